"""The in-memory data path: the reference the token store is tested against, token for token.

    corpus = load_corpus(path)                            # split as the store splits it
    tokens = tokenize_docs(tokenizer, corpus.train_docs)  # = a text store's train stream
    tokens, mask, starts = tokenize_records(tokenizer, corpus.train_records, with_starts=True)
    tokens, mask, packing = pack_records(tokens, mask, starts, seq_len, pad_id)

Here, written out independently of the store's build: the corpus as Python strings and its
tokens as one tensor, how a run read its data before the memory-mapped store (a run never
does now: BENCHMARKS.md §9, where bench/bench_data.py measures the store against this path), and
the records' tokenization and packing. The split, the document ids, the record rendering and the
packing rules are the store's own (nanochat.data.split, nanochat.data.read,
nanochat.data.instruct, nanochat.data.streams.pack_layout).
"""

import dataclasses
import hashlib
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from nanochat.common import warn_once
from nanochat.data import instruct
from nanochat.data.plan import iter_documents, plan_sources
from nanochat.data.read import Doc
from nanochat.data.sources import DataError, list_sources, unreadable
from nanochat.data.split import VAL_FRACTION, SplitRule, empty_corpus_message, val_hash
from nanochat.data.split import describe as describe_split
from nanochat.data.streams import Packing, pack_layout
from nanochat.fs import write_atomic
from nanochat.tokenizer import Tokenizer


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
        return describe_split(self.name, self.source, kind=self.kind, docs=(len(self.train_docs), len(self.val_docs)),
                              nbytes=(self.train_bytes, self.num_bytes - self.train_bytes),
                              split_note=self.split_note, skipped=self.skipped, shapes=self.shapes)


def load_corpus(dataset_path: str | os.PathLike | None = None) -> Corpus:
    """The built-in stdlib corpus (None) or the documents under `dataset_path`, split, in memory:
    the documents a token store holds, read by the store's own reader (nanochat.data.plan) and
    split by its rules (nanochat.data.split)."""
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


def _split(name: str, source: str, docs: list, skipped: dict[str, int]) -> Corpus:
    """The store's split rules over `docs` (nanochat.data.read.Doc), tiny corpora included."""
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


def _corpus(name: str, source: str, train: list, val: list, note: str, skipped: dict[str, int]) -> Corpus:
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


def tokenize_docs(tokenizer, docs: list[str], *, cache_dir: str | os.PathLike | None = None):
    """[n_tokens] int32 tensor: `<|bos|> doc0 <|bos|> doc1 ...`, cached in `cache_dir` when given.

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
    chunks, chunk_docs = [], 256  # docs per encode_batch call: bounded memory
    for i in range(0, len(docs), chunk_docs):
        flat: list[int] = []
        for ids in tokenizer.encode_batch(docs[i:i + chunk_docs], prepend_bos=True):
            flat += ids
        chunks.append(np.asarray(flat, dtype=np.int32))
    arr = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
    if path is not None:
        disk = arr.astype(np.uint16) if tokenizer.vocab_size <= 2**16 else arr  # half the bytes
        write_atomic(path, lambda f: np.save(f, disk, allow_pickle=False))
    return torch.from_numpy(arr)


def tokenize_records(tokenizer: Tokenizer, records: list[list[dict[str, str]]], *, ids: list[str] | None = None,
                     with_starts: bool = False):
    """tokens [n_tokens] int32 and loss_mask [n_tokens] bool of instruction records, one after the
    other: each record as `nanochat.data.instruct.render` makes it (ours: `<|bos|><|user_start|>...`;
    a Hugging Face tokenizer: its chat template), loss_mask True exactly on the assistant tokens.
    With `with_starts`, also starts [n_records] int64: where each record begins (for
    `pack_records`). `ids` (e.g. `corpus.train_ids`) name records in errors."""
    try:
        instruct.check_tokenizer(tokenizer)
    except ValueError as e:
        raise DataError(str(e)) from None
    tokens: list[int] = []
    mask: list[bool] = []
    starts: list[int] = []
    for k, messages in enumerate(records):
        try:
            rec_ids, rec_mask = instruct.render(tokenizer, messages)
        except ValueError as e:  # e.g. a chat template that is not prefix-stable, or raises
            where = ids[k] if ids is not None else f"record {k}"
            raise DataError(f"{where}: {e}") from None
        starts.append(len(tokens))
        tokens += rec_ids
        mask += rec_mask
    out = (torch.tensor(tokens, dtype=torch.int32), torch.tensor(mask, dtype=torch.bool))
    return (*out, torch.tensor(starts, dtype=torch.int64)) if with_starts else out


def pack_records(tokens: torch.Tensor, loss_mask: torch.Tensor, starts: torch.Tensor, seq_len: int,
                 pad_id: int) -> tuple[torch.Tensor, torch.Tensor, Packing]:
    """Lay records out so that each lies inside one window of `TokenBatches` / `val_batches`
    (`nanochat.data.streams.pack_layout`: the rules), in memory; the positions skipped hold `pad_id`
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
