"""Find the checkpoint a config names: a local directory, the local Hugging Face cache, or (if allowed) the hub."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from kiln.engines.cache.hashing import COPIED_SNAPSHOT_FIX, INDEX_FILE, dangling_link, index_shards
from kiln.pipeline.config import PACKAGE_DIR, ModelSection, is_local_path
from kiln.runtime.errors import KilnError


class ModelNotFoundError(KilnError):
    """The checkpoint is not on disk and may not (or cannot) be downloaded."""


REQUIRED_FILES = ("config.json",)
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")  # huggingface_hub's validate_repo_id, roughly


def hf_hub_cache() -> Path:
    """The local Hugging Face hub cache where huggingface_hub puts it: ``HF_HUB_CACHE`` (or its older name
    ``HUGGINGFACE_HUB_CACHE``), else ``hub`` in ``HF_HOME``, else in ``$XDG_CACHE_HOME/huggingface``."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    home = os.environ.get("HF_HOME") or str(Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface")
    return Path(home).expanduser() / "hub"


def find_model(model: ModelSection) -> Path | None:
    """The checkpoint directory if it is on disk (a local path, or a snapshot in the HF cache), else None."""
    local = Path(model.path).expanduser()
    if is_local_path(model.path):
        return local if _is_checkpoint(local) else None
    return next((snapshot for snapshot in _snapshots(model) if _is_checkpoint(snapshot)), None)


def _snapshots(model: ModelSection) -> list[Path]:
    """The snapshot folders of the HF cache that hold ``model`` at its revision: its ref's, then the one the revision
    names itself (a commit)."""
    repo_dir = hf_hub_cache() / f"models--{model.path.replace('/', '--')}"
    ref = repo_dir / "refs" / (model.revision or "main")
    commits = [ref.read_text(encoding="utf-8").strip()] if ref.is_file() else []
    return [repo_dir / "snapshots" / commit for commit in [*commits, model.revision] if commit
            and (repo_dir / "snapshots" / commit).is_dir()]


def resolve_model(model: ModelSection) -> Path:
    """The checkpoint directory; downloads only when ``model.allow_download`` is set. Raises ModelNotFoundError."""
    found = find_model(model)
    if found is not None:
        return found
    local = Path(model.path).expanduser()
    if is_local_path(model.path):
        raise ModelNotFoundError(f"model.path {local} {_what_is_missing(local)}")
    if not _REPO_ID.fullmatch(model.path) or "--" in model.path or ".." in model.path or len(model.path) > 96:
        hint = " (Kiln expands ~ but not environment variables)" if "$" in model.path else ""
        raise ModelNotFoundError(
            f"model.path {model.path} is neither a folder (a relative path is taken from the config file's folder) "
            f"nor a Hugging Face model id such as org/name{hint}; point model.path at the checkpoint folder")
    what = f"model '{model.path}'" + (f" at revision {model.revision}" if model.revision else "")
    command = f"hf download {model.path}" + (f" --revision {model.revision}" if model.revision else "")
    if not model.allow_download:
        for snapshot in _snapshots(model):  # in the cache, but not whole
            if problem := _weights_problem(snapshot, fetch=f"fetch them with `{command}`"):
                raise ModelNotFoundError(f"{what} in the Hugging Face cache ({snapshot}) {problem}")
        here = Path(model.path)
        folder = (f"; {here.resolve()} is a folder, but a relative model.path is read from the config file's folder: "
                  f"write it relative to that, or absolute") if here.is_dir() else ""
        raise ModelNotFoundError(
            f"{what} is not on disk (not in the Hugging Face cache {hf_hub_cache()}); download it "
            f"with `{command}` where the hub is reachable, or set model.path to a local folder "
            f"(or model.allow_download: true){folder}"
        )
    downloaded = _download(model)
    if problem := _weights_problem(downloaded):
        raise ModelNotFoundError(f"{what}, downloaded to {downloaded}, {problem}")
    return downloaded


def _download(model: ModelSection) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = ["*.json", "tokenizer*", "*.model", "*.jinja", "*.tiktoken", "merges.txt", "vocab.txt"]
    try:
        folder = Path(snapshot_download(model.path, revision=model.revision, allow_patterns=patterns, etag_timeout=10))
        # then the weights: with an index, only the shards it names (not a Mistral repo's consolidated.safetensors),
        # at the commit just fetched
        weights = sorted(shards) if (shards := index_shards(folder)) else ["*.safetensors"]
        return Path(snapshot_download(model.path, revision=folder.name, allow_patterns=weights, etag_timeout=10))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise ModelNotFoundError(
            f"model '{model.path}' could not be downloaded from the Hugging Face hub ({type(exc).__name__}); "
            "check network access and HF_TOKEN, or point model.path at a local folder"
        ) from None


def _what_is_missing(folder: Path) -> str:
    """Why a local folder is not a checkpoint Kiln reads, and what to do."""
    fix = "point model.path at a Hugging Face checkpoint folder"
    if not folder.is_dir():
        bundled = PACKAGE_DIR / "models" / folder.name
        if folder.parent.name == "models" and bundled.is_dir():  # a bundled config copied elsewhere
            return (f"is not a directory (a relative model.path is read from the config file's folder, and a "
                    f"bundled config copied elsewhere keeps its ../models/{folder.name}); Kiln's bundled model is "
                    f"{bundled}: point model.path there")
        return f"is not a directory; {fix}"
    if link := _dangling_link(folder, COPIED_SNAPSHOT_FIX):
        return link
    missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    if missing:
        return f"has no {', '.join(missing)}; {fix}"
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        return ("holds pickle weights (*.bin / *.pt) only, which Kiln never loads; re-save the checkpoint with "
                "save_pretrained(..., safe_serialization=True)")
    return _weights_problem(folder) or f"has no *.safetensors weights; {fix}"


def _weights_problem(folder: Path, fetch: str | None = None) -> str | None:
    """Why the safetensors of a folder are not one whole checkpoint (None: model.safetensors, or an index whose
    shards are all there): a dangling link among them or config.json, both model.safetensors and an index (which
    tools read differently), shards without their index, or an index naming shards not on disk (an interrupted
    download). ``fetch`` says how to get missing files (None: a local folder, whose links are fixed by copying)."""
    if link := _dangling_link(folder, fetch or COPIED_SNAPSHOT_FIX):
        return link
    index = folder / INDEX_FILE
    if index.is_file() and (folder / "model.safetensors").is_file():
        return (f"has both model.safetensors and {index.name}, which tools read differently (transformers, and so "
                "calibration, loads model.safetensors; the native builder and vLLM the shards of the index): a "
                "sharded save_pretrained leaves an earlier single-file save in place; remove the stale one")
    if index.is_file():
        shards = index_shards(folder) or set()  # an index that is not one: the builder names what is wrong with it
        if missing := sorted(s for s in shards if not (folder / s).is_file()):
            return (f"has {index.name} naming {len(missing)} shard(s) not on disk ({', '.join(missing[:3])}"
                    f"{' ...' if len(missing) > 3 else ''}): an interrupted download? "
                    f"{fetch or 'fetch the missing files'}")
        return None
    if not (folder / "model.safetensors").is_file() and any(folder.glob("*.safetensors")):
        return ("has *.safetensors shards but no model.safetensors.index.json saying which tensor is where; copy the "
                "index from the checkpoint's source")
    return None


def _dangling_link(folder: Path, fix: str) -> str | None:
    """A dangling link among the files of ``folder`` that say whether it is a checkpoint (config.json, the index,
    the weights), named with ``fix``."""
    named = [*(folder / name for name in REQUIRED_FILES), folder / INDEX_FILE, *sorted(folder.glob("*.safetensors"))]
    for path in named:
        if problem := dangling_link(path):
            return f"has a dangling link: {problem}: {fix}"
    return None


def _is_checkpoint(path: Path) -> bool:
    return (path.is_dir() and all((path / f).is_file() for f in REQUIRED_FILES) and any(path.glob("*.safetensors"))
            and _weights_problem(path) is None)


def model_max_positions(model_dir: Path) -> int | None:
    """The checkpoint's ``max_position_embeddings`` (None when its config.json does not say)."""
    try:
        value = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
