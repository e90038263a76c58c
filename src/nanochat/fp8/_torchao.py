"""torchao as nanochat uses it: imported with its import-time log lines muted (first, by every
file that uses torchao), and the setup of its float8 training entry point.

torchao 0.18 logs, on every import, that its prebuilt CUDA extensions for MX formats and Hopper
CUTLASS kernels (`_C_mxfp8`, `_C_cutlass_90a`) do not load for this torch build and that Triton
is absent on CPU, and torch's pytree logs a deprecation for torchao's Enums (also when its MX
modules load, imported here for the MXFP8 recipes). `torchao.float8` uses none of those
extensions, and MXFP8 needs `_C_mxfp8` only on sm_100+, where hardware.detect checks that it
loaded, so the lines are noise for our users; real problems (torchao failing to import at all)
still raise.
"""

import logging

import torch.nn as nn

_names = ("torchao", "torchao.kernel.intmm", "torch.utils._pytree")
_loggers = [logging.getLogger(n) for n in _names]
_levels = [lg.level for lg in _loggers]
for _lg in _loggers:
    _lg.setLevel(logging.ERROR)
try:
    from torchao.float8 import convert_to_float8_training
    import torchao.prototype.moe_training.mxfp8_linear  # noqa: F401  (MXFP8 training and its MX casts)
finally:
    for _lg, _level in zip(_loggers, _levels):
        _lg.setLevel(_level)


def prepare_float8_training() -> None:
    """Set up what torchao's float8 training entry point sets up before float8 kernels compile.

    nanochat swaps in its own Float8Linear subclass (layers.FP8Linear), so it does not convert
    through `convert_to_float8_training`; calling it on a module without Linear layers converts
    nothing and applies the rest. In torchao 0.18 that is a patch of inductor's Triton min/max
    codegen, which otherwise trips a Triton miscompile of FP8 stores (NaN/Inf in compiled float8
    backward kernels, triton-lang/triton#11111); it changes no numerics, and nothing on CPU.
    Cheap to call again: the patch is applied once a process.
    """
    convert_to_float8_training(nn.Module())
