"""NanoChatTrainer: one training run, put together from parts that each live in their own module.

    NanoChatTrainer(**fields_of_TrainConfig).train() -> TrainResult

The CLI (`scripts/base_train.py`) builds the same TrainConfig from flags and calls the same code.
`_setup` builds the parts in the order that makes errors come early, each attribute once
(declared on the class): the stop signals (first: a signal during setup is handled too), the
checkpointer (run directory, --init_from, --resume: read before the model, for its FP8 layer
set), preflight (device, process layout, input paths), run_data (corpus, tokenizer, token
store, batches: every data error before a model exists), the model (after the memory plan; FP8
conversion before compile; DDP or FSDP), the optimizer (AdamW, as FP8Training wraps it),
compiled (torch.compile's state), the step guard, the evaluator, the metrics log and the
progress printer. `train_step` is one step read top to bottom: learning rate, micro-batches
(forward, backward), the stop vote and the guard's one device read, the update, FP8's end of
step. `_train` is the loop: step, time, evaluate, log, save. torchrun: docs/distributed.md;
precision (--dtype, --master_weights, --optimizer_in_backward): docs/master_weights.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import torch

from nanochat import distributed
from nanochat.checkpoint import Checkpoint, Checkpointer, Saved, gpt_config, load_model
from nanochat.common import (
    DistEnv, NanoChatError, logger, print0, setup_logging,
)
from nanochat.config import TrainConfig, flag_text, flags_in_log
from nanochat.device import autocast_context, resolve_device, resolve_dtype, seed_everything
from nanochat.data.prepare import write_sources
from nanochat.fp8 import FP8Config, FP8Training
from nanochat.model.gpt import GPT
from nanochat.model.hub import ResolvedModel
from nanochat.optim import optimizer_state_bytes, param_dtype
from nanochat.report.plot import plot_after_run
from nanochat.rundir import START_EVENT
from nanochat.train import memory, mfu, preflight
from nanochat.train.compiled import Compiled
from nanochat.train.evaluation import Evaluator
from nanochat.train.guard import StepGuard
from nanochat.train.memory import HeldBytes, MemoryPlan, held
from nanochat.train.metrics import MetricsLog, Throughput, TrainResult
from nanochat.train.progress import Progress, header
from nanochat.train.run_data import RunData
from nanochat.train.stop import (
    StopNow, StopSignals, Stopped, lost_peer_message, resume_command, signal_name, stopped,
)


def lr_multiplier(step: int, total_steps: int, warmup_steps: int, final_lr_frac: float) -> float:
    """Linear warmup to 1, then cosine decay to `final_lr_frac` at the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return final_lr_frac + (1 - final_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress))


def newest_checkpoint(checkpoints: Checkpointer | None) -> Checkpoint | None:
    """The checkpoint a --resume would start from now (not re-verified: this runs on the way
    out), or None."""
    if checkpoints is None:
        return None
    with contextlib.suppress(NanoChatError, OSError):  # a loose newest checkpoint: --resume will say so
        return checkpoints.newest()
    return None


class NanoChatTrainer:
    """Train a GPT. `NanoChatTrainer(model_name="d4", fp8=True, fp8_mode="e5m2").train()`."""

    # The run's facts and parts, in the order _setup sets each of them, once.
    dist: DistEnv
    device: torch.device
    dtype: torch.dtype                 # the compute dtype: `autocast` runs the forward passes in it
    run_dir: Path
    checkpoints: Checkpointer          # claimed first: the run directory's lock makes this process the run's
    fallbacks: list[str]               # the trainer's own, with their reasons (all: all_fallbacks)
    init_source: Saved | None          # --init_from: the checkpoint whose weights the model starts from
    data: RunData
    total_steps: int
    resumed: Saved | None              # the checkpoint a resume continues, read before the model exists
    finished: int | None               # --auto_resume: the step the run had already finished at (nothing to do)
    memory_plan: MemoryPlan            # planned and checked before a weight is allocated
    model: GPT
    """The model: what is saved, evaluated and sampled (FP8 layers converted in place)."""
    fp8: FP8Training
    dist_model: torch.nn.Module
    """`model` wrapped for the world size (DDP), or `model` itself; eager steps call it."""
    parallel: str                      # how the model is spread over processes (TrainResult.parallel)
    optimizer: torch.optim.Optimizer
    optimizer_state_bytes: int         # this rank's, as the first step makes it
    params: list[torch.Tensor]
    num_params: int
    local_params: int                  # this rank's (its FSDP shard): the denominator of bytes per parameter
    compiled: Compiled
    guard: StepGuard
    autocast: Any
    evaluator: Evaluator
    metrics: MetricsLog
    flops_per_token: int               # with `peak`, the two factors of MFU (nanochat.train.mfu)
    peak: mfu.Peak | None
    saved_step: int | None             # the step of the checkpoint this run saved last
    starts: list[dict[str, Any]]       # every start of the run, this one last (TrainResult.starts)
    held: HeldBytes                    # weights and optimizer at setup, gradients at the first update
    stop: StopSignals
    """SIGTERM and Ctrl-C while training: the run stops after a step, with a checkpoint (set in
    __init__: a signal during setup is handled too)."""

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

    def train(self) -> TrainResult:
        """The run (module docstring). SIGTERM or Ctrl-C ends it after a step with a checkpoint,
        one line saying how to resume, and `Stopped` (a SystemExit: exit status 143 or 130); a
        rank whose peer died ends with one NanoChatError naming the checkpoint to resume."""
        exit_code, lost = 1, False
        try:
            with self.stop.handling(), flags_in_log():  # the FP8 warnings in flags: --fp8_emulate
                try:
                    result, exit_code = self._train(), 0
                except Stopped as e:
                    exit_code = e.code
                    raise
                except StopNow as e:  # no step to finish, or a second Ctrl-C
                    exit_code = 128 + e.signum
                    raise self._stopped(e.signum, f"stopped at once {e.when}") from None
                except RuntimeError as e:
                    if (reason := distributed.lost_peer(e)) is None:
                        raise
                    self.stop.ignore()  # torchrun's SIGTERM to the survivors must not cut this message short
                    lost = True
                    newest = newest_checkpoint(getattr(self, "checkpoints", None))
                    raise NanoChatError(lost_peer_message(reason, newest, resume_command(self.config),
                                                          auto_resume=self.config.auto_resume)) from e
            return result
        finally:
            if getattr(self, "metrics", None) is not None:
                self.metrics.close(exit_code=exit_code)  # --log's trackers: W&B marks failed or preempted
            if getattr(self, "checkpoints", None) is not None:
                self.checkpoints.release()  # the run lock
            if getattr(self, "dist_model", None) is not None:  # whoever owns the process group
                distributed.release_wrapper(self.dist_model)
                self.dist_model = self.model
            if not lost:  # a group that lost a rank would wait for it: the process exits without it
                distributed.destroy_distributed()  # only a process group init_distributed created

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        """Everything before the first step, in the order that makes errors come early (see the
        module docstring); the run directory is created last. A --auto_resume run that had
        finished stops once its checkpoint is read (`finished`)."""
        cfg = self.config
        setup_logging()
        env, self.device = distributed.init_distributed(resolve_device(cfg.device))
        self.dist = dataclasses.replace(env, tp=cfg.tp)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.run_dir = Path(cfg.run_dir)
        self.checkpoints = Checkpointer(cfg, self.dist)
        self.checkpoints.claim()  # the run directory first: its lock makes this process the run's
        resuming = self.checkpoints.resuming  # --resume, or what --auto_resume decided
        model_source = preflight.check_environment(cfg, self.dist, self.device, self.dtype, resume=resuming)
        self.fallbacks = []
        seed_everything(cfg.seed)
        self.init_source = self.checkpoints.read_init_source() if cfg.init_from and not resuming else None
        self.data = RunData.load(cfg, dist=self.dist, device=self.device, model=model_source,
                                 tokenizer=self.init_source.tokenizer if self.init_source else None,
                                 fallback=self._fallback, resume=resuming)
        self.total_steps = cfg.num_iterations if cfg.num_iterations > 0 else cfg.num_epochs * self.data.steps_per_epoch
        self.resumed = self.checkpoints.read_resume(self.total_steps, self.data.tokenizer) if resuming else None
        self.finished = self.checkpoints.finished(self.total_steps)
        if self.finished is not None:
            return  # nothing to train: no model is built, nothing is written
        model_config = gpt_config(model_source, vocab_size=self.data.tokenizer.vocab_size, seq_len=cfg.seq_len)
        self.memory_plan = memory.plan_run(cfg, model_config, autocast=self.dtype != torch.float32, device=self.device,
                                           shards=memory.param_shards(cfg, self.dist))
        print0(self.memory_plan.table())
        self.model = self._build_model(model_source)
        fp8_config, all_gather_problem = self._fp8_config()
        self.fp8 = FP8Training(self.model, fp8_config)
        if self.device.type == "cuda" and self.fp8.report is not None and self.fp8.report.shapes_measured:
            torch.cuda.reset_peak_memory_stats(self.device)  # the timing buffers are gone: not the run's peak
        # before the optimizer: FSDP replaces the parameters
        self.dist_model, self.parallel = self._parallelize(all_gather_problem)
        self.optimizer = self._build_optimizer()
        self.optimizer_state_bytes = optimizer_state_bytes(self.optimizer)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.num_params = self.model.num_params()
        self.local_params, weight_bytes = held(self.model.parameters())
        self.compiled = Compiled(self.dist_model, self.model.transformer.h, enabled=cfg.compile,
                                 scope=cfg.compile_scope)
        self.guard = StepGuard(self.model, max_bad_steps=cfg.max_bad_steps)
        self.autocast = autocast_context(self.device, self.dtype)
        self.evaluator = Evaluator(self.model, self.data, cfg, dist=self.dist, device=self.device,
                                   autocast=self.autocast, fp8=self.fp8, eager=self.compiled.eager)
        self.metrics = MetricsLog(self.run_dir, rank=self.dist.rank)
        self.flops_per_token = self.model.flops_per_token(cfg.seq_len)
        self.peak = mfu.device_peak(self.device)
        self.saved_step = None
        self.held = HeldBytes(weights=weight_bytes, optimizer=self.optimizer_state_bytes)  # gradients: step 1
        self.checkpoints.prepare()  # the run directory, created last: an error until here leaves nothing
        if cfg.save_checkpoints:  # room for one more checkpoint (--overwrite has made room first)
            preflight.check_disk(self.run_dir, self.optimizer_state_bytes + held(self.model.state_dict().values())[1])

    def _fallback(self, message: str) -> None:
        """Record a fallback in the run's results and say it once, now."""
        self.fallbacks.append(message)
        logger.warning("WARNING: %s", message)

    def all_fallbacks(self) -> list[str]:
        """Every fallback the run took so far, with its reason (TrainResult.fallbacks): the
        trainer's own, FP8's, the optimizer's and the trackers' (those failed mid-run)."""
        parts = self.fp8.fallbacks  # the conversion's and the optimizer's
        trackers = self.metrics.trackers.fallbacks if self.metrics.trackers is not None else []
        return self.fallbacks + [flag_text(f) for f in parts] + trackers

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

    def _fp8_config(self) -> tuple[FP8Config, str | None]:
        """The FP8 flags plus what only the trainer knows: the tokens per micro-batch (the M at
        which --fp8_layers faster times the layers), the layers a resumed run converted, and
        whether FSDP all-gathers the FP8 weights in FP8 (decided before converting: torchao wraps
        the weights for it then); and why not, if it does not (None: it does, or no FSDP)."""
        cfg = self.config
        config = dataclasses.replace(cfg.fp8_config(), micro_batch_tokens=cfg.batch_size * cfg.seq_len)
        saved = self.resumed.meta.get("fp8_converted") if self.resumed is not None else None
        if cfg.fp8 and saved is not None:  # a checkpoint saved without the list: the rules decide
            config = dataclasses.replace(config, converted_layers=tuple(saved))
        problem = None
        if cfg.fp8 and cfg.fsdp and self.dist.is_distributed:
            problem = distributed.fp8_all_gather_problem(self.model, config, fsdp=True, tp=cfg.tp)
            config = dataclasses.replace(config, fsdp_float8_all_gather=problem is None)
        return config, problem

    def _parallelize(self, fp8_all_gather_problem: str | None) -> tuple[torch.nn.Module, str]:
        """The module the training step calls for this world size (DDP around self.model, or
        self.model itself: one process, or split in place by TP and FSDP) and how it is spread."""
        cfg = self.config
        layout = distributed.plan_layout(fsdp=cfg.fsdp, tp=cfg.tp, env=self.dist, config=self.model.config)
        for note in layout.fallbacks:
            self._fallback(note)
        if not self.dist.is_distributed:
            return self.model, layout.name
        parallel = layout.name
        if layout.fsdp and self.fp8.has_fp8_layers:
            parallel += (f", fp8 all-gather on ({len(self.fp8.report.converted)} layers' weights all-gathered in "
                         f"{cfg.fp8_mode}, scales precomputed after each optimizer step)"
                         if self.fp8.config.fsdp_float8_all_gather else f", fp8 all-gather off: {fp8_all_gather_problem}")
        return distributed.wrap_model(self.model, fsdp=layout.fsdp, device=self.device, blocks=self.model.transformer.h,
                                      tp=cfg.tp), parallel

    def _build_optimizer(self) -> torch.optim.Optimizer:
        """AdamW, no weight decay on embeddings / norms / biases, as FP8Training wraps it (FP8
        moments: --fp8_opt_level; bf16 --master_weights; --optimizer_in_backward)."""
        cfg = self.config
        adamw = torch.optim.AdamW(
            self.model.param_groups(cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
            # fused: one kernel for all parameters (CPU and CUDA); FP8Optim steps its FP8-state
            # parameters itself and hands the rest to this same optimizer, so baselines match.
            eps=1e-8, fused=self.device.type in ("cpu", "cuda"),
        )
        for group in adamw.param_groups:
            group["initial_lr"] = cfg.lr
        return self.fp8.wrap_optimizer(adamw, master_weights=cfg.master_weights, seed=cfg.seed,
                                       emulate=cfg.master_weights_emulate, in_backward=cfg.optimizer_in_backward)

    def _resume(self) -> int:
        """The checkpoint read at setup into the built parts; its step."""
        step = self.checkpoints.restore(self.resumed, self.model, self.optimizer, self.data.loader, self.fp8,
                                        self.device)
        self.guard.load_state_dict(self.resumed.meta)
        return step

    # ------------------------------------------------------------------- step
    def train_step(self, step: int) -> dict[str, Any]:
        """One optimizer step (0-based `step`), top to bottom; returns its metrics record. In the
        steady state it reads the device once (the guard's read of the loss, the gradient norm
        and the stop votes); a step that samples FP8 statistics or calibrates adds a bounded
        number of reads."""
        cfg = self.config
        lr = cfg.lr * lr_multiplier(step, self.total_steps, cfg.warmup_steps, cfg.final_lr_frac)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        fp8_step = self.fp8.begin_step(step)  # calibration and statistics run eagerly: their hooks would recompile
        eager = fp8_step.eager or self.compiled.failed
        module = self.dist_model if eager else self.compiled.module
        loss_sum = torch.zeros((), device=self.device)
        with fp8_step:
            for micro in range(cfg.grad_accum_steps):  # gradients accumulate; DDP reduces them at the last
                x, y = self.data.loader.next_batch(self.device)
                with distributed.no_grad_sync(module, skip=micro < cfg.grad_accum_steps - 1):
                    loss = self.compiled.forward(x, y, eager=eager, autocast=self.autocast, fallback=self._fallback)
                    (loss / cfg.grad_accum_steps).backward()  # --optimizer_in_backward: this is the update
                loss_sum += loss.detach()
        # the loss averaged over micro-batches and ranks, and every rank's stop request, in one all-reduce
        loss, votes = self.stop.vote(loss_sum / cfg.grad_accum_steps)
        verdict = self._verdict(step, loss, votes, (x, y))  # the one device read; a non-finite step is skipped
        self.stop.decide(verdict.also)  # every rank read the same votes: all stop after the same step
        record = {"step": step + 1, "loss": verdict.loss, "lr": lr, "grad_norm": verdict.grad_norm,
                  **fp8_step.record(), **verdict.flags}
        if verdict.skipped and not cfg.optimizer_in_backward:  # its gradients are dropped: the weights stay
            return record
        self.held.count_gradients(self.params, self.optimizer)  # at the first update (train.memory)
        if not cfg.optimizer_in_backward:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.fp8.end_step(step):  # auto's formats are fixed: compile at the next step
            self.compiled.recompile()
        for event in self.fp8.pop_events():
            self.metrics.log(event)
        return record

    def _verdict(self, step: int, loss: torch.Tensor, votes: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]):
        """The step guard on this step (nanochat.train.guard), reading `votes` with the loss and
        the gradient norm: a non-finite step is skipped and its gradients dropped (`batch` is
        re-run eagerly to name where a non-finite loss began); a finite one is clipped. With
        --optimizer_in_backward the backward was the update; the guard reads what it did."""
        cfg, note = self.config, self.checkpoints.good_checkpoint_note
        if cfg.optimizer_in_backward:
            return self.guard.check_in_backward(step, loss, self.optimizer, note=note, also=votes)

        def rerun() -> None:
            with self.compiled.eager():
                self.model(*batch)

        return self.guard.check(step, loss, self.params, max_norm=cfg.grad_clip if cfg.grad_clip > 0 else math.inf,
                                rerun=rerun, note=note, also=votes)

    # ------------------------------------------------------------------- loop
    def _train(self) -> TrainResult:
        """Setup, resume, the loop (step, evaluate, log, save), the result."""
        t_start = time.perf_counter()
        cfg = self.config
        self._setup()
        if self.finished is not None:  # --auto_resume of a run that had finished: its result, as it wrote it
            return TrainResult.read(self.run_dir)
        start_step = self._resume() if self.checkpoints.resuming else 0
        rank0 = self.dist.rank == 0
        meter = Throughput(cfg.batch_size * cfg.seq_len * cfg.grad_accum_steps * self.dist.dp_size,
                           history=self._start_files())
        print0(header(self))
        if start_step == 0 and (self.data.num_choice_items or cfg.init_from):
            self._evaluate(start := {"step": 0})  # the starting point fine-tuning improves on
            self.metrics.log(start)
        final = None  # the last evaluation: (val_loss, val_bpb, val_accuracy)
        self.model.train()
        progress = Progress(self.total_steps, start_step, every=cfg.log_every, tokens_per_step=meter.tokens_per_step,
                            enabled=rank0)
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
            utilization = self._mfu(meter.add(record, seconds, compiled=compiles))
            if utilization is not None:
                record["mfu"] = utilization
            progress.update(done, record, utilization)
            if is_last and cfg.save_checkpoints:  # before the final evaluation, which could fail
                self._save(done, record)
            if (cfg.eval_every and done % cfg.eval_every == 0) or is_last:
                final = self._evaluate(record, progress)
            self.metrics.log(record)
            if int(self.data.loader.epoch) > epoch and not is_last:
                self._summaries(f"epoch {int(self.data.loader.epoch)}")
            if cfg.save_checkpoints and cfg.save_every and done % cfg.save_every == 0 and not is_last:
                self._save(done)
        progress.close()
        self.fp8.finish()  # a calibration the run did not complete keeps the hybrid (recorded)
        if final is None or not math.isfinite(final[1]):  # resumed at the end, or the last step was skipped
            final = self.evaluator.all()
        result = self._result(meter, *final, wall_time_s=time.perf_counter() - t_start)
        if rank0:
            result.write(self.run_dir)
            self.metrics.trackers.record_result(result.to_dict())
            if cfg.plot and (problem := plot_after_run(self.run_dir, meter.tokens_per_step)):
                self._fallback(problem)  # the run's results stand: recorded, not raised
                result.fallbacks = self.all_fallbacks()
                result.write(self.run_dir)
        return result

    def _start_files(self) -> list[dict[str, Any]]:
        """Before the first step: rank 0 saves a new run's tokenizer and begins the records
        (MetricsLog.begin: metrics.jsonl cut back, the trackers, this start's record); every
        rank learns the run's starts. Returns the records kept (the run's history)."""
        cfg, this, history = self.config, self.checkpoints.start_record(self.resumed), []
        if self.dist.rank == 0:
            if self.resumed is None:  # a new run replaces a tokenizer of its own only with --overwrite
                self.data.tokenizer.save(self.run_dir / "tokenizer", overwrite=cfg.overwrite)
                write_sources(self.data.sources, self.run_dir)  # what a resume must find unchanged
            history = self.metrics.begin(this, log=cfg.log, config=cfg.to_dict(),
                                         resumed_record=self.resumed.meta.get("record") if self.resumed else None)
        self.starts = distributed.broadcast_object([r for r in history if r.get("event") == START_EVENT] + [this])
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
        return stopped(signum, what, newest_checkpoint(getattr(self, "checkpoints", None)), resume_command(self.config),
                       saved=saved, saving=self.config.save_checkpoints)

    def _save(self, step: int, record: dict[str, Any] | None = None) -> None:
        """A checkpoint of `step` (checkpoint.Checkpointer.save) holding this loop's state too:
        the data position, the tokenizer's fingerprint, FP8's and the guard's state and `record`, the step's
        metrics line when it is logged after the save (the last step's, which waits for the final
        evaluation), so that a resume can log it if the run died in between."""
        self.checkpoints.save(step, self.model, self.optimizer, {
            "data": self.data.loader.state_dict(), "tokenizer_fingerprint": self.data.tokenizer.fingerprint,
            # --fp8_mode auto's measured formats (a resumed run does not recalibrate) with
            # --fp8_auto_recheck_every's switches and pending disagreements, the converted layers
            **self.fp8.state_dict(), **self.guard.state_dict(), "record": record})
        self.saved_step = step

    def _evaluate(self, record: dict[str, Any], progress: Progress | None = None) -> tuple[float, float, float | None]:
        """An evaluation, added to `record` and printed: a step's, or without `progress` the
        starting point a fine-tune improves on (step 0, with the questions it scored)."""
        val_loss, val_bpb, val_accuracy = self.evaluator.all()
        record.update(val_loss=val_loss, val_bpb=val_bpb)
        if val_accuracy is not None:
            record["val_accuracy"] = val_accuracy
        questions = "" if progress else f" ({self.data.num_choice_items} questions, {self.data.accuracy_scoring})"
        (progress.write if progress is not None else print0)(
            f"step {record['step']}: val loss {val_loss:.4f}, val bpb {val_bpb:.4f}"
            + (f", val accuracy {val_accuracy:.4f}{questions}" if val_accuracy is not None else ""))
        return val_loss, val_bpb, val_accuracy

    def _summaries(self, label: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The per-epoch (and final) reports, printed and logged to metrics.jsonl: the step
        guard's, and FP8's with --fp8. Returns both (FP8's None without --fp8)."""
        guard = self.guard.summary()
        print0(self.guard.summary_text(label))
        self.metrics.log({"event": "guard_summary", "label": label, **guard})
        if not self.config.fp8:
            return guard, None
        fp8 = self.fp8.summary()
        print0(self.fp8.summary_text(fp8, label))
        self.metrics.log({"event": "fp8_summary", "label": label, **fp8})
        return guard, fp8

    # ---------------------------------------------------------------- report
    def _mfu(self, tokens_per_sec: float, *, fp8: bool = False) -> float | None:
        """MFU against the dense bf16 peak, or with `fp8` the FP8 peak (native FP8 layers only)."""
        native = self.fp8.report is not None and self.fp8.report.backend == "native" and bool(self.fp8.report.converted)
        return mfu.run_mfu(tokens_per_sec, self.flops_per_token, self.peak, self.dist.world_size, fp8=fp8,
                           native_fp8=native)

    def _result(self, meter: Throughput, val_loss: float, val_bpb: float, val_accuracy: float | None, *,
                wall_time_s: float) -> TrainResult:
        """The run's TrainResult. Prints and logs the final summaries and generates the
        samples first."""
        cfg, report = self.config, self.fp8.report
        guard_stats, fp8_stats = self._summaries("end of training")
        return TrainResult(
            train_loss=meter.train_loss, val_loss=val_loss, val_bpb=val_bpb, val_accuracy=val_accuracy,
            tokens_per_sec=meter.tokens_per_sec, wall_time_s=wall_time_s, steps=self.total_steps,
            epochs=self.data.loader.epoch, compile_time_s=meter.compile_time_s,
            fallbacks=self.all_fallbacks(), optimizer_state_bytes=self.optimizer_state_bytes,
            num_params=self.num_params,
            fp8_backend=report.backend if report is not None else "off",
            fp8_converted=list(report.converted) if report is not None else [],
            fp8_skipped={n: flag_text(why) for n, why in report.skipped.items()} if report is not None else {},
            fp8_decisions={n: flag_text(why) for n, why in report.decisions.items()} if report is not None else {},
            fp8_measure_time_s=report.measure_time_s if report is not None else 0.0,
            fp8_choices=self.fp8.choices, fp8_stats=fp8_stats, guard_stats=guard_stats,
            accuracy_scoring=self.data.accuracy_scoring,
            samples=self.evaluator.samples(cfg.num_samples) if cfg.num_samples else [],
            run_dir=str(self.run_dir), parallel=self.parallel,
            state_bytes_per_param=self.held.total / max(1, self.local_params),
            state_bytes=self.held.as_dict(), planned_memory_bytes=self.memory_plan.total,
            peak_memory_bytes=torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None,
            flops_per_token=self.flops_per_token, peak_tflops=None if self.peak is None else self.peak.bf16_tflops,
            mfu=self._mfu(meter.tokens_per_sec), mfu_fp8=self._mfu(meter.tokens_per_sec, fp8=True),
            starts=self.starts, restarts=len(self.starts) - 1,
        )


__all__ = ["NanoChatTrainer", "TrainResult", "lr_multiplier"]
