"""Decode and prefill CUDA graphs: the padded static-buffer forwards against the eager reference (on CPU through
triton's interpreter, ``capture=False``), bucket choice, the switches; captured graphs on a CUDA GPU (``-m gpu``)."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

pytest.importorskip("triton")

from kiln.engines.native.builder import build_native_engine  # noqa: E402
from kiln.runtime import LLM, SamplingParams  # noqa: E402
from kiln.runtime.native.cuda_graphs import GraphSet  # noqa: E402
from kiln.runtime.native.decode_graphs import DecodeGraphRunner, decode_batch_sizes  # noqa: E402
from kiln.runtime.native.engine_format import EngineConfig  # noqa: E402
from kiln.runtime.native.kernels import kv_store, paged_attention  # noqa: E402
from kiln.runtime.native.layers import attention  # noqa: E402
from kiln.runtime.native.model_runner import ModelRunner  # noqa: E402
from kiln.runtime.native.prefill_graphs import PrefillGraphRunner, prefill_token_buckets  # noqa: E402
from kiln.runtime.options import RuntimeOptions  # noqa: E402
from tests.model_factories import PagedRunner, make_hf_checkpoint, tiny_plan  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_BATCH, MAX_SEQ_LEN, BLOCK = 8, 64, 4
BLOCKS_PER_SEQ = MAX_SEQ_LEN // BLOCK
PROMPT_LENS = [5, 13, 2, 9, 20]


@pytest.fixture
def device(kernel_device: str) -> torch.device:
    return torch.device(kernel_device)


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    make_hf_checkpoint(root / "checkpoint", seed=0)
    (root / "engine").mkdir()
    build_native_engine(root / "checkpoint", root / "engine",
                        tiny_plan(max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ_LEN, tokens_per_block=BLOCK),
                        "float32", device="cuda" if torch.cuda.is_available() else "cpu")
    return root / "engine"


@contextlib.contextmanager
def triton_attention_on(device: torch.device):
    """Route PagedAttention through the Triton kernels, as the default options do on CUDA; on CPU by pointing its
    reference functions at the interpreted kernels (the rest of the model stays on the PyTorch path)."""
    if device.type == "cuda":
        yield
        return
    with (mock.patch.object(attention, "store_kv", kv_store.store_kv),
          mock.patch.object(attention, "paged_attention_reference", paged_attention.paged_attention)):
        yield


def record_runs(graphs: DecodeGraphRunner | PrefillGraphRunner, device: torch.device) -> list[int]:
    """Make ``graphs.run`` take the Triton attention and record the token count of every call in the list
    returned."""
    counts = []

    def run(token_ids, *args, run=graphs.run):
        counts.append(len(token_ids))
        with triton_attention_on(device):
            return run(token_ids, *args)

    graphs.run = run
    return counts


def load_runner(engine_dir, device: torch.device, num_seqs: int, **options) -> ModelRunner:
    """A ModelRunner whose pool has an unused block 0 (what padding rows read) and a spare last block."""
    return ModelRunner(engine_dir, EngineConfig.load(engine_dir), device,
                       RuntimeOptions(num_kv_blocks=2 + num_seqs * BLOCKS_PER_SEQ, **options))


def block_tables(num_seqs: int) -> list[list[int]]:
    return [list(range(1 + i * BLOCKS_PER_SEQ, 1 + (i + 1) * BLOCKS_PER_SEQ)) for i in range(num_seqs)]


def eager_logits(runner: ModelRunner, kv_caches, new_tokens: list[list[int]], seq_lens: list[int]) -> torch.Tensor:
    """Last-token logits of one step on the eager reference path, over ``kv_caches`` with ``block_tables``."""
    return PagedRunner(runner.model, runner.config, len(seq_lens), runner.device, kv_caches).step(new_tokens, seq_lens)


@torch.inference_mode()
def graph_logits(graphs: DecodeGraphRunner, tokens: list[int], seq_lens: list[int]) -> torch.Tensor:
    return graphs.run(tokens, [s - 1 for s in seq_lens], seq_lens, block_tables(len(tokens))).clone()


@pytest.mark.parametrize("num_seqs", [1, 3, 5])
def test_padded_decode_matches_eager_reference_and_leaves_other_blocks_untouched(engine_dir, device, num_seqs):
    runner = load_runner(engine_dir, device, num_seqs)
    generator = torch.Generator().manual_seed(num_seqs)
    prompts = [torch.randint(3, 96, (n,), generator=generator).tolist() for n in PROMPT_LENS[:num_seqs]]
    seq_lens = [len(p) for p in prompts]
    logits = eager_logits(runner, runner.kv_caches, prompts, seq_lens)
    graph_caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    with triton_attention_on(device):
        graphs = DecodeGraphRunner(runner.model, graph_caches, runner.config, device,
                                   batch_sizes=decode_batch_sizes(MAX_BATCH), capture=device.type == "cuda")
    assert graphs.bucket(num_seqs) == {1: 1, 3: 4, 5: 8}[num_seqs]
    tol = {"rtol": 1e-4, "atol": 1e-4} if device.type == "cpu" else {"rtol": 2e-3, "atol": 2e-3}
    for _ in range(3):
        tokens = logits.argmax(-1).tolist()
        seq_lens = [n + 1 for n in seq_lens]
        logits = eager_logits(runner, runner.kv_caches, [[t] for t in tokens], seq_lens)
        with triton_attention_on(device):
            got = graph_logits(graphs, tokens, seq_lens)
        assert got.shape == logits.shape
        torch.testing.assert_close(got, logits, **tol)
        assert got.argmax(-1).tolist() == logits.argmax(-1).tolist()
    if graphs.graphs is not None:  # the first step of a bucket captured it; the idle captures of the others
        assert sorted(graphs.graphs.graphs) == [graphs.bucket(num_seqs)]  # warm up on padding: no KV written
        graphs.graphs.capture_all()
    for (k, v), (gk, gv) in zip(runner.kv_caches, graph_caches, strict=True):
        torch.testing.assert_close(gk, k, **tol)  # padding rows stored nothing anywhere
        torch.testing.assert_close(gv, v, **tol)
        for cache in (gk, gv):
            assert not cache[0].any() and not cache[-1].any()  # block 0 (read by padding), the spare last block



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs a CUDA GPU with programmatic dependent launch (compute capability 9.0+)")
def test_programmatic_dependent_launch_changes_no_logit_of_a_captured_decode(engine_dir):
    # Each kernel waits for the previous one before touching memory: a missing wait would read stale inputs.
    device = torch.device("cuda")
    prompts = [torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in PROMPT_LENS]
    runs = {}
    for pdl in (True, False):
        runner = load_runner(engine_dir, device, 5, pdl=pdl, cuda_graphs=False)
        first = eager_logits(runner, runner.kv_caches, prompts, [len(p) for p in prompts]).argmax(-1).tolist()
        caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        with triton_attention_on(device):
            graphs = DecodeGraphRunner(runner.model, caches, runner.config, device, batch_sizes=(8,))
            tokens, seq_lens, steps = first, [len(p) + 1 for p in prompts], []
            for _ in range(4):
                steps.append(graph_logits(graphs, tokens, seq_lens))
                tokens, seq_lens = steps[-1].argmax(-1).tolist(), [n + 1 for n in seq_lens]
        runs[pdl] = torch.stack(steps)
    assert torch.equal(runs[True], runs[False])

def test_buckets_double_to_128_then_step_by_quarters_and_a_step_takes_the_smallest_that_fits(engine_dir):
    assert decode_batch_sizes(8) == (1, 2, 4, 8)
    assert decode_batch_sizes(6) == (1, 2, 4, 6)
    assert decode_batch_sizes(1) == (1,)
    assert decode_batch_sizes(128) == (1, 2, 4, 8, 16, 32, 64, 128)
    # past 128, steps of a quarter of the power of two below; 448 measured slower than 512
    assert decode_batch_sizes(512)[7:] == (128, 160, 192, 224, 256, 320, 384, 512)
    assert decode_batch_sizes(440)[-3:] == (320, 384, 440)
    assert decode_batch_sizes(2100)[14:] == (512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 2100)
    assert decode_batch_sizes(1025)[-3:] == (896, 1024, 1025)
    graphs = DecodeGraphRunner(load_runner(engine_dir, torch.device("cpu"), 1).model, [], EngineConfig.load(engine_dir),
                               torch.device("cpu"), capture=False)
    assert graphs.batch_sizes == (1, 2, 4, 8)
    assert [graphs.bucket(n) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    with pytest.raises(ValueError, match="largest decode graph bucket"):
        graphs.bucket(9)
    assert graphs.fits([1, 1, 1]) and graphs.fits([1] * 8)
    assert not graphs.fits([]) and not graphs.fits([1, 2]) and not graphs.fits([1] * 9)


def test_staging_rewrites_only_changed_block_table_rows_and_keeps_padding_on_block_0(engine_dir):
    graphs = DecodeGraphRunner(None, [], EngineConfig.load(engine_dir), torch.device("cpu"), capture=False)
    block = graphs.block_size
    first, second, third = [5, 6], [7], [8, 9, 10]

    def stage(tables: list[list[int]]) -> list[list[int]]:
        n = len(tables)
        positions = [len(t) * block - 1 for t in tables]
        graphs._stage([1] * n, positions, [p + 1 for p in positions], tables, graphs.bucket(n))
        slots = graphs.slot_mapping[:graphs.bucket(n)].tolist()
        assert slots[:n] == [t[-1] * block + block - 1 for t in tables] and set(slots[n:]) <= {-1}
        assert graphs.block_tables[n:graphs.bucket(n), 0].eq(0).all()  # padding reads block 0
        return [graphs.block_tables[i, :len(t)].tolist() for i, t in enumerate(tables)]

    assert stage([first, second, third]) == [first, second, third]
    first.append(11)  # a table grows in place; row 1 now holds another sequence's (new) list, row 2 is padding
    assert stage([first, third]) == [first, third]
    assert stage([[12], first, [13, 14]]) == [[12], first, [13, 14]]


# (cached tokens, new tokens) of single-sequence prefill steps: a prompt in the smallest bucket, one that fills a
# bucket exactly, one padded to the largest, and the rest of a prompt after a prefix-cache hit.
PREFILL_STEPS = [(0, 5), (0, 16), (0, 27), (9, 14)]


@pytest.mark.parametrize(("cached", "new"), PREFILL_STEPS)
def test_padded_prefill_matches_eager_reference_and_stores_only_its_tokens(engine_dir, device, cached, new):
    runner = load_runner(engine_dir, device, 1)
    tokens = torch.randint(3, 96, (cached + new,), generator=torch.Generator().manual_seed(new)).tolist()
    if cached:  # the cached prefix is already stored, as a prefix-cache hit finds it
        eager_logits(runner, runner.kv_caches, [tokens[:cached]], [cached])
    graph_caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    expected = eager_logits(runner, runner.kv_caches, [tokens[cached:]], [cached + new])
    with triton_attention_on(device):
        graphs = PrefillGraphRunner(runner.model, graph_caches, runner.config, device, token_buckets=(8, 16, 32),
                                    capture=device.type == "cuda")
        got = graphs.run(tokens[cached:], list(range(cached, cached + new)), cached + new, block_tables(1)[0]).clone()
        if graphs.graphs is not None:  # captured by that step; the idle captures of the others store nothing
            assert sorted(graphs.graphs.graphs) == [(graphs.bucket(new), cached == 0)]
            graphs.graphs.capture_all()
            again = graphs.run(tokens[cached:], list(range(cached, cached + new)), cached + new,
                               block_tables(1)[0])
            torch.testing.assert_close(again, got, rtol=2e-3, atol=2e-3)  # its replay: the same K/V again
    assert graphs.bucket(new) == {5: 8, 16: 16, 27: 32, 14: 16}[new]
    tol = {"rtol": 1e-4, "atol": 1e-4} if device.type == "cpu" else {"rtol": 2e-3, "atol": 2e-3}
    assert got.shape == expected.shape == (1, runner.config.architecture.vocab_size)
    torch.testing.assert_close(got, expected, **tol)
    for (k, v), (gk, gv) in zip(runner.kv_caches, graph_caches, strict=True):
        torch.testing.assert_close(gk, k, **tol)  # the sequence's tokens stored; padding stored nothing anywhere
        torch.testing.assert_close(gv, v, **tol)
        for cache in (gk, gv):
            assert not cache[0].any() and not cache[-1].any()


def test_prefill_buckets_double_up_to_the_plan_token_budget_and_serve_one_sequence(engine_dir):
    assert prefill_token_buckets(8192) == (64, 128, 256, 512, 1024, 2048)
    assert prefill_token_buckets(100) == (64, 100)
    assert prefill_token_buckets(64) == (64,) and prefill_token_buckets(10) == (10,)
    graphs = PrefillGraphRunner(load_runner(engine_dir, torch.device("cpu"), 1).model, [],
                                EngineConfig.load(engine_dir), torch.device("cpu"), capture=False)
    assert graphs.token_buckets == (64,)  # the tiny plan's max_num_tokens
    assert graphs.fits([2]) and graphs.fits([64])
    assert not graphs.fits([1]) and not graphs.fits([65]) and not graphs.fits([3, 3]) and not graphs.fits([])
    with pytest.raises(ValueError, match="largest prefill graph bucket"):
        graphs.bucket(65)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter runs without CUDA")
def test_model_runner_routes_single_sequence_prefills_through_the_padded_buffers(engine_dir):
    device = torch.device("cpu")
    with LLM.load(engine_dir, RuntimeOptions(device="cpu")) as llm:
        expected = [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    with LLM.load(engine_dir, RuntimeOptions(device="cpu")) as llm:  # a fresh prefix cache: each prompt prefills whole
        runner = llm.engine.model_runner
        graphs = PrefillGraphRunner(runner.model, runner.kv_caches, runner.config, device, capture=False)
        token_counts = record_runs(graphs, device)
        runner.prefill_graphs = graphs
        assert [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS] == expected
    assert token_counts == [len(p) for p in PROMPTS]  # the prefills only; decodes stayed eager


def test_cuda_graphs_are_on_by_default_and_never_on_cpu(engine_dir):
    assert RuntimeOptions().captures_cuda_graphs and not RuntimeOptions(cuda_graphs=False).captures_cuda_graphs
    assert not RuntimeOptions(kernels="torch").captures_cuda_graphs  # the reference attention cannot be captured
    runner = load_runner(engine_dir, torch.device("cpu"), 1)
    assert runner.decode_graphs is None and runner.prefill_graphs is None


def test_programmatic_dependent_launch_is_on_for_small_cuda_launches_unless_turned_off(monkeypatch):
    from kiln.runtime.native.kernels import device_limits, pdl

    monkeypatch.setattr(device_limits, "supports_pdl", lambda device: True)
    cuda_looking = mock.Mock(is_cuda=True, device=torch.device("cuda", 0), shape=(pdl.PDL_MAX_TOKENS, 64))
    assert pdl.pdl_options(cuda_looking) == {"PDL": True, "launch_pdl": True}
    assert pdl.pdl_options(mock.Mock(is_cuda=True, device=cuda_looking.device, shape=(pdl.PDL_MAX_TOKENS + 1, 64))) \
        == {"PDL": False, "launch_pdl": False}  # larger batches: long kernels, where it costs more than it saves
    assert pdl.pdl_options(torch.zeros(1)) == {"PDL": False, "launch_pdl": False}  # the interpreter
    assert pdl.pdl_options(cuda_looking, enabled=False) == {"PDL": False, "launch_pdl": False}  # RuntimeOptions.pdl


PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19], [30, 31, 32, 33, 34]]
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter runs without CUDA")
def test_model_runner_routes_pure_decode_steps_through_the_padded_buffers(engine_dir):
    device = torch.device("cpu")
    with LLM.load(engine_dir, RuntimeOptions(device="cpu")) as llm:
        expected = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        runner = llm.engine.model_runner
        graphs = DecodeGraphRunner(runner.model, runner.kv_caches, runner.config, device, capture=False)
        batch_sizes = record_runs(graphs, device)
        runner.decode_graphs = graphs
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert batch_sizes and set(batch_sizes) <= {1, 2, 3}  # decodes only; prefills stayed eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_llm_with_cuda_graphs_serves_the_tokens_of_the_torch_reference_path(engine_dir):
    prompts = PROMPTS + [list(range(40, 40 + n)) for n in (2, 7, 11, 4, 16)]  # 8 requests: buckets up to 8
    with LLM.load(engine_dir, RuntimeOptions(device="cuda", kernels="torch")) as llm:
        assert llm.engine.model_runner.decode_graphs is None
        expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    for capture in ("deferred", "at_load"):
        with LLM.load(engine_dir, RuntimeOptions(device="cuda", cuda_graph_capture=capture)) as llm:
            runner = llm.engine.model_runner
            assert ("decode_graphs" in llm.stats()["load_phases_s"]) == (capture == "at_load")
            # deferred: the steps capture what they need first, the idle engine the rest
            assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
            assert llm.wait_until_warm(timeout=120)
            assert sorted(runner.decode_graphs.graphs.graphs) == [1, 2, 4, 8]
            assert sorted(runner.prefill_graphs.graphs.graphs) == [(64, False), (64, True)]
            assert llm.stats()["cuda_graphs"]["captured"] == 6 and llm.stats()["cuda_graphs"]["pending"] == 0
            assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
            assert [o.token_ids for o in llm.generate(prompts[:3], GREEDY)] == expected[:3]
            assert [llm.generate([p], GREEDY)[0].token_ids for p in prompts] == expected  # single-sequence prefills


def test_graph_set_captures_a_key_on_its_first_run_and_the_largest_pending_one_when_idle():
    """The bookkeeping of deferred capture, with CUDA's graph calls stood in for (the GPU tests capture for real)."""
    calls = []

    class Graph:
        def __init__(self):
            self.key = None

        def replay(self):
            calls.append(("replay", self.key))

    @contextlib.contextmanager
    def capturing(graph, pool, capture_error_mode):
        assert capture_error_mode == "thread_local"  # another thread of the process may use CUDA meanwhile
        calls.append("capture")
        yield

    def forward(key):
        calls.append(("forward", key))
        return torch.full((1,), float(key))

    with (mock.patch.object(torch.cuda, "CUDAGraph", Graph), mock.patch.object(torch.cuda, "graph", capturing),
          mock.patch.object(torch.cuda, "graph_pool_handle", lambda: "pool")):
        graphs = GraphSet(torch.device("cuda"), (1, 4, 2), forward, lambda key: calls.append(("padding", key)))
        assert graphs.run(2).item() == 2  # eager (the real step), then captured
        assert calls == [("forward", 2), "capture", ("forward", 2)] and graphs.pending == [1, 4]
        calls.clear()
        graphs.graphs[2].key = 2
        assert graphs.run(2).item() == 2 and calls == [("replay", 2)]
        calls.clear()
        assert graphs.capture_next() and graphs.pending == [1]  # the largest first, warmed up on padding
        assert calls == [("padding", 4), ("forward", 4), "capture", ("forward", 4)]
        graphs.capture_all()
        assert not graphs.pending and sorted(graphs.graphs) == [1, 2, 4] and not graphs.capture_next()
