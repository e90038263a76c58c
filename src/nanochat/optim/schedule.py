"""The learning-rate schedule: linear warmup, then cosine decay to a floor at the last step.

One function, read by the training loop (each step's rate) and by the resume policy, which says
how a resumed run's rate changes when its schedule's settings did (nanochat.checkpoint.resume).
"""

from __future__ import annotations

import math


def lr_multiplier(step: int, total_steps: int, warmup_steps: int, final_lr_frac: float) -> float:
    """Linear warmup to 1, then cosine decay to `final_lr_frac` at the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return final_lr_frac + (1 - final_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress))


def muon_momentum(step: int, warmup_steps: int, target: float, start: float = 0.85) -> float:
    """Muon's momentum at 0-based `step`: linear from `start` to `target` over `warmup_steps`
    (karpathy/nanochat's warmup, from 0.85), then `target`; `target` throughout for 0 steps."""
    if step >= warmup_steps:
        return target
    return start + (target - start) * step / warmup_steps


__all__ = ["lr_multiplier", "muon_momentum"]
