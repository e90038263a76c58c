"""NanoChatTrainer: one training run, put together from parts that each live in their own module.

    NanoChatTrainer(**fields_of_TrainConfig).train() -> TrainResult

The CLI (`scripts/base_train.py`) builds the same TrainConfig from flags and calls the same code.
`_setup` builds each part once (declared on the class), in the order that makes errors come
early: the stop signals (in __init__: a signal during setup is handled too), the process layout
(--fsdp and --tp on this world, decided once), the checkpointer (run directory, --init_from,
--resume: read before the model, for its FP8 layer set), preflight, run_data (every data error
before a model exists), the model (after the memory plan; FP8 conversion before compile; DDP,
FSDP or TP: nanochat.train.parts), the optimizer, compiled, the step guard, the evaluator, the
metrics log, and the report (nanochat.train.report: the header's facts, summaries, the result).

Three things are the run's, held once and handed to the parts:
- `closing`, an ExitStack: a part that must be let go of when the run ends (the process group,
  the run lock, a DDP wrapper, the trackers with the run's exit status) registers its close as
  it is built, so the run closes what it built, in reverse order, whatever stopped it.
- `fallbacks` (nanochat.config.fields.Fallbacks): every part's, logged once, named by flags.
- `stateful`: what a checkpoint holds, name -> state_dict()/load_state_dict() (model, optimizer,
  data position, FP8's and the step guard's state), saved and restored by the Checkpointer.

`train_step` is one step read top to bottom: learning rate, micro-batches (forward, backward),
the stop vote, the step's one device read (the guard's values and the votes), the update, FP8's
end of step. `_train` is the loop: step, time, evaluate, log, save. torchrun:
docs/distributed.md; precision (--dtype, --master_weights, --optimizer_in_backward):
docs/master_weights.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from nanochat.checkpoint import Checkpoint, Checkpointer, Saved, gpt_config, load_model
from nanochat.checkpoint.checkpointer import Keyed
from nanochat.common import NanoChatError, logger, print0, setup_logging
from nanochat.config import TrainConfig, flag_text, flags_in_log
from nanochat.config.fields import Fallbacks
from nanochat.device import autocast_context, host_read_all, resolve_device, resolve_dtype, seed_everything
from nanochat.data.prepare import write_sources
from nanochat.fp8 import FP8Training
from nanochat.model.gpt import GPT
from nanochat.model.hub import ResolvedModel
from nanochat.optim import FP8Optim, MuonAdamW, optimizer_state_bytes, param_dtype
from nanochat.optim.schedule import lr_multiplier, muon_momentum
from nanochat.parallel.layout import Layout
from nanochat.parallel.process_group import (
    broadcast_object, destroy_distributed, init_distributed, lost_peer, release_wrapper,
)
from nanochat.parallel.wrap import no_grad_sync
from nanochat.report.plot import plot_after_run
from nanochat.rundir import START_EVENT
from nanochat.train import memory, mfu, parts, preflight
from nanochat.train.compiled import Compiled
from nanochat.train.evaluation import Evaluator
from nanochat.train.guard import StepGuard, Verdict
from nanochat.train.memory import HeldBytes, MemoryPlan, held
from nanochat.train.metrics import MetricsLog, Throughput, TrainResult
from nanochat.train.progress import Progress, header
from nanochat.train.report import RunFacts, RunReport
from nanochat.train.run_data import RunData
from nanochat.train.stop import (
    StopNow, StopSignals, Stopped, lost_peer_message, resume_command, signal_name, stopped,
)
from nanochat.train.updates import UpdateRMS


class NanoChatTrainer:
    """Train a GPT. `NanoChatTrainer(model_name="d4", fp8=True, fp8_mode="e5m2").train()`."""

    # The run's facts and parts, in the order _setup sets each of them, once.
    layout: Layout                     # how the run spreads over the processes: decided once, read by every part
    device: torch.device
    dtype: torch.dtype                 # the compute dtype: `autocast` runs the forward passes in it
    run_dir: Path
    checkpoints: Checkpointer | None   # claimed first: the run directory's lock makes this process the run's
    fallbacks: Fallbacks               # every part's fallbacks, with their reasons (TrainResult.fallbacks)
    init_source: Saved | None          # --init_from: the checkpoint whose weights the model starts from
    data: RunData
    total_steps: int
    resumed: Saved | None              # the checkpoint a resume continues, read before the model exists
    finished: int | None               # --auto_resume: the step the run had already finished at (nothing to do)
    memory_plan: MemoryPlan            # planned and checked before a weight is allocated
    model: GPT                         # what is saved, evaluated and sampled (FP8 layers converted in place)
    fp8: FP8Training
    dist_model: torch.nn.Module        # `model` wrapped for the world size (DDP), or `model`; eager steps call it
    optimizer: torch.optim.Optimizer
    tokens_per_step: int               # all ranks and micro-batches: the recipe's batch and the throughput's
    peak_lrs: list[float]              # each param group's peak rate (--lr, or the recipe's per group)
    params: list[torch.Tensor]
    compiled: Compiled
    guard: StepGuard
    autocast: Any
    evaluator: Evaluator
    metrics: MetricsLog
    held: HeldBytes                    # weights and optimizer at setup, gradients at the first update
    facts: RunFacts                    # what the run is, as the header prints it and the result reports it
    report: RunReport
    stateful: dict[str, Any]           # what a checkpoint holds (module docstring)
    saved_step: int | None             # the step of the checkpoint this run saved last
    starts: list[dict[str, Any]]       # every start of the run, this one last (TrainResult.starts)
    stop: StopSignals                  # SIGTERM, Ctrl-C: set in __init__, so a signal during setup is handled too
    closing: contextlib.ExitStack      # the run's close-down, registered as _setup builds each part
    peer_lost: bool                    # a rank of the group died: its process group is not destroyed

    def __init__(self, config: TrainConfig | None = None, **kwargs: Any):
        if config is not None and kwargs:
            raise TypeError("pass either a TrainConfig or keyword fields, not both")
        if config is None:
            names = {f.name for f in dataclasses.fields(TrainConfig)}
            unknown = sorted(set(kwargs) - names)
            if unknown:
                raise TypeError(f"unknown NanoChatTrainer field(s) {unknown}; the fields are those of "
                                f"TrainConfig (the CLI flags): {sorted(names)}")
            config = TrainConfig(**kwargs)
        self.config = config
        self.stop = StopSignals()
        self.closing = contextlib.ExitStack()
        self.checkpoints = None
        self.peer_lost = False

    def train(self) -> TrainResult:
        """The run (module docstring). SIGTERM or Ctrl-C ends it after a step with a checkpoint,
        one line saying how to resume, and `Stopped` (a SystemExit: exit status 143 or 130); a
        rank whose peer died ends with one NanoChatError naming the checkpoint to resume. Whatever
        ends it, the parts built are closed (`closing`)."""
        with self.closing, self.stop.handling(), flags_in_log():  # the FP8 warnings in flags: --fp8_emulate
            try:
                return self._train()
            except StopNow as e:  # no step to finish, or a second Ctrl-C
                raise self._stopped(e.signum, f"stopped at once {e.when}") from None
            except RuntimeError as e:
                if (reason := lost_peer(e)) is None:
                    raise
                self.stop.ignore()  # torchrun's SIGTERM to the survivors must not cut this message short
                self.peer_lost = True
                raise NanoChatError(lost_peer_message(reason, self._newest(),
                                                      resume_command(self.config),
                                                      auto_resume=self.config.auto_resume)) from e

    def _newest(self) -> Checkpoint | None:
        """The checkpoint that holds the run, for the line it ends with; None before it has one."""
        return self.checkpoints.newest_if_any() if self.checkpoints is not None else None

    def _end_distributed(self) -> None:
        if not self.peer_lost:  # a group that lost a rank would wait for it: the process exits without it
            destroy_distributed()  # only a process group init_distributed created

    def _unwrap(self) -> None:
        release_wrapper(self.dist_model)  # before the process group goes: whoever owns it
        self.dist_model = self.model

    def _close_metrics(self, kind: type[BaseException] | None, error: BaseException | None,
                       tb: TracebackType | None) -> None:
        """--log's trackers closed with the run's exit status: W&B marks a run failed or preempted."""
        self.metrics.close(exit_code=0 if error is None else error.code if isinstance(error, Stopped) else 1)

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        """Everything before the first step, in the order that makes errors come early (see the
        module docstring); the run directory is created last. A --auto_resume run that had
        finished stops once its checkpoint is read (`finished`)."""
        cfg = self.config
        setup_logging()
        self.closing.callback(self._end_distributed)
        env, self.device = init_distributed(resolve_device(cfg.device))
        self.layout = preflight.check_layout(cfg, env)  # before the parts that read it, the checkpointer first
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.run_dir = Path(cfg.run_dir)
        self.checkpoints = Checkpointer(cfg, self.layout)
        self.closing.callback(self.checkpoints.release)  # the run lock, once claimed
        self.checkpoints.claim()  # the run directory first: its lock makes this process the run's
        resuming = self.checkpoints.resuming  # --resume, or what --auto_resume decided
        model_source = preflight.check_environment(cfg, self.layout, self.device, self.dtype, resume=resuming)
        self.fallbacks = Fallbacks(translate=flag_text)  # nanochat.fp8 names FP8Config's fields: these are flags
        seed_everything(cfg.seed)
        self.init_source = self.checkpoints.read_init_source() if cfg.init_from and not resuming else None
        self.data = RunData.load(cfg, layout=self.layout, device=self.device, model=model_source,
                                 tokenizer=self.init_source.tokenizer if self.init_source else None,
                                 fallback=self.fallbacks.add, resume=resuming)
        self.total_steps = cfg.num_iterations if cfg.num_iterations > 0 else cfg.num_epochs * self.data.steps_per_epoch
        self.resumed = self.checkpoints.read_resume(self.total_steps, self.data.tokenizer) if resuming else None
        self.finished = self.checkpoints.finished(self.total_steps)
        if self.finished is not None:
            return  # nothing to train: no model is built, nothing is written
        self._build_model_parts(model_source)
        self._build_loop_parts()
        self.checkpoints.prepare()  # the run directory, created last: an error until here leaves nothing
        if cfg.save_checkpoints:  # room for one more checkpoint (--overwrite has made room first)
            preflight.check_disk(self.run_dir, self.facts.optimizer_state_bytes
                                 + held(self.model.state_dict().values())[1])

    def _build_model_parts(self, source: ResolvedModel) -> None:
        """The memory plan, then the model, FP8's conversion, the parallel wrapping and the
        optimizer: each part once, in the order each needs the one before."""
        cfg = self.config
        model_config = gpt_config(source, vocab_size=self.data.tokenizer.vocab_size, seq_len=cfg.seq_len)
        self.memory_plan = memory.plan_run(cfg, model_config, autocast=self.dtype != torch.float32, device=self.device,
                                           shards=memory.param_shards(self.layout))
        print0(self.memory_plan.table())
        self.model = self._build_model(source)
        fp8_config, all_gather_problem = parts.fp8_config(cfg, self.model, self.layout,
                                                          self.resumed.meta if self.resumed else None)
        self.fp8 = FP8Training(self.model, fp8_config, fallbacks=self.fallbacks)
        if self.device.type == "cuda" and self.fp8.report is not None and self.fp8.report.shapes_measured:
            torch.cuda.reset_peak_memory_stats(self.device)  # the timing buffers are gone: not the run's peak
        # before the optimizer: FSDP replaces the parameters
        self.dist_model, parallel = parts.parallelize(cfg, self.model, self.fp8, self.layout, device=self.device,
                                                      all_gather_problem=all_gather_problem, fallbacks=self.fallbacks)
        self.closing.callback(self._unwrap)
        self.tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum_steps * self.layout.dp_size
        self.optimizer, rates = parts.build_optimizer(cfg, self.model, self.fp8, self.device, self.tokens_per_step,
                                                      steps_per_epoch=self.data.steps_per_epoch,
                                                      total_steps=self.total_steps)
        # this run's flags, read before a checkpoint's param groups replace the groups' own copies
        self.peak_lrs = [group["initial_lr"] for group in self.optimizer.param_groups]
        self.weight_decays = [group["weight_decay"] for group in self.optimizer.param_groups]
        self.update_rms = UpdateRMS(self.optimizer, every=cfg.update_rms_every, total_steps=self.total_steps)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        local_params, weight_bytes = held(self.model.parameters())
        state_bytes = optimizer_state_bytes(self.optimizer)  # this rank's, as the first step makes it
        self.held = HeldBytes(weights=weight_bytes, optimizer=state_bytes)  # gradients: step 1
        self.facts = RunFacts(
            config=cfg, model=self.model.config, num_params=self.model.num_params(), local_params=local_params,
            init_source=self.init_source, data=self.data, total_steps=self.total_steps, layout=self.layout,
            device=self.device, dtype=self.dtype, parallel=parallel, optimizer_state_bytes=state_bytes,
            optimizer_summary=(self.optimizer.summary(logged=True)  # the header says it: the first step does not
                               if isinstance(self.optimizer, (FP8Optim, MuonAdamW)) else None),
            fp8=self.fp8.report, flops_per_token=self.model.flops_per_token(cfg.seq_len),
            peak=mfu.device_peak(self.device), planned_memory_bytes=self.memory_plan.total, rates=rates,
            weight_decay=max(self.weight_decays))

    def _build_loop_parts(self) -> None:
        """What the loop runs the model with (compile, the step guard, autocast, the evaluator),
        what it records (the metrics log, the report) and what a checkpoint holds (`stateful`)."""
        cfg = self.config
        self.compiled = Compiled(self.dist_model, self.model.transformer.h, enabled=cfg.compile,
                                 scope=cfg.compile_scope)
        self.guard = StepGuard(self.model, max_bad_steps=cfg.max_bad_steps)
        self.autocast = autocast_context(self.device, self.dtype)
        self.evaluator = Evaluator(self.model, self.data, cfg, layout=self.layout, device=self.device,
                                   autocast=self.autocast, fp8=self.fp8, eager=self.compiled.eager)
        self.metrics = MetricsLog(self.run_dir, rank=self.layout.rank, fallbacks=self.fallbacks)
        self.closing.push(self._close_metrics)
        self.report = RunReport(self.facts, guard=self.guard, fp8=self.fp8, metrics=self.metrics,
                                evaluator=self.evaluator)
        self.stateful = {"model": self.model, "optimizer": self.optimizer, "data": Keyed("data", self.data.loader),
                         "fp8": self.fp8, "guard": self.guard}
        self.saved_step = None

    def _build_model(self, source: ResolvedModel) -> GPT:
        """The model in its master weights (nanochat.checkpoint.load_model): a Hugging Face model's,
        the --init_from source's or freshly initialized (FP8 conversion follows, before compile)."""
        cfg = self.config
        weights_dtype = torch.float32 if cfg.master_weights_emulate else param_dtype(cfg.master_weights)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        model, _ = load_model(self.init_source or source, device=self.device, dtype=weights_dtype,
                              vocab_size=self.data.tokenizer.vocab_size, seq_len=cfg.seq_len)
        if self.init_source is not None:
            logger.info("initialized from %s (step %d of that run)", self.init_source.path, self.init_source.step)
        if cfg.master_weights != "fp32":  # parameters only: the rotary tables stay fp32
            for p in model.parameters():  # emulated: fp32 tensors holding the bf16 values
                p.data = p.data.to(torch.bfloat16).to(weights_dtype)
        model.activation_checkpointing = cfg.activation_checkpointing
        return model

    def _resume(self) -> int:
        """The checkpoint read at setup into the built parts (`stateful`); its step. The groups
        keep this run's peak rates and weight decays; a derived one that changed is said (parts.keep_peaks)."""
        roles = [group.get("role") for group in self.optimizer.param_groups]  # a checkpoint's groups replace these
        step = self.checkpoints.restore(self.resumed, self.stateful, self.device)
        for changed in parts.keep_peaks(self.optimizer, self.peak_lrs, self.weight_decays, roles, self.facts.rates):
            if self.layout.rank == 0:
                logger.warning("%s", changed)
        return step

    # ------------------------------------------------------------------- step
    def train_step(self, step: int) -> dict[str, Any]:
        """One optimizer step (0-based `step`), top to bottom; returns its metrics record. In the
        steady state it reads the device once (the guard's read of the loss, the gradient norm
        and the stop votes); a step that samples FP8 statistics or calibrates adds a bounded
        number of reads."""
        cfg = self.config
        multiplier = lr_multiplier(step, self.total_steps, cfg.warmup_steps, cfg.final_lr_frac)
        lr = cfg.lr * multiplier  # --lr's; each group scales its own peak (Muon's: the recipe's rates)
        for group, peak in zip(self.optimizer.param_groups, self.peak_lrs):
            group["lr"] = peak * multiplier
        if cfg.optimizer == "muon" and cfg.muon_momentum_warmup:
            for group in self.optimizer.muon.param_groups:
                group["momentum"] = muon_momentum(step, cfg.muon_momentum_warmup, cfg.muon_beta)
        fp8_step = self.fp8.begin_step(step)  # calibration and statistics run eagerly: their hooks would recompile
        eager = fp8_step.eager or self.compiled.failed
        module = self.dist_model if eager else self.compiled.module
        loss_sum = torch.zeros((), device=self.device)
        self.update_rms.before(step)  # a sampled step: the weights, before a backward that may update them
        with fp8_step:
            for micro in range(cfg.grad_accum_steps):  # gradients accumulate; DDP reduces them at the last
                x, y = self.data.loader.next_batch(self.device)
                with no_grad_sync(module, skip=micro < cfg.grad_accum_steps - 1):
                    loss = self.compiled.forward(x, y, eager=eager, autocast=self.autocast, fallback=self.fallbacks.add)
                    (loss / cfg.grad_accum_steps).backward()  # --optimizer_in_backward: this is the update
                loss_sum += loss.detach()
        # the loss averaged over micro-batches and ranks, and every rank's stop request, in one all-reduce
        loss, votes = self.stop.vote(loss_sum / cfg.grad_accum_steps)
        verdict = self._verdict(step, loss, votes, (x, y))  # the one device read; a non-finite step is skipped
        record = {"step": step + 1, "loss": verdict.loss, "lr": lr, "lrm": multiplier, "grad_norm": verdict.grad_norm,
                  **fp8_step.record(), **verdict.flags}
        if verdict.skipped and not cfg.optimizer_in_backward:  # its gradients are dropped: the weights stay
            self.update_rms.drop()
            return record
        self.held.count_gradients(self.params, self.optimizer)  # at the first update (train.memory)
        if not cfg.optimizer_in_backward:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        record.update(self.update_rms.record())
        if self.fp8.end_step(step):  # auto's formats are fixed: compile at the next step
            self.compiled.recompile()
        for event in self.fp8.pop_events():
            self.metrics.log(event)
        return record

    def _verdict(self, step: int, loss: torch.Tensor, votes: torch.Tensor,
                 batch: tuple[torch.Tensor, torch.Tensor]) -> Verdict:
        """The step's one device read: the step guard's values (nanochat.train.guard: the loss and
        the gradient norm) and the stop `votes`, each then given its own. A non-finite step is
        skipped and its gradients dropped (`batch` is re-run eagerly to name where a non-finite
        loss began); a finite one is clipped. With --optimizer_in_backward the backward was the
        update; the guard reads what it did. Every rank reads the same votes: all stop after the
        same step."""
        cfg, note = self.config, self.checkpoints.good_checkpoint_note
        if cfg.optimizer_in_backward:
            reading = self.guard.measure_in_backward(step, loss, self.optimizer, note=note)
        else:
            def rerun() -> None:
                with self.compiled.eager():
                    self.model(*batch)

            reading = self.guard.measure(step, loss, self.params, rerun=rerun, note=note,
                                         max_norm=cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
        guard_values, vote_values = host_read_all(reading.values, votes)
        verdict = reading.judge(guard_values)
        self.stop.decide(vote_values)
        return verdict

    # ------------------------------------------------------------------- loop
    def _train(self) -> TrainResult:
        """Setup, resume, the loop (step, evaluate, log, save), the result."""
        t_start = time.perf_counter()
        cfg = self.config
        self._setup()
        if self.finished is not None:  # --auto_resume of a run that had finished: its result, as it wrote it
            return TrainResult.read(self.run_dir)
        start_step = self._resume() if self.checkpoints.resuming else 0
        rank0 = self.layout.rank == 0
        meter = Throughput(self.tokens_per_step, history=self._start_files())
        print0(header(self.facts))
        if start_step == 0 and (self.data.num_choice_items or cfg.init_from):
            self.report.evaluate(start := {"step": 0})  # the starting point fine-tuning improves on
            self.metrics.log(start)
        final = None  # the last evaluation: (val_loss, val_bpb, val_accuracy)
        self.model.train()
        progress = Progress(self.total_steps, start_step, every=cfg.log_every, tokens_per_step=meter.tokens_per_step,
                            enabled=rank0, per_group=self.facts.rates is not None)
        for step in self.stop.steps(start_step, self.total_steps, on_stop=self._stop):  # until a signal
            t0, epoch, compiles = time.perf_counter(), int(self.data.loader.epoch), self.compiled.pending
            record = self.train_step(step)
            seconds = time.perf_counter() - t0
            done = step + 1
            is_last = done == self.total_steps
            if record.get("skipped"):
                progress.update(done, record, None)
                self.metrics.log(record)
                if is_last and cfg.save_checkpoints:  # the last update's weights are the result
                    self._save(done)
                continue
            utilization = self.report.mfu(meter.add(record, seconds, compiled=compiles))
            if utilization is not None:
                record["mfu"] = utilization
            progress.update(done, record, utilization)
            if is_last and cfg.save_checkpoints:  # before the final evaluation, which could fail
                self._save(done, record)
            if (cfg.eval_every and done % cfg.eval_every == 0) or is_last:
                final = self.report.evaluate(record, progress.write)
            self.metrics.log(record)
            if int(self.data.loader.epoch) > epoch and not is_last:
                self.report.summaries(f"epoch {int(self.data.loader.epoch)}")
            if cfg.save_checkpoints and cfg.save_every and done % cfg.save_every == 0 and not is_last:
                self._save(done)
        progress.close()
        self.fp8.finish()  # a calibration the run did not complete keeps the hybrid (recorded)
        if final is None or not math.isfinite(final[1]):  # resumed at the end, or the last step was skipped
            final = self.evaluator.all()
        result = self.report.result(meter, final, held=self.held, fallbacks=self.fallbacks, starts=self.starts,
                                    wall_time_s=time.perf_counter() - t_start)
        if rank0:
            result.write(self.run_dir)
            self.metrics.trackers.record_result(result.to_dict())
            if cfg.plot and (problem := plot_after_run(self.run_dir, meter.tokens_per_step)):
                self.fallbacks.add(problem)  # the run's results stand: recorded, not raised
                result.fallbacks = list(self.fallbacks)
                result.write(self.run_dir)
        return result

    def _start_files(self) -> list[dict[str, Any]]:
        """Before the first step: rank 0 saves a new run's tokenizer and begins the records
        (MetricsLog.begin: metrics.jsonl cut back, the trackers, this start's record); every
        rank learns the run's starts. Returns the records kept (the run's history)."""
        cfg, this, history = self.config, self.checkpoints.start_record(self.resumed), []
        if self.layout.rank == 0:
            if self.resumed is None:  # a new run replaces a tokenizer of its own only with --overwrite
                self.data.tokenizer.save(self.run_dir / "tokenizer", overwrite=cfg.overwrite)
                write_sources(self.data.sources, self.run_dir)  # what a resume must find unchanged
            history = self.metrics.begin(this, log=cfg.log, config=cfg.to_dict(),
                                         resumed_record=self.resumed.meta.get("record") if self.resumed else None)
        self.starts = broadcast_object([r for r in history if r.get("event") == START_EVENT] + [this])
        return history

    def _stop(self, step: int, signum: int) -> None:
        """Every rank agreed to stop on `signum` after `step` steps: a checkpoint of that step
        (unless its own --save_every wrote one), then Stopped."""
        cfg = self.config
        if cfg.save_checkpoints and self.saved_step != step:
            self._save(step)
        raise self._stopped(signum, f"stopped by {signal_name(signum)} at step {step}", saved=cfg.save_checkpoints)

    def _stopped(self, signum: int, what: str, *, saved: bool = False) -> Stopped:
        """The Stopped that ends a run on `signum` (nanochat.train.stop.stopped): `what` stopped
        it, the checkpoint that holds the run (the one just saved, with `saved`), how to resume."""
        self.stop.ignore()  # the run is ending: a late signal must not cut this short
        return stopped(signum, what, self._newest(), resume_command(self.config),
                       saved=saved, saving=self.config.save_checkpoints)

    def _save(self, step: int, record: dict[str, Any] | None = None) -> None:
        """A checkpoint of `step` (checkpoint.Checkpointer.save): the `stateful` parts, the
        tokenizer's fingerprint, and `record`, the step's metrics line when it is logged after the
        save (the last step's, which waits for the final evaluation), so that a resume can log it
        if the run died in between."""
        self.checkpoints.save(step, self.stateful, {"tokenizer_fingerprint": self.data.tokenizer.fingerprint,
                                                    "record": record})
        self.saved_step = step


__all__ = ["NanoChatTrainer", "TrainResult", "lr_multiplier"]
