"""bf16 master weights: how an fp32 update is written into a bf16 parameter.

Stored in bf16 a parameter and its gradient cost 2 bytes each instead of 4, but a weight w only
moves when its update exceeds half a bf16 step, |w| * 2^-9: small updates are lost under round
to nearest (docs/master_weights.md). The choices (`--master_weights`):

    fp32        the parameter is the fp32 master (4 bytes; the reference)
    bf16        round to nearest (2 bytes): the baseline that shows the stale-update problem
    bf16_sr     stochastic rounding (2 bytes): round up with probability equal to the dropped
                fraction, so E[stored] = the fp32 result and small updates survive on average
                (torchao's low-bit optimizers' `bf16_stochastic_round`)
    bf16_split  bf16 weight + the 16 low bits of the fp32 master in the optimizer state (2 + 2
                bytes): the weight is exactly the top half of an fp32 master, which is kept
                bit for bit (bf16-fused-adam's layout). The weight the model sees is the master
                truncated toward zero, at most one bf16 step from it.

The update is always computed in fp32 (adam.py and the native kernel read the weight as fp32,
from the bf16 bits or from both halves); only the write differs. `--master_weights_emulate`
keeps fp32 tensors holding bf16 values and rounds gradients to bf16: bf16 storage's numerics
with fp32 compute, for CPUs whose bf16 matmuls are slow (no memory saved).

Stochastic rounding needs random bits that are reproducible (same seed, same run), resumable
(no generator state to checkpoint) and the same whichever backend or thread steps an element:
they come from a counter-based hash, not from a generator (`sr_bits` has the formula). Rounding
adds the 16 bits to the fp32 bit pattern and keeps the top 16 (`round_sr`).
"""

from __future__ import annotations

from typing import Literal

import torch

MasterWeights = Literal["fp32", "bf16", "bf16_sr", "bf16_split"]
MASTER_WEIGHTS: tuple[str, ...] = ("fp32", "bf16", "bf16_sr", "bf16_split")

M32 = 0xFFFFFFFF
MIX = 0x45D9F3B  # < 2^31: a uint32 times it fits in int64, so torch needs no unsigned type


def bytes_per_param(master_weights: str) -> tuple[int, int, int]:
    """(weight, gradient, extra optimizer-state) bytes per parameter of a choice: the remainder
    of bf16_split is the extra 2."""
    if master_weights == "fp32":
        return 4, 4, 0
    return 2, 2, 2 if master_weights == "bf16_split" else 0


def param_dtype(master_weights: str) -> torch.dtype:
    return torch.float32 if master_weights == "fp32" else torch.bfloat16


# ------------------------------------------------------------------------------ random bits
def mix32(x: int) -> int:
    """The 32-bit mixer on a Python int (the reference of mix32_t and of the native kernel's)."""
    x &= M32
    x = ((x ^ (x >> 16)) * MIX) & M32
    x = ((x ^ (x >> 16)) * MIX) & M32
    return x ^ (x >> 16)


def mix32_t(x: torch.Tensor) -> torch.Tensor:
    """mix32 on an int64 tensor holding values in [0, 2^32)."""
    x = ((x ^ (x >> 16)) * MIX) & M32
    x = ((x ^ (x >> 16)) * MIX) & M32
    return x ^ (x >> 16)


def sr_salt(seed: int, index: int) -> int:
    """The salt of the parameter at `index` (its position in the optimizer's groups)."""
    return mix32(mix32(seed) ^ (index & M32))


def sr_bits(salt: torch.Tensor | int, step: torch.Tensor | int, shape: torch.Size | tuple[int, ...],
            device: torch.device | str | None = None) -> torch.Tensor:
    """int64 [shape] of 16 random bits per element (flat index i), for step `step` (a tensor
    on any device, or an int). Element i of the parameter with salt s at optimizer step t gets

        key = mix32(s + t),   bits = mix32(i + key) & 0xFFFF          (all arithmetic mod 2^32)

    where mix32 is an invertible 32-bit integer mixer (xor-shift-multiply, two rounds) and
    s = sr_salt(seed, index) = mix32(mix32(seed) ^ index) for the parameter's index in the
    optimizer's groups. The same formulas run here in torch (int64 holding uint32, so inductor
    fuses them into the step) and in the native kernel (adam_kernel.c). Under FSDP
    `i` counts this rank's shard, so the noise (not its distribution) depends on the world size."""
    if torch.is_tensor(step):
        step = step.to(torch.int64)
        device = step.device if device is None else device
    key = mix32_t((step + salt) & M32) if torch.is_tensor(step) or torch.is_tensor(salt) \
        else torch.tensor(mix32(salt + step), dtype=torch.int64)
    n = 1
    for d in shape:
        n *= d
    i = torch.arange(n, dtype=torch.int64, device=device).view(shape)
    return mix32_t((i + key) & M32) & 0xFFFF


# ------------------------------------------------------------------------------ fp32 <-> bf16
def _bits(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> its bit pattern as int64 in [0, 2^32)."""
    return x.view(torch.int32).to(torch.int64) & M32


def _as_int16(u16: torch.Tensor) -> torch.Tensor:
    """int64 in [0, 2^16) -> int16 with those bits."""
    return ((u16 ^ 0x8000) - 0x8000).to(torch.int16)


def round_sr(x: torch.Tensor, bits16: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, rounded up in magnitude with probability (dropped bits) / 2^16, given 16
    uniform random bits per element. NaN stays NaN; values beyond bf16's range may become inf,
    as round-to-nearest would."""
    hi = (_bits(x) + bits16) >> 16
    out = _as_int16(hi).view(torch.bfloat16)
    return torch.where(torch.isnan(x), x.to(torch.bfloat16), out)


def round_rne(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the fp32 holding x rounded to bf16, to nearest even: x.to(torch.bfloat16).float(),
    bit for bit, written in int32 arithmetic. Emulation needs this form: inside a compiled graph
    inductor treats `x.to(bfloat16).float()` as x (it does not emulate precision casts by
    default), so the rounding that makes emulated bf16 storage bf16 would silently vanish.
    Adding 0x7FFF plus the kept part's lowest bit carries into the kept half exactly when round
    to nearest even rounds up (also into the exponent, and to inf past bf16's largest value);
    only NaN patterns could wrap, and NaN is passed through."""
    u = x.view(torch.int32)
    kept = (u + (0x7FFF + ((u >> 16) & 1))) & -0x10000
    return torch.where(torch.isnan(x), x, kept.view(torch.float32))


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 -> (bf16 of its top 16 bits, int16 of its low 16 bits): join(*split(x)) == x."""
    u = _bits(x)
    return _as_int16(u >> 16).view(torch.bfloat16), _as_int16(u & 0xFFFF)


def join(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """(bf16 top half, int16 low half) -> the fp32 they split from. `hi` may also be an fp32
    tensor holding bf16 values (emulated bf16 storage): its top 16 bits are the same."""
    top = _bits(hi) >> 16 if hi.dtype == torch.float32 else hi.view(torch.int16).to(torch.int64) & 0xFFFF
    u = (top << 16) | (lo.to(torch.int64) & 0xFFFF)
    return (u - ((u >> 31) << 32)).to(torch.int32).view(torch.float32)


def write_master(p: torch.Tensor, x: torch.Tensor, master_weights: str, *, lo: torch.Tensor | None = None,
                 bits16: torch.Tensor | None = None) -> None:
    """Store the fp32 result `x` into the parameter `p` as `master_weights` says (in place):
    fp32 as is, bf16 rounded to nearest even, bf16_sr with `bits16`, bf16_split with its low
    half into `lo`. An fp32 `p` under a bf16 choice (emulation) receives the bf16 value exactly."""
    if master_weights == "bf16_sr":
        p.copy_(round_sr(x, bits16))
    elif master_weights == "bf16_split":
        hi, low = split(x)
        p.copy_(hi)
        lo.copy_(low)
    elif master_weights == "bf16":  # into fp32 storage (emulation) a cast could be compiled away
        p.copy_(round_rne(x) if p.dtype == torch.float32 else x.to(torch.bfloat16))
    else:
        p.copy_(x)


def read_master(p: torch.Tensor, lo: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 master of `p`: joined with its low half under bf16_split, else p as fp32."""
    return join(p, lo) if lo is not None else p.float()
