"""The layers nanochat swaps in for nn.Linear: torchao's FP8 training layers plus a switch.

`FP8Linear` is torchao's Float8Linear (tensorwise, rowwise, rowwise_with_gw_hp) and `MXLinear`
its MXFP8Linear (mxfp8, mxfp8_wgrad_hp: e4m3 values with one e8m0 scale per block of 32); each
adds `fp8_enabled` (False: plain F.linear on the same Parameters, for `fp8_disabled`) and a check
that refuses CPU/MPS autocast and non-bf16 CUDA autocast with the fix, since torchao handles CUDA
autocast only. The casts and GEMMs are torchao's own: nothing here quantizes. conversion.py decides
which layers get them; speed.py times them as the run will run them.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat.fp8 import _torchao  # noqa: F401  (first: torchao imported with its log noise muted)
from torchao.float8.float8_linear import Float8Linear
from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear, _to_mxfp8_then_scaled_mm
from torchao.quantization.quantize_.common import KernelPreference

from nanochat.config.fp8 import MX_BLOCK

FP8_LAYER_TYPES = (Float8Linear, MXFP8Linear)
"""torchao's FP8 training layers: what `fp8_layers`, `restore_fp8` and the statistics hooks find."""


def mx_training_config(recipe: str, *, emulate: bool) -> MXFP8TrainingOpConfig:
    """torchao's MXFP8 training config for `recipe` (RCEIL e8m0 scales, torchao's recipes), with
    its EMULATED kernels (dequantize, then a high-precision matmul) where `emulate`."""
    wgrad_hp = recipe == "mxfp8_wgrad_hp"
    config = MXFP8TrainingOpConfig.from_recipe(
        MXFP8TrainingRecipe.MXFP8_RCEIL_WGRAD_WITH_HP if wgrad_hp else MXFP8TrainingRecipe.MXFP8_RCEIL)
    return dataclasses.replace(config, kernel_preference=KernelPreference.EMULATED) if emulate else config


def check_autocast(name: str) -> None:
    """Refuse an autocast torchao's FP8 layers do not handle (CPU, MPS, or CUDA with another dtype than bf16)."""
    if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("mps"):
        where = "cpu" if torch.is_autocast_enabled("cpu") else "mps"
        raise RuntimeError(
            f"FP8 layer {name!r} ran under torch.autocast({where!r}). torchao's Float8Linear only "
            "handles CUDA autocast, so its FP8 numerics would be mixed with a second precision "
            "policy. nanochat runs FP8 layers without autocast (fp32 master weights and compute) or "
            "under torch.autocast('cuda', dtype=torch.bfloat16); wrap high-precision work "
            "(evaluation, generation) in nanochat.fp8.fp8_disabled(model)."
        )
    if torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") != torch.bfloat16:
        raise RuntimeError(
            f"FP8 layer {name!r} ran under CUDA autocast with {torch.get_autocast_dtype('cuda')}. "
            "nanochat's FP8 layers support bfloat16 autocast only (fp16 would cast FP8 GEMM outputs "
            "to a format that overflows at 65504, with no loss scaling): use "
            "torch.autocast('cuda', dtype=torch.bfloat16) or no autocast."
        )


class FP8Linear(Float8Linear):
    """torchao's Float8Linear with a high-precision switch and nanochat's autocast check.

    `fp8_enabled=False` (set by `fp8_disabled`) runs plain F.linear on the same parameters; under
    torch.compile the flag is guarded, so each state compiles once.
    """

    fp8_name: str = ""
    fp8_enabled: bool = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.fp8_enabled:
            return F.linear(input, self.weight, self.bias)
        check_autocast(self.fp8_name)
        return super().forward(input)


def autocast_operand(t: torch.Tensor) -> torch.Tensor:
    """An MXFP8 operand as MXLinear casts it: to the CUDA autocast dtype first, as torchao's
    Float8Linear does its input (MX GEMM operands must share one high-precision dtype)."""
    if torch.is_autocast_enabled("cuda"):
        return t.to(torch.get_autocast_dtype("cuda"))
    return t


class MXLinear(MXFP8Linear):
    """torchao's MXFP8Linear with FP8Linear's high-precision switch and autocast check.

    Under CUDA bf16 autocast the input and the fp32 master weight go to bf16 before torchao's MX
    matmul (its two MX operands must share one dtype; autocast then has nothing left to cast).
    The weight-gradient GEMM blocks tokens by 32 (not with `wgrad_with_hp`): a token count that
    is not a multiple is refused in the forward, naming the fix, not by an assertion in the backward.
    """

    fp8_name: str = ""
    fp8_enabled: bool = True

    @classmethod
    def from_linear(cls, module: nn.Linear, config: MXFP8TrainingOpConfig) -> "MXLinear":
        """The MX layer over `module`'s own Parameters (no copy)."""
        with torch.device("meta"):  # no allocation: the parameters are reassigned right away
            new = cls(module.in_features, module.out_features, bias=False, kernel_preference=config.kernel_preference,
                      scale_calculation_mode=config.scale_calculation_mode, wgrad_with_hp=config.wgrad_with_hp)
        new.weight, new.bias = module.weight, module.bias
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.fp8_enabled:
            return F.linear(input, self.weight, self.bias)
        check_autocast(self.fp8_name)
        tokens = input.numel() // input.shape[-1]
        if not self.wgrad_with_hp and torch.is_grad_enabled() and tokens % MX_BLOCK:
            raise ValueError(f"MXFP8 layer {self.fp8_name!r}: {tokens} tokens in this forward pass; recipe mxfp8 "
                             f"scales the weight-gradient GEMM in blocks of {MX_BLOCK} tokens, so the tokens per "
                             f"pass must be a multiple of {MX_BLOCK} (or use recipe mxfp8_wgrad_hp)")
        # torchao's MXFP8Linear.forward, on the operands as autocast would give them
        output = _to_mxfp8_then_scaled_mm(autocast_operand(input), autocast_operand(self.weight),
                                          kernel_preference=self.kernel_preference,
                                          scale_calculation_mode=self.scale_calculation_mode,
                                          wgrad_with_hp=self.wgrad_with_hp)
        return output if self.bias is None else output + self.bias.to(output.dtype)


__all__ = ["FP8_LAYER_TYPES", "FP8Linear", "MXLinear", "autocast_operand", "check_autocast", "mx_training_config"]
