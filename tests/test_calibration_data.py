"""Calibration data: sources, seeded sampling, the held-out split, and clear errors for bad data."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoTokenizer

from kiln.calibration import CalibrationError, QuantizeRecipe
from kiln.calibration.datasets import load_calibration_data
from kiln.calibration.sources import read_documents, resolve_source
from tests.calibration_factories import corpus, write_jsonl, write_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def recipe(dataset, heldout=None, **fields) -> QuantizeRecipe:
    values = {"format": "fp8", "dataset": str(dataset), "heldout": str(heldout or dataset), "seq_len": 16,
              "num_samples": 8, "round_samples": 4, "heldout_samples": 2}
    return QuantizeRecipe(**(values | fields))


def test_same_seed_gives_the_same_samples_and_another_seed_others(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "c.jsonl", corpus(60))
    first = load_calibration_data(recipe(data, "bundled"), tokenizer)
    again = load_calibration_data(recipe(data, "bundled"), tokenizer)
    other = load_calibration_data(recipe(data, "bundled", seed=1), tokenizer)
    assert first.calibration.shape == (8, 16) and first.heldout.shape == (2, 16)
    assert torch.equal(first.calibration, again.calibration) and torch.equal(first.heldout, again.heldout)
    assert not torch.equal(first.calibration, other.calibration)
    assert [len(r) for r in first.rounds(3)] == [3, 3, 2]


def test_heldout_split_from_the_dataset_never_shares_a_document(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "c.jsonl", numbered(40))
    split = load_calibration_data(recipe(data, heldout_samples=4), tokenizer)
    assert numbers(tokenizer, split.heldout) and numbers(tokenizer, split.calibration)
    assert not numbers(tokenizer, split.heldout) & numbers(tokenizer, split.calibration)


def numbered(count: int, start: int = 0) -> list[str]:
    return [f"document number {i} says " + " ".join(["hello world"] * 12) for i in range(start, start + count)]


def numbers(tokenizer, rows) -> set[int]:
    return {int(n) for row in rows for n in re.findall(r"number (\d+)", tokenizer.decode(row))}


def test_a_document_repeated_in_the_dataset_lands_on_one_side_of_the_split(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "c.jsonl", numbered(30) * 2)
    split = load_calibration_data(recipe(data, heldout_samples=4), tokenizer)
    assert numbers(tokenizer, split.heldout) and numbers(tokenizer, split.calibration)
    assert not numbers(tokenizer, split.heldout) & numbers(tokenizer, split.calibration)
    assert any("repeat held-out ones and were left out of calibration" in note for note in split.notes)


def test_a_split_that_takes_the_only_document_says_so(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "c.jsonl", [" ".join(["hello world"] * 400)])
    with pytest.raises(CalibrationError, match=r"held-out split takes all 1 of its documents .* leaving none to "
                                               r"calibrate on; split the text into more documents"):
        load_calibration_data(recipe(data), tokenizer)


@pytest.mark.parametrize("tail", ["", "\n", '{"text": "one more document of its own"}\n', "link"])
def test_heldout_that_is_mostly_the_datasets_text_is_refused(tmp_path, tokenizer, tail):
    """A link, a copy, a copy with a blank line or one more document: the gate would measure calibration rows."""
    data = write_jsonl(tmp_path / "calib.jsonl", numbered(40))
    heldout = tmp_path / "heldout.jsonl"
    if tail == "link":
        heldout.symlink_to(data)
    else:
        heldout.write_text(data.read_text() + tail)
    total = 41 if "one more" in tail else 40
    with pytest.raises(CalibrationError, match=rf"quantize.heldout '.*heldout.jsonl' shares 40 of {total} documents "
                                               r"with quantize.dataset '.*calib.jsonl': the gate would measure"):
        load_calibration_data(recipe(data, heldout), tokenizer)


@pytest.mark.parametrize(("dataset", "heldout", "shared"), [("calib.jsonl", "calib.txt", "40 of 40"),
                                                          ("calib.txt", "calib.jsonl", "20 of 20")])
def test_the_same_text_read_by_another_reader_is_refused_as_heldout(tmp_path, tokenizer, dataset, heldout, shared):
    docs = [f"{first}\n\n{second}" for first, second in zip(numbered(20), numbered(20, 100), strict=True)]
    write_jsonl(tmp_path / "calib.jsonl", docs)  # a document a line: 20 of two paragraphs
    (tmp_path / "calib.txt").write_text("\n\n".join(docs) + "\n")  # a document a paragraph: 40
    with pytest.raises(CalibrationError, match=rf"'.*{heldout}' shares {shared} documents with .*'.*{dataset}'"):
        load_calibration_data(recipe(tmp_path / dataset, tmp_path / heldout), tokenizer)


def test_a_heldout_paragraph_of_a_calibration_document_is_left_out_and_a_shared_short_one_is_not(tmp_path, tokenizer):
    signed = [f"{doc}\n\nThanks for reading." for doc in numbered(40)]
    data = write_jsonl(tmp_path / "calib.jsonl", signed[:20])
    heldout = write_jsonl(tmp_path / "heldout.jsonl", [*signed[20:], numbered(1)[0]])  # calib.jsonl's first paragraph
    loaded = load_calibration_data(recipe(data, heldout), tokenizer)
    assert loaded.notes == [f"quantize.heldout '{heldout}': 1 of 21 documents are also in quantize.dataset '{data}' "
                            "and were left out of the held-out checks"]
    assert numbers(tokenizer, loaded.heldout) <= set(range(20, 40))


def test_heldout_documents_calibration_also_holds_are_left_out_and_noted(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "calib.jsonl", numbered(40))
    shared = [numbered(1, 3)[0] + "  \n", numbered(1, 7)[0]]  # whitespace aside, the same text
    heldout = write_jsonl(tmp_path / "heldout.jsonl", numbered(20, 100) + shared)
    tokens = sum(len(ids) + 1 for ids in tokenizer(numbered(20, 100))["input_ids"])
    loaded = load_calibration_data(recipe(data, heldout, heldout_samples=tokens // 16), tokenizer)
    assert numbers(tokenizer, loaded.heldout) <= set(range(100, 120))
    assert loaded.notes == [f"quantize.heldout '{heldout}': 2 of 22 documents are also in quantize.dataset "
                            f"'{data}' and were left out of the held-out checks"]
    again = load_calibration_data(recipe(data, heldout, heldout_samples=tokens // 16), tokenizer)
    assert torch.equal(loaded.heldout, again.heldout) and torch.equal(loaded.calibration, again.calibration)


def test_the_library_refuses_a_heldout_copy_as_the_cli_does(tmp_path):
    from kiln.calibration.quantize import quantize_checkpoint
    from tests.calibration_factories import make_checkpoint, small_recipe

    data = write_jsonl(tmp_path / "calib.jsonl", corpus(40))
    (tmp_path / "copy.jsonl").write_text(data.read_text() + "\n")
    with pytest.raises(CalibrationError, match="shares 40 of 40 documents"):
        quantize_checkpoint(make_checkpoint(tmp_path / "model"), small_recipe(
            format="fp8", dataset=str(data), heldout=str(tmp_path / "copy.jsonl")), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_folders_and_text_files_are_read_in_sorted_order_by_paragraph(tmp_path):
    (tmp_path / "b.txt").write_text("second file first paragraph\n\nsecond paragraph\n")
    write_jsonl(tmp_path / "a.jsonl", ["from jsonl"])
    (tmp_path / "ignored.csv").write_text("x,y\n")
    docs = read_documents(resolve_source(str(tmp_path), "calibration"), "text")
    assert docs == ["from jsonl", "second file first paragraph", "second paragraph"]


@pytest.mark.parametrize("name", ["c.jsonl", "c.txt"])
def test_a_utf8_byte_order_mark_is_not_part_of_the_text(tmp_path, name):
    body = '{"text": "first"}\n' if name == "c.jsonl" else "first\n"
    (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + body.encode())
    assert read_documents(resolve_source(str(tmp_path / name), "calibration"), "text") == ["first"]


@pytest.mark.parametrize(("values", "kind"), [
    ([1, 2], "int64"), ([["a"], ["b"]], "list<"), ([b"a", b"b"], "binary")])
def test_a_parquet_text_column_of_another_type_is_refused_naming_it(tmp_path, values, kind):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"text": values}), tmp_path / "c.parquet")
    with pytest.raises(CalibrationError, match=rf"c.parquet column 'text' holds {re.escape(kind)}.*, not strings"):
        read_documents(resolve_source(str(tmp_path / "c.parquet"), "calibration"), "text")


def test_a_null_in_a_parquet_text_column_is_refused_naming_the_row_as_jsonl_names_the_line(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"text": ["first", "", None]}), tmp_path / "c.parquet")
    with pytest.raises(CalibrationError, match=r"c.parquet row 2 \(from 0\) has no string in column 'text'"):
        read_documents(resolve_source(str(tmp_path / "c.parquet"), "calibration"), "text")
    pq.write_table(pa.table({"text": pa.array(["first", "", "third"]).dictionary_encode()}), tmp_path / "c.parquet")
    assert read_documents(resolve_source(str(tmp_path / "c.parquet"), "calibration"), "text") == ["first", "third"]


def test_missing_dataset_is_named_with_a_fix(tmp_path, tokenizer):
    with pytest.raises(CalibrationError, match=r"quantize.dataset: .*missing.jsonl does not exist; point it"):
        load_calibration_data(recipe(tmp_path / "missing.jsonl"), tokenizer)


def test_empty_dataset_is_rejected(tmp_path, tokenizer):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(CalibrationError, match="holds no text documents"):
        load_calibration_data(recipe(tmp_path / "empty.jsonl"), tokenizer)


@pytest.mark.parametrize(("name", "content", "words"), [
    ("c.json", b'[{"text": "a"}]', "is not a .jsonl, .txt or .parquet file"),  # read as prose it would calibrate
    ("c.jsonl.gz", b"\x1f\x8b\x08", "is not a .jsonl, .txt or .parquet file"),
    ("c.jsonl", b'\xff\xfe{"text": "a"}\n', "is not UTF-8 text"),
    ("c.txt", b"caf\xe9 au lait", "is not UTF-8 text"),
    ("c.parquet", b"not parquet", "cannot be read as parquet"),
])
def test_a_file_of_another_kind_or_encoding_is_refused_naming_it(tmp_path, name, content, words):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(CalibrationError, match=f"quantize.dataset: .*{re.escape(name)} {words}"):
        read_documents(resolve_source(str(tmp_path / name), "calibration"), "text")


def test_dataset_smaller_than_the_budget_says_how_many_samples_it_gives(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "small.jsonl", corpus(2))
    with pytest.raises(CalibrationError, match=r"gives \d+ samples of 16 tokens, fewer than quantize.num_samples=500"):
        load_calibration_data(recipe(data, "bundled", num_samples=500), tokenizer)


def test_a_token_id_past_the_models_embeddings_is_refused_naming_the_mismatch(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "c.jsonl", corpus(60))
    largest = int(load_calibration_data(recipe(data, "bundled"), tokenizer).calibration.max())
    assert load_calibration_data(recipe(data, "bundled"), tokenizer, embedding_rows=largest + 1).calibration.numel()
    with pytest.raises(CalibrationError, match=rf"token id {largest}, outside the model's {largest} embeddings"):
        load_calibration_data(recipe(data, "bundled"), tokenizer, embedding_rows=largest)


def test_jsonl_without_the_text_field_points_at_text_field(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "c.jsonl", corpus(5), field="article")
    with pytest.raises(CalibrationError, match=r"c.jsonl:1 has no string field 'text'; set quantize.text_field"):
        load_calibration_data(recipe(data), tokenizer)
    assert load_calibration_data(recipe(data, "bundled", text_field="article", num_samples=2, round_samples=2),
                                 tokenizer).calibration.shape == (2, 16)


def test_unreachable_hub_dataset_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CalibrationError, match="cannot fetch Hugging Face dataset 'nobody/nothing'"):
        resolve_source("hf:nobody/nothing:cfg", "calibration")


def test_random_token_ids_are_seeded_rows_over_the_vocabulary_with_their_own_heldout_rows(tokenizer):
    recipe = QuantizeRecipe(format="fp8", dataset="random", heldout="random", num_samples=6, round_samples=6,
                            heldout_samples=3, seq_len=16, seed=4)
    data = load_calibration_data(recipe, tokenizer)
    assert data.calibration.shape == (6, 16) and data.heldout.shape == (3, 16)
    assert int(data.calibration.min()) >= 0 and int(data.calibration.max()) < len(tokenizer)
    assert torch.equal(load_calibration_data(recipe, tokenizer).calibration, data.calibration)
    assert not torch.equal(data.heldout, data.calibration[:3])
    assert not torch.equal(load_calibration_data(recipe.model_copy(update={"seed": 5}), tokenizer).calibration,
                           data.calibration)


def test_random_token_ids_stay_inside_the_model_embedding_when_the_tokenizer_adds_special_tokens(tokenizer):
    """transformers' Qwen2Tokenizer adds <|endoftext|> past a small random vocabulary: ids must still embed."""
    recipe = QuantizeRecipe(format="fp8", dataset="random", heldout="random", num_samples=64, round_samples=64,
                            heldout_samples=64, seq_len=64, seed=0)
    rows = len(tokenizer) - 1
    data = load_calibration_data(recipe, tokenizer, embedding_rows=rows)
    assert int(data.calibration.max()) == rows - 1 and int(data.heldout.max()) == rows - 1
