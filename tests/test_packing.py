"""Best-fit packing (nanochat.data.packing, TokenBatches(packing="bestfit"), split_stream's
validation rows), checked against `reference_rows`: a plain Python best fit over token lists
written here from the rule (karpathy/nanochat's loader: a buffer scanned linearly for the longest
document that fits, else the shortest cropped to fill the row), on a small in-memory corpus
whose every non-BOS token is its own position + 1, so a token tells where it came from.

- layout: the rows equal the reference's, row by row; every row begins with BOS at a document's
  start; each piece of a row is a prefix of one document; no document is in two rows; the rows'
  tokens plus the dropped ones are exactly the corpus's; the dropped count and the cropped share
  equal the reference's;
- batches: x = row[:-1] and y = row[1:] of the layout's rows; same (seed, epoch) -> same batches,
  another epoch -> another layout; ranks of world 2 and 3 concatenated equal one rank reading
  the global batch, and their rows are disjoint; a state_dict taken mid-epoch (and in a later
  epoch) resumes on exactly the batches of an uninterrupted loader;
- validation: the same rows on every evaluation and every split_stream;
- errors: instruction data with bestfit, a validation split filling no row: a DataError naming
  --packing; a layout dropping most tokens: one warning;
- end to end: a d2 run with packing="bestfit" trains and evaluates on rows that begin with BOS,
  and scripts/eval.py --packing bestfit reproduces its val_loss.
All comparisons are exact (tolerance 0: integer bookkeeping) but eval.py's val_loss against the
run's (rel 1e-5, as tests/test_eval.py: the same rows in another batch size).
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from nanochat.data.batches import VAL_SEED, TokenBatches, split_stream, val_batches
from nanochat.data.packing import BUFFER_DOCS, HIGH_CROP, bestfit_rows, epoch_seed
from nanochat.data.sources import DataError
from nanochat.data.streams import TokenStream
from nanochat.data.token_store import TokenStore
from tests.conftest import load_script, tiny_train_kwargs, warnings_in

BOS = 0


def corpus(n_docs: int, mean: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """tokens (BOS = 0 at each document's start, else position + 1) and document starts; lengths
    from 2 (BOS and one token) to a few rows' worth, geometric-ish like text."""
    rng = np.random.default_rng(seed)
    lengths = 2 + rng.geometric(1 / mean, n_docs)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    tokens = np.arange(1, int(lengths.sum()) + 1, dtype=np.int64)
    tokens[starts] = BOS
    return tokens, starts


def reference_rows(tokens: np.ndarray, starts: np.ndarray, row_len: int, seed: int, epoch: int,
                   buffer_docs: int = BUFFER_DOCS) -> tuple[list[list[int]], int]:
    """Rows of `row_len` tokens and the dropped token count, by the rule, with lists only."""
    ends = list(starts[1:]) + [len(tokens)]
    docs = [tokens[s:e].tolist() for s, e in zip(starts, ends)]
    order = np.random.default_rng(epoch_seed(seed, epoch)).permutation(len(docs)).tolist()
    buffer: list[list[int]] = []  # in the order buffered
    rows, placed, nxt = [], 0, 0
    while True:
        row: list[int] = []
        while len(row) < row_len:
            while nxt < len(order) and len(buffer) < buffer_docs:
                buffer.append(docs[order[nxt]])
                nxt += 1
            if not buffer:
                return rows, sum(map(len, docs)) - placed
            room = row_len - len(row)
            fits = [i for i, d in enumerate(buffer) if len(d) <= room]
            if fits:
                best = max(fits, key=lambda i: (len(buffer[i]), -i))  # longest, first buffered
            else:
                best = min(range(len(buffer)), key=lambda i: (len(buffer[i]), i))  # shortest, first buffered
            row += buffer.pop(best)[:room]
        rows.append(row)
        placed += row_len


def all_rows(stream: TokenStream) -> np.ndarray:
    return stream.window_tokens(np.arange(len(stream) // stream.row_len) * stream.row_len, stream.row_len)


@pytest.mark.parametrize("seq_len,buffer_docs", [(8, 1000), (31, 1000), (64, 1000), (31, 5)])
def test_rows_equal_the_reference_and_hold_each_document_once(seq_len, buffer_docs):
    tokens, starts = corpus(600, mean=20, seed=seq_len)
    rows_stream, info = bestfit_rows(TokenStream(tokens, docs=starts), seq_len, seed=3, epoch=1,
                                     buffer_docs=buffer_docs)
    ref, ref_dropped = reference_rows(tokens, starts, seq_len + 1, seed=3, epoch=1, buffer_docs=buffer_docs)
    rows = all_rows(rows_stream)
    assert rows.tolist() == ref
    assert info.rows == len(ref) and info.dropped_tokens == ref_dropped and info.tokens == len(tokens)
    assert info.cropped_share == ref_dropped / len(tokens)

    doc_of_start = {int(s): d for d, s in enumerate(starts)}
    lengths = np.diff(np.append(starts, len(tokens)))
    seen: dict[int, int] = {}  # document -> tokens of it in the rows
    bos_alone = 0  # a document cropped to its BOS, the last token of a row (its source untold)
    for row in rows:
        assert row[0] == BOS
        bos = np.flatnonzero(row == BOS).tolist() + [len(row)]
        for a, b in zip(bos[:-1], bos[1:]):
            piece = row[a:b]
            if len(piece) == 1:  # the corpus has no 1-token document: a crop, at the row's end
                assert b == len(row)
                bos_alone += 1
                continue
            doc = doc_of_start[int(piece[1]) - 2]  # token p + 1 -> its document starts at p - 1
            s = int(starts[doc])
            assert piece.tolist() == tokens[s:s + len(piece)].tolist()  # a prefix of its document
            assert doc not in seen  # no document (so no token) in two places
            seen[doc] = len(piece)
    # the rows' tokens and the dropped ones make up the corpus exactly
    assert sum(seen.values()) + bos_alone == rows.size == len(tokens) - info.dropped_tokens
    assert info.cropped_docs == sum(n < lengths[d] for d, n in seen.items()) + bos_alone


def test_batches_are_the_rows_deterministic_per_seed_and_epoch():
    tokens, starts = corpus(500, mean=12, seed=0)
    stream = TokenStream(tokens, docs=starts)
    loader = TokenBatches(stream, seq_len=16, batch_size=4, seed=7, packing="bestfit")
    rows0 = all_rows(bestfit_rows(stream, 16, seed=7, epoch=0)[0])
    assert loader.num_windows == len(rows0) and loader.bestfit.rows == len(rows0)
    got = []
    for _ in range(loader.steps_per_epoch):
        x, y = loader.next_batch()
        assert torch.equal(x[:, 1:], y[:, :-1]) and (x[:, 0] == BOS).all()
        got += torch.cat([x, y[:, -1:]], 1).tolist()
    order = torch.randperm(len(rows0), generator=torch.Generator().manual_seed(epoch_seed(7, 0)))
    assert got == rows0[order[:len(got)].numpy()].tolist()

    again = TokenBatches(stream, seq_len=16, batch_size=4, seed=7, packing="bestfit")
    for _ in range(loader.steps_per_epoch):
        again.next_batch()
    a, b = loader.next_batch(), again.next_batch()  # epoch 1, both
    assert loader.epoch > 1 and all(torch.equal(u, v) for u, v in zip(a, b))
    rows1 = all_rows(bestfit_rows(stream, 16, seed=7, epoch=1)[0])
    assert rows1.tolist() != rows0.tolist()[:len(rows1)]  # another epoch lays out anew
    other = TokenBatches(stream, seq_len=16, batch_size=4, seed=8, packing="bestfit").next_batch()
    assert not torch.equal(other[0], TokenBatches(stream, seq_len=16, batch_size=4, seed=7,
                                                  packing="bestfit").next_batch()[0])


@pytest.mark.parametrize("world", [2, 3])
def test_rank_slices_are_disjoint_and_make_the_global_batch(world):
    tokens, starts = corpus(700, mean=12, seed=world)
    stream = TokenStream(tokens, docs=starts)
    one = TokenBatches(stream, seq_len=16, batch_size=2 * world, seed=1, packing="bestfit")
    ranks = [TokenBatches(stream, seq_len=16, batch_size=2, seed=1, rank=r, world_size=world, packing="bestfit")
             for r in range(world)]
    assert all(r.steps_per_epoch == one.steps_per_epoch for r in ranks)
    for _ in range(one.steps_per_epoch + 2):  # into the next epoch
        x, _ = one.next_batch()
        shares = [r.next_batch()[0] for r in ranks]
        assert torch.equal(torch.cat(shares), x)
        firsts = [tuple(row[1:3].tolist()) for share in shares for row in share]  # a row's first tokens name it
        assert len(set(firsts)) == len(firsts)


def test_resume_mid_epoch_equals_an_uninterrupted_loader(tmp_path):
    tokens, starts = corpus(400, mean=12, seed=5)
    stream = TokenStream(tokens, docs=starts)
    make = lambda: TokenBatches(stream, seq_len=16, batch_size=3, seed=2, rank=1, world_size=2,  # noqa: E731
                                packing="bestfit")
    full = make()
    n = full.steps_per_epoch
    uninterrupted = [full.next_batch() for _ in range(2 * n + 3)]
    for cut in (n // 2, n + 2):  # mid-epoch 0, and in epoch 1 (its layout recomputed on resume)
        first = make()
        for _ in range(cut):
            first.next_batch()
        torch.save(first.state_dict(), tmp_path / "state.pt")
        resumed = make()
        resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
        for want in uninterrupted[cut:]:
            got = resumed.next_batch()
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _store(kind: str, train: TokenStream, val: TokenStream) -> TokenStore:
    return TokenStore(Path("."), {"kind": kind}, train, val)


def test_validation_rows_are_the_same_on_every_evaluation():
    tokens, starts = corpus(300, mean=10, seed=9)
    store = _store("text", TokenStream(tokens[:0], docs=starts[:0]), TokenStream(tokens, docs=starts))
    val = split_stream(store, "val", 16, BOS, packing="bestfit")
    assert val.row_len == 17
    want = all_rows(bestfit_rows(store.val, 16, VAL_SEED, 0)[0])
    assert len(want) > 40
    picked = want[np.arange(20) * len(want) // 20]
    evaluations = [list(val_batches(val, 16, 4, max_tokens=16 * 20)) for _ in range(2)]
    evaluations.append(list(val_batches(split_stream(store, "val", 16, BOS, packing="bestfit"), 16, 4, 16 * 20)))
    for batches in evaluations:
        rows = torch.cat([torch.cat([x, y[:, -1:]], 1) for x, y in batches])
        assert rows.tolist() == picked.tolist()  # 20 rows spread over the layout, in order
    shards = [torch.cat([x for x, _ in val_batches(val, 16, 4, 16 * 20, rank=r, world_size=2)]) for r in (0, 1)]
    assert sorted(map(tuple, torch.cat(shards).tolist())) == sorted(map(tuple, picked[:, :-1].tolist()))
    assert split_stream(store, "val", 16, BOS) is store.val  # stream: the split as it is


def test_errors_and_warning_name_the_flag(nanochat_log):
    """Instruction data with bestfit, and a validation split that fills no row: a DataError
    naming --packing; a layout dropping more than HIGH_CROP of the tokens: a warning, once."""
    tokens, starts = corpus(50, mean=10, seed=1)
    mask = np.ones(len(tokens), dtype=np.uint8)
    stream = TokenStream(tokens, mask, docs=starts)
    with pytest.raises(DataError, match="--packing bestfit"):
        split_stream(_store("instruct", stream, stream), "val", 16, BOS, packing="bestfit")
    with pytest.raises(ValueError, match="plain-text"):
        TokenBatches(stream, seq_len=16, batch_size=2, packing="bestfit")
    small = TokenStream(tokens[:starts[3]], docs=starts[:3])  # 3 documents, fewer tokens than a row of 257
    with pytest.raises(DataError, match="--packing stream"):
        split_stream(_store("text", small, small), "val", 256, BOS, packing="bestfit")
    long_tokens, long_starts = corpus(200, mean=60, seed=2)
    long_docs = TokenStream(long_tokens, docs=long_starts)
    for epoch in (0, 1):
        info = bestfit_rows(long_docs, 8, seed=0, epoch=epoch, name="long")[1]
        assert info.cropped_share > HIGH_CROP
    median = int(np.median(np.diff(np.append(long_starts, len(long_tokens)))))
    assert [w for w in warnings_in(nanochat_log) if "drops" in w] == [
        f"WARNING: best-fit packing drops {info.cropped_share:.0%} of the long tokens at seq_len 8: its documents "
        f"are long for a row (median {median} tokens) and a document's tail past one row is never read. "
        "--packing stream reads every token"]


def test_d2_run_trains_and_evaluates_on_bestfit_rows(small_corpus, tmp_path, capsys, monkeypatch):
    """A run's loader and validation read rows that begin with BOS, its result.json holds the
    layout's cropped share; scripts/eval.py with
    --packing bestfit reproduces the run's val_loss (rel 1e-5, as tests/test_eval.py), and
    without it says which packing the run used."""
    from nanochat.common import logger
    from nanochat.trainer import NanoChatTrainer

    # documents: the corpus's paragraphs, as a jsonl of "text" records
    paragraphs = [p for f in sorted(small_corpus.glob("*.py")) for p in f.read_text().split("\n\n") if p.strip()]
    data = tmp_path / "paragraphs.jsonl"
    data.write_text("".join(f'{{"text": {json.dumps(p)}}}\n' for p in paragraphs))
    trainer = NanoChatTrainer(**tiny_train_kwargs(data, tmp_path / "run", packing="bestfit", num_iterations=6,
                                                  eval_every=3, num_samples=0))
    result = trainer.train()
    assert math.isfinite(result.val_loss) and result.steps == 6
    loader, bos = trainer.data.loader, trainer.data.tokenizer.bos_id
    assert loader.packing == "bestfit" and 0 < loader.bestfit.cropped_share < 1
    saved = json.loads((tmp_path / "run" / "result.json").read_text())
    assert saved["cropped_share"] == result.cropped_share == loader.bestfit.cropped_share
    assert trainer.data.val.row_len == 33
    x, _ = loader.next_batch()
    assert (x[:, 0] == bos).all()
    vx, _ = next(iter(val_batches(trainer.data.val, 32, 8, 2048)))
    assert (vx[:, 0] == bos).all()

    main = load_script("eval").main
    monkeypatch.setattr(logger, "handlers", [])  # eval.py logs to this test's stderr (capsys's)
    capsys.readouterr()
    common = ["--run_dir", str(tmp_path / "run"), "--dataset_path", str(data), "--device", "cpu", "--seq_len", "32",
              "--eval_tokens", "2048", "--batch_size", "3"]
    assert main([*common, "--packing", "bestfit"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["val_loss"] == pytest.approx(result.val_loss, rel=1e-5)
    assert main(common) == 0
    out, err = capsys.readouterr()
    assert "the run evaluated with --packing bestfit" in err
