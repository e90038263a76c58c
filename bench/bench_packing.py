"""Benchmark the best-fit layout (nanochat.data.packing): seconds to lay out one epoch, and the
cropped share, against the linear scan of karpathy/nanochat's loader.

    .venv/bin/python bench/bench_packing.py             # 1M documents; the scan on 20k; ~1 min on 2 cores
    .venv/bin/python bench/bench_packing.py --quick     # a dry run

Document lengths are drawn lognormal (median ~400 tokens, a long tail, as web text), at least 2
(a BOS and one token). Two tables:
  layout     `bestfit_pieces` on --docs documents at each seq_len: the median of --repeats runs,
             the rows and the cropped share, and this process's peak RSS (the layout's arrays
             and its buffer; the tokens are never read);
  rule       on --scan_docs documents: the candidate (a sorted buffer, a bisect per placement)
             against the baseline, the same rule by a linear scan of the buffer per placement
             (nanochat's loop), interleaved; both must give the same pieces.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import harness


@dataclass(frozen=True, kw_only=True)
class BenchPackingConfig:
    """Flags of bench/bench_packing.py."""

    docs: int = 1_000_000
    """Documents laid out in the layout table."""
    scan_docs: int = 20_000
    """Documents in the rule table (the linear scan is O(documents x buffer))."""
    seq_lens: tuple[int, ...] = (256, 2048)
    """Row lengths are seq_len + 1."""
    repeats: int = 3
    """Runs per figure (the median is reported)."""
    quick: bool = False
    """A dry run at toy sizes; its figures mean nothing."""
    out: str | None = None
    """Write the figures as JSON here."""


QUICK = dict(docs=20_000, scan_docs=2_000, repeats=1)


def scan_pieces(lengths, order, row_len: int, buffer_docs: int) -> tuple[list[int], list[int], int]:
    """The baseline: the best-fit rule with a list buffer scanned linearly for each placement."""
    buffer: list[tuple[int, int]] = []  # (document, length), in the order buffered
    docs, lens = [], []
    nxt, rows, n = 0, 0, len(order)
    while True:
        room, start = row_len, len(lens)
        while room:
            while nxt < n and len(buffer) < buffer_docs:
                buffer.append((int(order[nxt]), int(lengths[order[nxt]])))
                nxt += 1
            if not buffer:
                return docs[:start], lens[:start], rows
            best = -1
            for i, (_, length) in enumerate(buffer):
                if length <= room and (best < 0 or length > buffer[best][1]):
                    best = i
            if best < 0:
                best = min(range(len(buffer)), key=lambda i: buffer[i][1])
            doc, length = buffer.pop(best)
            docs.append(doc)
            lens.append(min(length, room))
            room -= lens[-1]
        rows += 1


def bench(cfg: BenchPackingConfig) -> dict:
    import numpy as np

    from nanochat.common import format_table
    from nanochat.data.packing import BUFFER_DOCS, bestfit_pieces

    rng = np.random.default_rng(0)
    figures: dict = {"layout": {}, "rule": {}, "load": harness.load()}
    rows_out = []
    for seq_len in cfg.seq_lens:
        lengths = np.maximum(2, rng.lognormal(6.0, 1.0, cfg.docs).astype(np.int64))
        order = rng.permutation(cfg.docs)
        result = {}
        runs = harness.interleave({"bisect": lambda _: harness.timed(
            lambda: result.update(out=bestfit_pieces(lengths, order, seq_len + 1)))}, cfg.repeats)
        _, piece_len, rows = result["out"]
        share = 1 - piece_len.sum() / lengths.sum()
        seconds = harness.medians(runs)["bisect"]
        figures["layout"][seq_len] = dict(docs=cfg.docs, seconds=seconds, rows=rows, cropped_share=share)
        rows_out.append([seq_len, f"{cfg.docs:,}", f"{seconds:.2f}", f"{rows:,}", f"{share:.1%}"])
    print(format_table(["seq_len", "documents", "seconds", "rows", "cropped"], rows_out))
    print(f"peak RSS {harness.peak_rss_mb():.0f} MB, load {figures['load']}")

    lengths = np.maximum(2, rng.lognormal(6.0, 1.0, cfg.scan_docs).astype(np.int64))
    order = rng.permutation(cfg.scan_docs)
    row_len = cfg.seq_lens[-1] + 1
    got = {}

    def variant(fn):
        return lambda _: harness.timed(lambda: got.__setitem__(fn.__name__, fn(lengths, order, row_len, BUFFER_DOCS)))

    runs = harness.interleave({"linear scan": variant(scan_pieces), "bisect": variant(bestfit_pieces)}, cfg.repeats)
    docs, lens, _ = got["bestfit_pieces"]
    if (docs.tolist(), lens.tolist()) != got["scan_pieces"][:2]:
        raise RuntimeError("the bisect layout differs from the linear scan's: the rule is broken")
    medians = harness.medians(runs)
    figures["rule"] = dict(docs=cfg.scan_docs, seq_len=row_len - 1, seconds=medians,
                           ratio=harness.ratios(medians, "linear scan"))
    print(format_table(["rule", "documents", "seconds", "x baseline"],
                       [[name, f"{cfg.scan_docs:,}", f"{s:.3f}", f"{figures['rule']['ratio'][name]:.2f}"]
                        for name, s in medians.items()]))
    return figures


def main(argv: list[str] | None = None) -> int:
    return harness.main(BenchPackingConfig, bench, argv, quick=QUICK)


if __name__ == "__main__":
    sys.exit(main())
