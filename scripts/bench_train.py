"""Benchmark the trainer's tokens/s: each candidate against its baseline, in one process.

    .venv/bin/python scripts/bench_train.py                  # ~10 min on 2 CPU cores
    .venv/bin/python scripts/bench_train.py --quick          # seconds: a dry run (tests)
    .venv/bin/python scripts/bench_train.py --pairs scope --scope_model d12 --scope_steps 4

Every figure is NanoChatTrainer's own TrainResult (tokens/s over the steady-state steps; the
steps that compile and auto's calibration steps excluded, compile time reported on its own).
Pairs, baseline first:
  compile  eager (--no_compile) vs compiled (the default), FP8 off;
  fp8      FP8 off vs --fp8 --fp8_emulate --fp8_layers all, both compiled;
  stats    --fp8 --fp8_emulate --fp8_layers all with --fp8_stats_every 0 vs the default period, both compiled;
  scope    compile time and steady step time, whole model vs per block (--scope_model).
Runs alternate baseline/candidate --repeats times so that machine load hits both alike; the
median of each is printed with the ratio, and os.getloadavg() next to them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

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


def run(cfg: BenchTrainConfig, root: Path, name: str, **over) -> dict:
    """One training run in a fresh process with a cold compiler cache: no graph compiled by an
    earlier run is reused, in memory or on disk, so every compile time is a first run's."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / name / "inductor-cache")
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(_train, cfg, root, name, over).result()


def _train(cfg: BenchTrainConfig, root: Path, name: str, over: dict) -> dict:
    from nanochat.train.trainer import NanoChatTrainer

    kw = dict(model_name=cfg.model_name, dataset_path=cfg.dataset_path, vocab_size=cfg.vocab_size,
              seq_len=cfg.seq_len, batch_size=cfg.batch_size, num_iterations=cfg.num_iterations,
              eval_every=0, eval_tokens=cfg.seq_len * 8, save_every=0, num_samples=0, device=cfg.device,
              run_dir=str(root / name), warmup_steps=min(20, cfg.num_iterations))
    kw.update(over)
    r = NanoChatTrainer(**kw).train()
    return dict(tokens_per_sec=r.tokens_per_sec, compile_time_s=r.compile_time_s, val_loss=r.val_loss,
                wall_time_s=r.wall_time_s, fallbacks=r.fallbacks, steps=r.steps)


def main(argv: list[str] | None = None) -> int:
    from nanochat.common import run_main
    from nanochat.config import parse_cli

    cfg = parse_cli(BenchTrainConfig, argv)
    return run_main(lambda: bench(cfg))  # a run's error (re-raised from its process): one line


def bench(cfg: BenchTrainConfig) -> int:
    if cfg.quick:
        cfg = dataclasses.replace(cfg, **QUICK)
    results: dict[str, dict] = {"config": dataclasses.asdict(cfg), "pairs": {}}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for pair in cfg.pairs:
            base_over, cand_over = PAIRS[pair]
            if pair == "stats" and not cfg.quick:  # at least two statistics steps in every run, at the default period
                from nanochat.config import TrainConfig

                steps = max(cfg.num_iterations, 2 * TrainConfig().fp8_stats_every)
                base_over, cand_over = dict(base_over, num_iterations=steps), dict(cand_over, num_iterations=steps)
            if pair == "scope":
                base_over = dict(base_over, model_name=cfg.scope_model, num_iterations=cfg.scope_steps,
                                 batch_size=cfg.scope_batch_size)
                cand_over = dict(cand_over, model_name=cfg.scope_model, num_iterations=cfg.scope_steps,
                                 batch_size=cfg.scope_batch_size)
            runs: dict[str, list[dict]] = {"baseline": [], "candidate": []}
            for i in range(cfg.repeats):
                for side, over in (("baseline", base_over), ("candidate", cand_over)):
                    runs[side].append(run(cfg, root, f"{pair}-{side}-{i}", **over))
                    runs[side][-1]["loadavg"] = os.getloadavg()[0]
            med = {side: {k: statistics.median(r[k] for r in rs) for k in ("tokens_per_sec", "compile_time_s")}
                   for side, rs in runs.items()}
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
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
