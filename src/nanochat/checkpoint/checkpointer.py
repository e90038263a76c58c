"""The trainer's checkpoint component: one object, built once, called at fixed points of a run.

    claim()            before any work: --run_dir checked, locked (rank 0), not clobbered (rundir.py);
                       how the run starts (`start`): fresh, restarted from step 0, or resumed
    read_init_source() --init_from: the source run's newest checkpoint, verified, and its tokenizer
    read_resume()      --resume, before the model is built: verified and compatible (resume.py)
    prepare()          just before the first step: the directory created, --overwrite's room made
    save(step, parts)  every --save_every steps and at the end: a .pt in one process, a DCP step
                       under torchrun (every rank), the newest --keep_checkpoints kept
    restore(parts)     the --resume checkpoint into the same parts, built
    release()          the run lock, when the run ends

`parts` is the run's one mapping of stateful parts, name -> an object with state_dict() and
load_state_dict() (torch.distributed.checkpoint's Stateful): "model" and "optimizer", whose
tensors the storage writes (.pt or DCP shards), and the parts whose state is plain data (the data
position, FP8's, the step guard's): each of those returns checkpoint keys of its own (FP8Training
prefixes its keys, StepGuard's sit under "guard", `Keyed` puts a part's under one key), merged into
the checkpoint's metadata beside the run's config, and is given that whole metadata back.

--auto_resume: rank 0 looks at --run_dir (after finishing what killed saves left there) and
decides for every rank, which it tells (`broadcast_object`), so all take the same branch: no run
there starts it; this run's newest checkpoint resumes it (checked as --resume checks it, once the
tokenizer is known); this run's records without a checkpoint restart it from step 0 (their start
records say whose they are); anything else is refused before a byte is written, and a run that
had finished is reported (`finished`). Each start's record (`start_record`) goes first into
metrics.jsonl: where it started from and which restart counters it came with.

Which checkpoint is the newest, whether it verifies and what is kept is the store's (store.py),
the same for both storages. Inf/nan is never saved, and never resumed (nonfinite.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.stateful import Stateful

from nanochat import rundir
from nanochat.checkpoint import dcp, pt, resume, store
from nanochat.checkpoint.dcp import DCP
from nanochat.checkpoint.pt import PT
from nanochat.checkpoint.nonfinite import nonfinite_state
from nanochat.device import rng_state, set_rng_state
from nanochat.checkpoint.storage import Checkpoint
from nanochat.common import NanoChatError, UsageError, logger
from nanochat.config import TrainConfig, flag_text
from nanochat.parallel.layout import Layout
from nanochat.parallel.process_group import barrier, broadcast_object, restart_counts
from nanochat.rundir import DCP_DIRNAME, START_EVENT

TENSOR_PARTS = ("model", "optimizer")
"""The parts whose state the storage writes as tensors; every other part's is plain data."""

Start = Literal["fresh", "restart", "resume"]
"""How a run starts: in a directory without a run (or --overwrite's); from step 0 over the records
of this run's earlier start, which died before its first checkpoint (--auto_resume); or from the
newest checkpoint (--resume, or --auto_resume finding this run's)."""


@dataclass
class Saved:
    """A checkpoint found, verified and checked: for --resume, --init_from, or a run's model to
    load (nanochat.checkpoint.loader)."""

    checkpoint: Checkpoint
    meta: dict[str, Any]
    """Everything it holds but the tensors (a DCP step's trainer.json)."""
    tokenizer: Any = None
    """--init_from: the source run's tokenizer, checked against the checkpoint."""
    weights: dict[str, torch.Tensor] | None = None
    """A .pt's model state, memory-mapped until loaded (--init_from, a run's model)."""
    origin: str = ""
    """The flag and directory it was found through (`--init_from runs/base`): errors name them."""

    @property
    def path(self) -> Path:
        return self.checkpoint.path

    @property
    def step(self) -> int:
        return self.checkpoint.step


class Keyed:
    """A part whose plain state sits under one `key` of a checkpoint (the data position: "data")."""

    def __init__(self, key: str, part: Stateful):
        self.key, self.part = key, part

    def state_dict(self) -> dict[str, Any]:
        return {self.key: self.part.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.part.load_state_dict(state[self.key])


class Checkpointer:
    """A training run's checkpoints and its claim on --run_dir (module docstring)."""

    def __init__(self, config: TrainConfig, layout: Layout):
        self.config, self.layout = config, layout
        self.run_dir = Path(config.run_dir)
        self.flag = "--auto_resume" if config.auto_resume else "--resume"
        """The flag that resumes this run: errors about its checkpoint name it."""
        self.start: Start = "resume" if config.resume else "fresh"
        """How the run starts (`Start`); --auto_resume's is decided by `claim`."""
        self._locked = False

    @property
    def resuming(self) -> bool:
        return self.start == "resume"

    # ---------------------------------------------------------------- the directory
    def claim(self) -> None:
        """Before any work: lock a --run_dir that exists (rank 0; the lock also lets it finish or
        remove what a killed save left there) and refuse to clobber a run in it; --auto_resume
        decides here how the run starts. One that does not exist yet is created and locked by
        `prepare`, so an error before the first step leaves nothing behind."""
        rundir.check_path(self.run_dir)
        if self.run_dir.is_dir():
            self._lock()
        barrier()  # the other ranks look at what rank 0 finished or removed
        if self.config.auto_resume:
            self.start = self._decide()
        else:
            self._check_claim()

    def _decide(self) -> Start:
        """--auto_resume: rank 0's decision (module docstring), or its refusal, on every rank."""
        start, problem = None, None
        if self.layout.rank == 0:
            try:
                start = self._auto_start()
            except UsageError as e:
                problem = str(e)
        start, problem = broadcast_object((start, problem))
        if problem is not None:
            raise UsageError(problem)
        if start == "restart":  # a resume says where it resumed from once it has (`restore`)
            logger.info("--auto_resume: %s holds this run's records but no checkpoint: starting it over from step 0",
                        self.run_dir)
        return start

    def _auto_start(self) -> Start:
        if not rundir.run_contents(self.run_dir):
            return "fresh"
        if self.newest() is not None:
            return "resume"  # whether it is this run's: read_resume, once the tokenizer is known
        resume.check_recorded_run(rundir.recorded_starts(self.run_dir), self.config)
        return "restart"

    def prepare(self) -> None:
        """Just before the first step: create --run_dir and prove it writable (every rank); rank 0
        locks a directory created just now and looks at it again (another process may have started
        there meanwhile), and makes room for --overwrite: the previous run's checkpoints that their
        manifests describe, and its records, are deleted (anything else was refused), with no
        barrier: the other ranks only write there later."""
        rundir.create(self.run_dir, self.layout.rank)
        if self.layout.rank != 0:
            return
        if not self._locked:
            self._lock()
            self._check_claim()
        if self.config.overwrite and rundir.run_contents(self.run_dir):
            logger.info("--overwrite: deleting the previous run's checkpoints and metrics in %s", self.run_dir)
            store.remove(self.run_dir)
            rundir.remove_records(self.run_dir)

    def release(self) -> None:
        if self._locked:
            rundir.release(self.run_dir)
            self._locked = False

    def _lock(self) -> None:
        """Rank 0: take --run_dir's lock, held until `release`, then finish or remove what a killed
        save left there and report what is not provably nanochat's."""
        if self.layout.rank != 0:
            return
        rundir.own(self.run_dir)
        self._locked = True
        for note in store.clean_interrupted(self.run_dir):
            logger.info("%s", note)

    def _check_claim(self) -> None:
        cfg = self.config
        resumable = self.resuming and self.newest() is not None
        foreign = store.foreign(self.run_dir) if cfg.overwrite else []
        rundir.check_claim(self.run_dir, resume=self.resuming, overwrite=cfg.overwrite, resumable=resumable,
                           foreign=foreign)

    def finished(self, total_steps: int) -> int | None:
        """--auto_resume: the step this run already finished at, when its result.json says so and
        the run has nothing left to train (it then says so and exits 0); else None. Asked once the
        records or checkpoint found are known to be this run's."""
        steps = resume.finished_steps(self.run_dir) if self.config.auto_resume else None
        if steps is None or self.start == "fresh":
            return None
        if self.start == "resume":
            newest = self.newest()
            steps = steps if newest is not None and newest.step == steps == total_steps else None
        elif steps != total_steps:
            raise UsageError(f"--auto_resume: the run in {self.run_dir} finished at step {steps} (its result.json) and "
                             "kept no checkpoint to continue from; start it over with --overwrite, or choose a new "
                             "--run_dir")
        if steps is not None:
            logger.info("--auto_resume: the run in %s already finished at step %d (its result.json); nothing to train",
                        self.run_dir, steps)
        return steps

    def start_record(self, resumed: Saved | None) -> dict[str, Any]:
        """The record this start writes first into metrics.jsonl: how and from which step it
        started (`from_step`; the checkpoint it `resumed`), the world size, the restart counters of
        torchrun and slurm (restart_counts) and the run's identity (resume.identity)."""
        return {"event": START_EVENT, "start": self.start, "from_step": resumed.step if resumed else 0,
                "checkpoint": None if resumed is None else str(resumed.path.relative_to(self.run_dir)),
                "world_size": self.layout.world_size, "data_parallel": self.layout.dp_size, **restart_counts(),
                **resume.identity(self.config)}

    # ------------------------------------------------------------------- reading
    def newest(self) -> Checkpoint | None:
        """The checkpoint a resume of this run starts from (store.newest: not verified here)."""
        return store.newest(self.run_dir, self.flag)

    def newest_if_any(self) -> Checkpoint | None:
        """`newest`, or None where none is there or it cannot be read: for the line a run ends
        with (not verified: it runs on the way out; a --resume from it verifies it)."""
        with contextlib.suppress(NanoChatError, OSError):
            return self.newest()
        return None

    def read_resume(self, total_steps: int, tokenizer: Any) -> Saved:
        """A resume, before the model is built: the newest checkpoint, with steps left to train,
        verified, whose settings and tokenizer this run shares (resume.py). Collective.
        --resume checks the steps first (a refusal reads nothing); --auto_resume checks the
        settings first: a different run in --run_dir is refused even where it had finished."""
        c, auto = self.newest(), self.config.auto_resume
        if not auto:
            resume.check_budget(c, self.config, total_steps)
        tensors = resume.TENSORS if c.kind == "pt" else ()  # a DCP step's tensors are outside trainer.json
        meta = store.read(c, self.flag, resume.RESUME_KEYS + tensors)
        meta = {k: v for k, v in meta.items() if k not in resume.TENSORS}  # `restore` reads the tensors
        resume.check_resume(meta, self.config, world_size=self.layout.dp_size, tokenizer=tokenizer, flag=self.flag)
        if auto:
            resume.check_budget(c, self.config, total_steps, self.flag)
        resume.warn_changed_settings(meta, self.config, total_steps)
        return Saved(c, meta)

    def read_init_source(self) -> Saved:
        """--init_from: the source run's newest checkpoint (.pt or DCP), verified, and its tokenizer,
        checked against this run before any weight is read (resume.check_init_source). A .pt
        checkpoint is memory-mapped: only the weights are read."""
        src = Path(self.config.init_from)
        c = store.newest(src, "--init_from")
        if c is None:
            raise UsageError(f"--init_from {src}: no checkpoint there (no checkpoint-<step>.pt with its .json "
                             f"manifest, no {DCP_DIRNAME}/); give the --run_dir of a run that saved one")
        meta = store.read(c, "--init_from", resume.INIT_KEYS + (("model",) if c.kind == "pt" else ()))
        tokenizer = resume.check_init_source(meta, self.config, src)
        return Saved(c, {k: v for k, v in meta.items() if k != "model"}, tokenizer=tokenizer,
                     weights=meta["model"] if c.kind == "pt" else None,
                     origin=f"--init_from {self.config.init_from}")

    # ------------------------------------------------------------------- loading
    def restore(self, saved: Saved, parts: Mapping[str, Stateful], device: torch.device) -> int:
        """The checkpoint `read_resume` found, into the built `parts` (module docstring): the
        weights and optimizer states (checked finite), every other part's plain state, then the
        RNG states. Returns its step."""
        c, model, optimizer = saved.checkpoint, parts["model"], parts["optimizer"]
        if c.kind == "dcp":
            tensors = {"rng_cpu": torch.get_rng_state()}
            dcp.load(c.path, model, optimizer, tensors=tensors)  # verified by read_resume
            rng = {"cpu": tensors["rng_cpu"]}
        else:  # verified by read_resume; read again onto the device, tensors only
            payload, why = pt.load_payload(c, device, keys=resume.TENSORS)
            if why is not None:
                raise NanoChatError(f"{self.flag}: checkpoint {c.path} is not usable: {why}")
            if self.layout.sharded:
                pt.load_full_state_dicts(model, optimizer, payload["model"], payload["optimizer"])
            else:
                model.load_state_dict(payload["model"])
                optimizer.load_state_dict(payload["optimizer"])
            rng = payload["rng"]
        bad = nonfinite_state(model, optimizer)
        if bad:
            raise NanoChatError(f"{self.flag}: checkpoint {c.path} holds inf/nan ({bad}), so training cannot "
                                f"continue from it; move it out of {c.path.parent} to resume from the previous "
                                "checkpoint")
        for name, part in parts.items():
            if name not in TENSOR_PARTS:
                try:
                    part.load_state_dict(saved.meta)
                except ValueError as e:  # e.g. FP8 choices that do not fit this model: said in flags
                    raise ValueError(flag_text(str(e))) from None
        set_rng_state(rng)
        logger.info("resumed from %s at step %d", c.path, c.step)
        return c.step

    # ------------------------------------------------------------------- writing
    def save(self, step: int, parts: Mapping[str, Stateful], extra: dict[str, Any]) -> None:
        """A checkpoint of `step`: the `parts` (module docstring), RNG states, the config and
        `extra` (facts a resume checks or logs: the tokenizer's fingerprint, the step's record).
        In one process a .pt, distributed a DCP step (every rank); both verified, the newest
        --keep_checkpoints kept, the other storage's checkpoints deleted afterwards so a resume
        finds one. A model or optimizer state holding inf/nan is never written: the run stops,
        naming the last checkpoint that is good."""
        model, optimizer = parts["model"], parts["optimizer"]
        bad = nonfinite_state(model, optimizer)
        if bad:
            raise NanoChatError(
                f"step {step}: not saving, {bad} hold inf/nan. Step {step}'s loss and gradients were "
                f"finite, so its update made them so (or an earlier update, in weights no batch since "
                f"used). {self.good_checkpoint_note()}: lower --lr, check the data, or try "
                "--fp8_mode e5m2 / auto")
        meta = {"config": self.config.to_dict(), "resolved_paths": resume.resolved_paths(self.config), "step": step,
                "world_size": self.layout.world_size, "data_parallel": self.layout.dp_size}
        for name, part in parts.items():
            if name not in TENSOR_PARTS:
                meta.update(part.state_dict())
        meta.update(extra)
        keep = self.config.keep_checkpoints
        if self.layout.distributed:  # every rank writes its part
            rng = {f"rng_{k}": v for k, v in rng_state().items() if k == "cpu"}
            store.save_dcp(self.run_dir, model, optimizer, step=step, meta=meta, tensors=rng, keep=keep)
            if self.layout.rank == 0:
                store.remove(self.run_dir, (PT,))
            return
        store.save_checkpoint(self.run_dir, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                             "rng": rng_state(), **meta}, step=step, keep=keep)
        store.remove(self.run_dir, (DCP,))

    def good_checkpoint_note(self) -> str:
        """Which checkpoint a resume would start from, checked now: its checksums, and its weights
        and optimizer states loaded and found finite (under torchrun by rank 0 only, without
        communication: this runs on error paths, where ranks may diverge)."""
        if self.layout.rank == 0:
            good, checked = store.newest_verified(self.run_dir, finite=True), "verified, finite"
        else:
            found = store.committed(self.run_dir)
            good, checked = (found[-1] if found else None), "rank 0 checks it"
        if good is None:
            return f"No good checkpoint of this run is in {self.run_dir}"
        return f"The last good checkpoint is {good.path} (step {good.step}, {checked})"


__all__ = ["TENSOR_PARTS", "Checkpointer", "Keyed", "Saved", "Start"]
