"""What an FP8 training step costs against a plain one, per mode or per Linear shape, on this machine.

    python scripts/bench_fp8_linear.py                       # d4-size MLP, emulated on CPU
    python scripts/bench_fp8_linear.py --recipes tensorwise rowwise mxfp8   # e4m3 per recipe too
    python scripts/bench_fp8_linear.py --tokens 8192 --dim 512
    python scripts/bench_fp8_linear.py --device cuda --models d12 d20 d26 llama3-8b   # per shape

Baseline and candidates run in the same process, interleaved (so machine load hits both), and
each figure is the median of `--repeats` medians of `--steps` timed fwd+bwd steps after warmup.
On CPU the FP8 path is torchao's emulation (FP8 rounding in high precision): it measures the
cost of *simulating* FP8, useful for planning tests and numerics studies, not FP8 speed. Then
the quantization error: each recipe's e4m3 (and tensorwise's/rowwise's e5m2 and auto) Linear
against the fp32 layer, output and both gradients, per `--sqnr_shapes` and input kind (gaussian;
gaussian with outlier channels, as LLM activations have, where per-row and per-block scales part).

`--models` times what decides FP8's speed on a GPU: every distinct Linear shape of those models
(the head excluded: it stays in high precision), at each `--shape_tokens` rows, forward and
backward compiled as the trainer runs them (fp32 master weights, bf16 autocast): bf16 against
torchao's FP8 e4m3 tensorwise and rowwise. Each shape compiles once per variant with the row
count dynamic, so one compile serves every row count (compiling dominates the benchmark's time;
the trainer compiles its one row count statically). scripts/gpu_check.py runs it within a budget.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from nanochat.common import run_main
from nanochat.config import parse_cli
from nanochat.config.fp8 import MX_RECIPES, RECIPES, FP8Recipe

# torch and the modules that load it are imported in the functions that use them: --help stays fast
if TYPE_CHECKING:
    import torch
    import torch.nn as nn

SEED_MODELS = {
    # Meta-Llama-3-8B's config.json: 32 heads of 128, 8 key/value heads, SwiGLU 14336
    "llama3-8b": dict(vocab_size=128256, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, intermediate_size=14336,
                      mlp="swiglu", norm_weight=True, embed_norm=False, qk_norm=False),
}
"""Models of --models that are not presets, by their shapes."""

SHAPE_VARIANTS = ("bf16", "tensorwise", "rowwise")


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


def linear_shapes(model: str) -> dict[tuple[int, int], list[str]]:
    """(in_features, out_features) -> the Linear layers of `model` with that shape, named as in
    one block ("attn.c_q"); lm_head is left out (FP8Config.skip_fqns keeps it in high precision)."""
    import torch
    import torch.nn as nn

    from nanochat.model.gpt import GPT, GPTConfig, preset_config

    if model in SEED_MODELS:
        config = GPTConfig(seq_len=16, **SEED_MODELS[model])
    else:
        config = preset_config(model, vocab_size=256, seq_len=16)
    with torch.device("meta"):  # shapes only, no memory
        gpt = GPT(config)
    shapes: dict[tuple[int, int], list[str]] = {}
    for name, m in gpt.named_modules():
        if isinstance(m, nn.Linear) and name != "lm_head":
            names = shapes.setdefault((m.in_features, m.out_features), [])
            layer = re.sub(r"^transformer\.h\.\d+\.", "", name)
            if layer not in names:
                names.append(layer)
    return shapes


def shape_variant(k: int, n: int, variant: str, device: torch.device, emulate: bool) -> nn.Module:
    """Linear(k, n) in fp32 master weights, as bf16 or converted to FP8 e4m3 with `variant`'s
    scaling recipe, compiled."""
    import torch
    import torch.nn as nn

    from nanochat.fp8 import FP8Config, convert

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(k, n, bias=False)).to(device)
    if variant != "bf16":
        report = convert(m, FP8Config(mode="e4m3", recipe=variant, emulate=emulate, min_dim=16,
                                      layers="all"))
        if not report.converted:
            raise RuntimeError(f"{k}->{n} did not convert to FP8 {variant}: {report.summary()}")
    return torch.compile(m)


def time_shape(k: int, n: int, cfg: BenchFP8LinearConfig, device: torch.device, *, emulate: bool) -> dict:
    """One shape at each cfg.shape_tokens: ms per fwd+bwd step of bf16, FP8 tensorwise and
    rowwise (median of cfg.repeats interleaved medians), FP8's speedup, bf16's TFLOP/s."""
    import torch

    on_cuda = device.type == "cuda"
    # CPU: FP8 layers refuse CPU autocast (emulated FP8 runs in fp32 there); the figures mean nothing
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if on_cuda else contextlib.nullcontext
    dtype = torch.bfloat16 if on_cuda else torch.float32

    def sync() -> None:
        if on_cuda:
            torch.cuda.synchronize()

    models = {v: shape_variant(k, n, v, device, emulate) for v in SHAPE_VARIANTS}
    figures: dict = {"in_features": k, "out_features": n, "compile_s": {}, "tokens": {}}
    for tokens in cfg.shape_tokens:
        x = torch.randn(tokens, k, device=device, dtype=dtype, requires_grad=True)
        torch._dynamo.maybe_mark_dynamic(x, 0)  # one compile for every row count
        g = torch.randn(tokens, n, device=device, dtype=dtype)

        def step(m: nn.Module) -> None:
            x.grad = None
            m.zero_grad(set_to_none=True)
            with autocast():
                y = m(x)
            y.backward(g)

        def seconds(m: nn.Module, steps: int) -> float:
            sync()
            t = time.perf_counter()
            for _ in range(steps):
                step(m)
            sync()
            return time.perf_counter() - t

        for v, m in models.items():  # warmup: the first row count compiles forward and backward
            figures["compile_s"].setdefault(v, seconds(m, 2))
        runs: dict[str, list[float]] = {v: [] for v in models}
        for _ in range(cfg.repeats):
            for v, m in models.items():
                runs[v].append(seconds(m, cfg.steps) / cfg.steps * 1e3)
        ms = {v: statistics.median(r) for v, r in runs.items()}
        figures["tokens"][str(tokens)] = {
            **{f"{v}_ms": ms[v] for v in SHAPE_VARIANTS},
            **{f"{v}_speedup": ms["bf16"] / ms[v] for v in SHAPE_VARIANTS[1:]},
            "bf16_tflops": 6 * tokens * k * n / (ms["bf16"] * 1e-3) / 1e12,
        }
    return figures


def time_shapes(cfg: BenchFP8LinearConfig, device: torch.device, *, emulate: bool, deadline: float | None = None,
                on_result: Callable[[str, dict], None] | None = None) -> dict:
    """time_shape for every distinct Linear shape of cfg.models, with the layers that have it.
    `on_result(key, figures)` after each shape; shapes not started by `deadline`
    (time.perf_counter()) are listed as not timed, a shape that fails under errors."""
    import torch

    shapes: dict[tuple[int, int], dict[str, list[str]]] = {}
    for model in cfg.models:
        for shape, layers in linear_shapes(model).items():
            shapes.setdefault(shape, {})[model] = layers
    out: dict = {"shapes": {}, "not_timed": [], "errors": {}}
    for (k, n), owners in shapes.items():
        key = f"{k}x{n}"
        if deadline is not None and time.perf_counter() > deadline:
            out["not_timed"].append(key)
            continue
        torch._dynamo.reset()  # 3 compiled modules per shape; older ones would fill dynamo's cache
        try:
            out["shapes"][key] = {**time_shape(k, n, cfg, device, emulate=emulate), "layers": owners}
        except Exception as e:  # noqa: BLE001 -- one shape's failure must not cost the others' figures
            out["errors"][key] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
        if on_result:
            on_result(key, out["shapes"].get(key) or {"error": out["errors"][key]})
        if device.type == "cuda":
            torch.cuda.empty_cache()
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

    device = resolve_device(cfg.device)
    backend = detect(device, emulate=False)
    emulate = backend.backend != "native"
    deadline = time.perf_counter() + cfg.budget_s if cfg.budget_s else None
    result = {"config": cfg.__dict__ | {"models": list(cfg.models), "shape_tokens": list(cfg.shape_tokens)},
              "backend": backend.backend, "reason": backend.reason, "device_name": backend.device_name,
              "torch": torch.__version__, **time_shapes(cfg, device, emulate=emulate, deadline=deadline)}
    where = ("bf16 autocast" if device.type == "cuda"
             else "no autocast: the bf16 column runs fp32 and FP8 is emulated, the figures mean nothing")
    print(f"compiled fwd+bwd per Linear shape on {backend.device_name}, fp32 master weights, {where}; FP8 e4m3; "
          f"median of {cfg.repeats} x {cfg.steps} steps; speedup = bf16 ms / FP8 ms")
    print_shapes(result)
    if cfg.out:
        with open(cfg.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


def main(cfg: BenchFP8LinearConfig) -> dict:
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
    print(f"{'variant':40s} {'median ms':>10s} {'x baseline':>11s}")
    for name, times in runs.items():
        ms = statistics.median(times) * 1e3
        result["variants"][name] = {"median_ms": ms, "ratio": ms / base_ms, "runs_ms": [t * 1e3 for t in times]}
        print(f"{name:40s} {ms:10.1f} {ms / base_ms:11.2f}")
    result["sqnr_db"] = sqnr_tables(cfg, device)
    if cfg.out:
        with open(cfg.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    cfg = parse_cli(BenchFP8LinearConfig)

    def bench() -> None:
        main(cfg)  # prints the figures (and writes --out); the returned dict is for Python callers

    sys.exit(run_main(bench))
