"""The ranks of one tensor-parallel engine and their collectives, on ``torch.distributed`` process groups that this
object owns (no process-wide default group, so an embedder may hold several engines in one process).

Collectives on the model's tensors run on the device group: NCCL on CUDA (with NVLink multicast left off, as the
shared GPU hosts require), gloo on the CPU. Every collective has a timeout, so a rank that died ends the others'
wait with an error instead of a hang.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from kiln.runtime.errors import TensorParallelError
from kiln.runtime.options import is_ascii_number

# How long a collective may wait for the other ranks before the engine fails (covers a first step that compiles).
COLLECTIVE_TIMEOUT = timedelta(seconds=300)


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one engine meet: rank 0 serves a ``TCPStore`` at ``host:port``."""

    host: str
    port: int
    rank: int
    size: int
    # rank 0 only: a socket already listening on host:port for the store to serve on (torch's TCPStore otherwise
    # listens on every interface, whatever ``host`` says)
    listen_fd: int | None = field(default=None, compare=False)

    @classmethod
    def from_environment(cls, env: Mapping[str, str]) -> Rendezvous:
        """The rendezvous ``torchrun`` describes in a rank's environment (MASTER_ADDR, RANK, WORLD_SIZE): rank 0
        serves Kiln's store at KILN_TP_PORT, else at MASTER_PORT + 1 (torchrun's agent may hold MASTER_PORT)."""
        missing = [k for k in ("MASTER_ADDR", "RANK", "WORLD_SIZE") if k not in env]
        if "KILN_TP_PORT" not in env and "MASTER_PORT" not in env:
            missing.append("MASTER_PORT")
        if missing:
            raise TensorParallelError(f"no torchrun rendezvous in the environment: {', '.join(missing)} unset; "
                                      f"start the ranks with torchrun, or load the engine with LLM.load on one host")
        name = "KILN_TP_PORT" if "KILN_TP_PORT" in env else "MASTER_PORT"
        port = _number(env, name) + (name == "MASTER_PORT")
        if not 0 < port <= 65535:
            raise TensorParallelError(f"{name}={env[name]!r}: Kiln's store needs a TCP port (1-65535)"
                                      + (" at MASTER_PORT + 1" if name == "MASTER_PORT" else ""))
        return cls(env["MASTER_ADDR"], port, _number(env, "RANK"), _number(env, "WORLD_SIZE"))

    @classmethod
    def parse(cls, text: str, rank: int, size: int) -> Rendezvous:
        """Rank ``rank`` of ``size`` meeting at ``"HOST:PORT"``."""
        host, _, port = text.rpartition(":")
        return cls(host, int(port), rank, size)

    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def on_loopback(self) -> bool:
        """Whether the ranks meet on this host's loopback interface (workers started by ``LocalWorkers``)."""
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:  # a host name: no lookup (it may be slow, and torchrun's ranks name the master's host)
            return self.host == "localhost"

    def store(self, timeout: timedelta = COLLECTIVE_TIMEOUT) -> dist.TCPStore:
        """Rank 0 serves the store (on a loopback address, on that address only), the others connect to it (waiting
        up to ``timeout`` for it)."""
        try:
            return dist.TCPStore(self.host, self.port, self.size, self.rank == 0, timeout=timeout,
                                 wait_for_workers=False, master_listen_fd=self._listen_fd())
        except (RuntimeError, OSError) as e:
            verb = "cannot listen for" if self.rank == 0 else "cannot reach"
            raise TensorParallelError(f"rank {self.rank}: {verb} the tensor-parallel rendezvous at "
                                      f"{self.address()} ({e})") from None

    def _listen_fd(self) -> int | None:
        """Rank 0's listening socket for the store: the one given, else one bound to a loopback ``host`` (the store
        owns it); None lets the store listen on every interface, as a rendezvous across hosts needs."""
        if self.rank != 0 or self.listen_fd is not None or not self.on_loopback:
            return self.listen_fd
        listener = socket.create_server((self.host, self.port), family=socket.AF_INET6 if ":" in self.host
                                        else socket.AF_INET, backlog=128)
        return listener.detach()


class TensorParallelGroup:
    """Rank ``rank`` of ``size``: ``all_reduce``, ``all_gather`` and ``broadcast`` on the device group, ``store``
    (rank 0's) for the step channel."""

    def __init__(self, rendezvous: Rendezvous, device: torch.device,
                 timeout: timedelta = COLLECTIVE_TIMEOUT) -> None:
        self.rank, self.size, self.device = rendezvous.rank, rendezvous.size, torch.device(device)
        self.store = store = rendezvous.store(timeout)
        self.cpu_group = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", store), self.rank, self.size,
                                               _gloo_options(rendezvous, timeout))
        if self.device.type == "cuda":
            # NCCL reads its settings from the environment only: NVLink multicast stays off unless the user turned
            # it on (it can take shared GPU hosts down)
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.device_group = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), self.rank, self.size, options)
        else:
            self.device_group = self.cpu_group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        self.device_group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` side by side along the last dim (rank order)."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.device_group.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's device tensor ``x`` into every rank's ``x`` (same shape and dtype), in stream order."""
        self.device_group.broadcast(x, 0).wait()
        return x

    def min_over_ranks(self, value: int) -> int:
        """The smallest of the ranks' ``value`` (each rank's KV pool must hold the same blocks)."""
        x = torch.tensor([value], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.cpu_group.allreduce([x], options).wait()
        return int(x.item())

    def abort(self) -> None:
        """End every collective in progress with an error (a rank died)."""
        for group in {id(g): g for g in (self.device_group, self.cpu_group)}.values():
            group.abort()


def _gloo_options(rendezvous: Rendezvous, timeout: timedelta) -> dist.ProcessGroupGloo._Options:
    """Gloo's options: ranks that meet on loopback connect over it (gloo would otherwise listen on the interface
    this host's name resolves to, open to the network); others on the interface of this host's name."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=rendezvous.host) if rendezvous.on_loopback
                        else dist.ProcessGroupGloo.create_default_device()]
    return options


def _number(env: Mapping[str, str], name: str) -> int:
    """The whole number a rendezvous variable holds (ASCII digits), or a TensorParallelError naming it and who sets
    it: torchrun, or for KILN_TP_PORT the user."""
    if not is_ascii_number(env[name].strip()):
        fix = ("set it to a free TCP port on rank 0's host, or unset it for MASTER_PORT + 1" if name == "KILN_TP_PORT"
               else "torchrun sets it: start the ranks with torchrun, or set it to one")
        raise TensorParallelError(f"{name}={env[name]!r} is not a whole number; {fix}")
    return int(env[name])
