"""Token streams: a 1-D stream of token ids, read window by window, and records packed into windows.

A `TokenStream` is what the batchers (nanochat.data.batches) read: a token store's split, whose arrays are
numpy.memmap views of its files (nanochat.data.token_store), or a tensor in memory (tests, notebooks). A
window of `size` tokens starting at `s` is gathered with one fancy index, so a batch reads only
the pages it needs and a rank's memory does not grow with the corpus.

Instruction records are packed so that each lies inside one training window (`pack_layout`): a
record that does not fit in what is left of the current window starts the next one, the gap
being padding that is never scored. A packed store stream is a layout over the memory map
(record i of the file placed at `out_start[i]`: 24 bytes per record), not a copy: the padding is
made when a window is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Packing:
    """What packing records into windows did: records kept whole, cut (longer than a window),
    padding added."""

    records: int
    long_records: int
    pad_tokens: int
    tokens: int
    """Length of the packed stream, padding included."""

    @property
    def pad_pct(self) -> float:
        return 100.0 * self.pad_tokens / self.tokens if self.tokens else 0.0


def pack_layout(starts: np.ndarray, n_tokens: int, seq_len: int) -> tuple[np.ndarray, Packing]:
    """Where each record goes so that it lies inside one window of seq_len+1 tokens (window k
    covers positions [k*seq_len, k*seq_len + seq_len]; the last is the next window's first).
    Records are taken in order; one that would run past the end of the current window starts at
    the next window instead, the positions skipped being padding. A record longer than
    seq_len + 1 starts at a window boundary and continues into the next windows (counted in
    `long_records`). The end is padded to a whole window (the batchers drop a partial one).
    `starts`: where each record begins in the unpacked stream of `n_tokens`. Returns the packed
    starts [n_records] int64 and the Packing."""
    st = np.asarray(starts, dtype=np.int64)
    if len(st) == 0:
        return st, Packing(0, 0, 0, n_tokens)
    if st[0] != 0 or np.any(np.diff(st) <= 0) or st[-1] >= n_tokens:
        raise ValueError("starts must be increasing record offsets into tokens, the first 0 "
                         f"(where each record begins); got {st[:5].tolist()}...")
    lengths = np.diff(np.append(st, n_tokens))
    out_start = np.empty_like(st)
    pos = pad = long_records = 0
    for i, r in enumerate(lengths.tolist()):
        window_end = (pos // seq_len) * seq_len + seq_len  # last position of the window pos is in
        if pos + r - 1 > window_end:
            if pos % seq_len:  # start the next window (a boundary position starts one already)
                nxt = (pos // seq_len + 1) * seq_len
                pad, pos = pad + nxt - pos, nxt
            long_records += r > seq_len + 1
        out_start[i] = pos
        pos += r
    total = -(-(pos - 1) // seq_len) * seq_len + 1  # a whole number of windows
    pad += total - pos
    return out_start, Packing(len(st), int(long_records), int(pad), int(total))


class TokenStream:
    """A 1-D token stream, with a loss mask for instruction records, read window by window.

    `tokens` (and `mask`) are arrays: a store file's numpy.memmap, or memory. A packed stream
    sees them through a layout: record i (`src_start[i]`, `lengths[i]` in the arrays) at position
    `out_start[i]`, the positions between records being padding (`pad_id`, never scored).
    `docs`: where each document starts in the stream (the samples' prompts). `row_len`: the
    stream is rows of that many tokens laid out whole (nanochat.data.packing's best fit), window k
    being row k, not windows that share a token with the next."""

    def __init__(self, tokens: np.ndarray, mask: np.ndarray | None = None, *, docs: np.ndarray | None = None,
                 layout: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None, length: int | None = None,
                 pad_id: int = 0, row_len: int | None = None) -> None:
        self.tokens, self.mask, self.docs, self.row_len = tokens, mask, docs, row_len
        self._layout = layout
        self._len = len(tokens) if layout is None else int(length)
        self.pad_id = pad_id
        self._scored: dict[int, np.ndarray] = {}  # seq_len -> scored_windows (each evaluation asks again)

    @classmethod
    def of(cls, tokens: Any, mask: Any = None) -> "TokenStream":
        """A stream over an in-memory 1-D token tensor or array (and its bool loss mask)."""
        if isinstance(tokens, TokenStream):
            if mask is not None:
                raise ValueError("a TokenStream carries its own loss mask; pass loss_mask only with a tensor")
            return tokens
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"tokens must be a 1-D stream, got shape {tuple(arr.shape)}")
        m = None
        if mask is not None:
            m = np.asarray(mask)
            if m.shape != arr.shape or m.dtype != np.bool_:
                raise ValueError(f"loss_mask must be a bool tensor shaped like tokens {tuple(arr.shape)}, got "
                                 f"{getattr(mask, 'dtype', m.dtype)} {tuple(m.shape)}")
        return cls(arr, m)

    def __len__(self) -> int:
        return self._len

    @property
    def has_mask(self) -> bool:
        return self.mask is not None

    def _sources(self, starts: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Array positions [n, size] of the windows starting at `starts`, and where they hold a
        record's token (None: everywhere)."""
        pos = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(size, dtype=np.int64)
        if self._layout is None:
            return pos, None
        out_start, src_start, lengths = self._layout
        r = np.maximum(np.searchsorted(out_start, pos, side="right") - 1, 0)  # the record at or before
        off = pos - out_start[r]
        inside = (off >= 0) & (off < lengths[r])
        return np.where(inside, src_start[r] + off, 0), inside

    def window_tokens(self, starts: np.ndarray, size: int) -> np.ndarray:
        """[len(starts), size] int64: the tokens of each window starting at `starts`."""
        src, inside = self._sources(starts, size)
        out = self.tokens[src].astype(np.int64)
        return out if inside is None else np.where(inside, out, self.pad_id)

    def window_mask(self, starts: np.ndarray, size: int) -> np.ndarray | None:
        """[len(starts), size] bool: which tokens are scored; None without a mask (all are)."""
        if self.mask is None:
            return None
        src, inside = self._sources(starts, size)
        out = self.mask[src].astype(np.bool_)
        return out if inside is None else out & inside

    def scored_windows(self, seq_len: int) -> np.ndarray | None:
        """Numbers of the windows (seq_len+1 tokens, stride seq_len) with a scored target, in
        order; None without a mask. A window's targets are its tokens 1..seq_len: token 0 is the
        previous window's last target, so it does not keep a window."""
        if self.mask is None:
            return None
        if seq_len in self._scored:
            return self._scored[seq_len]
        n = max(0, (len(self) - 1) // seq_len)
        chunk = max(1, (1 << 20) // (seq_len + 1))  # ~1M positions at a time: memory stays flat
        kept = [np.zeros(0, dtype=np.int64)]
        for w0 in range(0, n, chunk):
            ws = np.arange(w0, min(n, w0 + chunk), dtype=np.int64)
            kept.append(ws[self.window_mask(ws * seq_len, seq_len + 1)[:, 1:].any(axis=1)])
        self._scored[seq_len] = np.concatenate(kept)
        return self._scored[seq_len]

    def packed(self, seq_len: int, pad_id: int) -> tuple["TokenStream", Packing]:
        """This stream of records (`docs` = record starts) laid out by `pack_layout`."""
        if self._layout is not None or self.docs is None:
            raise ValueError("packed() needs an unpacked stream with record starts (docs)")
        st = np.asarray(self.docs, dtype=np.int64)
        out_start, info = pack_layout(st, len(self.tokens), seq_len)
        if not len(st):
            return self, info
        lengths = np.diff(np.append(st, len(self.tokens)))
        return TokenStream(self.tokens, self.mask, docs=out_start, layout=(out_start, st, lengths),
                           length=info.tokens, pad_id=pad_id), info

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """tokens[start:stop] of the stream as int64 (in memory: for small spans and tests)."""
        stop = len(self) if stop is None else min(stop, len(self))
        if stop <= start:
            return np.zeros(0, dtype=np.int64)
        return self.window_tokens(np.array([start]), stop - start)[0]

    def doc_prefixes(self, n: int, k: int) -> list[list[int]]:
        """The first `k` tokens (BOS included) of each of the first `n` documents."""
        if self.docs is None:
            return []
        starts = np.asarray(self.docs[:n + 1], dtype=np.int64).tolist()
        ends = starts[1:] + [len(self)]
        return [self.read(s, min(e, s + k)).tolist() for s, e in zip(starts[:n], ends)]


__all__ = ["Packing", "TokenStream", "pack_layout"]
