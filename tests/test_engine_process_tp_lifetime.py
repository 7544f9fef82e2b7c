"""No tensor-parallel worker outlives the engine process that is its rank 0 (`kiln serve`'s), even a hung one: not
when ``close`` kills the engine process, nor when the serving process itself is killed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from kiln.runtime import LLM, RuntimeOptions, SamplingParams
from tests.subprocess_env import REPO, repo_env
from tests.test_engine_process import _running
from tests.test_server_support import wait_until
from tests.test_tensor_parallel import _worker_pids, tp2_engine

PROMPT = [5, 17, 33, 8, 90, 41, 12]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def test_close_of_an_engine_process_stuck_on_a_stopped_worker_kills_the_worker_too(tmp_path, monkeypatch):
    monkeypatch.setattr("kiln.runtime.llm.STEP_GRACE_S", 0.5)
    engine = tp2_engine(tmp_path)
    llm = LLM.load(engine, RuntimeOptions(engine_process=True))
    (worker,) = _worker_pids(engine)
    try:
        os.kill(worker, signal.SIGSTOP)  # a hung rank: the step's collectives never meet
        llm.submit(PROMPT, GREEDY)
        wait_until(llm.engine.has_unfinished)
        time.sleep(0.2)  # the engine thread waits for the step's answer
        llm.close()  # the step is interrupted: the engine process is killed
        wait_until(lambda: not _running(worker), timeout=10)  # before: stopped for ever, orphaned
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)


SERVE = """import sys, time
from kiln.runtime import LLM, RuntimeOptions, SamplingParams
llm = LLM.load(sys.argv[1], RuntimeOptions(engine_process=True))
print(llm.engine_pid, flush=True)
sys.stdin.readline()
llm.submit([5, 17, 33], SamplingParams(max_tokens=10, ignore_eos=True))
time.sleep(120)
"""


def test_a_killed_server_takes_its_engine_process_and_a_stopped_worker_with_it(tmp_path):
    engine = tp2_engine(tmp_path)
    server = subprocess.Popen([sys.executable, "-c", SERVE, str(engine)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=REPO, env=repo_env())
    engine_pid = int(server.stdout.readline())
    (worker,) = _worker_pids(engine)
    try:
        os.kill(worker, signal.SIGSTOP)
        server.stdin.write("\n")
        server.stdin.flush()
        time.sleep(1)  # the engine process's step waits on the stopped worker
        server.kill()  # as an out-of-memory kill would
        server.wait()
        # before: the engine process sat in the step until gloo's 300 s timeout, the worker stopped for ever
        wait_until(lambda: not _running(engine_pid) and not _running(worker), timeout=20)
    finally:
        for pid in (engine_pid, worker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
