"""Atomic checkpoints that load without unpickling code.

A checkpoint is one file, `<run_dir>/checkpoint.pt`, holding plain data only: the model and
optimizer state dicts (tensors; FP8 optimizer states are `FP8Tensor`s, which register themselves
as safe globals), the config as a dict, the step, the RNG states as tensors and the data
loader's position as ints. It is read with `torch.load(weights_only=True)`, so a checkpoint
received from someone else cannot run code.

Writes are atomic: the payload goes to a temporary file in the same directory, is flushed and
fsync'ed, then `os.replace`d over the old checkpoint. A crash or an exception midway leaves the
previous checkpoint untouched (and the temporary file is removed), so there is never a
half-written `checkpoint.pt`. The rename is atomic on POSIX filesystems because source and
target are in the same directory.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_NAME = "checkpoint.pt"
FORMAT_VERSION = 1


def checkpoint_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINT_NAME


def save_checkpoint(run_dir: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """Write `payload` atomically to `<run_dir>/checkpoint.pt`; returns the path."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / CHECKPOINT_NAME
    fd, tmp = tempfile.mkstemp(prefix=f".{CHECKPOINT_NAME}.", suffix=".tmp", dir=run_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"format_version": FORMAT_VERSION, **payload}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        # Interrupted (exception, Ctrl-C): drop the partial file, keep the previous checkpoint.
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(run_dir)
    return target


def load_checkpoint(run_dir: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load `<run_dir>/checkpoint.pt` with `weights_only=True`; clear errors when it can't."""
    path = checkpoint_path(run_dir)
    if not path.is_file():
        raise FileNotFoundError(
            f"--resume: no checkpoint at {path}. Start a fresh run without --resume, or point "
            "--run_dir at the directory of the run you want to continue."
        )
    # FP8Tensor registers itself with torch.serialization.add_safe_globals on import.
    import nanochat.fp8  # noqa: F401

    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # unpickling errors come in many types; all mean "not loadable"
        raise RuntimeError(f"could not load checkpoint {path}: {e}") from e
    version = payload.get("format_version")
    if version != FORMAT_VERSION:
        raise RuntimeError(
            f"checkpoint {path} has format version {version}, this nanochat reads {FORMAT_VERSION}"
        )
    return payload


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


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory: makes a rename in it durable, POSIX); a no-op
    where it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
