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
median of each is printed with the ratio, and os.getloadavg() next to them. A run's figures
(`train_run`) also hold its graph breaks, recompile reasons and peak memory, and a run during
which dynamo hit its recompile limit (so part of the model ran eagerly) is marked `invalid`.
--stats_period then times one statistics period of the stats pair's candidate step by step
(`stats_cost`: the sampled step against the plain ones), --profile one more step of every run
under the profiler (`profile_step`). scripts/gpu_check.py runs these functions on a GPU.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import multiprocessing
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from nanochat.common import format_table

# torch and the trainer are imported in the functions that use them: --help stays fast
if TYPE_CHECKING:
    import torch

    from nanochat.train.trainer import NanoChatTrainer

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

RECOMPILE_LIMIT_HIT = "torch._dynamo hit config."
"""How dynamo's warning begins when a function reached its recompile limit and runs eagerly from
then on (torch/_dynamo/convert_frame.py)."""


class RecompileLog(logging.Handler):
    """The first recompile reasons dynamo logs while the block runs (why a graph was not reused),
    and `limit_hit`: dynamo's warning that a function reached its recompile limit (it then runs
    eagerly), or None."""

    def __init__(self):
        super().__init__()
        self.reasons: list[str] = []
        self.limit_hit: str | None = None

    def emit(self, record):
        message = record.getMessage()
        if message.startswith(RECOMPILE_LIMIT_HIT) and self.limit_hit is None:
            self.limit_hit = " ".join(message.split("\n")[:3])[:600]
        elif len(self.reasons) < 3:
            self.reasons.append(message[:600])

    def __enter__(self):
        import torch

        torch._logging.set_logs(recompiles=True)
        self.logger = logging.getLogger("torch._dynamo")
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        import torch

        self.logger.removeHandler(self)
        torch._logging.set_logs()


def train_run(kw: dict, **over) -> tuple[NanoChatTrainer, dict]:
    """NanoChatTrainer(**kw, **over) trained in this process: the trainer (for more steps) and its
    figures: TrainResult's fields (the layer lists as counts, without samples and statistics),
    `over` as `settings`, graph breaks, recompile reasons, peak memory, and `invalid` where dynamo
    hit its recompile limit."""
    from torch._dynamo.utils import counters

    from bench_optim import reset_memory  # scripts/, this script's folder
    from nanochat.device import resolve_device
    from nanochat.train.trainer import NanoChatTrainer

    kw = {**kw, **over}
    reset_memory(resolve_device(kw.get("device", "auto")))
    counters.clear()
    recompiles = RecompileLog()
    trainer = NanoChatTrainer(**kw)
    with recompiles:
        r = trainer.train()
    bulky = ("samples", "fp8_stats", "fp8_converted", "fp8_skipped")
    figures = {k: v for k, v in r.to_dict().items() if k not in bulky}
    report = trainer.fp8.report
    figures.update(settings=over, model=kw["model_name"], batch_size=kw["batch_size"],
                   fp8_converted_layers=len(r.fp8_converted), fp8_skipped_layers=len(r.fp8_skipped),
                   peak_gib=peak_gib(trainer.device),
                   fp8_kept_by_policy=report.kept_by_layers if report is not None else None,
                   recompile_reasons=recompiles.reasons[:3], **graph_breaks())
    if recompiles.limit_hit:
        figures["invalid"] = f"dynamo hit its recompile limit, so part of the model ran eagerly: {recompiles.limit_hit}"
    return trainer, figures


def peak_gib(device: torch.device) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def graph_breaks() -> dict[str, Any]:
    from torch._dynamo.utils import counters

    return {"graph_breaks": sum(counters["graph_break"].values()),
            "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
            "break_reasons": dict(list(counters["graph_break"].items())[:5])}


def timed_step(trainer: NanoChatTrainer, step: int) -> float:
    """Seconds of trainer.train_step(step), the device synchronized on both sides."""
    import torch

    cuda = trainer.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    trainer.train_step(step)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def stats_cost(trainer: NanoChatTrainer, tokens_per_step: int) -> dict:
    """What FP8 statistics cost a trained FP8 run: one period of --fp8_stats_every steps timed one
    by one, the last being the period's sampled step. tokens/s over the period against the same
    steps without the sampled one, i.e. statistics off (a step that samples nothing runs exactly
    as with statistics off)."""
    period = trainer.config.fp8_stats_every
    if not period:
        raise ValueError("stats_cost: the run samples no FP8 statistics (--fp8_stats_every 0 or no --fp8); "
                         "time a run with --fp8 and statistics on")
    # step s samples when (s + 1) % period == 0: warm up on one (its first eager run of the model),
    # then time steps period .. 2 period - 1
    timed_step(trainer, period - 1)
    times = [timed_step(trainer, s) for s in range(period, 2 * period)]
    with_stats, without = period * tokens_per_step / sum(times), (period - 1) * tokens_per_step / sum(times[:-1])
    return {"period": period, "tokens_per_sec_with_stats": with_stats, "tokens_per_sec_without": without,
            "overhead_pct": 100 * (1 - with_stats / without), "sampled_step_s": times[-1],
            "median_step_s": statistics.median(times[:-1]),
            "sampled_step_costs_steps": times[-1] / statistics.median(times[:-1]) - 1}


def profile_step(trainer: NanoChatTrainer) -> dict:
    """One more training step under the profiler (GEMM kernel names) and a device-read counter."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from nanochat.device import DeviceReads

    cuda, last = trainer.device.type == "cuda", trainer.total_steps - 1
    reads = DeviceReads()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    trainer.train_step(last)  # a steady-state step first (no recompiles below)
    with reads:
        trainer.train_step(last)
    with profile(activities=activities) as prof:
        trainer.train_step(last)
        if cuda:
            torch.cuda.synchronize()
    kernels: dict[str, int] = {}
    for e in prof.key_averages():
        if re.search(r"gemm|_mm|matmul|xmma|cutlass|nvjet", e.key, re.I) and (
                not cuda or getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA):
            kernels[e.key[:160]] = e.count
    scaled_mm = sum(e.count for e in prof.key_averages() if e.key == "aten::_scaled_mm")
    return {"gemm_kernels": kernels, "scaled_mm_calls": scaled_mm, "device_reads_in_step": reads.count}


def run(cfg: BenchTrainConfig, root: Path, name: str, over: dict, *, period: bool = False) -> dict:
    """One training run in a fresh process with a cold compiler cache: no graph compiled by an
    earlier run is reused, in memory or on disk, so every compile time is a first run's. With
    `period`, its stats_cost after training; with --profile, its profile_step."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / name / "inductor-cache")
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(_train, cfg, root, name, over, period).result()


def _train(cfg: BenchTrainConfig, root: Path, name: str, over: dict, period: bool) -> dict:
    kw = dict(model_name=cfg.model_name, dataset_path=cfg.dataset_path, vocab_size=cfg.vocab_size,
              seq_len=cfg.seq_len, batch_size=cfg.batch_size, num_iterations=cfg.num_iterations,
              eval_every=0, eval_tokens=cfg.seq_len * 8, save_every=0, num_samples=0, device=cfg.device,
              run_dir=str(root / name), warmup_steps=min(20, cfg.num_iterations))
    trainer, figures = train_run(kw, **over)
    if period:
        figures["stats_period"] = stats_cost(trainer, trainer.config.batch_size * trainer.config.seq_len)
    if cfg.profile:
        figures.update(profile_step(trainer))
    return figures


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
                    period = cfg.stats_period and pair == "stats" and side == "candidate"
                    runs[side].append(run(cfg, root, f"{pair}-{side}-{i}", over, period=period))
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
    for r in (results["pairs"].get("stats") or {}).get("runs", {}).get("candidate", []):
        if "stats_period" in r:
            p = r["stats_period"]
            print(f"  stats period of {p['period']} steps: sampled step {p['sampled_step_s']:.3f} s against a median "
                  f"{p['median_step_s']:.3f} s ({p['sampled_step_costs_steps']:+.2f} steps), "
                  f"overhead {p['overhead_pct']:.2f}% of tokens/s")
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
