"""Data: corpora, splits, token streams and batches, checked against independent references
(nanochat.data.sources: the listing; nanochat.data.read: a unit's documents; nanochat.data.plan:
the checks before any work; nanochat.data.split: the validation split; tests/reference_data.py:
the in-memory path; nanochat.data.batches).

- corpora: the documents read back equal the files written (jsonl lines, parquet rows); order is
  sorted relative paths; hidden entries are ignored; binary / empty / other-extension files are
  counted in `skipped` and a warning names the unreadable ones once per load; links to folders
  are followed, a folder reached twice (a second link, a loop) read once and counted;
- split: val membership equals sha1(id) < VAL_FRACTION recomputed here; identical across loads;
  never empty (smallest-hash doc, or the last 2% of characters of a single document);
- split files (the hub's ARC layout, parquet and jsonl): train files are exactly the training
  records and validation files the validation records (compared with the rows written), test
  rows appear nowhere, a README is skipped; digit and letter labels both map to letters; no
  validation file falls back to the hash split over the train files; no train file is an error;
- errors: every DataError case names the problem, what was found and the fix;
- the built-in stdlib corpus: no tests, no site-packages, deterministic, non-empty val;
- tokenize_docs: equals concat([bos] + encode(doc)) built here; cached file is reused, loads with
  allow_pickle=False, no temp files remain;
- TokenBatches: windows equal slices of the stream; same seed -> same batches; every window once
  per epoch; a state_dict round-tripped through torch.save / torch.load(weights_only=True)
  resumes on exactly the batches of an uninterrupted run; world_size=2 ranks concatenated equal
  world_size=1 with twice the batch; the global RNG is neither used nor disturbed.
All comparisons are exact (tolerance 0): this is integer bookkeeping.
"""

import hashlib
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from nanochat.data.batches import TokenBatches, val_batches
from nanochat.data.sources import REACHED_TWICE, DataError, list_sources
from nanochat.data.split import VAL_FRACTION, val_hash
from nanochat.tokenizer import BPETokenizer
from tests import reference_data
from tests.reference_data import load_corpus, tokenize_docs


def _sha1_val(doc_id: str) -> bool:
    return int(hashlib.sha1(doc_id.encode()).hexdigest()[:16], 16) / 2**64 < VAL_FRACTION


def _ids(corpus):
    return corpus.train_ids + corpus.val_ids


@pytest.fixture(scope="module")
def tok(small_corpus) -> BPETokenizer:
    return BPETokenizer.train([p.read_text() for p in sorted(small_corpus.glob("*.py"))], 400, progress=False)


@pytest.fixture
def warnings(monkeypatch) -> list[str]:
    seen: list[str] = []
    monkeypatch.setattr(reference_data, "warn_once", lambda key, msg: seen.append(msg))
    return seen


# ------------------------------------------------------------------ corpora
def test_stdlib_corpus_is_deterministic_and_has_no_tests():
    a, b = load_corpus(None), load_corpus(None)
    assert a.train_ids == b.train_ids and a.val_ids == b.val_ids and a.fingerprint == b.fingerprint
    ids = _ids(a)
    assert len(ids) > 100 and a.num_bytes > 1_000_000
    assert not any(set(i.split("/")[:-1]) & {"test", "tests", "idle_test", "site-packages"} for i in ids)
    assert a.train_ids == sorted(a.train_ids) and a.val_ids == sorted(a.val_ids)
    assert a.val_ids == [i for i in sorted(ids) if _sha1_val(i)]
    assert 0.005 < len(a.val_ids) / len(ids) < 0.05
    assert a.num_bytes == sum(len(d.encode()) for d in a.train_docs + a.val_docs)
    assert "stdlib" in a.describe() and "val" in a.describe()


def test_directory_corpus_reads_sorted_and_counts_skips(tmp_path, warnings):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".git").mkdir()
    files = {"b.txt": "second doc\n", "a.md": "# first\n", "sub/c.py": "x = 1\n", "Z.TXT": "upper ext"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / ".git" / "HEAD.txt").write_text("hidden, ignored")
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "nul.txt").write_bytes(b"abc\x00def")
    (tmp_path / "latin1.md").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "table.csv").write_text("a,b\n")
    c = load_corpus(tmp_path)
    assert sorted(_ids(c)) == ["Z.TXT", "a.md", "b.txt", "sub/c.py"]
    assert dict(zip(_ids(c), c.train_docs + c.val_docs)) == files
    assert c.skipped == {"binary (NUL bytes or not UTF-8)": 2, "empty": 1, "other extension (.csv)": 1}
    assert len(warnings) == 1 and "2 binary" in warnings[0] and "empty" not in warnings[0]
    assert "skipped 2 binary" in c.describe()


def test_linked_folders_are_read_once_and_their_changes_seen(tmp_path):
    """A corpus assembled from folders kept elsewhere: a link to a folder is followed (its files
    listed under the link's path, with the target's size and mtime, so an edit there is a
    change), a second link to the same folder and a link back to the corpus (a loop) are each
    read zero more times, counted once, and the walk ends."""
    shards, corpus = tmp_path / "shards", tmp_path / "corpus"
    shards.mkdir()
    corpus.mkdir()
    (shards / "a.txt").write_text("alpha " * 50)
    (corpus / "own.txt").write_text("beta " * 50)
    (corpus / "linked").symlink_to(shards, target_is_directory=True)
    (corpus / "second").symlink_to(shards, target_is_directory=True)
    (corpus / "loop").symlink_to(corpus, target_is_directory=True)
    src = list_sources(corpus)
    assert [f.path for f in src.files] == ["linked/a.txt", "own.txt"]
    assert src.skipped == {REACHED_TWICE: 2}
    before = src.listing()
    (shards / "a.txt").write_text("alpha " * 60)
    assert list_sources(corpus).changes(before) == ["linked/a.txt changed (size 300 -> 360 bytes)"]


def test_split_follows_sha1_and_is_stable_when_files_are_added(tmp_path):
    for i in range(300):
        (tmp_path / f"doc{i:03d}.txt").write_text(f"document number {i}\n")
    c = load_corpus(tmp_path)
    expected = [f"doc{i:03d}.txt" for i in range(300) if _sha1_val(f"doc{i:03d}.txt")]
    assert expected and c.val_ids == expected
    for i in range(300, 400):
        (tmp_path / f"doc{i:03d}.txt").write_text(f"document number {i}\n")
    bigger = load_corpus(tmp_path)
    assert set(c.val_ids) <= set(bigger.val_ids) and set(c.train_ids) <= set(bigger.train_ids)
    assert bigger.fingerprint != c.fingerprint


def test_small_corpus_gets_the_smallest_hash_doc_as_val(tmp_path):
    names = ["a.txt", "b.txt", "c.txt"]
    assert not any(_sha1_val(n) for n in names)  # precondition: the hash split alone gives no val
    for n in names:
        (tmp_path / n).write_text(f"text of {n}")
    c = load_corpus(tmp_path)
    smallest = min(names, key=lambda n: hashlib.sha1(n.encode()).hexdigest())
    assert c.val_ids == [smallest] and c.train_ids == [n for n in names if n != smallest]
    assert "smallest sha1" in c.describe()


def test_single_file_is_split_by_characters(tmp_path):
    text = "".join(f"line {i}\n" for i in range(200))
    (tmp_path / "book.txt").write_text(text)
    c = load_corpus(tmp_path / "book.txt")
    assert len(c.train_docs) == len(c.val_docs) == 1
    assert c.train_docs[0] + c.val_docs[0] == text
    assert len(c.val_docs[0]) == round(len(text) * VAL_FRACTION)
    assert "last" in c.split_note and "characters" in c.describe()


def test_jsonl_and_parquet_documents(tmp_path, warnings):
    rows = [{"text": "first doc", "id": 1}, {"text": "second\u2028doc\x85"}, {"text": None}, {"text": "bad \ud800"}]
    lines = [json.dumps(r, ensure_ascii=False) for r in rows[:3]]  # raw U+2028 / U+0085 inside a line
    lines.append(json.dumps(rows[3]))  # the escape "\\ud800" as broken real-world JSON has it
    lines[0] += "\r"  # a CRLF line ending
    (tmp_path / "a.jsonl").write_text(lines[0] + "\n\n" + "\n".join(lines[1:]) + "\n")
    pq.write_table(pa.table({"text": ["p0", "", "p2"], "meta": [1, 2, 3]}), tmp_path / "b.parquet")
    c = load_corpus(tmp_path)
    docs = dict(zip(_ids(c), c.train_docs + c.val_docs))
    assert docs == {"a.jsonl#1": "first doc", "a.jsonl#3": "second\u2028doc\x85", "b.parquet#0": "p0", "b.parquet#2": "p2"}
    assert c.skipped == {"empty": 2, "invalid Unicode (lone surrogates)": 1}
    assert len(warnings) == 1 and "lone surrogates" in warnings[0]


# ------------------------------------------------------------------- errors
def test_error_missing_path(tmp_path):
    with pytest.raises(DataError, match=r"nope does not exist.*\.jsonl.*omit it"):
        load_corpus(tmp_path / "nope")


def test_error_empty_corpus(tmp_path):
    (tmp_path / "a.txt").write_text("")
    (tmp_path / "b.md").write_text("\n\n")
    with pytest.raises(DataError, match=r"corpus is empty.*2 empty.*UTF-8 text"):
        load_corpus(tmp_path)


def test_error_no_supported_files_lists_extensions(tmp_path):
    (tmp_path / "x.csv").write_text("a")
    (tmp_path / "y.csv").write_text("b")
    (tmp_path / "README").write_text("c")
    with pytest.raises(DataError) as e:
        load_corpus(tmp_path)
    msg = str(e.value)
    assert "no readable text files" in msg and ".csv (2)" in msg and "(no extension) (1)" in msg
    assert ".txt, .md, .py, .jsonl, .parquet" in msg
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match="no files at all"):
        load_corpus(tmp_path / "empty_dir")


def test_error_unsupported_single_file(tmp_path):
    (tmp_path / "data.csv").write_text("a,b")
    with pytest.raises(DataError, match=r"'\.csv' is not supported.*rename"):
        load_corpus(tmp_path / "data.csv")


def test_error_only_binary_files(tmp_path, warnings):
    (tmp_path / "a.txt").write_bytes(b"\x00\x01\x02")
    (tmp_path / "b.py").write_bytes(b"\xff\xfe\xfa")
    with pytest.raises(DataError, match=r"empty.*2 binary"):
        load_corpus(tmp_path)
    assert len(warnings) == 1


def test_error_jsonl_without_text_names_fields_file_and_line(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "ok"}\n{"content": "x", "title": "t"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: no \"text\" field.*\['content', 'title'\]"):
        load_corpus(tmp_path)


def test_error_jsonl_invalid_json_and_wrong_type(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "ok"}\n\n{"text": "unterminated}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:3: invalid JSON"):
        load_corpus(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"text": 42}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:1: \"text\" is a JSON int"):
        load_corpus(tmp_path)


def test_error_parquet_without_text_column(tmp_path):
    pq.write_table(pa.table({"body": ["a"], "n": [1]}), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"t\.parquet: no \"text\" column \(columns: \['body', 'n'\]\)"):
        load_corpus(tmp_path)


# ------------------------------------------------------------------- tokens
def test_tokenize_docs_matches_reference_and_caches(tok, tmp_path, monkeypatch):
    docs = ["def f():\n    return 1\n", "héllo 👋 <|bos|>", "x" * 3000]
    reference = [i for d in docs for i in [tok.bos_id] + tok.encode(d)]
    stream = tokenize_docs(tok, docs, cache_dir=tmp_path)
    assert stream.dtype == torch.int32 and stream.tolist() == reference
    (cached,) = tmp_path.iterdir()  # exactly one file: no temp files left behind
    assert cached.suffix == ".npy" and tok.fingerprint in cached.name
    assert np.load(cached, allow_pickle=False).dtype == np.uint16  # vocab < 65536 -> 2 bytes/token

    monkeypatch.setattr(tok, "encode_batch", lambda *a, **k: pytest.fail("re-tokenized despite cache"))
    assert tokenize_docs(tok, docs, cache_dir=tmp_path).tolist() == reference
    monkeypatch.undo()
    tokenize_docs(tok, docs[:2], cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 2  # different documents -> a different key


# ------------------------------------------------------------------ batches
def _batches(loader, n):
    return [loader.next_batch() for _ in range(n)]


def test_windows_are_stream_slices():
    tokens = torch.arange(1000, dtype=torch.int32)
    loader = TokenBatches(tokens, seq_len=10, batch_size=4, seed=0)
    assert loader.num_windows == 99 and loader.steps_per_epoch == 24
    x, y = loader.next_batch("cpu")
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, 10)
    assert x.is_contiguous() and y.is_contiguous()
    for row_x, row_y in zip(x, y):
        k = int(row_x[0]) // 10
        assert row_x.tolist() == list(range(10 * k, 10 * k + 10))
        assert row_y.tolist() == list(range(10 * k + 1, 10 * k + 11))


def test_same_seed_same_batches_and_global_rng_untouched():
    tokens = torch.arange(2000, dtype=torch.int32)
    torch.manual_seed(0)
    a = _batches(TokenBatches(tokens, seq_len=8, batch_size=4, seed=3), 130)  # > 2 epochs (62/epoch)
    torch.manual_seed(12345)  # the global RNG must not matter
    b = _batches(TokenBatches(tokens, seq_len=8, batch_size=4, seed=3), 130)
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))
    c = _batches(TokenBatches(tokens, seq_len=8, batch_size=4, seed=4), 5)
    assert not all(torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a, c))
    before = torch.get_rng_state()
    _batches(TokenBatches(tokens, seq_len=8, batch_size=4, seed=3), 70)  # crosses an epoch: a reshuffle
    assert torch.equal(torch.get_rng_state(), before)


def test_every_window_once_per_epoch_and_reshuffled():
    tokens = torch.arange(24 * 5 + 1, dtype=torch.int32)  # exactly 24 windows of seq_len 5
    single = TokenBatches(tokens, seq_len=5, batch_size=6, seed=0)
    assert single.steps_per_epoch == 4
    e0 = [int(r[0]) // 5 for _ in range(4) for r in single.next_batch()[0]]
    e1 = [int(r[0]) // 5 for _ in range(4) for r in single.next_batch()[0]]
    assert sorted(e0) == sorted(e1) == list(range(24)) and e0 != e1
    assert single.epoch == 2.0
    # Not divisible: 25 windows, global batch 6 -> 4 steps, 24 distinct windows, 1 dropped.
    odd = TokenBatches(torch.arange(25 * 5 + 1), seq_len=5, batch_size=6, seed=0)
    seen = [int(r[0]) // 5 for _ in range(4) for r in odd.next_batch()[0]]
    assert len(set(seen)) == 24 and set(seen) <= set(range(25))


def test_rank_shares_partition_the_global_batch():
    tokens = torch.arange(3000, dtype=torch.int32)
    one = TokenBatches(tokens, seq_len=7, batch_size=6, seed=1)
    ranks = [TokenBatches(tokens, seq_len=7, batch_size=3, seed=1, rank=r, world_size=2) for r in (0, 1)]
    assert one.steps_per_epoch == ranks[0].steps_per_epoch
    for _ in range(one.steps_per_epoch + 5):  # across an epoch boundary
        x, y = one.next_batch()
        parts = [r.next_batch() for r in ranks]
        assert torch.equal(x, torch.cat([p[0] for p in parts])) and torch.equal(y, torch.cat([p[1] for p in parts]))


def test_state_dict_resume_equals_uninterrupted(tmp_path):
    tokens = torch.arange(1500, dtype=torch.int32)
    make = lambda: TokenBatches(tokens, seq_len=10, batch_size=4, seed=7)  # noqa: E731
    full = _batches(make(), 60)  # 37 steps per epoch: the resume point below is in epoch 1
    first = make()
    _batches(first, 45)
    torch.save({"data": first.state_dict()}, tmp_path / "ck.pt")
    state = torch.load(tmp_path / "ck.pt", weights_only=True)["data"]
    assert all(type(v) is int for v in state.values())
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.epoch == first.epoch == 1 + 8 / 37
    for (xa, ya), (xb, yb) in zip(full[45:], _batches(resumed, 15)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    # Same global batch on two ranks: rank shares of the resumed position match too.
    r0 = TokenBatches(tokens, seq_len=10, batch_size=2, seed=7, rank=0, world_size=2)
    r0.load_state_dict(state)
    assert torch.equal(r0.next_batch()[0], full[45][0][:2])


def test_resume_with_other_shape_is_an_error():
    tokens = torch.arange(1500, dtype=torch.int32)
    state = TokenBatches(tokens, seq_len=10, batch_size=4, seed=7).state_dict()
    with pytest.raises(DataError, match=r"seq_len: saved 10 vs now 12"):
        TokenBatches(tokens, seq_len=12, batch_size=4, seed=7).load_state_dict(state)
    with pytest.raises(DataError, match=r"global_batch: saved 4 vs now 8"):
        TokenBatches(tokens, seq_len=10, batch_size=8, seed=7).load_state_dict(state)


def test_stream_too_short_says_what_is_needed():
    with pytest.raises(DataError) as e:
        TokenBatches(torch.arange(100), seq_len=32, batch_size=4, seed=0)
    msg = str(e.value)
    assert "100 tokens" in msg and "3 windows" in msg and "129 tokens" in msg
    assert "--seq_len" in msg and "--batch_size" in msg


def test_val_batches_fixed_windows_spread_over_the_stream():
    tokens = torch.arange(1000, dtype=torch.int32)  # 99 windows of 10 (+1) tokens
    batches = list(val_batches(tokens, 10, 4, max_tokens=100))  # 10 of them: 4 + 4 + 2
    assert [x.shape[0] for x, _ in batches] == [4, 4, 2]
    xs = torch.cat([x for x, _ in batches])
    ys = torch.cat([y for _, y in batches])
    # window i*99//10: one in every tenth of the stream, the first window included
    assert (xs[:, 0] // 10).tolist() == [0, 9, 19, 29, 39, 49, 59, 69, 79, 89] and torch.equal(ys, xs + 1)
    # a stream stored in an order (here: values rising along it) is scored as a whole, not by its head:
    # the spread windows' mean is within one tenth of the stream (100) of the whole's, the first ten's is not
    assert abs(ys.double().mean().item() - tokens.double().mean().item()) < 100
    assert abs(torch.arange(1, 101).double().mean().item() - tokens.double().mean().item()) > 400
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(batches, val_batches(tokens, 10, 4, 100)))
    shards = [torch.cat([x for x, _ in val_batches(tokens, 10, 4, 100, rank=r, world_size=2)]) for r in (0, 1)]
    assert sorted(torch.cat(shards)[:, 0].tolist()) == xs[:, 0].tolist()
    assert len(list(val_batches(tokens, 10, 4, max_tokens=10**9))) == 25  # capped by the stream: 99 windows
    with pytest.raises(DataError, match=r"validation stream has 5 tokens.*seq_len\+1 = 11"):
        list(val_batches(torch.arange(5), 10, 4, 100))


# ------------------------------------------------------------------ split files
@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_split_files_are_the_splits_and_test_is_never_read(tmp_path, fmt):
    from nanochat.data import instruct
    from tests.test_eval import arc_rows, write_arc

    root = write_arc(tmp_path / "arc", fmt)
    corpus = load_corpus(root)
    as_messages = lambda rows: [instruct.to_messages(r, "multiple choice") for r in rows]  # noqa: E731
    assert corpus.train_records == as_messages(arc_rows(160, "train", 0))
    assert corpus.val_records == as_messages(arc_rows(24, "validation", 1))
    test_questions = {r["question"] for r in arc_rows(24, "test", 2)}
    assert not any(t in doc for t in test_questions for doc in corpus.train_docs + corpus.val_docs)
    assert corpus.skipped == {"not a split file (train*, validation*, test*)": 1, "test split (never trained on)": 1}
    assert "split files: train 1 file(s), validation 1 file(s)" in corpus.describe()
    # digit labels ("1".."4") were relettered: answers are letters of the shown options
    digit_row = arc_rows(160, "train", 0)[0]
    assert digit_row["choices"]["label"] == ["1", "2", "3", "4"]
    assert corpus.train_records[0][1]["content"] == "ABCD"[["1", "2", "3", "4"].index(digit_row["answerKey"])]


def test_split_files_without_validation_or_train(tmp_path):
    from tests.test_eval import write_arc

    root = write_arc(tmp_path / "arc", "jsonl")
    (root / "ARC-Challenge" / "validation-00000-of-00001.jsonl").unlink()
    corpus = load_corpus(root)
    ids = corpus.train_ids + corpus.val_ids
    assert all(i.startswith("ARC-Challenge/train-") for i in ids) and len(ids) == 160
    in_order = sorted(ids, key=lambda i: int(i.rsplit("#", 1)[1]))
    expected_val = [i for i in in_order if _sha1_val(i)] or [min(ids, key=val_hash)]
    assert corpus.val_ids == expected_val
    assert "train split files only" in corpus.split_note
    (root / "ARC-Challenge" / "train-00000-of-00001.jsonl").unlink()
    with pytest.raises(DataError, match="no train file"):
        load_corpus(root)
