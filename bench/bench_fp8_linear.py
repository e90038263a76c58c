"""What an FP8 training step costs against a plain one, per mode or per Linear shape, on this machine.

    python bench/bench_fp8_linear.py                       # d4-size MLP, emulated on CPU
    python bench/bench_fp8_linear.py --recipes tensorwise rowwise mxfp8   # e4m3 per recipe too
    python bench/bench_fp8_linear.py --tokens 8192 --dim 512
    python bench/bench_fp8_linear.py --device cuda --models d12 d20 d26 llama3-8b   # per shape

Baseline and candidates run in the same process, interleaved (so machine load hits both), and
each figure is the median of `--repeats` medians of `--steps` timed fwd+bwd steps after warmup.
On CPU the FP8 path is torchao's emulation (FP8 rounding in high precision): it measures the
cost of *simulating* FP8, useful for planning tests and numerics studies, not FP8 speed. Then
the quantization error: each recipe's e4m3 (and tensorwise's/rowwise's e5m2 and auto) Linear
against the fp32 layer, output and both gradients, per `--sqnr_shapes` and input kind (gaussian;
gaussian with outlier channels, as LLM activations have, where per-row and per-block scales part).

`--models` times what decides FP8's speed on a GPU: every distinct Linear shape of those models
at each `--shape_tokens` rows, bf16 against torchao's FP8 e4m3 tensorwise and rowwise, forward
and backward compiled as the trainer runs them (nanochat.train.linear_shapes, which
scripts/gpu_check.py's shapes job runs within a budget).
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import harness
from nanochat.config.fp8 import MX_RECIPES, RECIPES, FP8Recipe

# torch and the modules that load it are imported in the functions that use them: --help stays fast
if TYPE_CHECKING:
    import torch
    import torch.nn as nn


@dataclass(frozen=True, kw_only=True)
class BenchFP8LinearConfig:
    """Time forward+backward with and without FP8 (emulated where not native): an MLP, or with
    --models every Linear shape of those models."""

    dim: int = 256
    """Model width; the MLP is dim -> 4*dim -> dim (nanochat's MLP shape)."""
    tokens: int = 2048
    """Rows of the input (batch x sequence)."""
    modes: tuple[Literal["e4m3", "e5m2", "auto"], ...] = ("e4m3", "e5m2", "auto")
    """FP8 modes to time against the high-precision baseline (tensorwise)."""
    recipes: tuple[FP8Recipe, ...] = ()
    """Also time e4m3 with each of these recipes (an MXFP8 recipe runs e4m3 only)."""
    sqnr_shapes: tuple[str, ...] = ("256x256", "768x3072", "3072x768")
    """Linear shapes (in x out) of the SQNR tables: d4's attention and d12's MLP shapes."""
    steps: int = 5
    """Timed steps per measurement."""
    repeats: int = 3
    """Interleaved measurements per variant; the median is reported."""
    threads: int = 2
    """torch intra-op threads (the CPU figures in BENCHMARKS.md §2: a 2-core machine)."""
    device: str = "cpu"
    """cpu, cuda (cuda:N) or auto (FP8 runs natively on sm_89+, emulated elsewhere)."""
    out: str | None = None
    """Write the figures as JSON here."""
    models: tuple[str, ...] = ()
    """Time every Linear shape of these models instead of the MLP: presets (d2 ... d26) or
    llama3-8b (Meta-Llama-3-8B's shapes)."""
    shape_tokens: tuple[int, ...] = (8192, 32768)
    """Rows (tokens) of each shape's GEMMs with --models."""
    budget_s: float = 0.0
    """With --models: start no new shape after this many seconds (0: no limit); the shapes left
    are listed as not timed."""

    def __post_init__(self) -> None:
        from nanochat.model.gpt import PRESETS
        from nanochat.train.linear_shapes import SEED_MODELS

        unknown = [m for m in self.models if m not in PRESETS and m not in SEED_MODELS]
        if unknown:
            known = ", ".join([*PRESETS, *SEED_MODELS])
            raise ValueError(f"--models {' '.join(unknown)}: unknown; choose among {known}")
        for shape in self.sqnr_shapes:
            dims = shape.split("x")
            if len(dims) != 2 or not all(d.isdigit() and int(d) % 32 == 0 and int(d) > 0 for d in dims):
                raise ValueError(f"--sqnr_shapes: {shape!r} must be IN x OUT, each a positive multiple of 32 "
                                 "(MXFP8's blocks), e.g. 256x256")
        if any(t < 16 or t % 16 for t in self.shape_tokens):
            raise ValueError(f"--shape_tokens must be multiples of 16 (FP8 GEMM rows), got {self.shape_tokens}")
        for name in ("dim", "tokens", "steps", "repeats", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of x against ref, in dB."""
    import torch

    return (10 * torch.log10(ref.pow(2).sum() / (ref - x).pow(2).sum())).item()


OUTLIER_CHANNELS = 4
"""`inputs="outliers"`: this many input channels of every token scaled by OUTLIER_SCALE, as the few
outlier features of LLM activations are (LLM.int8(): magnitudes up to ~20x-100x+ the rest)."""
OUTLIER_SCALE = 2.0**10


def sqnr_table(device: torch.device, emulate: bool, recipes=RECIPES, modes=("e4m3", "e5m2", "auto"),
               seeds: int = 5, shape: tuple[int, int] = (256, 256), inputs: str = "gaussian") -> dict[str, list[float]]:
    """Output / grad-input / grad-weight SQNR (dB) of an FP8 Linear(k, n) against the same fp32
    layer on the same input (128 tokens: gaussian, or with outlier channels) and gaussian upstream
    gradient; mean of `seeds`. `auto` is measured uncalibrated, i.e. as the hybrid (e4m3 forward,
    e5m2 gradients); the MXFP8 recipes run e4m3 only (their other modes are left out)."""
    import torch
    import torch.nn as nn

    from nanochat.fp8 import convert

    k, n = shape
    out: dict[str, list[float]] = {}
    for recipe in recipes:
        for mode in modes:
            if recipe in MX_RECIPES and mode != "e4m3":
                continue
            per_seed = []
            for seed in range(seeds):
                torch.manual_seed(seed)
                ref = nn.Sequential(nn.Linear(k, n, bias=False)).to(device)
                fp8 = copy.deepcopy(ref)
                convert(fp8, mode=mode, recipe=recipe, emulate=emulate, min_dim=16, layers="all")
                x = torch.randn(128, k, device=device)
                if inputs == "outliers":
                    x[:, torch.randperm(k, device=device)[:OUTLIER_CHANNELS]] *= OUTLIER_SCALE
                upstream = torch.randn(128, n, device=device)
                results = []
                for m in (ref, fp8):
                    xi = x.clone().requires_grad_(True)
                    y = m(xi)
                    y.backward(upstream)
                    results.append((y.detach(), xi.grad, m[0].weight.grad))
                per_seed.append([sqnr_db(a, b) for a, b in zip(*results)])
            out[f"{mode}/{recipe}"] = [sum(v[i] for v in per_seed) / seeds for i in range(3)]
    return out


def sqnr_tables(cfg: BenchFP8LinearConfig, device: torch.device) -> dict[str, dict[str, list[float]]]:
    """`sqnr_table` for each of cfg.sqnr_shapes and both input kinds, printed; keyed "KxN/inputs"."""
    out = {}
    for shape in cfg.sqnr_shapes:
        k, n = map(int, shape.split("x"))
        for inputs in ("gaussian", "outliers"):
            table = out[f"{shape}/{inputs}"] = sqnr_table(device, True, shape=(k, n), inputs=inputs)
            what = inputs if inputs == "gaussian" else f"gaussian, {OUTLIER_CHANNELS} input channels x {OUTLIER_SCALE:g}"
            print(f"\nSQNR vs the fp32 layer, dB (output / grad input / grad weight), Linear({k}, {n}), 128 tokens, "
                  f"{what}, emulated, mean of 5 seeds")
            for name, (o, gi, gw) in table.items():
                print(f"{name:40s} {o:6.1f} {gi:6.1f} {gw:6.1f}")
    return out


def print_shapes(result: dict) -> None:
    print(f"{'shape':>12s} {'tokens':>7s} {'bf16 ms':>9s} {'tensorwise ms':>16s} {'rowwise ms':>16s}  layers")
    for key, f in result["shapes"].items():
        owners = "; ".join(f"{m}: {', '.join(layers)}" for m, layers in f["layers"].items())
        for tokens, t in f["tokens"].items():
            print(f"{f['in_features']:>5d}->{f['out_features']:<6d} {tokens:>7s} {t['bf16_ms']:9.3f} "
                  f"{t['tensorwise_ms']:9.3f} ({t['tensorwise_speedup']:.2f}x) "
                  f"{t['rowwise_ms']:9.3f} ({t['rowwise_speedup']:.2f}x)  {owners}")
    for key, error in result["errors"].items():
        print(f"{key}: FAILED {error.splitlines()[0]}")
    if result["not_timed"]:
        print(f"not timed (--budget_s): {', '.join(result['not_timed'])}")


def shapes_main(cfg: BenchFP8LinearConfig) -> dict:
    import torch

    from nanochat.device import resolve_device
    from nanochat.fp8 import detect
    from nanochat.train.linear_shapes import time_shapes

    device = resolve_device(cfg.device)
    backend = detect(device, emulate=False)
    emulate = backend.backend != "native"
    deadline = time.perf_counter() + cfg.budget_s if cfg.budget_s else None
    timed = time_shapes(cfg.models, device, tokens=cfg.shape_tokens, steps=cfg.steps, repeats=cfg.repeats,
                        emulate=emulate, deadline=deadline)
    result = {"config": cfg.__dict__ | {"models": list(cfg.models), "shape_tokens": list(cfg.shape_tokens)},
              "backend": backend.backend, "reason": backend.reason, "device_name": backend.device_name,
              "torch": torch.__version__, **timed}
    where = ("bf16 autocast" if device.type == "cuda"
             else "no autocast: the bf16 column runs fp32 and FP8 is emulated, the figures mean nothing")
    print(f"compiled fwd+bwd per Linear shape on {backend.device_name}, fp32 master weights, {where}; FP8 e4m3; "
          f"median of {cfg.repeats} x {cfg.steps} steps; speedup = bf16 ms / FP8 ms")
    print_shapes(result)
    return result


def bench(cfg: BenchFP8LinearConfig) -> dict:
    import torch
    import torch.nn as nn

    from nanochat.device import resolve_device
    from nanochat.fp8 import convert, detect

    if cfg.models:
        return shapes_main(cfg)
    device = resolve_device(cfg.device)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(0)
    backend = detect(device, emulate=False)
    base = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.ReLU(), nn.Linear(4 * cfg.dim, cfg.dim)).to(device)
    variants = {"high precision": base}
    combos = [(mode, "tensorwise") for mode in cfg.modes] + [("e4m3", r) for r in cfg.recipes]
    for mode, recipe in dict.fromkeys(combos):
        m = copy.deepcopy(base)
        # every layer, faster or not; emulated where this device has no kernel for the recipe
        native = detect(device, emulate=False, recipe=recipe).backend == "native"
        convert(m, mode=mode, recipe=recipe, emulate=not native, min_dim=16, layers="all")
        name = f"fp8 {mode}" + ("" if recipe == "tensorwise" else f"/{recipe}")
        variants[name + ("" if native else " (emulated)")] = m
    x = torch.randn(cfg.tokens, cfg.dim, device=device)
    cuda = device.type == "cuda"

    def step(m: nn.Module) -> None:
        m.zero_grad(set_to_none=True)
        m(x).square().mean().backward()

    def measure(m: nn.Module) -> float:
        """The median of cfg.steps timed fwd+bwd steps after one warmup step."""
        step(m)
        return statistics.median(harness.timed(lambda: step(m), cuda=cuda) for _ in range(cfg.steps))

    load_before = os.getloadavg()
    runs = harness.interleave({name: lambda _, m=m: measure(m) for name, m in variants.items()}, cfg.repeats)
    median_ms = {name: ms * 1e3 for name, ms in harness.medians(runs).items()}
    ratio = harness.ratios(median_ms, "high precision")
    result = {"config": cfg.__dict__ | {"modes": list(cfg.modes)}, "backend": backend.backend,
              "reason": backend.reason, "load_before": load_before, "load_after": os.getloadavg(),
              "torch": torch.__version__, "variants": {}}
    print(f"MLP {cfg.dim}->{4 * cfg.dim}->{cfg.dim}, {cfg.tokens} tokens, fwd+bwd, {cfg.threads} threads, "
          f"backend {backend.backend}; load {load_before[0]:.1f}")
    print(f"{'variant':40s} {'median ms':>10s} {'x baseline':>11s}")
    for name, times in runs.items():
        result["variants"][name] = {"median_ms": median_ms[name], "ratio": ratio[name],
                                    "runs_ms": [t * 1e3 for t in times]}
        print(f"{name:40s} {median_ms[name]:10.1f} {ratio[name]:11.2f}")
    result["sqnr_db"] = sqnr_tables(cfg, device)
    return result


def main(argv: list[str] | None = None) -> int:
    return harness.main(BenchFP8LinearConfig, bench, argv)


if __name__ == "__main__":
    sys.exit(main())
