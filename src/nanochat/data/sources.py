"""Corpus sources: the files --dataset_path names, listed, planned into units, read as documents.

1. `list_sources(path)`: every regular file under the path with a supported extension, by relative
   path, size and modification time: one stat per file, which is all a start-up reads of a corpus
   whose token store (nanochat.data.store) exists. Anything else is counted in `skipped`: other
   extensions, hidden entries, and special files (a FIFO would block the first read forever).
2. `plan_sources(sources)`: looks inside without tokenizing: parquet footers (schema, row groups),
   each .jsonl's first record and a UTF-8 check of every .jsonl byte, so a broken shard is one
   error before any work. It cuts the corpus into units that workers read independently: a
   parquet row group, ~8 MiB of .jsonl lines, a text file.
3. `read_unit`: a unit's documents in order, memory bounded by the largest document: parquet
   through pyarrow's buffered batch reader (it decodes page by page, not a whole row group),
   .jsonl line by line, a text file whole (it is one document).
4. The validation split: a document is in validation iff sha1(its id) falls in the lowest 2% of
   the hash range (id: relative path, `path#line`, `path#row`), so each document keeps its side
   when files come and go; split files (`train-*`, `validation-*`) are used as they are. The
   rules for tiny corpora (`SplitRule`) and the reasons: docs/data.md.

Every problem is a `DataError` naming the file (and line or row) and the fix.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
import stat
import sys
import sysconfig
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

from nanochat.data import instruct
from nanochat.common import format_bytes

TEXT_EXTENSIONS = (".txt", ".md", ".py")
SUPPORTED_EXTENSIONS = (*TEXT_EXTENSIONS, ".jsonl", ".parquet")
VAL_FRACTION = 0.02
"""Share of documents (by id hash) held out. On the default corpus (Python 3.11) that is 13 files,
230 KiB, 68k tokens with a 4096 vocabulary: twice the default --eval_tokens (32768) and 2% of the
training text."""
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
JSONL_RANGE_BYTES = 8 << 20
"""A .jsonl file is planned in ranges of about this many bytes, cut after a newline: the unit one
worker checks (UTF-8) and reads. Small enough to balance a single large file across cores."""
PARQUET_BATCH_ROWS = 64
"""Rows per pyarrow batch: with a buffered reader, memory is a few pages and 64 documents."""

BINARY = "binary (NUL bytes or not UTF-8)"
EMPTY = "empty"
SPECIAL = "not a regular file (FIFO, socket, device or broken link)"
TEST_SPLIT = "test split (never trained on)"
NOT_SPLIT = "not a split file (train*, validation*, test*)"

Role = Literal["train", "validation", ""]
"""A file's split: a train or validation split file, or "" (each document split by its id's hash)."""


class DataError(ValueError):
    """The corpus cannot be used as given; the message names the problem and the fix."""


# ------------------------------------------------------------------ listing
@dataclass(frozen=True)
class SourceFile:
    path: str
    """Relative to Sources.root, with forward slashes: the id of its documents."""
    size: int
    mtime_ns: int
    role: Role


@dataclass(frozen=True)
class Sources:
    """The files of a corpus, as one stat each found them."""

    name: str
    source: str
    """What was given (a path, or the standard library with its filter), for messages."""
    root: str
    """The directory the file paths are relative to (absolute)."""
    files: tuple[SourceFile, ...]
    skipped: dict[str, int] = field(default_factory=dict)
    """Reason -> count of files left out by the listing (extension, split layout, special files)."""
    split_layout: bool = False
    """The directory is laid out in train / validation split files."""
    target: str = ""
    """The real path of what was given (the corpus's identity: its token stores are kept by it)."""

    def listing(self) -> dict[str, Any]:
        """The listing as JSON: what a token store and a run record of the data they read."""
        return {"source": self.source, "root": self.root,
                "files": [[f.path, f.size, f.mtime_ns, f.role] for f in self.files]}

    @property
    def fingerprint(self) -> str:
        """16 hex digits of sha256 over the listing: changes when any file is added, removed,
        resized or modified (not when only the name of the corpus changes)."""
        files = self.listing()["files"]
        return hashlib.sha256(json.dumps([self.root, files]).encode()).hexdigest()[:16]

    def changes(self, listing: dict[str, Any]) -> list[str]:
        """How these files differ from a recorded `listing`: "x added", "y removed", "z changed
        (size a -> b bytes)" / "(modified <time> -> <time>)"; empty when they are the same."""
        old = {p: (size, mtime, role) for p, size, mtime, role in listing.get("files", [])}
        new = {f.path: (f.size, f.mtime_ns, f.role) for f in self.files}
        out = []
        for path in sorted(old.keys() | new.keys()):
            a, b = old.get(path), new.get(path)
            if a == b:
                continue
            if a is None:
                out.append(f"{path} was added")
            elif b is None:
                out.append(f"{path} was removed")
            elif a[0] != b[0]:
                out.append(f"{path} changed (size {a[0]:,} -> {b[0]:,} bytes)")
            elif a[1] != b[1]:
                out.append(f"{path} changed (modified {_time(a[1])} -> {_time(b[1])})")
            else:
                out.append(f"{path} changed split ({a[2] or 'hash'} -> {b[2] or 'hash'})")
        if not out and listing.get("root") != self.root:
            out.append(f"the corpus moved ({listing.get('root')} -> {self.root})")
        return out


def _time(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


def list_sources(dataset_path: str | os.PathLike | None = None, *,
                 exclude: Iterable[str | os.PathLike] = ()) -> Sources:
    """The files of the built-in stdlib corpus (None) or of `dataset_path`; `exclude`: directories
    never read as data (nanochat's own cache when it lies inside the corpus)."""
    skipped: Counter[str] = Counter()
    excluded = {os.path.realpath(p) for p in exclude}
    if dataset_path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        name = f"python{sys.version_info.major}.{sys.version_info.minor}-stdlib"
        found = [(p, st) for p, st in _walk(root, skipped, STDLIB_EXCLUDED_DIRS, excluded) if p.suffix == ".py"]
        if not found:
            raise DataError(f"this Python's standard library at {root} has no .py sources (a zipped "
                            "or stripped install?); pass --dataset_path with your own text")
        return Sources(name, f"{root}, *.py without tests", str(root.resolve()),
                       tuple(_source_file(root, p, st, "") for p, st in found), {}, target=str(root.resolve()))
    path = Path(dataset_path)
    name, source = path.name or str(path), str(path)
    if not path.exists():
        raise DataError(f"--dataset_path {path} does not exist; pass a text file or a directory "
                        f"of {', '.join(SUPPORTED_EXTENSIONS)} files, or omit it to use the "
                        "built-in Python standard-library corpus")
    if not path.is_dir():
        st = path.stat()
        if path.suffix.lower() not in SUPPORTED_EXTENSIONS:
            raise DataError(f"--dataset_path {path}: extension {path.suffix or '(none)'!r} is not "
                            f"supported; supported: {', '.join(SUPPORTED_EXTENSIONS)} (rename a "
                            "plain-text file to .txt)")
        if not stat.S_ISREG(st.st_mode):
            raise DataError(f"--dataset_path {path} is not a regular file (a FIFO, socket or device, which "
                            "cannot be read as a corpus); pass a file or a directory of files")
        return Sources(name, source, str(path.parent.resolve()), (_source_file(path.parent, path, st, ""),), {},
                       target=os.path.realpath(path))
    found = _walk(path, skipped, (), excluded)
    files = [(p, st) for p, st in found if p.suffix.lower() in SUPPORTED_EXTENSIONS]
    if not files:
        exts = Counter(p.suffix.lower() or "(no extension)" for p, _ in found)
        listing = ", ".join(f"{e} ({n})" for e, n in sorted(exts.items())) or "no files at all"
        raise DataError(f"--dataset_path {path} has no readable text files: found {listing}; "
                        f"supported: {', '.join(SUPPORTED_EXTENSIONS)}")
    for p, _ in found:
        if p.suffix.lower() not in SUPPORTED_EXTENSIONS:
            skipped[f"other extension ({p.suffix.lower() or 'none'})"] += 1
    roles = _split_roles(path, [p for p, _ in files], skipped)
    kept = [_source_file(path, p, st, roles[p] if roles else "") for p, st in files if not roles or p in roles]
    return Sources(name, source, str(path.resolve()), tuple(kept), dict(sorted(skipped.items())),
                   split_layout=roles is not None, target=os.path.realpath(path))


def _source_file(root: Path, p: Path, st: os.stat_result, role: Role) -> SourceFile:
    return SourceFile(p.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns, role)


def _walk(root: Path, skipped: Counter, excluded_names: Iterable[str],
          excluded_paths: set[str]) -> list[tuple[Path, os.stat_result]]:
    """Every regular file under `root` with its stat, sorted by relative path. Hidden entries
    (.git, .DS_Store: never training text) and __pycache__ are skipped silently, as are
    directories named in `excluded_names` or whose real path is in `excluded_paths`; special
    files (FIFOs, sockets, devices, broken links) are counted in `skipped`: opening a FIFO to
    read it would wait for a writer forever."""
    names = set(excluded_names) | {"__pycache__"}
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in names
                       and os.path.realpath(os.path.join(dirpath, d)) not in excluded_paths]
        for f in filenames:
            if f.startswith("."):
                continue
            p = Path(dirpath, f)
            try:
                st = p.stat()  # follows a link to the file it names
            except OSError:
                st = None
            if st is None or not stat.S_ISREG(st.st_mode):
                skipped[SPECIAL] += 1
                continue
            out.append((p, st))
    return sorted(out, key=lambda e: e[0].relative_to(root).as_posix())


_SPLIT_NAME = re.compile(r"^(train|validation|valid|val|dev|test)(?=$|[-_.])", re.IGNORECASE)


def _split_roles(root: Path, files: list[Path], skipped: Counter) -> dict[Path, Role] | None:
    """The role of each file kept when the directory is laid out in splits, as the hub's datasets
    are (`ARC-Challenge/train-00000-of-00001.parquet`, `validation-*`, `test-*`, or
    `train.jsonl`...): a file whose name starts with train / validation (valid, val, dev) / test
    followed by `-`, `_`, `.` or nothing. Test files are never read; other files (a README) are
    skipped. Without validation files the train files are split by hash (role ""). None when no
    file is so named: the hash split applies to every file."""
    kinds = {p: m.group(1).lower() if (m := _SPLIT_NAME.match(p.name)) else None for p in files}
    if not any(k is not None for k in kinds.values()):
        return None
    train = [p for p, k in kinds.items() if k == "train"]
    val = [p for p, k in kinds.items() if k in ("validation", "valid", "val", "dev")]
    for reason, n in ((TEST_SPLIT, sum(k == "test" for k in kinds.values())),
                      (NOT_SPLIT, sum(k is None for k in kinds.values()))):
        if n:
            skipped[reason] += n
    if not train:
        raise DataError(f"{root} is laid out in split files but has no train file (found: "
                        f"{', '.join(sorted(p.relative_to(root).as_posix() for p in files))}); name the "
                        "training file(s) train*.jsonl / train-*.parquet, or remove the split names to use "
                        "the hash split. A test split is never trained on")
    roles: dict[Path, Role] = {p: "train" if val else "" for p in train}
    roles.update({p: "validation" for p in val})
    return roles


# ------------------------------------------------------------------ plan
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
            shape, at, line = _first_record_shape(root / f.path)
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
                            if found and found[0].format == "text" and _has_text(root / f.path)), None)
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


def _first_record_shape(path: Path) -> tuple[str | None, str, int]:
    """(shape, location, line number) of a .jsonl file's first record; (None, "", 0) when it
    holds none."""
    for lineno, line in _lines(path, 0, None):
        if not line.strip():
            continue
        obj = _json_object(line, f"{path}:{lineno}")
        return _shape(obj, f"{path}:{lineno}", "line"), f"{path}:{lineno}", lineno
    return None, "", 0


def _has_text(path: Path) -> bool:
    raw = path.read_bytes()
    text = None if b"\x00" in raw else _utf8_or_none(raw)
    return bool(text and text.strip())


# ------------------------------------------------------------------ reading
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
    `skipped`, a malformed line or row is a DataError naming it."""
    root = Path(root)
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


def iter_documents(plan: Plan, skipped: Counter | None = None) -> Iterator[tuple[Unit, Doc]]:
    """Every document of the corpus in order, with the unit it is in."""
    skipped = Counter() if skipped is None else skipped
    for unit in plan.units:
        for doc in read_unit(plan.sources.root, unit, skipped):
            yield unit, doc


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


# ------------------------------------------------------------------ split
def val_hash(doc_id: str) -> float:
    """sha1(id) as a number in [0, 1): stable across runs, machines and Python versions."""
    return int.from_bytes(hashlib.sha1(doc_id.encode("utf-8")).digest()[:8], "big") / 2**64


@dataclass
class SplitRule:
    """Which side each document is on, decided from counts only (a token store decides it once
    every document has been read, `split_texts` as it reads).

    With validation split files that hold documents, the files decide ("role"). Otherwise a
    document is in validation iff val_hash(id) < VAL_FRACTION ("hash"), and a side left empty
    takes one document from the other: no validation document -> the one with the smallest hash
    is validation; no training document -> the one with the largest hash is training; a single
    document -> its last 2% of characters are validation ("cut")."""

    mode: Literal["role", "hash"]
    fallback: Literal["", "to_val", "to_train", "cut"] = ""
    moved: Any = None
    """Where the document that changes side is (the caller's handle: id or position)."""

    @staticmethod
    def decide(*, role_val_docs: int, docs: int, hash_val_docs: int, smallest: Any, largest: Any) -> "SplitRule":
        if role_val_docs:
            return SplitRule("role")
        if docs == 1:
            return SplitRule("hash", "cut", smallest)
        if hash_val_docs == 0:
            return SplitRule("hash", "to_val", smallest)
        if hash_val_docs == docs:
            return SplitRule("hash", "to_train", largest)
        return SplitRule("hash")

    def note(self, sources: Sources, cut_chars: int = 0) -> str:
        """What Corpus.split_note / the run header says about the split."""
        if self.mode == "role":
            val_files = sum(f.role == "validation" for f in sources.files)
            tests = sources.skipped.get(TEST_SPLIT)
            return (f"split files: train {len(sources.files) - val_files} file(s), validation {val_files} file(s)"
                    + (f"; {tests} test file(s) never read" if tests else ""))
        note = {"": f"val = sha1(doc id) < {VAL_FRACTION:g}",
                "to_val": f"no doc hashed below {VAL_FRACTION:g}: val = the doc with the smallest sha1",
                "to_train": f"every doc hashed below {VAL_FRACTION:g}: train = the doc with the largest sha1",
                "cut": f"one document: val = its last {cut_chars:,} characters"}[self.fallback]
        return f"train split files only, {note}" if sources.split_layout else note


def cut_point(text: str) -> int:
    """Where a single document is split: its last VAL_FRACTION of characters (at least one) are
    validation."""
    return len(text) - max(1, round(len(text) * VAL_FRACTION))


def split_texts(plan: Plan, max_chars: int, split: Literal["train", "val"] = "train") -> list[str]:
    """The first `max_chars` characters of the `split` documents in corpus order, split as a
    token store splits them (what a tokenizer trains on; what its compression is measured on).
    Reads until it has them and the split can no longer change them (a document of each side
    seen); a tiny corpus is read whole."""
    want_val = split == "val"
    role_val = any(u.role == "validation" for u in plan.units) and next(
        (True for u in plan.units if u.role == "validation" for _ in read_unit(plan.sources.root, u, Counter())), False)
    texts, chars = [], 0
    docs = hash_val = 0
    smallest = largest = None  # (hash, id)
    skipped: Counter = Counter()
    for unit, doc in iter_documents(plan, skipped):
        if role_val:
            is_val = unit.role == "validation"
        else:
            h = val_hash(doc.id)
            docs += 1
            smallest = (h, doc.id) if smallest is None or h < smallest[0] else smallest
            largest = (h, doc.id) if largest is None or h > largest[0] else largest
            is_val = h < VAL_FRACTION
            hash_val += is_val
        if is_val == want_val and chars < max_chars:
            texts.append(doc.text)
            chars += len(doc.text)
        if chars >= max_chars and (role_val or (hash_val and docs - hash_val)):
            return list(_take_chars(texts, max_chars))  # no rule can move a document across any more
    if role_val:
        if not texts and not want_val:
            raise DataError(f"--dataset_path {plan.sources.source}: the train split files hold no documents or records")
        return list(_take_chars(texts, max_chars))
    if docs == 0:
        raise DataError(empty_corpus_message(plan.sources.source, {**plan.sources.skipped, **skipped}))
    rule = SplitRule.decide(role_val_docs=0, docs=docs, hash_val_docs=hash_val,
                            smallest=smallest[1], largest=largest[1])
    if rule.fallback == "":
        return list(_take_chars(texts, max_chars))
    if rule.fallback == "cut" and plan.kind == "instruct":
        raise DataError(f"{plan.sources.source}: the corpus is a single instruction record ({rule.moved}); "
                        "training and validation need at least 2 records")
    out = []  # a document changes side: read again with the rule's outcome
    for _, doc in iter_documents(plan, Counter()):
        if rule.fallback == "cut":
            cut = cut_point(doc.text)
            if cut < 1:
                raise DataError(f"{plan.sources.source}: the corpus is a single {len(doc.text)}-character document; "
                                "training and validation need at least 2 characters")
            out.append(doc.text[cut:] if want_val else doc.text[:cut])
        elif (doc.id == rule.moved) == (want_val == (rule.fallback == "to_val")):
            out.append(doc.text)
    return list(_take_chars(out, max_chars))


def _take_chars(texts: Iterable[str], max_chars: int) -> Iterator[str]:
    left = max_chars
    for t in texts:
        if left <= 0:
            return
        yield t[:left]
        left -= len(t)


def empty_corpus_message(source: str, skipped: dict[str, int]) -> str:
    return (f"--dataset_path {source}: the corpus is empty after reading every file "
            f"({', '.join(f'{n} {w}' for w, n in sorted(skipped.items())) or 'nothing found'}); "
            "point it at files that contain UTF-8 text")


def describe(name: str, source: str, *, kind: str, docs: tuple[int, int], nbytes: tuple[int, int],
             split_note: str, skipped: dict[str, int], shapes: dict[str, int]) -> str:
    """One line about a corpus: size, documents, the split and what was skipped. `docs`, `nbytes`:
    (train, validation)."""
    unit = "records" if kind == "instruct" else "docs"
    shape_text = ", ".join(f"{n} {shape}" for shape, n in shapes.items())
    skipped_text = ", ".join(f"{n} {why}" for why, n in skipped.items())
    return (f"{name} ({source}): {format_bytes(sum(nbytes))} in {sum(docs)} {unit}"
            + (f" ({shape_text}; loss on assistant tokens only)" if shape_text else "")
            + f"; train {docs[0]} {unit} / {format_bytes(nbytes[0])}, val {docs[1]} {unit} / "
              f"{format_bytes(nbytes[1])} ({split_note})"
            + (f"; skipped {skipped_text}" if skipped_text else ""))


def unreadable(skipped: dict[str, int]) -> dict[str, int]:
    """The skips that deserve a warning: empty files and other extensions are expected."""
    return {why: n for why, n in skipped.items()
            if why not in (EMPTY, TEST_SPLIT, NOT_SPLIT) and not why.startswith("other")}
