"""Calibration and held-out samples: documents shuffled from a seed, tokenized, packed into rows of seq_len tokens.

Each document is encoded with the model's tokenizer (its own special tokens) and followed by the end-of-sequence
token; the stream is cut into rows of exactly seq_len tokens, so no padding or attention mask is needed. The gate
measures only text calibration does not use: held-out documents made only of paragraphs that the calibration data
also holds (whitespace aside; paragraphs as the .txt reader splits documents, so that the same text read from a .jsonl
and from a .txt matches) are left out, and a held-out set made mostly of them (a copy of the dataset) is refused.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kiln.calibration.errors import CalibrationError
from kiln.calibration.recipe import QuantizeRecipe
from kiln.calibration.sources import (
    RANDOM,
    RANDOM_SHA256,
    TextSource,
    paragraphs,
    read_documents,
    resolve_source,
    source_digest,
)

ENCODE_BATCH = 64


@dataclass
class CalibrationData:
    """Token rows for calibration ([num_samples, seq_len]) and for the held-out checks ([heldout_samples, seq_len])."""

    calibration: torch.Tensor
    heldout: torch.Tensor
    calibration_sha256: str
    heldout_sha256: str
    notes: list[str] = field(default_factory=list)  # documents left out, for the report

    def rounds(self, round_samples: int) -> list[torch.Tensor]:
        """The calibration rows split into rounds of round_samples (the last round may be shorter)."""
        return list(self.calibration.split(round_samples))


def load_calibration_data(recipe: QuantizeRecipe, tokenizer, dataset_root: Path | None = None, *,
                          embedding_rows: int | None = None) -> CalibrationData:
    """Read, shuffle (seeded), tokenize and pack the recipe's calibration and held-out text; for the "random" source,
    draw token ids uniformly over the tokenizer's vocabulary, capped at the model's ``embedding_rows`` (a tokenizer
    class may add special tokens past them), seeded; held-out rows from the next seed."""
    if recipe.dataset == RANDOM:
        vocab = min(len(tokenizer), embedding_rows or len(tokenizer))

        def rows(count: int, seed: int) -> torch.Tensor:
            generator = torch.Generator().manual_seed(seed)
            return torch.randint(0, vocab, (count, recipe.seq_len), generator=generator)

        return CalibrationData(calibration=rows(recipe.num_samples, recipe.seed),
                               heldout=rows(recipe.heldout_samples, recipe.seed + 1),
                               calibration_sha256=RANDOM_SHA256, heldout_sha256=RANDOM_SHA256)
    source = resolve_source(recipe.dataset, "calibration", dataset_root)
    label = f"{source.field} '{source.spec}'"
    docs = _shuffled(read_documents(source, recipe.text_field), recipe.seed)
    notes: list[str] = []
    if recipe.heldout_is_split:
        heldout_source = source
        docs, heldout_docs = _split_heldout(docs, tokenizer, recipe, label, notes)
        calibration_label, heldout_label = f"{label} less its held-out split", f"{label} (held-out split)"
    else:
        heldout_source = resolve_source(recipe.heldout, "heldout", dataset_root)
        heldout_docs, heldout_label = _heldout_unseen(heldout_source, docs, label, recipe, notes)
        calibration_label = label
    calibration = _pack(docs, tokenizer, recipe.seq_len, recipe.num_samples, calibration_label, "num_samples")
    heldout = _pack(heldout_docs, tokenizer, recipe.seq_len, recipe.heldout_samples, heldout_label,
                    "heldout_samples")
    for rows, what in ((calibration, calibration_label), (heldout, heldout_label)):
        _within_embeddings(rows, embedding_rows, what)
    calibration_sha256 = source_digest(source)
    return CalibrationData(
        calibration=calibration,
        heldout=heldout,
        calibration_sha256=calibration_sha256,
        heldout_sha256=calibration_sha256 if heldout_source is source else source_digest(heldout_source),
        notes=notes,
    )


def _within_embeddings(rows: torch.Tensor, embedding_rows: int | None, label: str) -> None:
    """CalibrationError where the tokenizer gave ``label``'s text a token id the model has no embedding for (a token
    added to tokenizer.json past config.json's vocab_size), which the model's forward would fail on."""
    if embedding_rows is not None and rows.numel() and (largest := int(rows.max())) >= embedding_rows:
        raise CalibrationError(f"the tokenizer encodes {label} with token id {largest}, outside the model's "
                               f"{embedding_rows} embeddings (vocab_size in config.json): the tokenizer files do not "
                               f"match the weights; fix tokenizer.json's added_tokens, or resize the embeddings")


def _split_heldout(docs: list[str], tokenizer, recipe: QuantizeRecipe, label: str,
                   notes: list[str]) -> tuple[list[str], list[str]]:
    """(calibration, held-out): documents taken from the end of the shuffled list until they hold the held-out rows,
    and the rest less the repeats of those (a document repeated in the dataset is on one side only)."""
    used = _docs_covering(list(reversed(docs)), tokenizer, recipe.heldout_samples * recipe.seq_len)
    if used == len(docs):
        raise CalibrationError(
            f"{label}: its held-out split takes all {used} of its documents to fill quantize.heldout_samples="
            f"{recipe.heldout_samples} rows of {recipe.seq_len} tokens, leaving none to calibrate on; split the text "
            "into more documents (JSONL lines, blank-line paragraphs of .txt), give quantize.heldout text of its own, "
            "or lower quantize.heldout_samples")
    heldout = docs[len(docs) - used:]
    calibration, repeated = _without(docs[: len(docs) - used], heldout)
    if repeated:
        notes.append(f"{label}: {repeated} documents repeat held-out ones and were left out of calibration")
    return calibration, heldout


def _heldout_unseen(heldout_source: TextSource, calibration_docs: list[str], label: str, recipe: QuantizeRecipe,
                    notes: list[str]) -> tuple[list[str], str]:
    """The held-out source's shuffled documents less those the calibration data also holds, and their label; a
    held-out set that is mostly calibration text (a copy, a link) is refused."""
    heldout_label = f"{heldout_source.field} '{heldout_source.spec}'"
    docs = _shuffled(read_documents(heldout_source, recipe.text_field), recipe.seed)
    unseen, shared = _without(docs, calibration_docs)
    if 2 * shared > len(docs):
        raise CalibrationError(
            f"{heldout_label} shares {shared} of {len(docs)} documents with {label}: the gate would measure text "
            "calibration saw; give quantize.heldout text of its own, or set it to quantize.dataset's value to split "
            "held-out documents off the dataset")
    if shared:
        notes.append(f"{heldout_label}: {shared} of {len(docs)} documents are also in {label} and were left out "
                     "of the held-out checks")
        heldout_label += f" less the {shared} documents it shares with {label}"
    return unseen, heldout_label


def _without(docs: list[str], others: list[str]) -> tuple[list[str], int]:
    """`docs`, in order, less those whose text, or every paragraph of it (``sources.paragraphs``), is a document or a
    paragraph of `others`, whitespace aside; and how many were left out.

    Paragraphs are the granularity every reader shares: a .txt file reads each as a document, a JSONL line may hold
    several. A document that shares only some paragraphs (a heading, a signature, a quotation) stays: a short repeated
    paragraph does not make the rest of it text calibration saw."""
    seen = {_text_key(text) for doc in others for text in (doc, *paragraphs(doc))}
    kept = [doc for doc in docs
            if _text_key(doc) not in seen and not all(_text_key(p) in seen for p in paragraphs(doc))]
    return kept, len(docs) - len(kept)


def _text_key(text: str) -> bytes:
    """A text's identity for overlap checks: a digest of its words, so runs of whitespace do not count."""
    return hashlib.blake2b(" ".join(text.split()).encode(), digest_size=16).digest()


def _shuffled(docs: list[str], seed: int) -> list[str]:
    docs = list(docs)
    random.Random(seed).shuffle(docs)
    return docs


def _encoded(docs: list[str], tokenizer) -> Iterator[list[int]]:
    """Token ids of each document followed by the end-of-sequence token, encoded in batches."""
    eos = tokenizer.eos_token_id
    for start in range(0, len(docs), ENCODE_BATCH):
        for ids in tokenizer(docs[start: start + ENCODE_BATCH], add_special_tokens=True, verbose=False)["input_ids"]:
            yield ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def _docs_covering(docs: list[str], tokenizer, tokens: int) -> int:
    """How many leading documents it takes to hold `tokens` tokens (all of them if they never do)."""
    total = 0
    for count, ids in enumerate(_encoded(docs, tokenizer), 1):
        total += len(ids)
        if total >= tokens:
            return count
    return len(docs)


def _pack(docs: list[str], tokenizer, seq_len: int, rows: int, label: str, budget: str) -> torch.Tensor:
    """The first `rows` rows of seq_len tokens from the documents' concatenated token stream."""
    stream: list[int] = []
    for ids in _encoded(docs, tokenizer):
        stream.extend(ids)
        if len(stream) >= rows * seq_len:
            return torch.tensor(stream[: rows * seq_len], dtype=torch.long).view(rows, seq_len)
    raise CalibrationError(
        f"{label} gives {len(stream) // seq_len} samples of {seq_len} tokens, fewer than quantize.{budget}="
        f"{rows}; lower quantize.{budget} or quantize.seq_len, or add text"
    )
