"""The optimizer wrapper: what nanochat adds to a torch AdamW/Adam/SGD, each concept in its file.

    from nanochat.optim import OptimWrapper
    opt = OptimWrapper(torch.optim.AdamW(model.parameters()), master_weights="bf16_sr")
    opt.step_in_backward()                         # optional: loss.backward() is the step

wrapper.py (OptimWrapper: shares the wrapped optimizer's groups and state, steps what torch
cannot), format.py (MomentFormat: how moments are stored, the one extension point; fp32 here),
step.py (the one Adam and SGD step over moment formats), master.py (bf16 master weights: how an
fp32 update is written into a bf16 weight), in_backward.py (the step inside the backward,
guarded per parameter), backends.py (native kernel, torch.compile, eager, and the fallbacks
between them), state.py (saved state: its checks, conversion between formats, FSDP2 shards),
state_bytes.py (bytes of state, planned and held).

Other moment formats live above this package: nanochat.fp8's E4M3Blocks keeps Adam's moments in
FP8 (with its C kernel; FP8Optim is the wrapper with it). Nothing here imports nanochat.fp8: a
quantized moment is recognized by what it can do (state.QuantizedState).
"""

from .format import MomentFormat
from .master import MASTER_WEIGHTS, MasterWeights, param_dtype
from .state import QuantizedState, dense
from .state_bytes import optimizer_bytes, optimizer_state_bytes
from .wrapper import OptimWrapper, optimizer_fallbacks

__all__ = ["MASTER_WEIGHTS", "MasterWeights", "MomentFormat", "OptimWrapper", "QuantizedState", "dense", "optimizer_bytes",
           "optimizer_fallbacks", "optimizer_state_bytes", "param_dtype"]
