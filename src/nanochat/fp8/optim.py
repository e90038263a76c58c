"""FP8Optim: Adam/AdamW/SGD-momentum with the moments stored in FP8, a format over nanochat.optim.

    opt = FP8Optim(torch.optim.AdamW(model.param_groups(0.1), lr=3e-4, fused=False), opt_level=2)
    ...loss.backward(); opt.step(); opt.zero_grad()   # schedulers, state_dict: as usual

    0  both moments fp32: the wrapped optimizer steps everything itself (it is the reference)
    1  first moment (Adam exp_avg, SGD momentum_buffer) in FP8 e4m3, second moment fp32
    2  both moments in FP8 (~2.03 bytes/param instead of 8)

Everything that is not FP8 is nanochat.optim's OptimWrapper (param_groups, bf16 master weights,
the step inside the backward, backends, state checks, bytes). This module is the moment format,
`E4M3Blocks` (a MomentFormat): which parameters it stores, the e4m3 read and write of a moment
inside the one step (FP8Tensor's quantizer), state conversion and its C kernel (kernel.py).

A parameter goes FP8 only with >= `min_numel` elements (MIN_NUMEL), a multiple of `block_size`
(256, tensor.py) of them, contiguous, and under FSDP2 a shard of whole blocks (decided on the
global shape, so all ranks agree). The others are stepped by the wrapped optimizer with torch's
math; a one-time summary says how many and why.

The second moment is stored as sqrt(v), a positive value never rounded to zero: plain e4m3 v
flushes small v to zero and the update becomes m / eps; sqrt halves the exponent range and the
floor turns "flushed" into "overestimated". Reasoning: docs/fp8.md; measurement: BENCHMARKS.md
§3(d). On CPU the FP8 step of fp32 Adam(W) parameters runs in the native C kernel, several times
faster than the compiled step (BENCHMARKS.md §3(b)); elsewhere compiled (nanochat.optim.backends).
"""

from __future__ import annotations

import torch

from nanochat.optim import MomentFormat, OptimWrapper
from nanochat.optim.state import DTensor, shard_problem
from nanochat.optim.step import AdamTensor

from . import kernel
from .kernel import KernelRow
from .tensor import DEFAULT_BLOCK_SIZE, Blocks, FP8Tensor, dequantize_blocks, quantize_blocks

E4M3 = torch.float8_e4m3fn
MIN_NUMEL = 4096  # bitsandbytes' and torchao's rule: below it the state is negligible, the per-call cost not


def _requantize(x: torch.Tensor, m: Blocks, *, floor: bool, ok: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, B] fp32 written into the stored blocks `m` (or a (codes, scale) pair) in place, by
    FP8Tensor's one quantizer;
    returns the new scale. ok: a 0-dim bool; False keeps the old codes and scale (a guarded step
    that is skipped)."""
    codes, scale = quantize_blocks(x, E4M3, floor=floor)
    stored_codes, stored_scale = m
    if ok is not None:
        codes, scale = torch.where(ok, codes, stored_codes), torch.where(ok, scale, stored_scale)
    stored_codes.copy_(codes)
    stored_scale.copy_(scale)
    return scale


def fp8_size_problem(numel: int, block_size: int = DEFAULT_BLOCK_SIZE, min_numel: int = MIN_NUMEL) -> str | None:
    """Why a tensor of `numel` elements keeps fp32 moments whatever its layout, or None."""
    if numel < min_numel:
        return f"numel < {min_numel}"
    if numel % block_size:
        return f"numel % {block_size} != 0"
    return None


class E4M3Blocks(MomentFormat):
    """Moments as FP8Tensors: e4m3 codes and one fp32 scale per block of `block_size` (absmax /
    448). Inside the step a moment is its `Blocks` view; the second moment is stored as sqrt(v),
    floored so a positive value never becomes 0.

    The returned tie, `0 * scale`, makes the parameter's write depend on the new per-block
    absmax, so inductor fuses it into the loop that writes the codes (one pass) instead of a
    third pass over p through a full-size temporary (BENCHMARKS.md §3(b), the implementation
    comparison)."""

    name = "FP8"

    def __init__(self, opt_level: int = 2, *, block_size: int = DEFAULT_BLOCK_SIZE, min_numel: int = MIN_NUMEL):
        if opt_level not in (0, 1, 2):
            raise ValueError(f"opt_level must be 0 (fp32 moments), 1 (first moment FP8) or 2 "
                             f"(both moments FP8); got {opt_level!r}")
        if block_size <= 0 or block_size % 8:
            raise ValueError(f"block_size must be a positive multiple of 8, got {block_size}")
        self.opt_level, self.block_size, self.min_numel = opt_level, block_size, max(min_numel, block_size)

    # ---- inside the step ------------------------------------------------------------------------
    @staticmethod
    def read(m: Blocks) -> torch.Tensor:
        return dequantize_blocks(m, E4M3)

    @staticmethod
    def write(m: Blocks, new: torch.Tensor, ok: torch.Tensor | None) -> torch.Tensor:
        return 0.0 * _requantize(new, m, floor=False, ok=ok)[:, None]

    @staticmethod
    def read_sq(v: Blocks) -> torch.Tensor:
        r = dequantize_blocks(v, E4M3)  # stored sqrt(v)
        return r * r

    @staticmethod
    def write_sq(v: Blocks, new: torch.Tensor, sqrt_new: torch.Tensor, ok: torch.Tensor | None) -> torch.Tensor:
        return 0.0 * _requantize(sqrt_new, v, floor=True, ok=ok)[:, None]

    # ---- which parameters ----------------------------------------------------------------------
    def _reason(self, p: torch.Tensor) -> str | None:
        """None if p's state goes FP8 at this level, else why it stays fp32."""
        if self.opt_level == 0:
            return "opt_level 0"
        size = fp8_size_problem(p.numel(), self.block_size, self.min_numel)
        if size:
            return size
        if isinstance(p, DTensor):  # FSDP: every rank's rows must be whole blocks too
            problem = shard_problem(p, self.block_size)
            if problem:
                return problem
        if not p.is_contiguous():
            return "not contiguous"
        if not p.is_floating_point():
            return "not floating point"
        return None

    def kept(self, p: torch.Tensor, group: dict, *, sgd: bool) -> str | None:
        if sgd and group["momentum"] == 0:
            return "SGD without momentum (no state)"
        return self._reason(p)

    def stores(self, p: torch.Tensor, group: dict, *, sgd: bool) -> int:
        if self.kept(p, group, sgd=sgd) is not None:
            return 0
        return min(self.opt_level, 1 if sgd else 2)  # SGD keeps one moment, Adam two

    def fallback_note(self, tensors: int, numel: int, reason: str) -> str | None:
        if not self.opt_level:
            return None
        return f"`opt_level` {self.opt_level}: {tensors} tensors / {numel:,} params keep fp32 moments ({reason})"

    def describe(self) -> str:
        return f"opt_level={self.opt_level}, block_size={self.block_size}"

    # ---- state ---------------------------------------------------------------------------------
    def zeros(self, shape: torch.Size, device: torch.device) -> FP8Tensor:
        return FP8Tensor.zeros(shape, dtype=E4M3, block_size=self.block_size, device=device)

    def view(self, x: FP8Tensor) -> Blocks:
        return x.blocks()

    def is_stored(self, x: torch.Tensor) -> bool:
        return isinstance(x, FP8Tensor) and x.block_size == self.block_size and x.fp8_dtype == E4M3

    def quantize(self, x: torch.Tensor) -> FP8Tensor:
        if self.is_stored(x):
            return x
        x = x.dequantize() if isinstance(x, FP8Tensor) else x
        return FP8Tensor.from_float(x.float(), dtype=E4M3, block_size=self.block_size)

    def quantize_sqrt(self, v: torch.Tensor) -> FP8Tensor:
        return quantize_sqrt_v(v, self.block_size)

    # ---- the native CPU kernel -------------------------------------------------------------------
    def native_ok(self, t: AdamTensor, *, master: str, emulate: bool) -> bool:
        dtype = torch.float32 if master == "fp32" else torch.bfloat16
        return (not emulate and t.p.device.type == "cpu" and t.p.dtype == dtype and t.g.dtype == dtype
                and self.block_size <= 1024)

    def native_step(self, items: list[AdamTensor], *, master: str) -> None:
        table = kernel.adam_table([t.step for t in items], [t.group for t in items])
        kernel.adam([_kernel_row(t) for t in items], table, self.block_size, items[0].decoupled,
                    items[0].v_format is E4M3Blocks, master=master, salts=[t.salt for t in items],
                    oks=[t.ok for t in items])


def quantize_sqrt_v(v: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE) -> FP8Tensor:
    """fp32 second moment v -> FP8Tensor of sqrt(v), positive values never flushed to zero: the
    step's own write, so a converted state is stored as a stepped one would be."""
    out = FP8Tensor.zeros(v.shape, dtype=E4M3, block_size=block_size, device=v.device)
    _requantize(v.detach().float().clamp(min=0).sqrt().reshape(-1, block_size), out.blocks(), floor=True)
    return out


def _kernel_row(t: AdamTensor) -> KernelRow:
    """An FP8-state tensor's buffers in the native kernel's order (kernel.py)."""
    v32, v_codes, v_scale = (None, *t.v) if t.v_format is E4M3Blocks else (t.v[0], None, None)
    return KernelRow(t.p, t.g, *t.m, v32, v_codes, v_scale, t.lo)


class FP8Optim(OptimWrapper):
    """Takes over the step of a torch AdamW/Adam/SGD and keeps its moments in FP8: OptimWrapper
    with the E4M3Blocks format.

    Args:
        optimizer: a constructed torch.optim.AdamW, Adam or SGD (its param_groups are shared).
        opt_level: 0 fp32 moments; 1 first moment FP8; 2 both moments FP8 (SGD: 1 and 2 agree).
        block_size: elements per scale (256: see tensor.py for the bytes/param arithmetic).
        min_numel: parameters with fewer elements keep fp32 state.
        compile, backend, master_weights, seed, emulate: nanochat.optim.OptimWrapper's. backend
            "auto" runs the native C kernel for fp32 Adam(W) parameters on CPU, torch.compile
            otherwise (a backend that cannot run falls back to the next, logged once).
    """

    moments: E4M3Blocks

    def __init__(self, optimizer: torch.optim.Optimizer, opt_level: int = 2, *,
                 block_size: int = DEFAULT_BLOCK_SIZE, min_numel: int = MIN_NUMEL,
                 compile: bool = True, backend: str = "auto", master_weights: str = "fp32",
                 seed: int = 0, emulate: bool = False) -> None:
        super().__init__(optimizer, moments=E4M3Blocks(opt_level, block_size=block_size, min_numel=min_numel),
                         compile=compile, backend=backend, master_weights=master_weights, seed=seed, emulate=emulate)

    @property
    def opt_level(self) -> int:
        return self.moments.opt_level

    @property
    def block_size(self) -> int:
        return self.moments.block_size


__all__ = ["E4M3Blocks", "FP8Optim", "MIN_NUMEL", "fp8_size_problem", "quantize_sqrt_v"]
