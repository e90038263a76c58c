"""The validation split is bounded by size as well as by document count. Checked against the
tokenizer applied to each document on its own: a corpus of one large document hashed to
validation and four small ones hashed to training (the large one 97% of the text) gives training
the small ones plus all but the large one's last tokens, and validation a BOS and those last
tokens, VAL_FRACTION of the corpus's tokens; the run header says so with both sides' sizes. A
corpus whose hashed split is within VAL_CAP is split exactly as hashed (test_store's reference
tests cover the rest of the rules)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from nanochat.data.plan import iter_documents, plan_sources
from nanochat.data.prepare import prepare_data
from nanochat.data.sources import list_sources
from nanochat.data.split import VAL_CAP, VAL_FRACTION, val_hash
from nanochat.tokenizer import BPETokenizer

WORDS = ("alpha", "beta", "gamma", "délta", "ε", "日本", "zeta", "eta", "theta", "kappa")


@pytest.fixture(scope="module")
def tok(small_corpus) -> BPETokenizer:
    return BPETokenizer.train([p.read_text() for p in sorted(small_corpus.glob("*.py"))], 400, progress=False)


def _names(val: bool, n: int) -> list[str]:
    return [f"doc{i}.txt" for i in range(5000) if (val_hash(f"doc{i}.txt") < VAL_FRACTION) == val][:n]


def _text(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 7 + k * 3) % len(WORDS)] + str(k % 13) for k in range(words)) + "\n"


def _corpus(root: Path, big_words: int, small_words: int) -> dict[str, str]:
    root.mkdir(parents=True)
    texts = {name: _text(i, small_words) for i, name in enumerate(_names(False, 4))}
    texts[_names(True, 1)[0]] = _text(99, big_words)
    for name, text in texts.items():
        (root / name).write_text(text, encoding="utf-8")
    return texts


def _tokens_in_corpus_order(tok, root: Path) -> list[tuple[str, list[int]]]:
    plan = plan_sources(list_sources(root))
    return [(d.id, tok.encode(d.text, prepend_bos=True)) for _, d in iter_documents(plan, Counter())]


def test_one_large_document_hashed_to_validation_is_cut_to_the_budget(tmp_path, tok):
    root = tmp_path / "corpus"
    texts = _corpus(root, big_words=12_000, small_words=80)
    big = _names(True, 1)[0]
    docs = _tokens_in_corpus_order(tok, root)
    total = sum(len(ids) for _, ids in docs)
    assert len(dict(docs)[big]) > 0.9 * total  # the premise: hashed as it is, val would be 90%+ of the corpus
    keep = math.ceil(VAL_FRACTION * total)
    want_train = [t for doc_id, ids in docs for t in (ids[:-keep] if doc_id == big else ids)]
    want_val = [tok.bos_id] + dict(docs)[big][-keep:]

    store = prepare_data(root, tokenizer=tok, cache_root=tmp_path / "cache", piece_bytes=4000).store
    assert store.train.read().tolist() == want_train
    assert store.val.read().tolist() == want_val
    assert np.asarray(store.val.docs).tolist() == [0]
    assert abs(len(want_val) / total - VAL_FRACTION) < 0.002  # within 0.2 points of the intended share
    header = store.describe()
    big_bytes = len(texts[big].encode())
    val_bytes = round(big_bytes * keep / len(dict(docs)[big]))
    assert f"val 1 docs / " in header and f"train 5 docs / " in header, header
    assert "1 doc(s) held" in header and f"above {VAL_CAP:.0%}" in header and f"last {keep:,} tokens" in header
    assert store.manifest["split"]["val"]["bytes"] == val_bytes
    assert store.manifest["split"]["train"]["bytes"] == sum(len(t.encode()) for t in texts.values()) - val_bytes


def test_a_split_within_the_cap_is_as_hashed(tmp_path, tok):
    root = tmp_path / "corpus"
    _corpus(root, big_words=40, small_words=80)  # the val doc is ~1/9 of the text: under VAL_CAP
    big = _names(True, 1)[0]
    docs = _tokens_in_corpus_order(tok, root)
    store = prepare_data(root, tokenizer=tok, cache_root=tmp_path / "cache", piece_bytes=4000).store
    assert store.train.read().tolist() == [t for doc_id, ids in docs if doc_id != big for t in ids]
    assert store.val.read().tolist() == dict(docs)[big]
    assert "held" not in store.describe()
