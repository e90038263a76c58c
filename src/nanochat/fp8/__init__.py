"""Everything FP8, for any nn.Module in anyone's training loop.

    from nanochat.fp8 import FP8Config, convert, fp8_disabled
    report = convert(model, FP8Config(mode="e4m3", recipe="tensorwise"))  # before torch.compile
    print(report.table()); print(report.summary())
    ...train as usual...
    with fp8_disabled(model):          # evaluation / generation in high precision
        ...

Files: hardware.py (native / emulated / fallback and why), linear.py (torchao conversion, the
layer filter, the report, restore and the high-precision switch), auto.py (`--fp8_mode auto`:
formats chosen per layer and tensor role by measurement), stats.py (amax, underflow,
saturation, SQNR per layer and role; the first non-finite layer), tensor.py (FP8Tensor),
optim.py (FP8Optim: Adam moments in FP8).

This package imports torch, torchao and nanochat.common only: never the trainer or the model.
"""

from .auto import AutoCalibration, apply_fp8_choices, fp8_choices, start_auto_calibration
from .hardware import FP8Backend, detect, native_gemm_problem
from .linear import (
    ConversionReport,
    FP8Config,
    FP8Linear,
    LayerReport,
    apply_fp8,
    convert,
    fp8_disabled,
    fp8_layers,
    fp8_report,
    is_fp8_model,
    restore_fp8,
)
from .optim import FP8Optim
from .stats import CastStats, FP8StatsSampler, collect_fp8_stats, first_nonfinite_layer, tensor_stats
from .tensor import FP8Tensor

__all__ = [
    "FP8Backend", "detect", "native_gemm_problem",
    "ConversionReport", "FP8Config", "FP8Linear", "LayerReport", "apply_fp8", "convert",
    "fp8_disabled", "fp8_layers", "fp8_report", "is_fp8_model", "restore_fp8",
    "AutoCalibration", "apply_fp8_choices", "fp8_choices", "start_auto_calibration",
    "CastStats", "FP8StatsSampler", "collect_fp8_stats", "first_nonfinite_layer", "tensor_stats",
    "FP8Optim", "FP8Tensor",
]
