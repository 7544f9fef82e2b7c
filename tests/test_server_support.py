"""Shared helpers of the server tests (no tests here): tiny engines built once per process, waiting for the engine
to go idle."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
import time
from pathlib import Path

from kiln.runtime import LLM
from tests.subprocess_env import REPO

TOKENIZER_SOURCE = REPO / "models" / "tiny-llama"  # a real BPE tokenizer with a chat template


@functools.cache
def tiny_engine(max_seq_len: int = 256, max_batch_size: int = 16, max_input_len: int = 64) -> Path:
    """A seeded random tiny Llama with the bundled tiny-llama tokenizer and chat template, built once per process."""
    import tokenizers

    from kiln.engines.native.builder import build_native_engine
    from tests.model_factories import make_hf_checkpoint, tiny_plan

    root = Path(tempfile.mkdtemp(prefix="kiln-server-test-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    vocab_size = tokenizers.Tokenizer.from_file(str(TOKENIZER_SOURCE / "tokenizer.json")).get_vocab_size()
    make_hf_checkpoint(root / "checkpoint", seed=0, vocab_size=vocab_size, max_position_embeddings=max_seq_len)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER_SOURCE / name, root / "checkpoint" / name)
    engine = root / "engine"
    engine.mkdir()
    plan = tiny_plan(max_batch_size=max_batch_size, max_input_len=min(max_input_len, max_seq_len),
                     max_seq_len=max_seq_len, max_num_tokens=256)
    build_native_engine(root / "checkpoint", engine, plan, "float32")
    return engine


def wait_until(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def engine_idle(llm: LLM) -> bool:
    """No request running or waiting, and every KV block free."""
    stats = llm.stats()
    kv = stats["kv_cache"]
    return stats["num_running"] == 0 and stats["num_waiting"] == 0 and kv["free_blocks"] == kv["num_blocks"]
