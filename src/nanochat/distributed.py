"""Beyond one process: torchrun, DDP or FSDP2, tensor parallelism, FP8 all-gather.

    torchrun --nproc_per_node=8 scripts/base_train.py ...                # DDP
    torchrun --nproc_per_node=8 scripts/base_train.py --fsdp ...         # FSDP2
    torchrun --nproc_per_node=8 scripts/base_train.py --fsdp --tp 2 ...  # FSDP2 x 4, TP x 2

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

With `--tp N` the ranks form a 2-D mesh (data parallel x tensor parallel, N consecutive ranks
per tensor-parallel group, so a group stays within a node): each block's q/k/v and first MLP
Linear split their output features over the group (column-wise), the two output projections
their input features (row-wise, one all-reduce each), Megatron's layout; the embedding and the
head split the vocabulary where it divides (`tensor_parallel`). FP8 layers of the tensorwise
recipe use torchao's FP8 styles (activations cast once before the collective); rowwise layers
take the plain styles. The data-parallel dimension is FSDP2 (`--fsdp`) or absent.

Distributed runs checkpoint with DCP: every rank writes its shards, and a checkpoint loads into
any world size (nanochat.checkpoint.dcp). The reasons, the measurements and the layout in full:
docs/distributed.md.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

# FSDP2's all-gather interface, the argument type of FSDPModule.set_custom_all_gather, lives in a
# private module in torch 2.11-2.13 (no public alias yet).
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from nanochat.common import DistEnv, NanoChatError, dist_env

if TYPE_CHECKING:
    from nanochat.config.fp8 import FP8Config
    from nanochat.model.gpt import GPT, GPTConfig

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
@dataclass(frozen=True)
class Layout:
    """How a run spreads its model over the processes: `fsdp` shards it over the data-parallel
    ranks (with --tp: over the groups); `name` is the run header's
    (`layout_name`), `fallbacks` what was asked and not done, with the reason."""

    fsdp: bool
    name: str
    fallbacks: tuple[str, ...] = ()


def layout_name(*, fsdp: bool, dp: int, tp: int = 1) -> str:
    """'ddp x2 (gloo)', 'fsdp x8 (nccl)', 'tp 2 (gloo)', 'fsdp 2 x tp 2 (gloo)'."""
    name = f"{'fsdp' if fsdp else 'ddp'} x{dp}" if tp == 1 else f"{f'fsdp {dp} x ' if fsdp else ''}tp {tp}"
    return f"{name} ({backend_name()})"


def plan_layout(*, fsdp: bool, tp: int, env: DistEnv, config: GPTConfig) -> Layout:
    """The Layout of --fsdp and --tp for this world (`env`) and model (checked before any work:
    tp_problem)."""
    if not env.is_distributed:
        why = () if not fsdp else ("fsdp: --fsdp ignored in a single process (launch with torchrun "
                                   "--nproc_per_node=N to shard)",)
        return Layout(fsdp=False, name="none", fallbacks=why)
    notes = []
    if fsdp and env.dp_size == 1:
        notes.append(f"fsdp: --fsdp ignored: --tp {tp} on {env.world_size} ranks leaves one data-parallel group, "
                     "nothing to shard over")
    if tp > 1 and (whole := vocab_parallel_problem(config, tp)) is not None:
        notes.append(f"tp: {whole}")
    fsdp = fsdp and env.dp_size > 1
    return Layout(fsdp=fsdp, name=layout_name(fsdp=fsdp, dp=env.dp_size, tp=tp), fallbacks=tuple(notes))


def wrap_model(model: nn.Module, *, fsdp: bool, device: torch.device,
               blocks: Iterable[nn.Module], tp: int = 1) -> nn.Module:
    """The module to train with: `model` itself (one process), DDP around it, or, with `fsdp`,
    `model` sharded in place by fully_shard on each of `blocks` and then on the root. With `tp`
    > 1 (a GPT), `model` is first split in place over groups of `tp` ranks (`tensor_parallel`),
    then sharded by FSDP over the groups when `fsdp` and there is more than one.

    Under DDP keep using `model` (the unwrapped module) for evaluation and state dicts; under
    FSDP and TP `model` *is* the sharded module (they change it in place).
    """
    if not is_distributed():
        return model
    mesh = None
    if tp > 1:
        if dist.get_world_size() > tp and not fsdp:
            raise ValueError(tp_problem(model.config, tp, world_size=dist.get_world_size(), fsdp=False))
        mesh = init_device_mesh(device.type, (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp"))
        tensor_parallel(model, mesh["tp"])
        if mesh["dp"].size() == 1:
            return model
        mesh = mesh["dp"]
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)  # the root: embedding, final norm, lm_head
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


# --------------------------------------------------------------------------- tensor parallel
def tp_problem(config: GPTConfig, tp: int, *, world_size: int, fsdp: bool) -> str | None:
    """Why a GPT of `config` cannot train with `--tp tp` on `world_size` ranks, else None: the
    heads and the MLP's hidden features must split evenly, the ranks form whole groups, and the
    data-parallel dimension, if any, is FSDP's (DDP does not reduce gradients of DTensor shards)."""
    if tp == 1:
        return None
    if world_size == 1:
        return (f"--tp {tp} splits each layer over {tp} processes, and this is one; launch with torchrun "
                f"--nproc_per_node={tp} (or more, a multiple of {tp}, with --fsdp)")
    if world_size % tp:
        return f"--tp {tp} on {world_size} ranks: the world size must be a multiple of --tp; launch a multiple of {tp} processes"
    if world_size > tp and not fsdp:
        return (f"--tp {tp} on {world_size} ranks leaves {world_size // tp} data-parallel groups, which need --fsdp "
                "(DDP does not reduce gradients of tensor-parallel shards); add --fsdp, or launch "
                f"--nproc_per_node={tp}")
    sizes = {"n_head": config.n_head, "n_kv_head": config.n_kv_head, "intermediate_size": config.intermediate_size}
    bad = [f"{name} {n}" for name, n in sizes.items() if n % tp]
    if bad:
        return (f"--tp {tp}: the model's {', '.join(bad)} do not divide by {tp}, and each rank must hold whole heads "
                f"and an equal share of the MLP; choose --tp among the common divisors (e.g. "
                f"{math.gcd(*sizes.values())} or a divisor of it)")
    return None


def vocab_parallel_problem(config: GPTConfig, tp: int) -> str | None:
    """Why the embedding and the head of `config` stay whole on every rank under `--tp tp`,
    else None (they split the vocabulary)."""
    if config.tie_embeddings:
        return "tied embedding and head stay whole on every rank under --tp (one weight, two layouts)"
    if config.vocab_size % tp:
        return (f"the vocabulary ({config.vocab_size}) does not divide by --tp {tp}: the embedding and the head "
                "stay whole on every rank")
    return None


def tensor_parallel(model: GPT, mesh: DeviceMesh) -> None:
    """Split `model` in place over the ranks of the 1-D `mesh`: per block, q/k/v, the MLP's
    c_fc (and c_gate) column-wise, the attention's and the MLP's c_proj row-wise, so the
    residual stream stays whole on every rank and each block costs two all-reduces forward and
    two backward; the embedding row-wise and the head column-wise over the vocabulary where
    `vocab_parallel_problem` allows, their outputs gathered whole. The attention reads its head
    count from the projections' local width (nanochat.model.gpt)."""
    from torch.distributed.tensor.parallel import parallelize_module

    col, row = _tp_styles()
    for block in model.transformer.h:
        plan = {name: col(block.get_submodule(name)) for name in ("attn.c_q", "attn.c_k", "attn.c_v", "mlp.c_fc")}
        if block.mlp.c_gate is not None:
            plan["mlp.c_gate"] = col(block.mlp.c_gate)
        plan.update({name: row(block.get_submodule(name)) for name in ("attn.c_proj", "mlp.c_proj")})
        parallelize_module(block, mesh, plan)
    if vocab_parallel_problem(model.config, mesh.size()) is None:
        from torch.distributed.tensor.parallel import RowwiseParallel

        parallelize_module(model, mesh, {
            "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": col(model.lm_head, output_layouts=Replicate()),
        })
    _replicate_the_rest(model, mesh)


def _replicate_the_rest(model: nn.Module, mesh: DeviceMesh) -> None:
    """Every module whose own parameters no style split (norm weights; the embedding and the head
    when they stay whole) gets them as replicated DTensors, its inputs wrapped and its outputs
    unwrapped: each rank computes the same values from the same whole activations, and every
    parameter is a DTensor of one mesh, as the fused optimizer and the gradient norm need (one
    foreach kernel takes one kind of tensor). Their gradients are equal on every rank, since
    the column-split layers all-reduce the gradients of their inputs."""
    from torch.distributed.tensor import distribute_module

    def wrap(module, inputs, device_mesh):
        return tuple(DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

    def unwrap(module, output, device_mesh):
        return output.to_local() if isinstance(output, DTensor) else output

    for module in model.modules():
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            distribute_module(module, mesh, input_fn=wrap, output_fn=unwrap)
    if model.config.tie_embeddings:  # distribute_module gave each its own parameter: one again
        model.lm_head.weight = model.transformer.wte.weight


def _tp_styles():
    """(column-wise, row-wise) style makers for a Linear: torchao's FP8 styles for its tensorwise
    FP8 layers (the activation is cast to FP8 once, by the style, with the scale of the whole
    tensor), torch's plain styles for everything else (a rowwise FP8 layer casts inside)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    import nanochat.fp8._torchao  # noqa: F401
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    def tensorwise(m: nn.Module) -> bool:
        return (isinstance(m, Float8Linear)
                and m.config.cast_config_input.scaling_granularity is ScalingGranularity.TENSORWISE)

    def col(m: nn.Module, **kw):
        return (Float8ColwiseParallel if tensorwise(m) else ColwiseParallel)(**kw)

    def row(m: nn.Module, **kw):
        return (Float8RowwiseParallel if tensorwise(m) else RowwiseParallel)(**kw)

    return col, row


# --------------------------------------------------------------------------- FP8 all-gather
def fp8_all_gather_problem(model: nn.Module, config: FP8Config, *, fsdp: bool, tp: int = 1) -> str | None:
    """None if the layers `convert(model, config)` will make FP8 can all-gather their weights in
    FP8 under FSDP2, else why not. Asked before converting: the answer is the FP8Config's
    `fsdp_float8_all_gather`, which torchao applies at conversion (the weights are wrapped then)."""
    from nanochat.fp8.linear import layers_to_convert

    if not fsdp or not is_distributed():
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
    "Layout", "layout_name", "plan_layout", "wrap_model", "tp_problem", "vocab_parallel_problem", "tensor_parallel",
    "no_grad_sync", "local_numel", "fp8_all_gather_problem", "full_copy", "DTensor",
]
