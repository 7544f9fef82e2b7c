"""What `kiln serve` tells an operator at startup: which build and limits are live, and where a bad host came from."""

from __future__ import annotations

import logging

from typer.testing import CliRunner

from kiln.pipeline.cli import app as cli
from kiln.pipeline.serve_command import ServeTarget
from kiln.runtime.options import RuntimeOptions
from kiln.runtime.version import kiln_version
from tests.subprocess_env import REPO
from tests.test_server_support import tiny_engine


def test_the_startup_lines_name_the_build_its_limits_and_whether_a_key_is_needed_never_the_key(caplog):
    target = ServeTarget(engine_dir=tiny_engine(), model_name="tiny", engine_cache={"key": "ab" * 32})
    with caplog.at_level(logging.INFO, logger="kiln"):
        llm = target.loader(RuntimeOptions(), target.settings(api_key="s3cret", max_queue=7))()
    llm.close()
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "kiln.pipeline")
    limits = llm.limits
    for fact in (f"engine {'ab' * 6} (cache key)", f"Kiln {kiln_version() or 'unknown'}", "native on cpu",
                 "quantization none", "KV cache float32", "tp_size 1", f"max_seq_len {limits.max_seq_len}",
                 f"max_input_len {limits.max_input_len}", f"max_batch_size {limits.max_batch_size}",
                 f"max_num_tokens {limits.max_num_tokens}", f"({limits.kv_pool_tokens} tokens)", "max_queue 7",
                 "scheduler_policy max_utilization (the native backend's default)", "API key required"):
        assert fact in text, fact
    assert "s3cret" not in text


def test_a_config_host_that_does_not_resolve_is_refused_naming_serve_host_and_its_line(tmp_path, monkeypatch):
    config = tmp_path / "host.yaml"
    config.write_text(f"model:\n  path: {REPO / 'models' / 'tiny-llama'}\nquantize:\n  format: none\n"
                      f"serve:\n  host: not a host\n")
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    result = CliRunner().invoke(cli, ["serve", str(config)])
    assert result.exit_code == 2
    assert f"{config}:6: serve.host: cannot serve on host 'not a host'" in " ".join(result.output.split())
