"""The optimizer step inside the backward: each parameter stepped as soon as its gradient exists.

torch's post-accumulate-grad hook runs once a parameter's gradient is complete; stepping there
and freeing the gradient at once means at most one gradient exists at a time, so the gradients'
memory (4 or 2 bytes a parameter) is gone. After `OptimWrapper.step_in_backward()`,
`loss.backward()` *is* the optimizer step.

What it excludes: gradient accumulation over micro-batches (each backward would step), clipping
by the global gradient norm (the norm exists only after the last parameter has stepped), and
DDP/FSDP (their reductions run after these hooks). A step that runs on its own cannot be
skipped by a loop that sees a non-finite loss afterwards, so each parameter is guarded where it
steps: one whose gradient holds inf or nan is left unchanged, states and step count included,
decided on the device (a 0-dim bool the step reads, adam.py and muon.py) without a host read.
The sums kept here, read once when the loop logs (`stats`), say how many parameters were left
and give the global norm of the finite gradients. A Muon matrix steps in its hook whole: its
gradient is complete there. MuonAdamW sums its two members' (muon.py).
"""

from __future__ import annotations

from typing import Callable

import torch

from .shards import local


class InBackward:
    """The hooks of one wrapper and what its last backward did. `step(p, group, ok)` steps one
    parameter guarded by `ok`; `begin()` runs before the first parameter of each backward."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, step: Callable[[torch.Tensor, dict, torch.Tensor], None],
                 begin: Callable[[], None]):
        self.optimizer, self._step, self._begin = optimizer, step, begin
        self.handles: list = []
        """The hook handles (`handle.remove()` for each undoes the stepping)."""
        self.max_live_grad_bytes = 0
        """The largest gradient seen: the most gradient memory alive at once."""
        # [sum of squared norms of the finite gradients, parameters left unchanged, parameters
        # that had a gradient, then per hooked parameter: 1 if it was left unchanged]
        self._sums: torch.Tensor | None = None

    def install(self) -> list:
        """A hook on every parameter that requires grad (param_groups order); returns the handles."""
        groups = self.optimizer.param_groups
        for i, group in enumerate(groups):
            for p in group["params"]:
                if p.requires_grad:
                    index = len(self.handles)
                    # the group by index, looked up when the hook runs: load_state_dict replaces the dicts
                    self.handles.append(p.register_post_accumulate_grad_hook(
                        lambda param, i=i, index=index: self._on_grad(param, self.optimizer.param_groups[i], index)))
        return self.handles

    @torch.no_grad()
    def _on_grad(self, p: torch.Tensor, group: dict, index: int) -> None:
        g = p.grad
        if self._sums is None:
            self._begin()
            self._sums = torch.zeros(3 + len(self.handles), dtype=torch.float32, device=g.device)
        self.max_live_grad_bytes = max(self.max_live_grad_bytes, local(g).numel() * g.element_size())
        ok = torch.isfinite(g).all()
        norm = torch.linalg.vector_norm(g, dtype=torch.float32)
        self._sums[:3] += torch.stack([torch.where(ok, norm * norm, 0.0), (~ok).float(), torch.ones_like(norm)])
        self._sums[3 + index] = (~ok).float()
        self._step(p, group, ok)
        p.grad = None

    def stats(self, per_param: bool = False) -> torch.Tensor | None:
        """After a backward: an fp32 device tensor, [global norm of the finite gradients,
        parameters left unchanged because their gradient was not finite] (read it when you log:
        one read); None if no parameter stepped. Resets. per_param: followed by the number of
        parameters that had a gradient, then one flag per hooked parameter (param_groups order,
        those that require grad): 1 if it was left unchanged, else 0."""
        out, self._sums = self._sums, None
        if out is None:
            return None
        head = torch.stack([out[0].sqrt(), out[1]])
        return torch.cat([head, out[2:]]) if per_param else head


__all__ = ["InBackward"]
