"""BOS-aligned best-fit packing: plain-text documents laid out into rows that each begin at a
document's start.

The stream cut (`--packing stream`) reads windows of seq_len+1 tokens straight off the stream
`<|bos|> doc <|bos|> doc ...`, so most windows begin in the middle of a document and their first
tokens are predicted without the document's beginning. Best-fit packing (`--packing bestfit`,
karpathy/nanochat's pretraining loader) makes every row of seq_len+1 tokens begin with a
document's <|bos|>: documents are placed whole, the largest that still fits first, and when none
of the buffered documents fits what is left of a row, the shortest of them is cropped to fill it
exactly, its tail dropped. No padding; the price is the dropped tails (nanochat measures ~35% of
the tokens at seq_len 2048; `BestFit.cropped_share`).

The layout is computed once per epoch from the documents' lengths only (the token store's
`docs.bin` offsets), never from the tokens: pieces (document, length) placed one after another,
row r being positions [r*(seq_len+1), (r+1)*(seq_len+1)). Given as a TokenStream over the same
memory map (`TokenStream`'s layout: piece i of the file at `out_start[i]`), so a batch still
reads only the pages it needs; 24 bytes per piece, about one piece per document plus one per
row. The documents enter the buffer in an order seeded by (seed, epoch), so the layout is
deterministic and a resumed run recomputes exactly the layout it was reading.

Why a bounded buffer of the next `BUFFER_DOCS` documents and not a global best fit over the
epoch (sorting all documents by length): a global sort would put the long documents together in
the first rows and the short ones at the end, and a row's documents would no longer be a random
sample of the corpus. The buffer is kept sorted (bisect), so a placement costs O(log buffer) in
a Python loop (the layout is sequential: each choice depends on the buffer the last one left);
`python -m nanochat.data.packing` times 1M documents.
"""

from __future__ import annotations

import bisect
from array import array
import hashlib
import time
from dataclasses import dataclass

import numpy as np

from nanochat.common import logger, warn_once
from nanochat.data.streams import TokenStream

BUFFER_DOCS = 1000
"""Documents the best fit chooses among (karpathy/nanochat's dataloader `buffer_size`)."""

HIGH_CROP = 0.5
"""A cropped share above which a layout warns: more than half of the split unread each epoch
(nanochat's web text loses ~35% at seq_len 2048; this repository's default corpus of whole
source files, median ~2,200 tokens, loses ~70% at 2048 and ~95% at 256)."""


def epoch_seed(seed: int, epoch: int) -> int:
    """One generator seed per (seed, epoch) pair, via a hash so that nearby pairs do not collide."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{epoch}".encode()).digest()[:8], "little") >> 1


@dataclass(frozen=True)
class BestFit:
    """What one best-fit layout did with a split's documents."""

    docs: int
    rows: int
    row_len: int
    tokens: int
    """The documents' tokens (BOS included)."""
    dropped_tokens: int
    """Tokens in no row: cropped tails, and the documents of a last row left unfinished."""
    cropped_docs: int
    """Documents placed with their tail cropped."""
    seconds: float

    @property
    def cropped_share(self) -> float:
        """Dropped tokens / all the documents' tokens."""
        return self.dropped_tokens / self.tokens if self.tokens else 0.0


def bestfit_pieces(lengths: np.ndarray, order: np.ndarray, row_len: int,
                   buffer_docs: int = BUFFER_DOCS) -> tuple[np.ndarray, np.ndarray, int]:
    """Documents of `lengths` [n] placed best-fit into rows of `row_len` tokens, taken into the
    buffer in `order` (a permutation of range(n)). Returns (piece_doc [P] int64: which document,
    piece_len [P] int64: its first piece_len tokens, rows): the pieces in row order, filling
    `rows` whole rows; each piece starts at its document's start. Ties between documents of one
    length go to the one buffered first."""
    n = len(lengths)
    lens = np.asarray(lengths, dtype=np.int64)[order].tolist()  # buffered position k -> length
    # buffer keys L*n + (n-1-k), sorted: a bisect finds the longest document of at most `room`
    # tokens, and among equal lengths the largest key is the earliest buffered (smallest k)
    keys: list[int] = []
    doc_of, len_of = array("q"), array("q")  # 8 bytes a piece, not a Python int's ~36
    insort, bisect_right, pop = bisect.insort, bisect.bisect_right, keys.pop  # locals: a hot loop
    nxt = rows = 0
    while True:
        room = row_len
        start = len(len_of)
        while room:
            while nxt < n and len(keys) < buffer_docs:
                insort(keys, lens[nxt] * n + (n - 1 - nxt))
                nxt += 1
            if not keys:
                del doc_of[start:], len_of[start:]  # a last row left unfinished: its documents are dropped
                return (np.asarray(order, dtype=np.int64)[np.frombuffer(doc_of, dtype=np.int64)],
                        np.frombuffer(len_of, dtype=np.int64).copy(), rows)
            i = bisect_right(keys, (room + 1) * n - 1) - 1  # longest with L <= room
            if i < 0:  # nothing fits: the shortest, earliest buffered, is cropped to fill the row
                i = bisect_right(keys, (keys[0] // n + 1) * n - 1) - 1
            key = pop(i)
            length = key // n
            if length > room:
                length = room
            doc_of.append(n - 1 - key % n)
            len_of.append(length)
            room -= length
        rows += 1


def bestfit_rows(stream: TokenStream, seq_len: int, seed: int, epoch: int, *, name: str = "train",
                 buffer_docs: int = BUFFER_DOCS) -> tuple[TokenStream, BestFit]:
    """The documents of `stream` (a plain-text split: `docs` holds where each starts, at its
    <|bos|>) laid out best-fit into rows of seq_len+1 tokens, the buffer's order seeded by
    (seed, epoch): a TokenStream of rows (`row_len` = seq_len+1) over the same token arrays, and
    the BestFit, logged."""
    if stream.docs is None or stream.has_mask:
        raise ValueError("best-fit packing lays out plain-text documents: a stream with document "
                         "starts (docs) and no loss mask")
    t0 = time.perf_counter()
    starts = np.asarray(stream.docs, dtype=np.int64)
    lengths = np.diff(np.append(starts, len(stream.tokens)))
    order = np.random.default_rng(epoch_seed(seed, epoch)).permutation(len(starts))
    row_len = seq_len + 1
    piece_doc, piece_len, rows = bestfit_pieces(lengths, order, row_len, buffer_docs)
    out_start = np.concatenate([[0], np.cumsum(piece_len)[:-1]]).astype(np.int64)
    kept = int(piece_len.sum())
    info = BestFit(docs=len(starts), rows=rows, row_len=row_len, tokens=int(lengths.sum()),
                   dropped_tokens=int(lengths.sum()) - kept,
                   cropped_docs=int(np.count_nonzero(piece_len < lengths[piece_doc])),
                   seconds=time.perf_counter() - t0)
    logger.info("%s, epoch %d: %d documents best-fit into %d rows of %d tokens, %.1f%% of the tokens "
                "cropped (%d documents) in %.2f s", name, epoch, info.docs, rows, row_len,
                100 * info.cropped_share, info.cropped_docs, info.seconds)
    if rows and info.cropped_share > HIGH_CROP:  # no row at all: the caller's error says why
        warn_once(f"bestfit-crop:{name}:{seq_len}",
                  f"best-fit packing drops {info.cropped_share:.0%} of the {name} tokens at seq_len {seq_len}: "
                  f"its documents are long for a row (median {int(np.median(lengths))} tokens) and a document's "
                  "tail past one row is never read. --packing stream reads every token")
    rows_stream = TokenStream(stream.tokens, docs=out_start, layout=(out_start, starts[piece_doc], piece_len),
                              length=rows * row_len, pad_id=stream.pad_id, row_len=row_len)
    return rows_stream, info


if __name__ == "__main__":  # the layout time for 1M documents of a web-text-like length spread
    rng = np.random.default_rng(0)
    lengths = np.maximum(2, rng.lognormal(6.0, 1.0, 1_000_000).astype(np.int64))
    for seq_len in (256, 2048):
        t0 = time.perf_counter()
        _, piece_len, rows = bestfit_pieces(lengths, rng.permutation(len(lengths)), seq_len + 1)
        print(f"seq_len {seq_len}: 1M documents ({lengths.sum():,} tokens) -> {rows:,} rows in "
              f"{time.perf_counter() - t0:.2f} s, {1 - piece_len.sum() / lengths.sum():.1%} cropped")


__all__ = ["BUFFER_DOCS", "BestFit", "bestfit_pieces", "bestfit_rows", "epoch_seed"]
