"""Hugging Face checkpoint layouts as they come: an index that omits a tensor its shard holds, a hub snapshot copied
with its links dangling, a Mistral repo's consolidated.safetensors beside the index shards."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kiln.engines.cache import hashing
from kiln.engines.native.checkpoint import CheckpointTensors, read_architecture
from kiln.pipeline.config import ModelSection
from kiln.pipeline.key_material import checkpoint_state
from kiln.pipeline.model_source import ModelNotFoundError, resolve_model
from kiln.runtime.errors import KilnError

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
COPIED = "that does not exist: copy the snapshot with `cp -rL` (following links) or point model.path at the hub cache"


def sharded(root: Path) -> Path:
    """A folder whose index maps "a" to the first shard and "b" to the second, while the first shard also holds
    "norm" (which the index omits), beside a consolidated.safetensors the index does not list."""
    root.mkdir()
    (root / "config.json").write_text("{}")
    save_file({"a": torch.zeros(2), "norm": torch.full((4,), 2.0)}, root / SHARDS[0])
    save_file({"b": torch.ones(3)}, root / SHARDS[1])
    save_file({"c": torch.ones(1)}, root / "consolidated.safetensors")
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": SHARDS[0], "b": SHARDS[1]}}))
    return root


def starts(*parts: object) -> str:
    """A pattern matching text that begins with ``parts``, joined, as they are."""
    return "^" + re.escape("".join(map(str, parts)))


def test_a_tensor_the_index_omits_is_read_from_the_listed_shard_that_holds_it(tmp_path):
    tensors = CheckpointTensors(sharded(tmp_path / "ck"))
    assert "norm" in tensors and torch.equal(tensors.get("norm"), torch.full((4,), 2.0))
    assert tensors.unused() == ["a", "b"]  # what the index never declared is not refused as unused


def test_a_file_the_index_does_not_list_is_never_read_and_a_missing_tensor_names_the_folder(tmp_path):
    folder = sharded(tmp_path / "ck")
    tensors = CheckpointTensors(folder)
    assert "c" not in tensors
    with pytest.raises(KilnError, match=starts(folder, ": no tensor 'c' in the shards model.safetensors.index.json")):
        tensors.get("c")


@pytest.mark.parametrize("dangling", ["config.json", "model.safetensors", SHARDS[1]])
def test_a_hub_snapshot_copied_without_following_its_links_is_named_as_such(tmp_path, dangling):
    folder = tmp_path / "copied"
    folder.mkdir()
    files = ["config.json", *SHARDS, "model.safetensors.index.json"] if dangling == SHARDS[1] else [
        "config.json", "model.safetensors"]
    for name in files:
        (folder / name).write_text("{}")
    (folder / dangling).unlink()
    (folder / dangling).symlink_to(f"../../blobs/{dangling}")
    with pytest.raises(ModelNotFoundError, match=starts(f"model.path {folder} has a dangling link: {dangling} is a "
                                                        f"link to ../../blobs/{dangling} {COPIED}") + "$"):
        resolve_model(ModelSection(path=str(folder)))


def test_the_builder_names_a_dangling_config_or_weights_link_too(tmp_path):
    folder = tmp_path / "copied"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).symlink_to(f"../../blobs/{name}")
    with pytest.raises(KilnError, match=starts(folder, f": config.json is a link to ../../blobs/config.json {COPIED}")):
        read_architecture(folder)
    with pytest.raises(KilnError, match=starts(folder, ": model.safetensors is a link to ../../blobs/")):
        CheckpointTensors(folder)


def test_a_safetensors_file_the_index_does_not_name_is_neither_hashed_nor_in_the_engine_key(tmp_path, monkeypatch):
    folder = sharded(tmp_path / "ck")
    monkeypatch.setattr(hashing, "_memo", {})
    read: list[str] = []
    real = hashing.file_sha256
    monkeypatch.setattr(hashing, "file_sha256", lambda path: read.append(Path(path).name) or real(path))
    with_consolidated = checkpoint_state(folder)
    assert "consolidated.safetensors" not in read + list(with_consolidated.identities)
    (folder / "consolidated.safetensors").unlink()
    assert checkpoint_state(folder).hash == with_consolidated.hash
    save_file({"b": torch.zeros(3)}, folder / SHARDS[1])  # a shard the index names is in the key
    assert checkpoint_state(folder).hash != with_consolidated.hash


def test_a_download_fetches_only_the_shards_the_index_names(tmp_path, monkeypatch):
    import huggingface_hub

    snapshot = tmp_path / "snapshots" / "c0ffee"
    calls: list[tuple[str | None, list[str]]] = []

    def snapshot_download(repo_id, revision, allow_patterns, etag_timeout):
        calls.append((revision, allow_patterns))
        if len(calls) == 1:  # the small files, the index among them
            snapshot.parent.mkdir()
            sharded(snapshot)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model(ModelSection(path="acme/tiny", allow_download=True)) == snapshot
    assert "*.safetensors" not in calls[0][1]
    assert calls[1] == ("c0ffee", list(SHARDS))  # at the commit the first call fetched


def test_a_value_beyond_float16s_range_is_refused_naming_the_tensor_and_the_dtype_to_build_with(tmp_path):
    """It had been published, and every request then failed with "non-finite logits"."""
    from safetensors.torch import load_file

    from kiln.engines.native.builder import build_native_engine
    from tests.model_factories import make_hf_checkpoint, tiny_plan

    checkpoint = make_hf_checkpoint(tmp_path / "checkpoint")
    weights = load_file(checkpoint / "model.safetensors")
    weights["model.layers.0.mlp.down_proj.weight"][0, 0] = 1e6
    save_file(weights, checkpoint / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "engine").mkdir()
    with pytest.raises(KilnError, match=r"layers\.0\.mlp\.down_proj\.weight is not finite in float16: .* bfloat16"):
        build_native_engine(checkpoint, tmp_path / "engine", tiny_plan(), "float16")
