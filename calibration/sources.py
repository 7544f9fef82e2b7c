"""Where calibration and held-out text comes from: the bundled set, local files or folders, a Hugging Face dataset.

A source spec is "bundled", a path (a .txt, .jsonl or .parquet file, or a folder of them), or
"hf:<name>[:<config>[:<split>]]" (the dataset repo's data files of that config folder and split, fetched into the
Hugging Face cache); or "random", seeded random token ids and no text at all (``datasets``), for checkpoints with
random weights. Parquet needs pyarrow. This module resolves a spec to files, reads their documents and hashes
their bytes; it imports no torch.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kiln.calibration.errors import CalibrationError

BUNDLED_DIR = Path(__file__).resolve().parents[1] / "data" / "tiny"
RANDOM = "random"
RANDOM_SHA256 = hashlib.sha256(b"kiln: seeded random token ids").hexdigest()  # the ids follow from seed and shape
BUNDLED_FILES = {"calibration": "calibration.jsonl", "heldout": "heldout.jsonl"}
TEXT_SUFFIXES = (".jsonl", ".txt", ".parquet")

Role = Literal["calibration", "heldout"]


@dataclass(frozen=True)
class TextSource:
    """A resolved source: the config field it came from, the spec as written, and its files in reading order."""

    field: str
    spec: str
    root: Path
    files: tuple[Path, ...]


def _field(role: Role) -> str:
    return "quantize.dataset" if role == "calibration" else "quantize.heldout"


def resolve_source(spec: str, role: Role, dataset_root: Path | None = None) -> TextSource:
    """Resolve a spec to its text files; raise CalibrationError when there are none."""
    field = _field(role)
    if spec == "bundled":
        path = BUNDLED_DIR / BUNDLED_FILES[role]
        if not path.is_file():
            raise CalibrationError(f"{field}: the bundled set {path} is missing; regenerate it with "
                                   f"tools/train_tiny_llama.py --data-only or point {field} at your own text")
        return TextSource(field, spec, path.parent, (path,))
    path = _download_hf(spec, field) if spec.startswith("hf:") else Path(spec).expanduser()
    if not path.is_absolute():
        path = (dataset_root or Path.cwd()) / path
    if not path.exists():
        raise CalibrationError(f"{field}: {path} does not exist; point it at a .jsonl, .txt or .parquet file, a "
                               "folder of them, 'hf:<name>' or 'bundled'")
    if path.is_file():
        if path.suffix not in TEXT_SUFFIXES:  # read as prose, a JSON array or a .gz would calibrate on its syntax
            raise CalibrationError(f"{field}: {path} is not a .jsonl, .txt or .parquet file; convert it to JSONL (one "
                                   f"{{\"text\": ...}} object a line), or rename a plain-text file to .txt")
        return TextSource(field, spec, path.parent, (path,))
    files = tuple(sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES))
    if not files:
        raise CalibrationError(f"{field}: folder {path} holds no .jsonl, .txt or .parquet files; add text files or "
                               f"point {field} at a file")
    return TextSource(field, spec, path, files)


def _download_hf(spec: str, field: str) -> Path:
    """Fetch the data files of a Hugging Face dataset repo (its <config>/ folder, files starting with <split>)."""
    from huggingface_hub import snapshot_download

    name, _, rest = spec[len("hf:"):].partition(":")
    config, _, split = rest.partition(":")
    prefix = (f"{config}/" if config else "") + split
    try:
        local = snapshot_download(repo_id=name, repo_type="dataset",
                                  allow_patterns=[f"{prefix}*{suffix}" for suffix in TEXT_SUFFIXES])
    except Exception as exc:  # the hub raises many kinds: offline, not found, gated, network
        raise CalibrationError(f"{field}: cannot fetch Hugging Face dataset '{name}' ({type(exc).__name__}); "
                               "check the name and the network, or download it and give a local path") from exc
    path = Path(local) / config if config else Path(local)
    if not path.is_dir() or not any(p.suffix in TEXT_SUFFIXES for p in path.rglob("*")):
        raise CalibrationError(f"{field}: Hugging Face dataset '{spec[3:]}' has no .jsonl, .txt or .parquet files "
                               "there; check the config and split names")
    return path


def source_sha256(spec: str, role: Role, dataset_root: Path | None = None) -> str:
    """sha256 over the bytes of the source's files (and, for a folder, their relative names, in reading order)."""
    return RANDOM_SHA256 if spec == RANDOM else source_digest(resolve_source(spec, role, dataset_root))


def source_digest(source: TextSource) -> str:
    """``source_sha256`` of a source already resolved."""
    if len(source.files) == 1 and source.files[0].parent == source.root:
        return _file_sha256(source.files[0])
    digest = hashlib.sha256()
    for path in source.files:
        digest.update(f"{path.relative_to(source.root).as_posix()}\0{_file_sha256(path)}\n".encode())
    return digest.hexdigest()


def _file_sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_documents(source: TextSource, text_field: str) -> list[str]:
    """The non-empty documents of a source: one per JSONL line or parquet row, one per paragraph of .txt.
    The bundled set always keeps its text in the field "text"."""
    text_field = "text" if source.spec == "bundled" else text_field
    docs: list[str] = []
    for path in source.files:
        if path.suffix == ".jsonl":
            docs.extend(_read_jsonl(path, text_field, source.field))
        elif path.suffix == ".parquet":
            docs.extend(_read_parquet(path, text_field, source.field))
        else:
            docs.extend(paragraphs(_utf8_text(path, source.field)))
    if not docs:
        names = ", ".join(str(p) for p in source.files[:3])
        raise CalibrationError(f"{source.field}: {names} holds no text documents; add text or choose another source")
    return docs


def paragraphs(text: str) -> list[str]:
    """The non-empty blank-line-separated paragraphs of `text`, stripped: the documents of a .txt file."""
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def _utf8_text(path: Path, field: str) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")  # a byte-order mark, as some editors write, is not text
    except UnicodeDecodeError as exc:
        raise CalibrationError(f"{field}: {path} is not UTF-8 text ({exc.reason} at byte {exc.start}); re-encode it "
                               "as UTF-8 (and decompress a compressed file)") from None


def _read_jsonl(path: Path, text_field: str, field: str) -> list[str]:
    docs = []
    for number, line in enumerate(_utf8_text(path, field).split("\n"), 1):  # JSON strings may hold U+2028
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CalibrationError(f"{field}: {path}:{number} is not valid JSON ({exc.msg}); fix or remove the "
                                   "line") from exc
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise CalibrationError(f"{field}: {path}:{number} has no string field '{text_field}'; set "
                                   "quantize.text_field to the field that holds the text")
        if text.strip():
            docs.append(text)
    return docs


def _read_parquet(path: Path, text_field: str, field: str) -> list[str]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise CalibrationError(f"{field}: {path} is parquet, which needs pyarrow; pip install pyarrow, or convert the "
                               "data to JSONL") from None
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as exc:
        raise CalibrationError(f"{field}: {path} cannot be read as parquet ({str(exc).splitlines()[0]}); check the "
                               "file, or convert it to JSONL") from None
    if text_field not in schema.names:
        raise CalibrationError(f"{field}: {path} has no column '{text_field}' (columns: {', '.join(schema.names)}); "
                               "set quantize.text_field to the text column")
    column_type = schema.field(text_field).type
    value_type = column_type.value_type if pa.types.is_dictionary(column_type) else column_type
    if not (pa.types.is_string(value_type) or pa.types.is_large_string(value_type)
            or pa.types.is_string_view(value_type)):
        raise CalibrationError(f"{field}: {path} column '{text_field}' holds {column_type}, not strings; set "
                               "quantize.text_field to the text column, or convert it to strings")
    docs = []
    for row, text in enumerate(pq.read_table(path, columns=[text_field]).column(text_field).to_pylist()):
        if text is None:  # as a JSONL line without the string is refused
            raise CalibrationError(f"{field}: {path} row {row} (from 0) has no string in column '{text_field}' "
                                   "(null); drop the row or fill it")
        if text.strip():
            docs.append(text)
    return docs
