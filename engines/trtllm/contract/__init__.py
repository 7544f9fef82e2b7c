"""The recorded TensorRT-LLM 1.2.1 surface Kiln depends on (data; provenance inside the JSON)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

CONTRACT_PATH = Path(__file__).with_name("trtllm-1.2.1.json")


@cache
def load_contract() -> dict:
    """The recorded trtllm-build options, Python names and runtime messages of TensorRT-LLM 1.2.1."""
    return json.loads(CONTRACT_PATH.read_text(encoding="utf-8"))


def option_spec(flag: str) -> dict | None:
    """The recorded spec of a trtllm-build flag (aliases resolve to their option), or None if it does not exist."""
    options = load_contract()["trtllm_build"]["options"]
    if flag in options:
        return options[flag]
    return next((spec for spec in options.values() if flag in spec.get("aliases", ())), None)
