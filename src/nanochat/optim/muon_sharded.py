"""Muon on a matrix split across ranks (FSDP2's row shards, tensor parallelism's row or column shards).

Newton-Schulz orthogonalizes a whole matrix: run on a shard it would orthogonalize the shard,
another update. So the step splits where the math allows (torchtitan's and karpathy/nanochat's
distributed Muon do the same):

- the momentum stays sharded: its update is elementwise, on this rank's part only, in the
  parameter's moment format (FP8 blocks of the local shard, which are the whole matrix's blocks
  wherever the format stores them: shards.shard_problem);
- the (Nesterov) update matrix is all-gathered whole (`DTensor.full_tensor`: one all-gather of
  each matrix per step, in fp32);
- every rank runs Newton-Schulz on the whole matrix: the same input, so the same output on every
  rank, computed redundantly (ranks x the one-process FLOPs; spreading the matrices round-robin
  would save it at the price of a second collective per matrix);
- each rank applies its own slice of the result to its shard, with weight decay on the shard,
  torch.optim.Muon's learning-rate factor of the GLOBAL shape, and bf16 master weights as in one
  process (the shard's own low halves, or stochastic rounding bits drawn for the shard).

Given the same gradient and momentum this is `muon.muon_step` on the whole matrix, element for
element (tests/test_muon_sharded.py). The step runs eagerly: the gather cannot sit inside the
compiled step, and Newton-Schulz's matmuls are what cost, compiled or not.
"""

from __future__ import annotations

import torch

from .muon import FP32, muon_flags, muon_hypers, muon_step, muon_tensors, newton_schulz
from .shards import DTensor, local, local_grad

try:
    from torch.distributed.tensor import Replicate
except ImportError:  # a torch built without distributed: no parameter is a DTensor, nothing runs here
    Replicate = None


def gather_whole(part: torch.Tensor, p: DTensor) -> torch.Tensor:
    """The whole matrix whose part laid out as `p` (this rank's shard) is `part`: an all-gather
    over p's mesh (every rank must call it, for the same parameters in the same order)."""
    return DTensor.from_local(part, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                              run_check=False).full_tensor()


def own_part(whole: torch.Tensor, p: DTensor) -> torch.Tensor:
    """This rank's part of `whole` (a tensor every rank holds alike, of p's global shape), laid
    out as p's shard: a slice taken locally (Replicate to Shard needs no communication), from
    p's placements, so uneven FSDP rows and strided FSDP x TP shards come out as p's own."""
    replicated = DTensor.from_local(whole, p.device_mesh, [Replicate()] * p.device_mesh.ndim, run_check=False)
    return replicated.redistribute(p.device_mesh, p.placements).to_local()


def orthogonalizer(p: DTensor, *, coefficients: tuple, ns_steps: int, eps: float, dtype: torch.dtype):
    """For `muon.muon_step` on p's shard: the shard's update -> this rank's part of Newton-Schulz
    of the whole update matrix (gathered; the same floats on every rank, so the same result:
    redundant compute, no second collective)."""
    def orthogonalize(update: torch.Tensor) -> torch.Tensor:
        return own_part(newton_schulz(gather_whole(update.contiguous(), p), coefficients, ns_steps, eps, dtype), p)
    return orthogonalize


def step_sharded(opt, mine: list[tuple[torch.Tensor, dict]]) -> list[tuple[torch.Tensor, dict]]:
    """Step the DTensor parameters among `mine` ((parameter, group) pairs of the OptimWrapper
    `opt` over torch.optim.Muon) with `muon.muon_step` on the shard, its Newton-Schulz on the
    gathered matrix, in `mine`'s order (the same on every rank: each gather is a collective);
    return the other pairs, for the wrapper's own step. The state is muon_tensors' (a momentum
    the format stores as FP8 blocks of the local shard, an fp32 one as torch's own DTensor, bf16
    masters' low halves and counts as the shard's), so it saves and reshards through DCP as
    Adam's moments do."""
    for p, group in mine:
        if not isinstance(p, DTensor):
            continue
        fmt = opt.moments if opt.stores(p, group) else FP32
        buf, lo, step, salt = muon_tensors(opt.state[p], p, fmt, master=opt.master_weights, ok=None,
                                           fp32_buffer=opt.steps_every_parameter, salt=opt._salts.get(p, 0))
        pl, g = local(p), local_grad(p)
        flags = muon_flags(group, pl.device, opt.muon_ns_dtype)
        if flags["normuon"]:
            raise ValueError("NorMuon normalizes each neuron over the whole matrix, which a sharded step does not "
                             "hold: train it in one process or under DDP, or drop --muon_normuon")
        ns = {k: flags.pop(k) for k in ("coefficients", "ns_steps", "eps", "dtype")}
        muon_step(pl, g.reshape(pl.shape), buf, *muon_hypers(group), **flags, **ns, m_format=type(fmt),
                  lo=lo, step=step, salt=salt, master=opt.master_weights, emulate=opt.emulate,
                  orthogonalize=orthogonalizer(p, **ns), shape=p.shape)
        opt.backends.count("eager", 1)  # one eager call per matrix, in the step's counts
    return [(p, group) for p, group in mine if not isinstance(p, DTensor)]


__all__ = ["gather_whole", "orthogonalizer", "own_part", "step_sharded"]
