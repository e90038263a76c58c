"""Assembling a token store from its tokenized pieces: the split decided, the streams written.

A build (nanochat.data.build) leaves one piece per slice of the corpus: its tokens and a table
of its documents (where each starts, its bytes, its id's hash, its split file's role). `finalize`
decides the split over every table (`SplitRule`, nanochat.data.split; a validation split over
VAL_CAP of the tokens has its large documents cut, `large_val_cuts`) and concatenates each side's
documents, piece after piece, in runs of consecutive documents copied in chunks. A corpus of one
document is cut by characters and tokenized again (`_write_cut`).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from nanochat.common import NanoChatError
from nanochat.data.plan import Plan
from nanochat.data.read import read_unit
from nanochat.data.sources import DataError
from nanochat.data.split import VAL_FRACTION, SplitRule, cut_note, cut_point, empty_corpus_message, large_val_cuts
from nanochat.data.token_store import FORMAT, VERSION
from nanochat.fs import AtomicFile

if TYPE_CHECKING:
    from nanochat.tokenizer import Tokenizer

COPY_CHUNK = 1 << 24  # bytes per read when pieces are concatenated
ROLE_CODE = {"": 0, "train": 1, "validation": 2}
"""A document's split-file role, as the pieces' tables store it (int8)."""


def finalize(plan: Plan, tokenizer: Tokenizer, path: Path, pieces: list[tuple[Path, dict[str, Any]]],
              dtype: np.dtype) -> dict[str, Any]:
    """Decide the split and concatenate the pieces into the store's files; the manifest's fields
    but `build`."""
    sources = plan.sources
    skipped = Counter(sources.skipped)
    shapes: Counter = Counter()
    docs = role_val = hash_val = 0
    smallest = largest = None  # (hash, piece, doc)
    for k, (stem, rec) in enumerate(pieces):
        skipped.update(rec["skipped"])
        shapes.update(rec["shapes"])
        if not rec["docs"]:
            continue
        with np.load(str(stem) + ".docs.npz", allow_pickle=False) as z:
            h, role = z["hash"], z["role"]
        docs += len(h)
        role_val += int((role == ROLE_CODE["validation"]).sum())
        hash_val += int((h < VAL_FRACTION).sum())
        i, j = int(np.argmin(h)), int(np.argmax(h))  # the first of equals, as min() / max() take it
        if smallest is None or h[i] < smallest[0]:
            smallest = (h[i], k, i)
        if largest is None or h[j] > largest[0]:
            largest = (h[j], k, j)
    skipped = dict(sorted(skipped.items()))
    if docs == 0:
        if sources.split_layout:
            raise DataError(f"--dataset_path {sources.source}: the train split files hold no documents or records")
        raise DataError(empty_corpus_message(sources.source, skipped))
    rule = SplitRule.decide(role_val_docs=role_val, docs=docs, hash_val_docs=hash_val,
                            smallest=smallest[1:], largest=largest[1:])
    if rule.mode == "role" and role_val == docs:
        raise DataError(f"--dataset_path {sources.source}: the train split files hold no documents or records")
    files: dict[str, dict[str, Any]] = {}
    split: dict[str, Any] = {}
    if rule.fallback == "cut":
        if plan.kind == "instruct":
            raise DataError(f"{sources.source}: the corpus is a single instruction record; training and "
                            "validation need at least 2 records")
        note = _write_cut(plan, tokenizer, path, dtype, files, split)
    else:
        cuts, note = {}, rule.note(sources)
        if plan.kind == "text" and rule.mode == "hash" and rule.fallback == "":
            cuts, val_tokens, total = _large_val_cuts(pieces, rule)
            note += cut_note(cuts, val_tokens, total) if cuts else ""
        for name in ("train", "val"):
            split[name] = _concat(plan, path, pieces, dtype, rule, name, files, cuts, tokenizer.bos_id)
    split["note"] = note
    return {"format": FORMAT, "version": VERSION, "tokenizer": tokenizer.fingerprint,
            "vocab_size": tokenizer.vocab_size, "dtype": dtype.name, "kind": plan.kind, "name": sources.name,
            "source": sources.source, "sources": sources.listing(), "split": split, "skipped": skipped,
            "shapes": dict(sorted(shapes.items())), "files": files}


def _to_val(rule: SplitRule, k: int, h: np.ndarray, role: np.ndarray) -> np.ndarray:
    """Which documents of piece k are in validation under `rule`."""
    if rule.mode == "role":
        return role == ROLE_CODE["validation"]
    val = h < VAL_FRACTION
    if rule.fallback in ("to_val", "to_train") and rule.moved[0] == k:
        val[rule.moved[1]] = rule.fallback == "to_val"
    return val


def _large_val_cuts(pieces: list[tuple[Path, dict[str, Any]]], rule: SplitRule) -> tuple[dict, int, int]:
    """(split.large_val_cuts of the validation documents, keyed (piece, doc), their tokens, all
    tokens)."""
    val_tokens, total = {}, 0
    for k, (stem, rec) in enumerate(pieces):
        total += rec["tokens"]
        if not rec["docs"]:
            continue
        with np.load(str(stem) + ".docs.npz", allow_pickle=False) as z:
            starts, h, role = z["starts"], z["hash"], z["role"]
        lengths = np.diff(np.append(starts, rec["tokens"]))
        for i in np.flatnonzero(_to_val(rule, k, h, role)):
            val_tokens[(k, int(i))] = int(lengths[i])
    return large_val_cuts(val_tokens, total), sum(val_tokens.values()), total


def _concat(plan: Plan, path: Path, pieces: list[tuple[Path, dict[str, Any]]], dtype: np.dtype, rule: SplitRule,
            name: str, files: dict[str, dict[str, Any]], cuts: dict[tuple[int, int], int] | None = None,
            bos: int = 0) -> dict[str, int]:
    """The `name` split's files from the pieces' documents on that side, in corpus order. A
    document in `cuts` ({(piece, doc): n}) gives its last n tokens, after a BOS, to validation
    and the rest to training."""
    records = plan.kind == "instruct"
    out = {"bin": AtomicFile(path / f"{name}.bin"), "docs": AtomicFile(path / f"{name}.docs.bin")}
    if records:
        out["mask"] = AtomicFile(path / f"{name}.mask.bin")
        if name == "val":
            out["records"] = AtomicFile(path / "val.records.jsonl")
    pos = n_docs = n_bytes = 0
    try:
        for k, (stem, rec) in enumerate(pieces):
            if not rec["docs"]:
                continue
            with np.load(str(stem) + ".docs.npz", allow_pickle=False) as z:
                starts, nbytes, h, role = z["starts"], z["nbytes"], z["hash"], z["role"]
            keep = _to_val(rule, k, h, role) == (name == "val")
            ends = np.append(starts[1:], rec["tokens"])
            begins, nbytes = starts.copy(), nbytes.astype(np.float64)
            cut = np.zeros(len(starts), bool)
            for (kk, i), n in (cuts or {}).items():
                if kk == k:  # validation: a BOS, then the last n tokens; training: the rest
                    cut[i], keep[i], share = True, True, n / (ends[i] - starts[i])
                    begins[i], ends[i] = (ends[i] - n, ends[i]) if name == "val" else (starts[i], ends[i] - n)
                    nbytes[i] *= share if name == "val" else 1 - share
            if not keep.any():
                continue
            lengths = (ends - begins + (cut & (name == "val")))[keep]
            out["docs"].write((pos + np.concatenate([[0], np.cumsum(lengths)[:-1]])).astype(np.int64).tobytes())
            n_docs += int(keep.sum())
            n_bytes += int(round(nbytes[keep].sum()))
            # runs of consecutive kept documents, a cut one alone: one copy each
            idx = np.flatnonzero(keep)
            breaks = np.flatnonzero((np.diff(idx) != 1) | cut[idx[:-1]] | cut[idx[1:]])
            for a, b in zip(np.append(idx[0], idx[breaks + 1]), np.append(idx[breaks], idx[-1])):
                s, e = int(begins[a]), int(ends[b])
                if cut[a] and name == "val":
                    out["bin"].write(np.asarray([bos], dtype=dtype).tobytes())
                    pos += 1
                _copy(str(stem) + ".tokens", s * dtype.itemsize, e * dtype.itemsize, out["bin"])
                if records:
                    _copy(str(stem) + ".mask", s, e, out["mask"])
                pos += e - s
            if "records" in out:
                with open(str(stem) + ".records.jsonl", "rb") as f:
                    for line, kept in zip(f, keep):
                        if kept:
                            out["records"].write(line)
    except BaseException:
        for w in out.values():
            w.discard()
        raise
    for key, w in out.items():
        files[w.path.name] = w.commit()
    return {"docs": n_docs, "bytes": n_bytes, "tokens": pos}


def _copy(src: str, start: int, stop: int, out: AtomicFile) -> None:
    with open(src, "rb") as f:
        f.seek(start)
        left = stop - start
        while left > 0:
            block = f.read(min(left, COPY_CHUNK))
            if not block:
                raise NanoChatError(f"token store piece {src} ended early (at byte {stop - left:,} of {stop:,}); "
                                    "it was changed during the build: run again")
            out.write(block)
            left -= len(block)


def _write_cut(plan: Plan, tokenizer: Tokenizer, path: Path, dtype: np.dtype, files: dict[str, dict[str, Any]],
               split: dict[str, Any]) -> str:
    """A corpus of one document: its last VAL_FRACTION of characters are the validation split."""
    unit, doc = next((u, d) for u in plan.units for d in read_unit(plan.sources.root, u, Counter()))
    cut = cut_point(doc.text)
    if cut < 1:
        raise DataError(f"{plan.sources.source}: the corpus is a single {len(doc.text)}-character document; "
                        "training and validation need at least 2 characters")
    for name, text in (("train", doc.text[:cut]), ("val", doc.text[cut:])):
        ids = np.asarray(tokenizer.encode(text, prepend_bos=True), dtype=dtype)
        for suffix, data in ((".bin", ids.tobytes()), (".docs.bin", np.zeros(1, np.int64).tobytes())):
            w = AtomicFile(path / f"{name}{suffix}")
            w.write(data)
            files[w.path.name] = w.commit()
        split[name] = {"docs": 1, "bytes": len(text.encode("utf-8")), "tokens": len(ids)}
    rule = SplitRule("hash", "cut")
    return rule.note(plan.sources, len(doc.text) - cut)


__all__ = ["COPY_CHUNK", "ROLE_CODE", "finalize"]
