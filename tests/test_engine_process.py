"""The engine in a process of its own (``RuntimeOptions(engine_process=True)``, the default of `kiln serve`): the
embedded ``LLM`` keeps its semantics (outputs, streams, abort, limits, errors), the server its health and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kiln.runtime import LLM, RuntimeOptions, SamplingParams
from kiln.runtime.engine_process import ProcessEngine, proxy, wire
from kiln.runtime.errors import EngineClosedError, EngineProcessError
from kiln.runtime.limits import EngineLimits, RequestTooLongError
from kiln.runtime.llm import IDLE_WAKE_S
from kiln.runtime.outputs import RequestMetrics, RequestOutput, StreamDelta
from kiln.runtime.sequence import Sequence
from kiln.runtime.server import ServerSettings, ServerThread, create_app
from tests.subprocess_env import REPO, repo_env
from tests.test_server_support import engine_idle, tiny_engine, wait_until

PROMPTS = ["Once upon a time", [5, 6, 7, 8, 9]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def load_apart() -> LLM:
    return LLM.load(tiny_engine(), RuntimeOptions(device="cpu", engine_process=True))


@pytest.fixture(scope="module")
def llm():
    with load_apart() as llm:
        yield llm


def test_the_engine_runs_in_another_process_and_generates_what_the_thread_engine_does(llm):
    assert llm.engine_pid != os.getpid()
    with LLM.load(tiny_engine(), RuntimeOptions(device="cpu")) as here:
        expected = here.generate(PROMPTS, GREEDY)
    got = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.text for o in got] == [o.text for o in expected]
    assert llm.tokenizer.encode("Once upon a time") == here.tokenizer.encode("Once upon a time")
    assert llm.limits == here.limits


def test_streams_carry_every_token_and_closing_one_aborts_it_in_the_engine_process(llm):
    expected = llm.generate(PROMPTS, GREEDY)

    async def stream_both() -> dict[int, list[int]]:
        tokens: dict[int, list[int]] = {0: [], 1: []}
        async for batch in llm.stream_many(PROMPTS, GREEDY):
            for index, delta in batch:
                tokens[index] += delta.token_ids
        return tokens

    async def stop_early() -> str | None:
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        async with contextlib.aclosing(llm.stream("Once upon a time", long)) as stream:
            async for _ in stream:
                break
        return None

    assert asyncio.run(stream_both()) == {0: expected[0].token_ids, 1: expected[1].token_ids}
    asyncio.run(stop_early())
    wait_until(lambda: engine_idle(llm))  # the abort reached the child, which freed the request's blocks
    request_id = llm.submit("Once upon a time", SamplingParams(max_tokens=200, ignore_eos=True))
    llm.abort(request_id)
    assert llm.result(request_id, timeout=30).finish_reason == "abort"


def test_sampling_params_cross_the_pipe_unchanged():
    params = SamplingParams(logit_bias={5: 2.0}, allowed_token_ids=[5, 9], skip_special_tokens=False)
    crossed = wire.request_from_wire(json.loads(json.dumps(wire.request_to_wire(Sequence("r", [1, 2], params)))))
    assert crossed.params == params


def test_a_request_over_the_limits_is_refused_in_the_caller_as_with_the_thread_engine(llm):
    with pytest.raises(RequestTooLongError, match="max_input_len is 64"):
        llm.generate([[5] * 300], SamplingParams(max_tokens=2))
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids  # still serving


def test_metrics_cross_the_process_boundary(llm):
    with ServerThread(create_app(llm, tiny_engine(), ServerSettings(model_name="tiny"))) as server:
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        wait_until(lambda: engine_idle(llm))
        metrics = httpx.get(f"{server.url}/metrics").text
    assert "kiln_time_to_first_token_seconds_count 1.0" in metrics
    assert _value(metrics, "kiln_engine_steps_total") > 0
    assert _value(metrics, "kiln_engine_up") == 1 and _value(metrics, "kiln_running_requests") == 0
    assert _value(metrics, "kiln_kv_blocks_free") > 0
    assert _value(metrics, "kiln_engine_process_resident_memory_bytes") > 0  # the engine process's own
    assert _value(metrics, "kiln_engine_process_cpu_seconds_total") > 0 and _value(metrics, "process_cpu_seconds_total")


def test_stats_turn_idle_after_a_stream_that_stops_before_the_step_queued_ahead():
    # a stop string ends the stream while the child has already queued its next step: the parent waits for the
    # child's reply after that step, whose stats are idle, instead of keeping the busy ones until the next request
    with load_apart() as llm:
        assert llm.wait_until_warm(60)  # while warming up, the parent reads the child's replies anyway
        text = llm.generate(PROMPTS[:1], GREEDY)[0].text
        stop = SamplingParams(max_tokens=12, temperature=0.0, stop=[text[len(text) // 2:][:3]])

        async def stream() -> str | None:
            async for delta in llm.stream(PROMPTS[0], stop):
                reason = delta.finish_reason
            return reason

        for _ in range(2):  # each checked after a pause, once the child has long sent its reply
            assert llm.generate(PROMPTS[:1], stop)[0].finish_reason == "stop"
            time.sleep(0.3)
            wait_until(lambda: engine_idle(llm), timeout=5)
            assert asyncio.run(stream()) == "stop"
            time.sleep(0.3)
            wait_until(lambda: engine_idle(llm), timeout=5)


def _value(metrics: str, name: str) -> float:
    return float(next(line for line in metrics.splitlines() if line.startswith(f"{name} ")).split()[1])


def test_a_killed_engine_process_fails_its_waiters_and_the_server_reports_503():
    llm = load_apart()
    try:
        with ServerThread(create_app(llm, tiny_engine(), ServerSettings(model_name="tiny"))) as server:
            assert httpx.get(f"{server.url}/health").status_code == 200
            request_id = llm.submit("Once upon a time", SamplingParams(max_tokens=200, ignore_eos=True))
            os.kill(llm.engine_pid, signal.SIGKILL)
            with pytest.raises(EngineClosedError, match="killed by signal 9"):
                llm.result(request_id, timeout=30)
            health = httpx.get(f"{server.url}/health")
            assert health.status_code == 503 and "killed by signal 9" in health.json()["message"]
            metrics = httpx.get(f"{server.url}/metrics").text  # no stale engine figures: it is down
            assert _value(metrics, "kiln_engine_up") == 0 and "kiln_running_requests" not in metrics
            with pytest.raises(EngineClosedError):
                llm.generate(["again"], SamplingParams(max_tokens=2))
    finally:
        llm.close()


def test_abort_all_fails_the_requests_in_flight_and_the_engine_serves_on(llm):
    before = llm.stats()
    request_id = llm.submit("Once upon a time", SamplingParams(max_tokens=240, ignore_eos=True))
    prompt = len(llm.tokenizer.encode("Once upon a time"))  # the child's token counters reach the parent as it runs
    wait_until(lambda: llm.stats()["num_generated_tokens"] > before["num_generated_tokens"]
               and llm.stats()["num_prompt_tokens"] == before["num_prompt_tokens"] + prompt)
    assert llm.abort_all(EngineClosedError("draining")) == 1
    with pytest.raises(EngineClosedError, match="draining"):
        llm.result(request_id, timeout=30)
    assert llm.generate(PROMPTS[:1], GREEDY)[0].token_ids  # the engine's abort of it found no waiter: no error
    assert llm.engine_error is None


def test_abort_all_also_aborts_a_request_added_while_it_fails_the_others(llm, monkeypatch):
    fail_all, late = llm._fail_all, []

    def with_a_request_meanwhile(error, **kwargs):  # another thread submits as abort_all fails the others
        late.append(llm.submit("Once upon a time", SamplingParams(max_tokens=240, ignore_eos=True)))
        return fail_all(error, **kwargs)

    monkeypatch.setattr(llm, "_fail_all", with_a_request_meanwhile)
    generated = llm.stats()["num_generated_tokens"]
    assert llm.abort_all(EngineClosedError("draining")) == 1
    with pytest.raises(EngineClosedError, match="draining"):
        llm.result(late[0], timeout=30)
    wait_until(lambda: engine_idle(llm))
    assert llm.stats()["num_generated_tokens"] - generated < 240  # aborted in the engine too: not run to its end


def test_an_id_abort_all_failed_is_taken_until_its_abort_lands_and_then_serves_a_new_request(llm):
    old = SamplingParams(max_tokens=240, ignore_eos=True, temperature=0)

    def reused() -> bool:  # refused as in use until the abort lands
        try:
            llm.submit([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), request_id="job-1")
        except ValueError:
            return False
        return True

    async def abort_all_while_it_runs() -> None:
        deltas = llm.stream_many(["Once upon a time"], old, request_ids=["job-1"])
        (_, first), *_ = await anext(deltas)  # a token came back: job-1 runs in the engine
        os.kill(llm.engine_pid, signal.SIGSTOP)  # and stays there, far from its 240 tokens, until the abort lands
        try:
            assert not first.finished
            llm.abort_all(EngineClosedError("draining"))
            with pytest.raises(EngineClosedError):
                await anext(deltas)
            assert not reused()
        finally:
            os.kill(llm.engine_pid, signal.SIGCONT)

    asyncio.run(abort_all_while_it_runs())
    wait_until(reused)
    out = llm.result("job-1", timeout=30)  # its own output, not the aborted request's
    assert (out.finish_reason, out.prompt_token_ids, len(out.token_ids)) == ("length", [5, 6, 7], 3)


def test_close_kills_an_engine_process_whose_step_does_not_return(monkeypatch, caplog):
    monkeypatch.setattr("kiln.runtime.llm.STEP_GRACE_S", 0.5)
    caplog.set_level("INFO", logger="kiln.runtime")
    llm = load_apart()
    os.kill(llm.engine_pid, signal.SIGSTOP)  # a hung GPU: the step taking this request never answers
    request_id = llm.submit("Once upon a time", SamplingParams(max_tokens=240, ignore_eos=True))
    wait_until(llm.engine.has_unfinished)
    time.sleep(0.2)  # the engine thread is waiting for the step's answer
    started, engine = time.monotonic(), llm.engine
    llm.close()
    assert time.monotonic() - started < 15 and engine._process.returncode == -signal.SIGKILL
    with pytest.raises(EngineClosedError):
        llm.result(request_id, timeout=5)
    stopped = [r for r in caplog.records if r.getMessage().startswith("the engine thread stopped")]
    assert [r.levelname for r in stopped] == ["INFO"]  # the kill close made, not an error with a traceback


class _IdleEngine:
    """Never has work; its stats say how many objects the garbage collector has frozen in its process."""

    tokenizer = None
    limits = EngineLimits(max_input_len=8, max_seq_len=16, max_batch_size=4, max_num_tokens=32, vocab_size=16)

    def has_unfinished(self) -> bool:
        return False

    def warm_up_step(self) -> bool:
        return False

    def failure(self) -> None:
        return None

    def stats_snapshot(self) -> dict:
        return {"frozen_objects": gc.get_freeze_count(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}

    def close(self) -> None:
        return None


class _Greeting(_IdleEngine):
    """Logs a line as it loads."""

    def __init__(self) -> None:
        logging.getLogger("kiln.runtime").warning("hello from the engine process")


def test_an_engine_process_logs_as_the_parents_logging_configuration_file_says(tmp_path):
    log, config = tmp_path / "kiln.log", tmp_path / "logging.json"
    config.write_text(json.dumps({  # the root logger's alone: Kiln's loggers, made before it applies, stay enabled
        "version": 1,
        "formatters": {"json": {"format": '{"pid": %(process)d, "logger": "%(name)s", "message": "%(message)s"}'}},
        "handlers": {"file": {"class": "logging.FileHandler", "filename": str(log), "formatter": "json"}},
        "root": {"handlers": ["file"], "level": "INFO"}}))
    embed = ("import sys\nfrom kiln.runtime import LLM, logs\nfrom kiln.runtime.engine_process import ProcessEngine\n"
             "logs.apply_log_config(sys.argv[1])\n"
             "with LLM(ProcessEngine('tests.test_engine_process:_Greeting', {})) as llm:\n"
             "    print(llm.engine_pid, flush=True)\n")
    done = subprocess.run([sys.executable, "-c", embed, str(config)], capture_output=True, text=True, cwd=REPO,
                          env=repo_env(), timeout=60)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert {"pid": int(done.stdout), "logger": "kiln.runtime", "message": "hello from the engine process"} in lines
    assert "hello" not in done.stderr  # before: the engine process logged in Kiln's format on stderr, or not at all


def test_the_engine_process_exempts_its_startup_heap_from_the_garbage_collector():
    with LLM(ProcessEngine("tests.test_engine_process:_IdleEngine", {})) as llm:
        assert llm.stats()["frozen_objects"] > 1000  # modules and the engine: full collections skip them


def test_the_engine_process_lets_its_idle_openmp_threads_sleep_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with LLM(ProcessEngine("tests.test_engine_process:_IdleEngine", {})) as llm:
        assert llm.stats()["omp_wait_policy"] == "PASSIVE"  # spinning, they starved this process on a busy host
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    with LLM(ProcessEngine("tests.test_engine_process:_IdleEngine", {})) as llm:
        assert llm.stats()["omp_wait_policy"] == "ACTIVE"


class _LoggingEngine(_IdleEngine):
    """Logs a line of Kiln's at info and one at warning as it loads."""

    def __init__(self) -> None:
        logging.getLogger("kiln.runtime").info("loading apart")
        logging.getLogger("kiln.runtime").warning("loaded apart")


def test_the_engine_process_logs_from_the_parents_level_in_the_servers_format(capfd):
    logging.getLogger("kiln").setLevel(logging.INFO)  # as kiln serve --log-level info sets it (restored after)
    ProcessEngine("tests.test_engine_process:_LoggingEngine", {}).close()
    err = capfd.readouterr().err
    assert re.search(r"\d INFO kiln.runtime \[-\]: loading apart\n", err), err  # before: not shown at all
    assert re.search(r"\d WARNING kiln.runtime \[-\]: loaded apart\n", err), err  # before: the bare message
    logging.getLogger("kiln").setLevel(logging.NOTSET)  # an embedder who set no level: logging left as it is
    ProcessEngine("tests.test_engine_process:_LoggingEngine", {}).close()
    err = capfd.readouterr().err
    assert re.search(r"^loaded apart$", err, re.MULTILINE) and "loading apart" not in err, err  # as Python's default


def test_an_engine_process_that_dies_while_idle_is_an_engine_error_at_once():
    with LLM(ProcessEngine("tests.test_engine_process:_IdleEngine", {})) as llm:
        assert llm.engine_error is None
        os.kill(llm.engine.pid, signal.SIGKILL)
        wait_until(lambda: llm.engine_error is not None)
        assert re.search(r"EngineProcessError: the engine process \(pid \d+\) was killed by signal 9", llm.engine_error)
        with pytest.raises(EngineClosedError, match=r"^the engine stopped \(.*killed by signal 9.*close this LLM"):
            llm.generate([1, 2], SamplingParams(max_tokens=2))
        assert not llm.closed  # the caller has not closed it: the refusal does not say it has


class _StuckClosing(_IdleEngine):
    """Never finishes freeing itself."""

    def close(self) -> None:
        time.sleep(60)


def test_an_engine_process_that_does_not_exit_on_close_is_killed_and_said_so(monkeypatch, caplog):
    monkeypatch.setattr(proxy, "CLOSE_TIMEOUT_S", 0.5)
    engine = ProcessEngine("tests.test_engine_process:_StuckClosing", {})
    engine.close()
    assert engine._process.returncode == -signal.SIGKILL
    assert "did not exit within 0.5 s of close: killed" in caplog.text  # before: killed without a word


class _GoneEngine(_IdleEngine):
    """Its process is gone: adding a request is where the engine thread learns it."""

    def make_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> Sequence:
        return Sequence(request_id, prompt, params)

    def add_request(self, seq: Sequence) -> None:
        raise EngineProcessError("the engine process (pid 1) exited with code 1")


def test_an_engine_process_found_gone_by_an_add_stops_the_engine_for_every_waiter():
    with LLM(_GoneEngine()) as llm:
        with pytest.raises(EngineClosedError, match="exited with code 1"):  # not one bad request: the engine is down
            llm.generate([[1, 2]], SamplingParams(max_tokens=2))
        assert "exited with code 1" in llm.engine_error
        with pytest.raises(EngineClosedError):
            llm.check([1, 2])


class _BatchRecordingEngine(_IdleEngine):
    """Finishes every request it has at each step; its stats list the request ids of each step."""

    def __init__(self) -> None:
        self.waiting: list[Sequence] = []
        self.batches: list[list[str]] = []

    def make_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> Sequence:
        return Sequence(request_id, prompt, params)

    def add_request(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting)

    def step(self) -> list[StreamDelta]:
        finished, self.waiting = self.waiting, []
        self.batches.append([seq.request_id for seq in finished])
        return [StreamDelta(seq.request_id, "", [], finished=True, finish_reason="length",
                            output=RequestOutput(seq.request_id, seq.prompt_token_ids, "", [], "length",
                                                 RequestMetrics.from_sequence(seq))) for seq in finished]

    def stats_snapshot(self) -> dict:
        return {"batches": self.batches}


class _PausingQueue(queue.SimpleQueue):
    """A command queue whose every put is followed by a pause, as when the caller's thread is descheduled."""

    def put(self, item, block=True, timeout=None) -> None:
        super().put(item)
        time.sleep(0.1)


def test_the_requests_of_one_call_start_in_the_same_step_even_if_the_caller_pauses_between_them():
    with LLM(_BatchRecordingEngine()) as llm:
        llm._commands = _PausingQueue()  # before: the engine stepped between a call's requests, batching at random
        time.sleep(IDLE_WAKE_S + 0.2)  # the idle engine thread has left the first queue for this one
        outputs = llm.generate([[1, 2], [1, 2], [3]], SamplingParams(max_tokens=2))
        assert llm.engine.batches == [[output.request_id for output in outputs]]


def test_the_engine_process_takes_the_requests_added_between_two_steps_in_one_step():
    engine = ProcessEngine("tests.test_engine_process:_BatchRecordingEngine", {})
    try:
        seqs = [engine.make_request(request_id, [1, 2], SamplingParams(max_tokens=2)) for request_id in "ab"]
        engine.add_request(seqs[0])
        time.sleep(0.2)  # before: the first add was its own message, and the child stepped on it alone
        engine.add_request(seqs[1])
        while engine.has_unfinished():
            engine.step()
        assert engine.stats_snapshot()["batches"] == [["a", "b"]]
    finally:
        engine.close()


class _WarmingEngine(_IdleEngine):
    """Has three pieces of deferred warm-up; its stats count the calls."""

    def __init__(self) -> None:
        self.warm_up_calls = 0

    def warm_up_step(self) -> bool:
        self.warm_up_calls += 1
        return self.warm_up_calls < 3

    def stats_snapshot(self) -> dict:
        return {"warm_up_calls": self.warm_up_calls}


@pytest.mark.parametrize("apart", [False, True], ids=["thread", "engine_process"])
def test_the_deferred_warm_up_runs_while_idle_until_done_and_can_be_waited_for(apart):
    engine = ProcessEngine("tests.test_engine_process:_WarmingEngine", {}) if apart else _WarmingEngine()
    with LLM(engine) as llm:
        assert llm.wait_until_warm(timeout=30)
        assert llm.stats()["warm_up_calls"] == 3  # and no more once it said it was done
    with pytest.raises(EngineClosedError):
        llm.wait_until_warm(timeout=0)


def test_an_engine_process_whose_parent_dies_while_it_loads_dies_too():
    # the socket stays open (this test holds both ends), so only the death of the parent can stop the child, which
    # would otherwise wait for its factory (or load the weights) forever
    ours, theirs = socket.socketpair()
    spawn = ("import os, subprocess, sys; child = subprocess.Popen([sys.executable, '-m', "
             "'kiln.runtime.engine_process', sys.argv[1], str(os.getpid()), '0', ''], pass_fds=[int(sys.argv[1])]); "
             "print(child.pid, flush=True); child.wait()")
    with ours, theirs:
        parent = subprocess.Popen([sys.executable, "-c", spawn, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                  stdout=subprocess.PIPE, text=True, cwd=REPO, env=repo_env())
        child = int(parent.stdout.readline())
        parent.kill()
        parent.wait()
        wait_until(lambda: not _running(child), timeout=30)


def test_an_engine_process_exits_with_its_parent_even_while_a_fork_of_the_parent_lives():
    embed = ("import os, time\nfrom kiln.runtime import LLM\nfrom kiln.runtime.engine_process import ProcessEngine\n"
             "llm = LLM(ProcessEngine('tests.test_engine_process:_IdleEngine', {}))\nfork = os.fork()\n"
             "if fork == 0:\n    time.sleep(60)\n    os._exit(0)\nprint(llm.engine_pid, fork, flush=True)\n"
             "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", embed], stdout=subprocess.PIPE, text=True, cwd=REPO,
                              env=repo_env())
    engine, fork = (int(pid) for pid in parent.stdout.readline().split())
    try:
        parent.kill()  # as an out-of-memory kill would
        parent.wait()
        wait_until(lambda: not _running(engine), timeout=20)  # before: alive until the fork exited (its socket copy)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(fork, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_a_command_larger_than_the_pipe_while_results_pour_in_does_not_deadlock_the_two_processes(llm):
    # each full pipe once blocked its writer: the parent sending a 2 MB request, the child its results
    flood = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, logprobs=20)
    ids = [llm.submit("Once upon a time", flood) for _ in range(4)]
    big = llm.submit([5, 6], SamplingParams(max_tokens=2, temperature=0.0, stop_token_ids=[7] * 300_000))
    assert len(llm.result(big, timeout=60).token_ids) <= 2
    assert all(llm.result(request_id, timeout=60).finish_reason == "length" for request_id in ids)
