"""The tokenizer an engine keeps (both builders): the checkpoint's files, with tokenizer.json as transformers reads
it, so that the engine tokenizes prompts as transformers (and vLLM, which tokenizes through it) does."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from kiln.runtime.tokenizer import copy_tokenizer_files

logger = logging.getLogger("kiln.engines")


def write_tokenizer_files(checkpoint_dir: Path, engine_dir: Path) -> None:
    """Copy the checkpoint's tokenizer files into ``engine_dir``, then write tokenizer.json as transformers loads the
    checkpoint's tokenizer where that differs from the file: transformers 5 rebuilds Llama-2-style SentencePiece
    tokenizers (Llama 2, Mistral, Phi-3) without their legacy normalizer, which put a '▁' after every special token,
    and converts a tokenizer.model that comes without a tokenizer.json."""
    copy_tokenizer_files(checkpoint_dir, engine_dir)
    loaded = transformers_tokenizer_json(checkpoint_dir)
    target = Path(engine_dir) / "tokenizer.json"
    if loaded is None or target.is_file() and json.loads(target.read_text(encoding="utf-8")) == json.loads(loaded):
        return
    logger.debug("tokenizer.json written as transformers loads %s's tokenizer (it differs from the file)",
                checkpoint_dir)
    target.write_text(loaded, encoding="utf-8")


def transformers_tokenizer_json(checkpoint_dir: Path) -> str | None:
    """The tokenizer.json of the tokenizer transformers loads from ``checkpoint_dir``; None when it loads none (no
    tokenizer files, a class of the checkpoint's own code, a slow tokenizer without a tokenizers backend)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
    except Exception as exc:  # transformers raises many kinds: the checkpoint's own files are then kept as they are
        logger.debug("transformers loads no tokenizer from %s: %s: %s", checkpoint_dir, type(exc).__name__, exc)
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend.to_str() if backend is not None else None
