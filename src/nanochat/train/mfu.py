"""Model FLOPs utilization (MFU): the share of the GPUs' dense peak that a run's model FLOPs use.

    mfu = tokens/s x FLOPs per token / (GPUs x peak FLOP/s per GPU)

FLOPs per token are the model's, not what the run executes: `GPT.flops_per_token` counts 6 per
matmul weight (2 forward, 4 backward) plus attention's QK^T and AV, the convention of
karpathy/nanochat (`estimate_flops`) and torchtitan (`get_num_flop_per_token`). Recomputation
(activation checkpointing), FP8 casts, the optimizer and causal attention's masked half are not
subtracted or added, so two runs of one model compare by MFU exactly as by tokens/s.

The peak is the device's dense (not 2:4-sparse) tensor-core rate from its vendor datasheet.
`mfu` divides by the bf16 peak for every run, FP8 ones included: one denominator, so it is the
honest figure for comparing runs, and an FP8 speedup shows as a higher MFU (it may exceed what
bf16 alone could reach). `mfu_fp8` divides by the FP8 peak instead, for runs with native FP8
layers: how close they came to the FP8 tensor cores' rate (a lower bound: the head, attention and
unconverted layers run in bf16). A device without a listed peak (CPU, MPS, an unlisted GPU) has
no MFU: None, never a guess.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Peak:
    """Dense tensor-core peaks of one GPU, in TFLOP/s."""

    part: str
    """The datasheet's name of the part (e.g. H100 SXM)."""
    bf16_tflops: float
    """Dense bf16 with fp32 accumulation: the denominator of `mfu`."""
    fp8_tflops: float | None
    """Dense FP8 with fp32 accumulation; None for parts without FP8 tensor cores."""
    source: str
    """Where the figures come from."""


# Matched in order against torch.cuda.get_device_name() (e.g. "NVIDIA H100 80GB HBM3" is the SXM
# part, "NVIDIA H100 PCIe", "NVIDIA GH200 480GB"): specific variants before the family name.
# Datasheets print the 2:4-sparse rate with a footnote; the dense rate is half of it.
PEAKS: tuple[tuple[str, Peak], ...] = (
    (r"\bH100 NVL\b", Peak("H100 NVL", 835, 1671, "NVIDIA H100 Tensor Core GPU datasheet")),
    (r"\bH100 PCIe\b", Peak("H100 PCIe", 756, 1513, "NVIDIA H100 Tensor Core GPU datasheet")),
    (r"\bH100\b", Peak("H100 SXM", 989, 1979, "NVIDIA H100 Tensor Core GPU datasheet")),
    (r"\bGH200\b", Peak("GH200", 989, 1979, "NVIDIA GH200 Grace Hopper Superchip datasheet")),
    (r"\bH200 NVL\b", Peak("H200 NVL", 835, 1671, "NVIDIA H200 Tensor Core GPU datasheet")),
    (r"\bH200\b", Peak("H200 SXM", 989, 1979, "NVIDIA H200 Tensor Core GPU datasheet")),
    (r"\bB200\b", Peak("B200 (HGX)", 2250, 4500, "NVIDIA HGX B200 datasheet, per GPU")),
    (r"\bL40S\b", Peak("L40S", 362, 733, "NVIDIA L40S datasheet")),
    # GeForce parts run fp32-accumulate tensor math at half their fp16-accumulate rate
    (r"\bRTX 4090$", Peak("GeForce RTX 4090", 165.2, 330.3,
                          "NVIDIA Ada Lovelace architecture whitepaper, fp32 accumulate")),
    (r"\bA100\b", Peak("A100", 312, None, "NVIDIA A100 Tensor Core GPU datasheet")),
)


def peak_for_name(device_name: str) -> Peak | None:
    """The peaks of a CUDA device by its name; None if it is not listed."""
    for pattern, peak in PEAKS:
        if re.search(pattern, device_name):
            return peak
    return None


def device_peak(device: torch.device) -> Peak | None:
    """The peaks of `device`; None off CUDA (no tensor-core peak to measure against)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return peak_for_name(torch.cuda.get_device_name(index))


def utilization(tokens_per_sec: float, flops_per_token: float, peak_tflops: float, devices: int = 1) -> float:
    """MFU: model FLOP/s over `devices` GPUs' peak (tokens_per_sec is the whole run's)."""
    return tokens_per_sec * flops_per_token / (devices * peak_tflops * 1e12)


def run_mfu(tokens_per_sec: float, flops_per_token: float, peak: Peak | None, devices: int = 1, *,
            fp8: bool = False, native_fp8: bool = False) -> float | None:
    """A run's MFU against `peak`'s dense bf16 rate, or with `fp8` its FP8 rate (only for runs
    with native FP8 layers, `native_fp8`); None where that peak is unknown or nothing was timed."""
    rate = None if peak is None or (fp8 and not native_fp8) else peak.fp8_tflops if fp8 else peak.bf16_tflops
    if rate is None or not math.isfinite(tokens_per_sec):
        return None
    return utilization(tokens_per_sec, flops_per_token, rate, devices)


def describe(peak: Peak | None, device: torch.device, flops_per_token: float) -> str:
    """A run header's line: the model's FLOPs per token and the peak its MFU is against."""
    if peak is not None:
        against = f"the {peak.part}'s dense bf16 peak, {peak.bf16_tflops:g} TFLOP/s ({peak.source})"
    else:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        against = f"no listed peak for {name}: MFU not reported"
    return f"{flops_per_token / 1e9:.3g} GFLOP per token, against {against}"
