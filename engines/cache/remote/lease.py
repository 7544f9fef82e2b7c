"""One builder per key across machines: a lease object the builder creates (only if absent) and refreshes.

Another machine that finds the lease waits for the entry's manifest instead of building too; a lease not refreshed
for ``stale_s`` (its builder died) is taken over: judged by the store's clock against the lease's time, or, whatever
the clocks say (a file share whose server's clock runs ahead or behind), once the waiter has seen the same lease
unchanged for ``stale_s`` by its own clock. Either way only after it has seen it unchanged for two refresh periods,
so that a live builder whose clock runs behind keeps its lease. The lease only saves duplicate work: publishing
stays correct without it, so a store that cannot write conditionally, or a lost race on a stale lease, costs a
second build at worst."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Literal

from kiln.engines.cache.remote.layout import lease_name, manifest_name
from kiln.engines.cache.remote.objects import ObjectInfo, ObjectStore, RemoteUnavailableError

LeaseOutcome = Literal["held", "published", "unavailable"]


@dataclass(frozen=True)
class LeaseTiming:
    """How often a waiter looks again, a holder refreshes its lease, and when an unrefreshed lease is stale."""

    poll_s: float = 2.0
    refresh_s: float = 10.0
    stale_s: float = 60.0
    tell_every_s: float = 30.0


@contextmanager
def build_lease(objects: ObjectStore, store: str, key: str, *, timing: LeaseTiming,
                on_wait: Callable[[str], None] | None, failed: Callable[[RemoteUnavailableError], None],
                replacing: bool = False, damaged: bool = False) -> Iterator[LeaseOutcome]:
    """Hold the remote build lease of ``key`` while the body builds: ``held``; ``published`` when another machine
    published the entry meanwhile (pull it instead; never when ``replacing`` it, a forced build; when the copy there
    was found ``damaged``, once another machine has published a new one); ``unavailable`` when the remote could not
    be asked (``failed`` hears why; build anyway)."""
    name = lease_name(store, key)
    body = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}).encode()
    try:
        outcome = _acquire(objects, store, key, name, body, timing, on_wait, replacing, damaged)
    except RemoteUnavailableError as exc:
        failed(exc)
        outcome = "unavailable"
    if outcome != "held":
        yield outcome
        return
    stop = threading.Event()
    refresher = threading.Thread(target=_refresh, args=(objects, name, body, timing, stop), daemon=True,
                                 name=f"kiln-lease-{key[:8]}")
    refresher.start()
    try:
        yield "held"
    finally:
        stop.set()
        refresher.join()
        with suppress(RemoteUnavailableError):  # else it goes stale and is taken over
            objects.delete(name)


def _acquire(objects: ObjectStore, store: str, key: str, name: str, body: bytes, timing: LeaseTiming,
             on_wait: Callable[[str], None] | None, replacing: bool, damaged: bool) -> LeaseOutcome:
    started, told = time.monotonic(), None
    first_seen: dict[tuple, float] = {}  # each version of the lease: when this waiter first saw it
    refused = objects.stat(manifest_name(store, key)) if damaged else None  # the copy found damaged
    while True:
        manifest = objects.stat(manifest_name(store, key))
        if not replacing and manifest is not None and (refused is None or _replaced(manifest, refused)):
            return "published"
        if objects.write(name, body, if_absent=True):
            return "held"
        lease = objects.stat(name)
        if lease is None:
            continue  # released between the two calls
        unchanged_s = time.monotonic() - first_seen.setdefault((lease.etag, lease.modified), time.monotonic())
        stale = objects.now() - lease.modified > timing.stale_s or unchanged_s > timing.stale_s
        if stale and unchanged_s >= 2 * timing.refresh_s and objects.write(name, body, if_tag=lease.etag):
            return "held"
        if on_wait is not None and (told is None or time.monotonic() - told >= timing.tell_every_s):
            holder = _holder(objects.read(name))
            waited = f" ({time.monotonic() - started:.0f} s so far)" if told is not None else ""
            on_wait(f"{holder} is building {store} {key[:12]} for the remote cache; waiting for it{waited}")
            told = time.monotonic()
        time.sleep(timing.poll_s)


def _replaced(now: ObjectInfo, before: ObjectInfo) -> bool:
    return (now.etag, now.modified) != (before.etag, before.modified)


def _holder(data: bytes | None) -> str:
    try:
        lease = json.loads(data or b"")
        return f"{lease['host']} (pid {lease['pid']})"
    except (ValueError, KeyError, TypeError):
        return "another machine"


def _refresh(objects: ObjectStore, name: str, body: bytes, timing: LeaseTiming, stop: threading.Event) -> None:
    while not stop.wait(timing.refresh_s):
        try:
            objects.write(name, body)
        except RemoteUnavailableError:
            continue  # the next refresh may get through; a lease that goes stale costs a duplicate build at worst
