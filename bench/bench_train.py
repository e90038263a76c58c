"""Benchmark the trainer's tokens/s: each candidate against its baseline, in one process.

    .venv/bin/python bench/bench_train.py                  # ~10 min on 2 CPU cores
    .venv/bin/python bench/bench_train.py --quick          # seconds: a dry run (tests)
    .venv/bin/python bench/bench_train.py --pairs scope --scope_model d12 --scope_steps 4

Every figure is NanoChatTrainer's own TrainResult (tokens/s over the steady-state steps; the
steps that compile and auto's calibration steps excluded, compile time reported on its own).
Pairs, baseline first:
  compile  eager (--no_compile) vs compiled (the default), FP8 off;
  fp8      FP8 off vs --fp8 --fp8_emulate --fp8_layers all, both compiled;
  stats    --fp8 --fp8_emulate --fp8_layers all with --fp8_stats_every 0 vs the default period, both compiled;
  scope    compile time and steady step time, whole model vs per block (--scope_model).
Runs alternate baseline/candidate --repeats times so that machine load hits both alike; the
median of each is printed with the ratio, and os.getloadavg() next to them. A run's figures
(nanochat.train.measure.train_run) also hold its graph breaks, recompile reasons and peak memory,
and a run during which dynamo hit its recompile limit (so part of the model ran eagerly) is
marked `invalid`. --stats_period then times one statistics period of the stats pair's candidate
step by step (`stats_cost`: the sampled step against the plain ones), --profile one more step of
every run under the profiler (`profile_step`). scripts/gpu_check.py takes the same measurements
on a GPU.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import harness
from nanochat.common import format_table

Pair = Literal["compile", "fp8", "stats", "scope"]

# --fp8_layers all: the FP8 pairs measure what emulated FP8 layers cost, and under the default
# (faster) a model this small would convert none
PAIRS: dict[str, tuple[dict, dict]] = {
    "compile": (dict(compile=False), dict(compile=True)),
    "fp8": (dict(compile=True), dict(compile=True, fp8=True, fp8_emulate=True, fp8_layers="all")),
    "stats": (dict(compile=True, fp8=True, fp8_emulate=True, fp8_layers="all", fp8_stats_every=0),
              dict(compile=True, fp8=True, fp8_emulate=True, fp8_layers="all")),
    "scope": (dict(compile=True, compile_scope="model"), dict(compile=True, compile_scope="blocks")),
}


@dataclass(frozen=True, kw_only=True)
class BenchTrainConfig:
    """NanoChatTrainer tokens/s: eager vs compiled, FP8 off vs emulated, statistics off vs on."""

    pairs: tuple[Pair, ...] = ("compile", "fp8", "stats")
    """Which comparisons to run (see the module docstring)."""
    model_name: str = "d2"
    """Size preset of the throughput pairs (d2: 2 layers, width 128)."""
    seq_len: int = 256
    """Tokens per training sequence."""
    batch_size: int = 16
    """Sequences per step."""
    num_iterations: int = 150
    """Steps per run (the first, compiling, step is not in tokens/s)."""
    vocab_size: int = 4096
    """BPE vocabulary trained on the corpus (cached after the first run)."""
    dataset_path: str | None = None
    """Corpus (default: this Python's standard-library sources)."""
    repeats: int = 1
    """Runs of each side of a pair (medians reported)."""
    scope_model: str = "d12"
    """Preset of the `scope` pair: compile time grows with depth only when the model compiles whole."""
    scope_steps: int = 4
    """Steps per `scope` run (compile time, then the median of the rest)."""
    scope_batch_size: int = 2
    """Sequences per step of the `scope` pair."""
    device: str = "auto"
    """cuda, cpu or auto."""
    optimizer: Literal["auto", "adamw", "muon"] = "auto"
    """The trainer's --optimizer (auto: its default, Muon + AdamW for a size preset). The figures
    BENCHMARKS.md dates before the Muon default trained AdamW: repeat them with adamw."""
    stats_period: bool = False
    """After each run of the stats pair's candidate, time one --fp8_stats_every period step by step."""
    profile: bool = False
    """After each run, one more step under the profiler: GEMM kernels, _scaled_mm calls, device reads."""
    quick: bool = False
    """Tiny sizes: a dry run in seconds (tests)."""
    out: str | None = None
    """Write the figures as JSON here."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "num_iterations", "repeats", "scope_steps", "scope_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")


QUICK = dict(model_name="d2", seq_len=32, batch_size=4, num_iterations=6, vocab_size=320, scope_model="d2",
             scope_steps=3, scope_batch_size=2)


def run(cfg: BenchTrainConfig, root: Path, name: str, over: dict, *, period: bool = False) -> dict:
    """One training run in a fresh process with a cold compiler cache: no graph compiled by an
    earlier run is reused, in memory or on disk, so every compile time is a first run's. With
    `period`, its stats_cost after training; with --profile, its profile_step."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / name / "inductor-cache")
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(_train, cfg, root, name, over, period).result()


def _train(cfg: BenchTrainConfig, root: Path, name: str, over: dict, period: bool) -> dict:
    from nanochat.train.measure import profile_step, stats_cost, train_run

    kw = dict(model_name=cfg.model_name, dataset_path=cfg.dataset_path, vocab_size=cfg.vocab_size,
              seq_len=cfg.seq_len, batch_size=cfg.batch_size, num_iterations=cfg.num_iterations,
              eval_every=0, eval_tokens=cfg.seq_len * 8, save_every=0, num_samples=0, device=cfg.device,
              run_dir=str(root / name), warmup_steps=min(20, cfg.num_iterations), optimizer=cfg.optimizer)
    trainer, figures = train_run(kw, **over)
    if period:
        figures["stats_period"] = stats_cost(trainer, trainer.config.batch_size * trainer.config.seq_len)
    if cfg.profile:
        figures.update(profile_step(trainer))
    return figures


def overrides(cfg: BenchTrainConfig, pair: str) -> tuple[dict, dict]:
    """The baseline's and the candidate's trainer flags of `pair` at cfg's sizes."""
    base_over, cand_over = PAIRS[pair]
    if pair == "stats" and not cfg.quick:  # at least two statistics steps in every run, at the default period
        from nanochat.config import TrainConfig

        steps = max(cfg.num_iterations, 2 * TrainConfig().fp8_stats_every)
        base_over, cand_over = dict(base_over, num_iterations=steps), dict(cand_over, num_iterations=steps)
    if pair == "scope":
        scope = dict(model_name=cfg.scope_model, num_iterations=cfg.scope_steps, batch_size=cfg.scope_batch_size)
        base_over, cand_over = dict(base_over, **scope), dict(cand_over, **scope)
    return base_over, cand_over


def bench(cfg: BenchTrainConfig) -> dict:
    results: dict[str, dict] = {"config": dataclasses.asdict(cfg), "pairs": {}}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)

        def side(pair: str, name: str, over: dict):
            """Repeat i of one side of `pair`: its figures, the load average after it."""
            def one(i: int) -> dict:
                period = cfg.stats_period and pair == "stats" and name == "candidate"
                return dict(run(cfg, root, f"{pair}-{name}-{i}", over, period=period), loadavg=os.getloadavg()[0])
            return one

        for pair in cfg.pairs:
            base_over, cand_over = overrides(cfg, pair)
            runs = harness.interleave({"baseline": side(pair, "baseline", base_over),
                                       "candidate": side(pair, "candidate", cand_over)}, cfg.repeats)
            med = {name: harness.medians({k: [r[k] for r in rs] for k in ("tokens_per_sec", "compile_time_s")})
                   for name, rs in runs.items()}
            ratio = med["candidate"]["tokens_per_sec"] / med["baseline"]["tokens_per_sec"]
            results["pairs"][pair] = dict(baseline=base_over, candidate=cand_over, runs=runs, median=med,
                                          ratio_tokens_per_sec=ratio)
            rows.append([pair, f"{med['baseline']['tokens_per_sec']:,.0f}", f"{med['candidate']['tokens_per_sec']:,.0f}",
                         f"{ratio:.3f}x", f"{med['baseline']['compile_time_s']:.1f} / {med['candidate']['compile_time_s']:.1f}",
                         f"{runs['candidate'][-1]['loadavg']:.2f}"])
    print(format_table(["pair", "baseline tok/s", "candidate tok/s", "ratio", "compile s (b / c)", "load"], rows))
    for pair in cfg.pairs:
        b, c = PAIRS[pair]
        print(f"  {pair}: baseline {b} vs candidate {c}")
    for r in (results["pairs"].get("stats") or {}).get("runs", {}).get("candidate", []):
        if "stats_period" in r:
            p = r["stats_period"]
            print(f"  stats period of {p['period']} steps: sampled step {p['sampled_step_s']:.3f} s against a median "
                  f"{p['median_step_s']:.3f} s ({p['sampled_step_costs_steps']:+.2f} steps), "
                  f"overhead {p['overhead_pct']:.2f}% of tokens/s")
    return results


def main(argv: list[str] | None = None) -> int:
    return harness.main(BenchTrainConfig, bench, argv, quick=QUICK)  # a run's error (re-raised from its process): one line


if __name__ == "__main__":
    sys.exit(main())
