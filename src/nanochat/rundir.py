"""One nanochat process per run directory: an OS file lock on `<run_dir>/.nanochat.lock`.

Two trainers on one --run_dir would log every step twice and write the same checkpoint names.
The trainer takes `fcntl.flock(LOCK_EX | LOCK_NB)` on a lock file inside the directory before
anything there is written or cleaned, and holds it for the run's life. The kernel drops the lock
when the process ends, however it ends (kill -9 included), so a stale lock cannot exist: the
file stays, only the lock on it counts. (Deleting lock files races: a process could lock a file
that another one has just unlinked.) The holder writes its pid, host and start time into the
file so that the process it refuses can name it. flock locks a local file system and, on Linux,
NFS (emulated there with byte-range locks); Windows has no fcntl: importing this module works,
locking raises a clear error.

The lock is held per process and counted: trainers built one after another in one process
(tests, notebooks) share it instead of refusing each other.

Why the lock is also a proof: every nanochat writer of checkpoint temporaries holds it (a bare
`save_checkpoint` takes it for the save), and one process saves one checkpoint at a time. So a
temporary file of nanochat's own naming found by the holder outside a save was left by a save
that is over, killed or failed, and may be removed; pids are not needed for that, and could not
prove it (they are reused). Anything else is reported and left alone.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from pathlib import Path
from typing import Iterator

from nanochat.common import NanoChatError, UsageError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

LOCK_NAME = ".nanochat.lock"

_held: dict[str, list[int]] = {}  # realpath of a run directory -> [lock file descriptor, count]


def _key(run_dir: str | os.PathLike) -> str:
    return os.path.realpath(run_dir)


def acquire(run_dir: str | os.PathLike) -> None:
    """Take the lock of the existing directory `run_dir` for this process, or raise a UsageError
    naming the process that holds it."""
    key = _key(run_dir)
    if key in _held:
        _held[key][1] += 1
        return
    if fcntl is None:
        raise NanoChatError(f"cannot lock --run_dir {run_dir}: this platform has no fcntl file locks "
                            "(nanochat needs a POSIX system: Linux, macOS, or WSL on Windows)")
    # os.open makes the descriptor non-inheritable: a program a run starts (compile workers) does
    # not keep the lock alive after the run dies.
    fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _holder(fd)
        os.close(fd)
        if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
            raise UsageError(f"--run_dir {run_dir} is in use by another nanochat process ({holder}); wait "
                             "for it or choose another --run_dir") from None
        raise NanoChatError(f"cannot lock --run_dir {run_dir} ({e.strerror or e}): its file system does not "
                            "support file locks; choose a --run_dir on one that does") from None
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    _held[key] = [fd, 1]


def release(run_dir: str | os.PathLike) -> None:
    """Give back one hold of `run_dir`'s lock; the last one unlocks it."""
    key = _key(run_dir)
    if key not in _held:
        return
    _held[key][1] -= 1
    if _held[key][1] == 0:
        os.close(_held.pop(key)[0])  # closing the descriptor releases the flock


def holder(run_dir: str | os.PathLike) -> str | None:
    """Who holds `run_dir`'s lock ('pid N on HOST, started T'), or None when nobody does: a
    training run in progress there. Probed with a shared lock taken and dropped at once."""
    if _key(run_dir) in _held:
        return f"this process, pid {os.getpid()}"
    try:
        fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return None
    try:
        if fcntl is None:
            return None
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        return _holder(fd) if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES) else None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


@contextlib.contextmanager
def holding(run_dir: str | os.PathLike) -> Iterator[None]:
    """The lock of `run_dir` for the duration of the block (shared with a hold already taken)."""
    acquire(run_dir)
    try:
        yield
    finally:
        release(run_dir)


def _holder(fd: int) -> str:
    """'pid N on HOST, started T' from the lock file, as its holder wrote it."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "it has not written its pid yet"
