"""AdamW against Muon at equal steps: a small learning-rate sweep, then seeds at each one's best.

    .venv/bin/python bench/bench_optimizers.py                  # d4, 250 steps: 21 runs, ~75 min on 2 cores
    .venv/bin/python bench/bench_optimizers.py --reuse          # after an interruption: train what is missing
    .venv/bin/python bench/bench_optimizers.py --quick --no_compile   # seconds: a dry run (tests)

1. Sweep: AdamW at each --adamw_lrs (every parameter at that --lr) and Muon at each --muon_lrs
   (its matrices at that --muon_lr; the embedding and head with AdamW at the recipe's rates,
   nanochat.optim.recipe; norms and biases at --lr), on
   --sweep_seeds. Each optimizer's best rate is the one with the lowest mean final val bpb; a
   best rate at the edge of its grid is flagged (the optimum may lie outside it).
2. Seeds: both at their best rate on every --seeds (runs of the sweep are reused), and with
   --fp8_momentum Muon again at its best rate with --fp8_opt_level 1 (its momentum, and the
   AdamW group's first moment, in FP8).

Within a seed every run starts from the same weights and sees the same batches, so a seed's
difference is the optimizer's alone. Per seed: the final val bpb of each; the steps Muon needs to
reach AdamW's final bpb (linear between evaluations: `steps_to`), and the time, at each run's own
tokens/s; FP8 momentum's gap to fp32 momentum. The targets (docs/muon.md): Muon at AdamW's final
bpb in <= --steps_target x its steps on every seed; FP8 momentum's mean gap <= --fp8_mean_target_pct,
every seed's within --fp8_seed_target_pct.

Runs go to --out_dir/<optimizer>-lr<rate>[-fp8m]/seed-<seed>/ (the trainer's run directory and
bench_run.json, its settings and figures, which --reuse checks before taking a run). Each run
trains in a fresh process, one at a time; tokens/s are the runs' own, with the load beside them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import multiprocessing
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
from fp8_parity import read_curves
from nanochat.common import format_table
from nanochat.config.fields import BatchFields, DataFields, DeviceFields, ModelFields, ScheduleFields, ScriptFields


@dataclass(frozen=True, kw_only=True)
class EqualStepsRuns(ScriptFields, DeviceFields, ScheduleFields, BatchFields, DataFields, ModelFields):
    """Training runs compared at equal steps, each in a fresh process (`run`). The model, data,
    batch, schedule and device flags are base_train's, given to every run; the defaults are
    `make train`'s d4 run (250 steps of 8 x 256 tokens)."""

    num_iterations: int = 250
    """Optimizer steps of every run."""
    batch_size: int = 8
    eval_every: int = 50
    compile: bool = True
    """torch.compile every run (base_train's default)."""
    out_dir: str = "runs/bench_optimizers"
    """Where the runs go."""
    reuse: bool = False
    """Take finished runs from --out_dir whose recorded settings equal this invocation's."""
    quick: bool = False
    """Tiny sizes: a dry run in seconds (tests); its figures mean nothing."""
    out: str | None = None
    """Write the figures as JSON here."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eval_every < 1:
            raise ValueError(f"--eval_every must be >= 1 (steps to a loss are read off the evaluations), "
                             f"got {self.eval_every}")


@dataclass(frozen=True, kw_only=True)
class BenchOptimizersConfig(EqualStepsRuns):
    """AdamW vs Muon at equal steps: a learning-rate sweep, then seeds at each one's best rate."""

    adamw_lrs: tuple[float, ...] = (3e-3, 6e-3, 1.2e-2, 2.4e-2)
    """AdamW's peak learning rates to sweep (--lr of an --optimizer adamw run)."""
    muon_lrs: tuple[float, ...] = (0.01, 0.02, 0.04)
    """Muon's peak learning rates to sweep (--muon_lr; its AdamW groups at the recipe's rates)."""
    sweep_seeds: tuple[int, ...] = (1,)
    """Seeds of the sweep; the best rate has the lowest mean final val bpb over them."""
    seeds: tuple[int, ...] = (1, 2, 3, 4, 5)
    """Seeds of the comparison at each optimizer's best rate."""
    fp8_momentum: bool = True
    """Also train Muon at its best rate with --fp8_opt_level 1 on every seed."""
    steps_target: float = 0.8
    """Target: Muon reaches AdamW's final val bpb within this fraction of AdamW's steps, every seed."""
    fp8_mean_target_pct: float = 0.25
    """Target: FP8 momentum's final val bpb above fp32 momentum's by at most this (percent, mean)."""
    fp8_seed_target_pct: float = 0.5
    """Target: every seed's FP8 momentum gap within +-this (percent)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("adamw_lrs", "muon_lrs", "sweep_seeds", "seeds"):
            if not getattr(self, name):
                raise ValueError(f"--{name} is empty; give at least one value")


QUICK = dict(model_name="d2", num_iterations=6, eval_every=3, eval_tokens=256, seq_len=32, batch_size=4,
             vocab_size=320, warmup_steps=2, adamw_lrs=(3e-3, 1e-2), muon_lrs=(0.02,), sweep_seeds=(1,), seeds=(1,))


@dataclass(frozen=True)
class Variant:
    optimizer: str
    lr: float
    fp8_momentum: bool = False
    extra: tuple[tuple[str, Any], ...] = ()
    """More NanoChatTrainer fields of this variant's runs, as (name, value) pairs."""
    label: str = ""
    """The extra fields' short name, in `name` (its run directory)."""

    @property
    def name(self) -> str:
        return f"{self.optimizer}-lr{self.lr:g}" + ("-fp8m" if self.fp8_momentum else "") + \
            (f"-{self.label}" if self.label else "")


def train_kwargs(cfg: BenchOptimizersConfig, v: Variant, seed: int) -> dict[str, Any]:
    """NanoChatTrainer fields of one run: everything equal but the seed and the optimizer's."""
    kw = dict(model_name=cfg.model_name, dataset_path=cfg.dataset_path, vocab_size=cfg.vocab_size,
              seq_len=cfg.seq_len, batch_size=cfg.batch_size, num_iterations=cfg.num_iterations,
              warmup_steps=cfg.warmup_steps, lr=cfg.lr, eval_every=cfg.eval_every, eval_tokens=cfg.eval_tokens,
              seed=seed, device=cfg.device, dtype=cfg.dtype, compile=cfg.compile, save_every=0, num_samples=0,
              run_dir=str(Path(cfg.out_dir) / v.name / f"seed-{seed}"), optimizer=v.optimizer)
    if v.optimizer == "muon":
        kw["muon_lr"] = v.lr
    else:
        kw["lr"] = v.lr
    if v.fp8_momentum:
        kw["fp8_opt_level"] = 1
    return dict(kw, **dict(v.extra))


def _train(kw: dict[str, Any]) -> dict[str, Any]:
    from nanochat.train.trainer import NanoChatTrainer

    r = NanoChatTrainer(**kw, overwrite=True).train()
    curves = read_curves(Path(r.run_dir))
    record = dict(val_bpb=r.val_bpb, val_loss=r.val_loss, tokens_per_sec=r.tokens_per_sec, steps=r.steps,
                  wall_time_s=r.wall_time_s, state_bytes_per_param=r.state_bytes_per_param,
                  val_step=curves["val_step"], val_bpb_curve=curves["val_bpb"], commit=harness.commit(),
                  loadavg=harness.load())
    harness.write_json(Path(kw["run_dir"]) / "bench_run.json", dict(settings=kw, record=record))
    return record


def run(cfg: BenchOptimizersConfig, v: Variant, seed: int, done: dict) -> dict[str, Any]:
    """One run's figures: taken from `done` (this invocation's runs: the sweep's are the seeds'
    too), reused with --reuse when a finished one has these settings, else trained in a fresh
    process (no compiled graph or allocator state carried from the run before)."""
    if (v, seed) not in done:
        done[v, seed] = _run_once(cfg, v, seed)
    return done[v, seed]


def _run_once(cfg: BenchOptimizersConfig, v: Variant, seed: int) -> dict[str, Any]:
    kw = train_kwargs(cfg, v, seed)
    if cfg.reuse:
        try:
            saved = json.loads((Path(kw["run_dir"]) / "bench_run.json").read_text())
            if saved["settings"] == json.loads(json.dumps(kw)):
                print(f"bench_optimizers: {v.name} seed {seed}: reused ({saved['record']['val_bpb']:.4f})", flush=True)
                return saved["record"]
        except (OSError, ValueError, KeyError):
            pass
    print(f"bench_optimizers: {v.name} seed {seed} ...", flush=True)
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        record = pool.submit(_train, kw).result()
    print(f"bench_optimizers: {v.name} seed {seed}: val bpb {record['val_bpb']:.4f}, "
          f"{record['tokens_per_sec']:,.0f} tok/s ({record['loadavg']})", flush=True)
    return record


def best(cfg: BenchOptimizersConfig, optimizer: str, lrs: tuple[float, ...],
         done: dict) -> tuple[Variant, list[list[str]], dict]:
    """Sweep one optimizer: its best variant, the table rows, the figures."""
    means = {}
    for lr in lrs:
        v = Variant(optimizer, lr)
        means[lr] = statistics.fmean(run(cfg, v, s, done)["val_bpb"] for s in cfg.sweep_seeds)
    top = min(means, key=means.get)
    edge = len(lrs) > 1 and top in (min(lrs), max(lrs))
    rows = [[optimizer, f"{lr:g}", f"{m:.4f}", "best" + (" (grid edge)" if edge else "") if lr == top else ""]
            for lr, m in sorted(means.items())]
    return Variant(optimizer, top), rows, dict(mean_val_bpb={f"{lr:g}": m for lr, m in means.items()}, best=top,
                                                best_at_grid_edge=edge)


def bench(cfg: BenchOptimizersConfig) -> dict:
    done: dict = {}
    adamw, rows_a, sweep_a = best(cfg, "adamw", cfg.adamw_lrs, done)
    muon, rows_m, sweep_m = best(cfg, "muon", cfg.muon_lrs, done)
    print(f"\nsweep ({cfg.model_name}, {cfg.num_iterations} steps of {cfg.batch_size} x {cfg.seq_len}, "
          f"seeds {' '.join(map(str, cfg.sweep_seeds))}): final val bpb")
    print(format_table(["optimizer", "peak lr", "val bpb (mean)", ""], rows_a + rows_m))

    variants = [adamw, muon] + ([Variant("muon", muon.lr, True)] if cfg.fp8_momentum else [])
    runs = {v.name: {s: run(cfg, v, s, done) for s in cfg.seeds} for v in variants}
    tokens_per_step = cfg.batch_size * cfg.seq_len
    per_seed, rows = [], []
    for s in cfg.seeds:
        a, m = runs[adamw.name][s], runs[muon.name][s]
        to = harness.steps_to(a["val_bpb"], m["val_step"], m["val_bpb_curve"])
        seconds = (to * tokens_per_step / m["tokens_per_sec"] if to is not None else None)
        rec = dict(seed=s, adamw=a["val_bpb"], muon=m["val_bpb"], muon_steps_to_adamw=to,
                   steps_ratio=None if to is None else to / a["steps"],
                   time_ratio=None if seconds is None else seconds / (a["steps"] * tokens_per_step / a["tokens_per_sec"]))
        row = [s, f"{a['val_bpb']:.4f}", f"{m['val_bpb']:.4f}", "never" if to is None else f"{to:.0f}",
               "-" if to is None else f"{rec['steps_ratio']:.2f}x", "-" if seconds is None else f"{rec['time_ratio']:.2f}x",
               f"{a['tokens_per_sec']:,.0f} / {m['tokens_per_sec']:,.0f}"]
        if cfg.fp8_momentum:
            f = runs[Variant("muon", muon.lr, True).name][s]
            rec.update(fp8_momentum=f["val_bpb"], fp8_gap_pct=100 * (f["val_bpb"] - m["val_bpb"]) / m["val_bpb"])
            row += [f"{f['val_bpb']:.4f}", f"{rec['fp8_gap_pct']:+.2f}%"]
        per_seed.append(rec)
        rows.append(row)
    headers = ["seed", f"AdamW {adamw.lr:g}", f"Muon {muon.lr:g}", "Muon steps to AdamW's final", "steps ratio",
               "time ratio", "tok/s AdamW / Muon"] + (["Muon FP8 momentum", "gap"] if cfg.fp8_momentum else [])
    print(f"\nat the best rates, seeds {' '.join(map(str, cfg.seeds))}: final val bpb ({harness.load()})")
    print(format_table(headers, rows))
    return dict(config=dataclasses.asdict(cfg), sweep=dict(adamw=sweep_a, muon=sweep_m), seeds=per_seed,
                summary=summarize(cfg, per_seed), runs={k: {str(s): r for s, r in v.items()} for k, v in runs.items()})


def summarize(cfg: BenchOptimizersConfig, per_seed: list[dict]) -> dict:
    """Means over the seeds and the targets' verdicts, printed."""
    ratios = [r["steps_ratio"] for r in per_seed]
    out = dict(adamw_mean=statistics.fmean(r["adamw"] for r in per_seed),
               muon_mean=statistics.fmean(r["muon"] for r in per_seed),
               steps_ratio_max=None if None in ratios else max(ratios),
               steps_ratio_mean=None if None in ratios else statistics.fmean(ratios))
    out["steps_target_met"] = out["steps_ratio_max"] is not None and out["steps_ratio_max"] <= cfg.steps_target
    lines = [f"mean final val bpb: AdamW {out['adamw_mean']:.4f}, Muon {out['muon_mean']:.4f}",
             "Muon's steps to AdamW's final: " + ("not reached on every seed" if out["steps_ratio_max"] is None else
                                                   f"mean {out['steps_ratio_mean']:.2f}x, worst {out['steps_ratio_max']:.2f}x")
             + f" (target <= {cfg.steps_target}x: {'met' if out['steps_target_met'] else 'missed'})"]
    if cfg.fp8_momentum:
        gaps = [r["fp8_gap_pct"] for r in per_seed]
        out.update(fp8_gap_mean_pct=statistics.fmean(gaps), fp8_gap_worst_pct=max(gaps, key=abs))
        out["fp8_target_met"] = (out["fp8_gap_mean_pct"] <= cfg.fp8_mean_target_pct
                                 and all(abs(g) <= cfg.fp8_seed_target_pct for g in gaps))
        lines.append(f"FP8 momentum's gap: mean {out['fp8_gap_mean_pct']:+.2f}%, worst {out['fp8_gap_worst_pct']:+.2f}% "
                     f"(targets mean <= {cfg.fp8_mean_target_pct}%, each within {cfg.fp8_seed_target_pct}%: "
                     f"{'met' if out['fp8_target_met'] else 'missed'})")
    print("\n".join(lines))
    return out


def main(argv: list[str] | None = None) -> int:
    return harness.main(BenchOptimizersConfig, bench, argv, quick=QUICK)


if __name__ == "__main__":
    sys.exit(main())
