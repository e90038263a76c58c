"""The validation split: which side of train / validation each document is on, and why.

A document is in validation iff sha1(its id) falls in the lowest VAL_FRACTION of the hash range
(`val_hash`; ids: nanochat.data.read): each document keeps its side when files are added or
removed, on every machine, with no seed to carry. Split files (`train-*`, `validation-*`,
nanochat.data.sources) are used as they are.

Tiny corpora can leave a side empty; `SplitRule` then moves one document (the smallest hash to
validation, or the largest to training) and a single document is cut by characters (its last
2%). It decides from counts alone, so a token store decides once every document is read
(nanochat.data.build), and `split_texts`, what a tokenizer trains on, reads only until no rule
can move a document any more. `describe` is the one line a run prints about the outcome. The
reasons, with the figures: docs/data.md.

Hashing counts documents, not their sizes: one huge document hashed to validation would take the
corpus with it (a 48 MB file among four small ones left 200 KiB to train on). When the hashed
validation split holds more than VAL_CAP of a text corpus's tokens, `large_val_cuts` cuts each
validation document over the budget (VAL_FRACTION of the tokens): its last tokens, a share of the
budget, stay validation and the rest is trained on. Corpora whose hash split is within the cap
(every corpus of many documents) are split exactly as hashed.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

from nanochat.common import format_bytes
from nanochat.data.plan import Plan, iter_documents
from nanochat.data.read import read_unit
from nanochat.data.sources import TEST_SPLIT, DataError, Sources
from nanochat.tokenizer import take_chars

VAL_FRACTION = 0.02
"""Share of documents (by id hash) held out. On the default corpus (Python 3.11) that is 13 files,
230 KiB, 68k tokens with a 4096 vocabulary: twice the default --eval_tokens (32768) and 2% of the
training text."""


VAL_CAP = 0.25
"""Most of a text corpus's tokens the hashed validation split may hold before its large documents
are cut: 12x the intended share, which a corpus of a dozen files of unequal size reaches by chance
(the stdlib's calendar.py is a fifth of the test corpus's text), while a single document taking the
split is far above it."""


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


def large_val_cuts(val_tokens: dict[Any, int], total_tokens: int) -> dict[Any, int]:
    """{document: how many of its last tokens stay validation} for the validation documents
    (`val_tokens`: their token counts, BOS included) to cut, empty when the split holds at most
    VAL_CAP of `total_tokens`. The cut ones share the budget, VAL_FRACTION of the tokens."""
    if sum(val_tokens.values()) <= VAL_CAP * total_tokens:
        return {}
    budget = max(1, math.ceil(VAL_FRACTION * total_tokens))
    large = [d for d, n in val_tokens.items() if n > budget]
    return {d: max(1, budget // len(large)) for d in large}


def cut_note(cuts: dict[Any, int], val_tokens: int, total_tokens: int) -> str:
    """What the run header adds about documents `large_val_cuts` cut."""
    return (f"; {len(cuts)} doc(s) held {val_tokens / total_tokens:.0%} of the tokens in val, above "
            f"{VAL_CAP:.0%}: val keeps their last {min(cuts.values()):,} tokens, train the rest")


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
            return list(take_chars(texts, max_chars))  # no rule can move a document across any more
    if role_val:
        if not texts and not want_val:
            raise DataError(f"--dataset_path {plan.sources.source}: the train split files hold no documents or records")
        return list(take_chars(texts, max_chars))
    if docs == 0:
        raise DataError(empty_corpus_message(plan.sources.source, {**plan.sources.skipped, **skipped}))
    rule = SplitRule.decide(role_val_docs=0, docs=docs, hash_val_docs=hash_val,
                            smallest=smallest[1], largest=largest[1])
    if rule.fallback == "":
        return list(take_chars(texts, max_chars))
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
    return list(take_chars(out, max_chars))


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
