"""The FP8 byte codec of the optimizer moments: e4m3 / e5m2 bit patterns to and from fp32, and
the blockwise quantizer every path shares (Blocks: codes with one fp32 scale per block). Written
with int32 ops so inductor vectorizes them on CPU; e4m3.h (C_CODEC) is the same codec in C, which
the native kernels include, so a converted state and a stepped one agree bit for bit.
"""

from __future__ import annotations

import pathlib
from typing import NamedTuple

import torch

E4M3 = torch.float8_e4m3fn
C_CODEC = pathlib.Path(__file__).with_name("e4m3.h")
"""The e4m3 block codec in C (dec/enc, dec_block/enc_block) that native kernels include."""

# Bit layout of the two formats: (mantissa bits, exponent bias, largest finite code magnitude).
# e4m3fn: s eeee mmm, bias 7, max 0x7E = 448 (0x7F is NaN, there is no inf).
# e5m2:   s eeeee mm, bias 15, max 0x7B = 57344 (0x7C is inf).
_LAYOUT = {
    torch.float8_e4m3fn: (3, 7, 0x7E),
    torch.float8_e5m2: (2, 15, 0x7B),
}
CODE_DTYPES = tuple(_LAYOUT)


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 format (e4m3fn: 448, e5m2: 57344)."""
    return float(torch.finfo(dtype).max)


def encode(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 values already divided by their block scale -> FP8 bit patterns as uint8.

    Round-to-nearest-even, saturating at the largest finite code; bit-identical to
    `y.clamp(-max, max).to(dtype).view(torch.uint8)`. Written with int32 ops so inductor
    vectorizes it on CPU. NaN inputs produce garbage codes (callers never pass NaN on purpose).
    """
    mbits, bias, max_code = _LAYOUT[dtype]
    shift = 23 - mbits  # fp32 mantissa bits dropped
    bits = y.view(torch.int32)
    sign = (bits >> 24) & 0x80  # arithmetic shift: keep only the sign bit, moved to bit 7
    a = bits & 0x7FFFFFFF  # |y| as bits
    # normal range: round the fp32 mantissa to `mbits` bits (RNE), then rebias the exponent
    rounded = a + ((1 << (shift - 1)) - 1) + ((a >> shift) & 1)
    normal = (rounded >> shift) - ((127 - bias) << mbits)
    # subnormal range (|y| < 2^(1-bias)): code = round(|y| / smallest_subnormal), RNE
    absy = a.view(torch.float32)
    sub = torch.round(absy * 2.0 ** (bias + mbits - 1)).to(torch.int32)
    mag = torch.where(a < ((128 - bias) << 23), sub, normal).clamp(max=max_code)
    return (mag | sign).to(torch.uint8)


def decode(codes_u8: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 bit patterns (uint8) -> fp32 values (unscaled). Exact; int32 ops only (vectorizes)."""
    mbits, bias, _ = _LAYOUT[dtype]
    u = codes_u8.to(torch.int32)
    mag = u & 0x7F
    # normal: move exponent+mantissa into fp32's fields and add the bias difference;
    # the sign goes straight to bit 31
    bits = ((mag << (23 - mbits)) + ((127 - bias) << 23)) | ((u & 0x80) << 24)
    normal = bits.view(torch.float32)
    # subnormal (exponent field 0): value = mantissa * smallest subnormal
    sub = mag.to(torch.float32) * 2.0 ** (1 - bias - mbits)
    sub = torch.where(u >= 0x80, -sub, sub)
    return torch.where(mag < (1 << mbits), sub, normal)


class Blocks(NamedTuple):
    """A blockwise FP8 tensor as the optimizer's step reads and writes it: `codes`, the FP8 bit
    patterns as a uint8 [n_blocks, B] view, and `scale`, one fp32 per block. An FP8Tensor's
    `blocks()` is a view of its own storage, so writing into it updates the tensor."""

    codes: torch.Tensor
    scale: torch.Tensor


def quantize_blocks(x: torch.Tensor, dtype: torch.dtype, *, floor: bool = False) -> Blocks:
    """[n, B] fp32 -> Blocks: scale = absmax / fp8_max per block (1 for an all-zero block),
    codes = encode(x * (fp8_max / absmax)): one division per block, none per element. The one
    quantizer of every path (a state converted on load, the compiled and eager step;
    C_CODEC computes the same in C), so a converted state and a stepped one agree bit for
    bit, and quantizing dequantized values gives back the same codes and scales.
    floor: a positive x never becomes code 0 (the smallest subnormal instead)."""
    amax = x.abs().amax(dim=-1)  # [n]
    scale = torch.where(amax > 0, amax / fp8_max(dtype), 1.0)
    inv = torch.where(amax > 0, fp8_max(dtype) / amax, 1.0)
    codes = encode(x * inv[:, None], dtype)
    if floor:
        codes = torch.where((x > 0) & (codes == 0), 1, codes).to(torch.uint8)
    return Blocks(codes, scale)


def dequantize_blocks(blocks: Blocks, dtype: torch.dtype) -> torch.Tensor:
    """Blocks (or a (codes, scale) pair) -> [n, B] fp32 values: decode(codes) * scale, exact
    (the one dequantizer)."""
    codes, scale = blocks
    return decode(codes, dtype) * scale[:, None]


__all__ = ["C_CODEC", "CODE_DTYPES", "E4M3", "Blocks", "decode", "dequantize_blocks", "encode", "fp8_max",
           "quantize_blocks"]
