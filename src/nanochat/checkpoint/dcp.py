"""The DCP storage: a torchrun run's checkpoint as a directory every rank writes its shards into.

    <run_dir>/checkpoint_dcp/step-000200/   DCP files + trainer.json (step, config, data position)
                                            + manifest.json (sha256 and size of every other file)
    <run_dir>/checkpoint_dcp/LATEST         {"dir": "step-000200", "step": 200}, for other tools

`torch.distributed.checkpoint` records which slice of which tensor each file holds, so a step
loads into any world size, FSDP or DDP, or one process. The ranks write into a temporary
directory of rank 0's naming (`.tmp-step-000200-<pid>-<hex>`); after a barrier rank 0 writes
trainer.json, reads every file back to hash it (other processes wrote the shards, so the hash
cannot be taken while writing, as the .pt storage does), writes the manifest and renames the
directory to its step's name: the commit (a directory cannot be replaced atomically, so a step
saved again gets `step-000200-2`). LATEST is replaced afterwards. Quantized optimizer moments
(FP8) reshard on whole blocks without requantization; where shards would cut blocks they load
through fp32 templates (`_fp32_templates`). docs/distributed.md has the measurements.

DCP keeps its index (`.metadata`) as a pickle, which plain `pickle.load` would let run code: every
read here goes through dcp_index.py's `SafeReader`, which refuses any class an index is not made of.
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
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from nanochat import rundir
from nanochat.checkpoint.dcp_index import SafeReader, read_index
from nanochat.checkpoint.pt import missing_keys
from nanochat.checkpoint.storage import Checkpoint, Storage
from nanochat.common import NanoChatError, dist_env
from nanochat.fs import commit_manifest, fsync_path, hash_file, manifest_problems, read_manifest, write_atomic
from nanochat.optim import OptimWrapper, QuantizedState, members
from nanochat.parallel.process_group import barrier, broadcast_object, is_distributed
from nanochat.rundir import DCP_DIRNAME

LATEST = "LATEST"
META_NAME = "trainer.json"
MANIFEST_NAME = "manifest.json"
_STEP_DIR = re.compile(r"step-(\d+)(?:-(\d+))?")  # step-000200, or step-000200-2 for a re-save
_OWN_TEMP = re.compile(r"\.tmp-step-\d+(?:-\d+)?-\d+-[0-9a-f]+")  # a save's directory until its commit


def dcp_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / DCP_DIRNAME


class DcpStorage(Storage):
    kind, tie_rank = "dcp", 1

    def scan(self, run_dir: Path) -> list[Checkpoint]:
        root = dcp_root(run_dir)
        found = []
        for p in root.glob("step-*") if root.is_dir() else []:
            m = _STEP_DIR.fullmatch(p.name)
            if m and p.is_dir():
                found.append(Checkpoint(self, Path(run_dir), p, int(m.group(1)), int(m.group(2) or 1)))
        return sorted(found, key=lambda c: c.order)

    def at(self, path: Path) -> Checkpoint:
        """The checkpoint of step directory `path` (<run_dir>/checkpoint_dcp/step-N)."""
        m = _STEP_DIR.fullmatch(path.name)
        if m is None:
            raise NanoChatError(f"{path} is not a DCP step directory (expected step-<step>, as training writes)")
        return Checkpoint(self, path.parent.parent, path, int(m.group(1)), int(m.group(2) or 1))

    def manifest_of(self, path: Path) -> Path:
        return path / MANIFEST_NAME

    def manifest_problem(self, c: Checkpoint) -> str | None:
        files, problem = _read_manifest(c)
        if problem is not None:
            return problem
        problem = next(manifest_problems(c.path, files, hash=False), None)
        if problem is not None:
            return problem
        try:
            extra = sorted({f.name for f in c.path.iterdir()} - {*files, MANIFEST_NAME})
        except OSError as e:
            return f"it cannot be read ({e.strerror or e})"
        return f"it holds {extra[0]}, which its manifest does not list (added after the save)" if extra else None

    def bytes_problem(self, c: Checkpoint) -> str | None:
        files, problem = _read_manifest(c)
        return problem or next(manifest_problems(c.path, files), None)

    def temporaries(self, run_dir: Path) -> tuple[list[Path], list[Path]]:
        root = dcp_root(run_dir)
        entries = sorted(root.iterdir()) if root.is_dir() else []
        ours = [p for p in entries if p.is_dir() and _OWN_TEMP.fullmatch(p.name)]
        return ours, [p for p in entries if p.name.startswith(".tmp-") and p not in ours]

    def finish(self, temporary: Path) -> str:
        shutil.rmtree(temporary)  # a save's shards are no use without its manifest
        return f"removed {temporary}, left by an interrupted save"

    def read(self, c: Checkpoint, keys: tuple[str, ...]) -> tuple[dict[str, Any] | None, str | None]:
        try:
            meta = read_meta(c.path)
        except (OSError, ValueError) as e:
            return None, f"its {META_NAME} does not read ({e})"
        if not isinstance(meta, dict):
            return None, f"its {META_NAME} is not a JSON object"
        missing = missing_keys(meta, keys)
        if missing:
            return None, f"its {META_NAME} lacks {', '.join(map(repr, missing))}"
        if "step" in meta and meta["step"] != c.step:
            return None, f"it holds step {meta['step']} under the name of step {c.step}"
        return meta, None

    def nonfinite(self, c: Checkpoint) -> list[str] | None:
        try:
            return nonfinite(c.path)
        except Exception:  # noqa: BLE001 -- shards that do not load: not a good checkpoint either
            return None

    def files_of(self, c: Checkpoint) -> str:
        return str(c.path)

    def tidy(self, run_dir: Path) -> None:
        root = dcp_root(run_dir)
        if root.is_dir() and not any(p.name != LATEST for p in root.iterdir()):
            (root / LATEST).unlink(missing_ok=True)
            root.rmdir()


DCP = DcpStorage()


def _read_manifest(c: Checkpoint) -> tuple[dict[str, dict[str, Any]] | None, str | None]:
    """The manifest's {file name: {"sha256", "bytes"}} when it is readable and of `c`'s step, else
    why not."""
    if not c.manifest.is_file():
        return None, f"it has no {MANIFEST_NAME}"
    try:
        manifest, files = read_manifest(c.manifest)
        step = int(manifest["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"its manifest {c.manifest} is unreadable ({type(e).__name__}: {e})"
    if step != c.step:
        return None, f"its manifest is of step {step}: it was renamed or copied under another step's name"
    return files, None


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON metadata (step, config, data position, ...) of a DCP step directory."""
    return json.loads((Path(path) / META_NAME).read_text())


# ---------------------------------------------------------------------------------- writing
def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    # Keys are parameter names (FQNs), the same for DDP (no "module." prefix), FSDP and a single
    # process; tensors are DTensors under FSDP (DCP saves each rank's shard), plain otherwise.
    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, _members(optimizer))}


def _members(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | tuple[torch.optim.Optimizer, ...]:
    """What torch's state-dict functions take for `optimizer`: a container's (MuonAdamW's)
    optimizers, whose states they key by parameter name into one dict (each parameter is in one
    of them), or the optimizer itself."""
    found = members(optimizer)
    return found if len(found) > 1 else optimizer


def _block_size(optimizer: torch.optim.Optimizer) -> int | None:
    """The quantized moments' block size of `optimizer` (or of a container's first wrapper)."""
    for opt in members(optimizer):
        if isinstance(opt, OptimWrapper) and opt.moments.block_size is not None:
            return opt.moments.block_size
    return None


def save(run_dir: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, *, step: int,
         meta: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> Checkpoint:
    """Write model, optimizer, `tensors` (e.g. RNG states) and JSON `meta` as the DCP checkpoint
    of `step`, commit it with its manifest and point LATEST at it (store.save_dcp also rotates).

    Collective: every rank calls it with the same step. Rank 0 holds the run lock meanwhile. The
    ranks write into a temporary directory of rank 0's naming, which is renamed to its step's
    name once its manifest is written: that rename is the commit. Returns the committed step.
    """
    import torch.distributed.checkpoint as dcp

    root = dcp_root(run_dir)
    rank0 = dist_env().rank == 0
    problem, name, tmp_name = broadcast_object(_claim_step_name(run_dir, root, step) if rank0 else None)
    if problem is not None:
        raise NanoChatError(problem)
    final, tmp = root / name, root / tmp_name
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
            _commit(tmp, final, step=step, meta=meta)
        barrier()
    except BaseException:
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)  # ours, never committed
        raise
    finally:
        if rank0:
            rundir.release(run_dir)
    return DCP.at(final)


def _claim_step_name(run_dir: str | os.PathLike, root: Path, step: int) -> tuple[str | None, str | None, str | None]:
    """Rank 0, before a save: take the run lock and name the step directory and its temporary;
    (error or None, step directory name, temporary name), what `save` broadcasts."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        rundir.acquire(run_dir)
    except (OSError, NanoChatError) as e:
        return f"cannot save the DCP checkpoint of step {step} in {root}: {e}", None, None
    name, n = f"step-{step:06d}", 1
    while (root / name).exists():  # this step saved before (a resumed run): never overwrite it
        n += 1
        name = f"step-{step:06d}-{n}"
    return None, name, f".tmp-{name}-{os.getpid()}-{secrets.token_hex(4)}"


def _commit(tmp: Path, final: Path, *, step: int, meta: dict[str, Any]) -> None:
    """Rank 0, once every shard is written: meta and manifest, the rename that commits, LATEST."""
    root = final.parent
    write_atomic(tmp / META_NAME, json.dumps({**meta, "step": step}, indent=1))
    for p in tmp.iterdir():  # rank 0 sees the shared filesystem; node-local files are their ranks' to flush
        fsync_path(p)
    files = {f.name: hash_file(f) for f in sorted(tmp.iterdir()) if f.is_file() and f.name != MANIFEST_NAME}
    commit_manifest(tmp / MANIFEST_NAME, {"step": step, "files": files})
    os.rename(tmp, final)  # the commit (DCP's index names its files relative to the directory)
    fsync_path(root)
    write_atomic(root / LATEST, json.dumps({"dir": final.name, "step": step}))


# ---------------------------------------------------------------------------------- reading
def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, *,
         tensors: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Load DCP step directory `path` into `model` and `optimizer` (any world size, FSDP, DDP or
    one process) and into the `tensors` templates (in place); returns its JSON meta. Collective
    when distributed; verify the step first (store.load_dcp does). Loads into existing tensors:
    `get_optimizer_state_dict` creates the optimizer's state first when it has none."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    path = Path(path)
    state = _state_dicts(model, optimizer)
    saved = read_index(path).state_dict_metadata
    block_size = _block_size(optimizer)
    full = _fp32_templates(state["optimizer"]["state"], saved, model, block_size)
    state["extra"] = dict(tensors or {})
    with _single_process_quiet():
        dcp.load(state, storage_reader=SafeReader(path), no_dist=not is_distributed())
    for current, k, p in full:  # every rank holds the whole tensor: keep this rank's rows
        if isinstance(p, DTensor):
            current[k] = distribute_tensor(current[k], p.device_mesh, p.placements, src_data_rank=None)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, _members(optimizer), state["optimizer"])
    if tensors is not None:
        tensors.update(state["extra"])
    return read_meta(path)


def load_weights(path: str | os.PathLike, model: nn.Module) -> None:
    """Load only the model weights of a verified DCP step directory into `model` (a plain, unwrapped
    model in this process): DCP reads just the requested keys, so the optimizer state is never
    read. Every rank of a group reads them whole (before wrapping, as from a .pt checkpoint)."""
    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict()}
    read_index(path)  # refused here, in one line, before DCP reads it
    with _single_process_quiet():
        dcp.load(state, storage_reader=SafeReader(path), no_dist=True)
    model.load_state_dict(state["model"])


def _fp32_templates(optim_state: dict[str, dict[str, Any]], saved: dict[str, Any], model: nn.Module,
                    block_size: int | None) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
    """Adjust the optimizer template, in place, where the checkpoint's moments cannot load as the
    optimizer holds them; returns the (state, key, param) entries given full fp32 templates.

    A quantized moment (nanochat.optim.QuantizedState, e.g. FP8) is whole `block_size`-element
    blocks and slices only along rows, on block boundaries. So a moment loads into a full,
    unsharded fp32 template (DCP then reads whole saved chunks and dequantizes them), and is
    resharded and requantized by the optimizer's load_state_dict afterwards, when
    - the checkpoint holds it under a name this optimizer does not use now (a tensor whose
      shards were not whole blocks kept fp32 state; nanochat.optim.saved_state names the states), or
    - loading would cut a quantized chunk other than along rows on block boundaries
      (`_cuts_blocks`).
    Otherwise (the usual case, and always where this rank's shard is one the checkpoint holds)
    quantized codes and scales load as they are, without requantization.
    """
    full = []
    for fqn, p in model.named_parameters():
        current = optim_state.get(fqn)
        prefix = f"optimizer.state.{fqn}."
        keys = {k[len(prefix):] for k in saved if k.startswith(prefix) and "." not in k[len(prefix):]}
        if not keys or current is None:
            continue
        for k in set(current) - keys:
            del current[k]
        for k in keys:
            value = current.get(k)
            if k == "step" or (value is not None and value.dim() == 0):
                continue
            if value is None or _cuts_blocks(p, value, saved[prefix + k].chunks, block_size):
                current[k] = torch.zeros(p.shape, device=p.device)
                full.append((current, k, p))
    return full


def _cuts_blocks(p: torch.Tensor, value: torch.Tensor, chunks: list, block_size: int | None) -> bool:
    """Whether reading the saved `chunks` of one moment of `p` into `value` (this run's state)
    would cut an FP8 chunk, the saved one or this rank's, across its blocks. Not when this
    rank's shard is exactly a saved chunk (read whole: a resume in the same layout). Otherwise:
    when a saved chunk holds some of the columns (a tensor-parallel row-split weight's), when
    this rank's shard is not whole rows of one mesh dim (tensor parallelism's shards), or when
    the row boundaries of the saved chunks or of this run's FSDP shards (torch.chunk of dim 0)
    are not block boundaries."""
    if block_size is None:
        return False
    sharded = isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)
    mine = p.__create_chunk_list__() if sharded else []
    if any(tuple(c.offsets) == tuple(m.offsets) and tuple(c.sizes) == tuple(m.sizes) for m in mine for c in chunks):
        return False
    if not sharded and len(chunks) == 1 and tuple(chunks[0].sizes) == tuple(p.shape):
        return False
    local = value.to_local() if isinstance(value, DTensor) else value
    quantized = isinstance(local, QuantizedState)
    if any(tuple(c.sizes[1:]) != tuple(p.shape[1:]) for c in chunks):
        return True
    if sharded and tuple(p.placements) != (Shard(0),):  # a saved FP8 chunk would be cut across rows too
        return True
    row = p.numel() // p.shape[0] if p.dim() else 1
    whole = lambda starts_ends: all((r * row) % block_size == 0 for r in starts_ends)  # noqa: E731
    bounds = []  # this run's shard boundaries (rows), FSDP2's torch.chunk split of dim 0
    if sharded and p.dim():
        chunk = -(-p.shape[0] // p.device_mesh.size())
        bounds = [min(i * chunk, p.shape[0]) for i in range(p.device_mesh.size() + 1)]
    theirs = [b for c in chunks for b in (c.offsets[0], c.offsets[0] + c.sizes[0])]
    return not whole(bounds) or (quantized and not whole(theirs))


def nonfinite(path: str | os.PathLike) -> list[str]:
    """The tensors of step directory `path` (weights, optimizer states) that hold inf/nan, read
    one at a time in this process (memory: the largest tensor, whatever the world size was)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    bad = []
    for key, md in read_index(path).state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata) or not md.properties.dtype.is_floating_point:
            continue
        one = {key: torch.empty(md.size, dtype=md.properties.dtype)}
        with _single_process_quiet():
            dcp.load(one, storage_reader=SafeReader(path), no_dist=True)
        if not torch.isfinite(one[key]).all():
            bad.append(key)
    return bad


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it "assumes the intent" of a single process even when no_dist=True says
    so; in one process that is exactly the intent, so that warning is dropped."""
    with warnings.catch_warnings():
        if not is_distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


__all__ = ["DCP", "DcpStorage", "LATEST", "META_NAME", "MANIFEST_NAME", "dcp_root", "load", "load_weights",
           "nonfinite", "read_meta", "save"]
