"""The optimizer wrapper: what nanochat adds to a torch AdamW/Adam/SGD; nothing FP8.

    from nanochat.optim import OptimWrapper
    opt = OptimWrapper(torch.optim.AdamW(model.parameters()), master_weights="bf16_sr")
    opt.step_in_backward()                         # optional: loss.backward() is the step

OptimWrapper shares the wrapped optimizer's param groups and state and steps what torch's cannot:
bf16 master weights (rounded to nearest, stochastically, or split), the step inside the backward,
and moments stored in another format (`MomentFormat`, the one extension point). It runs one
Adam / SGD step natively, compiled or eagerly, and saves, checks and shards its state; the bytes
it holds are counted (`optimizer_state_bytes`). docs/master_weights.md has the choices.

Other moment formats live above this package: nanochat.fp8's E4M3Blocks keeps Adam's moments in
FP8 (with its C kernel; FP8Optim is the wrapper with it). Nothing here imports nanochat.fp8: a
quantized moment is recognized by what it can do (`QuantizedState`).
"""

from .format import MomentFormat
from .master import MASTER_WEIGHTS, MasterWeights, param_dtype
from .state import QuantizedState, dense
from .state_bytes import optimizer_bytes, optimizer_state_bytes
from .wrapper import OptimWrapper, optimizer_fallbacks

__all__ = ["MASTER_WEIGHTS", "MasterWeights", "MomentFormat", "OptimWrapper", "QuantizedState", "dense", "optimizer_bytes",
           "optimizer_fallbacks", "optimizer_state_bytes", "param_dtype"]
