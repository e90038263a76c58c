"""Optimizers as nanochat steps them: torch's AdamW/Adam/SGD/Muon wrapped, with what torch's lack.

    from nanochat.optim import FP8Optim, MuonAdamW, OptimWrapper, muon_param_groups, wrap_optimizer
    opt = FP8Optim(torch.optim.AdamW(model.parameters()), opt_level=2)   # Adam moments in FP8
    opt = OptimWrapper(torch.optim.AdamW(model.parameters()), master_weights="bf16_sr")
    opt = wrap_optimizer(adamw, opt_level=2, master_weights="bf16_sr", in_backward=True)
    split = muon_param_groups(model)   # hidden matrices -> Muon (FP8 momentum), the rest -> AdamW
    opt = MuonAdamW(FP8Optim(torch.optim.Muon(split.muon), opt_level=1), torch.optim.AdamW(split.adamw))

A step reads here top to bottom: wrap.py (the wrapper a run's settings ask for) -> wrapper.py
(which parameters, which backend) -> adam.py (the update, compiled or in its C kernel), sgd.py,
muon.py -> moments/ (how a moment is stored: fp32, or FP8Tensor's e4m3 blocks). Before it:
recipe.py, each Muon-run group's peak rate from the width and the batch. Around it: bf16
master weights (master.py), the step inside the backward (in_backward.py), backends and their
fallbacks, saved state and its conversion, FSDP/TP shards, the bytes held. docs/master_weights.md,
docs/fp8.md and docs/muon.md have the choices and the measurements.
"""

from .master import MASTER_WEIGHTS, MasterWeights, param_dtype
from .moments import E4M3Blocks, FP8Tensor, MomentFormat
from .muon import MuonAdamW, MuonSplit, Placement, members, muon_param_groups
from .recipe import RecipeRates, recipe_rates
from .saved_state import QuantizedState, dense
from .state_bytes import optimizer_bytes, optimizer_state_bytes
from .wrap import optimizer_fallbacks, wrap_optimizer
from .wrapper import FP8Optim, OptimWrapper

__all__ = ["MASTER_WEIGHTS", "E4M3Blocks", "FP8Optim", "FP8Tensor", "MasterWeights", "MomentFormat", "MuonAdamW",
           "MuonSplit", "OptimWrapper", "Placement", "QuantizedState", "RecipeRates", "dense", "members",
           "muon_param_groups", "optimizer_bytes", "optimizer_fallbacks", "optimizer_state_bytes", "param_dtype",
           "recipe_rates", "wrap_optimizer"]
