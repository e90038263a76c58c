"""Files written whole, manifests and the file lock (nanochat.fs), against references that cannot
be faked: hashlib over the final file's bytes, the bytes put in a directory before and after,
and another process holding the lock.

- an atomic write whose writer raises midway leaves the old file byte for byte and nothing else
  in the directory; the entry it returns (sha256, bytes) equals hashlib's over the final file,
  also for a buffer of 8-byte items; the file has the permissions open() gives (umask applied);
- a manifest committed over staged files verifies; a flipped byte, a truncated file and a
  missing file are each reported in words naming the file (a size-only check passes the flipped
  byte, as the cheap check must); a commit whose last rename fails leaves nothing; the .pt
  checkpoint's one-file manifest reads as the same {name: entry} layout;
- the lock, held by another process, refuses a second holder naming that process's pid, makes a
  waiter wait, and is released by the kernel when that process is SIGKILLed (the waiter then
  holds it); a file system without locks is named in the run directory's refusal and the token
  store's warning.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
from array import array
from pathlib import Path

import pytest

from nanochat import fs, rundir
from nanochat.common import NanoChatError, logger
from nanochat.data.build import locked
from nanochat.fs import AtomicFile, FileLock, commit_manifest, manifest_problems, read_manifest, write_atomic
from tests.conftest import ROOT


# ------------------------------------------------------------------ atomic writes
def test_a_writer_raising_midway_leaves_the_old_file_and_nothing_else(tmp_path):
    path = tmp_path / "state.json"
    path.write_bytes(b"old contents")

    def half(f) -> None:
        f.write(b"new contents, the first half")
        raise RuntimeError("the writer died")

    with pytest.raises(RuntimeError, match="the writer died"):
        write_atomic(path, half)
    assert path.read_bytes() == b"old contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]

    f = AtomicFile(path)  # the object form: discarded after a write, the same
    f.write(b"x" * 100)
    f.discard()
    assert path.read_bytes() == b"old contents" and sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_the_entry_is_hashlibs_sha256_and_size_of_the_final_file(tmp_path):
    path = tmp_path / "d" / "data.bin"  # its directory is created
    words = array("q", range(1000))  # a buffer of 8-byte items: its size is in bytes, not items
    entry = write_atomic(path, lambda f: [f.write(b"head"), f.write(memoryview(words)), f.write(os.urandom(5000))])
    data = path.read_bytes()
    assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    assert len(data) == 4 + 8000 + 5000
    assert write_atomic(tmp_path / "t.txt", "héllo\n") == {"sha256": hashlib.sha256("héllo\n".encode()).hexdigest(),
                                                           "bytes": 7}
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask  # as open() creates files: caches are shared
    assert sorted(p.name for p in path.parent.iterdir()) == ["data.bin"]


# ------------------------------------------------------------------ manifests
def _committed(d: Path) -> dict[str, dict]:
    """Two files staged and committed by a manifest in `d`; the manifest's files."""
    staged = []
    for name, data in (("a.bin", os.urandom(3000)), ("b.bin", b"b" * 1000)):
        f = AtomicFile(d / name)
        f.write(data)
        f.close()
        staged.append(f)
    assert not (d / "a.bin").exists()  # staged: on disk under the temporary name only
    commit_manifest(d / "manifest.json", {"step": 3, "files": {f.path.name: f.close() for f in staged}}, staged)
    return read_manifest(d / "manifest.json")[1]


def test_a_committed_manifest_verifies_and_each_damage_is_named(tmp_path):
    files = _committed(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "b.bin", "manifest.json"]
    assert files == {n: {"sha256": hashlib.sha256((tmp_path / n).read_bytes()).hexdigest(),
                         "bytes": (tmp_path / n).stat().st_size} for n in ("a.bin", "b.bin")}
    assert list(manifest_problems(tmp_path, files)) == []

    a = bytearray((tmp_path / "a.bin").read_bytes())
    a[1500] ^= 0x01
    (tmp_path / "a.bin").write_bytes(bytes(a))
    (problem,) = manifest_problems(tmp_path, files)
    assert problem.startswith(f"file {tmp_path / 'a.bin'} has sha256 ") and problem.endswith("(corrupted)"), problem
    assert next(manifest_problems(tmp_path, files, hash=False), None) is None  # the size-only check: same size

    (tmp_path / "b.bin").write_bytes(b"b" * 600)
    assert list(manifest_problems(tmp_path, files, hash=False)) == [
        f"file {tmp_path / 'b.bin'} has 600 bytes, its manifest says 1,000 (truncated or appended to)"]
    (tmp_path / "b.bin").unlink()
    problems = list(manifest_problems(tmp_path, files))
    assert len(problems) == 2 and problems[1] == f"file {tmp_path / 'b.bin'} is missing", problems


def test_a_commit_whose_last_rename_fails_leaves_nothing(tmp_path, monkeypatch):
    f = AtomicFile(tmp_path / "data.bin")
    f.write(b"d" * 100)
    f.close()
    real = os.replace

    def fail_on_manifest(src, dst):
        if Path(dst).name == "manifest.json":
            raise OSError(errno.EIO, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", fail_on_manifest)
    with pytest.raises(OSError, match="Input/output error"):
        commit_manifest(tmp_path / "manifest.json", {"files": {"data.bin": f.close()}}, [f])
    assert list(tmp_path.iterdir()) == []  # the data file it had placed is gone too


def test_the_one_file_layout_of_a_pt_manifest_reads_as_files(tmp_path):
    entry = write_atomic(tmp_path / "checkpoint-000001.pt", b"payload")
    (tmp_path / "checkpoint-000001.json").write_text(json.dumps({"file": "checkpoint-000001.pt", **entry, "step": 1}))
    m, files = read_manifest(tmp_path / "checkpoint-000001.json")
    assert m["step"] == 1 and files == {"checkpoint-000001.pt": entry}
    (tmp_path / "bad.json").write_text(json.dumps({"files": {"x": {"bytes": 3}}}))
    with pytest.raises(ValueError, match=r"not \{name: \{sha256, bytes\}\}.*'sha256'"):
        read_manifest(tmp_path / "bad.json")


# ------------------------------------------------------------------ the lock
HOLDER = "import sys, time\nfrom nanochat.fs import FileLock\nassert FileLock(sys.argv[1]).try_acquire() is None\n" \
         "print('held', flush=True)\ntime.sleep(600)"


def _hold_elsewhere(path: Path) -> subprocess.Popen:
    """A process (its own process group) holding the lock on `path`, once it has said so."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    if not ready or proc.stdout.readline().strip() != "held":
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail("the holding process did not take the lock within 60 s")
    return proc


def test_the_lock_names_its_holder_and_dies_with_it(tmp_path):
    path = tmp_path / ".lock"
    proc = _hold_elsewhere(path)
    try:
        assert FileLock(path).holder().startswith(f"pid {proc.pid} on ")
        refused = FileLock(path).try_acquire()
        assert refused is not None and refused.startswith(f"pid {proc.pid} on "), refused
        waiter = FileLock(path)
        waited = threading.Thread(target=waiter.wait, daemon=True)
        waited.start()
        waited.join(0.5)
        assert waited.is_alive()  # blocked on the holder
        os.killpg(proc.pid, signal.SIGKILL)  # kill -9: no code of the holder runs
        proc.wait()
        waited.join(30)
        assert not waited.is_alive()  # the kernel released the lock, and the waiter holds it now
        assert FileLock(path).holder().startswith(f"pid {os.getpid()} on ")
        waiter.release()
        assert FileLock(path).holder() is None
        assert path.exists()  # never deleted: only the lock on it counts
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_no_file_locks_is_named_by_the_run_dir_and_the_store(tmp_path, monkeypatch, caplog):
    def enolck(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fs.fcntl, "flock", enolck)  # NFS without its lock daemon
    with pytest.raises(NanoChatError, match=rf"cannot lock --run_dir {tmp_path} \(No locks available\): its file "
                                            r"system does not support file locks; choose a --run_dir on one that does"):
        rundir.acquire(tmp_path)
    monkeypatch.setattr(logger, "propagate", True)  # to caplog, also after a script's setup_logging
    caplog.set_level(logging.WARNING, logger="nanochat")
    ran = []
    with locked(tmp_path / "store", "the token store of t"):
        ran.append(True)
    assert ran and any("the token store of t: its file system has no file locks (No locks available); proceeding "
                       "without one" in r.message for r in caplog.records), caplog.records
