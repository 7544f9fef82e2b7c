"""The checkpoint content hash: Merkle over weight, config and tokenizer files, memoised per file identity."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kiln.engines.cache import CheckpointHashError, checkpoint_files, checkpoint_hash, hashing


@pytest.fixture
def reads(monkeypatch):
    """Count the files actually read; start with an empty in-process memo."""
    monkeypatch.setattr(hashing, "_memo", {})
    seen: list[str] = []
    real = hashing.file_sha256

    def counting(path):
        seen.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(hashing, "file_sha256", counting)
    return seen


def make_checkpoint(root: Path) -> Path:
    root.mkdir()
    (root / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    (root / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (root / "tokenizer.json").write_text('{"model": {}}')
    (root / "tokenizer.model").write_bytes(b"spm")
    (root / "README.md").write_text("not part of the hash")
    (root / ".cache").mkdir()
    (root / ".cache" / "meta.json").write_text("{}")
    return root


def bump_mtime(path: Path) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_hash_covers_weights_configs_and_tokenizer_only(tmp_path):
    files = checkpoint_files(make_checkpoint(tmp_path / "ckpt"))
    assert files.hashed == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer.model"]


def test_hash_covers_every_file_a_build_reads_or_copies_into_the_engine(tmp_path):
    from kiln.runtime.tokenizer_files import TOKENIZER_FILES

    ckpt = make_checkpoint(tmp_path / "ckpt")
    read = {"model.safetensors.index.json", "hf_quant_config.json", "chat_template.json", "added_tokens.json",
            "vocab.json", "merges.txt", "tool_use.jinja", *TOKENIZER_FILES}
    for name in read:
        (ckpt / name).write_text("{}")
    assert read <= set(checkpoint_files(ckpt).hashed)


def test_editing_the_chat_template_changes_the_hash(tmp_path, reads):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    (ckpt / "chat_template.jinja").write_text("{{ messages[0].content }}")
    before = checkpoint_hash(ckpt)
    (ckpt / "chat_template.jinja").write_text("<s>{{ messages[0].content }}")
    assert checkpoint_hash(ckpt) != before


def test_hash_changes_with_one_weight_byte_and_not_with_other_files(tmp_path, reads):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    before = checkpoint_hash(ckpt)
    (ckpt / "README.md").write_text("edited")
    assert checkpoint_hash(ckpt) == before
    data = bytearray((ckpt / "model.safetensors").read_bytes())
    data[100] ^= 0x01
    (ckpt / "model.safetensors").write_bytes(bytes(data))
    bump_mtime(ckpt / "model.safetensors")
    assert checkpoint_hash(ckpt) != before


def test_hash_changes_with_config_or_tokenizer_or_a_renamed_file(tmp_path, reads):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    base = checkpoint_hash(ckpt)
    (ckpt / "tokenizer.json").write_text('{"model": {"x": 1}}')
    assert checkpoint_hash(ckpt) != base
    (ckpt / "tokenizer.json").write_text('{"model": {}}')
    bump_mtime(ckpt / "tokenizer.json")
    assert checkpoint_hash(ckpt) == base
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00001.safetensors")
    assert checkpoint_hash(ckpt) != base


def test_same_content_elsewhere_has_the_same_hash(tmp_path, reads):
    a = make_checkpoint(tmp_path / "a")
    b = make_checkpoint(tmp_path / "b")
    assert checkpoint_hash(a) == checkpoint_hash(b)


def test_second_hash_of_an_unchanged_checkpoint_reads_no_file(tmp_path, reads):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    first = checkpoint_hash(ckpt)
    assert sorted(reads) == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer.model"]
    reads.clear()
    assert checkpoint_hash(ckpt) == first
    assert reads == []


def test_memo_rereads_only_the_file_whose_size_or_mtime_changed(tmp_path, reads):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    first = checkpoint_hash(ckpt)
    reads.clear()
    bump_mtime(ckpt / "config.json")
    assert checkpoint_hash(ckpt) == first
    assert reads == ["config.json"]
    reads.clear()
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes() + b"\0")
    assert checkpoint_hash(ckpt) != first
    assert reads == ["model.safetensors"]


def test_memo_file_serves_a_fresh_process(tmp_path, reads, monkeypatch):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    memo = tmp_path / "cache" / "v1" / "hashmemo.sqlite"
    first = checkpoint_hash(ckpt, memo_path=memo)
    monkeypatch.setattr(hashing, "_memo", {})  # as if a new process started
    reads.clear()
    assert checkpoint_hash(ckpt, memo_path=memo) == first
    assert reads == []


def test_pickle_only_checkpoint_is_refused_without_being_read(tmp_path, reads):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    (ckpt / "config.json").write_text("{}")
    with pytest.raises(CheckpointHashError, match=r"pytorch_model\.bin.*safetensors"):
        checkpoint_hash(ckpt)
    assert reads == []


def test_pickles_next_to_safetensors_are_listed_but_not_hashed(tmp_path, reads):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    (ckpt / "training_args.bin").write_bytes(b"\x80\x04")
    files = checkpoint_files(ckpt)
    assert files.pickles == ["training_args.bin"]
    assert "training_args.bin" not in files.hashed


def test_missing_directory_and_no_weights_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointHashError, match="not a directory"):
        checkpoint_hash(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointHashError, match="no \\*.safetensors"):
        checkpoint_hash(tmp_path / "empty")


@pytest.mark.parametrize(("make", "words"), [
    (lambda ck: (ck / "extra.safetensors").symlink_to("/dev/zero"), "extra.safetensors is a character device"),
    (lambda ck: os.mkfifo(ck / "special.json"), "special.json is a FIFO"),
    (lambda ck: (ck / "gone.safetensors").symlink_to(ck / "nowhere"), "gone.safetensors cannot be read"),
    (lambda ck: (ck / "self.json").symlink_to(ck / "self.json"), "self.json cannot be read"),
])
def test_what_is_not_a_regular_file_is_refused_by_name_without_being_opened(tmp_path, make, words):
    checkpoint = make_checkpoint(tmp_path / "ck")
    make(checkpoint)
    with pytest.raises(CheckpointHashError, match=words):
        checkpoint_hash(checkpoint)  # /dev/zero would never end, a FIFO would block on open


def test_files_in_subfolders_never_change_the_hash_and_top_level_ones_do(tmp_path, reads):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    before = checkpoint_hash(ckpt)
    (ckpt / "original").mkdir()  # a Llama-3 hub repo's Meta-format copy, which no build reads
    (ckpt / "original" / "params.json").write_text('{"dim": 4096}')
    (ckpt / "original" / "tokenizer.model").write_bytes(b"tiktoken")
    (ckpt / "loop").symlink_to(".")
    assert checkpoint_hash(ckpt) == before
    (ckpt / "params.json").write_text('{"dim": 4096}')
    assert checkpoint_hash(ckpt) != before
    (ckpt / "extra.safetensors").symlink_to(ckpt / "model.safetensors")  # a link to a file is followed
    assert "extra.safetensors" in checkpoint_files(ckpt).hashed


def test_a_looping_model_path_is_refused_in_one_line(tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(CheckpointHashError, match="not a directory"):
        checkpoint_files(tmp_path / "loop")


def test_a_checkpoint_in_a_folder_whose_name_is_not_utf8_is_hashed_and_memoised(tmp_path, reads, monkeypatch):
    ckpt = make_checkpoint(tmp_path / os.fsdecode(b"lat\xe9in1"))  # a Latin-1 name: a surrogate escape in Python
    memo = tmp_path / "cache" / "v1" / "hashmemo.sqlite"
    first = checkpoint_hash(ckpt, memo_path=memo)
    monkeypatch.setattr(hashing, "_memo", {})  # as if a new process started
    reads.clear()
    assert checkpoint_hash(ckpt, memo_path=memo) == first and reads == []
