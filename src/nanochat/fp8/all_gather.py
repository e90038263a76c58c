"""FP8 all-gather under FSDP2: whether a model's FP8 weights can be all-gathered in FP8, and gloo's transport.

Under FSDP2 with the tensorwise recipe and one weight format, torchao all-gathers each FP8
layer's weight already in FP8 (`WeightWithDynamicFloat8CastTensor`): the same numerics, since the
scale comes from the whole weight, at a quarter of fp32's bytes. It is the conversion's choice
(`FP8Config.fsdp_float8_all_gather`, torchao's `enable_fsdp_float8_all_gather`): torchao wraps the
weights as it converts them, so whoever shards asks `fp8_all_gather_problem` before converting.
Rowwise and the MXFP8 recipes scale per row or per block of the whole weight and all-gather in
high precision. gloo rejects float8 tensors, so there the all-gather moves their bytes
(`gather_bytes`); NCCL all-gathers float8 itself. docs/distributed.md has the measurements.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from nanochat.fp8 import _torchao  # noqa: F401  (first: torchao imported with its log noise muted)
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

# FSDP2's all-gather interface, the argument type of FSDPModule.set_custom_all_gather, lives in a
# private module in torch 2.11-2.13 (no public alias yet).
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from nanochat.config.fp8 import FP8Config
from nanochat.fp8.conversion import layers_to_convert


def fp8_all_gather_problem(model: nn.Module, config: FP8Config, *, shards: int, tp: int = 1) -> str | None:
    """None if the layers `convert(model, config)` will make FP8 can all-gather their weights in
    FP8 when FSDP2 shards them over `shards` ranks (1: no FSDP), each a group of `tp` ranks, else
    why not. Asked before converting: the answer is the FP8Config's `fsdp_float8_all_gather`."""
    if shards < 2:
        return "only under FSDP (--fsdp with torchrun)"
    if tp > 1:
        return (f"under --tp {tp} the weights are tensor-parallel DTensors, which torchao's FP8 all-gather does not "
                "wrap; FSDP gathers them in high precision")
    layers = layers_to_convert(model, config)
    if not layers:
        return "no FP8 layers"
    if config.recipe != "tensorwise":
        return (f"needs the tensorwise recipe (one scale per weight); {config.recipe} all-gathers the weights in "
                "high precision and casts them after the gather")
    uneven = [name for name, m in layers.items() if m.weight.shape[0] % shards]
    if uneven:
        # torchao 0.18 returns the last rank's shorter shard unpadded from its all-gather hook, and
        # the collective fails (pytorch/ao#3982; measured: d2 at 3 ranks, gloo size mismatch)
        return (f"{len(uneven)} FP8 weights (e.g. {uneven[0]}) have rows not divisible by {shards} "
                "ranks, which torchao's FP8 all-gather does not pad (pytorch/ao#3982)")
    if config.mode == "auto":
        return "--fp8_mode auto may give layers different weight formats after calibration"
    return None


def gather_bytes(model: nn.Module) -> None:
    """After FSDP2 sharded `model` on gloo: its FSDP modules all-gather uint8 views of their
    buffers (`ByteAllGather`) where its weights all-gather in FP8; nothing otherwise."""
    if not any(isinstance(getattr(p, "_local_tensor", p), WeightWithDynamicFloat8CastTensor)
               for p in model.parameters()):
        return
    for module in model.modules():
        if hasattr(module, "set_custom_all_gather"):
            module.set_custom_all_gather(ByteAllGather())


class ByteAllGather(AllGather):
    """FSDP2's all-gather on uint8 views of its buffers, for gloo, which rejects float8 tensors
    ("Invalid scalar type"); the same bytes move, so the result is the same. NCCL all-gathers
    float8 itself and does not need this."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return dist.all_gather_single(output_tensor.view(torch.uint8), input_tensor.view(torch.uint8),
                                      group=group, async_op=async_op)


__all__ = ["ByteAllGather", "fp8_all_gather_problem", "gather_bytes"]
