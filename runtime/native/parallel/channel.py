"""Rank 0 hands each step to the other ranks through the rendezvous store: message ``n`` under key ``step/n``.

The store waits cheaply while the engine is idle (a collective would time out), and it lives in rank 0's process, so
a worker whose rank 0 died gets an error from its next read and exits.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

# Messages kept in the store: the other ranks cannot lag rank 0 by more than the steps it has in flight (two), since
# each step's collectives wait for every rank.
KEPT_MESSAGES = 16
POLL = timedelta(seconds=30)


class StepChannel:
    """One direction, rank 0 to the others: ``send`` on rank 0, ``receive`` elsewhere, both in step order."""

    def __init__(self, store: dist.Store) -> None:
        self.store = dist.PrefixStore("step/", store)
        self.count = 0

    def send(self, message: bytes) -> None:
        self.store.set(str(self.count), message)
        if self.count >= KEPT_MESSAGES:
            self.store.delete_key(str(self.count - KEPT_MESSAGES))
        self.count += 1

    def receive(self) -> bytes:
        """The next message, waiting as long as it takes (rank 0 gone: the store raises)."""
        key = str(self.count)
        while True:
            try:
                self.store.wait([key], POLL)
                break
            except dist.DistStoreError as e:
                if "timeout" not in str(e).lower():
                    raise
        self.count += 1
        return self.store.get(key)
