"""What this device can do with FP8 matmuls: native kernels, emulation, or nothing (fallback).

FP8 training needs a GEMM that reads FP8 operands. In torch that is `torch._scaled_mm`, and the
kernels behind it set the rules below. Each rule names the torch source it comes from, so it can
be re-checked when torch moves (this file is written against torch 2.11-2.13):

* **Native needs CUDA compute capability >= 8.9** (Ada sm_89, Hopper sm_90, Blackwell sm_100 /
  sm_120): the first NVIDIA GPUs with FP8 tensor cores. torch's own test suite gates FP8 on the
  same line (`torch/testing/_internal/common_cuda.py`, `evaluate_platform_supports_fp8`:
  `SM90OrLater or capability == (8, 9)`).
* **Rowwise scaling** (`--fp8_recipe rowwise | rowwise_with_gw_hp`) runs its forward GEMM on a
  CUTLASS kernel (`aten/src/ATen/native/cuda/RowwiseScaledMM.cu`, `dispatch_fp8_rowwise_kernel_on_sm`)
  that accepts sm_89, 9.x, 10.x, 11.x and 12.x and fails anything else with "Rowwise scaling is not
  currently supported on your device"; it is not built on Windows or ROCm (`BUILD_ROWWISE_FP8_KERNEL`).
  Older torch releases had only the sm_90 kernel, which is where the common "rowwise needs
  Hopper" rule comes from; the torch we support also has the sm_89 one. The same kernel requires
  its second operand (the weight) in e4m3 (`check_inputs`: `b.dtype() == kFloat8_e4m3fn`).
* **No GEMM may have both operands in e5m2**: cuBLASLt, behind tensorwise `_scaled_mm` (and behind
  torchao's rowwise backward GEMMs, which use the tensorwise kernel and rescale afterwards), has no
  e5m2 x e5m2 kernel; torch checks it up front ("Multiplication of two Float8_e5m2 matrices is not
  supported", `aten/src/ATen/native/cuda/ScaledBlas.cpp`, CUDA only). On CPU every pairing runs
  (measured: `tests/test_fp8_linear.py::test_scaled_mm_cpu_accepts_every_operand_pairing`), so
  this limit shows up only on a GPU; `native_gemm_problem` states it before a run starts.
* **ROCm** is not run natively: MI300 uses the fnuz FP8 formats (`float8_e4m3fnuz`,
  `float8_e5m2fnuz`: no negative zero, different max), torchao switches dtypes for it
  (`torchao.float8.config.Float8TypeConfig`), and nanochat's modes, statistics and tests are written
  for the OCP formats. Until that is tested, ROCm falls back (and `--fp8_emulate` works there).
* **CPU and MPS** have no FP8 matmul hardware: `_scaled_mm` on CPU is a reference loop (~0.12
  GFLOP/s measured on a 2-core x86 CPU), MPS has none. They fall back, unless `--fp8_emulate`.

`emulate=True` is always honoured: torchao then dequantizes the FP8 operands and runs an ordinary
high-precision matmul, which reproduces FP8 rounding exactly (the accumulation is fp32 instead of
the tensor core's) on any device, slowly.

A fallback is never silent: `linear.convert` logs it once and hands the reason to the trainer,
which records it in `TrainResult.fallbacks`.
"""

from __future__ import annotations

import platform
import sys
from dataclasses import dataclass
from typing import Literal

import torch

# Capability rules, with their sources in the module docstring.
MIN_NATIVE_CAPABILITY = (8, 9)
ROWWISE_MAJORS = (9, 10, 11, 12)  # plus exactly (8, 9)

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
    """Whether torch's CUTLASS rowwise FP8 kernel runs on this capability (see module docstring)."""
    return (capability == (8, 9) or capability[0] in ROWWISE_MAJORS) and sys.platform != "win32"


def detect(device: torch.device | str, *, emulate: bool, recipe: str = "tensorwise") -> FP8Backend:
    """Decide native / emulated / fallback for `device` and the scaling `recipe`."""
    device = torch.device(device)
    name, capability = _device_name(device)
    if emulate:
        return FP8Backend(
            "emulated",
            f"--fp8_emulate: FP8 rounding simulated with high-precision matmuls on {name} "
            "(same numerics as FP8 kernels up to accumulation order; slow, for tests and studies)",
            name, capability,
        )

    def fallback(what: str) -> FP8Backend:
        return FP8Backend(
            "fallback",
            f"{what}; training continues in high precision. Use --fp8_emulate to run FP8 numerics "
            "anyway (slow), or a CUDA GPU with compute capability 8.9+ (Ada, Hopper, Blackwell).",
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
        if recipe != "tensorwise" and not rowwise_supported(capability):
            return fallback(
                f"{name} (sm_{capability[0]}{capability[1]}) has no rowwise-scaled FP8 kernel in torch "
                f"(torch's rowwise kernel runs on sm_89, sm_9x-12x, not on Windows); "
                f"--fp8_recipe {recipe} cannot run natively, --fp8_recipe tensorwise can"
            )
        return FP8Backend(
            "native",
            f"{name} (sm_{capability[0]}{capability[1]}) has FP8 tensor cores: torch._scaled_mm",
            name, capability,
        )
    if device.type == "cpu":
        return fallback(
            f"{name} has no FP8 matmul hardware (torch._scaled_mm on CPU is a reference loop, "
            "~0.1 GFLOP/s)"
        )
    return fallback(f"{name} has no FP8 matmul kernels in torch")


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
    are in the module docstring; rowwise_with_gw_hp keeps the grad_weight GEMM in high precision,
    so that GEMM sets no constraint there.
    """
    e5 = torch.float8_e5m2
    for gemm, a, b in GEMMS:
        if gemm == "grad_weight" and recipe == "rowwise_with_gw_hp":
            continue
        if dtypes[a] == e5 and dtypes[b] == e5:
            return (f"the {gemm} GEMM would multiply {a} and {b} both in e5m2, which cuBLASLt does not "
                    "support ('Multiplication of two Float8_e5m2 matrices is not supported')")
    if recipe != "tensorwise" and dtypes["weight"] != torch.float8_e4m3fn:
        return ("torch's rowwise FP8 kernel needs the weight (second operand of the forward GEMM) "
                "in e4m3")
    return None
