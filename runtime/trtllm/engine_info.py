"""``kiln_trtllm.json``: what Kiln records beside the files trtllm-build wrote (``config.json``, ``rank<N>.engine``):
the build plan, the quantization, the EOS ids and the fingerprint of the build machine."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kiln.runtime.errors import EngineFormatError
from kiln.runtime.plan import BuildPlan, PlanError

TRTLLM_ENGINE_JSON = "kiln_trtllm.json"
ENGINE_FORMAT = "kiln-trtllm"
ENGINE_FORMAT_VERSION = 1


@dataclass(frozen=True)
class TrtllmEngineInfo:
    """The parsed `kiln_trtllm.json` of a TensorRT-LLM engine directory."""

    plan: BuildPlan
    quantization: dict[str, Any]
    fingerprint: dict[str, Any]
    eos_token_ids: list[int]
    vocab_size: int
    tp_size: int = 1
    pp_size: int = 1
    build: dict[str, Any] = field(default_factory=dict)
    format_version: int = ENGINE_FORMAT_VERSION

    @classmethod
    def load(cls, engine_dir: Path) -> TrtllmEngineInfo:
        """Read and check `engine_dir/kiln_trtllm.json`; raise EngineFormatError when it is missing or malformed."""
        path = Path(engine_dir) / TRTLLM_ENGINE_JSON
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise EngineFormatError(f"{engine_dir}: no {TRTLLM_ENGINE_JSON}; not a Kiln TensorRT-LLM engine, rebuild "
                                    f"it with `kiln build --backend trtllm`") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise EngineFormatError(f"{path}: unreadable ({e}); rebuild the engine") from None
        if not isinstance(data, dict) or data.get("format") != ENGINE_FORMAT:
            raise EngineFormatError(f"{path}: format is not {ENGINE_FORMAT!r}; rebuild the engine")
        if data.get("format_version") != ENGINE_FORMAT_VERSION:
            refusal = EngineFormatError.of_version(data.get("format_version"), ENGINE_FORMAT_VERSION)
            raise EngineFormatError(f"{path}: {refusal}")
        try:
            plan = BuildPlan.from_dict(data.get("plan"))
            return cls(**{k: v for k, v in data.items() if k not in ("format", "plan")}, plan=plan)
        except (TypeError, PlanError) as e:
            raise EngineFormatError(f"{path}: {e}; rebuild the engine") from None

    def save(self, engine_dir: Path) -> None:
        """Write `engine_dir/kiln_trtllm.json`."""
        data = {"format": ENGINE_FORMAT, **asdict(self)}
        (Path(engine_dir) / TRTLLM_ENGINE_JSON).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def is_trtllm_engine(engine_dir: Path) -> bool:
    """Whether `engine_dir` is a Kiln TensorRT-LLM engine (has `kiln_trtllm.json`)."""
    return (Path(engine_dir) / TRTLLM_ENGINE_JSON).is_file()


def ranks_not_loaded(tp_size: int, pp_size: int) -> str | None:
    """Why Kiln's adapter does not load a TensorRT-LLM engine of ``tp_size`` x ``pp_size`` ranks (one MPI process
    per GPU, which it does not start), or None for one rank."""
    if tp_size * pp_size == 1:
        return None
    return (f"a tp_size {tp_size} x pp_size {pp_size} TensorRT-LLM engine needs one MPI process per GPU, which Kiln's "
            f"adapter does not start: serve it with trtllm-serve")
