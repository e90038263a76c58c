"""A training run's directory and its checkpoints: verified, atomic, loaded without unpickling.

A checkpoint of step N is two files in the run directory: `checkpoint-0000NN.pt`, plain data
only (state dicts, the config as a dict, RNG states as tensors, the data position as ints; FP8
moments are `FP8Tensor`s, registered as safe globals), read with `torch.load(weights_only=True)`
so a checkpoint from someone else cannot run code; and `checkpoint-0000NN.json`, its manifest:
the file's name, step, size and sha256, hashed while the bytes stream to disk. Loading re-hashes
the file and refuses a mismatch, or a manifest naming another file or step, naming the newest
older checkpoint that does verify. A save writes both under temporary names, fsync'ed, then
renames the .pt and last the manifest (the commit): a kill at any instant leaves the previous
checkpoints whole. Nothing is deleted that this code cannot prove it wrote: under the run lock
(runlock.py says why that is a proof) `clean_interrupted` removes its own temporaries and
completes a save killed between its renames; rotation deletes only checkpoints whose manifest
describes them. A failed write (e.g. ENOSPC) raises a `NanoChatError` naming the file.

`Checkpointer` is this for NanoChatTrainer: it claims --run_dir (one process per run; a run
there is continued with --resume or replaced with --overwrite, never clobbered), saves and keeps
checkpoints (a .pt in one process, DCP steps under torchrun: distributed.py), reads a --resume
checkpoint before the model is built (its settings must match, RESUME_MUST_MATCH; its FP8 layer
set decides the conversion) and restores it once the model and optimizer exist, and reads the
run an --init_from starts from. Inf/nan is never saved, and never resumed.
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
import torch.nn as nn

from nanochat import distributed
from nanochat import rundir as runlock
from nanochat.common import (
    DistEnv, NanoChatError, UsageError, file_problem, format_bytes, fsync_path, logger, warn_once,
)
from nanochat.config import RESUME_MUST_MATCH, TrainConfig, flag_text
from nanochat.distributed import DCP_DIRNAME
from nanochat.model.gpt import PRESETS
from nanochat.tokenizer import BPETokenizer, HFTokenizer, Tokenizer

FORMAT_VERSION = 1
_NAME = re.compile(r"checkpoint-(\d+)\.pt")
# a save's temporaries: .checkpoint-000006.pt.tmp-<pid>-<hex> and .checkpoint-000006.json.tmp-...
_OWN_TEMP = re.compile(r"\.(checkpoint-\d+\.(?:pt|json))\.tmp-\d+-[0-9a-f]+")

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
            training = runlock.holder(source) if source.is_dir() else None
            if training is not None:  # a run in progress that has not saved yet
                raise UsageError(f"{flag} {source} holds no checkpoint yet: a training run is in progress there "
                                 f"({training}) and writes its first checkpoint at its first --save_every step or "
                                 f"at its end; wait for it, or point {flag} at a run that saved one")
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
    named = list((payload.get("model") or {}).items())
    for i, state in ((payload.get("optimizer") or {}).get("state") or {}).items():
        named += [(f"optimizer state {i}.{k}", v) for k, v in state.items()]
    flags = [(name, all_finite(t)) for name, t in named if isinstance(t, torch.Tensor)]
    return [name for name, ok in flags if ok is not None and not bool(ok)]


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


# ------------------------------------------------------------------------- a training run's
RESUME_DEFAULTS = {"master_weights": "fp32", "master_weights_emulate": False, "init_from": None, "fp8_layers": "all"}
"""What a checkpoint written before a field existed trained with (before --fp8_layers, FP8
converted every eligible layer)."""
_RESUME_KEYS = ("config.batch_size", "step", "data", "tokenizer_fingerprint")
"""What a checkpoint must hold to be resumed (dotted: nested), besides the tensors: a .pt's
"model", "optimizer" and "rng", which a DCP step holds outside its trainer.json."""
_INIT_KEYS = ("config.model_name", "step", "tokenizer_fingerprint")
"""What a checkpoint must hold to start another run from (--init_from), besides "model"."""
_TENSORS = ("model", "optimizer", "rng")


def run_tokenizer(run_dir: str | os.PathLike, fingerprint: str | None, flag: str) -> Tokenizer:
    """The tokenizer a run trained with, from its tokenizer/ (ours, or a Hugging Face model's
    tokenizer.json with the chat template the records were rendered with), checked against the
    `fingerprint` its checkpoint recorded: a checkpoint's weights mean something only with it."""
    directory = Path(run_dir) / "tokenizer"
    if not directory.is_dir():
        raise UsageError(f"{flag} {run_dir}: its tokenizer/ directory is missing, and the weights only mean "
                         "something with the tokenizer they were trained with; restore it from the run")
    tokenizer = (HFTokenizer.load(directory) if (directory / "tokenizer.json").is_file()
                 else BPETokenizer.load(directory))
    if fingerprint is not None and tokenizer.fingerprint != fingerprint:
        raise UsageError(f"{flag} {run_dir}: {directory} is not the tokenizer its checkpoint was trained with "
                         "(fingerprints differ: its token ids mean other text); restore the run's own tokenizer/")
    return tokenizer


@dataclass
class Saved:
    """A checkpoint found and verified for --resume or --init_from."""

    kind: str
    """"pt" (checkpoint-<step>.pt) or "dcp" (a step directory of a distributed run)."""
    path: Path
    step: int
    meta: dict[str, Any]
    """Everything it holds but the tensors (a DCP step's trainer.json)."""
    tokenizer: Tokenizer | None = None
    """--init_from: the source run's tokenizer, checked against the checkpoint."""
    weights: dict[str, torch.Tensor] | None = None
    """--init_from of a .pt: its model state, memory-mapped until loaded."""


class Checkpointer:
    """A training run's directory and checkpoints: claim it (one process per run directory; a run
    already there is continued with --resume or replaced with --overwrite, never clobbered), save
    verified checkpoints and keep the newest --keep_checkpoints (a .pt in one process, DCP steps
    under torchrun), resume one, or start from another run's (--init_from)."""

    def __init__(self, config: TrainConfig, dist: DistEnv):
        self.config, self.dist = config, dist
        self.run_dir = Path(config.run_dir)
        self._locked = False

    # ---------------------------------------------------------------- the directory
    def claim(self) -> None:
        """Before any work: lock a --run_dir that exists (rank 0; the lock also lets it finish or
        remove what a killed save left there) and refuse to clobber a run in it. One that does not
        exist yet is created and locked by `prepare`, so an error before the first step leaves
        nothing behind."""
        problem = _link_problem(self.run_dir)
        if problem is not None:
            raise UsageError(f"--run_dir {self.run_dir}: {problem}; point --run_dir at a directory, or repair the link")
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise UsageError(f"--run_dir {self.run_dir} exists and is not a directory; give a directory path")
        if self.run_dir.is_dir():
            self._lock()
        distributed.barrier()  # the other ranks look at what rank 0 finished or removed
        self._refuse_clobbering()

    def prepare(self) -> None:
        """Just before the first step: create --run_dir and prove it writable (every rank probes,
        since each writes there); rank 0 locks a directory created just now and looks at it again
        (another process may have started there meanwhile), and makes room for --overwrite: the
        previous run's checkpoints that their manifests describe, and its metrics, are deleted
        (anything else was refused), with no barrier: the other ranks only write there later."""
        d = self.run_dir
        try:
            d.mkdir(parents=True, exist_ok=True)
            probe = d / f".write-probe-{os.getpid()}-{self.dist.rank}"
            probe.write_bytes(b"nanochat")
            probe.unlink()
        except OSError as e:
            raise UsageError(f"--run_dir {d} is not writable ({e.strerror or e}); fix its permissions or "
                             "choose another --run_dir") from None
        if self.dist.rank != 0:
            return
        if not self._locked:
            self._lock()
            self._refuse_clobbering()
        if self.config.overwrite and run_contents(d):
            logger.info("--overwrite: deleting the previous run's checkpoints and metrics in %s", d)
            remove_checkpoints(d)
            distributed.remove_dcp(d)
            for name in RUN_FILES:
                (d / name).unlink(missing_ok=True)

    def release(self) -> None:
        if self._locked:
            runlock.release(self.run_dir)
            self._locked = False

    def _lock(self) -> None:
        """Rank 0: take --run_dir's lock, held until `release`, then finish or remove what a killed
        save left there and report what is not provably nanochat's (runlock.py: why that is a proof)."""
        if self.dist.rank != 0:
            return
        try:
            runlock.acquire(self.run_dir)
        except OSError as e:
            raise UsageError(f"--run_dir {self.run_dir} is not writable ({e.strerror or e}); fix its permissions or "
                             "choose another --run_dir") from None
        self._locked = True
        for note in clean_interrupted(self.run_dir) + distributed.clean_interrupted_dcp(self.run_dir):
            logger.info("%s", note)

    def _refuse_clobbering(self) -> None:
        """--resume needs a checkpoint; a fresh start needs a directory without a run, or
        --overwrite and only checkpoints nanochat can tell it wrote (the only ones it deletes)."""
        d, existing = self.run_dir, run_contents(self.run_dir)
        if self.config.resume:
            if self.find(d, "--resume") is None:
                legacy = (" Its checkpoint.pt was written by an earlier nanochat, without the checksum --resume "
                          "verifies: it still loads with torch.load(weights_only=True), but cannot be resumed."
                          if (d / "checkpoint.pt").is_file() else "")
                raise UsageError(
                    f"--resume: no checkpoint in {d} (no checkpoint-<step>.pt with its .json manifest, no "
                    f"{DCP_DIRNAME}/).{legacy} Start a fresh run without --resume, or point --run_dir at the "
                    "directory of the run you want to continue.")
        elif existing and not self.config.overwrite:
            raise UsageError(
                f"--run_dir {d} already holds a run ({', '.join(existing[:4])}); continue it with --resume, "
                "replace it with --overwrite (deletes its checkpoints and metrics), or choose a new --run_dir")
        elif existing:
            foreign = foreign_checkpoints(d) + distributed.foreign_dcp(d)
            if foreign:
                raise UsageError(
                    f"--overwrite: {d} holds checkpoints nanochat cannot tell it wrote ({'; '.join(foreign[:3])}), "
                    "and it deletes only its own; move them out of the directory and run again")

    # ------------------------------------------------------------------- reading
    def find(self, run_dir: Path, flag: str) -> tuple[str, Path, int] | None:
        """("pt", file, step) or ("dcp", step directory, step): the newest checkpoint of run_dir, or
        None. Both formats exist only after a crash between writing one and deleting the other;
        the later step wins. A checkpoint without a manifest that is newer is refused: falling
        back to an older one would silently lose its steps."""
        dcp_dir, pt = distributed.latest_dcp(run_dir), latest_checkpoint(run_dir)
        found = ([("dcp", dcp_dir, distributed.dcp_step(dcp_dir))] if dcp_dir else []) + (
            [("pt", pt.path, pt.step)] if pt else [])
        newest = max(found, key=lambda f: f[2], default=None)  # a tie: the first, DCP
        loose = ([(c.path, c.step) for c in uncommitted(run_dir)]
                 + [(p, distributed.dcp_step(p)) for p in distributed.uncommitted_dcp(run_dir)])
        newest_loose = max(loose, key=lambda f: f[1], default=None)
        if newest_loose is not None and (newest is None or newest_loose[1] > newest[2]):
            older, older_step = newest[1:] if newest else (None, None)
            raise UsageError(unmanifested_message(newest_loose[0], flag, older, older_step))
        return newest

    def _read(self, kind: str, path: Path, flag: str, keys: tuple[str, ...]) -> dict[str, Any]:
        """The checkpoint at `path`, verified: a .pt's payload memory-mapped on the CPU (its
        tensors read only where used), a DCP step's trainer.json; a NanoChatError naming what is
        wrong. A DCP step for --resume is verified by rank 0 for every rank (collective)."""
        if kind == "pt":
            tensors = _TENSORS if flag == "--resume" else ("model",)
            return load_checkpoint(path, map_location="cpu", keys=keys + tensors, mmap=True, flag=flag)
        if flag == "--resume":
            distributed.verify_dcp(path)
        else:
            problem = distributed.dcp_problem(path)
            if problem is not None:
                raise NanoChatError(f"{flag} {path.parent.parent}: its newest checkpoint {path} is not usable "
                                    f"({problem}); restore it, or move it away to start from the run's previous "
                                    "checkpoint")
        try:
            meta = distributed.read_dcp_meta(path)
        except (OSError, ValueError) as e:
            meta, problem = None, f"its {distributed.META_NAME} does not read ({e})"
        else:
            missing = missing_keys(meta, keys) if isinstance(meta, dict) else list(keys)
            problem = (f"its {distributed.META_NAME} lacks {', '.join(map(repr, missing))}" if missing else
                       None if meta["step"] == distributed.dcp_step(path) else
                       f"it holds step {meta['step']} under the name of step {distributed.dcp_step(path)}")
        if problem is not None:
            raise NanoChatError(f"{flag}: DCP checkpoint {path} is not usable: {problem}; move it out of "
                                f"{path.parent} to use the previous step")
        return meta

    def read_resume(self, total_steps: int, tokenizer: Tokenizer) -> Saved:
        """--resume, before the model is built: the newest checkpoint, verified, whose settings and
        tokenizer this run shares. Refused before any work: a checkpoint at or past the last step
        (it would train nothing; one whose run died before its result.json does resume, to finish)."""
        cfg, d = self.config, self.run_dir
        kind, path, step = self.find(d, "--resume")
        more = f"pass a larger --num_iterations (more than {step}) to train on"
        if step > total_steps:
            budget = (f"--num_iterations {cfg.num_iterations}" if cfg.num_iterations > 0
                      else f"--num_epochs {cfg.num_epochs} ({total_steps} steps)")
            raise UsageError(f"--resume: {d} is already at step {step} ({path.name}); {budget} would train "
                             f"nothing: {more}")
        if step == total_steps and _finished(d, step):
            raise UsageError(f"--resume: the run in {d} already finished at step {step} (its result.json); "
                             f"{more}, or start it over with --overwrite")
        payload = self._read(kind, path, "--resume", _RESUME_KEYS)
        meta = {k: v for k, v in payload.items() if k not in _TENSORS}  # the tensors are read by `restore`
        del payload
        self._check_settings(meta)
        if meta["tokenizer_fingerprint"] != tokenizer.fingerprint:
            raise UsageError("--resume: the tokenizer differs from the one the checkpoint was trained "
                             "with; pass the same --tokenizer_dir (or the same corpus and --vocab_size)")
        return Saved(kind, path, int(meta["step"]), meta)

    def _check_settings(self, meta: dict[str, Any]) -> None:
        """The flags that change the model, the data stream or the optimizer's meaning
        (config.RESUME_MUST_MATCH) as the checkpoint has them; the others (--num_iterations,
        --eval_every, ...) may differ, so a run can be extended. The batch is compared globally
        (batch_size x ranks): 2 ranks of 8 sequences resume in 1 process of 16 or 4 of 4."""
        saved, now = meta["config"], self.config.to_dict()
        saved_paths, paths_now = meta.get("resolved_paths") or {}, resolved_paths(self.config)

        def same(k: str) -> bool:
            if saved.get(k, RESUME_DEFAULTS.get(k)) == now[k]:
                return True
            if k == "fp8_layers" and not (saved.get("fp8") or now["fp8"]):
                return True  # which layers FP8 converts is moot in a run without FP8
            return k in paths_now and saved_paths.get(k, saved.get(k)) == paths_now[k]

        diff = {k: (saved.get(k, RESUME_DEFAULTS.get(k)), now[k]) for k in RESUME_MUST_MATCH if not same(k)}
        saved_ranks, ranks = meta.get("world_size", 1), self.dist.world_size
        if saved["batch_size"] * saved_ranks != now["batch_size"] * ranks:
            diff["batch_size"] = (f"{saved['batch_size']} x {saved_ranks} ranks", f"{now['batch_size']} x {ranks} ranks")
        if diff:
            lines = ", ".join(f"--{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items())
            level = (". FP8Optim loads moments saved at another --fp8_opt_level, but a resumed run keeps its "
                     "checkpoint's level (its optimizer state continues as saved); to change the level, start a "
                     "new run from these weights with --init_from" if "fp8_opt_level" in diff else "")
            raise UsageError(f"--resume: this run's settings differ from the checkpoint's ({lines}); "
                             f"use the checkpoint's values or a new --run_dir{level}")

    def read_init_source(self) -> Saved:
        """--init_from: the source run's newest checkpoint (.pt or DCP), verified, and its tokenizer,
        checked against this run before any weight is read: a preset of the same name, the same
        tokenizer it trained with. A .pt checkpoint is memory-mapped: only the weights are read."""
        cfg = self.config
        src = Path(cfg.init_from)
        found = self.find(src, "--init_from")
        if found is None:
            raise UsageError(f"--init_from {src}: no checkpoint there (no checkpoint-<step>.pt with its .json "
                             f"manifest, no {DCP_DIRNAME}/); give the --run_dir of a run that saved one")
        kind, path, _ = found
        meta = self._read(kind, path, "--init_from", _INIT_KEYS)
        name = meta["config"]["model_name"]
        if name not in PRESETS:
            raise UsageError(f"--init_from {src} trained the Hugging Face model {name}: continue from its export "
                             f"(python scripts/export_hf.py --run_dir {src} --out_dir <dir>, then --model_name <dir>)")
        if name != cfg.model_name:
            raise UsageError(f"--init_from {src} holds a {name} model, --model_name is {cfg.model_name}: "
                             f"pass --model_name {name}")
        tokenizer = run_tokenizer(src, meta["tokenizer_fingerprint"], "--init_from")
        return Saved(kind, path, int(meta["step"]), {k: v for k, v in meta.items() if k != "model"},
                     tokenizer=tokenizer, weights=meta["model"] if kind == "pt" else None)

    # ------------------------------------------------------------------- loading
    def restore(self, saved: Saved, model: nn.Module, optimizer: torch.optim.Optimizer, loader: Any, fp8: Any,
                device: torch.device) -> int:
        """The checkpoint `read_resume` found, into the built parts: the weights and optimizer
        states (checked finite), the RNG states, the data `loader`'s position and `fp8`'s state
        (FP8Training: counters, auto's formats). Returns its step."""
        if saved.kind == "dcp":
            tensors = {"rng_cpu": torch.get_rng_state()}
            distributed.load_dcp(saved.path, model, optimizer, tensors=tensors, verify=False)
            rng = {"cpu": tensors["rng_cpu"]}
        else:  # verified by read_resume; read again onto the device, tensors only
            payload, problem = _load(CheckpointFile(saved.step, saved.path, saved.path.with_suffix(".json")),
                                     device, keys=_TENSORS)
            if problem is not None:
                raise NanoChatError(f"--resume: checkpoint {saved.path} is not usable: {problem}")
            if self.dist.is_distributed and self.config.fsdp:
                distributed.load_full_state_dicts(model, optimizer, payload["model"], payload["optimizer"])
            else:
                model.load_state_dict(payload["model"])
                optimizer.load_state_dict(payload["optimizer"])
            rng = payload["rng"]
        bad = nonfinite_state(model, optimizer)
        if bad:
            raise NanoChatError(f"--resume: checkpoint {saved.path} holds inf/nan ({bad}), so training cannot "
                                f"continue from it; move it out of {saved.path.parent} to resume from the previous "
                                "checkpoint")
        loader.load_state_dict(saved.meta["data"])
        set_rng_state(rng)
        try:
            fp8.load_state_dict(saved.meta)
        except ValueError as e:  # FP8 choices that do not fit this model: say it in flags
            raise ValueError(flag_text(str(e))) from None
        logger.info("resumed from %s at step %d", saved.path, saved.step)
        return saved.step

    @torch.no_grad()
    def load_init_weights(self, source: Saved, model: nn.Module) -> None:
        """The --init_from source's weights into the freshly built model (before the master-weight
        cast and FP8 conversion, which then treat them as any initial weights)."""
        try:
            if source.kind == "dcp":
                distributed.load_dcp_model(source.path, model)
            else:
                model.load_state_dict(source.weights)
        except (RuntimeError, KeyError) as e:
            raise UsageError(f"--init_from {self.config.init_from}: its weights do not fit this {self.config.model_name} "
                             f"model ({str(e).splitlines()[0]}); it was saved by another version of the model") from None
        source.weights = None  # the memory-mapped checkpoint is closed with its last reference
        bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
        if bad:
            raise NanoChatError(f"--init_from {self.config.init_from}: its checkpoint {source.path} holds inf/nan in "
                                f"{', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}; start from one of its earlier "
                                "checkpoints (move this one away)")
        logger.info("initialized from %s (step %d of that run)", source.path, source.step)

    # ------------------------------------------------------------------- writing
    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """A checkpoint of `step`: the weights, the optimizer, RNG states, the config and `state`
        (the loop's: data position, tokenizer fingerprint, FP8 state, the step's record). In one
        process a .pt (this module), distributed a DCP directory (every rank); both verified, the
        newest --keep_checkpoints kept, the format not written deleted afterwards so a resume
        finds one. A model or optimizer state holding inf/nan is never written: the run stops,
        naming the last checkpoint that is good."""
        bad = nonfinite_state(model, optimizer)
        if bad:
            raise NanoChatError(
                f"step {step}: not saving, {bad} hold inf/nan. Step {step}'s loss and gradients were "
                f"finite, so its update made them so (or an earlier update, in weights no batch since "
                f"used). {self.good_checkpoint_note()}: lower --lr, check the data, or try "
                "--fp8_mode e5m2 / auto")
        meta = {"config": self.config.to_dict(), "resolved_paths": resolved_paths(self.config), "step": step,
                "world_size": self.dist.world_size, **state}
        keep = self.config.keep_checkpoints
        if self.dist.is_distributed:
            rng = {f"rng_{k}": v for k, v in rng_state().items() if k == "cpu"}
            distributed.save_dcp(self.run_dir, model, optimizer, step=step, meta=meta, tensors=rng, keep=keep)
            if self.dist.rank == 0:
                remove_checkpoints(self.run_dir)
            return
        save_checkpoint(self.run_dir, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                       "rng": rng_state(), **meta}, step=step, keep=keep)
        distributed.remove_dcp(self.run_dir)

    def good_checkpoint_note(self) -> str:
        """Which checkpoint a resume would start from, checked now: its checksums, and its weights
        and optimizer states loaded and found finite (DCP: by rank 0 only, without communication:
        this runs on error paths, where ranks may diverge)."""
        if self.dist.is_distributed:
            if self.dist.rank == 0:
                dcp, checked = distributed.last_good_dcp(self.run_dir, finite=True), "verified, finite"
            else:
                dcp, checked = distributed.latest_dcp(self.run_dir), "rank 0 checks it"
            return (f"The last good checkpoint is {dcp} (step {distributed.dcp_step(dcp)}, {checked})" if dcp
                    else f"No good checkpoint of this run is in {self.run_dir}")
        good = last_good_checkpoint(self.run_dir, finite=True)
        if good is None:
            return f"No good checkpoint of this run is in {self.run_dir}"
        return f"The last good checkpoint is {good.path} (step {good.step}, verified, finite)"


def _link_problem(path: Path) -> str | None:
    """Why `path`, or a directory above it, cannot be a directory: a symbolic link that loops or
    leads nowhere (mkdir would say only "File exists"); None when there is none."""
    for p in (path, *path.parents):
        if not os.path.islink(p):
            continue
        try:
            os.stat(p)
        except OSError as e:
            if e.errno == errno.ELOOP:
                return f"{p} is a symbolic link that loops (to {os.readlink(p)}, which leads back to it)"
            return f"{p} is a symbolic link to {os.readlink(p)}, which does not exist"
    return None


def _finished(run_dir: Path, step: int) -> bool:
    """Whether the run's result.json says it finished at `step`."""
    try:
        return json.loads((run_dir / "result.json").read_text()).get("steps") == step
    except (OSError, ValueError, AttributeError):
        return False


def resolved_paths(config: TrainConfig) -> dict[str, str | None]:
    """The path-valued fields as absolute, symlink-free paths: what resume compares (so `tok/`
    and `tok`, relative and absolute, name the same directory)."""
    out = {}
    for k in ("model_name", "dataset_path", "tokenizer_dir", "init_from"):
        v = getattr(config, k)
        out[k] = None if v is None else (os.path.realpath(v) if os.path.exists(v) else v)
    return out


def all_finite(t: torch.Tensor) -> torch.Tensor | None:
    """A 0-dim bool on the device (no sync) saying `t` holds no inf/nan; None for a tensor without
    floats. An FP8Tensor (FP8 moments): its codes (a transient fp32 copy) and scales."""
    from nanochat.fp8.tensor import FP8Tensor

    if isinstance(t, FP8Tensor):
        return torch.isfinite(t.codes.float()).all() & torch.isfinite(t.scale).all()
    return torch.isfinite(t).all() if t.is_floating_point() and t.numel() else None


def nonfinite_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """'' when every parameter and optimizer state is finite, else which tensors are not. One flag
    per tensor, stacked and reduced once: a single device-to-host read for the whole model (the
    names are looked up only when something is wrong); every rank decides alike."""
    def finite(t: torch.Tensor) -> torch.Tensor | None:
        return all_finite(t.to_local() if isinstance(t, distributed.DTensor) else t)

    named = [(f"parameter {n}", finite(p.detach())) for n, p in model.named_parameters()]
    for i, st in enumerate(optimizer.state_dict()["state"].values()):
        named += [(f"optimizer state {i}.{k}", finite(v)) for k, v in st.items()
                  if isinstance(v, torch.Tensor) and v.ndim]
    named = [(n, f) for n, f in named if f is not None]
    if not named:
        return ""
    flags = torch.stack([f for _, f in named])
    bad = distributed.all_reduce_sum((~flags).sum().float().reshape(1))
    if bad.item() == 0:
        return ""
    names = [n for (n, _), ok in zip(named, flags.tolist()) if not ok]
    return (f"{len(names)} of {len(named)} tensors on this rank ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''})" if names else "tensors on another rank")
