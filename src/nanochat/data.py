"""Corpora -> documents -> one token stream -> deterministic (x, y) batches.

The pipeline, and where each step's choice comes from:

1. **Documents.** `load_corpus(path)` reads a file or a directory (recursively, hidden entries
   ignored) of `.txt` / `.md` / `.py` (one file = one document), `.jsonl` (one line = one
   document, its "text" field) or `.parquet` (one row = one document, its "text" column). Files
   are visited in sorted relative-path order, so the corpus is the same on every machine.
   Without a path the corpus is the running interpreter's own standard library: every `.py`
   under `sysconfig.get_paths()["stdlib"]`, minus `site-packages` and the test suites (`test/`,
   `tests/`, `idle_test/`). With the tests it is ~31 MB on Python 3.11; without, 12.2 MB in
   734 files (3 of them empty). The tests are 60% of the bytes but mostly repetitive
   `assertEqual` boilerplate plus deliberately odd inputs (bad encodings, generated data), and
   without them there are already 3.4M training tokens at a 4096 vocabulary: a 5-minute run
   would have to train at 11k tokens/s just to read them once.
   Figures vary slightly across Python versions (3.12 removed distutils, every version adds and
   drops modules), so the run header prints them (`Corpus.describe()`).

2. **Validation split.** A document is in validation iff sha1(document id) falls in the lowest
   2% of the hash range (id = relative path, `path#line` for jsonl, `path#row` for parquet).
   Hashing the id rather than shuffling keeps each document on its side when files are added
   or removed, and needs no seed. Small corpora can come out with an empty side; then the
   document with the smallest hash becomes validation, and a single document is split by
   characters (its last 2%). `Corpus.describe()` says which rule was applied.

3. **Token stream.** `tokenize_docs` encodes every document, prefixes each with `<|bos|>` and
   concatenates them into one 1-D stream (nanochat's and GPT-2's layout: no padding, the model
   sees document boundaries as BOS tokens and may attend across them). Streams are cached as
   `.npy` (uint16 on disk when the vocabulary fits, int32 in memory) keyed by a hash of the
   documents' content and the tokenizer's fingerprint, so a stale cache is impossible.

4. **Batches.** `TokenBatches` cuts the stream into windows of seq_len+1 tokens with stride
   seq_len — consecutive windows share one token, so every token but the first is a prediction
   target exactly once per epoch (stride seq_len+1 would never predict the shared token).
   Each epoch visits the windows in a fresh order drawn from a `torch.Generator` seeded by
   (seed, epoch) — never the global RNG, so model code that draws random numbers cannot shift
   the data. A global batch is `batch_size * world_size` consecutive entries of that order and
   rank r takes the r-th slice, so the ranks of a distributed run together read exactly what one
   process with `world_size` times the batch would. The position is two ints (epoch, step),
   which is all a checkpoint needs to resume on the same next batch.

Every data problem is a `DataError` raised by `load_corpus` / `TokenBatches` — before any model
is built — whose message says what was found and what to do.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from nanochat.common import format_bytes, logger, warn_once
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
    """A corpus split into training and validation documents (plain strings)."""

    name: str
    source: str
    train_docs: list[str]
    val_docs: list[str]
    train_ids: list[str]
    """Document ids (relative path, `path#line`, `path#row`), parallel to train_docs."""
    val_ids: list[str]
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
        return (
            f"{self.name} ({self.source}): {format_bytes(self.num_bytes)} in "
            f"{len(self.train_docs) + len(self.val_docs)} docs; train {len(self.train_docs)} docs / "
            f"{format_bytes(train_b)}, val {len(self.val_docs)} docs / "
            f"{format_bytes(self.num_bytes - train_b)} ({self.split_note})"
            + (f"; skipped {skipped}" if skipped else "")
        )


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
        docs = list(_read_files(root, files, skipped))
    unreadable = {why: n for why, n in skipped.items() if why != _EMPTY and not why.startswith("other")}
    if unreadable:  # empty files and other extensions are expected; only these deserve a warning
        warn_once(f"data-skipped:{source}", f"{source}: skipped " +
                  ", ".join(f"{n} {why}" for why, n in sorted(unreadable.items())))
    if not docs:
        raise DataError(f"--dataset_path {source}: the corpus is empty after reading every file "
                        f"({', '.join(f'{n} {w}' for w, n in sorted(skipped.items())) or 'nothing found'}); "
                        "point it at files that contain UTF-8 text")
    return _split(name, source, docs, dict(sorted(skipped.items())))


def _walk(root: Path, excluded: Iterable[str] = ()) -> list[Path]:
    """Every regular file under `root`, sorted by relative path; hidden entries are skipped
    (.git, .DS_Store: never training text), as are directories named in `excluded`."""
    excluded = set(excluded)
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in excluded and d != "__pycache__"]
        out += [Path(dirpath, f) for f in filenames if not f.startswith(".")]
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def _read_files(root: Path, files: list[Path], skipped: Counter) -> Iterator[tuple[str, str]]:
    """(document id, text) for every document in `files`; problems are counted or raised."""
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
            yield rel, text
        else:
            skipped[_EMPTY] += 1


def _utf8_or_none(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _read_jsonl(text: str, path: Path, rel: str, skipped: Counter) -> Iterator[tuple[str, str]]:
    # split("\n"), not splitlines(): JSON strings may hold raw U+2028 / U+0085, which are not
    # record separators; numbering by "\n" also matches what editors and error messages show.
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg}, column {e.colno}); each line of a "
                            '.jsonl file must be one JSON object like {"text": "..."}') from None
        if not isinstance(obj, dict) or "text" not in obj:
            has = f"fields {sorted(obj)}" if isinstance(obj, dict) else f"a JSON {type(obj).__name__}"
            raise DataError(f'{path}:{lineno}: no "text" field (the line has {has}); each line must be '
                            'an object with the document in "text", e.g. {"text": "..."}')
        doc = obj["text"]
        if doc is None:
            doc = ""
        if not isinstance(doc, str):
            raise DataError(f'{path}:{lineno}: "text" is a JSON {type(doc).__name__}, expected a string')
        yield from _checked_doc(f"{rel}#{lineno}", doc, skipped)


def _read_parquet(path: Path, rel: str, skipped: Counter) -> Iterator[tuple[str, str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
        if "text" not in schema.names:
            raise DataError(f'{path}: no "text" column (columns: {schema.names}); the documents must '
                            'be in a string column named "text"')
        if not (pa.types.is_string(schema.field("text").type) or pa.types.is_large_string(schema.field("text").type)):
            raise DataError(f'{path}: column "text" has type {schema.field("text").type}, expected string')
        column = pq.read_table(path, columns=["text"]).column("text").to_pylist()
    except pa.ArrowException as e:
        raise DataError(f"{path}: not a readable parquet file ({e})") from None
    for row, doc in enumerate(column):
        yield from _checked_doc(f"{rel}#{row}", doc or "", skipped)


def _checked_doc(doc_id: str, doc: str, skipped: Counter) -> Iterator[tuple[str, str]]:
    if not doc.strip():
        skipped[_EMPTY] += 1
        return
    try:
        doc.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates, e.g. a broken "\ud800" escape in JSON
        skipped["invalid Unicode (lone surrogates)"] += 1
        return
    yield doc_id, doc


def _val_hash(doc_id: str) -> float:
    """sha1(id) as a number in [0, 1): stable across runs, machines and Python versions."""
    return int.from_bytes(hashlib.sha1(doc_id.encode("utf-8")).digest()[:8], "big") / 2**64


def _split(name: str, source: str, docs: list[tuple[str, str]], skipped: dict[str, int]) -> Corpus:
    train = [(i, t) for i, t in docs if _val_hash(i) >= VAL_FRACTION]
    val = [(i, t) for i, t in docs if _val_hash(i) < VAL_FRACTION]
    note = f"val = sha1(doc id) < {VAL_FRACTION:g}"
    if not train or not val:
        if len(docs) == 1:
            doc_id, text = docs[0]
            if len(text) < 2:
                raise DataError(f"{source}: the corpus is a single {len(text)}-character document; "
                                "training and validation need at least 2 characters")
            cut = len(text) - max(1, round(len(text) * VAL_FRACTION))
            train, val = [(doc_id, text[:cut])], [(f"{doc_id}[{cut}:]", text[cut:])]
            note = f"one document: val = its last {len(text) - cut:,} characters"
        elif not val:
            val = [min(docs, key=lambda d: _val_hash(d[0]))]
            train = [d for d in docs if d[0] != val[0][0]]
            note = f"no doc hashed below {VAL_FRACTION:g}: val = the doc with the smallest sha1"
        else:
            train = [max(docs, key=lambda d: _val_hash(d[0]))]
            val = [d for d in docs if d[0] != train[0][0]]
            note = f"every doc hashed below {VAL_FRACTION:g}: train = the doc with the largest sha1"
    h = hashlib.sha256()
    nbytes = {b"T": 0, b"V": 0}
    for tag, part in ((b"T", train), (b"V", val)):
        for _, text in part:
            b = text.encode("utf-8")
            nbytes[tag] += len(b)
            h.update(tag + len(b).to_bytes(8, "little") + b)
    return Corpus(
        name=name, source=source, train_docs=[t for _, t in train], val_docs=[t for _, t in val],
        train_ids=[i for i, _ in train], val_ids=[i for i, _ in val], skipped=skipped,
        split_note=note, num_bytes=nbytes[b"T"] + nbytes[b"V"], train_bytes=nbytes[b"T"],
        fingerprint=h.hexdigest()[:16],
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
    tmp.chmod(0o777 & ~_umask())  # mkdtemp makes 0700
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
        path.parent.mkdir(parents=True, exist_ok=True)
        disk = arr.astype(np.uint16) if tokenizer.vocab_size <= 2**16 else arr  # half the bytes
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; caches are shared by runs
            with os.fdopen(fd, "wb") as f:
                np.save(f, disk, allow_pickle=False)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return torch.from_numpy(arr)


# ------------------------------------------------------------------ batches
class TokenBatches:
    """Deterministic, resumable, rank-aware (x, y) batches from a token stream.

    `tokens` is [N] int; window k is tokens[k*seq_len : k*seq_len + seq_len + 1], x its first
    seq_len tokens and y its last seq_len. `steps_per_epoch` counts global batches of
    batch_size * world_size windows; the windows left over at the end of an epoch's order are
    skipped that epoch (a different set each epoch, because the order is reshuffled).
    """

    def __init__(self, tokens: torch.Tensor, *, seq_len: int, batch_size: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1) -> None:
        if seq_len < 1 or batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need seq_len, batch_size, world_size >= 1 and 0 <= rank < world_size; got "
                             f"seq_len={seq_len} batch_size={batch_size} rank={rank} world_size={world_size}")
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D stream, got shape {tuple(tokens.shape)}")
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.global_batch = batch_size * world_size
        self.num_windows = max(0, (len(tokens) - 1) // seq_len)
        self.steps_per_epoch = self.num_windows // self.global_batch
        if self.steps_per_epoch == 0:
            raise DataError(
                f"the training stream has {len(tokens):,} tokens = {self.num_windows} windows of "
                f"seq_len+1 = {seq_len + 1} tokens (consecutive windows share one token), but one "
                f"global batch needs batch_size*world_size = {self.global_batch} windows = "
                f"{self.global_batch * seq_len + 1:,} tokens. Use a smaller --seq_len or "
                "--batch_size, or a larger corpus"
            )
        # [num_windows, seq_len + 1], a strided view: no copy of the stream.
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
        w = self._windows[idx].to(torch.int64)  # [B, T+1], a copy (advanced indexing)
        x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()
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
                rank: int = 0, world_size: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The first max(1, max_tokens // seq_len) windows of the validation stream, in order.

    Same windows as TokenBatches (stride seq_len), so every scored token is scored once. Batches
    hold up to batch_size windows (the last may be smaller); rank r takes batches r, r+world_size...
    Fewer windows than asked for are evaluated when the stream is short.
    """
    num_windows = max(0, (len(tokens) - 1) // seq_len)
    if num_windows == 0:
        raise DataError(f"the validation stream has {len(tokens):,} tokens; one evaluation window needs "
                        f"seq_len+1 = {seq_len + 1}. Use a smaller --seq_len or a corpus with more "
                        f"validation text (about {VAL_FRACTION:.0%} of the documents)")
    windows = tokens.unfold(0, seq_len + 1, seq_len)[: min(num_windows, max(1, max_tokens // seq_len))]
    for start in range(rank * batch_size, len(windows), batch_size * world_size):
        w = windows[start:start + batch_size].to(torch.int64)
        yield w[:, :-1].contiguous(), w[:, 1:].contiguous()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
