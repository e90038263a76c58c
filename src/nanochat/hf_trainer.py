"""FP8Trainer: nanochat's FP8 training inside the Hugging Face `transformers.Trainer`.

    trainer = FP8Trainer(model=model, args=TrainingArguments(...), train_dataset=data,
                         fp8_config=FP8Config(mode="auto", opt_level=2), master_weights="bf16_sr")
    trainer.train()                      # or train(resume_from_checkpoint=True)
    print(trainer.fp8.summary_text(trainer.fp8.summary(), "end of training"))

It is the Trainer, with one FP8Training (nanochat.fp8) and one StepGuard (nanochat.train.guard)
called at the Trainer's own points: `__init__` casts bf16 master weights and converts the model
before the Trainer wraps or compiles it; `create_optimizer` wraps the Trainer's optimizer in
FP8Optim (or OptimWrapper for bf16 master weights alone: the same param_groups, so the scheduler
drives both); `training_step` opens the FP8 step at an optimizer step's first micro-batch and
closes it after the last backward (where the guard checks the step), running calibration and
statistics steps eagerly (`torch.compiler.set_stance("force_eager")`); `log()` carries FP8
health to every `report_to` tracker; checkpoints hold `fp8_state.json`; evaluation runs in high
precision. `save_fp8` writes an FP8 checkpoint for vLLM, SGLang and transformers
(nanochat.model.hf_fp8). SIGTERM or Ctrl-C (nanochat.train.stop) saves checkpoint-N after the
step in flight and raises `Stopped` (exit status 143 / 130), on every rank after the same step.

A step whose loss or gradient norm is not finite is skipped before the Trainer clips: its
gradients are dropped (the optimizer step updates nothing), the layer where it began is named,
and `max_bad_steps` such steps in a row stop training. The Trainer still counts the step and
advances the schedule, so the learning rate stays a function of the step number. docs/hf.md
compares this with accelerate's torchao FP8 path. This module imports transformers;
nanochat.fp8 does not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from nanochat.checkpoint.resume import setting_differences
from nanochat.common import logger, print_last_line, warn_once
from nanochat.device import host_read_all
from nanochat.fp8 import FP8Config, FP8Training
from nanochat.config.fp8 import RESUME_FIELDS, ROLES
from nanochat.fp8.health import fp8_health
from nanochat.fs import publish_directory, write_atomic
from nanochat.train.guard import StepGuard
from nanochat.model.export import check_export_dir
from nanochat.model.hf_fp8 import SQNR_FLOOR_DB, Quantize, quantize_checkpoint, require_compressed_tensors
from nanochat.optim import MASTER_WEIGHTS, MasterWeights, MuonAdamW, muon_param_groups, param_dtype
from nanochat.train.stop import StopNow, StopSignals, Stopped, signal_name, stop_line

FP8_STATE_NAME = "fp8_state.json"
"""FP8Training.state_dict() (statistics samples, auto's choices), the step guard's counts and the
FP8 settings, in each checkpoint."""

SUPPORTED_OPTIMIZERS = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)  # what nanochat.optim wraps


class _EndStep(TrainerCallback):
    """FP8Training.end_step right after the optimizer step (before the scheduler and zero_grad)."""

    def __init__(self, trainer: "FP8Trainer"):
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._end_step()


class _StopOnSignal(TrainerCallback):
    """The Trainer's own way to stop: after a step with a stop pending (nanochat.train.stop), save a
    checkpoint and end the loop. Marks the step in flight, where a first signal waits."""

    def __init__(self, stop: StopSignals):
        self.stop = stop

    def on_step_begin(self, args, state, control, **kwargs):
        self.stop.step = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        if self.stop.pending() is not None:
            self.stop.step = None  # what follows is the stop's save
            control.should_save = control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        self.stop.step = None


class FP8Trainer(Trainer):
    """A transformers.Trainer that trains in FP8 (see the module docstring).

    Args beyond the Trainer's (all keyword-only):
        fp8_config: what FP8Training does (formats, `auto`, moments, statistics); FP8Config() if None.
        master_weights: "fp32" (the parameters are the masters), or "bf16" / "bf16_sr" /
            "bf16_split": the parameters are cast to bf16 here and the optimizer wrapper writes
            each update into them (docs/master_weights.md). TrainingArguments.seed seeds bf16_sr.
        max_bad_steps: consecutive steps with a non-finite loss or gradient norm (each skipped)
            that stop training (the step guard's limit, nanochat.train.guard).
        optimizer: "adamw" (the Trainer's own optimizer, TrainingArguments.optim), or "muon":
            Muon for the hidden matrices (nanochat.optim.muon_param_groups) at `muon_lr` and
            `muon_momentum`, AdamW with TrainingArguments' lr, betas, eps and weight decay for
            the rest; TrainingArguments.weight_decay decays Muon's matrices too, master_weights
            applies to both, and fp8_config.opt_level 1 or 2 keeps Muon's momentum in FP8.
        log_layers_every: per-layer FP8 figures on every N-th statistics sample (0: never); the
            per-role worst and mean come with every sample. A Llama-3-8B has 224 FP8 layers, so
            2,016 per-layer scalars a sample, which the progress bar prints, every tracker stores
            and trainer_state.json keeps in each checkpoint: 5 (every 1000 steps at the default
            `stats_every` 200) keeps that small.
    """

    def __init__(self, *args, fp8_config: FP8Config | None = None, master_weights: MasterWeights = "fp32",
                 optimizer: str = "adamw", muon_lr: float = 0.02, muon_momentum: float = 0.95,
                 log_layers_every: int = 5, max_bad_steps: int = 10, **kwargs):
        config = fp8_config if fp8_config is not None else FP8Config()
        if not isinstance(config, FP8Config):
            raise TypeError(f"fp8_config must be a nanochat.fp8.FP8Config, got {type(config).__name__}")
        if master_weights not in MASTER_WEIGHTS:
            raise ValueError(f"master_weights must be one of {', '.join(MASTER_WEIGHTS)}, got {master_weights!r}")
        if optimizer not in ("adamw", "muon"):
            raise ValueError(f"optimizer must be 'adamw' or 'muon', got {optimizer!r}")
        if not (0 < muon_lr < 1 and 0 <= muon_momentum < 1):
            raise ValueError(f"muon_lr must be in (0, 1) and muon_momentum in [0, 1), got {muon_lr}, {muon_momentum}")
        self.muon = (muon_lr, muon_momentum) if optimizer == "muon" else None
        """Muon's (lr, momentum) when optimizer='muon', else None."""
        if log_layers_every < 0:
            raise ValueError(f"log_layers_every must be >= 0 (0: per-role figures only), got {log_layers_every}")
        super().__init__(*args, **kwargs)
        self._check_setup(config, master_weights)
        self.master_weights = master_weights
        self.log_layers_every = log_layers_every
        if master_weights != "fp32":  # parameters only: buffers (rotary tables) keep their dtype
            for p in self.model.parameters():
                p.data = p.data.to(param_dtype(master_weights))
        self.fp8 = FP8Training(self.model, config)
        """FP8's side of training: the conversion report, counters, auto's choices, statistics."""
        self.guard = StepGuard(self.model, max_bad_steps=max_bad_steps)
        """Skips a step whose loss or gradient norm is not finite; counts it (and the clips)."""
        if self.fp8.report is not None:
            logger.info("%s", self.fp8.report.summary())
        self._step = None  # the FP8 step open across an optimizer step's micro-batches
        self._step_loss: torch.Tensor | None = None
        self._skipped = False
        self._samples = 0
        self._pending_logs: dict[str, float] = {}
        self.stop = StopSignals()
        """SIGTERM and Ctrl-C while training: a checkpoint after the step in flight, then Stopped."""
        self.add_callback(_EndStep(self))
        self.add_callback(_StopOnSignal(self.stop))

    def _check_setup(self, config: FP8Config, master_weights: str) -> None:
        """Refuse, before the model is touched, what this trainer cannot run as asked."""
        args = self.args
        if self.model_init is not None:
            raise ValueError("FP8Trainer converts the model it is given once; model_init (a new model per "
                             "train() or trial) is not supported: pass model=")
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError("FP8Trainer runs in one process or under DDP; DeepSpeed and FSDP wrap the model and "
                             "optimizer in ways it does not follow: drop them from TrainingArguments")
        if config.enabled and self.accelerator.mixed_precision == "fp8":
            raise ValueError("accelerate's own FP8 (ACCELERATE_MIXED_PRECISION=fp8 or `accelerate launch "
                             "--mixed_precision fp8`) would convert the model a second time: unset it, "
                             "FP8Trainer converts the model itself")
        if config.enabled and args.fp16:
            raise ValueError("FP8 layers support bf16 autocast only (fp16 outputs overflow at 65504 with no "
                             "loss scaling): use bf16=True on CUDA or leave both off")
        if config.enabled and args.bf16 and args.device.type != "cuda":
            raise ValueError(f"bf16=True on {args.device.type}: torchao's FP8 layers handle CUDA autocast only; "
                             "train in fp32 (bf16=False), or use master_weights='bf16_sr' for bf16 parameters")
        if (config.enabled or master_weights != "fp32") and self.muon is None:
            kind = self._optimizer_class()
            if kind not in SUPPORTED_OPTIMIZERS:
                raise ValueError(f"FP8 moments and bf16 master weights wrap torch.optim.AdamW, Adam or "
                                 f"SGD; this Trainer would build {kind.__module__}.{kind.__qualname__}: use "
                                 "TrainingArguments(optim='adamw_torch') or 'adamw_torch_fused'")

    def _optimizer_class(self) -> type:
        if self.optimizer is not None:
            return type(self.optimizer)
        if self.optimizer_cls_and_kwargs is not None:
            return self.optimizer_cls_and_kwargs[0]
        return self.get_optimizer_cls_and_kwargs(self.args, self.model)[0]

    # ------------------------------------------------------------------ optimizer
    def _muon_adamw(self, model=None) -> MuonAdamW:
        """optimizer='muon': MuonAdamW over the model's split, AdamW with TrainingArguments' settings."""
        if self.optimizer is None:
            args, (lr, momentum) = self.args, self.muon
            split = muon_param_groups(model if model is not None else self.model)
            adamw = torch.optim.AdamW(split.adamw, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                      eps=args.adam_epsilon, weight_decay=args.weight_decay)
            self.optimizer = MuonAdamW(torch.optim.Muon(split.muon, lr=lr, momentum=momentum, nesterov=True,
                                                        weight_decay=args.weight_decay),
                                       adamw, placements=split.placements)
        return self.optimizer

    def create_optimizer(self, model=None):
        """The Trainer's optimizer, wrapped once by FP8Training.wrap_optimizer (FP8Optim for FP8
        moments at `opt_level` 1-2, OptimWrapper for bf16 master weights alone); the scheduler the
        Trainer builds next drives the shared param_groups."""
        optimizer = super().create_optimizer(model) if self.muon is None else self._muon_adamw(model)
        if self.fp8.optimizer is None:  # a wrapper logs its layout (and fp32 moments) at its first step
            self.optimizer = self.fp8.wrap_optimizer(optimizer, master_weights=self.master_weights, seed=self.args.seed)
        return self.optimizer

    # ----------------------------------------------------------------------- step
    def training_step(self, model, inputs, num_items_in_batch=None):
        """One micro-batch; the FP8 step spans all micro-batches of an optimizer step."""
        if self._step is None:  # the first micro-batch of this optimizer step
            self._step = self.fp8.begin_step(self.state.global_step)
            self._step_loss = None
        step = self._step
        try:  # calibration and statistics hooks need the uncompiled code (hooks would recompile it)
            with step, (torch.compiler.set_stance("force_eager") if step.eager else contextlib.nullcontext()):
                loss = super().training_step(model, inputs, num_items_in_batch)
        except BaseException:
            self._step = None
            raise
        self._step_loss = loss if self._step_loss is None else self._step_loss + loss
        if self.accelerator.sync_gradients:  # the last micro-batch: the gradients are complete
            self._step = None
            record = step.record()  # the sampled statistics (every rank takes part)
            if "fp8_stats" in record:
                self._samples += 1
                layers = bool(self.log_layers_every) and self._samples % self.log_layers_every == 0
                self._add_logs(fp8_health(record["fp8_stats"], layers=layers))
            self._skipped = self._check_step(inputs, sampled="fp8_stats" in record)
        return loss

    def _check_step(self, inputs, *, sampled: bool) -> bool:
        """The step guard, before the Trainer clips: True when the step's loss or gradient norm
        (the norm the Trainer computes; both in one device read) is not finite and the update
        must be skipped (StepGuard has dropped the gradients and named the layer). Also counts
        a clip against `max_grad_norm`; the Trainer itself clips."""
        max_norm = self.args.max_grad_norm if self.args.max_grad_norm > 0 else math.inf

        def rerun() -> None:  # the last micro-batch's forward again, eagerly, to name where inf began
            with torch.compiler.set_stance("force_eager"):
                self.model(**self._prepare_inputs(inputs))

        # every rank's stop request (nanochat.train.stop), averaged over the ranks and read with the
        # loss: no host sync of its own, and every rank stops after the same step
        _, votes = self.stop.vote(self._step_loss.detach().float())
        reading = self.guard.measure(self.state.global_step, self._step_loss, self.model.parameters(),
                                     max_norm=max_norm, clip=False, rerun=rerun, note=self._checkpoint_note)
        guard_values, vote_values = host_read_all(reading.values, votes)
        verdict = reading.judge(guard_values)
        self.stop.decide(vote_values)
        if verdict.skipped:  # the Trainer would log the norm of the dropped gradients: 0
            self._add_logs({"grad_norm": verdict.grad_norm})
        if verdict.skipped or sampled:
            self._add_logs({"guard/skipped_steps": self.guard.counters["skipped_steps"],
                            "guard/clip_events": self.guard.counters["clip_events"]})
        return verdict.skipped

    def _checkpoint_note(self) -> str:
        last = get_last_checkpoint(self.args.output_dir) if os.path.isdir(self.args.output_dir) else None
        return f"The newest checkpoint is {last}" if last else f"No checkpoint was saved in {self.args.output_dir}"

    def _end_step(self) -> None:
        """After optimizer.step(): FP8Training.end_step, unless the step was skipped."""
        if self._skipped:
            return
        self.fp8.end_step(self.state.global_step)
        for event in self.fp8.pop_events():
            if event["event"] == "fp8_auto_choices":
                chosen = [r for roles in event["choices"].values() for r, d in roles.items() if d == "e5m2"]
                self._add_logs({f"fp8/auto_e5m2_layers/{r}": chosen.count(r) for r in ROLES})
            else:  # a re-check switched a role
                self._add_logs({"fp8/auto_switches": len(self.fp8.switches)})

    # -------------------------------------------------------------------- logging
    def _add_logs(self, scalars: dict[str, float]) -> None:
        """Carried by the next log(); the step that produced them is logged (should_log)."""
        if self.args.logging_strategy == "no":
            return
        self._pending_logs.update(scalars)
        self.control.should_log = True

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log, with the FP8 figures of this step when there are any."""
        if self._pending_logs:
            logs = {**logs, **self._pending_logs}
            self._pending_logs = {}
        super().log(logs, start_time)

    def train(self, *args, **kwargs):
        """The Trainer's train(); a calibration left unfinished is recorded, and every fallback
        taken (FP8 conversion, FP8Optim) is added to the returned metrics as `fp8_fallbacks`.
        Stopped by a signal: checkpoint-N saved by the Trainer, one line, `Stopped` raised."""
        with self.stop.handling():
            try:
                output = super().train(*args, **kwargs)
            except StopNow as e:  # no step to finish, or a second Ctrl-C
                raise self._stopped(e.signum, f"stopped at once {e.when}", saved=None) from None
            if (signum := self.stop.pending()) is not None and self.state.global_step < self.state.max_steps:
                step = self.state.global_step
                folder = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
                raise self._stopped(signum, f"stopped by {signal_name(signum)} at step {step}",
                                    saved=folder if os.path.isdir(folder) else None)
        self.fp8.finish()
        output.metrics["fp8_fallbacks"] = self.fp8.fallbacks
        return output

    def _stopped(self, signum: int, what: str, *, saved: str | None) -> Stopped:
        """The Stopped that ends training on `signum`, its line printed by the main process."""
        self.stop.ignore()
        newest = get_last_checkpoint(self.args.output_dir) if os.path.isdir(self.args.output_dir) else None
        checkpoint = saved or newest
        line = stop_line(what, saved=saved, newest=None if saved else newest,
                         resume=checkpoint and f"trainer.train(resume_from_checkpoint={checkpoint!r})")
        if self.is_world_process_zero():
            print_last_line(line)
        return Stopped(signum, line)

    def evaluation_loop(self, *args, **kwargs):
        """Evaluation (and predict) in high precision: the model's quality, not FP8's inference noise."""
        with self.fp8.high_precision():
            return super().evaluation_loop(*args, **kwargs)

    # ------------------------------------------------------------------- export
    @torch.no_grad()
    def save_fp8(self, output_dir: str | os.PathLike, *, quantize: Quantize = "fp8", quantize_all: bool = False,
                 sqnr_floor_db: float = SQNR_FLOOR_DB, overwrite: bool = False) -> Path:
        """The trained model as an FP8 checkpoint that vLLM, SGLang and transformers serve, as
        `scripts/export_hf.py --quantize` writes one (nanochat.model.hf_fp8): every Linear but the output
        embedding in e4m3 with fp32 scales (per output channel; `fp8_block`: per 128x128 block;
        `mxfp8`: e8m0 scales per 32 values),
        except the layers this run trained in high precision (the conversion report's skipped
        layers) and those under `sqnr_floor_db`, unless `quantize_all`; everything else in bf16;
        config.json, the generation config and the tokenizer (`processing_class`) beside it.
        `output_dir` must be new or empty, or `overwrite` (never the Trainer's own output_dir or
        the directory the model was loaded from); it is replaced whole once complete. Under DDP only
        the process that saves (`args.should_save`) writes; the others return at once."""
        if not self.args.should_save:
            return Path(output_dir)
        model = self.accelerator.unwrap_model(self.model)
        sources = [self.args.output_dir, getattr(model.config, "_name_or_path", None)]
        check_export_dir(output_dir, overwrite=overwrite,
                         sources=[s for s in sources if s and os.path.isdir(s)])
        require_compressed_tensors(f"FP8Trainer.save_fp8(quantize={quantize!r})")
        tensors, seen = {}, set()
        for name, t in model.state_dict().items():  # a tied output embedding is stored once, as the input one
            if t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            tensors[name] = t.detach().cpu().contiguous()
        head = model.get_output_embeddings()
        head_name = next((n for n, m in model.named_modules() if m is head), "lm_head")
        linears = [n for n, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and m is not head and f"{n}.weight" in tensors]
        report = self.fp8.report
        keep = {n: f"trained in high precision: {why}" for n, why in (report.skipped if report else {}).items()
                if n in linears}
        fp8 = quantize_checkpoint(tensors, linears, quantize=quantize, keep=keep, quantize_all=quantize_all,
                                  floor_db=sqnr_floor_db, output_embedding=head_name)
        logger.info("fp8 export, per layer:\n%s\n%s", fp8.table(), fp8.summary())
        config = {k: v for k, v in model.config.to_dict().items() if k not in ("quantization_config", "torch_dtype")}
        config["dtype"] = "bfloat16"  # what the unquantized tensors are stored in

        def fill(tmp: Path) -> None:
            save_file(fp8.tensors, tmp / "model.safetensors", metadata={"format": "pt"})
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            fp8.write(tmp)
            if getattr(model, "generation_config", None) is not None and model.can_generate():
                model.generation_config.save_pretrained(tmp)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(tmp)

        return publish_directory(output_dir, fill)

    # ---------------------------------------------------------------- checkpoints
    def _fp8_state(self) -> dict[str, Any]:
        return {"fp8_config": json.loads(json.dumps(dataclasses.asdict(self.fp8.config))),
                "master_weights": self.master_weights, **self.fp8.state_dict(), **self.guard.state_dict()}

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint plus fp8_state.json (written first, atomically)."""
        if self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial),
                                  f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")  # the Trainer's name
            write_atomic(os.path.join(folder, FP8_STATE_NAME), json.dumps(self._fp8_state(), indent=1))
        super()._save_checkpoint(model, trial)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """The Trainer's weights, then the FP8 state: auto's formats are applied here, before the
        optimizer is built and its state loaded, and before the model is compiled."""
        path = os.path.join(resume_from_checkpoint, FP8_STATE_NAME)
        state = None
        if os.path.isfile(path):
            with open(path) as f:
                state = json.load(f)
            self._check_resume(state, resume_from_checkpoint)
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        if state is not None:
            self.fp8.load_state_dict(state)
            self.guard.load_state_dict(state)
        elif self.fp8.config.enabled:
            message = (f"{resume_from_checkpoint} has no {FP8_STATE_NAME} (not saved by FP8Trainer): the step "
                       "guard's and FP8's counts start from 0"
                       + (" and `mode` auto calibrates again" if self.fp8.config.mode == "auto" else ""))
            warn_once(f"fp8-resume:{resume_from_checkpoint}", message)
            self.fp8.add_fallback(message)

    def _check_resume(self, state: dict[str, Any], checkpoint: str) -> None:
        saved = {**(state.get("fp8_config") or {}), "master_weights": state.get("master_weights")}
        now = {**self._fp8_state()["fp8_config"], "master_weights": self.master_weights}
        diff = setting_differences(saved, now, (*RESUME_FIELDS, "master_weights"))
        differ = [f"{k} {a!r} -> {b!r}" for k, (a, b) in diff.items()]
        if differ:
            raise ValueError(f"{checkpoint} was trained with other FP8 settings ({'; '.join(differ)}): resume "
                             "with the checkpoint's settings, or start a new run from its weights")


__all__ = ["FP8Trainer", "fp8_health"]
