"""Every distinct Linear shape of a model timed in bf16 and in FP8 e4m3 (tensorwise, rowwise).

FP8's speed on a GPU is decided per GEMM shape (docs/fp8.md): `time_shapes` takes every distinct
(in_features, out_features) of some models (the head left out: it stays in high precision), and
times each at a few row counts, forward and backward compiled as the trainer runs them (fp32
master weights, bf16 autocast). Each shape compiles once per variant with the row count dynamic,
so one compile serves every row count (compiling dominates the time; the trainer compiles its one
row count statically). Variants are interleaved `repeats` times, so machine load hits them alike;
each figure is the median of those, each a mean over `steps` steps.

scripts/gpu_check.py's shapes job runs it within a budget; bench/bench_fp8_linear.py --models runs it
alone. The `faster` layer policy times shapes its own way (nanochat.fp8.speed: one row count,
CUDA events, cached) because it decides for one run; this module reports a model's shapes.
"""

from __future__ import annotations

import contextlib
import re
import statistics
import time
import traceback
from collections.abc import Callable

import torch
import torch.nn as nn

from nanochat.fp8 import FP8Config, convert
from nanochat.model.gpt import GPT, GPTConfig, preset_config

SEED_MODELS = {
    # Meta-Llama-3-8B's config.json: 32 heads of 128, 8 key/value heads, SwiGLU 14336
    "llama3-8b": dict(vocab_size=128256, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, intermediate_size=14336,
                      mlp="swiglu", norm_weight=True, embed_norm=False, qk_norm=False),
}
"""Models whose shapes can be timed that are not presets, by their shapes."""

SHAPE_VARIANTS = ("bf16", "tensorwise", "rowwise")


def linear_shapes(model: str) -> dict[tuple[int, int], list[str]]:
    """(in_features, out_features) -> the Linear layers of `model` with that shape, named as in
    one block ("attn.c_q"); lm_head is left out (FP8Config.skip_fqns keeps it in high precision)."""
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
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(k, n, bias=False)).to(device)
    if variant != "bf16":
        report = convert(m, FP8Config(mode="e4m3", recipe=variant, emulate=emulate, min_dim=16,
                                      layers="all"))
        if not report.converted:
            raise RuntimeError(f"{k}->{n} did not convert to FP8 {variant}: {report.summary()}")
    return torch.compile(m)


def time_shape(k: int, n: int, device: torch.device, *, tokens: tuple[int, ...], steps: int, repeats: int,
               emulate: bool) -> dict:
    """One shape at each row count of `tokens`: ms per fwd+bwd step of bf16, FP8 tensorwise and
    rowwise (median of `repeats` interleaved means of `steps` steps), FP8's speedup, bf16's TFLOP/s."""
    on_cuda = device.type == "cuda"
    # CPU: FP8 layers refuse CPU autocast (emulated FP8 runs in fp32 there); the figures mean nothing
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if on_cuda else contextlib.nullcontext
    dtype = torch.bfloat16 if on_cuda else torch.float32

    def sync() -> None:
        if on_cuda:
            torch.cuda.synchronize()

    models = {v: shape_variant(k, n, v, device, emulate) for v in SHAPE_VARIANTS}
    figures: dict = {"in_features": k, "out_features": n, "compile_s": {}, "tokens": {}}
    for rows in tokens:
        x = torch.randn(rows, k, device=device, dtype=dtype, requires_grad=True)
        torch._dynamo.maybe_mark_dynamic(x, 0)  # one compile for every row count
        g = torch.randn(rows, n, device=device, dtype=dtype)

        def step(m: nn.Module) -> None:
            x.grad = None
            m.zero_grad(set_to_none=True)
            with autocast():
                y = m(x)
            y.backward(g)

        def seconds(m: nn.Module, count: int) -> float:
            sync()
            t = time.perf_counter()
            for _ in range(count):
                step(m)
            sync()
            return time.perf_counter() - t

        for v, m in models.items():  # warmup: the first row count compiles forward and backward
            figures["compile_s"].setdefault(v, seconds(m, 2))
        runs: dict[str, list[float]] = {v: [] for v in models}
        for _ in range(repeats):
            for v, m in models.items():
                runs[v].append(seconds(m, steps) / steps * 1e3)
        ms = {v: statistics.median(r) for v, r in runs.items()}
        figures["tokens"][str(rows)] = {
            **{f"{v}_ms": ms[v] for v in SHAPE_VARIANTS},
            **{f"{v}_speedup": ms["bf16"] / ms[v] for v in SHAPE_VARIANTS[1:]},
            "bf16_tflops": 6 * rows * k * n / (ms["bf16"] * 1e-3) / 1e12,
        }
    return figures


def time_shapes(models: tuple[str, ...], device: torch.device, *, tokens: tuple[int, ...], steps: int,
                repeats: int, emulate: bool, deadline: float | None = None,
                on_result: Callable[[str, dict], None] | None = None) -> dict:
    """time_shape for every distinct Linear shape of `models`, with the layers that have it.
    `on_result(key, figures)` after each shape; the first shape is always timed (a budget too
    short still gives one figure), later ones not started by `deadline` (time.perf_counter())
    are listed as not timed, a shape that fails under errors."""
    shapes: dict[tuple[int, int], dict[str, list[str]]] = {}
    for model in models:
        for shape, layers in linear_shapes(model).items():
            shapes.setdefault(shape, {})[model] = layers
    out: dict = {"shapes": {}, "not_timed": [], "errors": {}}
    for (k, n), owners in shapes.items():
        key = f"{k}x{n}"
        started = bool(out["shapes"] or out["errors"])
        if started and deadline is not None and time.perf_counter() > deadline:
            out["not_timed"].append(key)
            continue
        torch._dynamo.reset()  # 3 compiled modules per shape; older ones would fill dynamo's cache
        try:
            figures = time_shape(k, n, device, tokens=tokens, steps=steps, repeats=repeats, emulate=emulate)
            out["shapes"][key] = {**figures, "layers": owners}
        except Exception as e:  # noqa: BLE001 -- one shape's failure must not cost the others' figures
            out["errors"][key] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
        if on_result:
            on_result(key, out["shapes"].get(key) or {"error": out["errors"][key]})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


__all__ = ["SEED_MODELS", "SHAPE_VARIANTS", "linear_shapes", "shape_variant", "time_shape", "time_shapes"]
