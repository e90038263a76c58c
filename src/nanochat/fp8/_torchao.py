"""torchao as nanochat uses it: imported with its import-time noise muted (first, by every file
that uses torchao; nanochat.common.mute_import_noise says what is muted and why), and the setup of
its float8 training entry point.
"""

import torch.nn as nn

from nanochat.common import mute_import_noise

mute_import_noise()
from torchao.float8 import convert_to_float8_training  # noqa: E402  (after the filter is in place)
import torchao.prototype.moe_training.mxfp8_linear  # noqa: E402,F401  (MXFP8 training and its MX casts)


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
