"""The files of a checkpoint's tokenizer that an engine directory keeps (both backends), and how to read a special
token's text from them: what a build copies, apart from the request-time tokenizer (``runtime.tokenizer``), so that
a change there does not change the engines' cache keys (``pipeline.source_hash``)."""

from __future__ import annotations

import shutil
from pathlib import Path

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


def special_token_text(token: str | dict | None) -> str | None:
    """A special token's text as tokenizer_config.json writes it: a string, or an AddedToken dict's ``content``."""
    return token.get("content") if isinstance(token, dict) else token


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
