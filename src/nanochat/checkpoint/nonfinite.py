"""The check that keeps inf/nan out of checkpoints.

A model or optimizer state holding inf/nan is never saved and never resumed: a checkpoint is
what a run falls back to, so it must be a state training can continue from. `nonfinite_state`
asks that of the live model and optimizer with one device-to-host read for the whole model (a
flag per tensor, stacked and reduced once, also across ranks, so every rank decides alike);
`nonfinite_tensors` asks it of a loaded .pt payload, and dcp.nonfinite of a DCP step directory.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from nanochat.optim import FP8Tensor
from nanochat.parallel.process_group import all_reduce_sum


def all_finite(t: torch.Tensor) -> torch.Tensor | None:
    """A 0-dim bool on the device (no sync) saying `t` holds no inf/nan; None for a tensor without
    floats. An FP8Tensor (FP8 moments): its codes (a transient fp32 copy) and scales."""
    if isinstance(t, FP8Tensor):
        return torch.isfinite(t.codes.float()).all() & torch.isfinite(t.scale).all()
    return torch.isfinite(t).all() if t.is_floating_point() and t.numel() else None


def _optimizer_states(state_dict: dict, where: str = "") -> list[tuple[str, dict]]:
    """(where, per-parameter states) of an optimizer's state dict: torch's {"state", "param_groups"},
    or a container's {name: such a dict} (MuonAdamW: "muon", "adamw"), `where` naming the member."""
    if "state" in state_dict:
        return [(where, state_dict["state"])]
    return [found for name, sub in state_dict.items() if isinstance(sub, dict)
            for found in _optimizer_states(sub, f"{where} {name}")]


def nonfinite_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """'' when every parameter and optimizer state is finite, else which tensors are not. One flag
    per tensor, stacked and reduced once: a single device-to-host read for the whole model (the
    names are looked up only when something is wrong); every rank decides alike."""
    def finite(t: torch.Tensor) -> torch.Tensor | None:
        return all_finite(t.to_local() if isinstance(t, DTensor) else t)

    named = [(f"parameter {n}", finite(p.detach())) for n, p in model.named_parameters()]
    for where, states in _optimizer_states(optimizer.state_dict()):
        for i, st in enumerate(states.values()):
            named += [(f"optimizer{where} state {i}.{k}", finite(v)) for k, v in st.items()
                      if isinstance(v, torch.Tensor) and v.ndim]
    named = [(n, f) for n, f in named if f is not None]
    if not named:
        return ""
    flags = torch.stack([f for _, f in named])
    bad = all_reduce_sum((~flags).sum().float().reshape(1))
    if bad.item() == 0:
        return ""
    names = [n for (n, _), ok in zip(named, flags.tolist()) if not ok]
    return (f"{len(names)} of {len(named)} tensors on this rank ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''})" if names else "tensors on another rank")


def nonfinite_tensors(payload: dict[str, Any]) -> list[str]:
    """The names of a loaded checkpoint's weights and optimizer states that hold inf/nan."""
    named = list((payload.get("model") or {}).items())
    for where, states in _optimizer_states(payload.get("optimizer") or {}):
        for i, state in states.items():
            named += [(f"optimizer{where} state {i}.{k}", v) for k, v in state.items()]
    flags = [(name, all_finite(t)) for name, t in named if isinstance(t, torch.Tensor)]
    return [name for name, ok in flags if ok is not None and not bool(ok)]


__all__ = ["rng_state", "set_rng_state", "all_finite", "nonfinite_state", "nonfinite_tensors"]
