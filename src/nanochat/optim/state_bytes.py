"""Bytes of optimizer state: one formula for planning, one measurement for what is held.

`optimizer_bytes` is the arithmetic behind the memory plan (nanochat.train.memory), a wrapper's
planned bytes and its summary: a moment costs 4 bytes an element in fp32, or one byte an
element plus a 4-byte scale per block when quantized (FP8 blocks of 256: 1 + 4/256 bytes). The
measurement, `optimizer_state_bytes`, sums the tensors an optimizer holds (codes and scales of a
quantized moment, not the values they stand for) and adds what its first step will allocate for
parameters without state yet, so the figure means the same right after construction (the run's
header, the disk-space check) and after a step (TrainResult.state_bytes). Step counts are left
out: 4 bytes a tensor, not a parameter.
"""

from __future__ import annotations

import torch

from . import adam, muon, sgd
from .saved_state import QuantizedState
from .shards import local


def optimizer_bytes(numel: int, *, quantized: int = 0, moments: int = 2, block_size: int | None = None,
                    moment_bytes: int = 4) -> int:
    """Bytes of the moments of one tensor of `numel` elements (Adam 2, SGD with momentum 1): the
    first `quantized` of them one byte an element and an fp32 scale per `block_size` block, the
    others `moment_bytes` an element."""
    if quantized and block_size is None:
        raise ValueError("quantized moments need their block_size (elements per scale)")
    blocked = quantized * (numel + numel // block_size * 4) if quantized else 0
    return blocked + (moments - quantized) * numel * moment_bytes


def moment_count(optimizer: torch.optim.Optimizer, group: dict) -> int:
    """Moments a torch optimizer keeps per parameter of `group`: Adam(W) 2, SGD with momentum 1,
    plain SGD none, Muon 1."""
    if isinstance(optimizer, torch.optim.Muon):
        return muon.moments(group)
    return sgd.moments(group) if isinstance(optimizer, torch.optim.SGD) else adam.MOMENTS


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state on this rank (moments, quantized codes and scales, bf16_split's
    remainders; step counts excluded) of a wrapper (wrapper.py) or a plain torch Adam/AdamW/SGD:
    the tensors held, plus what the first step will allocate for parameters without state yet.
    A wrapper says that itself (`planned_bytes`); torch makes its moments in the parameter's dtype.
    A container of optimizers (muon.MuonAdamW: `optimizers`) holds the sum of theirs."""
    if isinstance(optimizer, muon.MuonAdamW):
        return sum(optimizer_state_bytes(opt) for opt in muon.members(optimizer))
    planned = getattr(optimizer, "planned_bytes", None)
    total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state:
                for key, value in state.items():
                    if key != "step" and torch.is_tensor(value):
                        value = local(value)  # FSDP: this rank's shard
                        total += value.nbytes_stored() if isinstance(value, QuantizedState) else value.nbytes
            elif planned is not None:
                total += planned(p, group)
            else:
                total += optimizer_bytes(local(p).numel(), moments=moment_count(optimizer, group),
                                         moment_bytes=p.element_size())
    return total


__all__ = ["moment_count", "optimizer_bytes", "optimizer_state_bytes"]
