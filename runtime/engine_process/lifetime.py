"""While it loads, the engine process dies with the thread that started it: a parent killed then (``kill -9``, an
out-of-memory kill) must not leave an orphan that goes on loading weights and holding the device. Once loaded, the
socket tells it that the parent has gone. It, and every tensor-parallel worker, leaves Ctrl-C and SIGTERM to the
process that serves, which drains and then stops them."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the thread that started it exits (Linux; elsewhere nothing), and exit now when the
    parent ``parent_pid`` has already gone."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent_pid:  # it died before the line above
        os._exit(0)


def outlive_parent_thread() -> None:
    """Undo ``die_with_parent`` once loaded: the thread that started this process may end while the engine serves
    (``LLM.load`` in a thread of its own), and the socket says when the parent itself has gone."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, 0)


def leave_stop_signals_to_parent() -> None:
    """Ignore Ctrl-C and SIGTERM (a terminal's group, torchrun forwarding it to every rank): the serving process
    drains its requests and then stops this one; stopped first, it would end the requests in flight."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
