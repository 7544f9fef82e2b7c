"""Concurrent builders of one key build once; a builder killed at any point leaves no visible entry."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.engines.cache import EngineCache, engine_key
from tests.subprocess_env import repo_env

MATERIAL = {"key_schema": 1, "kind": "engine", "checkpoint": "ab" * 32, "backend": "native"}
KEY = engine_key(MATERIAL)

WORKER = r"""
import json, os, signal, sys, time
from pathlib import Path
from kiln.engines.cache import EngineCache, engine_key

root, mode, counter = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
material = json.loads(sys.argv[4])
key = engine_key(material)
cache = EngineCache.open(root)

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def build(out):
    with open(counter, "a") as f:
        f.write(f"{os.getpid()}\n")
    if mode == "kill_before_files":
        die()
    (out / "engine.json").write_text("{}")
    (out / "rank0.safetensors").write_bytes(b"w" * 4096)
    if mode == "kill_after_files":
        die()
    if mode == "slow":
        time.sleep(1.0)
    return {"built_by": os.getpid()}

if mode == "kill_before_rename":
    real_rename = os.rename
    os.rename = lambda src, dst: die() if Path(src).parent.name == "tmp" else real_rename(src, dst)
if mode == "slow":
    (root.parent / f"ready.{os.getpid()}").touch()
    while not (root.parent / "go").exists():
        time.sleep(0.01)
waits = []
result = cache.entries.get_or_build(key, material, build, on_wait=waits.append)
print(json.dumps({"hit": result.hit, "reason": result.reason, "waited": result.waited, "notes": waits}))
"""


def run_worker(tmp_path: Path, mode: str) -> subprocess.Popen:
    """Start a worker; its source goes on the command line, not in a shared file that the next ``run_worker`` would
    rewrite (a worker that read it while it was truncated ran an empty script and exited 0 without output)."""
    env = repo_env()
    return subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path / "cache"), mode, str(tmp_path / "builds"),
                             json.dumps(MATERIAL)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def write_engine(out: Path) -> dict:
    (out / "engine.json").write_text("{}")
    return {}


def test_four_concurrent_builders_build_once_and_three_hit(tmp_path):
    workers = [run_worker(tmp_path, "slow") for _ in range(4)]
    deadline = time.monotonic() + 30
    while len(list(tmp_path.glob("ready.*"))) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    (tmp_path / "go").touch()
    outputs = []
    for worker in workers:
        out, err = worker.communicate(timeout=60)
        assert worker.returncode == 0, err
        outputs.append(json.loads(out))
    assert len((tmp_path / "builds").read_text().split()) == 1
    assert sorted(o["hit"] for o in outputs) == [False, True, True, True]
    waiting = [o for o in outputs if o["waited"]]
    assert waiting and all("waiting" in o["notes"][0] for o in waiting)
    summary = EngineCache.open(tmp_path / "cache").stats.summary("entries")
    assert (summary["lookups"], summary["hits"], summary["misses"], summary["builds"]) == (4, 3, 1, 1)
    assert summary["misses_by_reason"]["new"] == 1


@pytest.mark.parametrize("mode", ["kill_before_files", "kill_after_files", "kill_before_rename"])
def test_builder_killed_at_any_point_leaves_no_entry_and_the_next_build_succeeds(tmp_path, mode):
    worker = run_worker(tmp_path, mode)
    worker.communicate(timeout=60)
    assert worker.returncode == -signal.SIGKILL
    cache = EngineCache.open(tmp_path / "cache")
    assert not cache.entries.entry_dir(KEY).exists()
    assert cache.entries.lookup(KEY, MATERIAL, record=False).reason == "new"
    leftovers = list((cache.v1 / "tmp").iterdir())
    assert [p.name.split(".")[:2] for p in leftovers] == [["entries", KEY]]
    assert (leftovers[0] / "manifest.json").exists() == (mode == "kill_before_rename")

    result = cache.entries.get_or_build(KEY, MATERIAL, write_engine)
    assert (result.hit, result.reason) == (False, "new")
    assert list((cache.v1 / "tmp").iterdir()) == []
    assert cache.entries.lookup(KEY, MATERIAL).hit


def test_a_dead_builders_temporary_is_swept_by_a_build_of_another_key(tmp_path):
    worker = run_worker(tmp_path, "kill_after_files")
    worker.communicate(timeout=60)
    cache = EngineCache.open(tmp_path / "cache")
    assert len(list((cache.v1 / "tmp").iterdir())) == 1
    other = {**MATERIAL, "backend": "trtllm"}
    cache.entries.get_or_build(engine_key(other), other, write_engine)
    assert list((cache.v1 / "tmp").iterdir()) == []
