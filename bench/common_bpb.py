"""One evaluator for two projects' models: bits per byte over every token of every validation
document, each row starting at its document's start, independent of how either project packs.

Why not each project's own evaluator: karpathy/nanochat's validation loader packs best-fit from a
buffer of 1,000 documents that it refills by cycling its validation shard, so on a split of fewer
documents the buffer holds copies of each, and best-fit fills every row with the shortest of them
(whole ones first, then the shortest cropped). On tiny Shakespeare's 57 validation pieces its 128
evaluation rows hold 8 distinct documents, all among the shortest; its bpb there measures those.
Ours cuts the validation stream every seq_len tokens. Both are fine for watching one run; neither
compares two models on the same text.

The rows (`document_rows`): a document is its BOS and its tokens. One that fits seq_len + 1 tokens
is one row, padded (padding is never scored). A longer one is scored in windows: the first holds
its first seq_len + 1 tokens and scores all of them; each next window ends seq_len / 2 targets
further (or at the document's end) and scores only the targets the previous windows did not, so
every target is scored once, with at least seq_len / 2 tokens of its own document before it (all
of it, when shorter). Rows other than a document's first do not begin with BOS; none of their first
half is scored. bpb = sum of the scored targets' losses in nats / (ln 2 x their UTF-8 bytes); a
special token has no bytes and is not scored. Both tokenizers are byte-level, so the bytes are the
documents' UTF-8 length on both sides and the denominators agree.

Its imports are torch's only: karpathy/nanochat's Python imports it too (bench/score_nanochat.py),
where `nanochat` is the checkout's package, not ours; `score_run`, for our checkpoints, imports
ours when called.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(inputs, targets) of shape (B, T) -> per-target loss in nats (B, T); targets -1 are padding."""


def document_rows(docs: Sequence[Sequence[int]], bos: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (rows, seq_len): every document's targets, each scored in exactly
    one row (the rest of a row's targets are -1), as the module docstring lays them out."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    stride = seq_len // 2
    xs, ys = [], []
    for doc in docs:
        tokens = [bos, *doc]
        scored_to = 0  # targets tokens[1 .. scored_to] are scored
        while scored_to < len(tokens) - 1:
            end = min(len(tokens) - 1, seq_len if scored_to == 0 else scored_to + stride)
            start = max(0, end - seq_len)
            window = tokens[start:end + 1]
            x = torch.zeros(seq_len, dtype=torch.long)
            y = torch.full((seq_len,), -1, dtype=torch.long)
            x[:len(window) - 1] = torch.tensor(window[:-1])
            first = scored_to - start  # target j of the window is tokens[start + j + 1]
            y[first:len(window) - 1] = torch.tensor(window[first + 1:])
            xs.append(x)
            ys.append(y)
            scored_to = end
    if not xs:
        raise ValueError("no validation tokens to score")
    return torch.stack(xs), torch.stack(ys)


@torch.no_grad()
def bits_per_byte(loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor, token_bytes: torch.Tensor, *,
                  batch_size: int = 16, device: str | torch.device = "cpu") -> float:
    """bpb of the model behind `loss_fn` over the scored targets of (`inputs`, `targets`);
    `token_bytes[id]`: the token's UTF-8 bytes (0: a special token, not scored)."""
    nats, nbytes = 0.0, 0
    token_bytes = token_bytes.to(device)
    for i in range(0, len(inputs), batch_size):
        x, y = inputs[i:i + batch_size].to(device), targets[i:i + batch_size].to(device)
        loss = loss_fn(x, y).double().view(-1)
        b = torch.where(y.view(-1) >= 0, token_bytes[y.view(-1).clamp(min=0)], 0)
        nats += torch.where(b > 0, loss, 0.0).sum().item()
        nbytes += int(b.sum().item())
    if nbytes == 0:
        raise ValueError("the validation rows hold no scorable bytes")
    return nats / (math.log(2) * nbytes)


def score_run(run_dir, steps: Sequence[int], texts: Sequence[str], seq_len: int,
              device: str | torch.device = "cpu") -> list[float]:
    """bpb of our run's checkpoints at `steps` over the documents `texts` (bench/score_nanochat.py
    does the same for karpathy/nanochat's)."""
    from nanochat.checkpoint.loader import load_model, read_run

    out, rows = [], None
    for step in steps:
        model, tok = load_model(read_run(run_dir, step=step), device=device)
        model.eval()
        if rows is None:
            rows = document_rows([tok.encode(t) for t in texts], tok.bos_id, seq_len)
        out.append(bits_per_byte(lambda x, y: model(x, y, reduction="none").view(y.shape), *rows,
                                 tok.token_bytes(), device=device))
    return out
