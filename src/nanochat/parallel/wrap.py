"""The module a run trains: its model as the Layout spreads it, by DDP, FSDP2 or tensor parallelism.

DDP (default) keeps the whole model on every rank and all-reduces gradients. FSDP2
(`fully_shard` per block, then the root) shards parameters, gradients and optimizer state along
dim 0. With --tp the ranks form a 2-D mesh (data parallel x tensor parallel, consecutive ranks
per group): `tensor_parallel` splits the layers a model's plan names (nanochat.model.parallelize)
with torch's styles, or torchao's FP8 styles for tensorwise FP8 layers (the activation cast to
FP8 once, before the collective; a rowwise FP8 layer casts inside, under torch's styles), and
FSDP2, if any, shards over the groups. Weights FSDP2 all-gathers in FP8 move as bytes on gloo
(nanochat.fp8.all_gather). `full_copy` goes back: the plain model a sharded one evaluates on.
The reasons and the measurements: docs/distributed.md.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

from nanochat.fp8 import _torchao  # noqa: F401  (first: torchao imported with its log noise muted)
from torchao.float8.config import ScalingGranularity
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

from nanochat.fp8.all_gather import gather_bytes
from nanochat.model.parallelize import Split, TPPlan
from nanochat.parallel.layout import Layout


def wrap_model(model: nn.Module, layout: Layout, *, device: torch.device, blocks: Iterable[nn.Module],
               plan: TPPlan | None = None) -> nn.Module:
    """The module to train with: `model` itself (one process), DDP around it, or, under FSDP,
    `model` sharded in place by fully_shard on each of `blocks` and then on the root. With
    `layout.tp` > 1, `model` is first split in place over its tensor-parallel group as `plan`
    says, then sharded by FSDP over the groups if the layout has several.

    Under DDP keep using `model` (the unwrapped module) for evaluation and state dicts; under
    FSDP and TP `model` *is* the sharded module (they change it in place).
    """
    if not layout.distributed:
        return model
    mesh = None
    if layout.tp > 1:
        if plan is None:
            raise ValueError(f"--tp {layout.tp} splits the model as its tensor-parallel plan says: pass `plan`")
        mesh = init_device_mesh(device.type, (layout.dp_size, layout.tp), mesh_dim_names=("dp", "tp"))
        tensor_parallel(model, mesh["tp"], plan)
        if not layout.fsdp:  # one group: nothing left to spread
            return model
        mesh = mesh["dp"]
    if layout.fsdp:
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)  # the root: embedding, final norm, lm_head
        if layout.backend == "gloo":
            gather_bytes(model)
        return model
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


@contextlib.contextmanager
def no_grad_sync(module: nn.Module, skip: bool) -> Iterator[None]:
    """Under DDP, skip the gradient all-reduce of a backward that is not the last micro-batch of
    an optimizer step (the grads accumulate locally and the last backward reduces their sum).
    FSDP2 reduce-scatters every micro-batch: holding unsharded gradients would cost the memory
    it exists to save."""
    if skip and hasattr(module, "no_sync"):
        with module.no_sync():
            yield
    else:
        yield


@torch.no_grad()
def full_copy(model: nn.Module, plain: nn.Module) -> nn.Module:
    """Fill `plain` (an unsharded model with the same parameter names, e.g. built on the meta
    device and materialized) with the full fp32 weights of the sharded `model`; returns it.

    Collective: every rank must call it. One parameter is gathered at a time, so the peak is
    `plain` plus one full parameter.
    """
    targets = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        inner = getattr(full, "_tensor", None)  # WeightWithDynamicFloat8CastTensor keeps fp32 here
        targets[name].copy_(inner if isinstance(inner, torch.Tensor) else full)
    return plain


# --------------------------------------------------------------------------- tensor parallel
def tensor_parallel(model: nn.Module, mesh: DeviceMesh, plan: TPPlan) -> None:
    """Split `model` in place over the ranks of the 1-D `mesh`: each module `plan` names by its
    split's style (`_style`), then every parameter left whole as a replicated DTensor."""
    for name, split in plan.splits.items():
        module = model.get_submodule(name)
        parallelize_module(module, mesh, _style(module, split))
    _replicate_the_rest(model, mesh)


def _style(module: nn.Module, split: Split) -> ParallelStyle:
    """torch's style for `split`, or torchao's FP8 style for a tensorwise FP8 Linear, which casts
    the activation to FP8 once, by the style, with the scale of the whole tensor."""
    if split == "embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    tensorwise = (isinstance(module, Float8Linear)
                  and module.config.cast_config_input.scaling_granularity is ScalingGranularity.TENSORWISE)
    col, row = (Float8ColwiseParallel, Float8RowwiseParallel) if tensorwise else (ColwiseParallel, RowwiseParallel)
    if split == "head":
        return col(output_layouts=Replicate())
    return col() if split == "colwise" else row()


def _replicate_the_rest(model: nn.Module, mesh: DeviceMesh) -> None:
    """Every module whose own parameters no style split (norm weights; the embedding and the head
    when they stay whole) gets them as replicated DTensors, its inputs wrapped and its outputs
    unwrapped: each rank computes the same values from the same whole activations, and every
    parameter is a DTensor of one mesh, as the fused optimizer and the gradient norm need (one
    foreach kernel takes one kind of tensor). Their gradients are equal on every rank, since
    the column-split layers all-reduce the gradients of their inputs."""

    def wrap(module, inputs, device_mesh):
        return tuple(DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

    def unwrap(module, output, device_mesh):
        return output.to_local() if isinstance(output, DTensor) else output

    first, ties = {}, []  # a parameter under two names (a tied embedding and head): (second, first)
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            ties.append((name, first[id(p)]))
        first.setdefault(id(p), name)
    for module in model.modules():
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            distribute_module(module, mesh, input_fn=wrap, output_fn=unwrap)
    for name, source in ties:  # distribute_module gave each name its own parameter: one again
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, model.get_parameter(source))


__all__ = ["full_copy", "no_grad_sync", "tensor_parallel", "wrap_model"]
