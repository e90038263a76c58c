"""What this device can do with FP8 matmuls: native kernels, emulation, or nothing (fallback).

FP8 training needs a GEMM that reads FP8 operands: `torch._scaled_mm`, whose kernels set the
rules below (written against torch 2.11-2.13; docs/fp8.md names the torch source of each, to
re-check when torch moves):

* native needs CUDA compute capability >= 8.9 (Ada, Hopper, Blackwell), torch's own FP8 gate;
* rowwise scaling (`recipe` rowwise | rowwise_with_gw_hp) runs on a CUTLASS kernel for sm_89 and
  sm_9x-12x, not on Windows or ROCm, and needs the weight in e4m3;
* no GEMM may have both operands in e5m2 (cuBLASLt has no such kernel; on CPU every pairing runs),
  which `native_gemm_problem` states before a run starts;
* MXFP8 (`recipe` mxfp8 | mxfp8_wgrad_hp) needs compute capability >= 10.0 (Blackwell: B200,
  GB200, B300) and CUDA 12.8+: torchao's MX casts and `torch._scaled_mm` with e8m0 block scales
  run there only (torchao's `is_sm_at_least_100` gate in mx_formats/kernels.py); an Ada or
  Hopper GPU falls back like any GPU without the recipe's kernel;
* ROCm falls back (MI300's fnuz formats are not yet supported), and so do CPU and MPS, which
  have no FP8 matmul hardware.

`emulate=True` is always honoured: torchao dequantizes the FP8 operands and runs an ordinary
high-precision matmul, which reproduces FP8 rounding exactly (fp32 accumulation instead of the
tensor core's) on any device, slowly.

A fallback is never silent: `linear.convert` logs it once and puts the reason in its report
(`ConversionReport.fallback`) for the caller to record.
"""

from __future__ import annotations

import platform
import sys
from dataclasses import dataclass
from typing import Literal

import torch

from nanochat.config.fp8 import MX_RECIPES
from nanochat.fp8 import _torchao  # noqa: F401  (torchao's MX kernels registered, its log noise muted)

# Capability rules; their torch sources are listed in docs/fp8.md.
MIN_NATIVE_CAPABILITY = (8, 9)
ROWWISE_MAJORS = (9, 10, 11, 12)  # plus exactly (8, 9)
MIN_MX_CAPABILITY = (10, 0)
MIN_MX_CUDA = (12, 8)

Backend = Literal["native", "emulated", "fallback"]


@dataclass(frozen=True)
class FP8Backend:
    """The outcome of `detect`: which FP8 path this device takes, and why."""

    backend: Backend
    """native: real FP8 kernels; emulated: FP8 numerics in high precision; fallback: no FP8."""
    reason: str
    """One sentence a user can act on (it names the device and, for a fallback, the fix)."""
    device_name: str
    """e.g. 'NVIDIA H100 80GB HBM3' or 'cpu (x86_64)'."""
    capability: tuple[int, int] | None = None
    """CUDA compute capability (major, minor); None off CUDA."""


def _device_name(device: torch.device) -> tuple[str, tuple[int, int] | None]:
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_name(index), tuple(torch.cuda.get_device_capability(index))
    if device.type == "cpu":
        return f"cpu ({platform.machine() or 'unknown arch'})", None
    return device.type, None


def rowwise_supported(capability: tuple[int, int]) -> bool:
    """Whether torch's CUTLASS rowwise FP8 kernel runs on this capability (docs/fp8.md)."""
    return (capability == (8, 9) or capability[0] in ROWWISE_MAJORS) and sys.platform != "win32"


def detect(device: torch.device | str, *, emulate: bool, recipe: str = "tensorwise") -> FP8Backend:
    """Decide native / emulated / fallback for `device` and the scaling `recipe`."""
    device = torch.device(device)
    name, capability = _device_name(device)
    if emulate:
        return FP8Backend(
            "emulated",
            f"`emulate`: FP8 rounding simulated with high-precision matmuls on {name} "
            "(same numerics as FP8 kernels up to accumulation order; slow, for tests and studies)",
            name, capability,
        )

    mx = recipe in MX_RECIPES
    needs = ("compute capability 10.0+ (Blackwell: B200, GB200, B300) for `recipe` " + recipe if mx
             else "compute capability 8.9+ (Ada, Hopper, Blackwell)")

    def fallback(what: str) -> FP8Backend:
        return FP8Backend(
            "fallback",
            f"{what}; training continues in high precision. Set `emulate` to run FP8 numerics "
            f"anyway (slow), or use a CUDA GPU with {needs}.",
            name, capability,
        )

    if device.type == "cuda":
        if not torch.cuda.is_available():
            return fallback(f"device {device} was requested but torch.cuda.is_available() is False")
        if torch.version.hip:
            return fallback(
                f"ROCm device {name}: nanochat does not run FP8 natively on ROCm yet (MI300 uses the "
                "fnuz FP8 formats float8_e4m3fnuz/float8_e5m2fnuz, which torchao handles differently "
                "and nanochat has not tested)"
            )
        assert capability is not None
        if capability < MIN_NATIVE_CAPABILITY:
            return fallback(
                f"{name} (sm_{capability[0]}{capability[1]}) has no FP8 tensor cores: FP8 matmuls "
                "need compute capability 8.9 or newer"
            )
        if mx:
            problem = mx_problem(name, capability)
            if problem:
                return fallback(problem)
        elif recipe != "tensorwise" and not rowwise_supported(capability):
            return fallback(
                f"{name} (sm_{capability[0]}{capability[1]}) has no rowwise-scaled FP8 kernel in torch "
                f"(torch's rowwise kernel runs on sm_89, sm_9x-12x, not on Windows); "
                f"`recipe` {recipe} cannot run natively, `recipe` tensorwise can"
            )
        kernels = ("MXFP8 tensor cores: torchao's MX casts, torch._scaled_mm with e8m0 block scales" if mx
                   else "FP8 tensor cores: torch._scaled_mm")
        return FP8Backend("native", f"{name} (sm_{capability[0]}{capability[1]}) has {kernels}", name, capability)
    if device.type == "cpu":
        return fallback(
            f"{name} has no FP8 matmul hardware (torch._scaled_mm on CPU is a reference loop, "
            "~0.1 GFLOP/s)"
        )
    return fallback(f"{name} has no FP8 matmul kernels in torch")


def mx_problem(name: str, capability: tuple[int, int]) -> str | None:
    """Why this CUDA GPU (8.9+) cannot run torchao's MXFP8 kernels, or None (see the module docstring)."""
    sm = f"sm_{capability[0]}{capability[1]}"
    if capability < MIN_MX_CAPABILITY:
        return (f"{name} ({sm}) has no MXFP8 tensor cores: the MXFP8 recipes need compute capability 10.0+; "
                "`recipe` tensorwise or rowwise runs natively here")
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    if cuda < MIN_MX_CUDA:
        return (f"{name} ({sm}) has MXFP8 tensor cores, but this torch is built for CUDA "
                f"{torch.version.cuda}; torchao's MXFP8 kernels need CUDA 12.8+")
    if not mx_kernels_loaded():
        return (f"{name} ({sm}) has MXFP8 tensor cores, but torchao's MXFP8 cast kernel (torchao._C_mxfp8) did "
                "not load in this install (a torchao build for another torch): install the torchao wheel "
                "built for this torch")
    return None


def mx_kernels_loaded() -> bool:
    """Whether torchao's CUDA MXFP8 cast (`torchao::mxfp8_quantize`, from its `_C_mxfp8` extension),
    which its MXFP8 backward calls on sm_100+, has a CUDA kernel in this process."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("torchao::mxfp8_quantize", "CUDA")
    except RuntimeError:  # the operator is not even defined (torchao defines it on sm_100+ only)
        return False


# The three GEMMs of a Linear as torchao issues them, (a, b) operand roles in `torch.mm(a, b)`
# order (torchao/float8/float8_linear.py, matmul_with_hp_or_float8_args):
#   output      = input       @ weight_t
#   grad_input  = grad_output @ weight
#   grad_weight = grad_output_t @ input
GEMMS = (("output", "input", "weight"), ("grad_input", "grad_output", "weight"),
         ("grad_weight", "grad_output", "input"))


def native_gemm_problem(dtypes: dict[str, torch.dtype], *, recipe: str) -> str | None:
    """Why torch's CUDA FP8 kernels would refuse these per-role dtypes, or None if they run.

    `dtypes` maps role (input, weight, grad_output) to its FP8 dtype. The rules and their sources
    are in docs/fp8.md; rowwise_with_gw_hp keeps the grad_weight GEMM in high precision,
    so that GEMM sets no constraint there.
    """
    e5 = torch.float8_e5m2
    for gemm, a, b in GEMMS:
        if gemm == "grad_weight" and recipe == "rowwise_with_gw_hp":
            continue
        if dtypes[a] == e5 and dtypes[b] == e5:
            return (f"the {gemm} GEMM would multiply {a} and {b} both in e5m2, which cuBLASLt does not "
                    "support ('Multiplication of two Float8_e5m2 matrices is not supported')")
    if recipe in MX_RECIPES:
        others = [role for role, d in dtypes.items() if d != torch.float8_e4m3fn]
        return f"MXFP8 casts every operand to e4m3; {', '.join(others)} would not be" if others else None
    if recipe != "tensorwise" and dtypes["weight"] != torch.float8_e4m3fn:
        return ("torch's rowwise FP8 kernel needs the weight (second operand of the forward GEMM) "
                "in e4m3")
    return None
