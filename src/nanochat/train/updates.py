"""The size of the optimizer's update, per param group: what a learning rate means for each.

AdamW's and Muon's learning rates are not on one scale: AdamW's update has an RMS near its lr
(each element ~ m / sqrt(v)), Muon's orthogonalized update an RMS of lr * sqrt(max(1, A/B)) /
sqrt(max(A, B)) per matrix. Comparing them, or seeing a schedule or a warmup do what it should,
needs the update itself: the RMS of (weights after the step - weights before), over each param
group, logged as `update_rms_<group>` in metrics.jsonl (train/update_rms_<group> in TensorBoard
and W&B).

It is sampled every --update_rms_every steps (and at the last): a sampled step copies the
parameters it trains before the step (a transient the size of the weights, freed after it) and
reads one small tensor from the device afterwards. Group names say which optimizer steps the
group and whether it decays: muon, adamw, adamw_no_decay (a number after a repeated name).
Sharded parameters (FSDP, TP) are DTensors: their sums are the whole tensors', every rank the same.
"""

from __future__ import annotations

from collections import Counter

import torch

from nanochat.optim import members


def group_names(optimizer: torch.optim.Optimizer) -> list[str]:
    """A name per entry of `optimizer.param_groups` (MuonAdamW: Muon's groups first, as there)."""
    names = []
    for member in members(optimizer):
        inner = getattr(member, "optimizer", member)  # a wrapper's torch optimizer
        kind = "muon" if type(inner).__name__ == "Muon" else type(inner).__name__.lower()
        names += [kind if g.get("weight_decay", 0) else f"{kind}_no_decay" for g in member.param_groups]
    seen, counts = Counter(), Counter(names)
    out = []
    for name in names:
        seen[name] += 1
        out.append(f"{name}_{seen[name]}" if counts[name] > 1 else name)
    return out


def _sum_squares(x: torch.Tensor) -> torch.Tensor:
    total = x.float().square().sum()
    return total.full_tensor() if hasattr(total, "full_tensor") else total  # a DTensor's: the whole tensor's


class UpdateRMS:
    """`before()` ahead of a sampled step's backward (the update may happen inside it), then
    `record()` after the step: {update_rms_<group>: float}. Other steps: both do nothing."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, every: int, total_steps: int):
        self.optimizer, self.every, self.total_steps = optimizer, every, total_steps
        self.names = group_names(optimizer)
        self._before: list[list[torch.Tensor]] | None = None

    def due(self, step: int) -> bool:
        """Step `step` (0-based) is sampled."""
        return self.every > 0 and ((step + 1) % self.every == 0 or step + 1 == self.total_steps)

    def before(self, step: int) -> None:
        self._before = None
        if self.due(step):
            self._before = [[p.detach().clone() for p in g["params"] if p.requires_grad]
                            for g in self.optimizer.param_groups]

    def record(self) -> dict[str, float]:
        """The sampled step's update RMS per group ({} when this step was not sampled, or its
        update was skipped: `drop()`); one device read."""
        if self._before is None:
            return {}
        sums, counts = [], []
        for group, olds in zip(self.optimizer.param_groups, self._before):
            params = [p for p in group["params"] if p.requires_grad]
            sums.append(sum((_sum_squares(p.detach() - old) for p, old in zip(params, olds)),
                            torch.zeros((), device=olds[0].device if olds else "cpu")))
            counts.append(sum(p.numel() for p in params))
        self._before = None
        values = torch.stack([s.to(sums[0].device) for s in sums]).tolist() if sums else []
        return {f"update_rms_{name}": (v / n) ** 0.5 for name, v, n in zip(self.names, values, counts) if n}

    def drop(self) -> None:
        """The step made no update (skipped): nothing to record."""
        self._before = None


__all__ = ["UpdateRMS", "group_names"]
