"""Files that are whole or absent: hashed atomic writes, manifests committed last, one file lock.

A reader of anything nanochat writes sees the old file or the whole new one, never a part.
`AtomicFile` writes under a temporary name of its own next to the target
(`.<name>.tmp-<pid>-<hex>`, created exclusively: a rename is atomic only within one file system),
hashes (sha256) and counts the bytes as they pass, and `commit` puts them on disk (fsync),
renames them into place and makes the rename durable (fsync of the directory). `write_atomic`
is the one-call form; `publish_file` and `publish_directory` do the same for what another
program writes, or a whole directory.

A set of files is committed by its manifest, {name: {"sha256", "bytes"}} written last by rename
(`commit_manifest`): whoever finds the manifest finds every file it names whole. `read_manifest`
reads it (and the one-file layout of a .pt checkpoint's), `manifest_problems` says in words what
differs: a file missing, truncated, or changed. Checkpoints (.pt and DCP) and the token store
share this; each keeps its manifest's other fields.

`FileLock` is an exclusive `fcntl.flock` on a file: taken without waiting (the holder named) or
waited for. The kernel drops it when its process ends, kill -9 included, so no lock is ever
stale (the file stays; deleting lock files races). Its holder signs the file (pid, host, start)
so that a process refused or kept waiting can name it. flock works on local file systems and,
on Linux, NFS; elsewhere `LockUnsupported` says so and the caller decides (why not the
`filelock` package: docs/design.md).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from nanochat.common import NanoChatError

try:
    import fcntl
except ImportError:  # Windows: importing works, locking raises LockUnsupported
    fcntl = None

HASH_CHUNK = 1 << 24  # 16 MiB reads when hashing a file


# ------------------------------------------------------------------ writing
def fsync_path(path: str | os.PathLike) -> None:
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


def temp_path(path: Path) -> Path:
    """A temporary name of this process's own next to `path`: `.<name>.tmp-<pid>-<8 hex>`."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def temp_pattern(names: str) -> re.Pattern[str]:
    """What `temp_path` names for the files whose names match the regex `names` (group 1: the name)."""
    return re.compile(rf"\.({names})\.tmp-\d+-[0-9a-f]+")


class AtomicFile:
    """A binary file written under `temp_path(path)`, hashed and counted as it is written;
    `commit` makes it `path`, `discard` removes it. `close` alone leaves it on disk under its
    temporary name, for `commit_manifest` to rename. The OSError of a failed write is kept in
    `error`: torch.save replaces it with a RuntimeError of its own ("unexpected pos")."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = temp_path(self.path)
        self._f = open(self.tmp, "xb")  # permissions as open() gives them (0666 less the umask)
        self.sha, self.size, self.error = hashlib.sha256(), 0, None

    def write(self, data: bytes | memoryview) -> int:
        try:
            n = self._f.write(data)
        except OSError as e:
            self.error = self._named(e)
            raise self.error from None
        self.sha.update(data)
        self.size += memoryview(data).nbytes
        return n

    def flush(self) -> None:
        self._f.flush()

    def _named(self, e: OSError) -> OSError:
        """`e` naming this file's final path: a write's or flush's error names no file."""
        return e if e.filename is not None or e.errno is None else OSError(e.errno, e.strerror, str(self.path))

    def close(self) -> dict[str, Any]:
        """The bytes on disk under the temporary name; their manifest entry {"sha256", "bytes"}."""
        if not self._f.closed:
            try:
                self._f.flush()
                os.fsync(self._f.fileno())
            except OSError as e:
                raise self._named(e) from None
            self._f.close()
        return {"sha256": self.sha.hexdigest(), "bytes": self.size}

    def commit(self) -> dict[str, Any]:
        """`close`, the rename into place, the rename made durable; the manifest entry."""
        entry = self.close()
        os.replace(self.tmp, self.path)
        fsync_path(self.path.parent)
        return entry

    def discard(self) -> None:
        """Remove what was written (nothing once committed)."""
        with contextlib.suppress(OSError):  # a close that fails to flush: the file goes anyway
            self._f.close()
        self.tmp.unlink(missing_ok=True)


def write_atomic(path: str | os.PathLike, content: str | bytes | Callable[[BinaryIO], None]) -> dict[str, Any]:
    """Write `path` whole or not at all (see AtomicFile): text (UTF-8), bytes, or a function
    writing to the binary file. Returns the file's manifest entry {"sha256", "bytes"}."""
    f = AtomicFile(path)
    try:
        if callable(content):
            content(f)
        else:
            f.write(content.encode("utf-8") if isinstance(content, str) else content)
        return f.commit()
    except BaseException:
        f.discard()
        raise


def publish_file(path: str | os.PathLike, make: Callable[[Path], None]) -> None:
    """`path` made by `make(tmp)`, which has a program create the file named `tmp` (a compiler's
    -o): a temporary name of ours next to `path`, put on disk and renamed into place; removed on
    any error."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        make(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def publish_directory(out: str | os.PathLike, fill: Callable[[Path], None]) -> Path:
    """Create directory `out` whole: `fill` writes into a temporary sibling, which then takes
    `out`'s place, so a reader sees the old directory or the complete new one and no file of the
    old one survives next to the new ones. An existing `out` is set aside and deleted only once
    the new one is in place; on any error the temporary directory goes and the old one is back.
    The caller decides whether `out` may be replaced (nanochat.model.export.check_export_dir).
    A symbolic link to a directory stays: the directory it points to is the one replaced."""
    out = Path(out)
    if os.path.islink(out) and out.is_dir():
        out = Path(os.path.realpath(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-{os.getpid()}-{secrets.token_hex(4)}"
    old = None
    try:
        tmp.mkdir()
        fill(tmp)
        if out.is_dir() and any(out.iterdir()):
            old = out.parent / f".{out.name}.replaced-{os.getpid()}-{secrets.token_hex(4)}"
            os.rename(out, old)
        elif out.is_dir():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # ours, never published
        if old is not None and not out.exists():
            os.rename(old, out)  # the previous directory back in place
        raise
    if old is not None:
        shutil.rmtree(old)
    return out


# ------------------------------------------------------------------ manifests
def hash_file(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest entry {"sha256", "bytes"} of a file, read in 16 MiB chunks."""
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return {"sha256": sha.hexdigest(), "bytes": size}


def commit_manifest(path: str | os.PathLike, manifest: dict[str, Any], staged: Sequence[AtomicFile] = ()) -> None:
    """Commit files by their manifest (JSON): the manifest is put on disk under its temporary
    name, the `staged` files (closed AtomicFiles) are renamed into place, the manifest last:
    the commit. A kill just before it leaves the manifest under its temporary name, next to the
    files it describes (nanochat.checkpoint.pt completes such a save). On an error nothing of
    the commit is left, the staged files placed by it included."""
    m = AtomicFile(path)
    placed: list[AtomicFile] = []
    try:
        m.write((json.dumps(manifest, indent=1) + "\n").encode())
        m.close()
        for f in staged:
            os.replace(f.tmp, f.path)
            placed.append(f)
        os.replace(m.tmp, m.path)  # the commit
    except BaseException:
        m.discard()
        for f in staged:
            f.discard()
        for f in placed:
            f.path.unlink(missing_ok=True)  # placed by this commit, never committed
        raise
    for d in {m.path.parent, *(f.path.parent for f in staged)}:
        fsync_path(d)


def read_manifest(path: str | os.PathLike) -> tuple[Any, dict[str, dict[str, Any]]]:
    """(the manifest at `path`, its files as {name: {"sha256", "bytes"}}): the layout
    `commit_manifest` writes ({"files": {...}, ...}) or a .pt checkpoint's one-file layout
    ({"file": name, "sha256", "bytes", ...}). OSError when it cannot be read, ValueError when it
    is not such a manifest."""
    m = json.loads(Path(path).read_text(encoding="utf-8"))
    try:
        listed = m["files"] if "files" in m else {m["file"]: m}
        files = {str(name): {"sha256": str(e["sha256"]), "bytes": int(e["bytes"])} for name, e in listed.items()}
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"its entries are not {{name: {{sha256, bytes}}}} ({type(e).__name__}: {e})") from None
    return m, files


def file_problem(path: str | os.PathLike, entry: dict[str, Any], *, hash: bool = True) -> str | None:
    """None when the file at `path` is what its manifest `entry` says, else what is wrong, a
    phrase whose subject is the file ("is missing", "has 10 bytes, its manifest says 12 ...").
    Its size is checked (a stat), and with `hash` its sha256 (reading every byte)."""
    try:
        got = hash_file(path) if hash else {"bytes": os.stat(path).st_size}
    except FileNotFoundError:
        return "is missing"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if got["bytes"] != entry["bytes"]:
        return f"has {got['bytes']:,} bytes, its manifest says {entry['bytes']:,} (truncated or appended to)"
    if hash and got["sha256"] != entry["sha256"]:
        return f"has sha256 {got['sha256'][:16]}..., its manifest says {entry['sha256'][:16]}... (corrupted)"
    return None


def manifest_problems(directory: str | os.PathLike, files: dict[str, dict[str, Any]], *,
                      hash: bool = True) -> Iterator[str]:
    """What differs between `directory` and its manifest's `files`, one sentence per file, in
    the manifest's order and lazily: `next(manifest_problems(...), None)` stops at the first."""
    for name, entry in files.items():
        problem = file_problem(Path(directory) / name, entry, hash=hash)
        if problem is not None:
            yield f"file {Path(directory) / name} {problem}"


# ------------------------------------------------------------------ the lock
_HELD = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES)  # flock's "another process holds it"
UNSIGNED = "a process that has not written its pid yet"


class LockUnsupported(NanoChatError):
    """No file lock here: this platform has no fcntl (`strerror` None), or the file system
    refused flock (its `strerror`: NFS without its lock daemon, some FUSE file systems)."""

    def __init__(self, strerror: str | None) -> None:
        self.strerror = strerror
        super().__init__("this platform has no fcntl file locks" if strerror is None
                         else f"its file system has no file locks ({strerror})")


class FileLock:
    """An exclusive `fcntl.flock` on `path` (created if missing, never deleted), signed by its
    holder. The descriptor is not inheritable: a program the holder starts (compile workers)
    does not keep the lock alive after the holder dies."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._fd: int | None = None

    def try_acquire(self) -> str | None:
        """Take the lock without waiting: None once held, else who holds it ('pid N on HOST,
        started T'). LockUnsupported where there are no file locks; OSError when the file cannot
        be opened."""
        if fcntl is None:
            raise LockUnsupported(None)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _signature(fd)
            os.close(fd)
            if e.errno in _HELD:
                return holder
            raise LockUnsupported(e.strerror or str(e)) from None
        self._signed(fd)
        return None

    def wait(self) -> None:
        """Take the lock, waiting for its holder to release it (or to die)."""
        if fcntl is None:
            raise LockUnsupported(None)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            os.close(fd)
            raise LockUnsupported(e.strerror or str(e)) from None
        self._signed(fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def holder(self) -> str | None:
        """Who holds the lock now, or None when nobody does: probed with a shared lock, taken and
        dropped at once."""
        if fcntl is None:
            return None
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            return _signature(fd) if e.errno in _HELD else None
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def _signed(self, fd: int) -> None:
        """Hold `fd`'s lock and write this process into the file, for those it refuses."""
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd


def _signature(fd: int) -> str:
    """'pid N on HOST, started T' from a lock file as its holder signed it; UNSIGNED before."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return UNSIGNED


__all__ = ["AtomicFile", "FileLock", "LockUnsupported", "UNSIGNED", "commit_manifest", "file_problem", "fsync_path",
           "hash_file", "manifest_problems", "publish_directory", "publish_file", "read_manifest", "temp_path",
           "temp_pattern", "write_atomic"]
