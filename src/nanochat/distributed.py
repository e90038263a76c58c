"""Beyond one process: torchrun, DDP or FSDP2, FP8 all-gather, distributed checkpoints.

    torchrun --nproc_per_node=8 scripts/base_train.py ...           # DDP
    torchrun --nproc_per_node=8 scripts/base_train.py --fsdp ...    # FSDP2

`init_distributed` joins the process group (NCCL on CUDA, gloo on CPU). Every rank reads its
share of each global batch and gradients are averaged, so the ranks together take the step one
process with world_size times the batch would. DDP (default) keeps the whole model on every
rank; FSDP2 (`fully_shard` per block, then the root) shards parameters, gradients and optimizer
state along dim 0.

Under FSDP2 with tensorwise FP8 and one weight format, weights are all-gathered in FP8
(torchao's `WeightWithDynamicFloat8CastTensor`, chosen at conversion by
`FP8Config.fsdp_float8_all_gather`; same numerics, a quarter of fp32's bytes); otherwise the run
header says why not. Evaluation under FSDP runs on an unsharded high-precision copy (`full_copy`).

Distributed runs checkpoint with DCP (`<run_dir>/checkpoint_dcp/step-N/` plus a LATEST pointer
replaced atomically): every rank writes its shards, and a checkpoint loads into any world size.
After a barrier rank 0 hashes every file of the step directory into its `manifest.json` (sha256
and size; the shards were written by other processes, so they are read back, streamed). That
manifest is the commit: a step directory without one is an interrupted save, removed at the next
start and never named by LATEST. Resume verifies the files before loading and refuses a mismatch,
naming the file and the previous step that verifies; the newest --keep_checkpoints steps are kept.
The reasons, the measurements and the layout in full: docs/distributed.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

# FSDP2's all-gather interface, the argument type of FSDPModule.set_custom_all_gather, lives in a
# private module in torch 2.11-2.13 (no public alias yet).
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from nanochat import rundir as runlock
from nanochat.common import DistEnv, NanoChatError, dist_env, file_problem, file_sha256, fsync_path, write_atomic
from nanochat.optim import OptimWrapper, QuantizedState, dense

if TYPE_CHECKING:
    from nanochat.config.fp8 import FP8Config

DCP_DIRNAME = "checkpoint_dcp"
"""Where distributed runs keep their DCP checkpoints, inside the run directory."""
LATEST = "LATEST"
META_NAME = "trainer.json"
MANIFEST_NAME = "manifest.json"
_STEP_DIR = re.compile(r"step-(\d+)(?:-(\d+))?")  # step-000200, or step-000200-2 for a re-save
_OWN_TEMP = re.compile(r"\.tmp-step-\d+(?:-\d+)?-\d+-[0-9a-f]+")  # a save's directory until its commit

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
        dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
        _owns_process_group = True
    if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
        raise RuntimeError(f"the process group (rank {dist.get_rank()} of {dist.get_world_size()}) does "
                           f"not match RANK={env.rank} WORLD_SIZE={env.world_size} from the environment")
    return env, device


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
        return "needs the tensorwise recipe (one scale per weight); rowwise all-gathers fp32"
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


# ------------------------------------------------------------------------------ checkpoints
def dcp_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / DCP_DIRNAME


def _order(path: Path) -> tuple[int, int]:
    m = _STEP_DIR.fullmatch(path.name)
    return int(m.group(1)), int(m.group(2) or 1)


def dcp_step(path: str | os.PathLike) -> int:
    """The step of a DCP step directory, from its name (readable even when its files are not)."""
    return _order(Path(path))[0]


def list_dcp(run_dir: str | os.PathLike) -> list[Path]:
    """Committed DCP step directories of `run_dir` (those with a manifest), oldest first."""
    root = dcp_root(run_dir)
    found = [p for p in root.glob("step-*") if _STEP_DIR.fullmatch(p.name) and (p / MANIFEST_NAME).is_file()]
    return sorted(found, key=_order)


def latest_dcp(run_dir: str | os.PathLike) -> Path | None:
    """The step directory LATEST names, or None when there is no DCP checkpoint.

    When LATEST is missing, or names a directory that was deleted (what the error about a damaged
    step tells the user to do), the newest committed step directory is the latest: its manifest,
    written before LATEST moves, is the commit."""
    pointer = dcp_root(run_dir) / LATEST
    if pointer.is_file():
        path = dcp_root(run_dir) / json.loads(pointer.read_text())["dir"]
        if path.is_dir():
            return path
    committed = list_dcp(run_dir)
    return committed[-1] if committed else None


def uncommitted_dcp(run_dir: str | os.PathLike) -> list[Path]:
    """Step directories without a manifest, oldest first: never loaded, never deleted. (The one
    LATEST names is not among them: it was published, by a nanochat that wrote no manifests, and
    resuming from it explains that it cannot be verified.)"""
    root = dcp_root(run_dir)
    if not root.is_dir():
        return []
    pointer = root / LATEST
    published = json.loads(pointer.read_text())["dir"] if pointer.is_file() else None
    found = [p for p in root.glob("step-*") if _STEP_DIR.fullmatch(p.name) and p.is_dir()
             and not (p / MANIFEST_NAME).is_file() and p.name != published]
    return sorted(found, key=_order)


def clean_interrupted_dcp(run_dir: str | os.PathLike) -> list[str]:
    """Remove the temporary step directories killed saves left, under the run lock (runlock.py
    says why that proves them ours); returns one line per directory for the log. Step directories
    without a manifest and other temporaries are reported and left alone."""
    root = dcp_root(run_dir)
    if not root.is_dir():
        return []
    notes = []
    with runlock.holding(run_dir):
        for p in sorted(root.iterdir()):
            if p.is_dir() and _OWN_TEMP.fullmatch(p.name):
                shutil.rmtree(p)
                notes.append(f"removed {p}, left by an interrupted save")
            elif p.name.startswith(".tmp-"):
                notes.append(f"left {p} alone: not a temporary name of this nanochat's saves; delete it if no "
                             f"other program writes {run_dir}")
        for p in uncommitted_dcp(run_dir):
            notes.append(f"left {p} alone: it has no {MANIFEST_NAME}, so nanochat neither loads nor deletes it; "
                         "restore its manifest or move it away")
    return notes


def _dcp_manifest_problem(path: Path) -> str | None:
    """None when step directory `path`'s manifest describes it: its step, and exactly its files
    with their sizes. Cheap (no file is read): what deleting a step directory requires."""
    try:
        manifest = json.loads((path / MANIFEST_NAME).read_text())
        files = {name: int(e["bytes"]) for name, e in manifest["files"].items()}
        step = int(manifest["step"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"its {MANIFEST_NAME} is unreadable or missing ({type(e).__name__}: {e})"
    if step != dcp_step(path):
        return f"its manifest is of step {step}: it was renamed or copied under another step's name"
    present = {f.name: f.stat().st_size for f in path.iterdir() if f.name != MANIFEST_NAME}
    if present != files:
        return "its files are not those its manifest lists (added, removed or resized)"
    return None


def foreign_dcp(run_dir: str | os.PathLike) -> list[str]:
    """The DCP step directories nanochat cannot prove it wrote, each with the reason: what
    --overwrite refuses to delete."""
    root = dcp_root(run_dir)
    steps = [p for p in root.glob("step-*") if _STEP_DIR.fullmatch(p.name) and p.is_dir()] if root.is_dir() else []
    out = []
    for p in sorted(steps, key=_order):
        problem = _dcp_manifest_problem(p)
        if problem is not None:
            out.append(f"{DCP_DIRNAME}/{p.name} ({problem})")
    return out


def remove_dcp(run_dir: str | os.PathLike) -> None:
    """Delete the DCP checkpoints of `run_dir` whose manifests describe them (manifest first, so
    none is half-deleted), then LATEST and the directory once nothing else is left in it."""
    root = dcp_root(run_dir)
    if not root.is_dir():
        return
    with runlock.holding(run_dir):
        for p in list_dcp(run_dir):
            if _dcp_manifest_problem(p) is None:
                (p / MANIFEST_NAME).unlink()
                shutil.rmtree(p)
        if not any(p.name != LATEST for p in root.iterdir()):
            (root / LATEST).unlink(missing_ok=True)
            root.rmdir()


def _write_manifest(path: Path, step: int) -> None:
    """Hash every file of step directory `path` into its manifest, atomically: the commit."""
    files = {}
    for f in sorted(path.iterdir()):
        if f.is_file() and f.name != MANIFEST_NAME:
            sha, size = file_sha256(f)
            files[f.name] = {"sha256": sha, "bytes": size}
    write_atomic(path / MANIFEST_NAME, json.dumps({"step": step, "files": files}, indent=1), fsync=True)


def dcp_problem(path: str | os.PathLike) -> str | None:
    """None when every file of step directory `path` matches its manifest, else which does not
    and why. Reads every file (this process alone: see `verify_dcp` for a group)."""
    path = Path(path)
    manifest = path / MANIFEST_NAME
    if not manifest.is_file():
        return (f"it has no {MANIFEST_NAME}, so its files cannot be verified (written by a nanochat "
                "that did not checksum DCP checkpoints, or modified by hand)")
    try:
        files = json.loads(manifest.read_text())["files"]
        entries = [(name, e["sha256"], int(e["bytes"])) for name, e in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"its manifest {manifest} is unreadable ({e})"
    for name, sha, size in entries:
        problem = file_problem(path / name, sha, size)
        if problem is not None:
            return f"file {path / name}: {problem}"
    return None


def verify_dcp(path: str | os.PathLike) -> None:
    """Check step directory `path` against its manifest; raise a NanoChatError naming the bad file
    and the previous DCP step that verifies. Collective when distributed: rank 0 reads the files
    once and broadcasts the verdict (every rank reading them would multiply a shared filesystem's
    traffic by the world size)."""
    path = Path(path)
    message = None
    if dist_env().rank == 0:
        problem = dcp_problem(path)
        if problem is not None:
            run_dir = path.parent.parent  # <run_dir>/checkpoint_dcp/step-N
            prev = next((p for p in reversed(list_dcp(run_dir)) if _order(p) < _order(path)
                         and dcp_problem(p) is None), None)
            if prev is None:
                fix = "no earlier DCP checkpoint verifies; start again with --overwrite"
            else:
                fix = (f"the previous DCP checkpoint {prev} (step {dcp_step(prev)}) verifies: delete {path} "
                       f"and run again with --resume to continue from step {dcp_step(prev)}")
            message = f"DCP checkpoint {path} (step {dcp_step(path)}) is not usable: {problem}; {fix}"
    if is_distributed():
        box = [message]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
    if message is not None:
        raise NanoChatError(message)


def last_good_dcp(run_dir: str | os.PathLike, *, finite: bool = False) -> Path | None:
    """The newest DCP step directory whose files verify and, with `finite`, whose tensors hold no
    inf/nan (this process reads them)."""
    return next((p for p in reversed(list_dcp(run_dir))
                 if dcp_problem(p) is None and not (finite and dcp_nonfinite(p))), None)


def dcp_nonfinite(path: str | os.PathLike) -> list[str]:
    """The tensors of step directory `path` (weights, optimizer states) that hold inf/nan, read
    one at a time in this process (memory: the largest tensor, whatever the world size was)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    bad = []
    for key, md in dcp.FileSystemReader(path).read_metadata().state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata) or not md.properties.dtype.is_floating_point:
            continue
        one = {key: torch.empty(md.size, dtype=md.properties.dtype)}
        with _single_process_quiet():
            dcp.load(one, checkpoint_id=path, no_dist=True)
        if not torch.isfinite(one[key]).all():
            bad.append(key)
    return bad


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    # Keys are parameter names (FQNs), the same for DDP (no "module." prefix), FSDP and a single
    # process; tensors are DTensors under FSDP (DCP saves each rank's shard), plain otherwise.
    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


def save_dcp(run_dir: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, *,
             step: int, meta: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None,
             keep: int = 2) -> Path:
    """Write model, optimizer, `tensors` (e.g. RNG states) and JSON `meta` as a DCP checkpoint,
    commit it with its manifest, point LATEST at it, and keep only the newest `keep` steps.

    Collective: every rank calls it with the same step. Rank 0 holds the run lock meanwhile. The
    ranks write into a temporary directory of rank 0's naming, which is renamed to its step's
    name once its manifest is written: that rename is the commit. Returns the step directory.
    """
    import torch.distributed.checkpoint as dcp

    root = dcp_root(run_dir)
    rank0 = dist_env().rank == 0
    box: list[Any] = _claim_step_name(run_dir, root, step) if rank0 else [None, None, None]
    if is_distributed():
        dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise NanoChatError(box[0])
    final, tmp = root / box[1], root / box[2]
    try:
        if rank0:
            tmp.mkdir()
        barrier()  # the directory exists before any rank writes into it
        state = _state_dicts(model, optimizer)
        state["extra"] = dict(tensors or {})
        with _single_process_quiet():
            dcp.save(state, checkpoint_id=tmp, no_dist=not is_distributed())
        barrier()  # every rank's shards are written before rank 0 hashes and commits them
        if rank0:
            _commit_dcp(run_dir, tmp, final, step=step, meta=meta, keep=keep)
        barrier()
    except BaseException:
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)  # ours, never committed
        raise
    finally:
        if rank0:
            runlock.release(run_dir)
    return final


def _claim_step_name(run_dir: str | os.PathLike, root: Path, step: int) -> list[Any]:
    """Rank 0, before a DCP save: take the run lock and name the step directory and its temporary;
    [error or None, step directory name, temporary name], what save_dcp broadcasts."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        runlock.acquire(run_dir)
    except (OSError, NanoChatError) as e:
        return [f"cannot save the DCP checkpoint of step {step} in {root}: {e}", None, None]
    name, n = f"step-{step:06d}", 1
    while (root / name).exists():  # this step saved before (a resumed run): never overwrite it
        n += 1
        name = f"step-{step:06d}-{n}"
    return [None, name, f".tmp-{name}-{os.getpid()}-{secrets.token_hex(4)}"]


def _commit_dcp(run_dir: str | os.PathLike, tmp: Path, final: Path, *, step: int, meta: dict[str, Any],
                keep: int) -> None:
    """Rank 0, once every shard is written: meta and manifest, the rename that commits, LATEST,
    then the rotation to the newest `keep` steps this code can tell it wrote."""
    root = final.parent
    (tmp / META_NAME).write_text(json.dumps({**meta, "step": step}, indent=1))
    _fsync_tree(tmp)
    _write_manifest(tmp, step)
    fsync_path(tmp)
    os.rename(tmp, final)  # the commit (DCP's index names its files relative to the directory)
    fsync_path(root)
    write_atomic(root / LATEST, json.dumps({"dir": final.name, "step": step}), fsync=True)
    fsync_path(root)
    ours = [p for p in list_dcp(run_dir) if _dcp_manifest_problem(p) is None]  # counted, deletable
    for old in ours[:-keep] if keep > 0 else []:
        (old / MANIFEST_NAME).unlink()  # uncommit first: a kill midway leaves no half step
        shutil.rmtree(old)


def load_dcp(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, *,
             tensors: dict[str, torch.Tensor] | None = None, verify: bool = True) -> dict[str, Any]:
    """Load a DCP step directory into `model` and `optimizer` (any world size, FSDP, DDP or one
    process) and into the `tensors` templates (in place); returns its JSON meta.

    Collective when distributed. Verifies the files against the manifest first (`verify_dcp`)
    unless `verify` is False (the caller did). Loads into existing tensors: `get_optimizer_state_dict`
    creates the optimizer's state first when it has none (a step with lr=0 and zero grads).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    path = Path(path)
    if verify:
        verify_dcp(path)
    state = _state_dicts(model, optimizer)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    block_size = optimizer.block_size if isinstance(optimizer, OptimWrapper) else None
    full = _fp32_templates(state["optimizer"]["state"], saved, model, block_size)
    state["extra"] = dict(tensors or {})
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=path, no_dist=not is_distributed())
    for current, k, p in full:  # every rank holds the whole tensor: keep this rank's rows
        if isinstance(p, DTensor):
            current[k] = distribute_tensor(current[k], p.device_mesh, p.placements, src_data_rank=None)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    if tensors is not None:
        tensors.update(state["extra"])
    return json.loads((path / META_NAME).read_text())


def load_dcp_model(path: str | os.PathLike, model: nn.Module) -> None:
    """Load only the model weights of a verified DCP step directory into `model` (a plain, unwrapped
    model in this process): DCP reads just the requested keys, so the optimizer state is never
    read. Every rank of a group reads them whole (before wrapping, as from a .pt checkpoint)."""
    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict()}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=Path(path), no_dist=True)
    model.load_state_dict(state["model"])


def _fp32_templates(optim_state: dict[str, dict[str, Any]], saved: dict[str, Any], model: nn.Module,
                    block_size: int | None) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
    """Adjust the optimizer template, in place, where the checkpoint's moments cannot load as the
    optimizer holds them; returns the (state, key, param) entries given full fp32 templates.

    A quantized moment (nanochat.optim.QuantizedState, e.g. FP8) is whole `block_size`-element
    blocks and slices only on block boundaries. So a moment loads into a full, unsharded fp32
    template (DCP then reads whole saved chunks and dequantizes them), and is resharded and
    requantized by the optimizer's load_state_dict afterwards, when
    - the checkpoint holds it under a name this optimizer does not use now (a tensor whose
      shards were not whole blocks kept fp32 state; nanochat.optim.state names the states), or
    - the saved chunks or this run's shards do not start and end on block boundaries.
    Otherwise (the usual case) quantized codes and scales load as they are, without requantization.
    """
    def whole_blocks(starts_ends: list[int], row: int) -> bool:
        return block_size is None or all((r * row) % block_size == 0 for r in starts_ends)

    full = []
    for fqn, p in model.named_parameters():
        current = optim_state.get(fqn)
        prefix = f"optimizer.state.{fqn}."
        keys = {k[len(prefix):] for k in saved if k.startswith(prefix) and "." not in k[len(prefix):]}
        if not keys or current is None:
            continue
        row = p.numel() // p.shape[0] if p.dim() else 1
        mine = []  # this run's shard boundaries (rows), FSDP2's torch.chunk split of dim 0
        if isinstance(p, DTensor) and p.dim():
            chunk = -(-p.shape[0] // p.device_mesh.size())
            mine = [min(i * chunk, p.shape[0]) for i in range(p.device_mesh.size() + 1)]
        for k in set(current) - keys:
            del current[k]
        for k in keys:
            value = current.get(k)
            if k == "step" or (value is not None and value.dim() == 0):
                continue
            theirs = [b for c in saved[prefix + k].chunks for b in (c.offsets[0], c.offsets[0] + c.sizes[0])]
            local = value.to_local() if isinstance(value, DTensor) else value
            if (value is None or not whole_blocks(mine, row)  # a saved FP8 chunk would be cut
                    or (isinstance(local, QuantizedState) and not whole_blocks(theirs, row))):
                current[k] = torch.zeros(p.shape, device=p.device)
                full.append((current, k, p))
    return full


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it "assumes the intent" of a single process even when no_dist=True says
    so; in one process that is exactly the intent, so that warning is dropped."""
    with warnings.catch_warnings():
        if not is_distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def read_dcp_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON metadata (step, config, data position, ...) of a DCP step directory."""
    return json.loads((Path(path) / META_NAME).read_text())


@torch.no_grad()
def load_full_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer,
                          model_state: dict[str, torch.Tensor], optim_state: dict[str, Any]) -> None:
    """Load a single process's state dicts (checkpoint-<step>.pt) into an FSDP-sharded model and its
    optimizer: every rank holds the full tensors and keeps its own rows.

    Quantized moments (FP8) are dequantized before slicing and requantized per shard by the
    optimizer's load_state_dict (a shard's blocks are the same elements as in the full tensor, so
    codes and scales come back as they were up to the rounding of recomputing a scale). DCP
    checkpoints need none of this: they reshard without dequantizing.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, model_state, options=StateDictOptions(full_state_dict=True))

    def shard_like(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        if not isinstance(p, DTensor) or full.dim() == 0:
            return full
        full = dense(full)
        # src_data_rank=None: every rank slices its own rows, no communication
        return distribute_tensor(full.to(p.device), p.device_mesh, p.placements, src_data_rank=None)

    # torch's optimizer state dicts number parameters in param_groups order; so does the model
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved_ids = [i for g in optim_state["param_groups"] for i in g["params"]]
    if len(params) != len(saved_ids):
        raise ValueError(f"the checkpoint's optimizer has {len(saved_ids)} parameters, this model {len(params)}")
    state = {i: {k: shard_like(v, p) if torch.is_tensor(v) else v for k, v in optim_state["state"][i].items()}
             for i, p in zip(saved_ids, params) if i in optim_state["state"]}
    optimizer.load_state_dict({"state": state, "param_groups": optim_state["param_groups"]})


def _fsync_tree(root: Path) -> None:
    """fsync every file of `root` and the directory itself (rank 0 sees the shared filesystem;
    other ranks' files on a node-local disk are theirs to flush, which DCP's writer does)."""
    for p in root.iterdir():
        fsync_path(p)
    fsync_path(root)


__all__ = [
    "init_distributed", "release_wrapper", "destroy_distributed", "is_distributed", "barrier", "all_reduce_sum",
    "all_reduce_mean", "backend_name", "wrap_model", "no_grad_sync", "local_numel",
    "fp8_all_gather_problem", "full_copy",
    "dcp_root", "dcp_step", "list_dcp", "latest_dcp", "uncommitted_dcp", "clean_interrupted_dcp", "foreign_dcp",
    "remove_dcp", "dcp_problem", "verify_dcp", "dcp_nonfinite",
    "last_good_dcp", "save_dcp", "load_dcp", "read_dcp_meta", "load_full_state_dicts",
    "DCP_DIRNAME", "LATEST", "MANIFEST_NAME",
]
