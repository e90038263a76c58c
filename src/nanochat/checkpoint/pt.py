"""The .pt storage: a checkpoint of one process as one file, loaded without unpickling.

`checkpoint-0000NN.pt` holds plain data only (state dicts, the config as a dict, RNG states as
tensors, the data position as ints; FP8 moments are `FP8Tensor`s, registered as safe globals) and
is read with `torch.load(weights_only=True)`, so a checkpoint from someone else cannot run code.
`checkpoint-0000NN.json` is its manifest: the file's name, step, size and sha256, hashed while the
bytes stream to disk (no second read, unlike DCP's shards, which other processes write). A save
writes both under temporary names (`.checkpoint-0000NN.pt.tmp-<pid>-<hex>`), fsync'ed, then
renames the .pt and last the manifest: the commit (nanochat.fs.commit_manifest). A kill between
the two renames leaves a pending manifest, which `finish` completes when it describes the .pt in
place.

Under FSDP a .pt (saved by one process) loads into the sharded model through
`load_full_state_dicts`: every rank reads the whole tensors and keeps its rows.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from nanochat.checkpoint.nonfinite import nonfinite_tensors
from nanochat.checkpoint.storage import Checkpoint, Storage
from nanochat.fs import AtomicFile, commit_manifest, file_problem, read_manifest, temp_pattern
from nanochat.optim import dense
from nanochat.rundir import PT_NAME

FORMAT_VERSION = 1
_OWN_TEMP = temp_pattern(r"checkpoint-\d+\.(?:pt|json)")
"""A save's temporaries: .checkpoint-000006.pt.tmp-<pid>-<hex> and .checkpoint-000006.json.tmp-..."""


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step:06d}.pt"


class PtStorage(Storage):
    kind, tie_rank = "pt", 0

    def scan(self, run_dir: Path) -> list[Checkpoint]:
        found = [Checkpoint(self, Path(run_dir), p, int(m.group(1)))
                 for p in Path(run_dir).glob("checkpoint-*.pt") if (m := PT_NAME.fullmatch(p.name))]
        return sorted(found, key=lambda c: c.step)

    def at(self, path: Path) -> Checkpoint | None:
        """The checkpoint whose file is `path`; None when that is not a checkpoint's name."""
        m = PT_NAME.fullmatch(path.name)
        return Checkpoint(self, path.parent, path, int(m.group(1))) if m else None

    def manifest_of(self, path: Path) -> Path:
        return path.with_suffix(".json")

    def manifest_problem(self, c: Checkpoint) -> str | None:
        m, problem = _read_manifest(c)
        if problem is not None:
            return problem
        if m["file"] != c.path.name or int(m["step"]) != c.step:
            return (f"its manifest describes {m['file']} (step {m['step']}), not {c.path.name}: it was renamed or "
                    "copied under another step's name")
        return _problem(c.path, m, hash=False)

    def bytes_problem(self, c: Checkpoint) -> str | None:
        m, problem = _read_manifest(c)
        return problem or _problem(c.path, m, hash=True)

    def temporaries(self, run_dir: Path) -> tuple[list[Path], list[Path]]:
        ours = [p for p in sorted(run_dir.iterdir()) if _OWN_TEMP.fullmatch(p.name) and p.is_file()]
        others = [p for p in sorted(run_dir.glob(".checkpoint-*")) if not _OWN_TEMP.fullmatch(p.name)]
        return ours, others

    def finish(self, temporary: Path) -> str:
        final = temporary.parent / _OWN_TEMP.fullmatch(temporary.name).group(1)
        if final.suffix == ".json" and _completes(temporary, final.with_suffix(".pt")):
            os.replace(temporary, final)
            return f"completed the save of {final.with_suffix('.pt')}, killed before its manifest's rename"
        temporary.unlink(missing_ok=True)
        return f"removed {temporary}, left by an interrupted save"

    def read(self, c: Checkpoint, keys: tuple[str, ...]) -> tuple[dict[str, Any] | None, str | None]:
        return load_payload(c, "cpu", mmap=True, keys=keys)  # memory-mapped: tensors read where used

    def nonfinite(self, c: Checkpoint) -> list[str] | None:
        payload, problem = load_payload(c, "cpu", mmap=True)
        return None if problem is not None else nonfinite_tensors(payload)

    def files_of(self, c: Checkpoint) -> str:
        return f"{c.path.name} and {c.manifest.name}"


PT = PtStorage()


def _read_manifest(c: Checkpoint) -> tuple[dict[str, Any] | None, str | None]:
    """(the manifest's file name, step, sha256 and bytes, None), or (None, why it has none)."""
    if not c.manifest.is_file():
        return None, "it has no manifest"
    try:
        m, files = read_manifest(c.manifest)
        (name, entry), = files.items()  # a .pt's manifest describes that file alone
        return {"file": name, "step": int(m["step"]), **entry}, None
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"its manifest {c.manifest} is unreadable ({type(e).__name__}: {e})"


def _problem(path: Path, m: dict[str, Any], *, hash: bool) -> str | None:
    problem = file_problem(path, m, hash=hash)
    return None if problem is None else f"it {problem}"


def _completes(pending: Path, pt: Path) -> bool:
    """Whether the pending manifest `pending` describes the bytes of `pt` (which is in place)."""
    try:
        _, files = read_manifest(pending)
    except (OSError, ValueError):
        return False
    return list(files) == [pt.name] and file_problem(pt, files[pt.name]) is None


# ---------------------------------------------------------------------------------- writing
def write(c: Checkpoint, payload: dict[str, Any]) -> int:
    """The .pt of `c` and its manifest, committed by `commit_manifest` (the .pt renamed into
    place, the manifest last). Returns the bytes written. On any failure nothing of this save is
    left and the error propagates (an OSError with `.written`, the bytes written until then)."""
    f = AtomicFile(c.path)
    try:
        try:
            torch.save({"format_version": FORMAT_VERSION, **payload}, f)
        except RuntimeError as e:
            if f.error is not None:
                raise f.error from e
            raise
        entry = f.close()
        commit_manifest(c.manifest, {"file": c.path.name, **entry, "step": c.step, "format_version": FORMAT_VERSION},
                        staged=[f])
    except BaseException as e:
        f.discard()
        if isinstance(e, OSError):
            e.written = f.size
        raise
    return f.size


# ---------------------------------------------------------------------------------- reading
def load_payload(c: Checkpoint, map_location, *, mmap: bool = False,
                 keys: tuple[str, ...] = ()) -> tuple[dict[str, Any] | None, str | None]:
    """(payload, None) when `c` loads as nanochat's checkpoint of its step holding `keys`, else
    (None, why not). Verify it first (store.verify): this reads, it does not check the hash."""
    try:
        payload = torch.load(c.path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:  # torch's text suggests weights_only=False: never, for a file on disk
        return None, ("it is not a nanochat checkpoint (it needs unpickling of arbitrary objects, which "
                      "nanochat never does)")
    except Exception as e:  # a damaged archive fails in many types; all mean "not loadable"
        return None, f"it verifies but does not load ({type(e).__name__}: {str(e).splitlines()[0]})"
    if not isinstance(payload, dict) or payload.get("format_version") != FORMAT_VERSION:
        version = payload.get("format_version") if isinstance(payload, dict) else None
        return None, f"it has format version {version}, this nanochat reads {FORMAT_VERSION}"
    if "step" in payload and payload["step"] != c.step:
        return None, f"it holds step {payload['step']} under the name of step {c.step} (renamed or planted)"
    missing = missing_keys(payload, keys)
    if missing:
        return None, f"it is not a nanochat training checkpoint: it lacks {', '.join(map(repr, missing))}"
    return payload, None


def missing_keys(payload: dict[str, Any], keys: tuple[str, ...]) -> list[str]:
    """The `keys` (dotted for nested dicts: "config.model_name") that `payload` lacks, each named
    by its outermost missing part."""
    out: list[str] = []
    for key in keys:
        obj, parts = payload, key.split(".")
        for i, part in enumerate(parts):
            if not isinstance(obj, dict) or part not in obj:
                missing = ".".join(parts[:i + 1])  # the outermost: 'config', not 'config.model_name'
                out += [missing] if missing not in out else []
                break
            obj = obj[part]
    return out


@torch.no_grad()
def load_full_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer,
                          model_state: dict[str, torch.Tensor], optim_state: dict[str, Any]) -> None:
    """Load a single process's state dicts (a .pt checkpoint) into an FSDP-sharded model and its
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


__all__ = ["FORMAT_VERSION", "PT", "PtStorage", "checkpoint_name", "write", "load_payload", "missing_keys",
           "load_full_state_dicts"]
