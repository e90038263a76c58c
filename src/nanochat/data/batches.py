"""Batches: deterministic, resumable, rank-aware (x, y) windows cut from a token stream.

    train = split_stream(store, "train", seq_len, pad_id)      # records packed into windows
    loader = TokenBatches(train, seq_len=256, batch_size=16, seed=0, rank=r, world_size=n)
    x, y = loader.next_batch(device)                           # [16, 256] int64 each
    for x, y in val_batches(split_stream(store, "val", ...), 256, 16, eval_tokens): ...

Window k of a stream is tokens[k*seq_len : k*seq_len + seq_len + 1]: x its first seq_len
tokens, y its last seq_len (consecutive windows share one token, so every token is a target
once). `TokenBatches` visits the windows in an order seeded by (seed, epoch), gives rank r its
slice of each global batch and resumes from two ints (epoch, step): a resumed run reads exactly
the batches of an uninterrupted one. `val_batches` reads windows spread evenly over the
validation stream, the same windows for every evaluation and for `scripts/eval.py`.

Plain text is cut either as above (`packing="stream"`) or into rows that each begin at a
document's start (`packing="bestfit"`, nanochat.data.packing): window k is then row k, seq_len+1
tokens of its own. The training rows are laid out anew each epoch (documents in an order seeded
by (seed, epoch)), the validation rows once, with `VAL_SEED`, so every evaluation reads the same.

Instruction records are scored on their answers only (the stream's loss mask: y is -1 where a
target is not scored) and packed so that none crosses a window boundary (`split_stream`), not
padded each to its own window (docs/design.md); a window without a scored target is left out.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Callable, Literal

import numpy as np
import torch

from nanochat.common import logger
from nanochat.data.packing import BestFit, bestfit_rows, epoch_seed
from nanochat.data.sources import DataError
from nanochat.data.split import VAL_FRACTION
from nanochat.data.token_store import TokenStore
from nanochat.data.streams import TokenStream


VAL_SEED = 0
"""The seed of the validation split's best-fit layout: fixed, so every run and evaluation of a
corpus at one seq_len reads the same validation rows."""

Packing = Literal["stream", "bestfit"]


def split_stream(store: TokenStore, split: Literal["train", "val"], seq_len: int, pad_id: int,
                 fallback: Callable[[str], None] | None = None, packing: Packing = "stream") -> TokenStream:
    """The stream a split's batches read. Plain text: the store's split as it is, or for the
    validation split with packing "bestfit", its rows (laid out once, `VAL_SEED`); the training
    rows change each epoch, so TokenBatches(packing="bestfit") lays them out. Instruction records:
    laid out whole inside the seq_len+1 windows (`TokenStream.packed`: a layout over the memory
    map, no copy), the packing logged; records longer than a window are a fallback, given to
    `fallback` (a run records it) or else logged. Best fit is for plain text only: asked for with
    instruction records, a DataError."""
    stream = store.train if split == "train" else store.val
    if store.kind != "instruct":
        if packing == "bestfit" and split == "val":
            rows, info = bestfit_rows(stream, seq_len, VAL_SEED, 0, name="validation")
            if info.rows == 0:
                raise DataError(f"--packing bestfit: the validation split's {info.docs} documents ({info.tokens:,} "
                                f"tokens) do not fill one row of seq_len+1 = {seq_len + 1} tokens. Use a smaller "
                                "--seq_len, a corpus with more validation text, or --packing stream")
            return rows
        return stream
    if packing == "bestfit":
        raise DataError("--packing bestfit lays out plain-text documents, but this corpus is instruction data, "
                        "whose records are always packed whole into windows; drop --packing bestfit")
    packed, packing = stream.packed(seq_len, pad_id)
    logger.info("%s records: %d packed into windows of %d tokens, %.1f%% padding", split,
                packing.records, seq_len + 1, packing.pad_pct)
    if packing.long_records:
        message = (f"instruction data: {packing.long_records} of {packing.records} {split} records are longer "
                   f"than a window (--seq_len {seq_len} + 1 tokens); their tokens past the first window are "
                   f"{'trained' if split == 'train' else 'scored'} without the record's beginning. Raise --seq_len "
                   "to keep them whole")
        if fallback is not None:
            fallback(message)
        else:
            logger.warning("WARNING: %s", message)
    return packed


def _stride(stream: TokenStream, seq_len: int) -> int:
    """Where window k starts, divided by k: seq_len (a window shares its last token with the
    next) or, for a stream of rows (best fit), seq_len+1."""
    if stream.row_len is None:
        return seq_len
    if stream.row_len != seq_len + 1:
        raise ValueError(f"a stream of rows of {stream.row_len} tokens is read with seq_len {stream.row_len - 1}, "
                         f"not {seq_len}")
    return seq_len + 1


def _num_windows(stream: TokenStream, seq_len: int) -> int:
    return max(0, (len(stream) - seq_len - 1) // _stride(stream, seq_len) + 1)


def _window_batch(stream: TokenStream, windows: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x, y [len(windows), seq_len] int64 (contiguous) of the stream's windows numbered `windows`;
    y is -1 (GPT.forward's ignore_index) where the mask does not score the target."""
    starts = windows.astype(np.int64) * _stride(stream, seq_len)
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

    A loss mask (the stream's, or `loss_mask` [N] bool with a tensor of instruction records' tokens)
    sets y to -1 where the target is not scored and leaves out the windows with no scored target
    (`num_windows` counts the rest). Without it every target is scored and every window is used.

    With packing "bestfit" the windows are the rows of a best-fit layout of the stream's documents
    (nanochat.data.packing), one layout per epoch, seeded by (seed, epoch) and recomputed from
    them on a resume. Epochs then differ by a few rows: `num_windows` and `steps_per_epoch` are
    epoch 0's (what the schedule counts); `bestfit` is the current epoch's layout, its cropped
    share included.
    """

    def __init__(self, tokens: TokenStream | torch.Tensor, *, seq_len: int, batch_size: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1, loss_mask: torch.Tensor | None = None,
                 packing: Packing = "stream") -> None:
        if seq_len < 1 or batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need seq_len, batch_size, world_size >= 1 and 0 <= rank < world_size; got "
                             f"seq_len={seq_len} batch_size={batch_size} rank={rank} world_size={world_size}")
        if packing not in ("stream", "bestfit"):
            raise ValueError(f"packing must be 'stream' or 'bestfit', got {packing!r}")
        self.stream = TokenStream.of(tokens, loss_mask)
        self.packing = packing
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.global_batch = batch_size * world_size
        self._rows: tuple[int, TokenStream, BestFit] | None = None  # the current epoch's best-fit layout
        all_windows = _num_windows(self._stream_of(0), seq_len)
        self._kept = self.stream.scored_windows(seq_len)  # None: every window
        self.num_windows = all_windows if self._kept is None else len(self._kept)
        self.steps_per_epoch = self.num_windows // self.global_batch
        if self.steps_per_epoch == 0:
            scored = "" if self._kept is None else f" ({self.num_windows} with a scored target)"
            scored += " (rows of whole documents: --packing bestfit)" if packing == "bestfit" else ""
            raise DataError(
                f"the training stream has {len(self.stream):,} tokens = {all_windows} windows{scored} of "
                f"seq_len+1 = {seq_len + 1} tokens (consecutive windows share one token), but one "
                f"global batch needs batch_size*world_size = {self.global_batch} windows = "
                f"{self.global_batch * seq_len + 1:,} tokens. Use a smaller --seq_len or "
                "--batch_size, or a larger corpus"
            )
        self._epoch, self._step = 0, 0
        self._order: tuple[int, torch.Tensor] | None = None

    def _stream_of(self, epoch: int) -> TokenStream:
        """The stream whose windows epoch `epoch` reads: the stream, or its best-fit rows."""
        if self.packing == "stream":
            return self.stream
        if self._rows is None or self._rows[0] != epoch:
            self._rows = (epoch, *bestfit_rows(self.stream, self.seq_len, self.seed, epoch))
        return self._rows[1]

    @property
    def bestfit(self) -> BestFit | None:
        """The current epoch's best-fit layout (its cropped share); None with packing "stream"."""
        if self.packing == "stream":
            return None
        self._stream_of(self._epoch)
        return self._rows[2]

    def _steps_in(self, epoch: int) -> int:
        if self.packing == "stream":
            return self.steps_per_epoch
        return _num_windows(self._stream_of(epoch), self.seq_len) // self.global_batch

    def _order_of(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            n = self.num_windows if self.packing == "stream" else _num_windows(self._stream_of(epoch), self.seq_len)
            g = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            self._order = (epoch, torch.randperm(n, generator=g))
        return self._order[1]

    def next_batch(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y: [batch_size, seq_len] int64 (contiguous), this rank's share of the next global batch."""
        while self._step >= self._steps_in(self._epoch):  # while: a best-fit epoch may hold no whole batch
            self._epoch, self._step = self._epoch + 1, 0
        start = self._step * self.global_batch + self.rank * self.batch_size
        idx = self._order_of(self._epoch)[start:start + self.batch_size].numpy()
        if self._kept is not None:
            idx = self._kept[idx]  # position among scored windows -> window number in the stream
        x, y = _window_batch(self._stream_of(self._epoch), idx, self.seq_len)
        self._step += 1
        if device is not None and torch.device(device).type != "cpu":
            pin = torch.device(device).type == "cuda"
            x = (x.pin_memory() if pin else x).to(device, non_blocking=pin)
            y = (y.pin_memory() if pin else y).to(device, non_blocking=pin)
        return x, y

    @property
    def epoch(self) -> float:
        """Epochs of progress: completed epochs + fraction of the current one (1.0 = one pass)."""
        return self._epoch + self._step / self._steps_in(self._epoch)

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


def spread(n: int, k: int) -> np.ndarray:
    """k of the indices 0..n-1 (all n when k >= n), evenly spaced and increasing: i*n // k for
    i < k, so the first is 0 and every stretch of n/k indices holds one."""
    if k >= n:
        return np.arange(n, dtype=np.int64)
    return np.arange(k, dtype=np.int64) * n // k


def val_batches(tokens: TokenStream | torch.Tensor, seq_len: int, batch_size: int, max_tokens: int, *,
                rank: int = 0, world_size: int = 1,
                loss_mask: torch.Tensor | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """max(1, max_tokens // seq_len) windows of the validation stream spread evenly over it, in
    stream order (`spread`; the rows of a best-fit stream, `split_stream`); every window when the
    stream holds no more. Spread, not the first ones: a corpus is often stored in an order (files
    by path, records by source or date), and its first documents can score far from the split as
    a whole.

    Same windows as TokenBatches (stride seq_len), so a scored token is scored once. Batches
    hold up to batch_size windows (the last may be smaller); rank r takes batches r, r+world_size...
    With a loss mask, as in TokenBatches: y is -1 at unscored targets and only windows with a
    scored target count (and are spread over).
    """
    stream = TokenStream.of(tokens, loss_mask)
    num_windows = _num_windows(stream, seq_len)
    if num_windows == 0:
        raise DataError(f"the validation stream has {len(stream):,} tokens; one evaluation window needs "
                        f"seq_len+1 = {seq_len + 1}. Use a smaller --seq_len or a corpus with more "
                        f"validation text (about {VAL_FRACTION:.0%} of the documents)")
    want = max(1, max_tokens // seq_len)
    kept = stream.scored_windows(seq_len)
    if kept is None:
        windows = spread(num_windows, want)
    elif len(kept) == 0:
        raise DataError("the validation records have no scored (assistant) token in any window of "
                        f"seq_len+1 = {seq_len + 1} tokens; the validation split is too small or its "
                        "records have empty answers")
    else:
        windows = kept[spread(len(kept), want)]
    for start in range(rank * batch_size, len(windows), batch_size * world_size):
        yield _window_batch(stream, windows[start:start + batch_size], seq_len)


__all__ = ["VAL_SEED", "Packing", "TokenBatches", "split_stream", "spread", "val_batches"]
