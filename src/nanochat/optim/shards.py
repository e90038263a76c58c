"""This rank's part of a parameter, and of the optimizer state made for it (FSDP2, tensor parallelism).

Under FSDP2 or tensor parallelism a parameter is a DTensor holding this rank's shard. The step
and the state code see plain tensors: `local` unwraps a DTensor (and torchao's FP8 all-gather
weight), `like` wraps a state made for the shard back as a DTensor laid out like its parameter,
which is what DCP saves and reshards. A block format stores a parameter's moments only where
every rank's shard is whole blocks (`shard_problem`).
"""

from __future__ import annotations

import functools

import torch

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # a torch built without distributed: no parameter is a DTensor
    DTensor, Shard = (), None  # isinstance(x, ()) is always False


def local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: the local shard of a DTensor (FSDP2 parameters, gradients,
    and the states made for them), with a wrapper subclass of one inner tensor (torchao's FP8
    all-gather weight, WeightWithDynamicFloat8CastTensor) unwrapped, so kernels see plain tensors;
    a quantized state stays whole."""
    if isinstance(t, DTensor):
        t = t.to_local()
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and not _quantized_type(type(t)) \
            and hasattr(t, "__tensor_flatten__"):
        inner, _ = t.__tensor_flatten__()
        if len(inner) == 1:
            t = getattr(t, inner[0])
    return t


@functools.cache
def _quantized_type(kind: type) -> bool:
    """A quantized state's class (saved_state.QuantizedState's members), decided once per class:
    `local` runs for every state at every step."""
    return all(callable(getattr(kind, name, None)) for name in ("dequantize", "layout_problem", "nbytes_stored"))


def local_grad(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of p's gradient, laid out as `local(p)`. A tensor-parallel embedding's
    gradient comes back replicated while its weight is split by rows (torch's sharding rule for
    the embedding backward); it is sliced to this rank's rows, which needs no communication."""
    g = p.grad
    if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
        g = g.redistribute(p.device_mesh, p.placements)
    return local(g)


def like(shard: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A state made for this rank's shard of `p`, as a DTensor laid out like `p` (what DCP saves
    and reshards); unchanged for a plain parameter."""
    if isinstance(p, DTensor):
        return DTensor.from_local(shard, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                  run_check=False)
    return shard


def shard_problem(p: torch.Tensor, block_size: int) -> str | None:
    """Why the shards of the DTensor `p` are not whole blocks on every rank, or None. Decided
    from the global shape, so all ranks agree. FSDP2 alone shards dim 0 like torch.chunk,
    ceil(rows / ranks) rows per rank (the last rank fewer, and whole blocks too when the full
    tensor and the others are). Tensor parallelism (and FSDP2 over it) splits rows or a matrix's
    columns over several mesh dims: every split must be even, and a shard's rows (row split) or
    each of its rows (column split) whole blocks, so its blocks are the full tensor's blocks. A
    replicated DTensor (norm weights under tensor parallelism) is whole everywhere."""
    splits: dict[int, int] = {}
    for mesh_dim, placement in enumerate(p.placements):
        if placement.is_shard():
            splits[placement.dim] = splits.get(placement.dim, 1) * p.device_mesh.size(mesh_dim)
    if not splits:
        return None
    row = p.numel() // p.shape[0]
    if tuple(p.placements) == (Shard(0),):
        chunk = -(-p.shape[0] // p.device_mesh.size())  # ceil
        if chunk * row % block_size:
            return (f"a shard of {chunk} rows x {row} is not whole {block_size}-element "
                    f"blocks at {p.device_mesh.size()} ranks")
        return None
    layout = f"sharded as {tuple(p.placements)}"
    if set(splits) - {0, 1} or (1 in splits and p.dim() != 2):
        return f"{layout}; a block format needs the rows or a matrix's columns split"
    uneven = [d for d, n in splits.items() if p.shape[d] % n]
    if uneven:
        return f"{layout}: dim {uneven[0]} ({p.shape[uneven[0]]}) does not split evenly over {splits[uneven[0]]} ranks"
    if 1 in splits and (p.shape[1] // splits[1]) % block_size:
        return f"{layout}: a shard's rows of {p.shape[1] // splits[1]} are not whole {block_size}-element blocks"
    if 1 not in splits and (p.shape[0] // splits[0]) * row % block_size:
        return f"{layout}: a shard of {p.shape[0] // splits[0]} rows x {row} is not whole {block_size}-element blocks"
    return None


__all__ = ["DTensor", "like", "local", "local_grad", "shard_problem"]
