"""What an FP8 training step costs against a plain one, per mode, on this machine.

    python scripts/bench_fp8_linear.py                       # d4-size MLP, emulated on CPU
    python scripts/bench_fp8_linear.py --tokens 8192 --dim 512

Baseline and candidates run in the same process, interleaved (so machine load hits both), and
each figure is the median of `--repeats` medians of `--steps` timed fwd+bwd steps after warmup.
On CPU the FP8 path is torchao's emulation (FP8 rounding in high precision): it measures the
cost of *simulating* FP8, useful for planning tests and numerics studies, not FP8 speed. FP8
speed needs FP8 tensor cores: scripts/gpu_check.py measures that on an H100/H200.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn

from nanochat.common import resolve_device, run_main
from nanochat.config import parse_cli
from nanochat.fp8 import convert, detect


@dataclass(frozen=True, kw_only=True)
class BenchFP8LinearConfig:
    """Time an MLP's forward+backward with and without FP8 (emulated where not native)."""

    dim: int = 256
    """Model width; the MLP is dim -> 4*dim -> dim (nanochat's MLP shape)."""
    tokens: int = 2048
    """Rows of the input (batch x sequence)."""
    modes: tuple[Literal["e4m3", "e5m2", "auto"], ...] = ("e4m3", "e5m2", "auto")
    """FP8 modes to time against the high-precision baseline."""
    steps: int = 5
    """Timed steps per measurement."""
    repeats: int = 3
    """Interleaved measurements per variant; the median is reported."""
    threads: int = 2
    """torch intra-op threads (the CPU figures in BENCHMARKS.md: a 2-core machine)."""
    device: str = "cpu"
    """cpu, cuda (cuda:N) or auto."""
    out: str | None = None
    """Write the figures as JSON here."""

    def __post_init__(self) -> None:
        for name in ("dim", "tokens", "steps", "repeats", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of x against ref, in dB."""
    return (10 * torch.log10(ref.pow(2).sum() / (ref - x).pow(2).sum())).item()


def sqnr_table(device: torch.device, emulate: bool, recipes=("tensorwise", "rowwise", "rowwise_with_gw_hp"),
               modes=("e4m3", "e5m2", "auto"), seeds: int = 5) -> dict[str, list[float]]:
    """Output / grad-input / grad-weight SQNR (dB) of an FP8 Linear(256, 256) against the same
    fp32 layer on the same gaussian input (128 tokens) and upstream gradient; mean of `seeds`.
    `auto` is measured uncalibrated, i.e. as the hybrid (e4m3 forward, e5m2 gradients)."""
    out: dict[str, list[float]] = {}
    for recipe in recipes:
        for mode in modes:
            per_seed = []
            for seed in range(seeds):
                torch.manual_seed(seed)
                ref = nn.Sequential(nn.Linear(256, 256, bias=False)).to(device)
                fp8 = copy.deepcopy(ref)
                convert(fp8, mode=mode, recipe=recipe, emulate=emulate, min_dim=16)
                x = torch.randn(128, 256, device=device)
                upstream = torch.randn(128, 256, device=device)
                results = []
                for m in (ref, fp8):
                    xi = x.clone().requires_grad_(True)
                    y = m(xi)
                    y.backward(upstream)
                    results.append((y.detach(), xi.grad, m[0].weight.grad))
                per_seed.append([sqnr_db(a, b) for a, b in zip(*results)])
            out[f"{mode}/{recipe}"] = [sum(v[i] for v in per_seed) / seeds for i in range(3)]
    return out


def main(cfg: BenchFP8LinearConfig) -> dict:
    device = resolve_device(cfg.device)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(0)
    backend = detect(device, emulate=False)
    emulate = backend.backend != "native"
    base = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.ReLU(), nn.Linear(4 * cfg.dim, cfg.dim)).to(device)
    variants = {"high precision": base}
    for mode in cfg.modes:
        m = copy.deepcopy(base)
        convert(m, mode=mode, emulate=emulate, min_dim=16)
        variants[f"fp8 {mode}" + (" (emulated)" if emulate else "")] = m
    x = torch.randn(cfg.tokens, cfg.dim, device=device)

    def step(m: nn.Module) -> None:
        m.zero_grad(set_to_none=True)
        m(x).square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    def measure(m: nn.Module) -> float:
        step(m)  # warmup
        times = []
        for _ in range(cfg.steps):
            t = time.perf_counter()
            step(m)
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    load_before = os.getloadavg()
    runs: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(cfg.repeats):
        for name, m in variants.items():
            runs[name].append(measure(m))
    base_ms = statistics.median(runs["high precision"]) * 1e3
    result = {"config": cfg.__dict__ | {"modes": list(cfg.modes)}, "backend": backend.backend,
              "reason": backend.reason, "load_before": load_before, "load_after": os.getloadavg(),
              "torch": torch.__version__, "variants": {}}
    print(f"MLP {cfg.dim}->{4 * cfg.dim}->{cfg.dim}, {cfg.tokens} tokens, fwd+bwd, {cfg.threads} threads, "
          f"backend {backend.backend}; load {load_before[0]:.1f}")
    print(f"{'variant':28s} {'median ms':>10s} {'x baseline':>11s}")
    for name, times in runs.items():
        ms = statistics.median(times) * 1e3
        result["variants"][name] = {"median_ms": ms, "ratio": ms / base_ms, "runs_ms": [t * 1e3 for t in times]}
        print(f"{name:28s} {ms:10.1f} {ms / base_ms:11.2f}")
    result["sqnr_db"] = sqnr_table(device, emulate)
    print("\nSQNR vs the fp32 layer, dB (output / grad input / grad weight), Linear(256, 256), 128 tokens, mean of 5 seeds")
    for name, (o, gi, gw) in result["sqnr_db"].items():
        print(f"{name:28s} {o:6.1f} {gi:6.1f} {gw:6.1f}")
    if cfg.out:
        with open(cfg.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    cfg = parse_cli(BenchFP8LinearConfig)

    def bench() -> None:
        main(cfg)  # prints the figures (and writes --out); the returned dict is for Python callers

    sys.exit(run_main(bench))
