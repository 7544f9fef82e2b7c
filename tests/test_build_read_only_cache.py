"""`kiln build --dry-run` against a cache this user cannot write says what the build would: refused, exit 2."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kiln.engines.cache import EngineCache
from kiln.pipeline.cli import app as cli


def read_only(path: Path) -> None:
    path.chmod(0o555)
    if os.access(path, os.W_OK):
        pytest.skip("this user writes folders whatever their mode (root)")


def build(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["build", "tiny-llama-bf16", *args])
    return result.exit_code, " ".join(result.output.split())


def test_a_dry_run_into_a_read_only_cache_is_refused_as_the_build_is(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    EngineCache.open(root)
    read_only(root / "v1")
    monkeypatch.setenv("KILN_CACHE", str(root))
    try:
        dry, real = build("--dry-run"), build()
    finally:
        (root / "v1").chmod(0o755)
    assert dry[0] == real[0] == 2
    refusal = real[1][real[1].index("error: engine "):]
    assert "cannot be built into the cache" in refusal and "cannot write" in refusal
    assert dry[1].endswith(refusal)


def test_a_dry_run_into_a_cache_root_that_cannot_be_created_is_refused(tmp_path, monkeypatch):
    read_only(tmp_path)
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    try:
        code, output = build("--dry-run")
    finally:
        tmp_path.chmod(0o755)
    assert code == 2 and f"cache root {tmp_path / 'cache'}: cannot create" in output
