"""An engine's or checkpoint's chat templates as its files hold them (transformers 5's `chat_template.jinja` and
`additional_chat_templates/<name>.jinja`, else `tokenizer_config.json`'s `chat_template`: one template, or named ones)
with the special tokens they write: read once, rendering nothing, so that `LLM.load` keeps them without importing
jinja2 and `LLM.chat` does not depend on the directory later."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.runtime.tokenizer_files import CHAT_TEMPLATES_DIR, special_token_texts

CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers 5's default template (its others: CHAT_TEMPLATES_DIR)
CONFIG_ORIGIN = "chat_template in tokenizer_config.json"


@dataclass(frozen=True)
class ChatTemplateFiles:
    """``source``: the default template's text (None: the directory has none), ``origin``: the file it came from,
    for an error, ``named``: the further named templates (``tool_use``, ``rag``, ...), each name to its text and
    origin, ``special_tokens``: the texts of the special tokens the templates are given (``bos_token``, ...);
    ``problem``: why the files could not be read (a template then fails with it when it is asked for)."""

    directory: Path
    source: str | None
    origin: str
    special_tokens: dict[str, str] = field(default_factory=dict)
    problem: str | None = None
    named: dict[str, tuple[str, str]] = field(default_factory=dict)

    @classmethod
    def read(cls, directory: Path) -> ChatTemplateFiles:
        """The files of ``directory``, as transformers reads them: its ``.jinja`` files, where it has any, take the
        place of the config's templates (all of them); a named template is the default when it is named
        ``default``. One that cannot be read is a ``problem``, not an error here."""
        directory = Path(directory)
        config_path = directory / "tokenizer_config.json"
        try:
            config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
            jinja = {name: (path.read_text(encoding="utf-8"), path.relative_to(directory).as_posix())
                     for name, path in _jinja_files(directory).items()}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            return cls(directory, None, config_path.name, problem=f"{directory}: its chat template's files cannot be "
                                                                   f"read ({exc})")
        if not isinstance(config, dict):
            return cls(directory, None, config_path.name, problem=f"{config_path}: not a JSON object")
        templates = jinja or _config_templates(config.get("chat_template"))
        templates = {name: (text, origin) for name, (text, origin) in templates.items() if text}
        source, origin = templates.pop("default", (None, CHAT_TEMPLATE_FILE if jinja else CONFIG_ORIGIN))
        return cls(directory, source, origin, special_token_texts(directory), named=templates)


def _jinja_files(directory: Path) -> dict[str, Path]:
    """Transformers 5's template files, by name: ``chat_template.jinja`` the default, then each of
    ``additional_chat_templates/`` (a ``default.jinja`` there taking its place, as transformers reads them)."""
    files = {"default": directory / CHAT_TEMPLATE_FILE} if (directory / CHAT_TEMPLATE_FILE).is_file() else {}
    for path in sorted((directory / CHAT_TEMPLATES_DIR).glob("*.jinja")):
        if path.is_file():
            files[path.name.removesuffix(".jinja")] = path
    return files


def _config_templates(value: Any) -> dict[str, tuple[str, str]]:
    """``tokenizer_config.json``'s ``chat_template``: one template (the default), or named ones
    (``[{"name": "default", "template": ...}, {"name": "tool_use", ...}]``, Hermes-2-Pro's and Command-R's); an
    entry without a name and a template is left out."""
    if isinstance(value, str):
        return {"default": (value, CONFIG_ORIGIN)}
    if not isinstance(value, list):
        return {}
    return {entry["name"]: (entry["template"], f"chat template '{entry['name']}' in tokenizer_config.json")
            for entry in value if isinstance(entry, dict) and isinstance(entry.get("name"), str)
            and isinstance(entry.get("template"), str)}
