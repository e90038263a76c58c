"""Corpora -> documents -> one token stream -> deterministic (x, y) batches.

1. Documents: `load_corpus(path)` reads a file or a directory of .txt / .md / .py (a file is a
   document), .jsonl / .parquet (a line or row with "text" is a document; one without may be an
   instruction record, `nanochat.instruct`). Without a path: this Python's standard library.
2. Validation split: a document is in validation iff sha1(its id) falls in the lowest 2% of the
   hash range (stable when files come and go, no seed); split files (`train-*`, `validation-*`)
   are used as they are.
3. Token stream: `tokenize_docs` joins BOS-prefixed documents into one stream (cached, keyed by
   content and tokenizer); `tokenize_records` + `pack_records` do the same for records, with a
   loss mask and no record crossing a window boundary.
4. Batches: `TokenBatches` cuts seq_len+1 windows with stride seq_len, visits them in an order
   seeded by (seed, epoch), gives rank r its slice of each global batch, and resumes from two
   ints (epoch, step).

Every data problem is a `DataError` raised before any model is built, naming the fix. Why each
choice was made, with the figures: docs/data.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
import sysconfig
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from tqdm import tqdm

from nanochat import instruct
from nanochat.common import format_bytes, logger, umask, warn_once, write_atomic
from nanochat.tokenizer import META_FILE, Tokenizer, take_chars

TEXT_EXTENSIONS = (".txt", ".md", ".py")
SUPPORTED_EXTENSIONS = (*TEXT_EXTENSIONS, ".jsonl", ".parquet")
VAL_FRACTION = 0.02
"""Share of documents (by id hash) held out. On the default corpus (Python 3.11) that is 13 files,
230 KiB, 68k tokens with a 4096 vocabulary: twice the default --eval_tokens (32768) and 2% of the
training text."""
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
DEFAULT_MAX_CHARS = 20_000_000
"""Characters a tokenizer is trained on when trained on the fly (TokTrainConfig's default)."""

_BINARY = "binary (NUL bytes or not UTF-8)"
_EMPTY = "empty"


class DataError(ValueError):
    """The corpus cannot be used as given; the message names the problem and the fix."""


@dataclass(frozen=True, kw_only=True)
class Corpus:
    """A corpus split into training and validation documents (plain strings) or, when `kind` is
    "instruct", instruction records (chat message lists) with their text in the docs fields."""

    name: str
    source: str
    train_docs: list[str]
    """The documents; for an instruct corpus each record's message contents joined by blank lines
    (the text a tokenizer is trained on and the corpus fingerprint hashes)."""
    val_docs: list[str]
    train_ids: list[str]
    """Document ids (relative path, `path#line`, `path#row`), parallel to train_docs."""
    val_ids: list[str]
    kind: Literal["text", "instruct"] = "text"
    """text: plain documents, every token scored. instruct: records, only assistant tokens scored."""
    train_records: list[list[dict[str, str]]] = field(default_factory=list)
    """instruct only: each record as [{"role", "content"}, ...], parallel to train_ids."""
    val_records: list[list[dict[str, str]]] = field(default_factory=list)
    shapes: dict[str, int] = field(default_factory=dict)
    """instruct only: record shape ("prompt/completion", "messages", "multiple choice") -> count."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Reason -> count of files (or jsonl lines / parquet rows) left out."""
    split_note: str = "hash split"
    num_bytes: int = 0
    """UTF-8 bytes of all documents, train and val."""
    train_bytes: int = 0
    fingerprint: str = ""
    """16 hex digits of sha256 over the documents of both splits: keys tokenizer caches."""

    def describe(self) -> str:
        train_b = self.train_bytes
        skipped = ", ".join(f"{n} {why}" for why, n in self.skipped.items())
        unit = "records" if self.kind == "instruct" else "docs"
        shapes = ", ".join(f"{n} {shape}" for shape, n in self.shapes.items())
        return (
            f"{self.name} ({self.source}): {format_bytes(self.num_bytes)} in "
            f"{len(self.train_docs) + len(self.val_docs)} {unit}"
            + (f" ({shapes}; loss on assistant tokens only)" if shapes else "")
            + f"; train {len(self.train_docs)} {unit} / {format_bytes(train_b)}, val {len(self.val_docs)} "
            f"{unit} / {format_bytes(self.num_bytes - train_b)} ({self.split_note})"
            + (f"; skipped {skipped}" if skipped else "")
        )


class _Doc(NamedTuple):
    id: str
    text: str
    messages: list[dict[str, str]] | None = None
    """None for a plain document."""
    shape: str = "text"


# ------------------------------------------------------------------ corpora
def load_corpus(dataset_path: str | os.PathLike | None = None) -> Corpus:
    """The built-in stdlib corpus (None) or the documents under `dataset_path`, split."""
    skipped: Counter[str] = Counter()
    if dataset_path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        name = f"python{sys.version_info.major}.{sys.version_info.minor}-stdlib"
        files = [p for p in _walk(root, STDLIB_EXCLUDED_DIRS) if p.suffix == ".py"]
        if not files:
            raise DataError(f"this Python's standard library at {root} has no .py sources (a zipped "
                            "or stripped install?); pass --dataset_path with your own text")
        docs = list(_read_files(root, files, skipped))
        source = f"{root}, *.py without tests"
    else:
        path = Path(dataset_path)
        name, source = path.name or str(path), str(path)
        if not path.exists():
            raise DataError(f"--dataset_path {path} does not exist; pass a text file or a directory "
                            f"of {', '.join(SUPPORTED_EXTENSIONS)} files, or omit it to use the "
                            "built-in Python standard-library corpus")
        if path.is_file():
            if path.suffix.lower() not in SUPPORTED_EXTENSIONS:
                raise DataError(f"--dataset_path {path}: extension {path.suffix or '(none)'!r} is not "
                                f"supported; supported: {', '.join(SUPPORTED_EXTENSIONS)} (rename a "
                                "plain-text file to .txt)")
            root, files = path.parent, [path]
        else:
            root, found = path, _walk(path)
            files = [p for p in found if p.suffix.lower() in SUPPORTED_EXTENSIONS]
            if not files:
                exts = Counter(p.suffix.lower() or "(no extension)" for p in found)
                listing = ", ".join(f"{e} ({n})" for e, n in sorted(exts.items())) or "no files at all"
                raise DataError(f"--dataset_path {path} has no readable text files: found {listing}; "
                                f"supported: {', '.join(SUPPORTED_EXTENSIONS)}")
            for p in found:
                if p.suffix.lower() not in SUPPORTED_EXTENSIONS:
                    skipped[f"other extension ({p.suffix.lower() or 'none'})"] += 1
            split_files = _split_files(root, files, skipped)
            if split_files is not None:
                return _from_split_files(name, source, root, *split_files, skipped)
        docs = list(_read_files(root, files, skipped))
    unreadable = {why: n for why, n in skipped.items() if why != _EMPTY and not why.startswith("other")}
    if unreadable:  # empty files and other extensions are expected; only these deserve a warning
        warn_once(f"data-skipped:{source}", f"{source}: skipped " +
                  ", ".join(f"{n} {why}" for why, n in sorted(unreadable.items())))
    if not docs:
        raise DataError(f"--dataset_path {source}: the corpus is empty after reading every file "
                        f"({', '.join(f'{n} {w}' for w, n in sorted(skipped.items())) or 'nothing found'}); "
                        "point it at files that contain UTF-8 text")
    _check_one_kind(source, docs)
    return _split(name, source, docs, dict(sorted(skipped.items())))


def _check_one_kind(source: str, docs: list[_Doc]) -> None:
    plain = next((d.id for d in docs if d.messages is None), None)
    record = next((d.id for d in docs if d.messages is not None), None)
    if plain is not None and record is not None:
        raise DataError(f"--dataset_path {source} mixes plain text ({plain}) and instruction records "
                        f"({record}); a corpus is one or the other: keep pretraining text and fine-tuning "
                        "records in separate directories and train on one at a time")


_SPLIT_NAME = re.compile(r"^(train|validation|valid|val|dev|test)(?=$|[-_.])", re.IGNORECASE)
_TEST_SPLIT = "test split (never trained on)"
_NOT_SPLIT = "not a split file (train*, validation*, test*)"



def _from_split_files(name: str, source: str, root: Path, train_files: list[Path], val_files: list[Path],
                      skipped: Counter[str]) -> Corpus:
    """The corpus of a directory with train/validation split files (_split_files)."""
    train = list(_read_files(root, train_files, skipped))
    val = list(_read_files(root, val_files, skipped))
    _check_one_kind(source, train + val)
    if not train:
        raise DataError(f"--dataset_path {source}: the train split files hold no documents or records")
    if not val:  # no validation file: held out from the train split by hash, as usual
        corpus = _split(name, source, train, dict(sorted(skipped.items())))
        return dataclasses.replace(corpus, split_note=f"train split files only, {corpus.split_note}")
    note = (f"split files: train {len(train_files)} file(s), validation {len(val_files)} file(s)"
            + (f"; {skipped[_TEST_SPLIT]} test file(s) never read" if skipped.get(_TEST_SPLIT) else ""))
    return _corpus(name, source, train, val, note, dict(sorted(skipped.items())))

def _split_files(root: Path, files: list[Path], skipped: Counter) -> tuple[list[Path], list[Path]] | None:
    """(train files, validation files) when the directory is laid out in splits, as the hub's
    datasets are (`ARC-Challenge/train-00000-of-00001.parquet`, `validation-*`, `test-*`, or
    `train.jsonl`...): a file whose name starts with train / validation (valid, val, dev) / test
    followed by `-`, `_`, `.` or nothing. Test files are never read; other files (a README) are
    skipped. None when no file is so named: the hash split applies."""
    kinds = {p: m.group(1).lower() if (m := _SPLIT_NAME.match(p.name)) else None for p in files}
    if not any(k in ("train", "test", "validation", "valid", "val", "dev") for k in kinds.values()):
        return None
    train = [p for p, k in kinds.items() if k == "train"]
    val = [p for p, k in kinds.items() if k in ("validation", "valid", "val", "dev")]
    for reason, n in ((_TEST_SPLIT, sum(k == "test" for k in kinds.values())),
                      (_NOT_SPLIT, sum(k is None for k in kinds.values()))):
        if n:
            skipped[reason] += n
    if not train:
        raise DataError(f"{root} is laid out in split files but has no train file (found: "
                        f"{', '.join(sorted(p.relative_to(root).as_posix() for p in files))}); name the "
                        "training file(s) train*.jsonl / train-*.parquet, or remove the split names to use "
                        "the hash split. A test split is never trained on")
    return train, val


def _walk(root: Path, excluded: Iterable[str] = ()) -> list[Path]:
    """Every regular file under `root`, sorted by relative path; hidden entries are skipped
    (.git, .DS_Store: never training text), as are directories named in `excluded`."""
    excluded = set(excluded)
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in excluded and d != "__pycache__"]
        out += [Path(dirpath, f) for f in filenames if not f.startswith(".")]
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def _read_files(root: Path, files: list[Path], skipped: Counter) -> Iterator[_Doc]:
    """Every document (or record) in `files`; problems are counted or raised."""
    for path in files:
        rel = path.relative_to(root).as_posix()
        ext = path.suffix.lower()
        if ext == ".parquet":  # columnar and binary: read with pyarrow, not as text
            yield from _read_parquet(path, rel, skipped)
            continue
        raw = path.read_bytes()
        text = None if b"\x00" in raw else _utf8_or_none(raw)  # NUL never occurs in real text
        if text is None:
            skipped[_BINARY] += 1
            continue
        if ext == ".jsonl":
            yield from _read_jsonl(text, path, rel, skipped)
        elif text.strip():
            yield _Doc(rel, text)
        else:
            skipped[_EMPTY] += 1


def _utf8_or_none(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _read_jsonl(text: str, path: Path, rel: str, skipped: Counter) -> Iterator[_Doc]:
    # split("\n"), not splitlines(): JSON strings may hold raw U+2028 / U+0085, which are not
    # record separators; numbering by "\n" also matches what editors and error messages show.
    def objects() -> Iterator[tuple[str, str, Any]]:
        for lineno, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg}, column {e.colno}); each line of a "
                                '.jsonl file must be one JSON object like {"text": "..."}') from None
            yield f"{path}:{lineno}", f"{rel}#{lineno}", obj

    yield from _records(objects(), "line", skipped)


def _records(objects: Iterable[tuple[str, str, Any]], unit: str, skipped: Counter) -> Iterator[_Doc]:
    """Documents / records of one file's (location, id, object) triples, all of one shape."""
    first: tuple[str, str] | None = None  # (shape, location) of the file's first object
    for where, doc_id, obj in objects:
        if not isinstance(obj, dict):
            raise DataError(f"{where}: the {unit} is a JSON {type(obj).__name__}, not an object; supported "
                            f"record shapes: {instruct.SHAPES_HELP}")
        shape = instruct.record_shape(obj)
        if shape is None:
            nulls = sorted(k for k, v in obj.items() if v is None)
            raise DataError(f'{where}: no "text" field and no instruction-record fields (the {unit} has fields '
                            f"{sorted(obj)}{f', null: {nulls}' if nulls else ''}); each {unit} must have one "
                            f'of the supported record shapes, e.g. {{"text": "..."}}: {instruct.SHAPES_HELP}')
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
        yield from _checked_record(doc_id, messages, shape, skipped)


def _read_parquet(path: Path, rel: str, skipped: Counter) -> Iterator[_Doc]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
        if "text" not in schema.names:
            if instruct.record_shape(dict.fromkeys(schema.names, "")) is None:
                raise DataError(f'{path}: no "text" column (columns: {schema.names}) and no instruction-record '
                                'columns; the documents must be in a string column named "text", or the rows '
                                f"must be records of a supported shape: {instruct.SHAPES_HELP}")
            rows = pq.read_table(path).to_pylist()  # nested columns (messages, choices) as dicts / lists
        else:
            if not (pa.types.is_string(schema.field("text").type) or pa.types.is_large_string(schema.field("text").type)):
                raise DataError(f'{path}: column "text" has type {schema.field("text").type}, expected string')
            rows = None
            column = pq.read_table(path, columns=["text"]).column("text").to_pylist()
    except pa.ArrowException as e:
        raise DataError(f"{path}: not a readable parquet file ({e})") from None
    if rows is not None:
        yield from _records(((f"{path} row {i}", f"{rel}#{i}", r) for i, r in enumerate(rows)), "row", skipped)
        return
    for row, doc in enumerate(column):
        yield from _checked_doc(f"{rel}#{row}", doc or "", skipped)


def _checked_doc(doc_id: str, doc: str, skipped: Counter) -> Iterator[_Doc]:
    if not doc.strip():
        skipped[_EMPTY] += 1
        return
    try:
        doc.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates, e.g. a broken "\ud800" escape in JSON
        skipped["invalid Unicode (lone surrogates)"] += 1
        return
    yield _Doc(doc_id, doc)


def _checked_record(doc_id: str, messages: list[dict[str, str]], shape: str, skipped: Counter) -> Iterator[_Doc]:
    text = "\n\n".join(m["content"] for m in messages)
    for _ in _checked_doc(doc_id, text, skipped):
        yield _Doc(doc_id, text, messages, shape)


def _val_hash(doc_id: str) -> float:
    """sha1(id) as a number in [0, 1): stable across runs, machines and Python versions."""
    return int.from_bytes(hashlib.sha1(doc_id.encode("utf-8")).digest()[:8], "big") / 2**64


def _split(name: str, source: str, docs: list[_Doc], skipped: dict[str, int]) -> Corpus:
    train = [d for d in docs if _val_hash(d.id) >= VAL_FRACTION]
    val = [d for d in docs if _val_hash(d.id) < VAL_FRACTION]
    note = f"val = sha1(doc id) < {VAL_FRACTION:g}"
    records = docs[0].messages is not None  # load_corpus made sure all docs are of one kind
    if not train or not val:
        if len(docs) == 1:
            (d,) = docs
            if records:
                raise DataError(f"{source}: the corpus is a single instruction record ({d.id}); training and "
                                "validation need at least 2 records")
            if len(d.text) < 2:
                raise DataError(f"{source}: the corpus is a single {len(d.text)}-character document; "
                                "training and validation need at least 2 characters")
            cut = len(d.text) - max(1, round(len(d.text) * VAL_FRACTION))
            train, val = [_Doc(d.id, d.text[:cut])], [_Doc(f"{d.id}[{cut}:]", d.text[cut:])]
            note = f"one document: val = its last {len(d.text) - cut:,} characters"
        elif not val:
            val = [min(docs, key=lambda d: _val_hash(d.id))]
            train = [d for d in docs if d.id != val[0].id]
            note = f"no doc hashed below {VAL_FRACTION:g}: val = the doc with the smallest sha1"
        else:
            train = [max(docs, key=lambda d: _val_hash(d.id))]
            val = [d for d in docs if d.id != train[0].id]
            note = f"every doc hashed below {VAL_FRACTION:g}: train = the doc with the largest sha1"
    return _corpus(name, source, train, val, note, skipped)


def _corpus(name: str, source: str, train: list[_Doc], val: list[_Doc], note: str,
            skipped: dict[str, int]) -> Corpus:
    docs = train + val
    records = docs[0].messages is not None
    h = hashlib.sha256()
    nbytes = {b"T": 0, b"V": 0}
    for tag, part in ((b"T", train), (b"V", val)):
        for d in part:
            b = d.text.encode("utf-8")
            nbytes[tag] += len(b)
            h.update(tag + len(b).to_bytes(8, "little") + b)
    return Corpus(
        name=name, source=source, train_docs=[d.text for d in train], val_docs=[d.text for d in val],
        train_ids=[d.id for d in train], val_ids=[d.id for d in val], skipped=skipped,
        split_note=note, num_bytes=nbytes[b"T"] + nbytes[b"V"], train_bytes=nbytes[b"T"],
        fingerprint=h.hexdigest()[:16], kind="instruct" if records else "text",
        train_records=[d.messages for d in train] if records else [],
        val_records=[d.messages for d in val] if records else [],
        shapes=dict(sorted(Counter(d.shape for d in docs).items())) if records else {},
    )


# ---------------------------------------------------------------- tokenizer
def get_or_train_tokenizer(corpus: Corpus, vocab_size: int, cache_root: str | os.PathLike,
                           max_chars: int = DEFAULT_MAX_CHARS, *, progress: bool = True) -> Tokenizer:
    """The tokenizer trained on `corpus` (first `max_chars` characters of its train docs), from
    `cache_root/tokenizer-<corpus fp>-<vocab>[-<max_chars>chars]/` when already trained there.

    The directory appears atomically (written to a temp dir, then renamed), so an interrupted run
    leaves no half-written tokenizer and concurrent processes (torchrun ranks) agree: a loser of
    the rename race loads the winner's, identical, tokenizer.
    """
    cache_root = Path(cache_root)
    total_chars = sum(len(d) for d in corpus.train_docs)
    suffix = f"-{max_chars}chars" if max_chars < total_chars else ""
    target = cache_root / f"tokenizer-{corpus.fingerprint}-{vocab_size}{suffix}"
    if (target / META_FILE).is_file():
        try:
            tok = Tokenizer.load(target)
        except (OSError, ValueError) as e:
            raise DataError(f"cached tokenizer {target} is unreadable ({e}); delete that directory "
                            "to retrain it") from None
        logger.info("tokenizer: %s from cache %s", tok, target)
        return tok
    n_chars = min(max_chars, total_chars)
    logger.info("tokenizer: training a %d-token BPE on %s characters of %s", vocab_size, f"{n_chars:,}", corpus.name)
    t0 = time.perf_counter()
    tok = Tokenizer.train(take_chars(corpus.train_docs, max_chars), vocab_size, progress=progress)
    logger.info("tokenizer: trained %s in %.1fs", tok, time.perf_counter() - t0)
    if tok.vocab_size < vocab_size:
        warn_once(f"small-vocab:{target}", f"the corpus supports only {tok.vocab_size} tokens, not "
                  f"--vocab_size {vocab_size}: BPE ran out of pairs to merge (a small corpus)")
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache_root, prefix=".tmp-tokenizer-"))
    tmp.chmod(0o777 & ~umask())  # mkdtemp makes 0700
    tok.save(tmp)
    try:
        os.rename(tmp, target)
    except OSError:  # another process renamed its copy first: same corpus, same merges
        shutil.rmtree(tmp, ignore_errors=True)
        return Tokenizer.load(target)
    return tok


# ------------------------------------------------------------------- tokens
def tokenize_docs(tokenizer: Tokenizer, docs: list[str], *, cache_dir: str | os.PathLike | None = None,
                  progress: bool = True) -> torch.Tensor:
    """[n_tokens] int32: `<|bos|> doc0 <|bos|> doc1 ...`, cached in `cache_dir` when given.

    The cache key hashes the documents themselves (not a split name) with the tokenizer's
    fingerprint: any change to either makes a new file. Files are `.npy` written atomically
    and read with allow_pickle=False.
    """
    path = None
    if cache_dir is not None:
        h = hashlib.sha256()
        for d in docs:
            b = d.encode("utf-8")
            h.update(len(b).to_bytes(8, "little") + b)
        path = Path(cache_dir) / f"tokens-{h.hexdigest()[:16]}-{tokenizer.fingerprint}.npy"
        if path.is_file():
            arr = np.load(path, allow_pickle=False)
            if arr.ndim == 1 and arr.dtype in (np.uint16, np.int32):
                return torch.from_numpy(arr.astype(np.int32))
            warn_once(f"bad-cache:{path}", f"{path} is not a token stream ({arr.dtype}, {arr.ndim}-D); re-tokenizing")

    chunks, chunk_docs = [], 256  # docs per encode_batch call: progress granularity, bounded memory
    bar = tqdm(total=sum(len(d) for d in docs), desc="tokenizing", unit="char", unit_scale=True,
               disable=None if progress else True, leave=False)  # None: only on a terminal
    for i in range(0, len(docs), chunk_docs):
        part = docs[i:i + chunk_docs]
        flat: list[int] = []
        for ids in tokenizer.encode_batch(part, prepend_bos=True):
            flat += ids
        chunks.append(np.asarray(flat, dtype=np.int32))
        bar.update(sum(len(d) for d in part))
    bar.close()
    arr = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)

    if path is not None:
        disk = arr.astype(np.uint16) if tokenizer.vocab_size <= 2**16 else arr  # half the bytes
        write_atomic(path, lambda f: np.save(f, disk, allow_pickle=False))
    return torch.from_numpy(arr)


RECORDS_FORMAT = 3
"""Bump when `nanochat.instruct` renders records differently: it is part of the cache key."""


def tokenize_records(tokenizer: Any, records: list[list[dict[str, str]]], *, ids: list[str] | None = None,
                     cache_dir: str | os.PathLike | None = None, progress: bool = True,
                     with_starts: bool = False):
    """tokens [n_tokens] int32 and loss_mask [n_tokens] bool of instruction records, one after the
    other: each record as `nanochat.instruct.render` makes it (ours: `<|bos|><|user_start|>...`;
    a Hugging Face tokenizer: its chat template), loss_mask True exactly on the assistant tokens.
    With `with_starts`, also starts [n_records] int64: where each record begins (for
    `pack_records`).

    `ids` (e.g. `corpus.train_ids`) name records in errors. Cached in `cache_dir` as one `.npz`
    keyed by the records, the tokenizer's fingerprint (which covers a checkpoint's chat template)
    and RECORDS_FORMAT.
    """
    def result(tokens: np.ndarray, mask: np.ndarray, starts: np.ndarray):
        out = (torch.from_numpy(tokens.astype(np.int32)), torch.from_numpy(mask))
        return (*out, torch.from_numpy(starts.astype(np.int64))) if with_starts else out

    try:
        instruct.check_tokenizer(tokenizer)
    except ValueError as e:
        raise DataError(str(e)) from None
    path = None
    if cache_dir is not None:
        h = hashlib.sha256(f"records-v{RECORDS_FORMAT}".encode())
        for r in records:
            b = json.dumps(r, sort_keys=True).encode("ascii")  # ASCII escapes: lone surrogates cannot fail
            h.update(len(b).to_bytes(8, "little") + b)
        path = Path(cache_dir) / f"records-{h.hexdigest()[:16]}-{tokenizer.fingerprint}.npz"
        if path.is_file():
            with np.load(path, allow_pickle=False) as z:
                tokens, mask = z["tokens"], z["loss_mask"]
                starts = z["starts"] if "starts" in z.files else None
            if (tokens.ndim == mask.ndim == 1 and tokens.shape == mask.shape and mask.dtype == np.bool_
                    and starts is not None and starts.ndim == 1 and len(starts) == len(records)):
                return result(tokens, mask, starts)
            warn_once(f"bad-cache:{path}", f"{path} is not a token stream with a loss mask; re-tokenizing")

    tokens_l: list[int] = []
    mask_l: list[bool] = []
    starts_l: list[int] = []
    for k, messages in enumerate(tqdm(records, desc="tokenizing records", unit="record",
                                      disable=None if progress else True, leave=False)):
        try:
            rec_ids, rec_mask = instruct.render(tokenizer, messages)
        except ValueError as e:  # e.g. a chat template that is not prefix-stable, or raises
            where = ids[k] if ids is not None else f"record {k}"
            raise DataError(f"{where}: {e}") from None
        starts_l.append(len(tokens_l))
        tokens_l += rec_ids
        mask_l += rec_mask
    tokens = np.asarray(tokens_l, dtype=np.int32)
    mask = np.asarray(mask_l, dtype=np.bool_)
    starts = np.asarray(starts_l, dtype=np.int64)

    if path is not None:
        disk = tokens.astype(np.uint16) if tokenizer.vocab_size <= 2**16 else tokens
        write_atomic(path, lambda f: np.savez(f, tokens=disk, loss_mask=mask, starts=starts))
    return result(tokens, mask, starts)


@dataclass(frozen=True)
class Packing:
    """What `pack_records` did: records kept whole, cut (longer than a window), padding added."""

    records: int
    long_records: int
    pad_tokens: int
    tokens: int
    """Length of the packed stream, padding included."""

    @property
    def pad_pct(self) -> float:
        return 100.0 * self.pad_tokens / self.tokens if self.tokens else 0.0


def pack_records(tokens: torch.Tensor, loss_mask: torch.Tensor, starts: torch.Tensor, seq_len: int,
                 pad_id: int) -> tuple[torch.Tensor, torch.Tensor, Packing]:
    """Lay records out so that each lies inside one window of `TokenBatches` / `val_batches`.

    Window k covers positions [k*seq_len, k*seq_len + seq_len] (seq_len + 1 tokens; the last is
    the next window's first). Records are taken in order; one that would run past the end of the
    current window starts at the next window instead, and the positions skipped hold `pad_id`
    with loss_mask False (never scored; the model sees them as context, like the other records
    in a window). A record longer than seq_len + 1 starts at a window boundary and continues into
    the next windows (counted in `Packing.long_records`). The end is padded to a whole window
    (the batchers drop a partial one). Returns tokens, loss_mask, Packing.
    """
    if len(starts) == 0:
        return tokens, loss_mask, Packing(0, 0, 0, len(tokens))
    st = starts.numpy().astype(np.int64)
    if st[0] != 0 or np.any(np.diff(st) <= 0) or st[-1] >= len(tokens):
        raise ValueError("starts must be increasing record offsets into tokens, the first 0 "
                         f"(from tokenize_records(..., with_starts=True)); got {st[:5].tolist()}...")
    lengths = np.diff(np.append(st, len(tokens)))
    out_start = np.empty_like(st)
    pos = pad = long_records = 0
    for i, r in enumerate(lengths.tolist()):
        window_end = (pos // seq_len) * seq_len + seq_len  # last position of the window pos is in
        if pos + r - 1 > window_end:
            if pos % seq_len:  # start the next window (a boundary position starts one already)
                nxt = (pos // seq_len + 1) * seq_len
                pad, pos = pad + nxt - pos, nxt
            long_records += r > seq_len + 1
        out_start[i] = pos
        pos += r
    # pad the end to a whole window: the batchers drop a partial last window, records and all
    total = -(-(pos - 1) // seq_len) * seq_len + 1
    pad += total - pos
    # every source position j of record i moves by out_start[i] - starts[i]
    dest = torch.from_numpy(np.arange(len(tokens)) + np.repeat(out_start - st, lengths))
    packed = torch.full((total,), pad_id, dtype=tokens.dtype)
    packed_mask = torch.zeros(total, dtype=torch.bool)
    packed[dest], packed_mask[dest] = tokens, loss_mask
    return packed, packed_mask, Packing(len(st), int(long_records), int(pad), int(total))


# ------------------------------------------------------------------ batches
class TokenBatches:
    """Deterministic, resumable, rank-aware (x, y) batches from a token stream.

    `tokens` is [N] int; window k is tokens[k*seq_len : k*seq_len + seq_len + 1], x its first
    seq_len tokens and y its last seq_len. `steps_per_epoch` counts global batches of
    batch_size * world_size windows; the windows left over at the end of an epoch's order are
    skipped that epoch (a different set each epoch, because the order is reshuffled).

    `loss_mask` ([N] bool, True = scored, from `tokenize_records`) sets y to -1 where the target
    is not scored and leaves out the windows with no scored target (`num_windows` counts the
    rest). Without it every target is scored and every window is used.
    """

    def __init__(self, tokens: torch.Tensor, *, seq_len: int, batch_size: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1, loss_mask: torch.Tensor | None = None) -> None:
        if seq_len < 1 or batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need seq_len, batch_size, world_size >= 1 and 0 <= rank < world_size; got "
                             f"seq_len={seq_len} batch_size={batch_size} rank={rank} world_size={world_size}")
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D stream, got shape {tuple(tokens.shape)}")
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.global_batch = batch_size * world_size
        all_windows = max(0, (len(tokens) - 1) // seq_len)
        self._mask_windows, self._kept = _scored_windows(tokens, loss_mask, seq_len)
        self.num_windows = all_windows if self._kept is None else len(self._kept)
        self.steps_per_epoch = self.num_windows // self.global_batch
        if self.steps_per_epoch == 0:
            scored = "" if self._kept is None else f" ({self.num_windows} with a scored target)"
            raise DataError(
                f"the training stream has {len(tokens):,} tokens = {all_windows} windows{scored} of "
                f"seq_len+1 = {seq_len + 1} tokens (consecutive windows share one token), but one "
                f"global batch needs batch_size*world_size = {self.global_batch} windows = "
                f"{self.global_batch * seq_len + 1:,} tokens. Use a smaller --seq_len or "
                "--batch_size, or a larger corpus"
            )
        # [all windows, seq_len + 1], a strided view: no copy of the stream.
        self._windows = tokens.unfold(0, seq_len + 1, seq_len)
        self._epoch, self._step = 0, 0
        self._order: tuple[int, torch.Tensor] | None = None

    def _order_of(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            # One generator seed per (seed, epoch) pair, via a hash so nearby pairs do not collide.
            mixed = int.from_bytes(hashlib.sha256(f"{self.seed}:{epoch}".encode()).digest()[:8], "little") >> 1
            g = torch.Generator().manual_seed(mixed)
            self._order = (epoch, torch.randperm(self.num_windows, generator=g))
        return self._order[1]

    def next_batch(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y: [batch_size, seq_len] int64 (contiguous), this rank's share of the next global batch."""
        if self._step == self.steps_per_epoch:
            self._epoch, self._step = self._epoch + 1, 0
        start = self._step * self.global_batch + self.rank * self.batch_size
        idx = self._order_of(self._epoch)[start:start + self.batch_size]
        if self._kept is not None:
            idx = self._kept[idx]  # position among scored windows -> window number in the stream
        w = self._windows[idx].to(torch.int64)  # [B, T+1], a copy (advanced indexing)
        # y its own copy: for B == 1 both slices are already contiguous views of w, and masking
        # y in place would write -1 into x as well
        x, y = w[:, :-1].contiguous(), w[:, 1:].clone(memory_format=torch.contiguous_format)
        if self._mask_windows is not None:
            y.masked_fill_(~self._mask_windows[idx, 1:], -1)  # -1: GPT.forward's ignore_index
        self._step += 1
        if device is not None and torch.device(device).type != "cpu":
            pin = torch.device(device).type == "cuda"
            x = (x.pin_memory() if pin else x).to(device, non_blocking=pin)
            y = (y.pin_memory() if pin else y).to(device, non_blocking=pin)
        return x, y

    @property
    def epoch(self) -> float:
        """Epochs of progress: completed epochs + fraction of the current one (1.0 = one pass)."""
        return self._epoch + self._step / self.steps_per_epoch

    def state_dict(self) -> dict[str, int]:
        """Only ints (torch.load(weights_only=True)-safe); the shape fields guard the resume."""
        return {"epoch": self._epoch, "step": self._step, "seed": self.seed, "seq_len": self.seq_len,
                "global_batch": self.global_batch, "num_windows": self.num_windows}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at the batch after the one `state` was taken at. world_size may change as
        long as the global batch (batch_size * world_size) does not."""
        mine = self.state_dict()
        diff = {k: (state.get(k), mine[k]) for k in ("seed", "seq_len", "global_batch", "num_windows")
                if state.get(k) != mine[k]}
        if diff:
            raise DataError(
                "the data position in the checkpoint was saved for a different stream or batch "
                f"shape ({', '.join(f'{k}: saved {a} vs now {b}' for k, (a, b) in diff.items())}); "
                "resume with the same corpus, tokenizer, --seq_len, --seed and global batch size"
            )
        self._epoch, self._step = int(state["epoch"]), int(state["step"])


def val_batches(tokens: torch.Tensor, seq_len: int, batch_size: int, max_tokens: int, *,
                rank: int = 0, world_size: int = 1,
                loss_mask: torch.Tensor | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The first max(1, max_tokens // seq_len) windows of the validation stream, in order.

    Same windows as TokenBatches (stride seq_len), so every scored token is scored once. Batches
    hold up to batch_size windows (the last may be smaller); rank r takes batches r, r+world_size...
    Fewer windows than asked for are evaluated when the stream is short. With `loss_mask`, as in
    TokenBatches: y is -1 at unscored targets and only windows with a scored target count.
    """
    num_windows = max(0, (len(tokens) - 1) // seq_len)
    if num_windows == 0:
        raise DataError(f"the validation stream has {len(tokens):,} tokens; one evaluation window needs "
                        f"seq_len+1 = {seq_len + 1}. Use a smaller --seq_len or a corpus with more "
                        f"validation text (about {VAL_FRACTION:.0%} of the documents)")
    windows = tokens.unfold(0, seq_len + 1, seq_len)
    mask_windows, kept = _scored_windows(tokens, loss_mask, seq_len)
    if kept is None:
        kept = torch.arange(num_windows)
    elif len(kept) == 0:
        raise DataError("the validation records have no scored (assistant) token in any window of "
                        f"seq_len+1 = {seq_len + 1} tokens; the validation split is too small or its "
                        "records have empty answers")
    kept = kept[: max(1, max_tokens // seq_len)]
    for start in range(rank * batch_size, len(kept), batch_size * world_size):
        idx = kept[start:start + batch_size]
        w = windows[idx].to(torch.int64)
        # y its own copy (see TokenBatches)
        x, y = w[:, :-1].contiguous(), w[:, 1:].clone(memory_format=torch.contiguous_format)
        if mask_windows is not None:
            y.masked_fill_(~mask_windows[idx, 1:], -1)
        yield x, y


def _scored_windows(tokens: torch.Tensor, loss_mask: torch.Tensor | None,
                    seq_len: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(mask windows [W, seq_len+1] bool, numbers of the windows with a scored target), both None
    without a mask. A window's targets are its tokens 1..seq_len: token 0 is the previous
    window's last target, so it does not keep a window."""
    if loss_mask is None:
        return None, None
    if loss_mask.shape != tokens.shape or loss_mask.dtype != torch.bool:
        raise ValueError(f"loss_mask must be a bool tensor shaped like tokens {tuple(tokens.shape)}, got "
                         f"{loss_mask.dtype} {tuple(loss_mask.shape)}")
    if len(tokens) <= seq_len:
        return loss_mask[:0].view(0, seq_len + 1), torch.zeros(0, dtype=torch.int64)
    windows = loss_mask.unfold(0, seq_len + 1, seq_len)
    return windows, windows[:, 1:].any(dim=1).nonzero().squeeze(1)
