"""Benchmark the process layouts on CPU (gloo): step time of one process, DDP x2, FSDP x2 and TP x2.

    .venv/bin/python bench/bench_distributed.py                 # d2 and d4, 3 repeats: ~5 min on 2 cores
    .venv/bin/python bench/bench_distributed.py --quick         # seconds: a dry run
    .venv/bin/python bench/bench_distributed.py --models d4 --repeats 5 --out bench_distributed.json

Every run is scripts/base_train.py under torchrun (--nproc_per_node 1 or 2, each process with
--threads intra-op threads), eager, with the same global batch in every layout: one process takes
--batch_size x 2 sequences a step, each of the 2 ranks --batch_size (DDP, FSDP), or both ranks
all of them (TP: one model split over the 2 ranks; models whose heads do not split in 2 skip it). A run's step time is its own
figure: the tokens of a step over result.json's tokens/s. The layouts alternate within each
repeat so that machine load hits them alike; the median of --repeats runs per layout is printed
with its ratio to one process, the training state each rank held (result.json's state_bytes:
weights, gradients, optimizer) and os.getloadavg() at the end of the run. On CPU the ratios say
what a layout's collectives cost against the compute the ranks split (2 ranks on 2 cores: 0.5x
is perfect scaling); absolute GPU figures (NCCL) are not measured here. docs/distributed.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import harness
from nanochat.common import NanoChatError, format_bytes, format_table

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).parent / "torchrun"
Layout = Literal["ddp", "fsdp", "tp"]


@dataclass(frozen=True, kw_only=True)
class BenchDistributedConfig:
    """Step time of one process against DDP x2, FSDP x2 and TP x2 (gloo), the same global batch."""

    models: tuple[str, ...] = ("d2", "d4")
    """Size presets to time (d2: 2 layers of width 128; d4: 4 of 256)."""
    layouts: tuple[Layout, ...] = ("ddp", "fsdp", "tp")
    """The 2-rank layouts timed against one process."""
    seq_len: int = 256
    """Tokens per training sequence."""
    batch_size: int = 8
    """Sequences per rank a step (one process: twice this)."""
    num_iterations: int = 40
    """Steps per run."""
    vocab_size: int = 4096
    """BPE vocabulary trained on the corpus (cached after the first run)."""
    dataset_path: str | None = None
    """Corpus (default: this Python's standard-library sources)."""
    repeats: int = 3
    """Runs of each layout (medians reported)."""
    threads: int = 1
    """Intra-op threads of each process (OMP_NUM_THREADS)."""
    optimizer: Literal["auto", "adamw", "muon"] = "auto"
    """The trainer's --optimizer (auto: its default, Muon + AdamW for a size preset). The figures
    BENCHMARKS.md dates before the Muon default trained AdamW: repeat them with adamw."""
    quick: bool = False
    """Tiny sizes, one repeat: a dry run in seconds."""
    out: str | None = None
    """Write every run's figures as JSON here."""

    def __post_init__(self) -> None:
        from nanochat.model.gpt import PRESETS

        for name in ("seq_len", "batch_size", "num_iterations", "repeats", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        for model in self.models:
            if model not in PRESETS:
                raise ValueError(f"--models {model!r} is not a size preset; give any of {', '.join(PRESETS)}")


QUICK = dict(models=("d2",), seq_len=32, batch_size=4, num_iterations=4, vocab_size=320, repeats=1)


def run(cfg: BenchDistributedConfig, run_dir: Path, model: str, layout: str) -> dict:
    """One training run of `layout` ("one" process, "ddp", "fsdp" or "tp" over 2 ranks) in a
    torchrun launch of its own: result.json's figures, the step time and the load average after it."""
    ranks = 1 if layout == "one" else 2
    replicas = 1 if layout in ("one", "tp") else 2
    flags = dict(model_name=model, seq_len=cfg.seq_len, batch_size=cfg.batch_size * 2 // replicas,
                 num_iterations=cfg.num_iterations, warmup_steps=min(10, cfg.num_iterations), vocab_size=cfg.vocab_size,
                 eval_every=0, eval_tokens=cfg.seq_len * 8, num_samples=0, device="cpu", run_dir=str(run_dir),
                 optimizer=cfg.optimizer)
    if cfg.dataset_path:
        flags["dataset_path"] = cfg.dataset_path
    argv = ["--no_compile", "--no_save_checkpoints", *({"fsdp": ["--fsdp"], "tp": ["--tp", "2"]}.get(layout, []))]
    argv += [a for k, v in flags.items() for a in (f"--{k}", str(v))]
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads)}
    r = subprocess.run([str(TORCHRUN), "--standalone", f"--nproc_per_node={ranks}",
                        str(ROOT / "scripts" / "base_train.py"), *argv], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise NanoChatError(f"the {layout} run of {model} failed (exit status {r.returncode}): {last}")
    result = json.loads((run_dir / "result.json").read_text())
    tokens_per_step = cfg.batch_size * 2 * cfg.seq_len
    return {"layout": layout, "model": model, "parallel": result["parallel"], "tokens_per_sec": result["tokens_per_sec"],
            "step_s": tokens_per_step / result["tokens_per_sec"], "state_bytes": sum(result["state_bytes"].values()),
            "num_params": result["num_params"], "loadavg": os.getloadavg()[0]}


def layouts_of(cfg: BenchDistributedConfig, model: str) -> tuple[str, ...]:
    """One process and the --layouts `model` can take (TP x2 needs an even number of heads)."""
    from nanochat.model.gpt import PRESETS

    return ("one", *(x for x in cfg.layouts if x != "tp" or PRESETS[model]["n_head"] % 2 == 0))


def bench(cfg: BenchDistributedConfig) -> dict:
    runs: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as tmp:

        def layout_run(model: str, layout: str):
            return lambda i: run(cfg, Path(tmp) / f"{model}-{layout}-{i}", model, layout)

        for model in cfg.models:  # the layouts alternate, so that the machine's load hits them alike
            runs[model] = harness.interleave({layout: layout_run(model, layout) for layout in layouts_of(cfg, model)},
                                             cfg.repeats)
    rows = []
    for model, by_layout in runs.items():
        med = harness.medians({layout: [r["step_s"] for r in mine] for layout, mine in by_layout.items()})
        vs_one = harness.ratios(med, "one")
        for layout, mine in by_layout.items():
            rows.append([model, mine[0]["parallel"], f"{med[layout] * 1e3:.1f}", f"{vs_one[layout]:.2f}x",
                         ", ".join(f"{r['step_s'] * 1e3:.1f}" for r in mine), format_bytes(mine[0]["state_bytes"]),
                         f"{max(r['loadavg'] for r in mine):.2f}"])
    print(f"global batch {cfg.batch_size * 2} x {cfg.seq_len} tokens, {cfg.num_iterations} steps, eager, "
          f"{cfg.threads} thread(s) per process, median of {cfg.repeats}")
    print(format_table(["model", "layout", "step ms", "vs one process", "runs (ms)", "state per rank", "load"], rows))
    return {"config": dataclasses.asdict(cfg),
            "runs": [r for by_layout in runs.values() for mine in by_layout.values() for r in mine]}


def main(argv: list[str] | None = None) -> int:
    return harness.main(BenchDistributedConfig, bench, argv, quick=QUICK)


if __name__ == "__main__":
    sys.exit(main())
