"""How fast FP8 is here: one Linear's compiled forward+backward timed in FP8 and in bf16.

FP8 halves a GEMM's tensor-core time (M*K*N work) but adds casts that read and write every
operand (M*(K+N) memory traffic), so whether a layer gains depends on its shape and on the GPU.
torchao's H100 tables show small layers slower than bf16 and large ones faster (docs/fp8.md).
Another GPU's tables are a guess for this one, so `layers="faster"`
(policy.py) times each distinct (M, K, N) of the run once, on the user's GPU: the layer the
run swaps in (FP8Linear, or MXLinear for the MXFP8 recipes) against the same nn.Linear in bf16, both compiled, fp32
weights under bf16 autocast as the trainer runs them, forward and both backward GEMMs, CUDA
events around windows of calls, FP8 and bf16 windows alternating, the median of each.

Timings are cached in `$NANOCHAT_CACHE/fp8_speed.json` (default `.cache/`), keyed by GPU name,
torch and torchao versions, recipe and shape, so a second run measures nothing. The file is
written atomically; one there that is not such a cache (corrupt, not UTF-8, something else's, or
not a regular file: a FIFO would block the read forever) is ignored with one logged line and
never overwritten: this run's timings then go uncached.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import stat
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from nanochat.fp8 import _torchao  # first: torchao imported with its log noise muted
import torchao
from torchao.float8.config import Float8LinearConfig
from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig

from nanochat.common import cache_root, logger
from nanochat.fp8.layers import FP8Linear, MXLinear
from nanochat.fs import write_atomic

CACHE_FORMAT = "nanochat fp8 speed v1"
"""The `format` a cache file must name; anything else at the cache's path is not ours."""

# Why a first d26 run measures in well under 30 s (an estimate, to be confirmed on a GPU):
# d26 (width 1664, MLP 6656) has three shapes, 1664->1664 (q, k, v, attention proj),
# 1664->6656 and 6656->1664 (lm_head is skipped by name). Each compiles two one-layer graphs,
# a cast kernel or two per GEMM (seconds, not the tens of seconds of a whole model), and times
# 2 x WINDOWS x CALLS calls: ~0.3 s at the largest shape with M=32768 (16 x 2048, BENCHMARKS.md
# §5), 6*M*K*N = 2.2 TFLOP a call.
WARMUP = 3
"""Calls before timing: the first compiles, the others settle the allocator and cuBLAS's choice."""
WINDOWS = 10
"""Timed windows per layer and precision; the median is kept (robust to a clock or load blip)."""
CALLS = 5
"""fwd+bwd calls per window: a window of several calls hides the launch gaps a whole compiled
model would not have between its layers."""


@dataclass(frozen=True)
class LinearShape:
    """One Linear's GEMM shape in a training step: M tokens, K = in_features, N = out_features."""

    m: int
    k: int
    n: int

    def __str__(self) -> str:
        return f"M={self.m} K={self.k} N={self.n}"


@dataclass(frozen=True)
class Timing:
    """Seconds of one forward+backward of a Linear in FP8 and in bf16."""

    fp8_s: float
    bf16_s: float

    @property
    def speedup(self) -> float:
        """bf16's time over FP8's: 1.2 means FP8 does the layer's step in 1/1.2 of bf16's time."""
        return self.bf16_s / self.fp8_s


Measure = Callable[[LinearShape, Float8LinearConfig | MXFP8TrainingOpConfig, torch.device], Timing]
"""(shape, torchao's config for the layer, device) -> its Timing. `time_fwd_bwd` on a GPU."""


def cuda_seconds(run: Callable[[], None]) -> float:
    """Seconds the GPU spent on `run()`'s work, between two CUDA events around it."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3  # elapsed_time is in ms


def _converted(plain: nn.Linear, lin_config: Float8LinearConfig | MXFP8TrainingOpConfig) -> nn.Module:
    """A copy of `plain` as the run converts it with `lin_config` (linear.convert's layers)."""
    plain = copy.deepcopy(plain)
    if isinstance(lin_config, MXFP8TrainingOpConfig):
        return MXLinear.from_linear(plain, lin_config)
    return FP8Linear.from_float(plain, config=lin_config)


def time_fwd_bwd(shape: LinearShape, lin_config: Float8LinearConfig | MXFP8TrainingOpConfig, device: torch.device, *,
                 seconds: Callable[[Callable[[], None]], float] = cuda_seconds) -> Timing:
    """Median fwd+bwd seconds of a bias-free Linear(K, N) on M tokens: converted by torchao with
    `lin_config` vs plain, both compiled; on CUDA under bf16 autocast (see the module docstring).
    `seconds(run)` times one window (the same code runs on CPU with another clock: tests)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    # the run's random streams must not depend on whether its timings came from the cache
    with torch.random.fork_rng(devices=[device] if cuda else []):
        plain = nn.Linear(shape.k, shape.n, bias=False, device=device)  # fp32 weight, as the trainer keeps it
        dtype = torch.bfloat16 if cuda else torch.float32  # what autocast feeds the GEMMs
        x = torch.randn(shape.m, shape.k, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn(shape.m, shape.n, device=device, dtype=dtype)
    fp8 = _converted(plain, lin_config)
    _torchao.prepare_float8_training()  # so the timed kernels are the ones a converted model compiles

    def run(layer: nn.Module, compiled: nn.Module, calls: int) -> None:
        for _ in range(calls):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                y = compiled(x)
            y.backward(grad)  # grad_input and grad_weight GEMMs
            layer.weight.grad = x.grad = None

    # every shape recompiles the same forward code; the default limit (8) would time a model's
    # ninth distinct shape eagerly
    with torch._dynamo.config.patch(recompile_limit=64):
        layers = [(fp8, torch.compile(fp8, dynamic=False)), (plain, torch.compile(plain, dynamic=False))]
        for layer, compiled in layers:
            run(layer, compiled, WARMUP)
        times: list[list[float]] = [[], []]
        for _ in range(WINDOWS):
            for (layer, compiled), out in zip(layers, times):
                out.append(seconds(functools.partial(run, layer, compiled, CALLS)) / CALLS)
    del layers, fp8, plain, x, grad
    if cuda:
        torch.cuda.empty_cache()  # hand the measuring buffers back before the model trains
    return Timing(fp8_s=statistics.median(times[0]), bf16_s=statistics.median(times[1]))


def cache_key(device_name: str, recipe: str, shape: LinearShape) -> str:
    """What a timing depends on: the GPU, the torch and torchao builds, the recipe and the shape."""
    return f"{device_name} | torch {torch.__version__} | torchao {torchao.__version__} | {recipe} | {shape}"


def default_cache_path() -> Path:
    """`$NANOCHAT_CACHE/fp8_speed.json`: the trainer's cache directory (default `.cache`)."""
    return cache_root() / "fp8_speed.json"


def _parse(data: object) -> dict[str, Timing]:
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
        raise ValueError(f'no "format": "{CACHE_FORMAT}" in it')
    entries = data.get("timings")
    if not isinstance(entries, dict):
        raise ValueError('its "timings" is not an object')
    timings = {}
    for key, t in entries.items():
        values = [t.get(f) for f in ("fp8_s", "bf16_s")] if isinstance(t, dict) else [None]
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values):
            raise ValueError(f"the timing of {key!r} is not two positive numbers of seconds")
        timings[key] = Timing(*map(float, values))
    return timings


class SpeedCache:
    """The timings stored at `path`, by `cache_key`; see the module docstring."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.timings: dict[str, Timing] = {}
        self.writable = True
        """False when the file at `path` is not a cache of ours: it is then never overwritten."""
        try:  # O_NONBLOCK: opening a FIFO for reading would wait for a writer
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return
        except OSError as e:
            self._ignore(f"it cannot be read ({e.strerror})")
            return
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                self._ignore("it is not a regular file")
                return
            try:
                data = f.read()
            except OSError as e:
                self._ignore(f"it cannot be read ({e.strerror})")
                return
        try:
            self.timings = _parse(json.loads(data.decode("utf-8")))
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            self._ignore(f"it is not a nanochat FP8 speed cache: {e}")

    def _ignore(self, why: str) -> None:
        self.writable = False
        logger.warning("WARNING: fp8 speed cache %s ignored and left as it is (%s); this run's layer timings "
                       "are not cached: move the file away to cache them", self.path, why)

    def get(self, key: str) -> Timing | None:
        return self.timings.get(key)

    def put(self, key: str, timing: Timing) -> None:
        self.timings[key] = timing
        if not self.writable:
            return
        data = {"format": CACHE_FORMAT,
                "timings": {k: {"fp8_s": t.fp8_s, "bf16_s": t.bf16_s} for k, t in sorted(self.timings.items())}}
        try:
            write_atomic(self.path, json.dumps(data, indent=1) + "\n")
        except OSError as e:
            self.writable = False
            logger.warning("WARNING: fp8 speed cache %s cannot be written (%s); this run's layer timings are "
                           "not cached", self.path, e.strerror or e)


__all__ = ["CACHE_FORMAT", "LinearShape", "Measure", "SpeedCache", "Timing", "cache_key", "cuda_seconds",
           "default_cache_path", "time_fwd_bwd"]
