"""FP8 moments: FP8Tensor and E4M3Blocks, the format a step reads and writes.

An FP8Tensor looks like a float32 tensor and stores `codes` (float8_e4m3fn or e5m2, its shape)
and `scale`, one fp32 per `block_size` elements of the flattened tensor: element i is
codes.flat[i] * scale[i // block_size], with scale = absmax / max_finite per block, so a block's
largest element is exact and two moments in blocks of 256 cost 2 * (1 + 4/256) bytes a parameter.
Every path quantizes with codec.py's one quantizer (the compiled and eager step, a converted
state; the C kernels with its C twin, C_CODEC), so a converted state and a stepped one agree bit
for bit. E4M3Blocks keeps a parameter's moments as e4m3 FP8Tensors, the second one as sqrt(v), never
rounded to zero. The reasoning and the measurements: docs/fp8.md (FP8 optimizer state).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from nanochat.common import mute_import_noise

from ..shards import DTensor, shard_problem
from .codec import CODE_DTYPES, E4M3, Blocks, dequantize_blocks, quantize_blocks
from .format import MomentFormat

mute_import_noise()  # before torchao's first import: its import-time log lines
from torchao.utils import TorchAOBaseTensor  # noqa: E402

aten = torch.ops.aten

DEFAULT_BLOCK_SIZE = 256  # the smallest power of two whose fp32 scales keep two moments under 2.05 bytes
MIN_NUMEL = 4096  # bitsandbytes' and torchao's rule: below it the state is negligible, the per-call cost not


def _check_blocks(numel: int, block_size: int) -> None:
    if block_size <= 0 or numel % block_size != 0:
        raise ValueError(
            f"FP8Tensor needs numel divisible by block_size; got numel={numel}, "
            f"block_size={block_size}. Keep such tensors in fp32 (FP8Optim does) or pick a "
            "block size that divides them."
        )


class FP8Tensor(TorchAOBaseTensor):
    """Float32-looking tensor stored as FP8 `codes` (same shape) and fp32 `scale` per block.

    A wrapper subclass: the outer tensor has no storage, only the appearance (shape, dtype
    float32, device). The plumbing (flatten/unflatten for torch.compile and DTensor, the op
    table, detach/clone/alias) is torchao's TorchAOBaseTensor. The op table holds only what the
    optimizer, torch.save/torch.load(weights_only=True), .to(device) and DCP need; any other op
    raises NotImplementedError naming it, rather than silently dequantizing (a hidden 4x memory
    blow-up in someone's loop)."""

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
        if codes.dtype not in CODE_DTYPES:
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
        if dtype not in CODE_DTYPES:
            raise ValueError(f"dtype must be one of {CODE_DTYPES}, got {dtype}")
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
        if not torch.is_tensor(codes) or codes.dtype not in CODE_DTYPES:
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


# torch.load(weights_only=True) rebuilds only registered classes, by the module path pickled with
# them: checkpoints written before FP8Tensor moved here name it nanochat.fp8.tensor.FP8Tensor
torch.serialization.add_safe_globals([FP8Tensor, (FP8Tensor, "nanochat.fp8.tensor.FP8Tensor")])


# ---------------------------------------------------------------------------------- the format
def _requantize(x: torch.Tensor, m: Blocks, *, floor: bool, ok: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, B] fp32 written into the stored blocks `m` (or a (codes, scale) pair) in place by
    the one quantizer; returns the new scale. ok: a 0-dim bool; False keeps the old codes and
    scale (a guarded step that is skipped)."""
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
    """Moments as e4m3 FP8Tensors in blocks of `block_size` (MomentFormat's hooks). `opt_level`:
    0 stores none, 1 the first moment, 2 both. A parameter's moments go FP8 with >= `min_numel`
    elements, a multiple of `block_size`, contiguous, and under FSDP2/TP shards of whole blocks
    (decided on the global shape, so all ranks agree); the others keep fp32 moments.

    Inside the step a moment is its `Blocks` view; the second moment is stored as sqrt(v),
    floored so a positive value never becomes 0. The returned tie, `0 * scale`, makes the
    parameter's write depend on the new per-block absmax, so inductor fuses it into the loop
    that writes the codes (one pass over p instead of a second through a full-size temporary)."""

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
    def kept(self, p: torch.Tensor, moments: int) -> str | None:
        if moments == 0:
            return "no moments (SGD without momentum)"
        if self.opt_level == 0:
            return "opt_level 0"
        size = fp8_size_problem(p.numel(), self.block_size, self.min_numel)
        if size:
            return size
        if isinstance(p, DTensor):  # FSDP / TP: every rank's part must be whole blocks too
            problem = shard_problem(p, self.block_size)
            if problem:
                return problem
        if not p.is_contiguous():
            return "not contiguous"
        if not p.is_floating_point():
            return "not floating point"
        return None

    def stores(self, p: torch.Tensor, moments: int) -> int:
        return 0 if self.kept(p, moments) is not None else min(self.opt_level, moments)

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


def quantize_sqrt_v(v: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE) -> FP8Tensor:
    """fp32 second moment v -> FP8Tensor of sqrt(v), positive values never flushed to zero: the
    step's own write, so a converted state is stored as a stepped one would be."""
    out = FP8Tensor.zeros(v.shape, dtype=E4M3, block_size=block_size, device=v.device)
    _requantize(v.detach().float().clamp(min=0).sqrt().reshape(-1, block_size), out.blocks(), floor=True)
    return out


__all__ = ["DEFAULT_BLOCK_SIZE", "E4M3Blocks", "FP8Tensor", "MIN_NUMEL", "fp8_size_problem", "implements",
           "quantize_sqrt_v"]
