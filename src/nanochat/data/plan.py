"""The plan: a corpus cut into units of work, every file checked before any of it is tokenized.

`plan_sources(sources)` looks inside the files without tokenizing them: each parquet footer
(schema, row groups), each .jsonl's first record, and every .jsonl byte checked as UTF-8 in
parallel (`map_fn`: a process pool's map). A 0-byte shard, a parquet without a "text" column, a
non-UTF-8 or NUL-holding line, a corpus mixing plain text and instruction records: each is one
`DataError` naming the file (and line) before any work: a broken shard holds thousands of
documents, which would vanish from the run unnoticed (a binary *text* file is one document, and
is skipped and counted instead).

The plan cuts the corpus into units (nanochat.data.read): a parquet row group, ~8 MiB of .jsonl
lines cut after a newline (a single large file is still spread over every core), a text file.
`Plan.pieces` groups them into what one worker tokenizes (nanochat.data.build), and the plan is
cached as JSON beside the stores for the listing it was made from.
"""

from __future__ import annotations

import codecs
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from nanochat.data import instruct
from nanochat.data.read import Doc, Unit, first_record_shape, has_text, read_unit
from nanochat.data.sources import DataError, SourceFile, Sources

JSONL_RANGE_BYTES = 8 << 20
"""A .jsonl file is planned in ranges of about this many bytes, cut after a newline: the unit one
worker checks (UTF-8) and reads. Small enough to balance a single large file across cores."""


@dataclass(frozen=True)
class Plan:
    """A corpus cut into units, checked before any of it is tokenized."""

    sources: Sources
    kind: Literal["text", "instruct"]
    units: tuple[Unit, ...]

    def pieces(self, piece_bytes: int) -> list[tuple[Unit, ...]]:
        """Consecutive units grouped into pieces of about `piece_bytes` (a piece never spans two
        .jsonl / .parquet files, nor two roles): what one worker tokenizes into one file."""
        out: list[list[Unit]] = []
        size = 0
        for u in self.units:
            last = out[-1][-1] if out else None
            joins = (last is not None and size < piece_bytes and last.role == u.role
                     and (u.path == last.path or (u.format == last.format == "text")))
            if joins:
                out[-1].append(u)
                size += u.nbytes
            else:
                out.append([u])
                size = u.nbytes
        return [tuple(p) for p in out]

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    def to_json(self) -> dict[str, Any]:
        return {"sources": {"name": self.sources.name, "skipped": self.sources.skipped,
                            "split_layout": self.sources.split_layout, "target": self.sources.target,
                            **self.sources.listing()},
                "kind": self.kind, "units": [list(u) for u in self.units]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Plan":
        s = d["sources"]
        sources = Sources(s["name"], s["source"], s["root"], tuple(SourceFile(*f) for f in s["files"]),
                          dict(s["skipped"]), s["split_layout"], s["target"])
        return cls(sources, d["kind"], tuple(Unit(*u) for u in d["units"]))


def plan_sources(sources: Sources, *, map_fn=map) -> Plan:
    """Check every file's format and cut the corpus into units (see the module docstring).
    `map_fn`: how the .jsonl ranges are checked (a process pool's map, to use every core)."""
    root = Path(sources.root)
    per_file: list[tuple[SourceFile, list[Unit], str | None, str | None]] = []  # (file, units, shape, first doc id)
    jsonl = {}
    for f in sources.files:
        ext = Path(f.path).suffix.lower()
        if ext == ".parquet":
            units, shape, _ = _parquet_units(root, f)
            per_file.append((f, units, shape, f"{f.path}#0"))
        elif ext == ".jsonl":
            jsonl[f.path] = _jsonl_ranges(root / f.path, f.size)
            per_file.append((f, [], None, None))  # after the UTF-8 check below
        else:
            per_file.append((f, [Unit(f.path, "text", 0, f.size, 0, f.size, f.role, None, f.path)], None, None))
    # the .jsonl ranges, checked in parallel: UTF-8 throughout, and the line each one starts at
    tasks = [(str(root / path), a, b) for path, ranges in jsonl.items() for a, b in ranges]
    scans = iter(list(map_fn(_scan_jsonl_range, tasks)))
    first_line: dict[tuple[str, int], int] = {}
    for path, ranges in jsonl.items():
        line = 1
        for a, _ in ranges:
            newlines, problem = next(scans)
            if problem is not None:
                at, what = problem
                raise DataError(f"{root / path}:{line + at}: {what}; a .jsonl file must be UTF-8 text, one JSON "
                                "object per line: convert it (e.g. iconv -t UTF-8) or remove it")
            first_line[(path, a)] = line
            line += newlines
    text_at = record_at = None
    units: list[Unit] = []
    for f, found, shape, first_id in per_file:
        if f.path in jsonl and jsonl[f.path]:
            shape, at, line = first_record_shape(root / f.path)
            first_id = f"{f.path}#{line}"
            found = [Unit(f.path, "jsonl", a, b, first_line[(f.path, a)], b - a, f.role, shape, at)
                     for a, b in jsonl[f.path]]
        units += found
        if shape == "text" and text_at is None:
            text_at = first_id
        elif shape not in (None, "text") and record_at is None:
            record_at = first_id
    if record_at is not None:
        if text_at is None:  # plain text files count only if they hold text: an empty README does not
            text_at = next((f.path for f, found, shape, _ in per_file
                            if found and found[0].format == "text" and has_text(root / f.path)), None)
        if text_at is not None:
            raise DataError(f"--dataset_path {sources.source} mixes plain text ({text_at}) and instruction "
                            f"records ({record_at}); a corpus is one or the other: keep pretraining text and "
                            "fine-tuning records in separate directories and train on one at a time")
    return Plan(sources, "instruct" if record_at is not None else "text", tuple(units))


def _parquet_units(root: Path, f: SourceFile) -> tuple[list[Unit], str | None, str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = root / f.path
    if f.size == 0:
        raise DataError(f"{path}: an empty (0-byte) file, not a parquet shard (an interrupted download or "
                        "copy?); download it again or remove it")
    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
        names = schema.names
        if "text" in names:
            t = schema.field("text").type
            if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
                raise DataError(f'{path}: column "text" has type {t}, expected string')
            columns, shape, at = ["text"], "text", f"{f.path}#0"
        else:
            if instruct.record_shape(dict.fromkeys(names, "")) is None:
                raise DataError(f'{path}: no "text" column (columns: {names}) and no instruction-record '
                                'columns; the documents must be in a string column named "text", or the rows '
                                f"must be records of a supported shape: {instruct.SHAPES_HELP}")
            columns, at = names, f"{path} row 0"
            first = next(pf.iter_batches(batch_size=1), None)
            shape = instruct.record_shape(first.to_pylist()[0]) if first is not None and first.num_rows else None
        md = pf.metadata
        units, row = [], 0
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            nbytes = sum(rg.column(c).total_uncompressed_size for c in range(rg.num_columns)
                         if rg.column(c).path_in_schema.split(".")[0] in columns)
            if rg.num_rows:
                units.append(Unit(f.path, "parquet", g, g + 1, row, nbytes, f.role, shape, at))
            row += rg.num_rows
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file ({e}); download it again or remove it") from None
    return units, (shape if units else None), at


def _jsonl_ranges(path: Path, size: int) -> list[tuple[int, int]]:
    """[start, stop) byte ranges of about JSONL_RANGE_BYTES, each starting a line."""
    cuts = [0]
    with open(path, "rb") as f:
        pos = JSONL_RANGE_BYTES
        while pos < size:
            f.seek(pos)
            while (block := f.read(1 << 16)) and b"\n" not in block:
                pos += len(block)
            if not block:
                break
            pos += block.index(b"\n") + 1
            if pos >= size:
                break
            cuts.append(pos)
            pos += JSONL_RANGE_BYTES
    return [(a, b) for a, b in zip(cuts, cuts[1:] + [size]) if b > a]


def _scan_jsonl_range(task: tuple[str, int, int]) -> tuple[int, tuple[int, str] | None]:
    """(newlines in the range, None), or (_, (line offset in the range, what)) at its first problem."""
    path, start, stop = task
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    newlines = 0
    with open(path, "rb") as f:
        f.seek(start)
        left = stop - start
        while left > 0:
            block = f.read(min(left, 1 << 24))
            if not block:
                break
            left -= len(block)
            nul = block.find(b"\0")
            kept = len(decoder.getstate()[0])
            try:
                decoder.decode(block, final=left <= 0)
            except UnicodeDecodeError as e:
                at = max(0, e.start - kept)  # e.start counts the bytes kept from the previous block
                return newlines, (newlines + block[:at].count(b"\n"),
                                  f"not UTF-8 (byte 0x{e.object[e.start:e.start + 1].hex()})")
            if nul >= 0:
                return newlines, (newlines + block[:nul].count(b"\n"), "a NUL byte (binary data, or UTF-16 text)")
            newlines += block.count(b"\n")
    return newlines, None


def iter_documents(plan: Plan, skipped: Counter | None = None) -> Iterator[tuple[Unit, Doc]]:
    """Every document of the corpus in order, with the unit it is in."""
    skipped = Counter() if skipped is None else skipped
    for unit in plan.units:
        for doc in read_unit(plan.sources.root, unit, skipped):
            yield unit, doc
