"""A run directory: what it holds, and which process owns it.

    <run_dir>/.nanochat.lock             the lock of the process that runs here
    <run_dir>/checkpoint-000200.pt       one process's checkpoints, each with its .json manifest
    <run_dir>/checkpoint_dcp/step-.../   a torchrun run's checkpoints (nanochat.checkpoint.dcp)
    <run_dir>/metrics.jsonl, result.json the run's records;  <run_dir>/tokenizer/  its tokenizer

One process per run directory: a `nanochat.fs.FileLock` (flock) on `.nanochat.lock`, taken
without waiting before anything there is written or cleaned and held for the run's life. The
kernel drops it when the process ends, however it ends (kill -9 included), so a stale lock cannot
exist; a second process is refused, naming the pid, host and start time its holder signed into
the file. A file system or platform without file locks is a clear error, not an unlocked run.
Holds are counted per process: trainers built one after another in one process (tests,
notebooks) share the lock.

The lock is also a proof: every nanochat writer of checkpoint temporaries holds it, one save at a
time, so a temporary of nanochat's own naming that the holder finds outside a save was left by a
save that is over, and may be removed (pids could not prove that: they are reused). Anything else
is reported and left alone.

Claiming: a directory that holds a run (`run_contents`) is continued with --resume or replaced
with --overwrite, never clobbered, and --overwrite deletes only checkpoints whose manifests say
nanochat wrote them (the checkpoint store tells which are not: `nanochat.checkpoint.foreign`).
Each start of a run writes a start record first (`recorded_starts`): what --auto_resume reads
to tell this run's records from another's before the first checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Iterator

from nanochat.common import NanoChatError, UsageError, dist_env, logger
from nanochat.fs import FileLock, LockUnsupported, temp_pattern

LOCK_NAME = ".nanochat.lock"
RUN_FILES = ("metrics.jsonl", "result.json")
"""The run's records: with checkpoints, what makes a directory a run's (and what --overwrite deletes)."""
PT_NAME = re.compile(r"checkpoint-(\d+)\.pt")
"""A one-process checkpoint's file name (its manifest: the same name, .json)."""
DCP_DIRNAME = "checkpoint_dcp"
"""Where distributed runs keep their DCP step directories."""
START_EVENT = "start"
"""The `event` of the metrics.jsonl record each start of a run writes first (where it started
from, why, and the settings that identify the run)."""

_held: dict[str, list] = {}  # realpath of a run directory -> [its FileLock, count]


def run_contents(run_dir: str | os.PathLike) -> list[str]:
    """What in `run_dir` belongs to a training run (checkpoint files with or without manifest,
    the DCP directory, metrics, result); empty for any other directory."""
    d = Path(run_dir)
    if not d.is_dir():
        return []
    pts = sorted((int(m.group(1)), p.name) for p in d.glob("checkpoint-*.pt") if (m := PT_NAME.fullmatch(p.name)))
    found = [name for _, name in pts] + [n for n in RUN_FILES if (d / n).exists()]
    return found + ([DCP_DIRNAME + "/"] if (d / DCP_DIRNAME).exists() else [])


def recorded_starts(run_dir: str | os.PathLike) -> list[dict]:
    """The start records in `run_dir`'s metrics.jsonl, oldest first (a line cut by a kill ends
    the reading); empty without one."""
    try:
        lines = (Path(run_dir) / RUN_FILES[0]).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    starts = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            break
        if isinstance(rec, dict) and rec.get("event") == START_EVENT:
            starts.append(rec)
    return starts


# ------------------------------------------------------------------------------ the lock
def _key(run_dir: str | os.PathLike) -> str:
    return os.path.realpath(run_dir)


def acquire(run_dir: str | os.PathLike) -> None:
    """Take the lock of the existing directory `run_dir` for this process, or raise a UsageError
    naming the process that holds it."""
    key = _key(run_dir)
    if key in _held:
        _held[key][1] += 1
        return
    lock = FileLock(Path(run_dir) / LOCK_NAME)
    try:
        holder = lock.try_acquire()
    except LockUnsupported as e:
        if e.strerror is None:
            raise NanoChatError(f"cannot lock --run_dir {run_dir}: {e} (nanochat needs a POSIX system: Linux, "
                                "macOS, or WSL on Windows)") from None
        raise NanoChatError(f"cannot lock --run_dir {run_dir} ({e.strerror}): its file system does not support "
                            "file locks; choose a --run_dir on one that does") from None
    if holder is not None:
        raise UsageError(f"--run_dir {run_dir} is in use by another nanochat process ({holder}); wait for it or "
                         "choose another --run_dir")
    _held[key] = [lock, 1]


def release(run_dir: str | os.PathLike) -> None:
    """Give back one hold of `run_dir`'s lock; the last one unlocks it."""
    key = _key(run_dir)
    if key not in _held:
        return
    _held[key][1] -= 1
    if _held[key][1] == 0:
        _held.pop(key)[0].release()


def holder(run_dir: str | os.PathLike) -> str | None:
    """Who holds `run_dir`'s lock ('pid N on HOST, started T'), or None when nobody does: a
    training run in progress there."""
    if _key(run_dir) in _held:
        return f"this process, pid {os.getpid()}"
    return FileLock(Path(run_dir) / LOCK_NAME).holder()


@contextlib.contextmanager
def holding(run_dir: str | os.PathLike) -> Iterator[None]:
    """The lock of `run_dir` for the duration of the block (shared with a hold already taken)."""
    acquire(run_dir)
    try:
        yield
    finally:
        release(run_dir)


# ------------------------------------------------------------------------- claiming a run
def check_path(run_dir: str | os.PathLike) -> None:
    """A UsageError when --run_dir cannot be a directory: a symbolic link (itself or above it)
    that loops or leads nowhere (mkdir would say only "File exists"), or a file."""
    path = Path(run_dir)
    for p in (path, *path.parents):
        if not os.path.islink(p):
            continue
        try:
            os.stat(p)
        except OSError as e:
            what = (f"is a symbolic link that loops (to {os.readlink(p)}, which leads back to it)"
                    if e.errno == errno.ELOOP else f"is a symbolic link to {os.readlink(p)}, which does not exist")
            raise UsageError(f"--run_dir {path}: {p} {what}; point --run_dir at a directory, or repair "
                             "the link") from None
    if path.exists() and not path.is_dir():
        raise UsageError(f"--run_dir {path} exists and is not a directory; give a directory path")


def own(run_dir: str | os.PathLike) -> None:
    """Take `run_dir`'s lock for a run, held until `release`: a UsageError when another process
    holds it or the lock file cannot be written there."""
    try:
        acquire(run_dir)
    except OSError as e:
        raise UsageError(f"--run_dir {run_dir} is not writable ({e.strerror or e}); fix its permissions or "
                         "choose another --run_dir") from None


def check_claim(run_dir: str | os.PathLike, *, resume: bool, overwrite: bool, resumable: bool,
                foreign: Sequence[str]) -> None:
    """The claim rules, before any work: --resume needs a checkpoint to continue (`resumable`); a
    fresh start needs a directory without a run, or --overwrite and no checkpoint nanochat cannot
    tell it wrote (`foreign`, each with its reason: the only ones --overwrite would not delete).
    --overwrite through a symbolic link says which directory's run it deletes."""
    d, existing = Path(run_dir), run_contents(run_dir)
    if resume:
        if not resumable:
            raise UsageError(
                f"--resume: no checkpoint in {d} (no checkpoint-<step>.pt with its .json manifest, no "
                f"{DCP_DIRNAME}/). Start a fresh run without --resume, or point --run_dir at the directory of "
                "the run you want to continue.")
    elif existing and not overwrite:
        raise UsageError(
            f"--run_dir {d} already holds a run ({', '.join(existing[:4])}); continue it with --resume, "
            "replace it with --overwrite (deletes its checkpoints and metrics), or choose a new --run_dir")
    elif existing and foreign:
        raise UsageError(
            f"--overwrite: {d} holds checkpoints nanochat cannot tell it wrote ({'; '.join(foreign[:3])}), "
            "and it deletes only its own; move them out of the directory and run again")
    elif existing and os.path.realpath(d) != os.path.abspath(d) and dist_env().rank == 0:
        logger.warning("--overwrite: --run_dir %s is reached through a symbolic link: the run it deletes is the one "
                       "in %s", d, os.path.realpath(d))


def create(run_dir: str | os.PathLike, rank: int = 0) -> None:
    """Create `run_dir` and prove it writable (a probe file written and removed; every rank
    probes, since each writes there): a UsageError naming the fix otherwise."""
    d = Path(run_dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".write-probe-{os.getpid()}-{rank}"
        probe.write_bytes(b"nanochat")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"--run_dir {d} is not writable ({e.strerror or e}); fix its permissions or "
                         "choose another --run_dir") from None


_RECORD_TEMP = temp_pattern("|".join(map(re.escape, RUN_FILES)))


def record_temporaries(run_dir: str | os.PathLike) -> list[Path]:
    """The temporaries (fs.temp_path names) of run records whose write was interrupted: only the
    run's lock holder writes records, so under the lock none is being written."""
    d = Path(run_dir)
    return sorted(p for p in d.iterdir() if _RECORD_TEMP.fullmatch(p.name)) if d.is_dir() else []


def remove_records(run_dir: str | os.PathLike) -> None:
    """--overwrite: delete the previous run's records (its checkpoints go through the store)."""
    for name in RUN_FILES:
        (Path(run_dir) / name).unlink(missing_ok=True)


__all__ = ["LOCK_NAME", "RUN_FILES", "PT_NAME", "DCP_DIRNAME", "START_EVENT", "run_contents", "recorded_starts",
           "acquire", "release", "holder", "holding", "check_path", "own", "check_claim", "create",
           "record_temporaries", "remove_records"]
