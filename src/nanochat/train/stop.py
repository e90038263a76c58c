"""Stopping a run on request: SIGTERM or Ctrl-C ends training after a step, with a checkpoint.

A scheduler (slurm, a preemptible cloud) sends SIGTERM some seconds before SIGKILL; a user
presses Ctrl-C. Python's defaults lose every step since the last checkpoint (SIGTERM kills,
SIGINT raises KeyboardInterrupt mid-step). While a run trains, `StopSignals` holds both: the
first signal is noted, the step in flight finishes (its evaluation and log line too), a
checkpoint of it is saved, and the run ends with one line naming the checkpoint and the command
that resumes it, exit status 128 + the signal's number (143, 130), as a shell reports a process
the signal killed. A second Ctrl-C stops at once; the newest checkpoint is then the last one
saved before it. Outside the loop (setup, the end of the run) there is no step to finish, so
the first signal stops at once.

Under torchrun the ranks may get the signal at different times, or only one of them may (a
`kill` of one pid): each rank's request travels in the all-reduce of the step's loss
(`vote`), and is read in the step's one device read, beside the step guard's values (the
loop reads both and hands each its own: `decide`), so every rank stops after the same step, and
a step gains no collective and no host sync. (An
all-reduced flag read on its own would add a sync a step: the host could no longer queue the
next step's kernels while the GPU finishes this one.)

A handler the program installed itself is left alone: it decides what its signals mean.
`Stopped` is a SystemExit: uncaught, the process exits with its status and no traceback, and
`except Exception` does not swallow it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import signal
import sys
import threading
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from nanochat.common import DistEnv, dist_env, print_last_line
from nanochat.parallel.process_group import all_reduce_mean, is_distributed, torchrun_restarts_left

if TYPE_CHECKING:
    from nanochat.checkpoint import Checkpoint

SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals a run stops on, in the order of their request flags."""
_DEFAULTS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
"""Python's own handlers: only these are replaced."""


class Stopped(SystemExit):
    """The run stopped on a signal: `code` is 128 + the signal's number; `message` is the line
    that was printed (what stopped, which checkpoint holds the run, how to resume it)."""

    def __init__(self, signum: int, message: str):
        super().__init__(128 + signum)
        self.signum, self.message = signum, message


class StopNow(BaseException):
    """Raised by the handler where there is no step to finish, or on a second Ctrl-C; `when`
    says where the run was. The trainer turns it into `Stopped` with the line that says what is
    saved."""

    def __init__(self, signum: int, when: str):
        super().__init__(f"{signal.Signals(signum).name} {when}")
        self.signum, self.when = signum, when


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopSignals:
    """SIGINT and SIGTERM while a run trains (module docstring). `handling()` installs the
    handlers; `steps()` is the loop's range; `vote` and `decide` carry each rank's request
    through the step's own all-reduce and device read."""

    def __init__(self):
        self.received: int | None = None
        """The first signal this process got (None: none)."""
        self.agreed: int | None = None
        """The signal every rank stops on, once a step's read has shown a request."""
        self.step: int | None = None
        """The step in flight (0-based) while the loop runs (`steps()`, or a loop that sets it),
        else None: only then does a first signal wait for the step to finish."""
        self.trained = False
        """`steps()` has run its last step: a signal now finds the run finishing."""
        self.ignoring = False
        """The run is ending (stopped, or failing with an error of its own): a signal must not cut
        short or replace its last line."""
        self._zeros: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    # ------------------------------------------------------------------ handlers
    @contextlib.contextmanager
    def handling(self) -> Iterator[None]:
        """SIGINT and SIGTERM handled here for the block, where Python's defaults are in place
        and this is the main thread (only it may set handlers); the previous handlers after."""
        self.received = self.agreed = self.step = None
        self.trained = self.ignoring = False
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                if signal.getsignal(signum) is _DEFAULTS[signum]:
                    previous[signum] = signal.signal(signum, self._handle)
        try:
            yield
        finally:
            for signum, handler in previous.items():
                # a torchrun rank that is ending ignores the launcher's SIGTERM on its way out
                keep = self.ignoring and signum == signal.SIGTERM and is_distributed()
                signal.signal(signum, signal.SIG_IGN if keep else handler)

    def ignore(self) -> None:
        """The run is ending (stopped, or on an error that must be reported whole): signals are
        ignored from now on; under torchrun SIGTERM also after `handling()`, since the launcher
        sends it to every rank once one has exited (and SIGKILL 30 s later)."""
        self.ignoring = True

    def _handle(self, signum: int, frame) -> None:
        if self.ignoring:
            return
        stopping = self.received is not None or self.agreed is not None
        if not stopping and self.step is not None:  # the first: the step in flight finishes
            self.received = signum
            _note(f"{signal_name(signum)} received: finishing the step in flight, then saving a checkpoint and "
                  "stopping" + (" (Ctrl-C again stops at once)" if signum == signal.SIGINT else ""))
            return
        if stopping and (signum == signal.SIGTERM or self.received is None):
            # already stopping: a repeated SIGTERM, or a signal reaching a rank that agreed to
            # another rank's, changes nothing
            self.received = self.received or signum
            return
        if stopping:
            when = f"by a second {signal_name(signum)}" + (f" during step {self.step + 1}" if self.step is not None
                                                     else " while saving")
        elif self.trained:
            when = f"by {signal_name(signum)} after the last step, before the run's results were written"
        else:
            when = f"by {signal_name(signum)} before the first step"
        raise StopNow(signum, when)

    # ---------------------------------------------------------------------- loop
    def steps(self, start: int, end: int, on_stop: Callable[[int, int], None]) -> Iterator[int]:
        """range(start, end), while a signal waits for the step in flight: before each next step,
        if a stop is `pending`, `on_stop(steps_done, signum)` (which saves and raises Stopped).
        Under torchrun a signal that comes after a step's all-reduce is agreed on in the next
        step. A request that came with the last step lets the run finish: it was ending."""
        try:
            for step in range(start, end):
                signum = self.pending()
                if signum is not None:
                    self.step = None  # what follows is the stop's save
                    on_stop(step, signum)
                    raise AssertionError("on_stop must raise Stopped")
                self.step = step
                yield step
        finally:
            self.step = None
        self.trained = True
        if self.received is not None:
            _note(f"{signal_name(self.received)} came with the last step: the run finishes")

    def pending(self) -> int | None:
        """The signal to stop on at this step boundary: the one every rank agreed on (torchrun),
        or in one process the one received (no agreement needed, so the step it came in is the
        last, wherever in the step it came)."""
        return self.agreed if is_distributed() else self.received

    def requests(self, like: torch.Tensor) -> torch.Tensor:
        """This rank's request flags (one per SIGNALS entry) on `like`'s device and dtype: the
        same zeros every step until a signal comes (then a fill, once: no host-to-device copy)."""
        key = (like.device, like.dtype)
        if key not in self._zeros:
            self._zeros[key] = torch.zeros(len(SIGNALS), device=like.device, dtype=like.dtype)
        flags = self._zeros[key]
        if self.received is not None:
            flags = flags.clone()
            flags[SIGNALS.index(self.received)] = 1
        return flags

    def vote(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`loss` (a scalar) averaged over ranks and every rank's request flags averaged with it,
        in the one all-reduce the loss needs anyway: (loss, votes), both still on the device, for
        the step's one device read (`decide` takes the votes as read)."""
        both = all_reduce_mean(torch.cat([loss.reshape(1), self.requests(loss)]))
        return both[0], both[1:]

    def decide(self, votes: list[float]) -> None:
        """The requests as read on the host: any rank's SIGTERM stops the run as SIGTERM, else
        any rank's SIGINT as SIGINT. Every rank reads the same values, so all decide alike."""
        requested = [s for s, v in zip(SIGNALS, votes) if v > 0]
        if requested and self.agreed is None:
            self.agreed = signal.SIGTERM if signal.SIGTERM in requested else requested[0]


def _note(text: str) -> None:
    """One line on stderr from a signal handler: os.write, since a handler that ran during a
    buffered write to sys.stderr (the progress bar's) may not write through it again."""
    if dist_env().rank == 0:
        with contextlib.suppress(OSError):
            os.write(sys.stderr.fileno(), f"\n{text}\n".encode())


# ----------------------------------------------------------------------------- the last line
def resume_command(config, dist: DistEnv | None = None) -> str:
    """The command that resumes the run `config` describes: scripts/base_train.py with every
    flag that differs from its default, and --resume, or the run's own --auto_resume, which
    continues it as well (torchrun's layout prefixed). In a slurm job ($SLURM_JOB_ID) the run
    continues in a job: its sbatch script again, whose step runs the agent command given."""
    dist = dist or dist_env()
    argv0 = sys.argv[0] if sys.argv and os.path.basename(sys.argv[0]) == "base_train.py" else "scripts/base_train.py"
    launch = "python"
    job = os.environ.get("SLURM_JOB_ID")
    if dist.world_size > 1:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.world_size))
        nodes = max(1, dist.world_size // local)
        launch = (f"torchrun --standalone --nproc_per_node={local}" if nodes == 1 and job is None else
                  f"torchrun --nnodes={nodes} --nproc_per_node={local} <your rendezvous flags>")
    if job is not None:
        name = os.environ.get("SLURM_JOB_NAME", "its name unknown")
        launch = f"sbatch with the script of slurm job {job} ({name}), its step running: srun {launch}"
    words = [argv0]
    for f in dataclasses.fields(config):
        if f.name in ("resume", "overwrite", "debug"):
            continue
        value = getattr(config, f.name)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if value == default:
            continue
        if isinstance(value, bool):
            words.append(f"--{f.name}" if value else f"--no_{f.name}")
        elif isinstance(value, (tuple, list)):
            words += [f"--{f.name}", *map(str, value)]
        else:
            words += [f"--{f.name}", str(value)]
    return f"{launch} {shlex.join(words if config.auto_resume else words + ['--resume'])}"


def stopped(signum: int, what: str, newest: Checkpoint | None, resume: str, *, saved: bool,
            saving: bool) -> Stopped:
    """The Stopped that ends a run on `signum`, its line printed by rank 0: `what` stopped it,
    the checkpoint that holds the run (`newest`: the one just saved when `saved`) and the command
    that `resume`s it; `saving` False: the run saves none (--no_save_checkpoints)."""
    where = None if newest is None else str(newest.path)
    if saved and newest is not None:
        line = stop_line(what, saved=where, resume=resume)
    elif not saving:
        line = stop_line(what, unsaved="no checkpoint saved (--no_save_checkpoints): this run cannot be resumed")
    else:
        line = stop_line(what, newest=where and f"{where} (step {newest.step})", resume=resume)
    if dist_env().rank == 0:
        print_last_line(line)
    return Stopped(signum, line)


def lost_peer_message(reason: str, newest: Checkpoint | None, resume: str, *, auto_resume: bool = False) -> str:
    """The one error line of a rank whose peer died: what happened, the `newest` checkpoint and
    what comes next: torchrun's restart of the worker group where --max-restarts has one left
    (which continues the run with --auto_resume, and would refuse its directory without), else
    the command that `resume`s the run once every rank can run again."""
    left = torchrun_restarts_left()
    where = (f"the newest checkpoint is {newest.path} (step {newest.step})" if newest is not None
             else "no checkpoint of this run was saved")
    if left and auto_resume:
        after = (f"{where}; torchrun restarts the worker group ({left} of its --max-restarts left) and "
                 f"--auto_resume continues the run from {'it' if newest is not None else 'step 0'}")
    elif left:
        after = (f"{where}; torchrun restarts this command ({left} of its --max-restarts left), which refuses "
                 "a --run_dir holding a run: pass --auto_resume for a restart to continue it")
    else:
        after = f"{where}; once every rank can run again, resume: {resume}" if newest is not None else where
    return (f"rank {dist_env().rank} lost its connection to another rank of this run ({reason}): that rank's "
            f"process died or was killed, and its own output says why; {after}")


def stop_line(what: str, *, saved: str | None = None, newest: str | None = None, unsaved: str | None = None,
              resume: str | None = None) -> str:
    """The line a stopped run ends with: `what` stopped it and when, which checkpoint holds the
    run (`saved` just now, or the `newest` from before; `unsaved` says why there is none), and
    the command that resumes it."""
    if saved is not None:
        where = f"{saved} saved"
    elif newest is not None:
        where = f"the newest checkpoint is {newest}"
    else:
        where = unsaved or "no checkpoint of this run was saved"
    return f"{what}; {where}" + (f"; resume: {resume}" if resume and (saved or newest) else "")


__all__ = ["SIGNALS", "StopNow", "StopSignals", "Stopped", "lost_peer_message", "resume_command", "signal_name",
           "stop_line", "stopped"]
