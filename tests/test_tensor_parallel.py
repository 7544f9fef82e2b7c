"""Tensor-parallel engines on the CPU: rank 0 in this process, the other ranks worker processes it starts, their
collectives on gloo. A tp_size 2 engine gives the tokens the one-device engine gives, and fails loudly, not by hanging,
when a worker dies."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kiln.engines.native.builder import build_native_engine
from kiln.runtime import LLM, RuntimeOptions, SamplingParams
from kiln.runtime.errors import EngineClosedError, TensorParallelError
from kiln.runtime.native.parallel.group import Rendezvous
from kiln.runtime.native.parallel.launch import TensorParallelRanks
from kiln.runtime.native.parallel.step_batch import StepBatch
from kiln.runtime.native.parallel.worker import rank_key
from kiln.runtime.options import RuntimeOptionsError
from tests.model_factories import make_fp8_checkpoint, make_hf_checkpoint, tiny_plan
from tests.test_server_support import wait_until

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 17, 33, 8, 90, 41, 12], [3, 64, 9], [77, 21, 50, 50, 6, 31, 2, 88, 14, 19, 60, 7, 7, 40, 33, 12]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def engines(tmp_path, checkpoint, plan=None) -> dict[int, object]:
    """The one-device and the tp_size 2 engine of ``checkpoint``."""
    built = {}
    for tp_size in (1, 2):
        built[tp_size] = tmp_path / f"tp{tp_size}"
        built[tp_size].mkdir()
        build_native_engine(checkpoint, built[tp_size], plan or tiny_plan(), "float32", tp_size=tp_size)
    return built


def generated(engine, params: SamplingParams = GREEDY, prompts=PROMPTS) -> list:
    with LLM.load(engine) as llm:
        return llm.generate(prompts, params)


@pytest.mark.parametrize("config", [dict(num_heads=4, num_kv_heads=2), dict(num_heads=4, num_kv_heads=1, vocab_size=97),
                                    dict(family="gemma2", num_heads=4, num_kv_heads=2, sliding_window=6,
                                         attn_logit_softcapping=2.0, final_logit_softcapping=3.0)],
                         ids=["gqa", "fewer-kv-heads-than-ranks-odd-vocab", "gemma2-tied"])
def test_tp2_gives_the_tokens_and_log_probabilities_of_one_device(tmp_path, config):
    built = engines(tmp_path, make_hf_checkpoint(tmp_path / "checkpoint", 0, **config))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    one, two = generated(built[1], params), generated(built[2], params)
    assert [r.token_ids for r in two] == [r.token_ids for r in one]
    for a, b in zip(one, two, strict=True):
        assert [e.logprob for e in b.logprobs] == pytest.approx([e.logprob for e in a.logprobs], abs=1e-4)
        assert [e.logprob for e in b.prompt_logprobs if e] == pytest.approx(
            [e.logprob for e in a.prompt_logprobs if e], abs=1e-4)


def test_the_bundled_tiny_model_at_tp2_writes_what_it_writes_on_one_device(tmp_path):
    built = engines(tmp_path, REPO / "models" / "tiny-llama", tiny_plan(max_seq_len=128, max_input_len=64))
    prompts = ["Monday, Tuesday,", "The cat sat on the"]
    assert [r.token_ids for r in generated(built[2], prompts=prompts)] == \
        [r.token_ids for r in generated(built[1], prompts=prompts)]


@pytest.mark.parametrize("fmt", ["fp8", "int4_awq"])
def test_quantized_tp2_engines_give_the_tokens_of_one_device(tmp_path, fmt):
    from kiln.calibration.quantize import quantize_checkpoint
    from tests.calibration_factories import make_checkpoint, small_recipe

    # 4 heads of 64: each rank's half of the attention output and of the MLP holds whole INT4 groups of 128
    checkpoint = make_checkpoint(tmp_path / "hf", hidden=256, intermediate=512)
    kv = {"kv_cache_dtype": "fp8"} if fmt == "fp8" else {}
    quantize_checkpoint(checkpoint, small_recipe(format=fmt, **kv), tmp_path / "quantized")
    built = engines(tmp_path, tmp_path / "quantized" / "hf")
    assert [r.token_ids for r in generated(built[2])] == [r.token_ids for r in generated(built[1])]


def test_a_hand_written_fp8_checkpoint_with_an_fp8_kv_cache_splits_too(tmp_path):
    built = engines(tmp_path, make_fp8_checkpoint(tmp_path / "checkpoint", 0, fp8_kv_cache=True))
    assert [r.token_ids for r in generated(built[2])] == [r.token_ids for r in generated(built[1])]


@pytest.mark.slow
def test_preemption_prefix_reuse_and_structured_output_under_tp2_match_one_device(tmp_path):
    """A KV pool too small for the batch (preempted sequences recompute), prompts sharing a prefix (cached blocks
    reused on every rank) and a JSON-constrained request (rank 0's mask): the one-device engine's tokens."""
    from kiln.runtime import StructuredOutput

    built = engines(tmp_path, REPO / "models" / "tiny-llama", tiny_plan(max_seq_len=128, max_input_len=64))
    prompts = [f"Monday, Tuesday, Wednesday, Thursday, {day}" for day in ("Friday", "Saturday", "Sunday", "May")]
    prompts += ["The cat sat on the", "One, two, three,"]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * len(prompts)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params[0] = SamplingParams(temperature=0, max_tokens=40, structured_output=StructuredOutput(json=schema))
    outputs = {}
    for tp_size in (1, 2):
        with LLM.load(built[tp_size], RuntimeOptions(num_kv_blocks=32)) as llm:
            llm.generate(prompts[1:2], params[1:2])  # its prefix stays cached for the batch's first lookups
            outputs[tp_size] = llm.generate(prompts, params)
            preempted = sum(r.metrics.num_preemptions for r in outputs[tp_size])
            cached = sum(r.metrics.num_cached_tokens for r in outputs[tp_size])
        assert preempted and cached  # the pool is small enough to preempt, and the prefix is reused
    assert [r.token_ids for r in outputs[2]] == [r.token_ids for r in outputs[1]]


def test_abort_frees_a_request_and_the_engine_keeps_serving_through_the_stop_signals_that_rank_0_drains_on(tmp_path):
    make_hf_checkpoint(tmp_path / "checkpoint", 0)
    (tmp_path / "tp2").mkdir()
    build_native_engine(tmp_path / "checkpoint", tmp_path / "tp2", tiny_plan(), "float32", tp_size=2)
    with LLM.load(tmp_path / "tp2") as llm:
        phases = llm.stats()["load_phases_s"]  # before: weights and kv_pool alone, 10 % of a tp2 load
        assert list(phases)[:2] == ["ranks_joined", "other_ranks_loaded"] and sum(phases.values()) <= llm.load_ms / 1e3
        llm.submit(PROMPTS[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), request_id="long")
        time.sleep(0.2)
        llm.abort("long")
        assert llm.result("long", 60).finish_reason == "abort"
        for process in llm.engine.ranks.workers.processes.values():  # Ctrl-C to the group, torchrun's SIGTERM
            os.kill(process.pid, signal.SIGINT)
            os.kill(process.pid, signal.SIGTERM)
        assert len(llm.generate([PROMPTS[1]], GREEDY)[0].token_ids) == 10
        # the ranks of one host meet on loopback only: their store and gloo take no connection from the network
        ranks = [os.getpid(), *(p.pid for p in llm.engine.ranks.workers.processes.values())]
        addresses = {address for pid in ranks for address in listening_addresses(pid)}
        assert addresses and addresses <= {"0100007F", "00000000000000000000000001000000"}, addresses


def test_a_killed_worker_stops_the_engine_with_an_error_naming_it(tmp_path):
    make_hf_checkpoint(tmp_path / "checkpoint", 0)
    (tmp_path / "tp2").mkdir()
    build_native_engine(tmp_path / "checkpoint", tmp_path / "tp2", tiny_plan(), "float32", tp_size=2)
    with LLM.load(tmp_path / "tp2") as llm:
        worker = llm.engine.ranks.workers.processes[1]
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        wait_until(lambda: llm.engine_error is not None, timeout=30)  # noticed while idle: /health turns 503
        assert "worker rank 1" in (llm.engine_error or "")
        with pytest.raises(EngineClosedError, match=r"worker rank 1 \(pid \d+\) exited with code -9"):
            llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        assert time.monotonic() - start < 60  # aborted, not the collective timeout
        assert "TensorParallelError" in llm.engine_error


def test_waiting_for_the_workers_to_load_ends_at_once_when_a_worker_exits_and_names_it():
    ranks = TensorParallelRanks.__new__(TensorParallelRanks)  # its group's store, and a worker that has exited
    store = torch.distributed.HashStore()
    store.set_timeout(timedelta(seconds=5))  # before: the store's own wait, for its whole timeout (300 s in a group)
    ranks.group = SimpleNamespace(size=2, store=store)
    ranks.workers = SimpleNamespace(failure="tensor-parallel worker rank 1 (pid 7) exited with code 1")
    with pytest.raises(TensorParallelError, match=r"^tensor-parallel worker rank 1 \(pid 7\) exited with code 1 "
                                                  r"while the engine was loading$"):
        ranks.wait_for_workers_loaded()
    ranks.workers.failure = None
    store.set(rank_key("loaded", 1), "1")
    ranks.wait_for_workers_loaded()  # every rank has loaded


def test_a_rank_that_exits_before_saying_which_build_it_loads_stops_the_other_local_workers(tmp_path):
    (tmp_path / "engine.json").write_text("{}")
    ranks = TensorParallelRanks.__new__(TensorParallelRanks)
    ranks.group = SimpleNamespace(size=3, store=torch.distributed.HashStore())
    stopped = []
    ranks.workers = SimpleNamespace(failure="tensor-parallel worker rank 2 (pid 7) exited with code 1",
                                    stop=lambda kill: stopped.append(kill))
    with pytest.raises(TensorParallelError, match="rank 2"):
        ranks._check_same_build(tmp_path, 3)
    assert stopped == [True]  # before: rank 1 ran on until its own collective timeout


def _worker_pids(engine_dir: Path) -> list[int]:
    """The tensor-parallel workers serving ``engine_dir``, from their command lines."""
    pids = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"kiln.runtime.native.parallel.worker" in argv and str(engine_dir).encode() in argv:
                pids.append(int(proc.name))
    return pids


def test_a_worker_that_dies_under_an_idle_engine_process_stops_it(tmp_path):
    make_hf_checkpoint(tmp_path / "checkpoint", 0)
    (tmp_path / "tp2").mkdir()
    build_native_engine(tmp_path / "checkpoint", tmp_path / "tp2", tiny_plan(), "float32", tp_size=2)
    with LLM.load(tmp_path / "tp2", RuntimeOptions(engine_process=True)) as llm:
        (worker,) = _worker_pids(tmp_path / "tp2")
        os.kill(worker, signal.SIGKILL)
        wait_until(lambda: llm.engine_error is not None, timeout=30)  # rank 0's process stops: /health 503
        assert "EngineProcessError: the engine process" in (llm.engine_error or "")
        with pytest.raises(EngineClosedError):
            llm.generate(PROMPTS, GREEDY)


def test_a_worker_that_fails_to_load_its_shard_or_a_deferred_capture_is_refused_at_load(tmp_path):
    make_hf_checkpoint(tmp_path / "checkpoint", 0)
    (tmp_path / "tp2").mkdir()
    build_native_engine(tmp_path / "checkpoint", tmp_path / "tp2", tiny_plan(), "float32", tp_size=2)
    with pytest.raises(RuntimeOptionsError, match="cuda_graph_capture 'deferred' cannot run a tensor-parallel"):
        LLM.load(tmp_path / "tp2", RuntimeOptions(cuda_graph_capture="deferred"))  # refused before any worker starts
    (tmp_path / "tp2" / "rank1.safetensors").write_bytes(b"garbage")
    with pytest.raises(TensorParallelError, match=r"worker rank 1 \(pid \d+\) exited with code 1 \(.*rank1"
                                                  r".safetensors.*\) while the engine was loading"):
        LLM.load(tmp_path / "tp2")  # the worker's own error in rank 0's, for whatever reads only that


def test_a_worker_that_stored_its_error_is_waited_for_past_the_usual_wait():
    import threading

    stored = {rank_key("error", 1): b"EngineFormatError: rank1.safetensors: not a safetensors file"}
    store = SimpleNamespace(check=lambda keys: all(key in stored for key in keys), get=stored.__getitem__)
    workers = SimpleNamespace(failed=threading.Event(), failure=None)
    ranks = object.__new__(TensorParallelRanks)  # rank 0's side, as the engine's load sees it after a gloo error
    ranks.workers, ranks.group = workers, SimpleNamespace(size=2, store=store)

    def exit_late() -> None:  # a loaded host reaps the worker after the usual wait
        time.sleep(0.5)
        workers.failure = "tensor-parallel worker rank 1 (pid 7) exited with code 1"
        workers.failed.set()

    threading.Thread(target=exit_late).start()
    assert ranks.failure_after_error(timeout_s=0.1) == ("tensor-parallel worker rank 1 (pid 7) exited with code 1 "
                                                        "(EngineFormatError: rank1.safetensors: not a safetensors "
                                                        "file)")


def tp2_engine(tmp_path) -> Path:
    make_hf_checkpoint(tmp_path / "checkpoint", 0)
    (tmp_path / "tp2").mkdir()
    build_native_engine(tmp_path / "checkpoint", tmp_path / "tp2", tiny_plan(), "float32", tp_size=2)
    return tmp_path / "tp2"


def test_a_rank_zero_killed_while_its_engine_loads_leaves_no_worker_behind(tmp_path):
    import subprocess
    import sys

    engine = tp2_engine(tmp_path)
    loading = subprocess.Popen([sys.executable, "-c", f"from kiln.runtime import LLM; LLM.load({str(engine)!r})"],
                               cwd=REPO, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: _worker_pids(engine), timeout=60)
    finally:
        loading.kill()  # as an out-of-memory kill would, before the worker has joined
        loading.wait()
    wait_until(lambda: not _worker_pids(engine), timeout=30)  # gone with it, not minutes later


def test_a_load_interrupted_at_the_rendezvous_stops_at_once_and_the_process_exits(tmp_path):
    import subprocess
    import sys

    engine = tp2_engine(tmp_path)  # rank 0 waits at a rendezvous no worker comes to
    code = (f"from kiln.runtime import LLM, RuntimeOptions\ntry:\n    LLM.load({str(engine)!r}, "
            f"RuntimeOptions(tp_rendezvous='127.0.0.1:{free_port()}'))\nexcept KeyboardInterrupt:\n"
            "    print('interrupted', flush=True)")
    loading = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    time.sleep(3)
    loading.send_signal(signal.SIGINT)
    # a hang guard, under gloo's 300 s: neither the wait nor a thread left in it holds it
    out, _ = loading.communicate(timeout=180)
    assert out == "interrupted\n"


def test_ranks_that_load_different_builds_are_refused_naming_the_rank(tmp_path):
    import subprocess
    import sys

    ours = tp2_engine(tmp_path / "a")
    theirs = tp2_engine(tmp_path / "b")
    (theirs / "engine.json").write_text((theirs / "engine.json").read_text().replace('"float32"', '"float32" '))
    address = f"127.0.0.1:{free_port()}"
    worker = subprocess.Popen([sys.executable, "-m", "kiln.runtime.native.parallel.worker", str(theirs),
                               "--rendezvous", address, "--rank", "1", "--size", "2", "--local-rank", "0"], cwd=REPO,
                              stderr=subprocess.DEVNULL)  # a host given another copy
    try:
        with pytest.raises(TensorParallelError, match="rank 1 loads another build of this engine"):
            LLM.load(ours, RuntimeOptions(tp_rendezvous=address))
    finally:
        worker.kill()
        worker.wait()


def test_close_ends_a_step_that_waits_on_a_hung_worker(tmp_path):
    import threading

    llm = LLM.load(tp2_engine(tmp_path))
    worker = llm.engine.ranks.workers.processes[1]
    failures = []
    generating = threading.Thread(target=lambda: failures.append(pytest.raises(EngineClosedError, llm.generate,
                                                                               PROMPTS, GREEDY)))
    try:
        os.kill(worker.pid, signal.SIGSTOP)  # a hung rank: its collectives never answer
        generating.start()
        wait_until(lambda: llm.stats()["num_running"] > 0)  # its first step waits on the worker
        start = time.monotonic()
        llm.close()
        generating.join(30)
        assert time.monotonic() - start < 60 and failures  # not the 300 s collective timeout
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker.pid, signal.SIGKILL)


def test_step_batches_survive_the_wire_and_garbage_is_refused():
    batch = StepBatch([5, 6, 7, 0], [0, 1, 2, 9], [3, 1], [3, 10], [[4], [1, 2, 3]], [0, 1], [1], [(0, 2)])
    assert StepBatch.decode(batch.encode()) == batch
    empty = StepBatch([], [], [], [], [], [], [], [])
    assert StepBatch.decode(empty.encode()) == empty
    with pytest.raises(Exception, match="header says"):
        StepBatch.decode(batch.encode()[:-8])


def _listening_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net shows them) of sockets listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, _, hex_port = local.partition(":")
                if state == "0A" and int(hex_port, 16) == port:
                    found.add(address)
    return found


def test_a_rendezvous_on_loopback_listens_on_loopback_only():
    port = free_port()
    store = Rendezvous.parse(f"127.0.0.1:{port}", 0, 2).store()
    assert _listening_addresses(port) == {"0100007F"}  # 127.0.0.1, not every interface: the store trusts its peers
    del store
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port := free_port()))
        taken.listen()
        with pytest.raises(TensorParallelError, match="rank 0: cannot listen for the tensor-parallel rendezvous"):
            Rendezvous.parse(f"127.0.0.1:{port}", 0, 2).store()


def test_torchrun_rendezvous_comes_from_its_environment():
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "2"}
    # torchrun's agent may serve its own store at MASTER_PORT: Kiln's is the next port, unless KILN_TP_PORT says
    assert Rendezvous.from_environment(env) == Rendezvous("10.0.0.1", 29501, 1, 2)
    assert Rendezvous.parse("10.0.0.1:29501", 1, 2) == Rendezvous.from_environment(env)
    assert Rendezvous.from_environment({**env, "KILN_TP_PORT": "4000"}).port == 4000
    with pytest.raises(TensorParallelError, match="RANK, MASTER_PORT unset"):
        Rendezvous.from_environment({"MASTER_ADDR": "h", "WORLD_SIZE": "2"})
    for bad, words in (({"KILN_TP_PORT": "abc"}, "KILN_TP_PORT='abc' is not a whole number"),
                       ({"KILN_TP_PORT": "99999"}, "KILN_TP_PORT='99999': .* TCP port"),
                       ({"MASTER_PORT": "65535"}, "MASTER_PORT='65535': .* at MASTER_PORT \\+ 1")):
        with pytest.raises(TensorParallelError, match=words):
            Rendezvous.from_environment({**env, **bad})


@pytest.mark.slow
def test_torchrun_starts_kiln_serve_as_rank_zero_and_a_worker(tmp_path):
    """The launch across hosts, on one: torchrun starts `kiln serve ENGINE` twice; rank 0 serves, rank 1 works."""
    import json
    import subprocess
    import sys
    import urllib.request

    built = engines(tmp_path, make_hf_checkpoint(tmp_path / "checkpoint", 0))
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), "-m", "kiln", "serve", str(built[2]), "--port", str(port)]
    # Kiln's store on a port known to be free, not MASTER_PORT + 1, which nothing checked
    env = {**os.environ, "KILN_TP_PORT": str(free_port())}
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                              env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                models = json.load(urllib.request.urlopen(f"{url}/v1/models", timeout=1))
                break
            except OSError:
                if server.poll() is not None:  # the ranks' own error lines, then torchrun's summary
                    errors = server.stderr.read().decode()
                    pytest.fail("\n".join([line for line in errors.splitlines() if "error" in line.lower()][:10]
                                           + [errors[-1500:]]))
                time.sleep(0.2)
        body = {"model": models["data"][0]["id"], "prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0,
                "logprobs": 0, "ignore_eos": True}
        request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        choice = json.load(urllib.request.urlopen(request, timeout=60))["choices"][0]
        served = len(choice["logprobs"]["tokens"])
        assert served == 10 and choice["text"] == generated(built[1], prompts=[PROMPTS[0]])[0].text
    finally:
        with contextlib.suppress(ProcessLookupError):  # already gone: the assertion above says why
            os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp2_on_two_gpus_with_nccl_and_cuda_graphs_gives_the_tokens_of_one_gpu(tmp_path, dtype):
    """NCCL collectives inside the decode and prefill graphs, and overlapped steps feeding tokens across ranks."""
    checkpoint = make_hf_checkpoint(tmp_path / "checkpoint", 0, num_heads=4, num_kv_heads=2)
    built = {}
    for tp_size in (1, 2):
        built[tp_size] = tmp_path / f"tp{tp_size}"
        built[tp_size].mkdir()
        build_native_engine(checkpoint, built[tp_size], tiny_plan(), dtype, device="cuda", tp_size=tp_size)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    one, two = generated(built[1], params), generated(built[2], params)
    if dtype == "float32":
        assert [r.token_ids for r in two] == [r.token_ids for r in one]
    else:  # bf16 sums in another order: the first tokens agree, near-ties may part later
        assert [r.token_ids[:4] for r in two] == [r.token_ids[:4] for r in one]


def free_port() -> int:
    """A TCP port nobody listens on right now (for processes this test starts), below the kernel's ephemeral range:
    a port bind(0) handed out could be handed again to another test's server before the process binds it."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    below = int(ephemeral.read_text().split()[0]) if ephemeral.is_file() else 32768
    for port in random.Random().sample(range(10_000, below), 200):
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
    raise RuntimeError("no free TCP port below the ephemeral range")


def listening_addresses(pid: int) -> set[str]:
    """The local addresses (as /proc/net/tcp writes them) of the TCP sockets process ``pid`` listens on."""
    links = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):  # closed since the listing
            links.append(os.readlink(fd))
    inodes = {link[8:-1] for link in links if link.startswith("socket:[")}
    return {fields[1].split(":")[0] for table in ("tcp", "tcp6")
            for fields in (line.split() for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:])
            if fields[3] == "0A" and fields[9] in inodes}


def test_kiln_cache_ls_tells_a_tp2_engine_from_a_one_device_one(tmp_path):
    import json

    from typer.testing import CliRunner

    from kiln.pipeline.cli import app

    config = tmp_path / "tp2.yaml"
    config.write_text(f"model:\n  path: {REPO / 'models' / 'tiny-llama'}\n  dtype: float32\nquantize:\n"
                      f"  format: none\nbuild:\n  max_seq_len: 128\n  max_input_len: 64\n  tp_size: 2\n"
                      f"cache:\n  dir: {tmp_path / 'c'}\n")
    assert CliRunner().invoke(app, ["build", str(config), "--json"]).exit_code == 0
    listed = CliRunner().invoke(app, ["cache", "ls", "--cache-dir", str(tmp_path / "c"), "--json"])
    assert [row["gpu"] for row in json.loads(listed.stdout) if row["store"] == "entries"] == ["cpu x2"]


def test_rank_zero_under_torchrun_names_the_ranks_an_engine_of_one_device_cannot_run_on(tmp_path):
    from typer.testing import CliRunner

    from kiln.pipeline.cli import app
    from tests.test_server_support import tiny_engine

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
           "KILN_CACHE": str(tmp_path / "cache")}
    result = CliRunner().invoke(app, ["serve", str(tiny_engine()), "--port", "0"], env=env)
    assert result.exit_code != 0 and "an engine of tp_size 1 cannot run on 2 ranks" in result.stderr, result.stderr
    assert "tp_rendezvous" not in result.stderr  # before: an option the user never set, to leave unset


def test_a_torchrun_worker_stops_at_once_on_a_stop_signal_until_it_has_joined_rank_zero(monkeypatch, tmp_path):
    """Waiting for a rank 0 that failed (its port taken) or never started, SIGTERM stops the rank (it had been ignored
    until the rendezvous timed out); once joined, rank 0 stops it after draining."""
    import signal

    import kiln.runtime.native.parallel.worker as worker
    from kiln.pipeline.serve_command import serve_as_worker
    from kiln.runtime import RuntimeOptions
    from kiln.runtime.engine_process.lifetime import leave_stop_signals_to_parent
    from tests.test_server_support import tiny_engine

    seen = {}

    def run_worker(engine_dir, options, rendezvous, device, on_joined=None):
        seen["waiting"] = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
        seen["on_joined"] = on_joined
    monkeypatch.setattr(worker, "run_worker", run_worker)
    monkeypatch.setenv("KILN_CACHE", str(tmp_path))
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve_as_worker(str(tiny_engine()), RuntimeOptions(), Rendezvous("127.0.0.1", free_port(), 1, 2), 0)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    # the default: a Python handler would not run while joining blocks in C++ (it retries through the signal)
    assert seen == {"waiting": (signal.SIG_DFL, signal.SIG_DFL), "on_joined": leave_stop_signals_to_parent}
