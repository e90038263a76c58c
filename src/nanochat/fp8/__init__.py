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

import logging as _logging


def _import_torchao_quietly() -> None:
    """Import torchao with its import-time log lines muted.

    torchao 0.18 logs, on every import, that its prebuilt CUDA extensions for MX formats and
    Hopper CUTLASS kernels (`_C_mxfp8`, `_C_cutlass_90a`) do not load for this torch build and that
    Triton is absent on CPU, and torch's pytree logs a deprecation for two torchao Enums. None of
    those extensions is used by `torchao.float8` or by us, so the lines are noise for our users;
    real problems (torchao failing to import at all) still raise.
    """
    names = ("torchao", "torchao.kernel.intmm", "torch.utils._pytree")
    loggers = [_logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(_logging.ERROR)
    try:
        import torchao.float8  # noqa: F401
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


_import_torchao_quietly()

from .auto import AutoCalibration, apply_fp8_choices, fp8_choices, recheck_choices, start_auto_calibration  # noqa: E402
from .hardware import FP8Backend, detect, native_gemm_problem  # noqa: E402
from .linear import (  # noqa: E402
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
from .optim import FP8Optim  # noqa: E402
from .stats import CastStats, FP8StatsSampler, collect_fp8_stats, first_nonfinite_layer, tensor_stats
from .tensor import FP8Tensor

__all__ = [
    "FP8Backend", "detect", "native_gemm_problem",
    "ConversionReport", "FP8Config", "FP8Linear", "LayerReport", "apply_fp8", "convert",
    "fp8_disabled", "fp8_layers", "fp8_report", "is_fp8_model", "restore_fp8",
    "AutoCalibration", "apply_fp8_choices", "fp8_choices", "recheck_choices", "start_auto_calibration",
    "CastStats", "FP8StatsSampler", "collect_fp8_stats", "first_nonfinite_layer", "tensor_stats",
    "FP8Optim", "FP8Tensor",
]
