"""Reading a corpus: the units a worker reads on its own, and the documents each one holds.

A `Unit` is a part of one file: a parquet row group, a range of .jsonl lines (nanochat.data.plan
cuts them, about 8 MiB each, after a newline), or a text file. `read_unit` yields its documents
in order, with memory bounded by the largest document:
- parquet through pyarrow's buffered batch reader, which decodes page by page, not a whole row
  group at once (its memory: docs/data.md);
- .jsonl line by line, split at "\\n" only (JSON strings may hold U+2028), its "text" field or an
  instruction record (nanochat.data.instruct); one file holds one record shape;
- a text file whole: it is one document.
A document's id is its relative path, `path#line` or `path#row`: what the validation split
hashes (nanochat.data.split). Empty documents, binary text files and lone surrogates are counted
in `skipped`; a malformed .jsonl line or parquet row is a `DataError` naming it.
"""

from __future__ import annotations

import codecs
import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal, NamedTuple

from nanochat.data import instruct
from nanochat.data.sources import BINARY, EMPTY, DataError, Role

PARQUET_BATCH_ROWS = 64
"""Rows per pyarrow batch: with a buffered reader, memory is a few pages and 64 documents."""


class Unit(NamedTuple):
    """A part of one file that a worker reads on its own."""

    path: str
    format: Literal["text", "jsonl", "parquet"]
    start: int
    """jsonl: first byte; parquet: first row group; text: 0."""
    stop: int
    """jsonl: one past the last byte; parquet: one past the last row group; text: the size."""
    first: int
    """jsonl: the number of the range's first line (1-based); parquet: the index of its first row."""
    nbytes: int
    """Bytes of text it holds, about (parquet: the uncompressed column data): progress, pieces."""
    role: Role
    shape: str | None
    """jsonl / parquet: the shape of the file's first record (instruct.record_shape); None: text file."""
    shape_at: str
    """Where that first record is, for messages."""


class Doc(NamedTuple):
    id: str
    text: str
    """The document; for a record its message contents joined by blank lines (what a tokenizer
    trains on, what bytes are counted of)."""
    messages: list[dict[str, str]] | None = None
    """None for a plain document."""
    shape: str = "text"


def read_unit(root: str | os.PathLike, unit: Unit, skipped: Counter) -> Iterator[Doc]:
    """The documents (or records) of `unit`, in order; empty or unreadable ones are counted in
    `skipped`, a malformed line or row is a DataError naming it, and so is a file that is gone:
    it was listed, so it disappeared since (deleted or moved during the build)."""
    try:
        yield from _read_unit(Path(root), unit, skipped)
    except FileNotFoundError as e:
        raise DataError(f"{e.filename or Path(root) / unit.path}: this corpus file disappeared while the corpus was "
                        "being read (deleted or moved after it was listed, during the token store's build or the "
                        "tokenizer's training); restore it, or run again to use the corpus as it is now") from None


def _read_unit(root: Path, unit: Unit, skipped: Counter) -> Iterator[Doc]:
    path = root / unit.path
    if unit.format == "parquet":
        yield from _read_parquet(path, unit, skipped)
    elif unit.format == "jsonl":
        first = (unit.shape, unit.shape_at) if unit.shape is not None else None

        def objects() -> Iterator[tuple[str, str, Any]]:
            for lineno, line in _lines(path, unit.start, unit.stop, first_line=unit.first):
                if line.strip():
                    yield f"{path}:{lineno}", f"{unit.path}#{lineno}", _json_object(line, f"{path}:{lineno}")

        yield from _records(objects(), "line", skipped, first)
    else:
        raw = path.read_bytes()
        text = None if b"\x00" in raw else _utf8_or_none(raw)  # NUL never occurs in real text
        if text is None:
            skipped[BINARY] += 1
        elif text.strip():
            yield Doc(unit.path, text)
        else:
            skipped[EMPTY] += 1


def first_record_shape(path: Path) -> tuple[str | None, str, int]:
    """(shape, location, line number) of a .jsonl file's first record; (None, "", 0) when it
    holds none."""
    for lineno, line in _lines(path, 0, None):
        if not line.strip():
            continue
        obj = _json_object(line, f"{path}:{lineno}")
        return _shape(obj, f"{path}:{lineno}", "line"), f"{path}:{lineno}", lineno
    return None, "", 0


def has_text(path: Path) -> bool:
    """Whether a text file holds any text (UTF-8, no NUL byte, not only whitespace)."""
    raw = path.read_bytes()
    text = None if b"\x00" in raw else _utf8_or_none(raw)
    return bool(text and text.strip())


def _utf8_or_none(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _lines(path: Path, start: int, stop: int | None, *, first_line: int = 1) -> Iterator[tuple[int, str]]:
    """(number, text) of each line of path[start:stop], split at "\\n" only: JSON strings may hold
    raw U+2028 / U+0085, which are not record separators, and numbering by "\\n" matches what
    editors and error messages show. A UTF-8 byte-order mark opening the file is dropped."""
    with open(path, "rb") as f:
        f.seek(start)
        left = None if stop is None else stop - start
        carry, lineno = b"", first_line
        while left is None or left > 0:
            block = f.read(1 << 20 if left is None else min(left, 1 << 20))
            if not block:
                break
            if left is not None:
                left -= len(block)
            if start == 0 and lineno == first_line and not carry and block.startswith(codecs.BOM_UTF8):
                block = block[len(codecs.BOM_UTF8):]
            parts = (carry + block).split(b"\n")
            carry = parts.pop()
            for raw in parts:
                yield lineno, _decode_line(raw, path, lineno)
                lineno += 1
        if carry:
            yield lineno, _decode_line(carry, path, lineno)


def _decode_line(raw: bytes, path: Path, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}:{lineno}: not UTF-8 ({e.reason} at column {e.start + 1}); a .jsonl file "
                        "must be UTF-8 text: convert it (e.g. iconv -t UTF-8) or remove it") from None


def _json_object(line: str, where: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON ({e.msg}, column {e.colno}); each line of a "
                        '.jsonl file must be one JSON object like {"text": "..."}') from None


def _shape(obj: Any, where: str, unit: str) -> str:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: the {unit} is a JSON {type(obj).__name__}, not an object; supported "
                        f"record shapes: {instruct.SHAPES_HELP}")
    shape = instruct.record_shape(obj)
    if shape is None:
        nulls = sorted(k for k, v in obj.items() if v is None)
        raise DataError(f'{where}: no "text" field and no instruction-record fields (the {unit} has fields '
                        f"{sorted(obj)}{f', null: {nulls}' if nulls else ''}); each {unit} must have one "
                        f'of the supported record shapes, e.g. {{"text": "..."}}: {instruct.SHAPES_HELP}')
    return shape


def _records(objects: Iterable[tuple[str, str, Any]], unit: str, skipped: Counter,
             first: tuple[str, str] | None) -> Iterator[Doc]:
    """Documents / records of one file's (location, id, object) triples, all of the shape of the
    file's first object (`first`: its shape and location)."""
    for where, doc_id, obj in objects:
        shape = _shape(obj, where, unit)
        if first is None:
            first = (shape, where)
        elif shape != first[0]:
            raise DataError(f"{where}: a {shape} record, but the file's first {unit} ({first[1]}) is a {first[0]} "
                            "record; one file must hold one record shape (a stray line is usually an export "
                            "bug; to mix shapes, put each in its own file)")
        if shape == "text":
            doc = obj["text"]
            if doc is None:
                doc = ""
            if not isinstance(doc, str):
                raise DataError(f'{where}: "text" is a JSON {type(doc).__name__}, expected a string')
            yield from _checked_doc(doc_id, doc, skipped)
            continue
        try:
            messages = instruct.to_messages(obj, shape)
        except ValueError as e:
            raise DataError(f"{where}: {shape} record: {e}; supported record shapes: {instruct.SHAPES_HELP}") from None
        text = "\n\n".join(m["content"] for m in messages)
        for _ in _checked_doc(doc_id, text, skipped):
            yield Doc(doc_id, text, messages, shape)


def _read_parquet(path: Path, unit: Unit, skipped: Counter) -> Iterator[Doc]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = unit.shape == "text"
    row = unit.first
    try:
        # buffer_size: pages are read and decoded as batches need them, not a whole row group
        pf = pq.ParquetFile(path, buffer_size=1 << 20, pre_buffer=False)
        batches = pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=list(range(unit.start, unit.stop)),
                                  columns=["text"] if text else None)
        first = (unit.shape, unit.shape_at)
        for batch in batches:
            if text:
                for doc in batch.column(0).to_pylist():
                    yield from _checked_doc(f"{unit.path}#{row}", doc or "", skipped)
                    row += 1
            else:
                rows = batch.to_pylist()
                yield from _records(((f"{path} row {row + i}", f"{unit.path}#{row + i}", r)
                                     for i, r in enumerate(rows)), "row", skipped, first)
                row += len(rows)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: row group {unit.start}, near row {row}, does not read ({e}); download the "
                        "file again or remove it") from None


def _checked_doc(doc_id: str, doc: str, skipped: Counter) -> Iterator[Doc]:
    if not doc.strip():
        skipped[EMPTY] += 1
        return
    try:
        doc.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates, e.g. a broken "\ud800" escape in JSON
        skipped["invalid Unicode (lone surrogates)"] += 1
        return
    yield Doc(doc_id, doc)
