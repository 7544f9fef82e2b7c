"""The files of a checkpoint's tokenizer that an engine directory keeps (both backends), and how to read a special
token's text from them: what a build copies, apart from the request-time tokenizer (``runtime.tokenizer``), so that
a change there does not change the engines' cache keys (``pipeline.source_hash``)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.runtime.json_files import read_json_object

if TYPE_CHECKING:
    from kiln.runtime.tokenizer import Tokenizer

# What an engine directory keeps of a checkpoint's tokenizer (both backends). chat_template.jinja: transformers 5
# saves a tokenizer's chat template there rather than in tokenizer_config.json; the server reads it first.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
# And the folder where transformers 5 saves a tokenizer's further named chat templates (tool_use.jinja, ...).
CHAT_TEMPLATES_DIR = "additional_chat_templates"
# What the request-time tokenizer loads; generation_config.json belongs to the model, which an engine of token-id
# prompts keeps too
TOKENIZER_JSON = "tokenizer.json"
MODEL_FILES = ("generation_config.json",)
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def special_token_text(token: str | dict | None) -> str | None:
    """A special token's text as tokenizer_config.json writes it: a string, or an AddedToken dict's ``content``."""
    return token.get("content") if isinstance(token, dict) else token


def special_token_texts(directory: Path) -> dict[str, str]:
    """The texts of the special tokens (SPECIAL_TOKENS: ``bos_token``, ``eos_token``, ...) of the tokenizer in
    ``directory`` as transformers resolves them (what chat templates are given, and vLLM's
    ``tokenizer.eos_token_id``): tokenizer_config.json's, which special_tokens_map.json's override where the config
    has no ``added_tokens_decoder`` (one saved before transformers 4.34, or none). A file that does not read as a
    JSON object counts as absent."""
    config = _json_object(Path(directory) / "tokenizer_config.json")
    tokens = {name: config.get(name) for name in SPECIAL_TOKENS}
    if "added_tokens_decoder" not in config:
        mapped = _json_object(Path(directory) / SPECIAL_TOKENS_MAP)
        tokens |= {name: mapped[name] for name in SPECIAL_TOKENS if name in mapped}
    return {name: text for name, token in tokens.items()
            if isinstance(text := special_token_text(token), str) and text}


def eos_token_text(directory: Path) -> str | None:
    """The text of the tokenizer's ``eos_token`` (``special_token_texts``); None without one."""
    return special_token_texts(directory).get("eos_token")


def tokenizer_eos_id(directory: Path, tokenizer: Tokenizer | None) -> int | None:
    """The id of ``eos_token_text`` in ``tokenizer`` (``directory``'s), None without one: vLLM's
    ``tokenizer.eos_token_id``, the one EOS id that ends a completion with ``stop_reason`` None."""
    text = eos_token_text(directory)
    return None if tokenizer is None or text is None else tokenizer.token_id(text)


def _json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; {} where there is none, or it does not read as one."""
    try:
        return read_json_object(path, ValueError, "") if path.is_file() else {}
    except ValueError:
        return {}


def partial_tokenizer_files(directory: Path) -> list[str]:
    """The tokenizer's files in ``directory`` (of TOKENIZER_FILES and CHAT_TEMPLATES_DIR) when it has no
    tokenizer.json: a tokenizer copied in part, which cannot tokenize; [] when it has tokenizer.json or none of them
    (an engine built without a tokenizer, which takes token ids only)."""
    directory = Path(directory)
    if (directory / TOKENIZER_JSON).exists():
        return []
    present = [name for name in TOKENIZER_FILES if name not in (TOKENIZER_JSON, *MODEL_FILES)
               and (directory / name).is_file()]
    templates = sorted((directory / CHAT_TEMPLATES_DIR).glob("*.jinja"))
    return present + [f"{CHAT_TEMPLATES_DIR}/{path.name}" for path in templates]


def copy_tokenizer_files(source_dir: Path, engine_dir: Path) -> None:
    """Copy the TOKENIZER_FILES that ``source_dir`` (a Hugging Face checkpoint) has into an engine directory, and
    the ``.jinja`` files of its CHAT_TEMPLATES_DIR."""
    for name in TOKENIZER_FILES:
        if (Path(source_dir) / name).is_file():
            shutil.copyfile(Path(source_dir) / name, Path(engine_dir) / name)
    for path in sorted((Path(source_dir) / CHAT_TEMPLATES_DIR).glob("*.jinja")):
        if path.is_file():
            (Path(engine_dir) / CHAT_TEMPLATES_DIR).mkdir(exist_ok=True)
            shutil.copyfile(path, Path(engine_dir) / CHAT_TEMPLATES_DIR / path.name)
