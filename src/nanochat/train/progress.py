"""What a run prints while it trains: a progress bar on a terminal, plain lines in a log.

On a terminal (stdout and stderr both) the loop draws a tqdm bar with the step's loss, tokens/s,
learning rate and MFU, redrawn in place. Anywhere else (nohup, slurm, a pipe, `> log`) a bar is
a string of `\\r` refreshes that piles up in the file (~63 KB for 250 steps), so instead one
plain line every `--log_every` steps and at the last, as karpathy's nanochat prints:

    step 120/250 (48.0%) | loss 4.2214 | lr 2.52e-03 | 6,120 tok/s | mfu 41.2% | eta 21s

A run whose groups have peak rates of their own (Muon's recipe) shows the schedule's multiplier
instead, `lrm 0.84` (each group is at its peak, in the header, times it), as karpathy's nanochat
does: `--lr` alone would name a rate no matrix trains at.

ETA: the steps left at the steady-state tokens/s (evaluations and saves not counted). Evaluation
lines go above the bar, or between the plain lines. The other progress in a run (the tokenizer's
training, the token store's build) draws its bar only on a terminal too, so a log file holds no
`\\r`. Only rank 0 prints.
"""

from __future__ import annotations

import math
import sys
from typing import Any

from tqdm import tqdm

from nanochat.common import format_bytes, format_table
from nanochat.config import flag_text
from nanochat.train import mfu
from nanochat.train.report import RunFacts


def on_terminal() -> bool:
    """Whether stdout and stderr (where a bar draws) are both a terminal."""
    return sys.stdout.isatty() and sys.stderr.isatty()


def format_eta(seconds: float) -> str:
    """`1h02m`, `3m05s`, `7s`; `?` before any step was timed."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    """The loop's progress from step `start` to `total`: `update` after each step, `write` for a
    line of its own (an evaluation), `close` at the end. `enabled`: this process prints (rank 0);
    `terminal`: a bar (default: `on_terminal()`), else a line every `every` steps. `per_group`:
    the groups have peaks of their own, so the record's `lrm` is shown rather than its `lr`."""

    def __init__(self, total: int, start: int, *, every: int, tokens_per_step: int, enabled: bool = True,
                 terminal: bool | None = None, per_group: bool = False):
        self.total, self.every, self.tokens_per_step = total, every, tokens_per_step
        self.rate = ("lrm", ".2f") if per_group else ("lr", ".2e")
        terminal = on_terminal() if terminal is None else terminal
        self.bar = tqdm(total=total, initial=start, dynamic_ncols=True, desc="train") if enabled and terminal else None
        self.lines = enabled and not terminal

    def update(self, done: int, record: dict[str, Any], mfu: float | None) -> None:
        """Step `done` (1-based) finished with `record` (loss, lr and lrm, tokens_per_sec; a skipped
        step has no tokens_per_sec and shows in the guard's own warning instead)."""
        if self.bar is not None:
            self.bar.update(1)
            if "tokens_per_sec" in record:
                key, fmt = self.rate
                shown = {key: f"{record[key]:{fmt}}", **({"mfu": f"{mfu:.1%}"} if mfu is not None else {})}
                self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_sec']:,.0f}", **shown)
        elif self.lines and "tokens_per_sec" in record and (done % self.every == 0 or done == self.total):
            print(self.line(done, record, mfu), flush=True)

    def line(self, done: int, record: dict[str, Any], mfu: float | None) -> str:
        """The plain line of step `done` (module docstring)."""
        tok_s = record["tokens_per_sec"]
        eta = (self.total - done) * self.tokens_per_step / tok_s if tok_s > 0 else math.nan
        key, fmt = self.rate
        return (f"step {done}/{self.total} ({100 * done / self.total:.1f}%) | loss {record['loss']:.4f} | "
                f"{key} {record[key]:{fmt}} | {tok_s:,.0f} tok/s | mfu {'-' if mfu is None else f'{mfu:.1%}'} | "
                f"eta {format_eta(eta)}")

    def write(self, text: str) -> None:
        """A line of its own: above the bar on a terminal, else in the log."""
        if self.bar is not None:
            self.bar.write(text)
        elif self.lines:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def header(facts: RunFacts) -> str:
    """What a run prints before its first step: the run's table (model, data, schedule, device,
    parallelism, optimizer, FP8, MFU) and, with FP8, the conversion report and FP8Optim's layout."""
    f, cfg, m, data = facts, facts.config, facts.model, facts.data
    optimizer = (f"Muon for hidden matrices (lr {f.rates.matrix:.4g}) and AdamW (embedding {f.rates.embedding:.4g}, "
                 f"head {f.rates.head:.4g}, vectors {f.rates.vector:.4g})" if f.rates is not None else "AdamW")
    rows = [
        ["model", f"{cfg.model_name}: {m.n_layer} layers, width {m.n_embd}, "
                  f"{m.n_head} heads ({m.n_kv_head} kv), {f.num_params / 1e6:.2f}M params"],
        *([["init", f"weights of {f.init_source.path} (step {f.init_source.step})"]] if f.init_source else []),
        ["data", data.store.describe()],
        ["tokens", f"{len(data.train):,} train / {len(data.val):,} val, vocab {data.tokenizer.vocab_size}"],
        ["store", data.store.summary()],
        ["schedule", f"{f.total_steps} steps x {cfg.batch_size * cfg.grad_accum_steps * f.layout.dp_size}"
                     f" x {cfg.seq_len} tokens ({data.steps_per_epoch} steps/epoch)"],
        ["device", f"{f.device} ({f.dtype}), world size {f.layout.world_size}, "
                   f"compile {(cfg.compile_scope if cfg.compile else 'off')}"],
        ["parallel", f.parallel],
        ["optimizer", f"{optimizer}, {format_bytes(f.optimizer_state_bytes)} of state"
                      f"{' on each rank' if f.layout.distributed else ''} "
                      f"({f.optimizer_state_bytes / f.local_params:.3f} bytes/param)"],
    ]
    if not cfg.save_checkpoints:
        rows.append(["checkpoints", "none (--no_save_checkpoints): this run cannot be resumed or exported"])
    report = f.fp8
    if report is not None:
        rows.append(["fp8", flag_text(report.summary())])
    rows.append(["mfu", mfu.describe(f.peak, f.device, f.flops_per_token)])
    parts = [format_table(["run", ""], rows)]
    if report is not None:
        parts.append(report.table(flag_text))
    if f.optimizer_summary is not None:
        parts.append(f.optimizer_summary)
    if f.rates is not None:
        parts.append("peak learning rates (nanochat.optim.recipe):\n" + f.rates.describe())
    if report is not None:
        parts.append("fp8: evaluation and sampling run in high precision ("
                     + ("an unsharded copy of the shards)" if f.layout.sharded else "fp8_disabled)"))
    return "\n".join(parts)


__all__ = ["Progress", "format_eta", "header", "on_terminal"]
