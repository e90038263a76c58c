"""FP8Tensor: a float32-looking tensor stored as FP8 codes plus one fp32 scale per block.

It holds optimizer state (Adam moments, SGD momentum) at ~1 byte per element. It is a *wrapper*
subclass: the outer tensor has no storage, only the appearance (shape, dtype float32, device);
the data lives in two inner tensors,

    codes  [*shape]              float8_e4m3fn or float8_e5m2, same shape as the tensor
    scale  [numel // block_size] float32, one per block of the *flattened* tensor

and element i dequantizes to `codes.flat[i].float() * scale[i // block_size]`. Blocks of 256
with fp32 scale = absmax / max_finite: two FP8 moments cost 2.031 bytes per parameter and the
largest element of a block is exact. `encode`/`decode` use int32 bit operations rather than
`.to(torch.float8_*)` (same bits) because inductor vectorizes those on CPU; optim.py's fused step
and its C kernel share the formulas. docs/fp8.md has the reasoning and the measurements.

The subclass plumbing (flatten/unflatten for torch.compile and DTensor, the op table and its
`implements`, detach/clone/alias, rebuilding through `_apply_fn_to_data`) is torchao's
`TorchAOBaseTensor`, the base of torchao's own low-bit optimizer states. The op table holds only
what the optimizer, `torch.save`/`torch.load(weights_only=True)`, `.to(device)` and distributed
checkpointing need; every other op raises NotImplementedError naming the op, rather than
silently dequantizing (which would hide a 4x memory blow-up in someone's loop).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from nanochat.fp8 import _torchao  # noqa: F401  (first: torchao imported with its log noise muted)
from torchao.utils import TorchAOBaseTensor

aten = torch.ops.aten

DEFAULT_BLOCK_SIZE = 256
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
"""The two OCP FP8 formats, by the names the API and the CLI use (`mode="e4m3"`)."""
DTYPE_NAMES = {v: k for k, v in FP8_DTYPES.items()}

# Bit layout of the two formats: (mantissa bits, exponent bias, largest finite code magnitude).
# e4m3fn: s eeee mmm, bias 7, max 0x7E = 448 (0x7F is NaN, there is no inf).
# e5m2:   s eeeee mm, bias 15, max 0x7B = 57344 (0x7C is inf).
_LAYOUT = {
    torch.float8_e4m3fn: (3, 7, 0x7E),
    torch.float8_e5m2: (2, 15, 0x7B),
}


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
    optim_kernel.c computes the same in C), so a converted state and a stepped one agree bit for
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


def _check_blocks(numel: int, block_size: int) -> None:
    if block_size <= 0 or numel % block_size != 0:
        raise ValueError(
            f"FP8Tensor needs numel divisible by block_size; got numel={numel}, "
            f"block_size={block_size}. Keep such tensors in fp32 (FP8Optim does) or pick a "
            "block size that divides them."
        )


class FP8Tensor(TorchAOBaseTensor):
    """Float32-looking tensor stored as FP8 `codes` (same shape) and fp32 `scale` per block."""

    # the names torchao's base reads to flatten/unflatten, rebuild (_apply_fn_to_data) and print
    tensor_data_names = ["codes", "scale"]
    tensor_attribute_names = ["block_size", "dtype"]

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scale: torch.Tensor, block_size: int,
                dtype: torch.dtype = torch.float32):
        return torch.Tensor._make_wrapper_subclass(
            cls, codes.shape, dtype=dtype, device=codes.device, requires_grad=False
        )

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, block_size: int,
                 dtype: torch.dtype = torch.float32):
        if codes.dtype not in FP8_DTYPES.values():
            raise TypeError(f"codes must be float8_e4m3fn or float8_e5m2, got {codes.dtype}")
        _check_blocks(codes.numel(), block_size)
        if scale.dtype != torch.float32 or scale.shape != (codes.numel() // block_size,):
            raise ValueError(
                f"scale must be float32 of shape ({codes.numel() // block_size},) for "
                f"{codes.numel()} elements in blocks of {block_size}; got {scale.dtype} "
                f"{tuple(scale.shape)}"
            )
        # these three are the instance __dict__ that torch.save pickles; keep the names
        self.codes = codes
        self.scale = scale
        self.block_size = block_size

    @classmethod
    def from_float(cls, x: torch.Tensor, *, dtype: torch.dtype = torch.float8_e4m3fn,
                   block_size: int = DEFAULT_BLOCK_SIZE) -> "FP8Tensor":
        """Quantize a float tensor blockwise (absmax scaling, round to nearest even)."""
        if dtype not in FP8_DTYPES.values():
            raise ValueError(f"dtype must be one of {tuple(FP8_DTYPES.values())}, got {dtype}")
        _check_blocks(x.numel(), block_size)
        codes, scale = quantize_blocks(x.detach().to(torch.float32).reshape(-1, block_size), dtype)  # [n, B], [n]
        codes = codes.view(dtype).view(x.shape)
        return cls(codes, scale, block_size)

    @classmethod
    def zeros(cls, shape, *, dtype: torch.dtype = torch.float8_e4m3fn,
              block_size: int = DEFAULT_BLOCK_SIZE, device=None) -> "FP8Tensor":
        codes = torch.zeros(shape, dtype=dtype, device=device)
        _check_blocks(codes.numel(), block_size)
        scale = torch.ones(codes.numel() // block_size, dtype=torch.float32, device=device)
        return cls(codes, scale, block_size)

    def blocks(self) -> Blocks:
        """Codes and scales as the step reads and writes them in place: [n_blocks, B] uint8, [n_blocks]."""
        return Blocks(self.codes.view(torch.uint8).view(-1, self.block_size), self.scale)

    def dequantize(self, output_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_blocks(self.blocks(), self.fp8_dtype).view(self.shape).to(output_dtype)

    def layout_problem(self) -> str | None:
        """Why codes, scale and block_size do not describe this tensor, or None: codes of an FP8
        dtype in this tensor's shape, a block size dividing their count, one float32 scale per
        block, both contiguous and on this tensor's device. torch.load rebuilds a subclass from
        its saved attributes without calling __init__, so a tensor read from a file is checked
        with this before anything reads its codes as raw bytes (FP8Optim.load_state_dict)."""
        codes, scale = getattr(self, "codes", None), getattr(self, "scale", None)
        block = getattr(self, "block_size", None)
        if not torch.is_tensor(codes) or codes.dtype not in FP8_DTYPES.values():
            return f"codes must be float8_e4m3fn or float8_e5m2, got {getattr(codes, 'dtype', type(codes).__name__)}"
        if codes.shape != self.shape:
            return f"codes of shape {tuple(codes.shape)} in an FP8Tensor of shape {tuple(self.shape)}"
        if type(block) is not int or block <= 0 or codes.numel() % block:
            return f"block_size {block!r} does not divide its {codes.numel()} elements"
        blocks = codes.numel() // block
        if not torch.is_tensor(scale) or scale.dtype != torch.float32 or scale.shape != (blocks,):
            got = f"{scale.dtype} {tuple(scale.shape)}" if torch.is_tensor(scale) else type(scale).__name__
            return f"scale must be float32 of shape ({blocks},), one per block of {block}; got {got}"
        if not (codes.is_contiguous() and scale.is_contiguous()):
            return "codes and scale must be contiguous"
        if codes.device != self.device or scale.device != self.device:
            return f"codes on {codes.device} and scale on {scale.device} in an FP8Tensor on {self.device}"
        return None

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.codes.dtype

    def nbytes_stored(self) -> int:
        """Bytes actually held: codes plus scales."""
        return self.codes.numel() * self.codes.element_size() + self.scale.numel() * 4

    # the base's repr prints every code; one line of metadata is what a state dict dump needs
    def __repr__(self) -> str:
        return (f"FP8Tensor(shape={tuple(self.shape)}, fp8={self.fp8_dtype}, "
                f"block_size={self.block_size}, device={self.device})")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # torchao's dispatcher raises without naming the way out; ours points to .dequantize()
        table = cls._ATEN_OP_TABLE[cls]
        if func not in table:
            raise NotImplementedError(
                f"FP8Tensor does not implement {func}. It stores optimizer state; supported ops: "
                f"{', '.join(sorted(str(op) for op in table))}. Call .dequantize() to get a "
                "float32 tensor for anything else."
            )
        return table[func](func, types, args, kwargs or {})


def implements(ops: list) -> Callable:
    """Register a handler in FP8Tensor's op table; an op that already has one is an error
    (torchao's `FP8Tensor.implements` would silently replace it)."""

    def decorator(fn: Callable) -> Callable:
        table = FP8Tensor._ATEN_OP_TABLE[FP8Tensor]
        for op in ops:
            if op in table:
                raise RuntimeError(f"FP8Tensor: {op} is already implemented by {table[op].__name__}")
        return FP8Tensor.implements(ops)(fn)

    return decorator


# detach, alias, clone and contiguous (DCP, state_dict helpers, deepcopy) come from torchao's
# base, which applies the op to codes and scale; copy_ and _to_copy below replace the base's.


# needed by load paths that copy into existing state (DCP load, FP8Optim level conversion);
# replaces the base's, which copies only between FP8Tensors of identical format
@FP8Tensor.implements([aten.copy_.default])
def _copy(func, types, args, kwargs):
    dst, src = args[0], args[1]
    if isinstance(dst, FP8Tensor):
        if isinstance(src, FP8Tensor) and (src.block_size, src.fp8_dtype) == (dst.block_size, dst.fp8_dtype):
            dst.codes.copy_(src.codes)
            dst.scale.copy_(src.scale)
        else:  # requantize into dst's format
            src = src.dequantize() if isinstance(src, FP8Tensor) else src
            q = FP8Tensor.from_float(src.to(dst.device), dtype=dst.fp8_dtype, block_size=dst.block_size)
            dst.codes.copy_(q.codes.view(dst.codes.shape))
            dst.scale.copy_(q.scale)
    else:  # plain tensor destination: write the values
        dst.copy_(src.dequantize())
    return dst


# needed by .to(device) and by Optimizer.load_state_dict (value.to(dtype=p.dtype, device=p.device));
# replaces the base's, which ignores the dtype
@FP8Tensor.implements([aten._to_copy.default])
def _to_copy(func, types, args, kwargs):
    x = args[0]
    device = kwargs.get("device") or x.device
    dtype = kwargs.get("dtype") or x.dtype
    if dtype not in (torch.float32,):
        # the appearance dtype is float32 by construction; another dtype means "give me values"
        return x.dequantize().to(dtype=dtype, device=device)
    return x._apply_fn_to_data(lambda t: t.to(device))


# needed by torch.empty_like(state, device=...) in DCP (planner_helpers materializes meta state)
@implements([aten.empty_like.default])
def _empty_like(func, types, args, kwargs):
    x = args[0]
    device = kwargs.get("device") or x.device
    return x._apply_fn_to_data(lambda t: torch.empty_like(t, device=device))


# needed by DCP save (it asks whether to pin before copying to CPU)
@implements([aten.is_pinned.default])
def _is_pinned(func, types, args, kwargs):
    x = args[0]
    return x.codes.is_pinned() and x.scale.is_pinned()


# needed by DTensor.from_local and DCP (view to the same or a block-compatible shape)
@implements([aten.view.default])
def _view(func, types, args, kwargs):
    x, shape = args[0], args[1]
    return FP8Tensor(x.codes.view(shape), x.scale, x.block_size, x.dtype)


# needed by DCP resharding (narrow_tensor_by_index -> slice along dim 0, block-aligned)
@implements([aten.slice.Tensor])
def _slice(func, types, args, kwargs):
    x, dim = args[0], args[1] if len(args) > 1 else 0
    start = args[2] if len(args) > 2 else None
    end = args[3] if len(args) > 3 else None
    step = args[4] if len(args) > 4 else 1
    n = x.shape[0] if x.dim() else 1
    start = 0 if start is None else (start + n if start < 0 else start)
    end = n if end is None else min(end + n if end < 0 else end, n)
    row = math.prod(x.shape[1:])
    if dim != 0 or step != 1 or (start * row) % x.block_size or (end * row) % x.block_size:
        raise ValueError(
            f"FP8Tensor slices only along dim 0 with step 1 on block boundaries (block_size="
            f"{x.block_size}, row of {row} elements); got dim={dim}, {start}:{end}:{step}"
        )
    blocks = slice(start * row // x.block_size, end * row // x.block_size)
    return FP8Tensor(x.codes[start:end], x.scale[blocks], x.block_size, x.dtype)


torch.serialization.add_safe_globals([FP8Tensor])
