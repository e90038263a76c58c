"""FP8 statistics per layer and tensor role: amax, scale, underflow, saturation, SQNR.

What a cast to FP8 does to a tensor x, with torchao's dynamic scaling (float8_utils.py):

    scale  = max_fmt / amax(x)            per tensor, or per row/column for rowwise recipes
    x_fp8  = cast(clamp(x * scale, -max_fmt, max_fmt))   round to nearest even
    x_back = x_fp8 / scale                what the GEMM effectively multiplies

What can go wrong is what this file counts: underflow (a non-zero x that becomes 0; % of the
non-zero elements), saturation (|x * scale| > max_fmt before the clamp, ~0 with dynamic scaling
unless a scale is stale; % of all elements) and SQNR (torchao's `compute_error`, in dB; it weighs
errors by energy and barely notices underflow, hence both). A role's figures aggregate every cast
the layer's config makes of it, each with its own scaling axis. For MXFP8 layers the cast is
torchao's own (`MXTensor.to_mx`, the layer's e8m0 scale rule, blocks of 32 along each axis) and
the figures count its codes: underflow and SQNR under block scales, saturation before its clamp
(0 by construction of RCEIL's scale unless a block holds an inf), scale the smallest block's.

`FP8StatsSampler` collects them on the real tensors of a training step: hooks installed while the
`with` block runs (forward *and* backward inside it) and removed on exit, so a step not sampled
pays nothing. Run the sampled step uncompiled: hooks that come and go would make a compiled
module recompile. `first_nonfinite_layer` names where an inf/nan appeared. The thresholds,
margins and aggregation in full: docs/fp8.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn as nn
from nanochat.fp8 import _torchao  # noqa: F401  (first: torchao imported with its log noise muted)
from torchao.float8.config import ScalingGranularity, ScalingType
from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
from torchao.prototype.mx_formats.mx_tensor import MXTensor
from torchao.quantization.quantize_.common import KernelPreference

from nanochat.common import format_table
from nanochat.config.fp8 import MX_BLOCK
from nanochat.device import host_read
from nanochat.fp8.layers import FP8_LAYER_TYPES, autocast_operand
from nanochat.fp8.conversion import CAST_FIELDS, DTYPE_NAMES, FP8_DTYPES, ROLES, layer_dtypes

EPS = 1e-12  # torchao's amax floor (float8_utils.EPS)
SATURATION_MARGIN = 2.0**-20


def cast_axes(config, role: str) -> list[tuple[int | None, bool]]:
    """(axis of the amax reduction or None for one scale, round scale to power of 2) for every
    FP8 cast `config` makes of `role`, with the role's tensor in its natural 2D layout:
    input [tokens, in], weight [out, in], grad_output [tokens, out]. torchao reduces over the last
    dim for the first GEMM a role feeds and over the first dim for the second (float8_linear.py)."""
    out = []
    for cast_name, axis in zip(CAST_FIELDS[role], (-1, 0)):
        cast = getattr(config, cast_name)
        if cast.scaling_type is ScalingType.DISABLED:
            continue
        rowwise = cast.scaling_granularity is ScalingGranularity.AXISWISE
        out.append((axis if rowwise else None, config.round_scales_to_power_of_2))
    return out


def mx_cast_axes(layer: MXFP8Linear, role: str) -> tuple[int, ...]:
    """The block axes of every cast an MXFP8 layer makes of `role` (natural 2D layouts as in
    `cast_axes`): along the last dim for the GEMM a role feeds first, along the first dim for the
    second (torchao's mx_mm: dim0 and dim1 casts); `wgrad_with_hp` drops the weight-gradient GEMM's."""
    if role != "weight" and layer.wgrad_with_hp:
        return (-1,)
    return (-1, 0)


@dataclass
class CastCounts:
    """Running sums for one role in one format; merge several casts and steps by adding.

    `add` never reads the device: its sums stay in one small device tensor until a reader (a
    property, `CastStats.of`, `flush_counts` for many at once) copies them to the host, so a
    sampled step costs one device-to-host read for all its layers, not several per cast."""

    numel: int = 0
    nonzero: int = 0
    underflow: int = 0
    saturated: int = 0
    signal: float = 0.0
    noise: float = 0.0
    amax: float = 0.0
    scale: float = math.inf
    """The scale applied to the largest element (tensorwise scale; smallest row scale)."""
    _pending: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """float64 [nonzero, underflow, saturated, signal, noise, amax, scale] not yet on the host."""

    def add(self, x: torch.Tensor, dtype: torch.dtype, *, axis: int | None = None,
            round_pow2: bool = False, scale: torch.Tensor | float | None = None) -> "CastCounts":
        """Simulate the cast of x (float) to `dtype` the way torchao does it, and count."""
        x = x.detach().float()
        fmax = torch.finfo(dtype).max
        if scale is None:
            amax = x.abs().amax() if axis is None else x.abs().amax(dim=axis, keepdim=True)
            scale = (fmax / amax.double().clamp(min=EPS)).float()
            if round_pow2:
                scale = torch.exp2(torch.floor(torch.log2(scale)))
        scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
        scaled = x * scale
        back = scaled.clamp(-fmax, fmax).to(dtype).float() / scale
        return self._count(x, scaled, back, scale, fmax)

    def add_mx(self, x: torch.Tensor, *, axis: int, scaling_mode) -> "CastCounts":
        """torchao's MXFP8 cast of the 2D tensor x (e4m3, one e8m0 scale per MX_BLOCK values along
        `axis`, `scaling_mode` torchao's scale rule), and count. Its codes and scales are torchao's
        (MXTensor.to_mx, the emulated kernel, which torchao's GPU kernels match bit for bit)."""
        x = x.detach().float()
        t = (x if axis == -1 else x.t()).contiguous()
        mx = MXTensor.to_mx(t, torch.float8_e4m3fn, MX_BLOCK, scaling_mode, KernelPreference.EMULATED)
        descale = mx.scale.float().unsqueeze(-1)  # [rows, blocks, 1]: 2^e, what a block's codes multiply
        scaled = t.view(*descale.shape[:-1], MX_BLOCK) / descale  # before torchao's clamp
        return self._count(t, scaled, mx.dequantize(torch.float32), 1 / descale, torch.finfo(torch.float8_e4m3fn).max)

    def _count(self, x: torch.Tensor, scaled: torch.Tensor, back: torch.Tensor, scale: torch.Tensor,
               fmax: float) -> "CastCounts":
        """Add one cast: x (float), x times its scale before the clamp, x as the GEMM sees it, the scales."""
        nonzero = x != 0
        self.numel += x.numel()
        f64 = torch.float64
        new = torch.stack([
            nonzero.sum(dtype=f64),
            (nonzero & (back.view_as(x) == 0)).sum(dtype=f64),  # -0 == 0 is True
            (scaled.abs() > fmax * (1 + SATURATION_MARGIN)).sum(dtype=f64),
            (x * x).sum(dtype=f64),  # fp32 squares, summed in fp64: no fp64 copy of x
            (x - back.view_as(x)).square().sum(dtype=f64),
            x.abs().amax().double() if x.numel() else x.new_zeros((), dtype=f64),
            scale.min().double(),
        ])
        if self._pending is None:
            self._pending = new
        else:
            old = self._pending
            self._pending = torch.cat([old[:5] + new[:5], torch.maximum(old[5:6], new[5:6]),
                                       torch.minimum(old[6:], new[6:])])
        return self

    def flush(self) -> "CastCounts":
        flush_counts([self])
        return self

    @property
    def sqnr_db(self) -> float:
        self.flush()
        if self.noise == 0:
            return math.inf
        return 10 * math.log10(self.signal / self.noise) if self.signal > 0 else -math.inf

    @property
    def underflow_pct(self) -> float:
        self.flush()
        return 100.0 * self.underflow / self.nonzero if self.nonzero else 0.0

    @property
    def saturation_pct(self) -> float:
        self.flush()
        return 100.0 * self.saturated / self.numel if self.numel else 0.0


def flush_counts(counts) -> None:
    """Bring the device-side sums of many CastCounts to the host in one read per device."""
    todo = [c for c in counts if c._pending is not None]
    by_device: dict[torch.device, list[CastCounts]] = {}
    for c in todo:
        by_device.setdefault(c._pending.device, []).append(c)
    for group in by_device.values():
        rows = host_read(torch.stack([c._pending for c in group]))
        for c, (nz, uf, sat, sig, noise, amax, scale) in zip(group, rows):
            c.nonzero += int(nz)
            c.underflow += int(uf)
            c.saturated += int(sat)
            c.signal += sig
            c.noise += noise
            c.amax = max(c.amax, amax)
            c.scale = min(c.scale, scale)
            c._pending = None


@dataclass(frozen=True)
class CastStats:
    """One layer, one role, in the format that layer casts it to."""

    dtype: str
    amax: float
    scale: float
    underflow_pct: float
    saturation_pct: float
    sqnr_db: float
    numel: int

    @classmethod
    def of(cls, dtype: str, c: CastCounts) -> "CastStats":
        c.flush()
        return cls(dtype, c.amax, c.scale, c.underflow_pct, c.saturation_pct, c.sqnr_db, c.numel)

    def as_dict(self) -> dict:
        return asdict(self)


def tensor_stats(x: torch.Tensor, dtype: str | torch.dtype, *, axis: int | None = None,
                 round_pow2: bool = False, scale: torch.Tensor | float | None = None) -> CastStats:
    """Statistics of one cast of `x` (dynamic amax scale unless `scale` is given)."""
    dtype = FP8_DTYPES[dtype] if isinstance(dtype, str) else dtype
    counts = CastCounts().add(x, dtype, axis=axis, round_pow2=round_pow2, scale=scale)
    return CastStats.of(DTYPE_NAMES[dtype], counts)


def role_counts(layer: nn.Module, role: str, x: torch.Tensor, dtype: torch.dtype,
                counts: CastCounts | None = None) -> CastCounts:
    """Add every FP8 cast `layer` makes of `role` (tensor `x`), in format `dtype`, to `counts`."""
    counts = counts if counts is not None else CastCounts()
    x2d = x.reshape(-1, x.shape[-1])
    if isinstance(layer, MXFP8Linear):
        if dtype != torch.float8_e4m3fn:
            raise ValueError(f"MXFP8 layers cast to e4m3 only, not {DTYPE_NAMES[dtype]}")
        x2d = autocast_operand(x2d)  # MXLinear casts its input and weight to the autocast dtype first
        for axis in mx_cast_axes(layer, role):
            counts.add_mx(x2d, axis=axis, scaling_mode=layer.scale_calculation_mode)
        return counts
    for axis, pow2 in cast_axes(layer.config, role):
        counts.add(x2d, dtype, axis=axis, round_pow2=pow2)
    return counts


def _as_torchao_sees_it(x: torch.Tensor) -> torch.Tensor:
    # Float8Linear casts its input to the CUDA autocast dtype before quantizing it.
    if torch.is_autocast_enabled("cuda"):
        return x.to(torch.get_autocast_dtype("cuda"))
    return x


def _layers_of(model_or_layers: nn.Module | dict[str, nn.Module]) -> dict[str, nn.Module]:
    if isinstance(model_or_layers, dict):
        return {n: m for n, m in model_or_layers.items() if isinstance(m, FP8_LAYER_TYPES)}
    return {n: m for n, m in model_or_layers.named_modules() if isinstance(m, FP8_LAYER_TYPES)}


class RoleHooks:
    """Calls `record(name, layer, role, tensor)` with each FP8 layer's input and weight (forward)
    and grad_output (backward, through a hook on the output tensor). Shared with auto.py."""

    def __init__(self, layers: dict[str, nn.Module], record: Callable, roles=ROLES):
        self.handles = []
        for name, layer in layers.items():
            self.handles.append(layer.register_forward_hook(self._forward_hook(name, record, set(roles))))

    @staticmethod
    def _forward_hook(name, record, roles):
        def hook(layer, args, output):
            if not getattr(layer, "fp8_enabled", True):
                return  # running in high precision (fp8_disabled): nothing is cast
            with torch.no_grad():
                if "input" in roles and args:  # (an input passed by keyword is not seen)
                    record(name, layer, "input", _as_torchao_sees_it(args[0]))
                if "weight" in roles:
                    record(name, layer, "weight", layer.weight)
            if "grad_output" in roles and output.requires_grad:
                def grad_hook(grad):
                    with torch.no_grad():
                        record(name, layer, "grad_output", grad)
                output.register_hook(grad_hook)
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


_SUM_FIELDS = ("numel", "nonzero", "underflow", "saturated", "signal", "noise")


def all_reduce_counts(tree: dict[str, dict[str, dict[str, CastCounts]]]) -> None:
    """Merge, in place, every rank's counts `{layer: {role: {fmt: CastCounts}}}` into the counts
    of the whole global batch (sums; amax the max; scale the min), so that decisions taken from
    them (auto's format choice) are the same on every rank. A no-op outside torch.distributed.

    Every rank must hold the same keys (the same model, every layer run): that is checked, since
    a mismatch would silently add one layer's counts to another's."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    keys = sorted((n, r, f) for n, roles in tree.items() for r, fmts in roles.items() for f in fmts)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, keys)  # a few hundred short strings, once per sample
    if any(k != keys for k in gathered):
        raise RuntimeError("FP8 statistics differ in layers/roles between ranks: every rank must run "
                           "the same model and the same FP8 layers during a sampled step")
    counts = [tree[n][r][f] for n, r, f in keys]
    flush_counts(counts)
    # NCCL reduces CUDA tensors only (on this rank's device); gloo CPU ones
    backend_device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    # float64 holds integer counts exactly up to 2^53
    sums = torch.tensor([[getattr(c, k) for k in _SUM_FIELDS] for c in counts], dtype=torch.float64,
                        device=backend_device)
    amax = torch.tensor([c.amax for c in counts], dtype=torch.float64, device=backend_device)
    scale = torch.tensor([c.scale for c in counts], dtype=torch.float64, device=backend_device)
    dist.all_reduce(sums)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    dist.all_reduce(scale, op=dist.ReduceOp.MIN)
    for c, row, a, sc in zip(counts, sums.tolist(), amax.tolist(), scale.tolist()):
        for k, v in zip(_SUM_FIELDS, row):
            setattr(c, k, int(v) if k not in ("signal", "noise") else v)
        c.amax, c.scale = a, sc


class FP8StatsSampler:
    """`with FP8StatsSampler(model) as s: loss = model(x); loss.backward()` then `s.results()`.

    Accumulates over every forward/backward inside the block (e.g. all micro-batches of a step).
    With `both_formats=True` it also measures the format each role is *not* cast to
    (`format_counts()`), which auto's re-check compares (twice the cost of a sample).
    """

    def __init__(self, model_or_layers: nn.Module | dict[str, nn.Module], roles=ROLES, *,
                 both_formats: bool = False):
        self.layers = _layers_of(model_or_layers)
        self.roles = tuple(roles)
        self.both_formats = both_formats
        mx = [n for n, m in self.layers.items() if isinstance(m, MXFP8Linear)]
        if both_formats and mx:
            raise ValueError(f"both_formats measures e4m3 and e5m2, but MXFP8 layers (e.g. {mx[0]}) cast to e4m3 "
                             "only: sample them with both_formats=False")
        self.counts: dict[str, dict[str, tuple[str, CastCounts]]] = {}
        self.by_format: dict[str, dict[str, dict[str, CastCounts]]] = {}
        self._hooks: RoleHooks | None = None

    def _record(self, name, layer, role, x):
        dtype = FP8_DTYPES[layer_dtypes(layer)[role]]
        slot = self.counts.setdefault(name, {})
        if not self.both_formats:
            if role not in slot:
                slot[role] = (DTYPE_NAMES[dtype], CastCounts())
            role_counts(layer, role, x, dtype, slot[role][1])
            return
        fmts = self.by_format.setdefault(name, {}).setdefault(role, {d: CastCounts() for d in FP8_DTYPES})
        for dname, dt in FP8_DTYPES.items():
            role_counts(layer, role, x, dt, fmts[dname])
        slot[role] = (DTYPE_NAMES[dtype], fmts[DTYPE_NAMES[dtype]])  # the cast it really makes

    def format_counts(self) -> dict[str, dict[str, dict[str, CastCounts]]]:
        """layer -> role -> {"e4m3": counts, "e5m2": counts} (needs `both_formats=True`)."""
        if not self.both_formats:
            raise RuntimeError("format_counts() needs FP8StatsSampler(..., both_formats=True)")
        self.flush()
        return self.by_format

    def flush(self) -> None:
        """Copy every layer's device-side sums to the host: one read for the whole sample."""
        flush_counts([c for roles in self.counts.values() for _, c in roles.values()]
                     + [c for roles in self.by_format.values() for fmts in roles.values() for c in fmts.values()])

    def all_reduce(self) -> None:
        """Merge every rank's counts (see `all_reduce_counts`); call after the sampled step."""
        if self.both_formats:
            all_reduce_counts(self.by_format)  # self.counts shares these objects
        else:
            all_reduce_counts({n: {r: {dt: c} for r, (dt, c) in roles.items()} for n, roles in self.counts.items()})

    def __enter__(self) -> "FP8StatsSampler":
        self._hooks = RoleHooks(self.layers, self._record, self.roles)
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.remove()

    def results(self) -> dict[str, dict[str, CastStats]]:
        """layer -> role -> CastStats, in forward order of first appearance."""
        self.flush()
        return {name: {role: CastStats.of(dt, c) for role, (dt, c) in roles.items()}
                for name, roles in self.counts.items()}

    def as_dict(self) -> dict[str, dict[str, dict]]:
        """Plain dict (JSON / weights_only safe) for metrics and TrainResult.fp8_stats."""
        return {n: {r: s.as_dict() for r, s in roles.items()} for n, roles in self.results().items()}

    def table(self) -> str:
        rows = [[name, role, s.dtype, f"{s.amax:.3g}", f"{s.scale:.3g}", f"{s.underflow_pct:.2f}",
                 f"{s.saturation_pct:.2f}", f"{s.sqnr_db:.1f}"]
                for name, roles in self.results().items() for role, s in roles.items()]
        return format_table(["layer", "role", "fmt", "amax", "scale", "underflow %", "saturated %",
                             "SQNR dB"], rows)


def collect_fp8_stats(model_or_layers: nn.Module | dict[str, nn.Module], roles=ROLES, *,
                      both_formats: bool = False) -> FP8StatsSampler:
    """The sampler for one step (the trainer decides which steps): use it as a context manager."""
    return FP8StatsSampler(model_or_layers, roles, both_formats=both_formats)


def _nonfinite(t: torch.Tensor) -> str | None:
    bad = ~torch.isfinite(t)
    if not bool(bad.any()):
        return None
    n_nan = int(torch.isnan(t).sum())
    return f"{int(bad.sum()) - n_nan} inf, {n_nan} nan of {t.numel()}"


def first_nonfinite_layer(model: nn.Module, run: Callable[[], object] | None = None) -> str | None:
    """Name where an inf/nan appeared, or None.

    With `run` (a no-argument callable doing a forward pass, e.g. `lambda: model(x, y)`): run it
    without grad, hooks on every module, and return the first module, in execution order, whose
    output is non-finite -- where the inf was born (modules after it inherit it).

    Without `run`: inspect the gradients left by the last backward. Backward runs in reverse, so
    the layer where a non-finite gradient was born is the *last* one, in forward order, whose
    parameters' grads are non-finite (every layer before it inherits it). Module registration
    order stands in for forward order (true for nanochat's GPT and for nn.Sequential).
    """
    if run is not None:
        found: list[str] = []

        def make_hook(name):
            def hook(module, args, output):
                if not found and isinstance(output, torch.Tensor) and output.is_floating_point():
                    what = _nonfinite(output)
                    if what:
                        found.append(f"{name or type(module).__name__}: output has {what}")
            return hook

        handles = [m.register_forward_hook(make_hook(n)) for n, m in model.named_modules()]
        try:
            with torch.no_grad():
                run()
        finally:
            for h in handles:
                h.remove()
        return found[0] if found else None

    last = None
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            what = _nonfinite(p.grad) if p.grad is not None else None
            if what:
                last = f"{name}.{pname} grad has {what} (first non-finite gradient in backward order)"
    return last


__all__ = ["CastCounts", "CastStats", "FP8StatsSampler", "all_reduce_counts", "cast_axes", "collect_fp8_stats",
           "flush_counts", "first_nonfinite_layer", "mx_cast_axes", "role_counts", "tensor_stats"]
