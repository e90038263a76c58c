"""What a run reports about itself: the facts its setup decided, its summaries, its result.

The setup decides once what the run is (model, data, schedule, device, parallelism, optimizer,
FP8 conversion, the MFU's two factors) and keeps it as one value, `RunFacts`: the header reads
it before the first step (nanochat.train.progress.header), and `RunReport` reads it again when
the run ends, with the live parts whose figures change as it trains (the step guard's counts,
FP8's statistics and choices, the bytes held), to print and log the summaries (each epoch and
at the end), print its evaluations, and assemble the TrainResult that `train()` returns and
result.json holds.

MFU divides by the bf16 peak for every run, and by the FP8 peak only for runs with native FP8
layers (nanochat.train.mfu explains why).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from nanochat.checkpoint import Saved
from nanochat.common import print0
from nanochat.config import TrainConfig, flag_text
from nanochat.config.fields import Fallbacks
from nanochat.fp8 import FP8Training
from nanochat.fp8.conversion import ConversionReport
from nanochat.model.gpt import GPTConfig
from nanochat.optim.recipe import RecipeRates
from nanochat.parallel.layout import Layout
from nanochat.train import mfu
from nanochat.train.evaluation import Evaluator
from nanochat.train.guard import StepGuard
from nanochat.train.memory import HeldBytes
from nanochat.train.metrics import MetricsLog, Throughput, TrainResult
from nanochat.train.run_data import RunData


@dataclass(frozen=True)
class RunFacts:
    """What the setup decided the run is: the header prints it, the result reports it."""

    config: TrainConfig
    model: GPTConfig
    num_params: int
    local_params: int
    """This rank's parameters (its FSDP shard): the denominator of bytes per parameter."""
    init_source: Saved | None
    """--init_from: the checkpoint whose weights the model started from."""
    data: RunData
    total_steps: int
    layout: Layout
    device: torch.device
    dtype: torch.dtype
    parallel: str
    """How the model is spread over processes, with FP8 all-gather on or off and why."""
    optimizer_state_bytes: int
    """This rank's, as the first step makes it."""
    optimizer_summary: str | None
    """FP8Optim's layout line, None for another optimizer."""
    fp8: ConversionReport | None
    """What the FP8 conversion did; None without --fp8."""
    flops_per_token: int
    peak: mfu.Peak | None
    """The device's dense peaks (nanochat.train.mfu); None where none is listed."""
    planned_memory_bytes: int
    rates: RecipeRates | None = None
    """--optimizer muon: each group's peak rate and its rule; None for AdamW."""
    weight_decay: float = 0.0
    """The decayed groups' weight decay, as build_optimizer set it."""


class RunReport:
    """The summaries and the result of a run: `facts` with the parts whose figures change as it
    trains."""

    def __init__(self, facts: RunFacts, *, guard: StepGuard, fp8: FP8Training, metrics: MetricsLog,
                 evaluator: Evaluator):
        self.facts, self.guard, self.fp8, self.metrics, self.evaluator = facts, guard, fp8, metrics, evaluator

    def evaluate(self, record: dict[str, Any],
                 write: Callable[[str], None] | None = None) -> tuple[float, float, float | None]:
        """An evaluation, added to `record` and printed: a step's, by `write` (Progress.write), or
        without it the starting point a fine-tune improves on (step 0, with the questions it scored)."""
        val_loss, val_bpb, val_accuracy = self.evaluator.all()
        record.update(val_loss=val_loss, val_bpb=val_bpb)
        if val_accuracy is not None:
            record["val_accuracy"] = val_accuracy
        data = self.facts.data
        questions = "" if write is not None else f" ({data.num_choice_items} questions, {data.accuracy_scoring})"
        (write or print0)(
            f"step {record['step']}: val loss {val_loss:.4f}, val bpb {val_bpb:.4f}"
            + (f", val accuracy {val_accuracy:.4f}{questions}" if val_accuracy is not None else ""))
        return val_loss, val_bpb, val_accuracy

    def mfu(self, tokens_per_sec: float, *, fp8: bool = False) -> float | None:
        """MFU against the dense bf16 peak, or with `fp8` the FP8 peak (native FP8 layers only)."""
        f, report = self.facts, self.facts.fp8
        native = report is not None and report.backend == "native" and bool(report.converted)
        return mfu.run_mfu(tokens_per_sec, f.flops_per_token, f.peak, f.layout.world_size, fp8=fp8, native_fp8=native)

    def summaries(self, label: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The per-epoch (and final) reports, printed and logged to metrics.jsonl: the step
        guard's, and FP8's with --fp8. Returns both (FP8's None without --fp8)."""
        guard = self.guard.summary()
        print0(self.guard.summary_text(label))
        self.metrics.log({"event": "guard_summary", "label": label, **guard})
        if not self.facts.config.fp8:
            return guard, None
        fp8 = self.fp8.summary()
        print0(self.fp8.summary_text(fp8, label))
        self.metrics.log({"event": "fp8_summary", "label": label, **fp8})
        return guard, fp8

    def result(self, meter: Throughput, final: tuple[float, float, float | None], *, held: HeldBytes,
               fallbacks: Fallbacks, starts: list[dict[str, Any]], wall_time_s: float) -> TrainResult:
        """The run's TrainResult from its `final` evaluation (val_loss, val_bpb, val_accuracy).
        Prints and logs the final summaries and generates the samples first."""
        f, report = self.facts, self.facts.fp8
        val_loss, val_bpb, val_accuracy = final
        guard_stats, fp8_stats = self.summaries("end of training")
        return TrainResult(
            train_loss=meter.train_loss, val_loss=val_loss, val_bpb=val_bpb, val_accuracy=val_accuracy,
            tokens_per_sec=meter.tokens_per_sec, wall_time_s=wall_time_s, steps=f.total_steps,
            epochs=f.data.loader.epoch, compile_time_s=meter.compile_time_s,
            fallbacks=list(fallbacks), optimizer_state_bytes=f.optimizer_state_bytes, num_params=f.num_params,
            fp8_backend=report.backend if report is not None else "off",
            fp8_converted=list(report.converted) if report is not None else [],
            fp8_skipped={n: flag_text(why) for n, why in report.skipped.items()} if report is not None else {},
            fp8_decisions={n: flag_text(why) for n, why in report.decisions.items()} if report is not None else {},
            fp8_measure_time_s=report.measure_time_s if report is not None else 0.0,
            fp8_choices=self.fp8.choices, fp8_stats=fp8_stats, guard_stats=guard_stats,
            accuracy_scoring=f.data.accuracy_scoring,
            samples=self.evaluator.samples(f.config.num_samples) if f.config.num_samples else [],
            run_dir=str(Path(f.config.run_dir)), parallel=f.parallel,
            state_bytes_per_param=held.total / max(1, f.local_params),
            state_bytes=held.as_dict(), planned_memory_bytes=f.planned_memory_bytes,
            peak_memory_bytes=torch.cuda.max_memory_allocated(f.device) if f.device.type == "cuda" else None,
            flops_per_token=f.flops_per_token, peak_tflops=None if f.peak is None else f.peak.bf16_tflops,
            mfu=self.mfu(meter.tokens_per_sec), mfu_fp8=self.mfu(meter.tokens_per_sec, fp8=True),
            starts=starts, restarts=len(starts) - 1, cropped_share=self._cropped_share(),
            learning_rates=f.rates.as_dict() if f.rates is not None else {},
            weight_decay=f.weight_decay,
        )

    def _cropped_share(self) -> float | None:
        layout = getattr(self.facts.data.loader, "bestfit", None)  # instruction data packs whole records
        return None if layout is None else layout.cropped_share


__all__ = ["RunFacts", "RunReport"]
