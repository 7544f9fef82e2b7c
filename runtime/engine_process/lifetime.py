"""While it loads, the engine process dies with the thread that started it: a parent killed then (``kill -9``, an
out-of-memory kill) must not leave an orphan that goes on loading weights and holding the device. Once loaded, the
socket tells it that the parent has gone; one stuck in a step (a hung tensor-parallel worker) is killed, with its
workers, a few seconds after its parent has gone. It, and every tensor-parallel worker, leaves Ctrl-C and SIGTERM to
the process that serves, which drains and then stops them."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_POLL_S = 1.0
# how long a process whose parent has gone may take to end by itself (its socket or rank 0's store closed, it
# stops its workers) before it is killed: a healthy one takes well under a second
PARENT_GONE_GRACE_S = 5.0


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the thread that started it exits (Linux), and exit now when the parent
    ``parent_pid`` has already gone. Whatever this process is doing, ``PARENT_GONE_GRACE_S`` after the parent has
    gone it is killed, with its process group when it leads one (an engine process and its workers)."""
    threading.Thread(target=_kill_when_gone, args=(parent_pid,), daemon=True, name="kiln-parent-watch").start()
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent_pid:  # it died before the line above
        os._exit(0)


def _kill_when_gone(parent_pid: int) -> None:
    """Once ``parent_pid`` is no longer this process's parent, give it ``PARENT_GONE_GRACE_S`` to end by itself,
    then SIGKILL it, and its group's processes when it leads the group (a SIGSTOPped or hung worker included)."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    time.sleep(PARENT_GONE_GRACE_S)
    if os.getpgrp() == os.getpid():  # an engine process, in a session of its own: its workers are in its group
        os.killpg(os.getpid(), signal.SIGKILL)
    else:
        os.kill(os.getpid(), signal.SIGKILL)


def outlive_parent_thread() -> None:
    """Undo ``die_with_parent``'s death with the thread that started this process, once loaded: that thread may end
    while the engine serves (``LLM.load`` in a thread of its own); the socket, or the watch on the parent process,
    says when the parent itself has gone."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, 0)


def stop_at_once_on_stop_signals() -> None:
    """Let Ctrl-C and SIGTERM end this process at once, as by default: while it waits in a C++ call (joining a
    rendezvous, which retries through the signal) no Python handler would run."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def leave_stop_signals_to_parent() -> None:
    """Ignore Ctrl-C and SIGTERM (a terminal's group, torchrun forwarding it to every rank): the serving process
    drains its requests and then stops this one; stopped first, it would end the requests in flight."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
