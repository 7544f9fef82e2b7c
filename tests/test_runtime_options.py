"""One typed options object for the runtime, filled from ``KILN_*`` variables only at the CLI's edge."""

from __future__ import annotations

import pytest

from kiln.pipeline.runtime_env import runtime_options
from kiln.runtime.options import RuntimeOptions, RuntimeOptionsError


def test_defaults_are_what_the_performance_figures_were_measured_with():
    options = RuntimeOptions()
    assert (options.kernels, options.overlap_steps, options.pdl) == ("triton", None, True)
    assert options.device is None and options.linear_max_m is None and options.num_kv_blocks is None
    assert options.captures_cuda_graphs and options.changed() == []
    assert RuntimeOptions(kernels="torch", pdl=False).changed() == ["kernels='torch'", "pdl=False"]


@pytest.mark.parametrize(("values", "problem"), [
    ({"kernels": "cuda"}, "kernels 'cuda' must be one of triton, torch"),
    ({"kernels": "torch", "cuda_graphs": True}, "cuda_graphs needs the Triton kernels"),
    ({"linear_max_m": 0}, "linear_max_m 0 must be a positive integer"),
    ({"num_kv_blocks": -3}, "num_kv_blocks -3 must be a positive integer"),
    ({"device": "gpu"}, "device 'gpu' must be 'cpu', 'cuda' or 'cuda:N'"),
    ({"device": "cuda:x"}, "device 'cuda:x' must be"),
    ({"device": "cuda:١"}, "device 'cuda:١' must be"),  # a decimal to str.isdecimal, not an ASCII digit
    ({"tp_rendezvous": "h:٢٩٥٠٠"}, "tp_rendezvous 'h:٢٩٥٠٠' must be 'HOST:PORT'"),
    ({"scheduler_policy": "fcfs"}, "scheduler_policy 'fcfs' must be one of max_utilization, guaranteed_no_evict"),
    ({"gpu_memory_utilization": 1.2}, r"gpu_memory_utilization 1.2 must be a number in \(0, 1\]"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization 0 must be"),
    ({"cuda_graph_capture": "lazy"}, "cuda_graph_capture 'lazy' must be one of deferred, at_load"),
    ({"prefix_caching": "no"}, "prefix_caching 'no' must be True or False"),
])
def test_options_that_cannot_run_are_refused_naming_the_field(values, problem):
    with pytest.raises(RuntimeOptionsError, match=problem):
        RuntimeOptions(**values)


def test_the_cli_fills_options_from_kiln_variables_and_its_own_flags():
    environ = {"KILN_KERNELS": "torch", "KILN_CUDA_GRAPHS": "0", "KILN_OVERLAP_STEPS": "0", "KILN_PDL": "0",
               "KILN_ATTENTION_FP8_PV": "0", "KILN_LINEAR_MAX_M": "8", "KILN_SCHEDULER_POLICY": "guaranteed_no_evict",
               "KILN_GPU_MEMORY_UTILIZATION": "0.95", "KILN_CUDA_GRAPH_CAPTURE": "at_load", "KILN_PREFIX_CACHING": "0",
               "UNRELATED": "x"}
    options = runtime_options(environ, device="cuda:1", num_kv_blocks=64)
    assert options == RuntimeOptions(device="cuda:1", kernels="torch", cuda_graphs=False, overlap_steps=False,
                                     pdl=False, attention_fp8_pv=False, linear_max_m=8, num_kv_blocks=64,
                                     scheduler_policy="guaranteed_no_evict", gpu_memory_utilization=0.95,
                                     cuda_graph_capture="at_load", prefix_caching=False)
    assert runtime_options(environ, gpu_memory_utilization=0.8).gpu_memory_utilization == 0.8  # the flag wins
    assert runtime_options(environ, prefix_caching=True).prefix_caching
    assert runtime_options({}) == RuntimeOptions()


@pytest.mark.parametrize(("name", "value", "problem"), [
    ("KILN_CUDA_GRAPHS", "yes", "must be one of 0, 1"),
    ("KILN_KERNELS", "cuda", "must be one of triton, torch"),
    ("KILN_LINEAR_MAX_M", "0", "must be a positive integer"),
    ("KILN_LINEAR_MAX_M", "²", "must be a positive integer"),  # a digit to str.isdigit, not to int()
    ("KILN_LINEAR_MAX_M", "١٢", "must be a positive integer"),  # 12 to int(), but not in ASCII digits
    ("KILN_PDL", "on", "must be one of 0, 1"),
    ("KILN_SCHEDULER_POLICY", "fifo", "must be one of max_utilization, guaranteed_no_evict"),
    ("KILN_GPU_MEMORY_UTILIZATION", "lots", r"must be a number in \(0, 1\]"),
    ("KILN_GPU_MEMORY_UTILIZATION", "1.5", r"must be a number in \(0, 1\]"),
    ("KILN_CUDA_GRAPH_CAPTURE", "later", "must be one of deferred, at_load"),
    ("KILN_PREFIX_CACHING", "off", "must be one of 0, 1"),
])
def test_a_bad_variable_is_refused_naming_it(name, value, problem):
    with pytest.raises(RuntimeOptionsError, match=f"{name}={value!r} {problem}"):
        runtime_options({name: value})


@pytest.mark.parametrize(("flags", "environ", "prefix_caching"), [
    ([], {}, True),
    (["--no-enable-prefix-caching"], {}, False),
    ([], {"KILN_PREFIX_CACHING": "0"}, False),
    (["--enable-prefix-caching"], {"KILN_PREFIX_CACHING": "0"}, True),  # the flag wins
])
def test_kiln_serve_takes_prefix_caching_from_its_flag_else_the_variable(monkeypatch, flags, environ, prefix_caching):
    from typer.testing import CliRunner

    from kiln.pipeline import cli
    from kiln.pipeline.serve_command import ServeTarget
    from kiln.runtime import server
    from tests.test_server_support import tiny_engine

    monkeypatch.delenv("KILN_PREFIX_CACHING", raising=False)
    seen = {}
    monkeypatch.setattr(server, "run_server", lambda *args, **kwargs: None)
    monkeypatch.setattr(ServeTarget, "loader",
                        lambda self, options, settings=None: seen.update(options=options) or (lambda: None))
    result = CliRunner().invoke(cli.app, ["serve", str(tiny_engine()), *flags], env=environ)
    assert result.exit_code == 0, result.output
    assert seen["options"].prefix_caching is prefix_caching


def test_cuda_graphs_asked_for_with_the_torch_kernels_are_refused_naming_both_variables():
    with pytest.raises(RuntimeOptionsError, match="KILN_CUDA_GRAPHS=1 needs KILN_KERNELS=triton"):
        runtime_options({"KILN_KERNELS": "torch", "KILN_CUDA_GRAPHS": "1"})
    assert not runtime_options({"KILN_KERNELS": "torch"}).captures_cuda_graphs  # the default stays eager there


def test_gpu_memory_utilization_is_the_share_of_the_device_the_kv_pool_fills(monkeypatch):
    from types import SimpleNamespace

    import torch

    from kiln.runtime.native import kv_cache

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (100 * gib, 140 * gib))  # 40 GiB already held
    monkeypatch.setattr(kv_cache, "kv_bytes_per_block", lambda config: gib // 4)
    arch = SimpleNamespace(hidden_size=64, intermediate_size=128, vocab_size=256)
    plan = SimpleNamespace(max_batch_size=512, blocks_per_seq=4096 // 32, max_num_tokens=64)
    config = SimpleNamespace(plan=plan, architecture=arch)
    blocks = {share: kv_cache.default_kv_blocks(config, torch.device("cuda"), share) for share in (0.9, 0.95)}
    assert blocks == {0.9: 4 * 86 - 1, 0.95: 4 * 93 - 1}  # (100 - 14 or 7 GiB) in quarter-GiB blocks, less activations


@pytest.mark.parametrize(("values", "device", "tp_size", "problem"), [
    (dict(cuda_graphs=True), "cpu", 1, r"cuda_graphs=True: CUDA settings, and this engine runs on the cpu"),
    (dict(gpu_memory_utilization=0.5, cuda_graph_capture="at_load"), "cpu", 2,
     r"cuda_graph_capture='at_load', gpu_memory_utilization=0.5: CUDA settings"),
    (dict(tp_rendezvous="10.0.0.1:29500"), "cuda", 1, r"tp_rendezvous='10.0.0.1:29500': this engine runs on one"),
    (dict(pdl=False, attention_fp8_pv=False, linear_max_m=1), "cpu", 1,  # the streaming crossover asks for kernels
     r"^linear_max_m=1: CUDA settings, and this engine runs on the cpu"),
])
def test_options_the_engine_would_not_use_are_refused(values, device, tp_size, problem):
    with pytest.raises(RuntimeOptionsError, match=problem):
        RuntimeOptions(**values).check_applies(device, tp_size)
    RuntimeOptions(cuda_graphs=False, tp_rendezvous="10.0.0.1:29500").check_applies("cpu", 2)  # off, or used
    RuntimeOptions(kernels="torch").check_applies("cpu", 1)  # what the CPU runs anyway
    RuntimeOptions(pdl=False, attention_fp8_pv=False).check_applies("cpu", 1)  # on or off, nothing asked of a CPU
    RuntimeOptions(**values).check_applies("cuda", 2)
