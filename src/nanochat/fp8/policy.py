"""Which nn.Linear layers convert to FP8, and why: the default filter of `convert`.

The first rule that applies is the layer's reason in the conversion report:
  1. its full name matches a `skip_fqns` pattern (default lm_head: the most precision-sensitive
     matmul);
  2. it is an nn.Linear subclass (its owner may use the weight without calling forward);
  3. a dimension is not a multiple of 16 (`torch._scaled_mm` requires it), or of 32 with an
     MXFP8 recipe (one e8m0 scale per block of 32 along each GEMM's inner dimension, and both
     dims are an inner dimension of one of the three GEMMs);
  4. min(in, out) < `min_dim`;
  5. the device has no FP8 (fallback);
  6. `converted_layers` when given (a resumed run converts what the run it continues did), else
     `layers`: all converts the rest; faster converts a layer only where FP8 is faster than
     bf16 at this run's shapes. With native FP8 kernels that is measured (speed.py: timed once
     per shape, cached on disk) and FP8 must be at least MARGIN faster. Elsewhere (emulated,
     `micro_batch_tokens` unknown, a measurement that failed) torchao's `_auto_filter_for_recipe`
     decides: its thresholds come from H100 tables, so an emulated run converts the layers an
     H100 most likely would. torchao has no rule for MXFP8: tensorwise's stands in (MX_RULE).
A caller's own `module_filter_fn(module, fqn) -> bool` (torchao's signature) replaces rules 1, 4
and 6; rules 2, 3 and 5 are what the kernels can run. Under torch.distributed rank 0 times (or
reads the cache) and every rank takes its figures, so all ranks convert the same layers.
"""

from __future__ import annotations

import fnmatch
import time
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from nanochat.fp8 import _torchao  # noqa: F401  (first: torchao imported with its log noise muted)
from torchao.float8.config import Float8LinearConfig
from torchao.float8.float8_linear_utils import _auto_filter_for_recipe
from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig

from nanochat.common import warn_once
from nanochat.config.fp8 import MX_BLOCK, MX_RECIPES, FP8Config
from nanochat.fp8.hardware import FP8Backend
from nanochat.fp8.speed import LinearShape, Measure, SpeedCache, Timing, cache_key, default_cache_path, time_fwd_bwd

MARGIN = 1.03
"""`layers` faster converts a layer whose fwd+bwd FP8 runs at least this much faster than bf16.
A policy, not a measurement: a gain under 3% is within what a whole model's fusions and
scheduling can take back, and not worth FP8's rounding."""

MX_RULE = "tensorwise"
"""The torchao rule `layers` faster takes for the MXFP8 recipes where it cannot time them: torchao
has none for MX (no `_auto_filter_for_recipe` entry, no per-shape MX table). Its B200 Llama-3-8B
runs (torchao's mx_formats README: mxfp8 +16-20% tokens/s, tensorwise +25%, rowwise +4% over
bf16) put MXFP8 next to tensorwise, not rowwise, so tensorwise's H100 thresholds are the
estimate; on sm_100 each shape is timed instead."""

ModuleFilter = Callable[[nn.Module, str], bool]


class Decision(NamedTuple):
    convert: bool
    reason: str
    """Why: the rule that skipped the layer, or `layers`' (or the caller's filter's) verdict."""
    final_rule: bool
    """Decided by the last rule (`layers` or the caller's filter), not by rules 1-5."""


def torchao_rule(recipe: str, module: nn.Linear) -> tuple[bool, str]:
    """torchao's `_auto_filter_for_recipe` verdict for `module`, and the rule's name. torchao has
    no rule for rowwise_with_gw_hp; its two FP8 GEMMs are rowwise's, so rowwise's applies. Nor for
    MXFP8: MX_RULE's applies."""
    rule = "rowwise" if recipe == "rowwise_with_gw_hp" else MX_RULE if recipe in MX_RECIPES else recipe
    name = f"torchao's {rule} rule" + ("" if rule == recipe else f" (it has none for {recipe})")
    return _auto_filter_for_recipe(rule, filter_fqns=[])(module, ""), name


def _verdict(convert: bool) -> str:
    return "converted" if convert else "kept in bf16"


class LayerPolicy:
    """Decides what `convert` does with each nn.Linear (see the module docstring). Callable as a
    torchao `module_filter_fn(module, fqn)`. `measure` replaces the GPU timer (speed.time_fwd_bwd)
    and is then used on any backend (timings taken elsewhere; tests)."""

    def __init__(self, config: FP8Config, hw: FP8Backend, lin_config: Float8LinearConfig | MXFP8TrainingOpConfig,
                 *, device: torch.device, measure: Measure | None = None, module_filter_fn: ModuleFilter | None = None):
        self.config, self.hw, self.lin_config, self.device = config, hw, lin_config, torch.device(device)
        self.module_filter_fn = module_filter_fn
        self.measure = measure if measure is not None else time_fwd_bwd if hw.backend == "native" else None
        self.measure_time_s = 0.0
        """Wall time spent timing layers (and waiting for rank 0's timings); cache hits cost ~0."""
        self.shapes_measured = self.shapes_cached = 0
        self.fallback: str | None = None
        """Why `layers` faster could not measure and torchao's rule decided instead (logged once)."""
        self._timings: dict[LinearShape, tuple[Timing | None, bool]] = {}
        self._cache: SpeedCache | None = None

    def __call__(self, module: nn.Module, fqn: str) -> bool:
        return self.decide(fqn, module).convert

    def decide(self, name: str, module: nn.Module) -> Decision:
        c, own_filter = self.config, self.module_filter_fn
        if own_filter is None:
            for pattern in c.skip_fqns:
                if fnmatch.fnmatchcase(name, pattern):
                    return Decision(False, f"name matches `skip_fqns` {pattern!r}", False)
        if type(module) is not nn.Linear:
            return Decision(False, f"{type(module).__name__} is an nn.Linear subclass (its owner may use the "
                                   "weight without calling forward); only plain nn.Linear converts", False)
        k, n = module.in_features, module.out_features
        if k % 16 or n % 16:
            return Decision(False, f"{k}->{n}: FP8 GEMMs need both dims divisible by 16 (torch._scaled_mm)", False)
        if c.recipe in MX_RECIPES and (k % MX_BLOCK or n % MX_BLOCK):
            return Decision(False, f"{k}->{n}: MXFP8 needs both dims divisible by {MX_BLOCK} (one e8m0 scale per "
                                   f"block of {MX_BLOCK} along each GEMM's inner dim)", False)
        if own_filter is None and min(k, n) < c.min_dim:
            return Decision(False, f"min(in, out) = {min(k, n)} < `min_dim` {c.min_dim}: casts cost more than "
                                   "FP8 saves", False)
        if self.hw.backend == "fallback":
            return Decision(False, f"no FP8 hardware: {self.hw.device_name} (see `emulate`)", False)
        if c.converted_layers is not None:  # the layer set of the run this one continues
            convert = name in c.converted_layers
            return Decision(convert, f"`converted_layers` (the run this one continues): {_verdict(convert)}", True)
        if own_filter is not None:
            convert = bool(own_filter(module, name))
            return Decision(convert, f"module_filter_fn returned {convert}", True)
        if c.layers == "all":
            return Decision(True, "`layers` all", True)
        return Decision(*self._faster(module), True)

    def _faster(self, module: nn.Linear) -> tuple[bool, str]:
        def rule(why_not_timed: str) -> tuple[bool, str]:
            convert, name = torchao_rule(self.config.recipe, module)
            return convert, (f"{name} from H100 tables, not timed ({why_not_timed}): "
                             f"K={module.in_features}, N={module.out_features}: {_verdict(convert)}")

        if self.measure is None:
            return rule(f"FP8 is {self.hw.backend} here")
        m = self.config.micro_batch_tokens
        if m is None:
            self._fall_back("`micro_batch_tokens` (the tokens per forward pass the layers are timed at) is not set")
            return rule("`micro_batch_tokens` not set")
        timing, cached = self._timing(LinearShape(m, module.in_features, module.out_features))
        if timing is None:
            return rule("timing failed")
        convert = timing.speedup >= MARGIN
        return convert, (f"fwd+bwd {timing.speedup:.2f}x bf16 at M={m} ({'cached' if cached else 'measured'}): "
                         + (_verdict(convert) if convert else f"kept in bf16 (FP8 must be >= {MARGIN:.2f}x)"))

    def _timing(self, shape: LinearShape) -> tuple[Timing | None, bool]:
        """(timing or None when timing failed, whether it came from the cache), once per shape."""
        if shape in self._timings:
            return self._timings[shape]
        start = time.perf_counter()
        result: list = [None, False, None]  # timing, cached, error: what rank 0 sends every rank
        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
            self._cache = self._cache or SpeedCache(default_cache_path())
            key = cache_key(self.hw.device_name, self.config.recipe, shape)
            timing = self._cache.get(key)
            result = [timing, timing is not None, None]
            if timing is None:
                try:
                    result[0] = self.measure(shape, self.lin_config, self.device)
                    self._cache.put(key, result[0])
                # measuring is an optimization: whatever stops it (a compiler error, no memory),
                # the run goes on with torchao's rule and records why
                except Exception as e:  # noqa: BLE001
                    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
                    result = [None, False, f"{type(e).__name__}: {first}"]
        if dist.is_available() and dist.is_initialized():
            dist.broadcast_object_list(result, src=0, device=self.device if self.device.type == "cuda" else None)
        timing, cached, error = result
        self.measure_time_s += time.perf_counter() - start
        if error is not None:
            self._fall_back(f"timing {shape} failed ({error})")
        elif cached:
            self.shapes_cached += 1
        else:
            self.shapes_measured += 1
        self._timings[shape] = (timing, cached)
        return timing, cached

    def _fall_back(self, why: str) -> None:
        if self.fallback is None:
            self.fallback = (f"fp8: `layers` faster could not time the layers on {self.hw.device_name}: {why}; "
                             "torchao's rule for the recipe (H100 tables) decided instead")
            warn_once(f"fp8-layers:{why}", self.fallback)


__all__ = ["MARGIN", "Decision", "LayerPolicy", "ModuleFilter", "torchao_rule"]
