"""Where a run's scalars go besides metrics.jsonl: TensorBoard and Weights & Biases (`--log`).

    trackers = Trackers(cfg.log, run_dir, cfg.to_dict(), rank=rank, start_step=start_step)
    trackers.record(rec)                      # every dict the run writes to metrics.jsonl
    trackers.record_result(result.to_dict())  # result.json's figures, once at the end
    trackers.close()

metrics.jsonl stays the run's own record (resume and plot_run read it); a tracker is a view of
the same records, so nothing is measured twice. Names group by their first path component, as
both TensorBoard and W&B lay out their panels: train/loss, train/lr, train/lrm, train/grad_norm,
train/tokens_per_sec, train/mfu, val/loss, val/bpb, val/accuracy, events/..., final/... and
memory/peak_gib. A statistics step (--fp8_stats_every) adds FP8 health under the names
nanochat.fp8.health gives every consumer: fp8/<role>_<stat>_worst and _mean over all layers,
the charts to look at first, and fp8_<role>_<stat>/<layer>, a section per role and statistic.
Events (skipped steps, auto's choices and switches, FP8 summaries) are texts under events/ at
the last step logged before them.

A resumed run continues the same TensorBoard run: SummaryWriter's `purge_step` hides what the
interrupted run logged after its checkpoint, so each step shows once. It continues the same W&B
run too, whose id <run_dir>/wandb_id keeps; W&B never rewrites a step, so steps it already holds
are not sent again (a resume repeats them bit for bit on the same machine). A restart from step 0
of a run that died before its first checkpoint (--auto_resume) continues both the same way.

Only rank 0 logs. A tracker that cannot start is an error before the first step (nothing is
lost yet); one that fails later (disk, network) warns once, is switched off and recorded in
`fallbacks`; training, metrics.jsonl and checkpoints go on. Both are optional extras:
`pip install -e '.[tensorboard]'`, `'.[wandb]'`. More: docs/trackers.md.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, get_args

from nanochat.common import NanoChatError, UsageError, logger
from nanochat.config.train import LogChoice
from nanochat.fp8.health import fp8_health
from nanochat.fs import write_atomic

LOG_CHOICES: tuple[str, ...] = get_args(LogChoice)
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_id"
HPARAM_METRICS = ("final/val_bpb", "final/val_loss", "final/train_loss", "final/tokens_per_sec", "final/mfu",
                  "memory/peak_gib")
"""The figures TensorBoard's HPARAMS tab shows beside each run's config."""
_PACKAGES = {"tensorboard": ("tensorboard", "torch.utils.tensorboard"), "wandb": ("wandb",)}


def check_trackers(log: Iterable[str], run_dir: str | os.PathLike | None = None) -> None:
    """Before any work: every `--log` choice is known and its package imports, and what it writes
    in `run_dir` can be a directory there; else a one-line UsageError with the fix."""
    if "tensorboard" in _requested(log) and run_dir is not None:
        path = Path(run_dir) / TENSORBOARD_DIR
        if os.path.lexists(path) and not path.is_dir():
            raise UsageError(f"--log tensorboard writes its event files into the directory {path}, but that path "
                             "exists and is not a directory; move it out of the run directory, or drop tensorboard "
                             "from --log")


def _requested(log: Iterable[str]) -> list[str]:
    """The trackers `log` asks for besides metrics.jsonl, each once, checked as check_trackers says."""
    names = list(dict.fromkeys(log))
    for name in names:
        if name not in LOG_CHOICES:
            raise UsageError(f"--log {name!r} is not a tracker nanochat knows; give any of {', '.join(LOG_CHOICES)}")
        for module in _PACKAGES.get(name, ()):
            try:
                importlib.import_module(module)
            except ImportError as e:
                why = (str(e).splitlines() or [type(e).__name__])[0]
                raise UsageError(f"--log {name} needs the {name} package, which does not import ({why}); "
                                 f"install it with: pip install -e '.[{name}]'") from None
    return [n for n in names if n != "jsonl"]


def _number(v: Any) -> float | None:
    """A record's value as a float; None for a non-number or a non-finite one (metrics.jsonl's null)."""
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    return None


def _value_text(v: Any) -> str:
    """A config value as text: strings as they are, anything else as JSON (null, true, [..])."""
    return v if isinstance(v, str) else json.dumps(v)


def _table(header: tuple[str, ...], rows: Iterable[Iterable[Any]]) -> str:
    """A markdown table: TensorBoard's text tab renders it, W&B shows it as text."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


_STEP_NAMES = {"skipped": "events/skipped", "skipped_params": "events/skipped_params",
               "clip_factor": "events/clip_factor", "calibrating": "fp8/calibrating"}


def translate(rec: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """One metrics.jsonl record as (scalars, texts) under tracker names. A step record's numbers
    go to train/<field> (val_<x>: val/<x>; the flags above to events/ and fp8/), an event's to
    events/<field>, its description to the text events/<event>. Fields that are not numbers (a
    layer name, a list) only appear in the texts; null and non-finite values are left out."""
    scalars: dict[str, float] = {}
    texts: dict[str, str] = {}
    event = rec.get("event")
    for key, value in rec.items():
        if key in ("step", "event"):
            continue
        if key == "fp8_stats" and isinstance(value, Mapping):
            scalars.update(fp8_health(value))  # the names every FP8 consumer uses
            continue
        v = _number(value)
        if v is None:
            continue
        if event is not None:
            scalars[f"events/{key}"] = v
        else:
            scalars[_STEP_NAMES.get(key) or (f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}")] = v
    if event is not None:
        texts[f"events/{event}"] = _event_text(rec)
    elif rec.get("skipped") or rec.get("skipped_params"):
        texts["events/nonfinite"] = _nonfinite_text(rec)
    return scalars, texts


def _nonfinite_text(rec: Mapping[str, Any]) -> str:
    step = rec.get("step")
    if rec.get("skipped"):
        return f"step {step}: non-finite, update skipped; first at {rec.get('nonfinite_at', 'unknown')}"
    names = rec.get("skipped_param_names") or []
    return (f"step {step}: {rec['skipped_params']} parameter(s) with a non-finite gradient kept their values"
            + (f": {', '.join(map(str, names))}" if names else ""))


def _event_text(ev: Mapping[str, Any]) -> str:
    kind = ev["event"]
    if kind == "fp8_auto_choices" and isinstance(ev.get("choices"), Mapping):
        roles = ("input", "weight", "grad_output")
        return "fp8 auto: formats chosen by measurement\n\n" + _table(
            ("layer", *roles), ([name, *(r.get(role, "-") for role in roles)]
                                for name, r in ev["choices"].items() if isinstance(r, Mapping)))
    if kind == "fp8_auto_switch":
        from nanochat.fp8.training import describe_switch  # FP8's own wording; torchao only when needed

        return f"step {ev.get('step')}: {describe_switch(ev)}"
    if kind == "guard_summary":
        counts = ", ".join(f"{ev[k]} {k.replace('_', ' ')}" for k in ("overflow_events", "skipped_steps",
                                                                       "clip_events") if k in ev)
        return f"step guard ({ev.get('label', '')}): {counts}"
    if kind == "fp8_summary":
        counts = ", ".join(f"{ev[k]} {k.replace('_', ' ')}" for k in ("overflow_events", "skipped_steps",
                                                                       "clip_events", "stats_samples") if k in ev)
        worst = [[f"most {key[4:]}", f"{n} ({r})", f"{v:.3f} %"] for key in ("top_underflow", "top_saturation")
                 for n, r, v in ev.get(key) or () if _number(v)]
        return (f"fp8 summary ({ev.get('label', '')}): {counts}"
                + ("\n\n" + _table(("", "layer (role)", "share of values"), worst) if worst else ""))
    return "```\n" + json.dumps(dict(ev), indent=1) + "\n```"


def _result_scalars(result: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """result.json's figures: every number as final/<field>, the memory in GiB as memory/...,
    and the fallbacks as a text."""
    scalars: dict[str, float] = {}
    for key, value in result.items():
        v = _number(value)
        if v is None or isinstance(value, bool):
            continue
        if key in ("peak_memory_bytes", "planned_memory_bytes"):
            scalars[f"memory/{key.split('_')[0]}_gib"] = v / 2**30
        else:
            scalars[f"final/{key}"] = v
    fallbacks = result.get("fallbacks") or []
    texts = {"final/fallbacks": "\n".join(f"- {f}" for f in fallbacks)} if fallbacks else {}
    return scalars, texts


class _TensorBoard:
    """Event files in <run_dir>/tensorboard/ through torch's SummaryWriter."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, config: Mapping[str, Any], first_step: int, continuing: bool):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        # purge_step: TensorBoard's reader hides every event at this step or later that files
        # written before this one hold: an interrupted run's steps after the checkpoint on a
        # resume, a replaced run's everything on a fresh start (step 0). Nothing is deleted.
        # flush_secs: a curve appears within about a TensorBoard reload (5 s by default) of this.
        self.writer = SummaryWriter(str(run_dir / TENSORBOARD_DIR), purge_step=first_step, flush_secs=10)
        rows = [(k, _value_text(v)) for k, v in config.items()]
        self.writer.add_text("config", _table(("field", "value"), rows), first_step)
        # the config in the HPARAMS tab, in this run (add_hparams would start a run of its own)
        hp = {k: v if isinstance(v, (int, float)) and not isinstance(v, bool) else _value_text(v)
              for k, v in config.items()}
        experiment, start, _ = hparams(hp, dict.fromkeys(HPARAM_METRICS, 0.0))
        for summary in (experiment, start):
            self.writer.file_writer.add_summary(summary, first_step)

    def log(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        for tag, v in scalars.items():
            self.writer.add_scalar(tag, v, step)
        for tag, text in texts.items():
            self.writer.add_text(tag, text, step)

    summarize = log  # TensorBoard has no run summary: the final figures are points at the last step

    def close(self, exit_code: int) -> None:
        self.writer.close()


class _WandB:
    """A W&B run in <run_dir>/wandb/, its id kept in <run_dir>/wandb_id for a resume."""

    name = "wandb"

    def __init__(self, run_dir: Path, config: Mapping[str, Any], first_step: int, continuing: bool):
        import wandb

        id_file = run_dir / WANDB_ID_FILE
        resume = (first_step > 0 or continuing) and id_file.is_file()
        run_id = id_file.read_text(encoding="utf-8").strip() if resume else None  # None: W&B makes one
        try:
            self.run = wandb.init(dir=str(run_dir), id=run_id, resume="allow", config=dict(config),
                                  project=os.environ.get("WANDB_PROJECT", "nanochat"),
                                  name=os.environ.get("WANDB_NAME", run_dir.resolve().name))
        except Exception as e:  # noqa: BLE001 -- any of W&B's errors (login, network, settings)
            why = (str(e).strip().splitlines() or [""])[0]
            raise NanoChatError(
                f"--log wandb: W&B could not start a run ({type(e).__name__}: {why}); fix W&B's settings "
                f"(`wandb login` or WANDB_API_KEY; WANDB_MODE=offline logs to {run_dir / 'wandb'} for a later "
                "`wandb sync`), or drop wandb from --log") from None
        if not resume:  # a fresh start (a replaced run's id with it: --overwrite replaced that run)
            write_atomic(id_file, self.run.id + "\n")
        # W&B drops a step below its current one: on a resume, the steps the run already holds
        self.first_new = self.run.step
        self._told = False

    def log(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        if step < self.first_new:
            if not self._told:
                logger.info("--log wandb: run %s already holds steps up to %d; they are kept, not sent again",
                            self.run.id, self.first_new - 1)
                self._told = True
            return
        self.run.log({**scalars, **texts}, step=step)

    def summarize(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        self.run.summary.update({**scalars, **texts})

    def close(self, exit_code: int) -> None:
        if exit_code > 128:  # stopped by a signal after a checkpoint: W&B's "preempted", resumable
            self.run.mark_preempting()
        self.run.finish(exit_code=exit_code)


_TRACKERS = {"tensorboard": _TensorBoard, "wandb": _WandB}


class Trackers:
    """The run's trackers, built once (rank 0 only; other ranks get an object that does nothing).

    `start_step`: 0 for a new run, the checkpoint's step when resuming; `continuing`: a start
    from step 0 of a run that logged before (a restart that found no checkpoint), which W&B
    continues as a resume does. `config`: the run's config as plain data (TrainConfig.to_dict()),
    logged as hyperparameters."""

    def __init__(self, log: Iterable[str], run_dir: str | os.PathLike, config: Mapping[str, Any], *,
                 rank: int = 0, start_step: int = 0, continuing: bool = False):
        self.fallbacks: list[str] = []
        """A tracker that failed mid-run, with the error (for TrainResult.fallbacks)."""
        self._active: list[_TensorBoard | _WandB] = []
        # what this run logs first: step 0 (the starting evaluation) or the step after the checkpoint
        self._step = start_step + 1 if start_step else 0
        if rank != 0:
            return
        try:
            for name in _requested(log):
                self._active.append(_TRACKERS[name](Path(run_dir), config, self._step, continuing))
        except BaseException:
            self.close(exit_code=1)
            raise

    def record(self, rec: Mapping[str, Any]) -> None:
        """Log one metrics.jsonl record: a step's (at its `step`) or an event (at the event's own
        `step` if it has one, else at the last step logged)."""
        if not self._active:
            return
        if isinstance(rec.get("step"), int) and not isinstance(rec["step"], bool):
            self._step = rec["step"]
        try:
            scalars, texts = translate(rec)
        except Exception as e:  # noqa: BLE001 -- a record no tracker can read must not stop training
            for tracker in list(self._active):
                self._failed(tracker, "reading a record", e)
            return
        for tracker in list(self._active):
            self._guarded(tracker, "logging", lambda t: t.log(self._step, scalars, texts))

    def record_result(self, result: Mapping[str, Any]) -> None:
        """The run's final figures (result.json's numbers) as the run's summary."""
        if not self._active:
            return
        scalars, texts = _result_scalars(result)
        for tracker in list(self._active):
            self._guarded(tracker, "logging the result", lambda t: t.summarize(self._step, scalars, texts))

    def close(self, *, exit_code: int = 0) -> None:
        """Flush and close every tracker. `exit_code` is the run's: 0 finished, 128 + N stopped by
        signal N (W&B marks the run preempted, the state a resumed run continues), else failed."""
        for tracker in list(self._active):
            self._guarded(tracker, "closing", lambda t: t.close(exit_code))
        self._active = []

    def _guarded(self, tracker, action: str, call) -> None:
        try:
            call(tracker)
        except Exception as e:  # noqa: BLE001 -- disk, network, a library's bug: training goes on
            self._failed(tracker, action, e)

    def _failed(self, tracker, action: str, e: BaseException) -> None:
        message = (f"--log {tracker.name}: {action} failed at step {self._step} ({type(e).__name__}: "
                   f"{(str(e).strip().splitlines() or [''])[0]}); {tracker.name} is off for the rest of the run, "
                   "metrics.jsonl and checkpoints go on")
        logger.warning("WARNING: %s", message)
        self.fallbacks.append(message)
        self._active.remove(tracker)
        try:
            tracker.close(1)
        except Exception:  # noqa: BLE001 -- it already failed; its error was reported above
            pass


__all__ = ["LOG_CHOICES", "LogChoice", "Trackers", "check_trackers", "translate"]
