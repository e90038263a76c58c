"""FP8 matmuls for any nn.Module in anyone's training loop.

    from nanochat.fp8 import FP8Config, FP8Training
    fp8 = FP8Training(model, FP8Config(mode="auto", opt_level=2), optimizer)  # before torch.compile
    optimizer = fp8.optimizer                      # FP8Optim: Adam moments in FP8
    ...each step: fp8.begin_step / fp8.end_step (examples/custom_loop.py; its step guard:
       nanochat.train.guard.StepGuard, which is not FP8's)...
    with fp8.high_precision():                     # evaluation / generation in high precision
        ...

FP8Training holds the order a loop must follow. What it calls is usable alone: FP8Config (the
settings: nanochat.config.fp8, which the CLI's FP8 flags come from), `detect` (native kernels,
emulation or a fallback on this device), `apply_fp8` / `convert` (torchao's FP8 linears, its MX
layers for the MXFP8 recipes, with a per-layer report of what converted and why), mode auto's
calibration and re-checks, per-layer FP8 statistics. FP8Optim and FP8Tensor (Adam moments in
FP8) are the optimizer's: they live in nanochat.optim and are re-exported here. The reasoning
and the measurements: docs/fp8.md.

Names are imported on first use, so `from nanochat.fp8 import FP8Config` (the CLI's flags)
loads neither torch nor torchao. This package imports torch, torchao and, of nanochat, only
the layers below it (optim, config, device, common): never the trainer or the model.
"""

import importlib

_EXPORTS = {
    "FP8Config": "nanochat.config.fp8",
    "FP8Training": "training",
    "FP8Backend": "hardware", "detect": "hardware", "native_gemm_problem": "hardware",
    "FP8Linear": "layers", "MXLinear": "layers",
    "ConversionReport": "conversion", "LayerReport": "conversion", "apply_fp8": "conversion",
    "convert": "conversion", "fp8_disabled": "conversion", "fp8_layers": "conversion", "fp8_report": "conversion",
    "is_fp8_model": "conversion", "layers_to_convert": "conversion", "restore_fp8": "conversion",
    "LayerPolicy": "policy",
    "AutoCalibration": "auto", "apply_fp8_choices": "auto", "fp8_choices": "auto",
    "recheck_choices": "auto", "start_auto_calibration": "auto",
    "CastStats": "stats", "FP8StatsSampler": "stats", "collect_fp8_stats": "stats",
    "first_nonfinite_layer": "stats", "tensor_stats": "stats",
    "FP8Optim": "nanochat.optim", "FP8Tensor": "nanochat.optim",  # the optimizer's, re-exported
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'nanochat.fp8' has no attribute {name!r}")
    module = _EXPORTS[name]
    value = getattr(importlib.import_module(module if "." in module else f"nanochat.fp8.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
