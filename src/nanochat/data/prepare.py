"""What a run reads: the corpus prepared once as a token store, and deterministic (x, y) batches.

1. `prepare_data(path, ...)`: the sources are listed (a stat per file, nanochat.data.sources), the
   tokenizer is given or trained on the corpus's first training characters (cached by that
   listing), and the corpus is tokenized once into a token store (nanochat.data.store) that every
   later run and every rank memory-maps. One process prepares while the others wait on a file
   lock. A source that changed rebuilds the store for a new run and stops a --resume.
2. `load_corpus(path)`: the same documents and split, in memory (`Corpus`), for tools, notebooks
   and tests; `tokenize_docs` / `tokenize_records` + `pack_records` are the matching in-memory
   streams (a store's streams equal them token for token).
3. Batches: `TokenBatches` cuts seq_len+1 windows with stride seq_len from a stream (a store's
   memory map, or a tensor), visits them in an order seeded by (seed, epoch), gives rank r its
   slice of each global batch, and resumes from two ints (epoch, step); instruction records
   are packed so that none crosses a window boundary. `val_batches`: the first windows of the
   validation stream, in order.

Every data problem is a `DataError` raised before any model is built, naming the fix. Why each
choice was made, with the figures: docs/data.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from tqdm import tqdm

from nanochat.data import instruct
from nanochat.common import UsageError, logger, umask, warn_once, write_atomic
from nanochat.data.sources import (
    VAL_FRACTION, DataError, Doc, Plan, Sources, SplitRule, describe, empty_corpus_message, iter_documents,
    list_sources, plan_sources, split_texts, unreadable, val_hash,
)
from nanochat.data.store import TokenStore, build_store, dataset_dir, load_plan, locked, open_store, report, store_dir
from nanochat.data.streams import Packing, TokenStream, pack_layout
from nanochat.tokenizer import META_FILE, BPETokenizer, Tokenizer

DEFAULT_MAX_CHARS = 20_000_000
"""Characters a tokenizer is trained on when trained on the fly (TokTrainConfig's default)."""
SOURCES_FILE = "sources.json"
"""In a run directory: the listing of the corpus the run started on (what --resume checks)."""


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
    """16 hex digits of sha256 over the documents of both splits."""

    def describe(self) -> str:
        return describe(self.name, self.source, kind=self.kind, docs=(len(self.train_docs), len(self.val_docs)),
                        nbytes=(self.train_bytes, self.num_bytes - self.train_bytes), split_note=self.split_note,
                        skipped=self.skipped, shapes=self.shapes)


# ------------------------------------------------------------------ a run's data
@dataclass
class PreparedData:
    """What `prepare_data` found or made."""

    sources: Sources
    store: TokenStore
    tokenizer: Tokenizer
    """The tokenizer the store was built with (with the chat template chosen, for records)."""
    fallbacks: list[str]
    """What was not as asked (a smaller vocabulary, the plain chat format), each with its reason."""


def prepare_data(dataset_path: str | os.PathLike | None, *, tokenizer: Tokenizer | None = None, vocab_size: int = 4096,
                 chat_template: str | None = None, cache_root: str | os.PathLike, resume: bool = False,
                 recorded: dict[str, Any] | None = None, workers: int = 0, progress: bool = True,
                 piece_bytes: int | None = None, max_chars: int = DEFAULT_MAX_CHARS, build: bool = True) -> PreparedData:
    """The token store of the corpus at `dataset_path` (None: the standard library) for
    `tokenizer` (None: one trained on the corpus, `vocab_size`, cached), built if missing or if
    its sources changed (and said why). With `resume`, sources that changed since `recorded`
    (the listing the run started on) or since the store was built are refused, naming the file:
    resuming on other data must never be silent. `chat_template`: --chat_template (records).
    `build=False`: only find them (a DataError says what is missing)."""
    cache_root = Path(cache_root)
    sources = list_sources(dataset_path, exclude=[cache_root])
    if resume and recorded is not None:
        _refuse_changed(sources.changes(recorded), "since this run started")
    directory = dataset_dir(cache_root, sources)
    fallbacks = []
    with locked(directory, f"the token store of {sources.name}"):
        plan = load_plan(sources, directory, workers=workers)
        if tokenizer is None:
            tokenizer = get_or_train_tokenizer(plan, vocab_size, cache_root / "tokenizers", max_chars,
                                               progress=progress, train=build)
            if tokenizer.vocab_size < vocab_size:
                fallbacks.append(f"tokenizer: the corpus ran out of BPE merges at {tokenizer.vocab_size} tokens "
                                 f"(--vocab_size {vocab_size} asked); training with the smaller vocabulary")
        tokenizer, template_fallback = instruct.choose_chat_template(tokenizer, chat_template,
                                                                     records=plan.kind == "instruct")
        if template_fallback:
            fallbacks.append(template_fallback)
        if plan.kind == "instruct":
            try:
                instruct.check_tokenizer(tokenizer)
            except ValueError as e:
                raise DataError(str(e)) from None
        path = store_dir(directory, tokenizer)
        store, why = open_store(path, sources)
        if store is None:
            if resume and recorded is None and why.startswith("its sources changed"):
                _refuse_changed([why.split(": ", 1)[1]], "since its token store was built")
            if not build:
                raise DataError(f"no token store of {sources.source} for tokenizer {tokenizer.fingerprint} at "
                                f"{path} ({why}); build it with scripts/tokenize_corpus.py without --verify")
            report("token store %s: %s; building it", path, why)
            store = build_store(plan, tokenizer, path, workers=workers, progress=progress, piece_bytes=piece_bytes)
    return PreparedData(sources, store, tokenizer, fallbacks)


def _refuse_changed(changes: list[str], when: str) -> None:
    if changes:
        more = f" (and {len(changes) - 1} more)" if len(changes) > 1 else ""
        raise UsageError(f"--resume: the corpus changed {when}: {changes[0]}{more}; a resumed run must read the "
                         "data it started on. Restore it, or train on the new data in a new run (a new --run_dir; "
                         "--init_from <this run_dir> starts from its weights)")


def write_sources(sources: Sources, run_dir: str | os.PathLike) -> None:
    """Record in `run_dir` the listing of the corpus a fresh run starts on (what --resume checks)."""
    write_atomic(Path(run_dir) / SOURCES_FILE, json.dumps({"fingerprint": sources.fingerprint,
                                                           **sources.listing()}) + "\n")


def recorded_sources(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The listing `write_sources` recorded in `run_dir`; None for a run that has none."""
    try:
        recorded = json.loads((Path(run_dir) / SOURCES_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return recorded if isinstance(recorded, dict) and isinstance(recorded.get("files"), list) else None


# ------------------------------------------------------------------ corpora in memory
def load_corpus(dataset_path: str | os.PathLike | None = None) -> Corpus:
    """The built-in stdlib corpus (None) or the documents under `dataset_path`, split, in memory:
    the documents a token store holds, for a corpus that fits in memory."""
    sources = list_sources(dataset_path)
    plan = plan_sources(sources)
    counts: Counter[str] = Counter(sources.skipped)
    read = [(unit.role, doc) for unit, doc in iter_documents(plan, counts)]
    skipped = dict(sorted(counts.items()))
    bad = unreadable(skipped)
    if bad:  # empty files and other extensions are expected; only these deserve a warning
        warn_once(f"data-skipped:{sources.source}", f"{sources.source}: skipped " +
                  ", ".join(f"{n} {why}" for why, n in sorted(bad.items())))
    name, source = sources.name, sources.source
    if sources.split_layout:
        train = [d for role, d in read if role != "validation"]
        val = [d for role, d in read if role == "validation"]
        if not train:
            raise DataError(f"--dataset_path {source}: the train split files hold no documents or records")
        if val:
            return _corpus(name, source, train, val, SplitRule("role").note(sources), skipped)
        corpus = _split(name, source, train, skipped)  # no validation file: held out by hash, as usual
        return dataclasses.replace(corpus, split_note=f"train split files only, {corpus.split_note}")
    if not read:
        raise DataError(empty_corpus_message(source, skipped))
    return _split(name, source, [d for _, d in read], skipped)


def _split(name: str, source: str, docs: list[Doc], skipped: dict[str, int]) -> Corpus:
    train = [d for d in docs if val_hash(d.id) >= VAL_FRACTION]
    val = [d for d in docs if val_hash(d.id) < VAL_FRACTION]
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
            train, val = [Doc(d.id, d.text[:cut])], [Doc(f"{d.id}[{cut}:]", d.text[cut:])]
            note = f"one document: val = its last {len(d.text) - cut:,} characters"
        elif not val:
            val = [min(docs, key=lambda d: val_hash(d.id))]
            train = [d for d in docs if d.id != val[0].id]
            note = f"no doc hashed below {VAL_FRACTION:g}: val = the doc with the smallest sha1"
        else:
            train = [max(docs, key=lambda d: val_hash(d.id))]
            val = [d for d in docs if d.id != train[0].id]
            note = f"every doc hashed below {VAL_FRACTION:g}: train = the doc with the largest sha1"
    return _corpus(name, source, train, val, note, skipped)


def _corpus(name: str, source: str, train: list[Doc], val: list[Doc], note: str,
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
def get_or_train_tokenizer(plan: Plan, vocab_size: int, cache_root: str | os.PathLike,
                           max_chars: int = DEFAULT_MAX_CHARS, *, progress: bool = True, train: bool = True) -> BPETokenizer:
    """The tokenizer trained on the first `max_chars` characters of the corpus's training
    documents (`sources.split_texts`), from `cache_root/tokenizer-<listing>-<vocab>-<chars>/`
    when already trained there (keyed by the sources' listing: a start reads no document).

    The directory appears atomically (written to a temp dir, then renamed), so an interrupted run
    leaves no half-written tokenizer and concurrent processes agree: a loser of the rename race
    loads the winner's, identical, tokenizer.
    """
    cache_root = Path(cache_root)
    target = cache_root / f"tokenizer-{plan.sources.fingerprint}-{vocab_size}-{max_chars}chars"
    if (target / META_FILE).is_file():
        try:
            tok = BPETokenizer.load(target)
        except (OSError, ValueError) as e:
            raise DataError(f"cached tokenizer {target} is unreadable ({e}); delete that directory "
                            "to retrain it") from None
        logger.info("tokenizer: %s from cache %s", tok, target)
        return tok
    if not train:
        raise DataError(f"no tokenizer trained on {plan.sources.source} with --vocab_size {vocab_size} in "
                        f"{cache_root}; pass the --tokenizer_dir the store was built with")
    texts = split_texts(plan, max_chars)
    logger.info("tokenizer: training a %d-token BPE on %s characters of %s", vocab_size,
                f"{sum(len(t) for t in texts):,}", plan.sources.name)
    t0 = time.perf_counter()
    tok = BPETokenizer.train(texts, vocab_size, progress=progress)
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
        return BPETokenizer.load(target)
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
"""Bump when `nanochat.data.instruct` renders records differently: it is part of the cache key."""


def tokenize_records(tokenizer: Tokenizer, records: list[list[dict[str, str]]], *, ids: list[str] | None = None,
                     cache_dir: str | os.PathLike | None = None, progress: bool = True,
                     with_starts: bool = False):
    """tokens [n_tokens] int32 and loss_mask [n_tokens] bool of instruction records, one after the
    other: each record as `nanochat.data.instruct.render` makes it (ours: `<|bos|><|user_start|>...`;
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


def pack_records(tokens: torch.Tensor, loss_mask: torch.Tensor, starts: torch.Tensor, seq_len: int,
                 pad_id: int) -> tuple[torch.Tensor, torch.Tensor, Packing]:
    """Lay records out so that each lies inside one window of `TokenBatches` / `val_batches`
    (`nanochat.data.store.pack_layout`: the rules), in memory; the positions skipped hold `pad_id`
    with loss_mask False (never scored; the model sees them as context, like the other records
    in a window). Returns tokens, loss_mask, Packing. A store's streams are packed the same way
    without a copy (`TokenStream.packed`)."""
    st = starts.numpy().astype(np.int64)
    out_start, info = pack_layout(st, len(tokens), seq_len)
    if len(st) == 0:
        return tokens, loss_mask, info
    lengths = np.diff(np.append(st, len(tokens)))
    # every source position j of record i moves by out_start[i] - starts[i]
    dest = torch.from_numpy(np.arange(len(tokens)) + np.repeat(out_start - st, lengths))
    packed = torch.full((info.tokens,), pad_id, dtype=tokens.dtype)
    packed_mask = torch.zeros(info.tokens, dtype=torch.bool)
    packed[dest], packed_mask[dest] = tokens, loss_mask
    return packed, packed_mask, info


# ------------------------------------------------------------------ batches
def _window_batch(stream: TokenStream, windows: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x, y [len(windows), seq_len] int64 (contiguous) of the stream's windows numbered `windows`;
    y is -1 (GPT.forward's ignore_index) where the mask does not score the target."""
    starts = windows.astype(np.int64) * seq_len
    w = torch.from_numpy(stream.window_tokens(starts, seq_len + 1))  # [B, T+1], a copy
    # y its own copy: for B == 1 both slices are already contiguous views of w, and masking
    # y in place would write -1 into x as well
    x, y = w[:, :-1].contiguous(), w[:, 1:].clone(memory_format=torch.contiguous_format)
    mask = stream.window_mask(starts, seq_len + 1)
    if mask is not None:
        y.masked_fill_(~torch.from_numpy(np.ascontiguousarray(mask[:, 1:])), -1)
    return x, y


class TokenBatches:
    """Deterministic, resumable, rank-aware (x, y) batches from a token stream.

    `tokens` is a TokenStream (a token store's split, memory-mapped) or a [N] int tensor; window k
    is tokens[k*seq_len : k*seq_len + seq_len + 1], x its first seq_len tokens and y its last
    seq_len. `steps_per_epoch` counts global batches of batch_size * world_size windows; the
    windows left over at the end of an epoch's order are skipped that epoch (a different set each
    epoch, because the order is reshuffled).

    A loss mask (the stream's, or `loss_mask` [N] bool with a tensor, from `tokenize_records`)
    sets y to -1 where the target is not scored and leaves out the windows with no scored target
    (`num_windows` counts the rest). Without it every target is scored and every window is used.
    """

    def __init__(self, tokens: TokenStream | torch.Tensor, *, seq_len: int, batch_size: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1, loss_mask: torch.Tensor | None = None) -> None:
        if seq_len < 1 or batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need seq_len, batch_size, world_size >= 1 and 0 <= rank < world_size; got "
                             f"seq_len={seq_len} batch_size={batch_size} rank={rank} world_size={world_size}")
        self.stream = TokenStream.of(tokens, loss_mask)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.global_batch = batch_size * world_size
        all_windows = max(0, (len(self.stream) - 1) // seq_len)
        self._kept = self.stream.scored_windows(seq_len)  # None: every window
        self.num_windows = all_windows if self._kept is None else len(self._kept)
        self.steps_per_epoch = self.num_windows // self.global_batch
        if self.steps_per_epoch == 0:
            scored = "" if self._kept is None else f" ({self.num_windows} with a scored target)"
            raise DataError(
                f"the training stream has {len(self.stream):,} tokens = {all_windows} windows{scored} of "
                f"seq_len+1 = {seq_len + 1} tokens (consecutive windows share one token), but one "
                f"global batch needs batch_size*world_size = {self.global_batch} windows = "
                f"{self.global_batch * seq_len + 1:,} tokens. Use a smaller --seq_len or "
                "--batch_size, or a larger corpus"
            )
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
        idx = self._order_of(self._epoch)[start:start + self.batch_size].numpy()
        if self._kept is not None:
            idx = self._kept[idx]  # position among scored windows -> window number in the stream
        x, y = _window_batch(self.stream, idx, self.seq_len)
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


def val_batches(tokens: TokenStream | torch.Tensor, seq_len: int, batch_size: int, max_tokens: int, *,
                rank: int = 0, world_size: int = 1,
                loss_mask: torch.Tensor | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The first max(1, max_tokens // seq_len) windows of the validation stream, in order.

    Same windows as TokenBatches (stride seq_len), so every scored token is scored once. Batches
    hold up to batch_size windows (the last may be smaller); rank r takes batches r, r+world_size...
    Fewer windows than asked for are evaluated when the stream is short. With a loss mask, as in
    TokenBatches: y is -1 at unscored targets and only windows with a scored target count.
    """
    stream = TokenStream.of(tokens, loss_mask)
    num_windows = max(0, (len(stream) - 1) // seq_len)
    if num_windows == 0:
        raise DataError(f"the validation stream has {len(stream):,} tokens; one evaluation window needs "
                        f"seq_len+1 = {seq_len + 1}. Use a smaller --seq_len or a corpus with more "
                        f"validation text (about {VAL_FRACTION:.0%} of the documents)")
    want = max(1, max_tokens // seq_len)
    kept = stream.scored_windows(seq_len)
    if kept is None:
        kept = np.arange(min(num_windows, want), dtype=np.int64)
    elif len(kept) == 0:
        raise DataError("the validation records have no scored (assistant) token in any window of "
                        f"seq_len+1 = {seq_len + 1} tokens; the validation split is too small or its "
                        "records have empty answers")
    kept = kept[:want]
    for start in range(rank * batch_size, len(kept), batch_size * world_size):
        yield _window_batch(stream, kept[start:start + batch_size], seq_len)


__all__ = ["Corpus", "DataError", "Packing", "PreparedData", "TokenBatches", "TokenStream", "get_or_train_tokenizer",
           "load_corpus", "pack_records", "prepare_data", "tokenize_docs", "tokenize_records", "val_batches"]
