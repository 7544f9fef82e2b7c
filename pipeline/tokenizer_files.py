"""The tokenizer.json an engine keeps (both backends): as transformers reads the checkpoint's, so that the engine
tokenizes prompts as transformers (and vLLM, which tokenizes through it) does. The builders copy the checkpoint's
files (they may not import transformers); the build stage then rewrites tokenizer.json where transformers reads it
otherwise."""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger("kiln.pipeline")


def write_transformers_tokenizer(checkpoint_dir: Path, engine_dir: Path) -> None:
    """Write the tokenizer.json of ``engine_dir`` (built from ``checkpoint_dir``) as transformers loads the
    checkpoint's tokenizer, where that differs from what the builder copied: transformers 5 rebuilds Llama-2-style
    SentencePiece tokenizers (Llama 2, Mistral, Phi-3) without their legacy normalizer, which put a '▁' after every
    special token, and converts a tokenizer.model that comes without a tokenizer.json."""
    loaded = transformers_tokenizer_json(checkpoint_dir)
    target = Path(engine_dir) / "tokenizer.json"
    if loaded is None or target.is_file() and json.loads(target.read_text(encoding="utf-8")) == json.loads(loaded):
        return
    logger.debug("tokenizer.json written as transformers loads %s's tokenizer", checkpoint_dir)
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
