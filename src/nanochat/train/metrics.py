"""What a training run records: metrics.jsonl, one JSON object per line, and TrainResult.

Every record a run logs goes through `MetricsLog.log`, the one place to hook another sink (a
tracker) into: the step records ({"step", "loss", "lr", "lrm", "grad_norm", "tokens_per_sec", ...},
with `val_loss`/`val_bpb`/`val_accuracy` on evaluation steps, `fp8_stats` on sampled steps,
`skipped`/`nonfinite_at` on a skipped step), the step-0 evaluation of a fine-tune, and events
({"event": "fp8_auto_choices" | "fp8_auto_switch" | "fp8_summary" | "guard_summary", ...}). Only
rank 0 writes.
The trackers of --log (nanochat.report.trackers: TensorBoard, W&B) get every record logged after them.

The files are strict JSON (a non-finite float is written as null, the field kept) so any JSON
reader takes them. A resumed run first cuts metrics.jsonl back to its checkpoint's step: the
steps it repeats were logged by the interrupted run, and each step must appear once. Every start
then writes its start record ({"event": "start", "from_step", "checkpoint", restart counters,
...}: nanochat.checkpoint.Checkpointer.start_record); those of earlier starts stay, so the file,
and `TrainResult.starts`, tell every restart of the run and where it resumed from.
`TrainResult` is what `NanoChatTrainer.train()` returns and `<run_dir>/result.json` holds.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanochat.config.fields import Fallbacks
from nanochat.fs import write_atomic
from nanochat.report.trackers import Trackers
from nanochat.rundir import START_EVENT


def jsonable(x: Any) -> Any:
    """`x` with every non-finite float as None: json.dumps would write NaN, which only Python's
    parser reads; the field names stay."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def json_line(record: dict[str, Any]) -> str:
    return json.dumps(jsonable(record), allow_nan=False) + "\n"


class MetricsLog:
    """`<run_dir>/metrics.jsonl`, appended to by rank 0 (the other ranks' calls do nothing)."""

    def __init__(self, run_dir: Path, *, rank: int, fallbacks: Fallbacks | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.writes = rank == 0
        self.trackers: Trackers | None = None
        """--log's TensorBoard / W&B, started by `begin` before the first step."""
        if fallbacks is not None:  # a tracker that fails mid-run records why (TrainResult.fallbacks)
            fallbacks.follow(lambda: self.trackers.fallbacks if self.trackers is not None else ())

    def log(self, record: dict[str, Any]) -> None:
        """Append one record (see the module docstring for the kinds), then hand it to the trackers."""
        self._append(record)
        if self.trackers is not None:
            self.trackers.record(record)

    def _append(self, record: dict[str, Any]) -> None:
        if self.writes:
            with open(self.path, "a") as f:
                f.write(json_line(record))

    def begin(self, start: dict[str, Any], *, log: tuple[str, ...], config: dict[str, Any],
              resumed_record: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Before a start's first step (rank 0): metrics.jsonl cut back to where `start` (its start
        record, nanochat.checkpoint.Checkpointer.start_record) continues, unless it is a fresh
        start (`cut_to`, which appends `resumed_record`, the checkpoint's own step record, when the
        interrupted run died before logging it); `start` written (to the file only: it is not a
        step, and the trackers get the run's restarts with result.json's figures); --log's
        trackers started, continuing the run's unless fresh, and given that record first.
        Returns the records kept (the run's history before this start)."""
        step, fresh = start["from_step"], start["start"] == "fresh"
        history, appended = ([], None) if fresh else self.cut_to(step, resumed_record)
        self._append(start)
        self.trackers = Trackers(log, self.path.parent, config, rank=0, start_step=step, continuing=not fresh)
        if appended is not None:
            self.trackers.record(appended)
        return history

    def close(self, *, exit_code: int) -> list[str]:
        """Close the trackers with the run's `exit_code` (Trackers.close); returns what failed in
        them mid-run (TrainResult.fallbacks)."""
        if self.trackers is None:
            return []
        self.trackers.close(exit_code=exit_code)
        return list(self.trackers.fallbacks)

    def cut_to(self, step: int, record: dict[str, Any] | None) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """Before a resumed run's first step (rank 0): drop the lines from the first record after
        `step` on, and append `record`, the checkpoint's own line for `step`, when the interrupted
        run died before logging it. At step 0 (a restart from scratch, which logs its step 0
        again) only the start records stay. Returns the records kept (the run's history up to
        `step`) and the record appended, if one was."""
        lines = self.path.read_text().splitlines(keepends=True) if self.path.is_file() else []
        kept = []
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut by the kill
                break
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] > step:
                break
            kept.append((line, rec))
        if step == 0:
            kept = [(line, rec) for line, rec in kept if isinstance(rec, dict) and rec.get("event") == START_EVENT]
        logged = any(isinstance(r, dict) and "loss" in r and r.get("step") == step for _, r in kept)
        tail = [json_line(record)] if record is not None and not logged else []
        if len(kept) < len(lines) or tail:
            write_atomic(self.path, "".join([line for line, _ in kept] + tail))
        appended = jsonable(record) if tail else None
        return [r for _, r in kept if isinstance(r, dict)] + ([appended] if tail else []), appended


class Throughput:
    """What the loop times: tokens/s over the steady-state steps, the time of the steps that
    compiled, and the last 20 losses (train_loss). A resumed run reports what the uninterrupted
    one would: `history` (metrics.jsonl's records before this call) seeds the losses and, with
    no step left to time, gives the throughput last logged."""

    def __init__(self, tokens_per_step: int, history: list[dict[str, Any]]):
        logged = [r for r in history if isinstance(r.get("loss"), float) and not r.get("skipped")]
        self.losses: list[float] = [r["loss"] for r in logged][-20:]
        self.logged_tokens_per_sec = next((r["tokens_per_sec"] for r in reversed(logged)
                                           if isinstance(r.get("tokens_per_sec"), float)), math.nan)
        self.tokens_per_step = tokens_per_step
        self.timed_tokens, self.timed_seconds = 0, 0.0
        self.compile_time_s = 0.0

    def add(self, record: dict[str, Any], seconds: float, *, compiled: bool) -> float:
        """A step that updated the weights and took `seconds`: the compiling step's time is compile
        time, auto's eager calibration steps are left out, the others are the steady state. Sets
        and returns record["tokens_per_sec"] (the steady state's so far, else this step's)."""
        if compiled:
            self.compile_time_s += seconds
        elif not record.get("calibrating"):
            self.timed_tokens += self.tokens_per_step
            self.timed_seconds += seconds
        self.losses = (self.losses + [record["loss"]])[-20:]
        record["tokens_per_sec"] = (self.timed_tokens / self.timed_seconds if self.timed_seconds
                                    else self.tokens_per_step / seconds)
        return record["tokens_per_sec"]

    @property
    def train_loss(self) -> float:
        return sum(self.losses) / len(self.losses) if self.losses else math.nan

    @property
    def tokens_per_sec(self) -> float:
        return self.timed_tokens / self.timed_seconds if self.timed_seconds else self.logged_tokens_per_sec


@dataclass
class TrainResult:
    """What a run produced; also written to `<run_dir>/result.json`."""

    train_loss: float
    """Mean training loss over the last logged steps (nats per token)."""
    val_loss: float
    """Validation loss at the end (nats per token, high precision)."""
    val_bpb: float
    """Validation bits per byte at the end: comparable across tokenizers (8 = uniform bytes)."""
    tokens_per_sec: float
    """Training throughput over the steady-state steps: the steps that compiled (see
    compile_time_s) and auto's eager calibration steps are excluded."""
    steps: int
    """Optimizer steps completed (including those done before a --resume)."""
    epochs: float
    """Passes over the training tokens completed."""
    wall_time_s: float
    """Seconds this call of train() took, setup included."""
    compile_time_s: float = 0.0
    """Wall time of the steps that compiled the model (the first step, and the first after auto's
    calibration): tracing and code generation plus that step's own work. 0 without --compile."""
    fallbacks: list[str] = field(default_factory=list)
    """Every fallback the run took, with its reason (e.g. no FP8 hardware)."""
    optimizer_state_bytes: int = 0
    """Bytes of optimizer state (Adam moments and FP8 block scales)."""
    num_params: int = 0
    fp8_backend: str = "off"
    """off, native, emulated or fallback."""
    fp8_converted: list[str] = field(default_factory=list)
    fp8_skipped: dict[str, str] = field(default_factory=dict)
    fp8_decisions: dict[str, str] = field(default_factory=dict)
    """--fp8_layers: layer -> why it was converted or kept in bf16 (the measured fwd+bwd ratio,
    or the rule that decided)."""
    fp8_measure_time_s: float = 0.0
    """--fp8_layers faster: seconds spent timing layer shapes on the GPU before training (0 when
    every shape came from the cache); part of wall_time_s, not of compile_time_s."""
    fp8_choices: dict[str, dict[str, str]] | None = None
    """--fp8_mode auto: layer -> role -> chosen dtype name."""
    fp8_stats: dict[str, Any] | None = None
    """With --fp8: FP8's end-of-run summary (statistics samples, the layers with most underflow
    and saturation, auto's choices and switches, the last sample); None without --fp8."""
    guard_stats: dict[str, Any] = field(default_factory=dict)
    """The step guard's counts (nanochat.train.guard), every run: overflow_events and skipped_steps
    (non-finite steps skipped), clip_events and min_clip_factor."""
    samples: list[str] = field(default_factory=list)
    run_dir: str = ""
    parallel: str = "none"
    """How the run was spread over processes: none, or ddp/fsdp x world size (backend), with FP8
    all-gather on/off and why."""
    val_accuracy: float | None = None
    """Multiple-choice accuracy on the validation records at the end: the prediction is the option
    whose answer tokens have the highest log-likelihood (nanochat.train.evaluation); None when there are
    no multiple-choice records."""
    accuracy_scoring: str | None = None
    """How val_accuracy scored the options: "option log-likelihood (1 token per option)", which is
    the letters' logits compared, or e.g. "(1-2 tokens per option)" where some letter takes two
    tokens. None without multiple-choice records."""
    state_bytes_per_param: float = 0.0
    """Training state per parameter, measured from the live tensors: weights + gradients (all of
    them at the first optimizer step; the largest one alive at a time with --optimizer_in_backward)
    + optimizer states (moments, FP8 scales, bf16_split's remainders: as the first step allocates
    them), divided by the parameters (this rank's under FSDP). Breakdown in state_bytes."""
    state_bytes: dict[str, int] = field(default_factory=dict)
    """The bytes behind state_bytes_per_param: weights, gradients, optimizer."""
    planned_memory_bytes: int = 0
    """The memory plan's total per device (an estimate, printed before the weights were loaded)."""
    peak_memory_bytes: int | None = None
    """Measured peak of allocated memory on CUDA (torch.cuda.max_memory_allocated); None elsewhere."""
    flops_per_token: int = 0
    """Model FLOPs per trained token: GPT.flops_per_token at --seq_len (nanochat.train.mfu)."""
    peak_tflops: float | None = None
    """The dense bf16 peak per GPU that `mfu` divides by, from the device's datasheet
    (nanochat.train.mfu.PEAKS); None without a listed peak (CPU, MPS, an unlisted GPU)."""
    mfu: float | None = None
    """Model FLOPs utilization against the dense bf16 peak: tokens_per_sec x flops_per_token /
    (GPUs x peak_tflops). One denominator for bf16 and FP8 runs, so MFUs compare as tokens/s
    do. None where the peak is unknown."""
    mfu_fp8: float | None = None
    """The same against the dense FP8 peak, for runs with native FP8 layers (a lower bound on
    the FP8 tensor cores' use: the head and attention stay in bf16); None otherwise."""
    starts: list[dict[str, Any]] = field(default_factory=list)
    """Every start of the run, oldest first (metrics.jsonl's start records): `start` (fresh,
    restart from step 0, resume), `from_step`, the `checkpoint` resumed, `world_size`, and the
    restart counters of that start, `torchelastic_restart_count` (torchrun --max-restarts) and
    `slurm_restart_count` (a requeued slurm job), None where unset."""
    restarts: int = 0
    """Starts after the first: restarts by torchrun or slurm, and resumes by hand (`starts` says
    which: their counters)."""
    learning_rates: dict[str, float] = field(default_factory=dict)
    """--optimizer muon: each parameter group's peak rate (matrix, embedding, head, vector), as
    given or derived by the recipe's rules (nanochat.optim.recipe); empty for AdamW (--lr)."""
    weight_decay: float = 0.1
    """The decoupled weight decay of the decayed groups (hidden matrices, AdamW's too): --weight_decay,
    or the recipe's for a Muon run that repeats its data (nanochat.optim.recipe)."""
    cropped_share: float | None = None
    """--packing bestfit: the share of the training tokens the last epoch's layout dropped (the
    tails of documents cropped to fill a row: nanochat.data.packing); None with stream packing."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def read(cls, run_dir: Path) -> "TrainResult":
        """The result a finished run wrote to `<run_dir>/result.json` (fields this version does
        not know are left out)."""
        known = {f.name for f in dataclasses.fields(cls)}
        saved = json.loads((Path(run_dir) / "result.json").read_text())
        return cls(**{k: v for k, v in saved.items() if k in known})

    def write(self, run_dir: Path) -> None:
        """`<run_dir>/result.json`, strict JSON, replaced atomically."""
        write_atomic(Path(run_dir) / "result.json", json.dumps(jsonable(self.to_dict()), indent=2, allow_nan=False))


__all__ = ["MetricsLog", "Throughput", "TrainResult", "json_line", "jsonable"]
