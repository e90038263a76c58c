"""What a training loop steps: a torch optimizer wrapped for the run's settings, and what fell back.

`wrap_optimizer` makes the decisions a run's flags imply (FP8 moments, bf16 master weights, the
step inside the backward, Muon's fp32 Newton-Schulz off CUDA) and picks the wrapper (wrapper.py)
that carries them out, or none; `optimizer_fallbacks` lists what any of them fell back from.
nanochat.fp8.FP8Training, the trainer and FP8Trainer call these two.
"""

from __future__ import annotations

import torch

from .master import sr_salt
from .muon import MuonAdamW, members
from .wrapper import FP8Optim, OptimWrapper


def wrap_optimizer(optimizer: torch.optim.Optimizer, *, opt_level: int = 0, master_weights: str = "fp32",
                   seed: int = 0, emulate: bool = False, in_backward: bool = False) -> torch.optim.Optimizer:
    """The optimizer a loop steps, built around `optimizer` (on the parameters the loop trains:
    after FSDP wraps them): FP8Optim for `opt_level` 1 or 2 (FP8 moments); else OptimWrapper for
    bf16 `master_weights` (`emulate`: bf16 numerics on fp32 tensors; `seed` seeds bf16_sr) or
    `in_backward` (installed here: `loss.backward()` is then the step); else `optimizer` itself.
    A MuonAdamW has each of its two optimizers wrapped alike."""
    if isinstance(optimizer, MuonAdamW):
        muon, adamw = optimizer.optimizers
        # wrapped at every level: off CUDA the wrapper runs Newton-Schulz in fp32, not torch's bf16.
        # its own seed (index -1 is no parameter's): else bf16_sr's bits of its tensor i would be
        # those of the AdamW wrapper's tensor i, the same noise in two tensors
        kw = dict(master_weights=master_weights, seed=sr_salt(seed, -1), emulate=emulate)
        muon = FP8Optim(muon, opt_level=opt_level, **kw) if opt_level else OptimWrapper(muon, **kw)
        if in_backward:
            muon.step_in_backward()
        adamw = wrap_optimizer(adamw, opt_level=opt_level, master_weights=master_weights, seed=seed, emulate=emulate,
                               in_backward=in_backward)
        return MuonAdamW(muon, adamw, placements=optimizer.placements)
    if opt_level:
        wrapped = FP8Optim(optimizer, opt_level=opt_level, master_weights=master_weights, seed=seed, emulate=emulate)
    elif master_weights != "fp32" or in_backward:
        wrapped = OptimWrapper(optimizer, master_weights=master_weights, seed=seed, emulate=emulate)
    else:
        return optimizer
    if in_backward:
        wrapped.step_in_backward()
    return wrapped


def optimizer_fallbacks(optimizer: torch.optim.Optimizer) -> list[str]:
    """Every fallback `optimizer` took so far, with its reason: the parameters a moment format
    keeps in fp32 and the steps that fell back to another backend; none for a plain torch
    optimizer. What the trainer and FP8Trainer record in their results."""
    if isinstance(optimizer, MuonAdamW):
        return [note for opt in members(optimizer) for note in optimizer_fallbacks(opt)]
    if not isinstance(optimizer, OptimWrapper):
        return []
    return optimizer.fp32_state_notes() + list(optimizer.fallbacks)


__all__ = ["optimizer_fallbacks", "wrap_optimizer"]
