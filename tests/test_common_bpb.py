"""bench/common_bpb.py, the one evaluator bench_vs_nanochat scores both projects' models with.

Checked against: the documents themselves (every target scored exactly once, after a context that
is its own document's preceding tokens, at least seq_len / 2 of them or all); a bigram model's bpb
computed by hand in float64 over every transition of every document (a bigram's loss depends on the
previous token only, so any windowing must give the hand figure); our GPT's loss on a document
that fits one row, computed directly.
"""

import math
import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import common_bpb  # noqa: E402  (a benchmark module, outside the package)

BOS = 0


def _docs(seed: int, n: int, vocab: int, longest: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(1, longest))] for _ in range(n)]


@pytest.mark.parametrize("seq_len", [2, 7, 16])
def test_every_target_is_scored_once_after_its_own_documents_context(seq_len):
    docs = _docs(0, 40, 50, 4 * seq_len + 3)
    x, y = common_bpb.document_rows(docs, BOS, seq_len)
    assert x.shape == y.shape and x.shape[1] == seq_len
    # Walk the rows in order: each belongs to the next document whose targets are not all scored.
    r = 0
    for doc in docs:
        tokens = [BOS, *doc]
        scored = []
        first_row = True
        while len(scored) < len(doc):
            row_x, row_y = x[r].tolist(), y[r].tolist()
            if first_row:
                assert row_x[0] == BOS  # a document's first row starts at its start
            for j, t in enumerate(row_y):
                if t < 0:
                    continue
                pos = len(scored) + 1  # index in `tokens` of the next unscored target
                assert t == tokens[pos]
                context = row_x[:j + 1]
                assert context == tokens[pos - len(context):pos]  # its own document, in order
                assert len(context) >= min(pos, seq_len // 2)
                scored.append(t)
            first_row = False
            r += 1
        assert scored == doc
    assert r == len(x)  # no row left over


def test_a_bigram_models_bpb_is_the_hand_computed_one():
    vocab, seq_len = 30, 8
    docs = _docs(1, 25, vocab, 3 * seq_len)
    torch.manual_seed(0)
    table = torch.randn(vocab, vocab)  # logits of the next token given the previous one
    token_bytes = torch.tensor([0, *[random.Random(k).randint(1, 4) for k in range(1, vocab)]])

    def loss_fn(x, y):
        return F.cross_entropy(table[x].view(-1, vocab), y.view(-1), ignore_index=-1, reduction="none").view(y.shape)

    got = common_bpb.bits_per_byte(loss_fn, *common_bpb.document_rows(docs, BOS, seq_len), token_bytes, batch_size=5)
    logp = torch.log_softmax(table.double(), dim=-1)
    nats = sum(-logp[a, b].item() for d in docs for a, b in zip([BOS, *d], d))
    nbytes = sum(int(token_bytes[t]) for d in docs for t in d)
    # fp32 log-softmax terms (relative error ~1e-7 each), summed in float64: 1e-6 is ample
    assert got == pytest.approx(nats / (math.log(2) * nbytes), rel=1e-6)


def test_a_document_that_fits_one_row_scores_as_the_models_own_loss():
    from nanochat.model.gpt import GPT, preset_config

    torch.manual_seed(0)
    model = GPT(preset_config("d2", vocab_size=64, seq_len=16))
    model.init_weights()
    model.eval()
    doc = _docs(2, 1, 64, 15)[0]
    token_bytes = torch.ones(64, dtype=torch.long)
    token_bytes[BOS] = 0
    got = common_bpb.bits_per_byte(lambda x, y: model(x, y, reduction="none").view(y.shape),
                                   *common_bpb.document_rows([doc], BOS, 16), token_bytes)
    row = torch.tensor([[BOS, *doc]])
    with torch.no_grad():
        want = model(row[:, :-1], row[:, 1:], reduction="none").sum().item() / (math.log(2) * len(doc))
    # the same forward on a row padded after the document (causal: padding is never seen)
    assert got == pytest.approx(want, rel=1e-5)


def test_nothing_to_score_is_an_error():
    with pytest.raises(ValueError, match="no validation tokens"):
        common_bpb.document_rows([], BOS, 8)
    with pytest.raises(ValueError, match="seq_len"):
        common_bpb.document_rows([[1]], BOS, 1)
