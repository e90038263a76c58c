"""The token store (nanochat.data.token_store: open, map, verify; nanochat.data.build: the parallel,
resumable build under one lock) against the in-memory path and against references built here.

- streams: a store built by a process pool from parquet shards (several row groups per shard),
  a .jsonl file cut into several ranges and text files equals, token for token, both
  concat([bos] + encode(doc)) over the documents this test wrote (split by sha1 here) and
  the in-memory path's `tokenize_docs(load_corpus(...))` (tests/reference_data.py); its
  document starts are the cumulative lengths;
  the build logs its progress in MB/s with the time left;
- the default corpus (the standard library, what `make train` reads) gives the same streams;
- the split's rules for tiny corpora and split files (no validation document, every document in
  validation, a single document, split files with and without validation files): the store's
  streams, its description and `split_texts` equal `load_corpus`'s;
- instruction records: tokens, loss masks and record starts equal `tokenize_records`; packed
  batches equal `pack_records` + TokenBatches; the validation records are kept;
- batches: TokenBatches on the store equals TokenBatches on the in-memory tensor, and a state
  dict taken on one opening of the store resumes on exactly the batches of an uninterrupted run;
- a build killed by SIGKILL continues: the finished pieces are not tokenized again and the result
  equals a build from nothing (sha256 of every file);
- two processes preparing one store at once: one builds, the other waits on the lock, and both
  read the same files; no temporary file is left;
- a source changed, added or removed: a new run rebuilds and says which file; --resume is
  refused naming it (against the run's own record, and against the store's when there is none),
  also through the trainer;
- a store file truncated or missing is refused at start; a changed byte fails --verify;
- errors before any work (nanochat.data.plan; nothing tokenized, no tokenizer trained): a parquet
  without "text", a 0-byte shard, a non-UTF-8 or NUL-holding .jsonl (one `error:` line from base_train);
- a FIFO in the corpus is skipped (said once) instead of blocking the start; a run directory
  inside --dataset_path is refused; a .jsonl with a UTF-8 byte-order mark reads as without one.
Comparisons are exact: tokens are integers.

Modules: nanochat.data.token_store, nanochat.data.build, nanochat.data.streams (the stream read
window by window).
"""

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import nanochat.data.build as build_mod
import nanochat.data.plan as plan_mod
import nanochat.data.sources as sources
from nanochat.common import UsageError, describe_error
from nanochat.data.batches import TokenBatches
from nanochat.data.plan import plan_sources
from nanochat.data.prepare import CHANGES_FILE, RESUME_NAMED, prepare_data
from nanochat.data.sources import DataError, list_sources
from nanochat.data.split import VAL_FRACTION, split_texts
from nanochat.tokenizer import BPETokenizer, take_chars
from tests.conftest import load_script, tiny_train_kwargs
from tests.reference_data import load_corpus, pack_records, tokenize_docs, tokenize_records

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("alpha", "beta", "gamma", "délta", "ε", "日本", "zeta", "eta", "theta", "\u2028iota", "kappa")


@pytest.fixture(scope="module")
def tok(small_corpus) -> BPETokenizer:
    return BPETokenizer.train([p.read_text() for p in sorted(small_corpus.glob("*.py"))], 400, progress=False)


@pytest.fixture(scope="module")
def tok_dir(tok, tmp_path_factory) -> Path:
    return tok.save(tmp_path_factory.mktemp("tok") / "tok")


def _text(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(5 + i % 40)) + f" #{i}\n"


def _is_val(doc_id: str) -> bool:
    return int(hashlib.sha1(doc_id.encode()).hexdigest()[:16], 16) / 2**64 < VAL_FRACTION


def write_mixed(root: Path) -> list[tuple[str, str]]:
    """Parquet shards (5 row groups each, empty and null rows), a .jsonl (blank lines), text files;
    returns the (id, text) of every non-empty document in corpus order, built here."""
    root.mkdir(parents=True)
    docs = []
    for s in range(3):
        rows = [_text(100 * s + i) if i % 9 else ("" if i % 2 else None) for i in range(40)]
        pq.write_table(pa.table({"text": rows, "n": list(range(40))}), root / f"shard_{s:05d}.parquet",
                       row_group_size=8)
        docs += [(f"shard_{s:05d}.parquet#{i}", t) for i, t in enumerate(rows) if t]
    lines = []
    for i in range(70):
        lines.append("" if i % 11 == 5 else json.dumps({"text": _text(500 + i)}, ensure_ascii=False))
    (root / "more.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    docs += [(f"more.jsonl#{n + 1}", _text(500 + n)) for n, line in enumerate(lines) if line]
    for name in ("notes.md", "z.txt"):
        text = _text(len(name) * 13) * 3
        (root / name).write_text(text, encoding="utf-8")
        docs.append((name, text))
    return sorted(docs, key=lambda d: d[0].split("#")[0])  # files in path order, rows and lines in file order


def _reference(tok: BPETokenizer, docs: list[tuple[str, str]], val: bool) -> list[int]:
    return [t for doc_id, text in docs if _is_val(doc_id) == val for t in [tok.bos_id, *tok.encode(text)]]


def _files_sha(store) -> dict[str, str]:
    return {name: f["sha256"] for name, f in store.manifest["files"].items()}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, tok):
    """The mixed corpus, and its store built by 2 workers in pieces of ~2 KB, .jsonl ranges of 300 B."""
    root = tmp_path_factory.mktemp("mixed") / "corpus"
    docs = write_mixed(root)
    assert any(_is_val(i) for i, _ in docs) and not all(_is_val(i) for i, _ in docs)  # the plain hash split
    with pytest.MonkeyPatch.context() as m:
        m.setattr(plan_mod, "JSONL_RANGE_BYTES", 300)
        prepared = prepare_data(root, tokenizer=tok, cache_root=root.parent / "cache", workers=2, piece_bytes=2000)
    return root, docs, prepared


# ------------------------------------------------------------------ streams
def test_store_streams_equal_the_reference_and_tokenize_docs(mixed, tok, caplog):
    root, docs, prepared = mixed
    store = prepared.store
    plan = plan_sources(list_sources(root))  # the same units whatever the range size: compare ids only
    assert sum(u.format == "parquet" for u in plan.units) == 15
    corpus = load_corpus(root)
    for split, val in (("train", False), ("val", True)):
        stream = getattr(store, split)
        reference = _reference(tok, docs, val)
        assert stream.read().tolist() == reference
        in_memory = tokenize_docs(tok, corpus.val_docs if val else corpus.train_docs)
        assert torch.equal(torch.from_numpy(stream.read()).to(torch.int32), in_memory)
        lengths = [1 + len(tok.encode(t)) for i, t in docs if _is_val(i) == val]
        assert np.asarray(stream.docs).tolist() == np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
    assert store.manifest["dtype"] == "uint16" and store.manifest["build"]["pieces"] > 5
    assert store.manifest["build"]["workers"] == 2
    assert store.describe() == corpus.describe()
    assert not (store.path / "pieces").exists() and not list(store.path.glob(".*tmp*"))
    # the progress of a build, for a log: MB/s and the time left
    caplog.set_level(logging.INFO, logger="nanochat")
    (store.path / "manifest.json").unlink()
    prepare_data(root, tokenizer=tok, cache_root=root.parent / "cache", workers=1, piece_bytes=2000)
    assert any("MB/s" in r.message and "left" in r.message for r in caplog.records)


def test_default_corpus_stream_equals_tokenize_docs(tmp_path, small_corpus):
    """The standard library, as `make train` reads it: the same tokens as the in-memory path."""
    tok = BPETokenizer.train([p.read_text() for p in sorted(small_corpus.glob("*.py"))], 300, progress=False)
    store = prepare_data(None, tokenizer=tok, cache_root=tmp_path).store
    corpus = load_corpus(None)
    assert np.array_equal(store.train.read(), tokenize_docs(tok, corpus.train_docs).numpy())
    assert np.array_equal(store.val.read(), tokenize_docs(tok, corpus.val_docs).numpy())
    assert store.describe() == corpus.describe()


def _all_val_names(n: int) -> list[str]:
    return [name for name in (f"v{i}.txt" for i in range(20000)) if _is_val(name)][:n]


def _split_case(root: Path, case: str) -> None:
    from tests.test_eval import write_arc

    root.mkdir(parents=True)
    if case == "no validation document":
        for name in ("a.txt", "b.txt", "c.txt"):
            assert not _is_val(name)
            (root / name).write_text(f"text of {name} " * 20)
    elif case == "every document in validation":
        for name in _all_val_names(3):
            (root / name).write_text(f"text of {name} " * 20)
    elif case == "one document":
        (root / "book.txt").write_text("".join(f"line {i}\n" for i in range(300)))
    else:
        write_arc(root, "jsonl")
        if case == "split files without validation":
            (root / "ARC-Challenge" / "validation-00000-of-00001.jsonl").unlink()


@pytest.mark.parametrize("case", ["no validation document", "every document in validation", "one document",
                                  "split files", "split files without validation"])
def test_split_rules_match_load_corpus(tmp_path, tok, case):
    root = tmp_path / "corpus"
    _split_case(root, case)
    corpus = load_corpus(root)
    store = prepare_data(root, tokenizer=tok, cache_root=tmp_path / "cache", piece_bytes=300).store
    assert store.describe() == corpus.describe()
    if corpus.kind == "instruct":
        for split in ("train", "val"):
            tokens, mask, starts = tokenize_records(tok, getattr(corpus, f"{split}_records"), with_starts=True)
            stream = getattr(store, split)
            assert stream.read().tolist() == tokens.tolist()
            assert np.asarray(stream.mask).astype(bool).tolist() == mask.tolist()
            assert np.asarray(stream.docs).tolist() == starts.tolist()
        assert list(store.val_records()) == corpus.val_records
    else:
        assert store.train.read().tolist() == tokenize_docs(tok, corpus.train_docs).tolist()
        assert store.val.read().tolist() == tokenize_docs(tok, corpus.val_docs).tolist()
    plan = plan_sources(list_sources(root))
    assert split_texts(plan, 10**9) == corpus.train_docs
    assert split_texts(plan, 10**9, "val") == corpus.val_docs
    assert split_texts(plan, 50) == list(take_chars(corpus.train_docs, 50))


def test_instruction_records_keep_their_masks(tmp_path, tok):
    from tests.test_instruct import ARC, MESSAGES, PROMPT_COMPLETION

    root = tmp_path / "sft"
    root.mkdir()
    rows = [dict(r, prompt=f"{r['prompt']} ({i})") for i in range(30) for r in PROMPT_COMPLETION]
    (root / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(MESSAGES * 20), root / "b.parquet", row_group_size=7)
    (root / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ARC * 20))
    corpus = load_corpus(root)
    store = prepare_data(root, tokenizer=tok, cache_root=tmp_path / "cache", workers=2, piece_bytes=1500).store
    assert store.kind == "instruct" and store.describe() == corpus.describe()
    tokens, mask, starts = tokenize_records(tok, corpus.train_records, with_starts=True)
    assert store.train.read().tolist() == tokens.tolist()
    assert np.asarray(store.train.mask).astype(bool).tolist() == mask.tolist()
    assert np.asarray(store.train.docs).tolist() == starts.tolist()
    assert list(store.val_records()) == corpus.val_records
    seq_len = 48
    packed, pmask, info = pack_records(tokens, mask, starts, seq_len, tok.bos_id)
    stream, sinfo = store.train.packed(seq_len, tok.bos_id)
    assert sinfo == info and len(stream) == len(packed)
    a = TokenBatches(stream, seq_len=seq_len, batch_size=3, seed=5)
    b = TokenBatches(packed, seq_len=seq_len, batch_size=3, seed=5, loss_mask=pmask)
    assert a.num_windows == b.num_windows
    for _ in range(a.steps_per_epoch + 3):  # across an epoch boundary
        (xa, ya), (xb, yb) = a.next_batch(), b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_batches_equal_the_tensor_path_and_resume_exactly_across_openings(mixed, tok, tmp_path):
    root, docs, prepared = mixed
    tensor = torch.tensor(_reference(tok, docs, False), dtype=torch.int32)
    make = lambda s: TokenBatches(s, seq_len=16, batch_size=4, seed=3)  # noqa: E731
    full, in_memory = make(prepared.store.train), make(tensor)
    uninterrupted = [full.next_batch() for _ in range(full.steps_per_epoch + 20)]
    for x, y in uninterrupted:
        xm, ym = in_memory.next_batch()
        assert torch.equal(x, xm) and torch.equal(y, ym)
    first = make(prepared.store.train)
    cut = first.steps_per_epoch - 5
    for _ in range(cut):
        first.next_batch()
    torch.save({"data": first.state_dict()}, tmp_path / "ck.pt")
    reopened = prepare_data(root, tokenizer=tok, cache_root=root.parent / "cache").store  # a new process's view
    resumed = make(reopened.train)
    resumed.load_state_dict(torch.load(tmp_path / "ck.pt", weights_only=True)["data"])
    for x, y in uninterrupted[cut:]:
        xr, yr = resumed.next_batch()
        assert torch.equal(x, xr) and torch.equal(y, yr)


# ------------------------------------------------------------------ building
SLOW_BUILD = """
import json, os, sys, time
from pathlib import Path
import nanochat.data.build as build
from nanochat.common import setup_logging
from nanochat.data.prepare import prepare_data
from nanochat.tokenizer import BPETokenizer
root, tok_dir, cache, ready = sys.argv[1:5]
real = build._tokenize_piece
def slow(job, tokenizer=None):
    record = real(job, tokenizer)
    print("piece", job.index, flush=True)
    time.sleep(0.3)
    return record
build._tokenize_piece = slow
setup_logging()
Path(ready + f".{os.getpid()}").touch()
while len(list(Path(ready).parent.glob(Path(ready).name + ".*"))) < int(sys.argv[5]):  # start together
    time.sleep(0.05)
prepared = prepare_data(root, tokenizer=BPETokenizer.load(tok_dir), cache_root=cache, workers=1, piece_bytes=2000)
print("RESULT " + json.dumps({"path": str(prepared.store.path),
                              "files": {n: f["sha256"] for n, f in prepared.store.manifest["files"].items()}}), flush=True)
"""


def _slow_build(root, tok_dir, cache, ready, together=1) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", SLOW_BUILD, str(root), str(tok_dir), str(cache), str(ready),
                             str(together)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def test_a_killed_build_continues_where_it_stopped(mixed, tok, tok_dir, tmp_path, monkeypatch, caplog):
    root = mixed[0]
    proc = _slow_build(root, tok_dir, tmp_path / "cache", tmp_path / "ready")
    try:
        pieces = []
        deadline = time.time() + 120
        while len(pieces) < 3 and time.time() < deadline:
            line = proc.stdout.readline()
            if line.startswith("piece"):
                pieces.append(line)
        assert len(pieces) == 3, proc.stderr.read()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # kill -9 mid-build
        proc.wait()
    (path,) = (tmp_path / "cache" / "stores").glob("*/tokens-*")
    assert not (path / "manifest.json").exists() and (path / "pieces").is_dir()  # never read as complete
    done = {p.name for p in (path / "pieces").glob("*.json")}
    assert len(done) >= 3
    tokenized = []
    real = build_mod._tokenize_piece
    monkeypatch.setattr(build_mod, "_tokenize_piece", lambda job, t=None: tokenized.append(job.index) or real(job, t))
    caplog.set_level(logging.INFO, logger="nanochat")
    resumed = prepare_data(root, tokenizer=tok, cache_root=tmp_path / "cache", workers=1, piece_bytes=2000).store
    assert any("continuing an interrupted build" in r.message and f"{len(done)} of" in r.message for r in caplog.records)
    assert len(tokenized) == resumed.manifest["build"]["pieces"] - len(done)
    assert resumed.manifest["build"]["pieces_reused"] == len(done)
    fresh = prepare_data(root, tokenizer=tok, cache_root=tmp_path / "fresh", workers=1, piece_bytes=2000).store
    assert _files_sha(resumed) == _files_sha(fresh)


def test_two_concurrent_builders_make_one_store_used_by_both(mixed, tok_dir, tmp_path):
    root = mixed[0]
    procs = [_slow_build(root, tok_dir, tmp_path / "cache", tmp_path / "ready", together=2) for _ in range(2)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=300)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        assert p.returncode == 0, err
        outs.append((out, err))
    results = [json.loads(next(line[7:] for line in out.splitlines() if line.startswith("RESULT "))) for out, _ in outs]
    built = [("building it" in err) for _, err in outs]
    assert sorted(built) == [False, True]  # exactly one built
    waiter = outs[built.index(False)]
    assert "waiting for pid" in waiter[1] and not waiter[0].count("piece")  # it tokenized nothing
    assert results[0] == results[1]  # the same files, read by both
    store_dir = Path(results[0]["path"])
    assert not (store_dir / "pieces").exists() and not [p for p in store_dir.iterdir() if ".tmp" in p.name]


# ------------------------------------------------------------------ sources changed
def test_a_resume_refusal_names_every_change_up_to_its_bound_then_where_all_are(tmp_path, tok):
    """3 changed files: all 3 named in the one line. 25: the first RESUME_NAMED (20) named, a
    count of the other 5, and the file holding all 25 (one per line), which is all they are."""
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(30):
        (root / f"d{i:02d}.txt").write_text(_text(i))
    cache = tmp_path / "cache"
    recorded = prepare_data(root, tokenizer=tok, cache_root=cache).sources.listing()
    for i in range(3):
        with open(root / f"d{i:02d}.txt", "a") as f:
            f.write("appended\n")
    with pytest.raises(UsageError) as e:
        prepare_data(root, tokenizer=tok, cache_root=cache, resume=True, recorded=recorded)
    assert all(f"d{i:02d}.txt changed (size" in str(e.value) for i in range(3)) and "more" not in str(e.value)
    for i in range(3, 25):
        with open(root / f"d{i:02d}.txt", "a") as f:
            f.write("appended\n")
    full = tmp_path / "run" / CHANGES_FILE
    full.parent.mkdir()
    with pytest.raises(UsageError) as e:
        prepare_data(root, tokenizer=tok, cache_root=cache, resume=True, recorded=recorded, changes_file=full)
    message = str(e.value)
    assert [f"d{i:02d}.txt changed" in message for i in range(25)] == [True] * RESUME_NAMED + [False] * 5
    assert f"; and 5 more (all 25 in {full})" in message
    assert full.read_text().splitlines() == list_sources(root).changes(recorded)
    assert len(full.read_text().splitlines()) == 25


def test_changed_sources_rebuild_a_new_run_and_stop_a_resume(tmp_path, tok, caplog):
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(40):
        (root / f"d{i:02d}.txt").write_text(_text(i))
    cache = tmp_path / "cache"
    first = prepare_data(root, tokenizer=tok, cache_root=cache)
    recorded = first.sources.listing()
    with open(root / "d07.txt", "a") as f:
        f.write("appended\n")
    with pytest.raises(UsageError, match=r"--resume: the corpus changed since this run started: d07\.txt changed "
                                         r"\(size \d+ -> \d+ bytes\)"):
        prepare_data(root, tokenizer=tok, cache_root=cache, resume=True, recorded=recorded)
    with pytest.raises(UsageError, match=r"changed since its token store was built: d07\.txt changed"):
        prepare_data(root, tokenizer=tok, cache_root=cache, resume=True, recorded=None)
    caplog.set_level(logging.INFO, logger="nanochat")
    second = prepare_data(root, tokenizer=tok, cache_root=cache)  # a new run: rebuilt, and why
    assert any("its sources changed: d07.txt changed" in r.message and "building it" in r.message
               for r in caplog.records)
    assert second.store.path == first.store.path
    corpus = load_corpus(root)
    assert second.store.train.read().tolist() == tokenize_docs(tok, corpus.train_docs).tolist()
    (root / "d40.txt").write_text("a new document\n")
    (root / "d03.txt").unlink()
    changes = list_sources(root).changes(second.sources.listing())
    assert changes == ["d03.txt was removed", "d40.txt was added"]
    os.utime(root / "d05.txt", ns=(0, 0))  # same size, another modification time
    assert any(c.startswith("d05.txt changed (modified ") for c in list_sources(root).changes(second.sources.listing()))
    assert list_sources(root).changes(list_sources(root).listing()) == []


def test_resume_through_the_trainer_is_refused_naming_the_changed_file(small_corpus, tmp_path, monkeypatch):
    from tests.conftest import train_until_first_save

    from nanochat.train.trainer import NanoChatTrainer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for p in small_corpus.iterdir():
        (corpus / p.name).write_text(p.read_text())
    kw = tiny_train_kwargs(corpus, tmp_path / "run", num_iterations=4, save_every=2, num_samples=0)
    train_until_first_save(kw, monkeypatch)
    assert json.loads((tmp_path / "run" / "sources.json").read_text())["files"]
    (corpus / "glob.py").write_text((corpus / "glob.py").read_text() + "\n# edited\n")
    with pytest.raises(UsageError) as e:
        NanoChatTrainer(**{**kw, "resume": True}).train()
    code, message = describe_error(e.value)
    assert code == 2 and "\n" not in message and "glob.py changed" in message and "since this run started" in message


def test_truncated_or_missing_store_file_is_refused_and_verify_finds_a_changed_byte(tmp_path, tok, tok_dir,
                                                                                     monkeypatch, capsys):
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(60):
        (root / f"d{i:02d}.txt").write_text(_text(i))
    cache = tmp_path / "cache"
    store = prepare_data(root, tokenizer=tok, cache_root=cache).store
    path, size = store.path / "val.bin", (store.path / "val.bin").stat().st_size
    data = path.read_bytes()
    path.write_bytes(data[: size - 2])
    with pytest.raises(DataError, match=rf"val\.bin has {size - 2:,} bytes, its manifest says {size:,}.*delete"):
        prepare_data(root, tokenizer=tok, cache_root=cache)
    path.unlink()
    with pytest.raises(DataError, match=r"val\.bin is missing"):
        prepare_data(root, tokenizer=tok, cache_root=cache)
    path.write_bytes(bytes([data[0] ^ 1]) + data[1:])  # the right size, one byte changed
    main = _script_main("tokenize_corpus")
    argv = ["--dataset_path", str(root), "--tokenizer_dir", str(tok_dir)]
    monkeypatch.setenv("NANOCHAT_CACHE", str(cache))
    assert main([*argv, "--verify"]) == 1
    path.write_bytes(data)
    capsys.readouterr()
    assert main([*argv, "--verify"]) == 0
    said = capsys.readouterr().out  # what it checked, and how: the store by sha256, the corpus by stat
    assert f"the token store's {len(store.manifest['files'])} files match the sha256" in said
    assert "the corpus's 60 files match its listing by size and modification time (their bytes are not hashed)" in said


def _script_main(name: str):
    return load_script(name).main


# ------------------------------------------------------------------ bad input, before any work
def _bad_corpus(root: Path, case: str) -> str:
    root.mkdir()
    pq.write_table(pa.table({"text": [_text(i) for i in range(20)]}), root / "shard_00000.parquet")
    if case == "parquet without text":
        pq.write_table(pa.table({"body": ["x"]}), root / "shard_00001.parquet")
        return r'shard_00001\.parquet: no "text" column \(columns: \[\'body\'\]\)'
    if case == "0-byte shard":
        (root / "shard_00001.parquet").write_bytes(b"")
        return r"shard_00001\.parquet: an empty \(0-byte\) file, not a parquet shard.*download it again or remove it"
    lines = [json.dumps({"text": _text(i)}) for i in range(5)]
    if case == "non-UTF-8 .jsonl":
        (root / "more.jsonl").write_bytes(("\n".join(lines[:2]) + "\n").encode() + '{"text": "caf\xe9"}\n'.encode("latin-1"))
        return r"more\.jsonl:3: not UTF-8 \(byte 0xe9\).*convert it"
    (root / "more.jsonl").write_bytes(("\n".join(lines) + "\n").encode("utf-16-le"))
    return r"more\.jsonl:1: a NUL byte"


@pytest.mark.parametrize("case", ["parquet without text", "0-byte shard", "non-UTF-8 .jsonl", "UTF-16 .jsonl"])
def test_bad_shards_are_one_line_errors_before_any_work(tmp_path, case):
    pattern = _bad_corpus(tmp_path / "corpus", case)
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match=pattern) as e:
        prepare_data(tmp_path / "corpus", vocab_size=300, cache_root=cache)  # a tokenizer would be trained first
    assert "\n" not in describe_error(e.value)[1]
    assert not (cache / "tokenizers").exists() and not list(cache.glob("stores/*/tokens-*"))


def test_bad_shard_from_base_train_is_one_error_line(tmp_path):
    _bad_corpus(tmp_path / "corpus", "non-UTF-8 .jsonl")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "base_train.py"), "--dataset_path",
                        str(tmp_path / "corpus"), "--device", "cpu", "--run_dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "NANOCHAT_CACHE": str(tmp_path / "cache")})
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "more.jsonl:3" in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_a_fifo_in_the_corpus_is_skipped_not_waited_on(tmp_path, tok_dir):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_text(_text(1) * 5)
    (root / "b.txt").write_text(_text(2) * 5)
    os.mkfifo(root / "zz.txt")  # opening it to read would wait for a writer forever
    assert list_sources(root).skipped == {sources.SPECIAL: 1}
    code = ("import sys; sys.path.insert(0, sys.argv[4]); from tests.reference_data import load_corpus;"
            " from nanochat.common import setup_logging; from nanochat.data.prepare import prepare_data;"
            " from nanochat.tokenizer import BPETokenizer; setup_logging(); c = load_corpus(sys.argv[1]);"
            " s = prepare_data(sys.argv[1], tokenizer=BPETokenizer.load(sys.argv[2]), cache_root=sys.argv[3]).store;"
            " print('OK', c.describe() == s.describe())")
    r = subprocess.run([sys.executable, "-c", code, str(root), str(tok_dir), str(tmp_path / "cache"), str(ROOT)],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert r.returncode == 0 and "OK True" in r.stdout, r.stderr
    assert r.stderr.count("skipped 1 not a regular file (FIFO") == 1  # said once
    with pytest.raises(DataError, match=r"zz\.txt is not a regular file"):
        list_sources(root / "zz.txt")


def test_a_run_directory_inside_the_corpus_is_refused(small_corpus, tmp_path):
    from nanochat.train.trainer import NanoChatTrainer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(_text(3) * 50)
    with pytest.raises(UsageError, match=r"--run_dir .*run is inside --dataset_path .*corpus.*outside the corpus"):
        NanoChatTrainer(**tiny_train_kwargs(corpus, corpus / "runs" / "run")).train()
    assert not (corpus / "runs").exists()


def test_jsonl_with_a_byte_order_mark_reads_as_without(tmp_path, tok):
    lines = "".join(json.dumps({"text": _text(i)}) + "\n" for i in range(30))
    for name, data in (("bom", b"\xef\xbb\xbf" + lines.encode()), ("plain", lines.encode())):
        (tmp_path / name).mkdir()
        (tmp_path / name / "d.jsonl").write_bytes(data)
    bom, plain = load_corpus(tmp_path / "bom"), load_corpus(tmp_path / "plain")
    assert bom.train_docs == plain.train_docs and bom.train_ids == plain.train_ids and bom.val_docs == plain.val_docs
    a = prepare_data(tmp_path / "bom", tokenizer=tok, cache_root=tmp_path / "cache").store
    b = prepare_data(tmp_path / "plain", tokenizer=tok, cache_root=tmp_path / "cache").store
    assert np.array_equal(a.train.read(), b.train.read()) and np.array_equal(a.val.read(), b.val.read())
