"""Find the checkpoint a config names: a local directory, the local Hugging Face cache, or (if allowed) the hub."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kiln.pipeline.config import ModelSection, is_local_path
from kiln.runtime.errors import KilnError


class ModelNotFoundError(KilnError):
    """The checkpoint is not on disk and may not (or cannot) be downloaded."""


REQUIRED_FILES = ("config.json",)


def hf_hub_cache() -> Path:
    """The local Hugging Face hub cache, honouring ``HF_HUB_CACHE`` and ``HF_HOME``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    return Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser() / "hub"


def find_model(model: ModelSection) -> Path | None:
    """The checkpoint directory if it is on disk (a local path, or a snapshot in the HF cache), else None."""
    local = Path(model.path).expanduser()
    if is_local_path(model.path):
        return local if _is_checkpoint(local) else None
    repo_dir = hf_hub_cache() / f"models--{model.path.replace('/', '--')}"
    ref = repo_dir / "refs" / (model.revision or "main")
    snapshots = repo_dir / "snapshots"
    if ref.is_file():
        snapshot = snapshots / ref.read_text().strip()
        if _is_checkpoint(snapshot):
            return snapshot
    if model.revision and _is_checkpoint(snapshots / model.revision):
        return snapshots / model.revision
    return None


def resolve_model(model: ModelSection) -> Path:
    """The checkpoint directory; downloads only when ``model.allow_download`` is set. Raises ModelNotFoundError."""
    found = find_model(model)
    if found is not None:
        return found
    local = Path(model.path).expanduser()
    if is_local_path(model.path):
        raise ModelNotFoundError(f"model.path {local} {_what_is_missing(local)}")
    if not model.allow_download:
        raise ModelNotFoundError(
            f"model '{model.path}' is not on disk (not in the Hugging Face cache {hf_hub_cache()}); download it "
            f"with `hf download {model.path}` where the hub is reachable, or set model.path to a local folder "
            "(or model.allow_download: true)"
        )
    return _download(model)


def _download(model: ModelSection) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model"]
    try:
        return Path(snapshot_download(model.path, revision=model.revision, allow_patterns=patterns, etag_timeout=10))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise ModelNotFoundError(
            f"model '{model.path}' could not be downloaded from the Hugging Face hub ({type(exc).__name__}); "
            "check network access and HF_TOKEN, or point model.path at a local folder"
        ) from None


def _what_is_missing(folder: Path) -> str:
    """Why a local folder is not a checkpoint Kiln reads, and what to do."""
    fix = "point model.path at a Hugging Face checkpoint folder"
    if not folder.is_dir():
        return f"is not a directory; {fix}"
    missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    if missing:
        return f"has no {', '.join(missing)}; {fix}"
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        return ("holds pickle weights (*.bin / *.pt) only, which Kiln never loads; re-save the checkpoint with "
                "save_pretrained(..., safe_serialization=True)")
    return f"has no *.safetensors weights; {fix}"


def _is_checkpoint(path: Path) -> bool:
    return path.is_dir() and all((path / f).is_file() for f in REQUIRED_FILES) and any(path.glob("*.safetensors"))


def model_max_positions(model_dir: Path) -> int | None:
    """The checkpoint's ``max_position_embeddings`` (None when its config.json does not say)."""
    try:
        value = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
