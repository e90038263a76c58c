"""The checkpoint store: one policy over both storages (.pt files: pt.py; DCP step directories: dcp.py).

A checkpoint is committed when its manifest is in place, and only a committed checkpoint whose
manifest describes it is nanochat's. From that one rule:
- `newest` is the checkpoint a --resume continues from: the newest committed one. A newer
  checkpoint without a manifest is refused rather than passed over (that would silently lose
  its steps). `verify` then reads its bytes against the manifest; a mismatch is an error naming
  `newest_verified`, the newest older checkpoint that does verify (and, with `finite`, loads
  without inf/nan), and how to fall back to it.
- `rotate` keeps the newest `keep` checkpoints of ours after each save; `remove` (--overwrite)
  deletes ours; both delete the manifest first, so a kill midway leaves no half checkpoint.
- `clean_interrupted` (under the run lock: rundir.py says why that is a proof) finishes or
  removes what killed saves left under their own temporary names; everything else that is not
  provably ours is reported and left alone, and `foreign` lists it with the reason.
A save writes one storage and then removes the other's checkpoints (a run resumed in another
layout), so both exist only after a crash in between; the later step wins.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn as nn

from nanochat import rundir
from nanochat.checkpoint import dcp, pt
from nanochat.checkpoint.dcp import DCP
from nanochat.checkpoint.pt import PT
from nanochat.checkpoint.storage import Checkpoint, Storage
from nanochat.common import NanoChatError, UsageError, dist_env, format_bytes, warn_once
from nanochat.fs import fsync_path
from nanochat.parallel.process_group import broadcast_object

STORAGES: tuple[Storage, ...] = (PT, DCP)


def _scan(run_dir: str | os.PathLike, storages: Sequence[Storage]) -> list[Checkpoint]:
    return sorted((c for s in storages for c in s.scan(Path(run_dir))), key=lambda c: c.order)


def committed(run_dir: str | os.PathLike, storages: Sequence[Storage] = STORAGES) -> list[Checkpoint]:
    """The committed checkpoints of `run_dir` (those with a manifest), oldest first."""
    return [c for c in _scan(run_dir, storages) if c.committed]


def uncommitted(run_dir: str | os.PathLike, storages: Sequence[Storage] = STORAGES) -> list[Checkpoint]:
    """Checkpoints without their manifest, oldest first: never loaded, never deleted."""
    return [c for c in _scan(run_dir, storages) if not c.committed]


def newest(run_dir: str | os.PathLike, flag: str = "--resume",
           storages: Sequence[Storage] = STORAGES) -> Checkpoint | None:
    """The newest committed checkpoint of `run_dir` (None: none); a UsageError naming `flag` when
    a checkpoint without a manifest is newer."""
    every = _scan(run_dir, storages)
    found, loose = [c for c in every if c.committed], [c for c in every if not c.committed]
    c = found[-1] if found else None
    if loose and (c is None or loose[-1].order > c.order):
        raise UsageError(unmanifested_message(loose[-1], flag, c))
    return c


def unmanifested_message(loose: Checkpoint, flag: str, older: Checkpoint | None) -> str:
    """The refusal of a newest checkpoint that has no manifest."""
    instead = (f"move it out of {loose.path.parent} to continue from step {older.step} ({older.path.name})"
               if older is not None else "move it away to start from scratch")
    return (f"{flag}: the newest checkpoint {loose.path} has no manifest, so it cannot be verified (nanochat "
            f"neither loads nor deletes such a checkpoint): restore its manifest, or {instead}")


# ------------------------------------------------------------------------------ verification
def problem(c: Checkpoint) -> str | None:
    """None when `c`'s manifest describes it and its bytes hash as the manifest says, else what
    is wrong. Reads every byte, in this process."""
    return c.storage.manifest_problem(c) or c.storage.bytes_problem(c)


def newest_verified(run_dir: str | os.PathLike, *, before: Checkpoint | None = None, finite: bool = False,
                    storages: Sequence[Storage] = STORAGES) -> Checkpoint | None:
    """The newest checkpoint (older than `before`, if given) whose bytes verify and, with
    `finite`, whose weights and optimizer states load in this process without inf/nan."""
    for c in reversed(committed(run_dir, storages)):
        if before is not None and c.order >= before.order:
            continue
        if problem(c) is None and (not finite or c.storage.nonfinite(c) == []):
            return c
    return None


def unusable(c: Checkpoint, why: str, flag: str = "--resume", storages: Sequence[Storage] = STORAGES) -> str:
    """The error for checkpoint `c`, unusable because of `why`: what to do, namely fall back to
    the previous checkpoint (of `storages`) that verifies, when one does."""
    prev = newest_verified(c.run_dir, before=c, storages=storages)
    if flag in ("--resume", "--auto_resume"):
        fix = ("no older checkpoint verifies; start again with --overwrite" if prev is None else
               f"the previous checkpoint {prev.path} (step {prev.step}) verifies: delete {c.storage.files_of(c)} "
               f"and run again with {flag} to continue from step {prev.step}")
    else:
        fix = ("no older checkpoint of that run verifies; restore this one from a copy" if prev is None else
               f"the previous checkpoint {prev.path} (step {prev.step}) verifies: move {c.storage.files_of(c)} "
               f"out of {c.path.parent} to use it")
    return f"{flag}: checkpoint {c.path} is not usable: {why}; {fix}"


def verify(c: Checkpoint, flag: str = "--resume") -> None:
    """Raise a NanoChatError, naming the previous checkpoint that verifies, unless `c` verifies.
    Collective when distributed: rank 0 reads the files once and broadcasts the verdict (every
    rank reading them would multiply a shared filesystem's traffic by the world size)."""
    message = None
    if dist_env().rank == 0:
        why = problem(c)
        message = unusable(c, why, flag) if why is not None else None
    message = broadcast_object(message)
    if message is not None:
        raise NanoChatError(message)


def read(c: Checkpoint, flag: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """`c`, verified (collective when distributed), as nanochat's checkpoint holding `keys`: a
    .pt's payload memory-mapped on the CPU, a DCP step's trainer.json."""
    verify(c, flag)
    meta, why = c.storage.read(c, keys)
    if why is not None:
        raise NanoChatError(unusable(c, why, flag))
    return meta


# --------------------------------------------------------------------------- what is ours
def _delete(c: Checkpoint) -> None:
    c.manifest.unlink(missing_ok=True)  # uncommit first: a kill midway leaves no half checkpoint
    if c.path.is_dir():
        shutil.rmtree(c.path)
    else:
        c.path.unlink(missing_ok=True)


def rotate(run_dir: str | os.PathLike, storage: Storage, keep: int) -> None:
    """Keep the newest `keep` checkpoints of `storage` that are ours (their manifests describe
    them); the others are neither counted nor deleted, and said so once."""
    with rundir.holding(run_dir):
        ours = []
        for c in committed(run_dir, (storage,)):
            why = storage.manifest_problem(c)
            if why is None:
                ours.append(c)
            else:
                warn_once(f"keep {c.path}", f"not counting or deleting {c.path}: {why}")
        for old in ours[:-keep] if keep > 0 else []:
            _delete(old)


def remove(run_dir: str | os.PathLike, storages: Sequence[Storage] = STORAGES) -> None:
    """Delete the checkpoints of `run_dir` whose manifests describe them; any other stays."""
    if not Path(run_dir).is_dir():
        return
    with rundir.holding(run_dir):
        for storage in storages:
            for c in committed(run_dir, (storage,)):
                if storage.manifest_problem(c) is None:
                    _delete(c)
            storage.tidy(Path(run_dir))


def foreign(run_dir: str | os.PathLike) -> list[str]:
    """The checkpoints of `run_dir` nanochat cannot prove it wrote (no manifest, or one that does
    not describe them), each with the reason: what --overwrite refuses to delete."""
    out = []
    for c in _scan(run_dir, STORAGES):
        why = c.storage.manifest_problem(c)
        if why is not None:
            out.append(f"{c.name} ({why})")
    return out


def clean_interrupted(run_dir: str | os.PathLike) -> list[str]:
    """Finish or remove what killed saves (and killed writes of the run's records) left in
    `run_dir`, under its lock; one line per file for the log. Checkpoints without a manifest and
    temporaries of other names are reported and left alone."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    notes = []
    with rundir.holding(run_dir):
        for storage in STORAGES:
            ours, others = storage.temporaries(run_dir)
            notes += [storage.finish(p) for p in ours]
            if ours:
                fsync_path(ours[0].parent)
            for c in uncommitted(run_dir, (storage,)):
                notes.append(f"left {c.path} alone: it has no manifest ({c.manifest.name}), so nanochat neither "
                             "loads nor deletes it; restore its manifest or move it away")
            notes += [f"left {p} alone: not a temporary name of this nanochat's saves; delete it if no other "
                      f"program writes {run_dir}" for p in others]
        for p in rundir.record_temporaries(run_dir):
            p.unlink(missing_ok=True)
            notes.append(f"removed {p}, left by an interrupted write of {p.name[1:].split('.tmp-')[0]}")
    return notes


# ------------------------------------------------------------------------- saving, loading
def save_checkpoint(run_dir: str | os.PathLike, payload: dict[str, Any], *, step: int | None = None,
                    keep: int = 2) -> Path:
    """Write `payload` as the .pt checkpoint of `step` (default: payload["step"]), then keep only
    the newest `keep`; returns the .pt path. Holds `run_dir`'s lock meanwhile. A failed write
    (e.g. ENOSPC) raises a NanoChatError naming the file and the checkpoint that survives."""
    run_dir = Path(run_dir)
    step = int(payload["step"] if step is None else step)
    run_dir.mkdir(parents=True, exist_ok=True)
    with rundir.holding(run_dir):
        c = PT.at(run_dir / pt.checkpoint_name(step))
        if c.path.exists():  # re-saving a step: only over a checkpoint of ours
            why = PT.manifest_problem(c)
            if why is not None:
                raise NanoChatError(f"not saving step {step}: {c.path} exists and nanochat cannot tell it wrote it "
                                    f"({why}); move it out of {run_dir} and run again")
        try:
            pt.write(c, payload)
        except OSError as e:
            raise NanoChatError(_write_failed(c, e)) from e
        rotate(run_dir, PT, keep)
    return c.path


def _write_failed(c: Checkpoint, e: OSError) -> str:
    prev = committed(c.run_dir, (PT,))
    kept = f"the previous checkpoint {prev[-1].path} is intact" if prev else "no earlier checkpoint exists"
    if e.errno == errno.ENOSPC:
        return (f"no space left on the device while writing checkpoint {c.path} (step {c.step}, "
                f"{format_bytes(getattr(e, 'written', 0))} written); {kept}. Free disk space, or lower "
                "--keep_checkpoints, or point --run_dir at another disk, then continue with --resume")
    return f"could not write checkpoint {c.path}: {e}; {kept}"


def load_checkpoint(source: str | os.PathLike, map_location: str | torch.device = "cpu", *,
                    keys: tuple[str, ...] = (), mmap: bool = False, flag: str = "--run_dir") -> dict[str, Any]:
    """The payload of the newest .pt checkpoint of run directory `source` (or of the checkpoint
    file `source`), verified, loaded with `weights_only=True`; clear errors naming `flag` (what
    gave `source`) when it can't: a damaged or foreign file, a step that disagrees with the name,
    one of `keys` missing, a newer checkpoint without its manifest."""
    source = Path(source)
    if source.is_file():
        c = PT.at(source)
        if c is None or not c.committed:
            raise UsageError(f"{source} is not a nanochat checkpoint: expected checkpoint-<step>.pt next "
                             "to its manifest checkpoint-<step>.json (what training writes)")
    else:
        c = newest(source, flag, (PT,))
        if c is None:
            found = "no such directory" if not source.is_dir() else "no checkpoint-<step>.pt with its .json manifest"
            training = rundir.holder(source) if source.is_dir() else None
            if training is not None:  # a run in progress that has not saved yet
                raise UsageError(f"{flag} {source} holds no checkpoint yet: a training run is in progress there "
                                 f"({training}) and writes its first checkpoint at its first --save_every step or "
                                 f"at its end; wait for it, or point {flag} at a run that saved one")
            raise UsageError(f"{flag} {source} holds no checkpoint ({found}); point {flag} at the directory of "
                             "a run that saved one")
    why = problem(c)
    if why is None:
        payload, why = pt.load_payload(c, map_location, mmap=mmap, keys=keys)
        if why is None:
            return payload
    raise NanoChatError(unusable(c, why, flag, (PT,)))


def save_dcp(run_dir: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, *, step: int,
             meta: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None, keep: int = 2) -> Path:
    """The DCP checkpoint of `step` (dcp.save: collective, every rank calls it), then rank 0 keeps
    only the newest `keep` steps. Returns the step directory."""
    c = dcp.save(run_dir, model, optimizer, step=step, meta=meta, tensors=tensors)
    if dist_env().rank == 0:
        rotate(run_dir, DCP, keep)
    return c.path


def load_dcp(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, *,
             tensors: dict[str, torch.Tensor] | None = None, verify_first: bool = True) -> dict[str, Any]:
    """DCP step directory `path`, verified against its manifest unless `verify_first` is False
    (the caller did), loaded into `model`, `optimizer` and `tensors` (dcp.load); its JSON meta.
    Collective when distributed."""
    if verify_first:
        verify(DCP.at(Path(path)))
    return dcp.load(path, model, optimizer, tensors=tensors)


__all__ = ["STORAGES", "committed", "uncommitted", "newest", "unmanifested_message", "problem", "newest_verified",
           "unusable", "verify", "read", "rotate", "remove", "foreign", "clean_interrupted", "save_checkpoint",
           "load_checkpoint", "save_dcp", "load_dcp"]
