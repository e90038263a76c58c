"""Beyond one process: torchrun, DDP or FSDP2, FP8 all-gather.

    torchrun --nproc_per_node=8 scripts/base_train.py ...           # DDP
    torchrun --nproc_per_node=8 scripts/base_train.py --fsdp ...    # FSDP2

`init_distributed` joins the process group (NCCL on CUDA, gloo on CPU). Every rank reads its
share of each global batch and gradients are averaged, so the ranks together take the step one
process with world_size times the batch would. DDP (default) keeps the whole model on every
rank; FSDP2 (`fully_shard` per block, then the root) shards parameters, gradients and optimizer
state along dim 0.

Under FSDP2 with tensorwise FP8 and one weight format, weights are all-gathered in FP8
(torchao's `WeightWithDynamicFloat8CastTensor`, chosen at conversion by
`FP8Config.fsdp_float8_all_gather`; same numerics, a quarter of fp32's bytes); otherwise (rowwise,
the MXFP8 recipes, whose scales are per row or per block of the whole weight) they all-gather in
high precision and the run header says why. Evaluation under FSDP runs on an unsharded
high-precision copy (`full_copy`).

Distributed runs checkpoint with DCP: every rank writes its shards, and a checkpoint loads into
any world size (nanochat.checkpoint.dcp). The reasons, the measurements and the layout in full:
docs/distributed.md.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

# FSDP2's all-gather interface, the argument type of FSDPModule.set_custom_all_gather, lives in a
# private module in torch 2.11-2.13 (no public alias yet).
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from nanochat.common import DistEnv, NanoChatError, dist_env

if TYPE_CHECKING:
    from nanochat.config.fp8 import FP8Config

_owns_process_group = False


# --------------------------------------------------------------------------- process group
def init_distributed(device: torch.device) -> tuple[DistEnv, torch.device]:
    """Join torchrun's process group (NCCL on CUDA, gloo on CPU); returns (env, this rank's device).

    A no-op for a single process. An existing process group (created by the caller) is reused
    and stays the caller's to destroy; one created here is destroyed by `destroy_distributed`.
    """
    global _owns_process_group
    env = dist_env()
    if not env.is_distributed:
        return env, device
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"distributed training runs on cuda (NCCL) or cpu (gloo), not {device.type}; "
                         "pass --device cuda or --device cpu")
    if device.type == "cuda":
        if device.index is None:  # "--device cuda": one GPU per process, by local rank
            device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        store = _rendezvous_store(env)
        dist.init_process_group(backend=backend, store=dist.PrefixStore("default_pg", store), rank=env.rank,
                                world_size=env.world_size, device_id=device if device.type == "cuda" else None)
        if env.rank == 0:  # every rank has looked for it: the group is formed
            store.set(_GROUP_FORMED, "1")
        _owns_process_group = True
    if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
        raise RuntimeError(f"the process group (rank {dist.get_rank()} of {dist.get_world_size()}) does "
                           f"not match RANK={env.rank} WORLD_SIZE={env.world_size} from the environment")
    return env, device


_GROUP_FORMED = "nanochat/process_group_formed"
"""Set in the rendezvous store once a worker group's process group exists."""


def _rendezvous_store(env: DistEnv) -> dist.Store:
    """The store torchrun's environment names (torch's env:// rendezvous), where the process group
    forms: each rank publishes its address there. torch 2.13's torchrun keeps one store, shared
    with its workers, for every restart of the worker group (--max-restarts): a restarted group
    would read the dead group's addresses and fail to connect or hang (pytorch/pytorch#135712).
    That store still holds `_GROUP_FORMED` then, and the start is refused with the fix."""
    store, _, _ = next(dist.rendezvous("env://", rank=env.rank, world_size=env.world_size))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and store.check([_GROUP_FORMED]):
        raise NanoChatError(
            "torchrun restarted this worker group on the rendezvous store of the previous one, which still holds "
            "that group's addresses: its ranks would connect to dead processes and fail or hang (torch's store "
            "shared across restarts, pytorch/pytorch#135712). Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in "
            "torchrun's environment: each restart then gets a store of its own")
    return store


def release_wrapper(module: nn.Module) -> None:
    """Let a DDP wrapper go of the process group: its Reducer and Logger are dropped now, while the
    group is still registered. Call it when training is over, before the group is destroyed; the
    wrapper cannot run a step afterwards. FSDP and a bare module hold nothing to release.

    Why: gloo's process group joins its worker threads when its last owner lets go of it, and a
    worker may need the GIL to free the tensors of the collective it just ran. Python's handle on
    the group lets go with the GIL released; a Reducer (a C++ owner freed from Python) lets go
    with the GIL held, so if it is the last owner the join waits on a thread that waits on the
    GIL, forever. Dropping the Reducer first leaves the registry's handle as the last owner.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    if isinstance(module, DDP):
        for name in ("reducer", "logger"):  # the Logger holds the Reducer too
            if name in vars(module):
                delattr(module, name)


def destroy_distributed() -> None:
    """Destroy the process group if `init_distributed` created it (after `release_wrapper` of any
    DDP wrapper built on it)."""
    global _owns_process_group
    if _owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
    _owns_process_group = False


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over ranks, in place; returns it (a no-op for a single process)."""
    if is_distributed():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """Mean of `t` over ranks, in place (sum / world size: gloo has no AVG)."""
    if is_distributed():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= dist.get_world_size()
    return t


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` (a small picklable value: a verdict, a name) on every rank; `obj` itself
    in one process. Collective."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


RESTART_COUNTERS = {"torchelastic_restart_count": "TORCHELASTIC_RESTART_COUNT",
                    "slurm_restart_count": "SLURM_RESTART_COUNT"}
"""Who restarted this process, by the variable each launcher sets: torchrun for every restart of
its worker group (--max-restarts; 0 at its first start), slurm for every requeue of a job."""


def restart_counts() -> dict[str, int | None]:
    """This start's restart counters (RESTART_COUNTERS), None where the variable is unset."""
    out = {}
    for name, var in RESTART_COUNTERS.items():
        value = os.environ.get(var, "")
        out[name] = int(value) if value.isdigit() else None
    return out


def torchrun_restarts_left() -> int:
    """How many more times torchrun restarts this worker group, when a rank fails, into a group
    that can form: --max-restarts minus the restarts so far; 0 outside torchrun, and where its
    workers share its rendezvous store (`_rendezvous_store` refuses such a restart)."""
    most, done = os.environ.get("TORCHELASTIC_MAX_RESTARTS", ""), os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    if not (most.isdigit() and done.isdigit()) or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return 0
    return int(most) - int(done)


_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused",
              "NCCL communicator was aborted", "remote process exited")
"""What gloo's TCP transport and NCCL say when another rank's process is gone (gloo's pair.cc;
NCCL's abort after its watchdog or a peer's exit)."""


def lost_peer(e: BaseException) -> str | None:
    """A short reason when `e` is a collective that failed because another rank's process died
    or was killed (the run cannot go on; its checkpoints can), else None."""
    text = str(e)
    if not isinstance(e, RuntimeError) or isinstance(e, NanoChatError):
        return None
    if not (isinstance(e, dist.DistError) or "gloo" in text or "NCCL" in text):
        return None
    said = next((s for s in _PEER_GONE if s in text), None)
    if said is None:
        return None
    backend = "gloo" if "gloo" in text else "NCCL" if "NCCL" in text else backend_name()
    return f"{backend}: {said}"


def backend_name() -> str:
    return dist.get_backend() if is_distributed() else "none"


# ---------------------------------------------------------------------------------- wrapping
def wrap_model(model: nn.Module, *, fsdp: bool, device: torch.device,
               blocks: Iterable[nn.Module]) -> nn.Module:
    """The module to train with: `model` itself (one process), DDP around it, or, with `fsdp`,
    `model` sharded in place by fully_shard on each of `blocks` and then on the root.

    Under DDP keep using `model` (the unwrapped module) for evaluation and state dicts; under
    FSDP `model` *is* the sharded module (fully_shard changes it in place).
    """
    if not is_distributed():
        return model
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in blocks:
            fully_shard(block)
        fully_shard(model)  # the root: embedding, final norm, lm_head
        if _has_fp8_all_gather(model) and dist.get_backend() == "gloo":
            for module in model.modules():
                if hasattr(module, "set_custom_all_gather"):
                    module.set_custom_all_gather(_ByteAllGather())
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

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


def local_numel(p: torch.Tensor) -> int:
    """Elements this rank holds of `p` (its shard under FSDP)."""
    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


# --------------------------------------------------------------------------- FP8 all-gather
def fp8_all_gather_problem(model: nn.Module, config: FP8Config, *, fsdp: bool) -> str | None:
    """None if the layers `convert(model, config)` will make FP8 can all-gather their weights in
    FP8 under FSDP2, else why not. Asked before converting: the answer is the FP8Config's
    `fsdp_float8_all_gather`, which torchao applies at conversion (the weights are wrapped then)."""
    from nanochat.fp8.linear import layers_to_convert

    if not fsdp or not is_distributed():
        return "only under FSDP (--fsdp with torchrun)"
    layers = layers_to_convert(model, config)
    if not layers:
        return "no FP8 layers"
    if config.recipe != "tensorwise":
        return (f"needs the tensorwise recipe (one scale per weight); {config.recipe} all-gathers the weights in "
                "high precision and casts them after the gather")
    world = dist.get_world_size()
    uneven = [name for name, m in layers.items() if m.weight.shape[0] % world]
    if uneven:
        # torchao 0.18 returns the last rank's shorter shard unpadded from its all-gather hook, and
        # the collective fails (pytorch/ao#3982; measured: d2 at 3 ranks, gloo size mismatch)
        return (f"{len(uneven)} FP8 weights (e.g. {uneven[0]}) have rows not divisible by {world} "
                "ranks, which torchao's FP8 all-gather does not pad (pytorch/ao#3982)")
    if config.mode == "auto":
        return "--fp8_mode auto may give layers different weight formats after calibration"
    return None


def _has_fp8_all_gather(model: nn.Module) -> bool:
    import nanochat.fp8._torchao  # noqa: F401  (first torchao import of a run: mutes its log noise)
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return any(isinstance(getattr(p, "_local_tensor", p), WeightWithDynamicFloat8CastTensor)
               for p in model.parameters())


class _ByteAllGather(AllGather):
    """FSDP2's all-gather on uint8 views of its buffers, for gloo, which rejects float8 tensors
    ("Invalid scalar type"); the same bytes move, so the result is the same. NCCL all-gathers
    float8 itself and does not need this."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return dist.all_gather_single(output_tensor.view(torch.uint8), input_tensor.view(torch.uint8),
                                      group=group, async_op=async_op)


# ------------------------------------------------------------------------- full (eval) copy
@torch.no_grad()
def full_copy(model: nn.Module, plain: nn.Module) -> nn.Module:
    """Fill `plain` (an unsharded model with the same parameter names, e.g. built on the meta
    device and materialized) with the full fp32 weights of the FSDP-sharded `model`; returns it.

    Collective: every rank must call it. One parameter is gathered at a time, so the peak is
    `plain` plus one full parameter.
    """
    targets = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        inner = getattr(full, "_tensor", None)  # WeightWithDynamicFloat8CastTensor keeps fp32 here
        targets[name].copy_(inner if isinstance(inner, torch.Tensor) else full)
    return plain


__all__ = [
    "init_distributed", "release_wrapper", "destroy_distributed", "is_distributed", "barrier", "all_reduce_sum",
    "all_reduce_mean", "broadcast_object", "restart_counts", "torchrun_restarts_left", "lost_peer", "backend_name",
    "wrap_model", "no_grad_sync", "local_numel", "fp8_all_gather_problem", "full_copy", "DTensor",
]
