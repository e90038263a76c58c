"""Verified, atomic checkpoints that load without unpickling code.

A checkpoint of step N is two files in the run directory: `checkpoint-0000NN.pt`, plain data
only (model and optimizer state dicts, the config as a dict, the step, RNG states as tensors, the
data position as ints; FP8 optimizer states are `FP8Tensor`s, registered as safe globals), read
with `torch.load(weights_only=True)` so a checkpoint from someone else cannot run code; and
`checkpoint-0000NN.json`, its manifest: the sha256 and size of the .pt file's bytes.

Why a sidecar over the file's bytes: the hash is computed while the bytes stream to disk (no
second copy in memory), it covers everything torch.save wrote (tensor data and the pickled
structure alike), and it survives renames because it names no path. Loading re-hashes the file
and refuses a mismatch, naming the file and the newest older checkpoint that does verify.

Writes are ordered so a kill at any instant leaves the previous checkpoint whole: the .pt goes
to a temporary file, is fsync'ed and renamed; then the manifest likewise. The manifest's rename
is the commit point: a .pt without a manifest is an interrupted save, removed (with temporary
files) by `clean_interrupted` at the next start. Then all but the newest `keep` checkpoints are
deleted, so a bad newest one never strands a run. A write that fails (e.g. ENOSPC) raises a
`NanoChatError` naming the file, and leaves the previous checkpoints untouched.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanochat.common import NanoChatError, UsageError, format_bytes, fsync_path, write_atomic

FORMAT_VERSION = 1
_NAME = re.compile(r"checkpoint-(\d+)\.pt")
_HASH_CHUNK = 1 << 24  # 16 MiB reads when verifying


@dataclass(frozen=True)
class CheckpointFile:
    """One committed checkpoint: its step, .pt file and manifest."""

    step: int
    path: Path
    manifest: Path


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step:06d}.pt"


def list_checkpoints(run_dir: str | os.PathLike) -> list[CheckpointFile]:
    """Committed checkpoints of `run_dir` (those with a manifest), oldest first."""
    out = []
    for p in Path(run_dir).glob("checkpoint-*.pt"):
        m = _NAME.fullmatch(p.name)
        if m and p.with_suffix(".json").is_file():
            out.append(CheckpointFile(int(m.group(1)), p, p.with_suffix(".json")))
    return sorted(out, key=lambda c: c.step)


def latest_checkpoint(run_dir: str | os.PathLike) -> CheckpointFile | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def clean_interrupted(run_dir: str | os.PathLike) -> list[Path]:
    """Delete what a killed save left: temporary files and .pt files without a manifest."""
    removed = []
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return removed
    for p in run_dir.iterdir():
        stray_tmp = p.name.startswith(".checkpoint-") and p.name.endswith(".tmp")
        uncommitted = _NAME.fullmatch(p.name) is not None and not p.with_suffix(".json").exists()
        if p.is_file() and (stray_tmp or uncommitted):
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def remove_checkpoints(run_dir: str | os.PathLike) -> None:
    """Delete every checkpoint of `run_dir` (manifest first, so none is half-deleted)."""
    for c in list_checkpoints(run_dir):
        c.manifest.unlink(missing_ok=True)
        c.path.unlink(missing_ok=True)
    clean_interrupted(run_dir)


class _HashingWriter:
    """File-like object for torch.save: writes through to `f` and hashes what it writes. It keeps
    the OSError of a failed write, which torch would otherwise replace by its own RuntimeError
    ("enforce fail ... unexpected pos")."""

    def __init__(self, f):
        self.f, self.sha, self.size, self.error = f, hashlib.sha256(), 0, None

    def write(self, data) -> int:
        try:
            n = self.f.write(data)
        except OSError as e:
            self.error = e
            raise
        self.sha.update(data)
        self.size += len(data)
        return n

    def flush(self) -> None:
        self.f.flush()


def save_checkpoint(run_dir: str | os.PathLike, payload: dict[str, Any], *, step: int | None = None,
                    keep: int = 2) -> Path:
    """Write `payload` as the checkpoint of `step` (default: payload["step"]), then keep only the
    newest `keep` checkpoints; returns the .pt path."""
    run_dir = Path(run_dir)
    step = int(payload["step"] if step is None else step)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / checkpoint_name(step)
    manifest = target.with_suffix(".json")
    manifest.unlink(missing_ok=True)  # re-saving a step: uncommit the old one before replacing it
    writer = _HashingWriter(None)

    def write(f) -> None:
        writer.f = f
        try:
            torch.save({"format_version": FORMAT_VERSION, **payload}, writer)
        except RuntimeError as e:
            if writer.error is not None:
                raise writer.error from e
            raise

    try:
        write_atomic(target, write, fsync=True)  # interrupted: no partial file, the previous ones kept
        write_atomic(manifest, json.dumps({"file": target.name, "sha256": writer.sha.hexdigest(),
                                           "bytes": writer.size, "step": step,
                                           "format_version": FORMAT_VERSION}, indent=1), fsync=True)
    except OSError as e:
        target.unlink(missing_ok=True)  # never committed
        prev = latest_checkpoint(run_dir)
        kept = f"the previous checkpoint {prev.path} is intact" if prev else "no earlier checkpoint exists"
        if e.errno == errno.ENOSPC:
            raise NanoChatError(
                f"no space left on the device while writing checkpoint {target} (step {step}, "
                f"{format_bytes(writer.size)} written); {kept}. Free disk space, or lower "
                "--keep_checkpoints, or point --run_dir at another disk, then continue with --resume"
            ) from e
        raise NanoChatError(f"could not write checkpoint {target}: {e}; {kept}") from e
    fsync_path(run_dir)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        old.manifest.unlink(missing_ok=True)
        old.path.unlink(missing_ok=True)
    return target


def verify_checkpoint(c: CheckpointFile) -> str | None:
    """None when `c`'s bytes match its manifest, else what is wrong."""
    try:
        manifest = json.loads(c.manifest.read_text())
        want, size = manifest["sha256"], int(manifest["bytes"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its manifest {c.manifest} is unreadable ({e})"
    return file_problem(c.path, want, size)


def file_sha256(path: str | os.PathLike) -> tuple[str, int]:
    """(sha256 hex digest, size in bytes) of a file, read in 16 MiB chunks (never whole in memory)."""
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return sha.hexdigest(), size


def file_problem(path: str | os.PathLike, sha256: str, size: int) -> str | None:
    """None when the file at `path` has this sha256 and size, else what is wrong with it."""
    try:
        got_sha, got = file_sha256(path)
    except FileNotFoundError:
        return "it is missing"
    except OSError as e:
        return f"it cannot be read ({e})"
    if got != size:
        return f"it has {got:,} bytes, its manifest says {size:,} (truncated or appended to)"
    if got_sha != sha256:
        return f"its sha256 {got_sha[:16]}... differs from the manifest's {sha256[:16]}... (corrupted)"
    return None


def last_good_checkpoint(run_dir: str | os.PathLike, before: int | None = None) -> CheckpointFile | None:
    """The newest checkpoint (older than step `before`, if given) whose bytes verify."""
    for c in reversed(list_checkpoints(run_dir)):
        if (before is None or c.step < before) and verify_checkpoint(c) is None:
            return c
    return None


def load_checkpoint(source: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load the newest checkpoint of run directory `source` (or the checkpoint file `source`),
    verified against its manifest, with `weights_only=True`; clear errors when it can't."""
    source = Path(source)
    if source.is_file():
        m = _NAME.fullmatch(source.name)
        if m is None or not source.with_suffix(".json").is_file():
            raise UsageError(f"{source} is not a nanochat checkpoint: expected checkpoint-<step>.pt next "
                             "to its manifest checkpoint-<step>.json (what training writes)")
        c = CheckpointFile(int(m.group(1)), source, source.with_suffix(".json"))
    else:
        c = latest_checkpoint(source)
        if c is None:
            found = "no such directory" if not source.is_dir() else "no checkpoint-<step>.pt with its .json manifest"
            raise UsageError(f"--run_dir {source} holds no checkpoint ({found}); point --run_dir at the "
                             "directory of a training run")
    problem = verify_checkpoint(c)
    if problem is None:
        # FP8Tensor registers itself with torch.serialization.add_safe_globals on import.
        import nanochat.fp8.tensor  # noqa: F401

        try:
            payload = torch.load(c.path, map_location=map_location, weights_only=True)
        except Exception as e:  # unpickling errors come in many types; all mean "not loadable"
            problem = f"it verifies but does not load ({type(e).__name__}: {str(e).splitlines()[0]})"
        else:
            if not isinstance(payload, dict) or payload.get("format_version") != FORMAT_VERSION:
                version = payload.get("format_version") if isinstance(payload, dict) else None
                raise NanoChatError(f"checkpoint {c.path} has format version {version}, this nanochat "
                                    f"reads {FORMAT_VERSION}")
            return payload
    prev = last_good_checkpoint(c.path.parent, before=c.step)
    if prev is None:
        fix = "no older checkpoint verifies; start again with --overwrite"
    else:
        fix = (f"the previous checkpoint {prev.path} (step {prev.step}) verifies: delete {c.path.name} "
               f"and {c.manifest.name} and run again with --resume to continue from step {prev.step}")
    raise NanoChatError(f"checkpoint {c.path} is not usable: {problem}; {fix}")


def rng_state() -> dict[str, Any]:
    """RNG states as tensors (weights_only-safe)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
