"""The tokenizer.json an engine keeps (both backends): as transformers reads the checkpoint's, so that the engine
tokenizes prompts as transformers (and vLLM, which tokenizes through it) does. The builders copy the checkpoint's
files (they may not import transformers); the build stage then rewrites tokenizer.json where transformers reads it
otherwise, and writes it where the checkpoint has none (only vocab.json + merges.txt, or tokenizer.model)."""

from __future__ import annotations

import json
import logging
from importlib.util import find_spec
from pathlib import Path

import tokenizers

from kiln.engines.native.builder import CONVERTIBLE_TOKENIZERS
from kiln.runtime.errors import KilnError
from kiln.runtime.tokenizer import Tokenizer

logger = logging.getLogger("kiln.pipeline")


def checkpoint_tokenizer(checkpoint_dir: Path) -> Tokenizer:
    """The tokenizer an engine built from ``checkpoint_dir`` encodes with: its tokenizer.json, else the one
    transformers makes from its vocab.json + merges.txt or tokenizer.model (written as the engine's tokenizer.json
    after the build). KilnError naming what the folder has when there is neither."""
    if (tokenizer := Tokenizer.from_dir(checkpoint_dir)) is not None:
        return tokenizer
    loaded, why = _transformers_tokenizer_json(checkpoint_dir)
    if loaded is not None:
        return Tokenizer(tokenizers.Tokenizer.from_str(loaded))
    if has := [name for names in CONVERTIBLE_TOKENIZERS for name in names if (checkpoint_dir / name).is_file()]:
        fix = "save the tokenizer with transformers' save_pretrained (a fast tokenizer writes it)"
        if "tokenizer.model" in has and find_spec("sentencepiece") is None:  # transformers' error then names another
            why, fix = "it needs the sentencepiece package for that, which is not installed", \
                f"`pip install sentencepiece`, or {fix}"
        raise KilnError(f"{checkpoint_dir} has {' and '.join(has)} but no tokenizer.json, and transformers makes none "
                        f"from {'it' if len(has) == 1 else 'them'} ({why}): Kiln reads tokenizer.json; {fix}")
    raise KilnError(f"{checkpoint_dir} has no tokenizer (no tokenizer.json, nor vocab.json + merges.txt or "
                    "tokenizer.model to make one from); add the checkpoint's tokenizer files")


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
    return _transformers_tokenizer_json(checkpoint_dir)[0]


def _transformers_tokenizer_json(checkpoint_dir: Path) -> tuple[str | None, str]:
    """(transformers_tokenizer_json's answer, and where it is None, why)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
    except Exception as exc:  # transformers raises many kinds: the checkpoint's own files are then kept as they are
        logger.debug("transformers loads no tokenizer from %s: %s: %s", checkpoint_dir, type(exc).__name__, exc)
        return None, f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return (backend.to_str(), "") if backend is not None else (None, f"its {type(tokenizer).__name__} is slow")
