"""The process group: joining torchrun's ranks, the collectives every layer uses, restarts.

`init_distributed` joins the ranks torchrun started into one process group (NCCL on CUDA, gloo
on CPU); `destroy_distributed` ends one it created. The collectives (`barrier`,
`all_reduce_sum`, `broadcast_object`...) are no-ops in one process, so a checkpoint read or an
evaluation calls them whether or not it runs under torchrun. torchrun's and slurm's restarts
are counted for the run's start records, and a collective that failed because another rank died
is told from other errors (`lost_peer`), so the survivors end with one line instead of a hang.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from nanochat.common import DistEnv, NanoChatError, dist_env

_owns_process_group = False


# --------------------------------------------------------------------------- process group
def init_distributed(device: torch.device) -> tuple[DistEnv, torch.device]:
    """Join torchrun's process group (NCCL on CUDA, gloo on CPU); returns (env, this rank's device).

    A no-op for a single process. An existing process group (created by the caller) is reused
    and stays the caller's to destroy; one created here is destroyed by `destroy_distributed`.
    """
    global _owns_process_group
    env = dist_env()
    if env.world_size == 1:
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
    on the same keys would read the dead group's addresses and fail to connect or hang
    (pytorch/pytorch#135712). So each restart forms its group under a prefix of its own,
    `restart-<TORCHELASTIC_RESTART_COUNT>/`. A group restarted because a node joined or left keeps
    torchrun's restart count (its agent restarts it without spending a restart): that start finds
    `_GROUP_FORMED` under its prefix and is refused with the fix."""
    store, _, _ = next(dist.rendezvous("env://", rank=env.rank, world_size=env.world_size))
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"nanochat/restart-{restart}", store)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and store.check([_GROUP_FORMED]):
        raise NanoChatError(
            f"torchrun restarted this worker group (restart {restart}) on the rendezvous store of a group of the same "
            "restart count, which still holds that group's addresses: a node joined or left, which torchrun does "
            "not count as a restart, and its ranks would connect to dead processes and fail or hang "
            "(pytorch/pytorch#135712). Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment for "
            "elastic node counts: each rendezvous then gets a store of its own")
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
    """Whether this process is one of several in a process group: the collectives run only then.
    A training run's decisions read its Layout (nanochat.parallel.layout), planned from the same
    group."""
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
    that can form: --max-restarts minus the restarts so far; 0 outside torchrun. Each restart
    forms its group under a store prefix of its own (`_rendezvous_store`)."""
    most, done = os.environ.get("TORCHELASTIC_MAX_RESTARTS", ""), os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    if not (most.isdigit() and done.isdigit()):
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


__all__ = [
    "init_distributed", "release_wrapper", "destroy_distributed", "is_distributed", "barrier", "all_reduce_sum",
    "all_reduce_mean", "broadcast_object", "RESTART_COUNTERS", "restart_counts", "torchrun_restarts_left",
    "lost_peer", "backend_name",
]
