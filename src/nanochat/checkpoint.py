"""Verified, atomic checkpoints that load without unpickling code.

A checkpoint of step N is two files in the run directory: `checkpoint-0000NN.pt`, plain data
only (model and optimizer state dicts, the config as a dict, the step, RNG states as tensors, the
data position as ints; FP8 optimizer states are `FP8Tensor`s, registered as safe globals), read
with `torch.load(weights_only=True)` so a checkpoint from someone else cannot run code; and
`checkpoint-0000NN.json`, its manifest: the file's name, step, size and sha256. The hash is
computed while the bytes stream to disk (no second copy in memory) and covers everything
torch.save wrote; loading re-hashes the file and refuses a mismatch, naming the file and the
newest older checkpoint that does verify. A manifest that names another file or step (a renamed
or planted checkpoint) is refused the same way.

A save writes both files under temporary names of its own (`.checkpoint-0000NN.pt.tmp-<pid>-<hex>`
and the manifest's likewise), fsync'ed, then renames the .pt and last the manifest into place: the
manifest's rename is the commit, and a kill at any instant leaves the previous checkpoints whole. Nothing is deleted that
this code cannot prove it wrote: at the next start, under the run lock (runlock.py says why that
is a proof), `clean_interrupted` removes temporaries of this naming and completes a save killed
between its two renames; a .pt without a manifest, or anything else, is reported and left.
Rotation keeps the newest `keep` checkpoints and deletes older ones only when their manifest
describes them. A failed write (e.g. ENOSPC) raises a `NanoChatError` naming the file.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanochat import runlock
from nanochat.common import NanoChatError, UsageError, format_bytes, fsync_path, warn_once

FORMAT_VERSION = 1
_NAME = re.compile(r"checkpoint-(\d+)\.pt")
# a save's temporaries: .checkpoint-000006.pt.tmp-<pid>-<hex> and .checkpoint-000006.json.tmp-...
_OWN_TEMP = re.compile(r"\.(checkpoint-\d+\.(?:pt|json))\.tmp-\d+-[0-9a-f]+")
_HASH_CHUNK = 1 << 24  # 16 MiB reads when verifying

DCP_DIRNAME = "checkpoint_dcp"
"""Where distributed runs keep their DCP checkpoints (distributed.py); named here so that
`run_contents` sees them."""
RUN_FILES = ("metrics.jsonl", "result.json", "checkpoint.pt")
"""Files that make a directory a run's (checkpoint.pt: the single checkpoint file of earlier
nanochat versions), besides its checkpoints."""


@dataclass(frozen=True)
class CheckpointFile:
    """One committed checkpoint: its step, .pt file and manifest."""

    step: int
    path: Path
    manifest: Path


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step:06d}.pt"


def _checkpoint_files(run_dir: str | os.PathLike) -> list[CheckpointFile]:
    """Every checkpoint-<step>.pt of `run_dir`, manifest or not, oldest first."""
    out = []
    for p in Path(run_dir).glob("checkpoint-*.pt"):
        m = _NAME.fullmatch(p.name)
        if m:
            out.append(CheckpointFile(int(m.group(1)), p, p.with_suffix(".json")))
    return sorted(out, key=lambda c: c.step)


def list_checkpoints(run_dir: str | os.PathLike) -> list[CheckpointFile]:
    """Committed checkpoints of `run_dir` (those with a manifest), oldest first."""
    return [c for c in _checkpoint_files(run_dir) if c.manifest.is_file()]


def latest_checkpoint(run_dir: str | os.PathLike) -> CheckpointFile | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def uncommitted(run_dir: str | os.PathLike) -> list[CheckpointFile]:
    """checkpoint-<step>.pt files without their manifest, oldest first: never loaded, never deleted."""
    return [c for c in _checkpoint_files(run_dir) if not c.manifest.is_file()]


def run_contents(run_dir: str | os.PathLike) -> list[str]:
    """What in `run_dir` belongs to a training run (checkpoints with or without manifest, DCP
    checkpoints, metrics, result); empty for any other directory."""
    d = Path(run_dir)
    if not d.is_dir():
        return []
    found = [c.path.name for c in _checkpoint_files(d)]
    found += [n for n in RUN_FILES if (d / n).exists()]
    return found + ([DCP_DIRNAME + "/"] if (d / DCP_DIRNAME).exists() else [])


def newest_checkpoint(run_dir: str | os.PathLike, flag: str) -> CheckpointFile | None:
    """The newest committed checkpoint of `run_dir`; a UsageError when a .pt without a manifest
    is newer (never silently fall back to an older one)."""
    files = _checkpoint_files(run_dir)
    c = latest_checkpoint(run_dir)
    if files and not files[-1].manifest.is_file() and (c is None or files[-1].step > c.step):
        raise UsageError(unmanifested_message(files[-1].path, flag, c.path if c else None, c.step if c else None))
    return c


def unmanifested_message(path: Path, flag: str, older: Path | None, older_step: int | None) -> str:
    """The refusal of a newest checkpoint that has no manifest (a .pt file or a DCP step)."""
    instead = (f"move it out of {path.parent} to continue from step {older_step} ({older.name})"
               if older is not None else "move it away to start from scratch")
    return (f"{flag}: the newest checkpoint {path} has no manifest, so it cannot be verified (nanochat "
            f"neither loads nor deletes such a checkpoint): restore its manifest, or {instead}")


def foreign_checkpoints(run_dir: str | os.PathLike) -> list[str]:
    """The checkpoint files of `run_dir` that nanochat cannot prove it wrote (no manifest, or one
    that does not describe them), each with the reason: what --overwrite refuses to delete."""
    out = []
    for c in _checkpoint_files(run_dir):
        problem = manifest_problem(c) if c.manifest.is_file() else "it has no manifest"
        if problem is not None:
            out.append(f"{c.path.name} ({problem})")
    return out


def clean_interrupted(run_dir: str | os.PathLike) -> list[str]:
    """Finish or remove what killed saves left in `run_dir`, under its lock; returns one line per
    file for the log. A pending manifest whose .pt is in place and matches it completes its save
    (the kill came between the two renames); every other temporary of a save is removed; a .pt
    without a manifest and temporaries of other names are reported and left alone."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    notes = []
    with runlock.holding(run_dir):
        for p in sorted(run_dir.iterdir()):
            m = _OWN_TEMP.fullmatch(p.name)
            if m is None or not p.is_file():
                continue
            final = run_dir / m.group(1)
            if final.suffix == ".json" and _completes(p, final.with_suffix(".pt")):
                os.replace(p, final)
                notes.append(f"completed the save of {final.with_suffix('.pt')}, killed before its manifest's rename")
            else:
                p.unlink(missing_ok=True)
                notes.append(f"removed {p}, left by an interrupted save")
        if notes:
            fsync_path(run_dir)
        for c in uncommitted(run_dir):
            notes.append(f"left {c.path} alone: it has no manifest {c.manifest.name}, so nanochat neither loads "
                         "nor deletes it; restore its manifest or move it away")
        for p in sorted(run_dir.glob(".checkpoint-*")):
            if not _OWN_TEMP.fullmatch(p.name):
                notes.append(f"left {p} alone: not a temporary name of this nanochat's saves; delete it if no "
                             f"other program writes {run_dir}")
    return notes


def _completes(pending: Path, pt: Path) -> bool:
    """Whether the pending manifest `pending` describes the bytes of `pt` (which is in place)."""
    try:
        m = json.loads(pending.read_text())
        return m["file"] == pt.name and file_problem(pt, m["sha256"], int(m["bytes"])) is None
    except (OSError, ValueError, KeyError, TypeError):
        return False


def remove_checkpoints(run_dir: str | os.PathLike) -> None:
    """Delete the checkpoints of `run_dir` whose manifests describe them (manifest first, so none
    is half-deleted); any other checkpoint file stays."""
    with runlock.holding(run_dir):
        for c in list_checkpoints(run_dir):
            if manifest_problem(c) is None:
                c.manifest.unlink(missing_ok=True)
                c.path.unlink(missing_ok=True)


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


def _temp_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def _write_new(path: Path, write) -> None:
    """Create `path` (it must not exist; permissions as open() gives them), fill it with
    `write(f)` and put it on disk."""
    with open(path, "xb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(run_dir: str | os.PathLike, payload: dict[str, Any], *, step: int | None = None,
                    keep: int = 2) -> Path:
    """Write `payload` as the checkpoint of `step` (default: payload["step"]), then keep only the
    newest `keep` checkpoints; returns the .pt path. Holds `run_dir`'s lock meanwhile."""
    run_dir = Path(run_dir)
    step = int(payload["step"] if step is None else step)
    run_dir.mkdir(parents=True, exist_ok=True)
    with runlock.holding(run_dir):
        path = run_dir / checkpoint_name(step)
        c = CheckpointFile(step, path, path.with_suffix(".json"))
        if c.path.exists():  # re-saving a step: only over a checkpoint of ours
            problem = manifest_problem(c) if c.manifest.is_file() else "it has no manifest"
            if problem is not None:
                raise NanoChatError(f"not saving step {step}: {c.path} exists and nanochat cannot tell it wrote it "
                                    f"({problem}); move it out of {run_dir} and run again")
        _write_committed(c, payload)
        ours = []  # rotation counts and deletes only checkpoints whose manifests describe them
        for other in list_checkpoints(run_dir):
            problem = manifest_problem(other)
            if problem is None:
                ours.append(other)
            else:
                warn_once(f"keep {other.path}", f"not counting or deleting {other.path}: {problem}")
        for old in ours[:-keep] if keep > 0 else []:
            old.manifest.unlink(missing_ok=True)  # uncommit first: a kill midway leaves no half checkpoint
            old.path.unlink(missing_ok=True)
    return c.path


def _write_committed(c: CheckpointFile, payload: dict[str, Any]) -> None:
    """Both files of `c` under temporary names, then the renames: the .pt's, the manifest's last."""
    tmp_pt, tmp_manifest = _temp_path(c.path), _temp_path(c.manifest)
    writer = _HashingWriter(None)

    def write(f) -> None:
        writer.f = f
        try:
            torch.save({"format_version": FORMAT_VERSION, **payload}, writer)
        except RuntimeError as e:
            if writer.error is not None:
                raise writer.error from e
            raise

    placed = False
    try:
        _write_new(tmp_pt, write)
        manifest = {"file": c.path.name, "sha256": writer.sha.hexdigest(), "bytes": writer.size, "step": c.step,
                    "format_version": FORMAT_VERSION}
        _write_new(tmp_manifest, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        os.replace(tmp_pt, c.path)  # a kill from here to the commit: clean_interrupted completes it
        placed = True
        os.replace(tmp_manifest, c.manifest)  # the commit
    except BaseException as e:
        tmp_pt.unlink(missing_ok=True)
        tmp_manifest.unlink(missing_ok=True)
        if placed:
            c.path.unlink(missing_ok=True)  # never committed
        if not isinstance(e, OSError):
            raise
        prev = latest_checkpoint(c.path.parent)
        kept = f"the previous checkpoint {prev.path} is intact" if prev else "no earlier checkpoint exists"
        if e.errno == errno.ENOSPC:
            raise NanoChatError(
                f"no space left on the device while writing checkpoint {c.path} (step {c.step}, "
                f"{format_bytes(writer.size)} written); {kept}. Free disk space, or lower "
                "--keep_checkpoints, or point --run_dir at another disk, then continue with --resume"
            ) from e
        raise NanoChatError(f"could not write checkpoint {c.path}: {e}; {kept}") from e
    fsync_path(c.path.parent)


def _read_manifest(c: CheckpointFile) -> tuple[dict[str, Any] | None, str | None]:
    try:
        m = json.loads(c.manifest.read_text())
        m["file"], int(m["step"]), int(m["bytes"]), m["sha256"]  # noqa: B018 -- each must be there
        return m, None
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"its manifest {c.manifest} is unreadable ({type(e).__name__}: {e})"


def manifest_problem(c: CheckpointFile) -> str | None:
    """None when `c`'s manifest describes `c`: it names this file and step and its size. Cheap (no
    read of the .pt): what deleting a checkpoint requires; loading also checks the bytes."""
    m, problem = _read_manifest(c)
    if problem is not None:
        return problem
    if m["file"] != c.path.name or int(m["step"]) != c.step:
        return (f"its manifest describes {m['file']} (step {m['step']}), not {c.path.name}: it was renamed or "
                "copied under another step's name")
    try:
        got = c.path.stat().st_size
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    if got != int(m["bytes"]):
        return f"it has {got:,} bytes, its manifest says {int(m['bytes']):,} (truncated or appended to)"
    return None


def verify_checkpoint(c: CheckpointFile) -> str | None:
    """None when `c`'s manifest describes it and its bytes match the manifest's hash, else what
    is wrong."""
    problem = manifest_problem(c)
    if problem is not None:
        return problem
    m, _ = _read_manifest(c)
    return file_problem(c.path, m["sha256"], int(m["bytes"]))


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


def last_good_checkpoint(run_dir: str | os.PathLike, before: int | None = None, *,
                         finite: bool = False) -> CheckpointFile | None:
    """The newest checkpoint (older than step `before`, if given) whose bytes verify and, with
    `finite`, whose weights and optimizer states hold no inf/nan (each candidate is loaded)."""
    for c in reversed(list_checkpoints(run_dir)):
        if (before is None or c.step < before) and verify_checkpoint(c) is None:
            if not finite:
                return c
            payload, problem = _load(c, "cpu", mmap=True)
            if problem is None and not nonfinite_tensors(payload):
                return c
    return None


def _load(c: CheckpointFile, map_location, *, mmap: bool = False,
          keys: tuple[str, ...] = ()) -> tuple[dict[str, Any] | None, str | None]:
    """(payload, None) for a verified checkpoint that loads as nanochat's, else (None, why not)."""
    import nanochat.fp8.tensor  # noqa: F401  FP8Tensor registers itself as a safe global on import

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


def load_checkpoint(source: str | os.PathLike, map_location: str | torch.device = "cpu", *,
                    keys: tuple[str, ...] = (), mmap: bool = False, flag: str = "--run_dir") -> dict[str, Any]:
    """Load the newest checkpoint of run directory `source` (or the checkpoint file `source`),
    verified against its manifest, with `weights_only=True`; clear errors, naming `flag` (what
    gave `source`), when it can't: a damaged or foreign file, a step that disagrees with the
    name, one of `keys` missing, a newer checkpoint without its manifest."""
    source = Path(source)
    if source.is_file():
        m = _NAME.fullmatch(source.name)
        if m is None or not source.with_suffix(".json").is_file():
            raise UsageError(f"{source} is not a nanochat checkpoint: expected checkpoint-<step>.pt next "
                             "to its manifest checkpoint-<step>.json (what training writes)")
        c = CheckpointFile(int(m.group(1)), source, source.with_suffix(".json"))
    else:
        c = newest_checkpoint(source, flag)
        if c is None:
            found = "no such directory" if not source.is_dir() else "no checkpoint-<step>.pt with its .json manifest"
            raise UsageError(f"{flag} {source} holds no checkpoint ({found}); point {flag} at the directory of "
                             "a run that saved one")
    problem = verify_checkpoint(c)
    if problem is None:
        payload, problem = _load(c, map_location, mmap=mmap, keys=keys)
        if problem is None:
            return payload
    raise NanoChatError(f"{flag}: checkpoint {c.path} is not usable: {problem}; {_unusable_fix(c, flag)}")


def _unusable_fix(c: CheckpointFile, flag: str = "--resume") -> str:
    """What to do about the unusable checkpoint `c`: use the previous one that verifies."""
    prev = last_good_checkpoint(c.path.parent, before=c.step)
    if flag == "--resume":
        if prev is None:
            return "no older checkpoint verifies; start again with --overwrite"
        return (f"the previous checkpoint {prev.path} (step {prev.step}) verifies: delete {c.path.name} and "
                f"{c.manifest.name} and run again with --resume to continue from step {prev.step}")
    if prev is None:
        return "no older checkpoint of that run verifies; restore this one from a copy"
    return (f"the previous checkpoint {prev.path} (step {prev.step}) verifies: move {c.path.name} and "
            f"{c.manifest.name} out of {c.path.parent} to use it")


def nonfinite_tensors(payload: dict[str, Any]) -> list[str]:
    """The names of a loaded checkpoint's weights and optimizer states that hold inf/nan."""
    from nanochat.fp8.tensor import FP8Tensor

    def finite(t: torch.Tensor) -> bool:
        if isinstance(t, FP8Tensor):  # its codes (a transient fp32 copy) and scales
            return bool(torch.isfinite(t.codes.float()).all() and torch.isfinite(t.scale).all())
        return not t.is_floating_point() or bool(torch.isfinite(t).all())

    named = list((payload.get("model") or {}).items())
    for i, state in ((payload.get("optimizer") or {}).get("state") or {}).items():
        named += [(f"optimizer state {i}.{k}", v) for k, v in state.items()]
    return [name for name, t in named if isinstance(t, torch.Tensor) and not finite(t)]


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
