"""An engine's or checkpoint's chat template as its files hold it (`chat_template.jinja`, else
`tokenizer_config.json`'s `chat_template`) with the special tokens it writes: read once, rendering nothing, so that
`LLM.load` keeps it without importing jinja2 and `LLM.chat` does not depend on the directory later."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kiln.runtime.tokenizer import special_token_text

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class ChatTemplateFiles:
    """``source``: the template's text (None: the directory has none), ``origin``: the file it came from, for an
    error, ``special_tokens``: the texts of the special tokens the template is given (``bos_token``, ...);
    ``problem``: why the files could not be read (a template then fails with it when it is asked for)."""

    directory: Path
    source: str | None
    origin: str
    special_tokens: dict[str, str] = field(default_factory=dict)
    problem: str | None = None

    @classmethod
    def read(cls, directory: Path) -> ChatTemplateFiles:
        """The files of ``directory``; one that cannot be read is a ``problem``, not an error here."""
        directory = Path(directory)
        config_path = directory / "tokenizer_config.json"
        jinja_path = directory / "chat_template.jinja"
        try:
            config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
            jinja = jinja_path.read_text(encoding="utf-8") if jinja_path.is_file() else None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            return cls(directory, None, config_path.name, problem=f"{directory}: its chat template's files cannot be "
                                                                   f"read ({exc})")
        if not isinstance(config, dict):
            return cls(directory, None, config_path.name, problem=f"{config_path}: not a JSON object")
        if jinja is not None:
            source, origin = jinja, jinja_path.name
        else:
            source, origin = config.get("chat_template"), "chat_template in tokenizer_config.json"
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
        special = {name: text for name in SPECIAL_TOKENS if (text := special_token_text(config.get(name)))}
        return cls(directory, source if isinstance(source, str) and source else None, origin, special)
