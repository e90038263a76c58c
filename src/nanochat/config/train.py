"""TrainConfig: every flag of a training run, `scripts/base_train.py`'s CLI and
`NanoChatTrainer(**kwargs)`'s keyword arguments, in one frozen dataclass.

It inherits the shared field groups (nanochat.config.fields: FP8, model, data, batches, schedule,
device) and adds what only training has: the optimizer, checkpoints and resume, logging, sampling
and the memory switches. Checkpoints store it as a plain dict (`to_dict`), so a run is resumed and
inspected without unpickling anything; `RESUME_MUST_MATCH` (what a --resume must share with its
checkpoint) is read off the fields marked `kept`. Values are checked here, at construction; what
a value means for the machine or the files (a device, a path) is checked at start-up
(nanochat.train.preflight).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Literal

from nanochat.config.checks import RESUME, finite, kept, non_negative, positive
from nanochat.config.fields import (
    BatchFields, DataFields, DeviceFields, FP8Fields, ModelFields, ScheduleFields, ScriptFields, flag_text, is_preset,
)

MUON_MOMENTUM = 0.95
"""Muon's default momentum: torch.optim.Muon's and karpathy/nanochat's."""

MUON_RATES = ("muon_lr", "embedding_lr", "head_lr")
"""The Muon recipe's per-group peak rates: None derives each from the run's width and batch
(nanochat.optim.recipe)."""
MUON_ADDITIONS = ("muon_momentum_warmup", "muon_normuon")
"""Muon's settings beyond torch.optim.Muon's constructor: set away from their defaults, they need Muon."""

LogChoice = Literal["jsonl", "tensorboard", "wandb"]
"""A `--log` choice (TrainConfig.log): metrics.jsonl, always written, and the trackers
nanochat.report.trackers adds (TensorBoard, W&B)."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig(ScriptFields, DeviceFields, ScheduleFields, BatchFields, DataFields,  # type: ignore[misc]
                  ModelFields, FP8Fields):
    """Train (or continue training) a GPT on a corpus. `scripts/base_train.py`."""

    # --help lists the groups' flags last base first (FP8, model, data, batches, schedule,
    # device, --debug), then these

    tokenizer_dir: str | None = kept(None)
    """A tokenizer saved by scripts/tok_train.py. Default: train one on the corpus (cached)."""

    grad_accum_steps: int = kept(1)
    """Forward/backward passes per optimizer step (effective batch = batch_size * this * ranks)."""

    num_epochs: int = 1
    """Full passes over the training tokens (ignored when --num_iterations is set)."""

    final_lr_frac: float = 0.1
    """Each group's learning rate decays (cosine) from its peak to this fraction of it at the last step."""

    optimizer: Literal["auto", "adamw", "muon"] = kept("auto")
    """auto: muon for a size preset (d2 ... d26), adamw for a Hugging Face model (the run records
    which). adamw: AdamW for every parameter. muon: Muon (torch.optim.Muon: momentum orthogonalized
    by Newton-Schulz) for the hidden matrices, the attention and MLP projections, at --muon_lr;
    AdamW for the embeddings (--embedding_lr), the output head (--head_lr), norms and biases (--lr)
    (the run's header lists where each tensor went); at d4 it reaches AdamW's loss in half the steps (BENCHMARKS.md).
    --fp8_opt_level 1 or 2 keeps Muon's momentum in FP8 (~1.02 bytes a parameter instead of 4).
    One process, DDP, --fsdp or --tp (a split matrix is all-gathered whole for Newton-Schulz, its
    momentum stays split). bf16 --master_weights and --optimizer_in_backward work as with AdamW (a
    matrix steps in its hook once its gradient is whole). docs/muon.md"""

    muon_lr: float | None = None
    """Peak learning rate of Muon's matrices (--optimizer muon), on the same warmup and decay as
    --lr; scaled per matrix by sqrt(max(1, rows / columns)) as torch.optim.Muon does. None: the
    recipe's, from the tokens a step (nanochat.optim.recipe; docs/muon.md)."""

    embedding_lr: float | None = None
    """--optimizer muon: peak AdamW rate of the token embedding. None: the recipe's, from the
    width and the tokens a step (nanochat.optim.recipe; docs/muon.md)."""

    head_lr: float | None = None
    """--optimizer muon: peak AdamW rate of the output head. None: the recipe's, from the width and
    the tokens a step (nanochat.optim.recipe; docs/muon.md). Norms and biases train at --lr."""

    muon_momentum: float | None = None
    """Muon's momentum (Nesterov), --optimizer muon. None means 0.95."""

    muon_momentum_warmup: int = 100
    """Muon's momentum rises linearly from 0.85 to --muon_momentum over the first N steps; 0:
    constant. At d4 (250 steps, 3 seeds) 100 steps ended 0.44-0.60% lower in val bpb than none
    (BENCHMARKS.md); karpathy/nanochat ramps over 400 steps of its far longer runs."""

    muon_normuon: bool = kept(False)
    """NorMuon (arXiv 2510.05491): each neuron's orthogonalized update divided by the root of an
    EMA of its mean square (beta2 0.9), then rescaled to the update's norm, so every neuron moves
    alike. One fp32 value per neuron of state. At d4 0.41-0.59% lower val bpb (with the momentum
    warmup: 0.86-1.01%; BENCHMARKS.md). One process and DDP; not with --fsdp or --tp (a shard
    holds part of a neuron's row or column)."""

    weight_decay: float | None = None
    """Decoupled weight decay for matrices, AdamW's and Muon's (norms, biases and embeddings get
    none). None: 0.1, and for a Muon run that repeats its data enough to memorize it the recipe's,
    1 / (Muon's rate x steps an epoch) (nanochat.optim.recipe; docs/muon.md)."""

    beta1: float = 0.9
    """Adam beta1."""

    beta2: float = 0.95
    """Adam beta2."""

    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 turns clipping off."""

    max_bad_steps: int = 10
    """Stop the run after this many consecutive steps with a non-finite loss or gradient (each
    such step is skipped, its layer named); the last good checkpoint stays intact. The step
    guard's limit (nanochat.train.guard), with or without FP8."""

    save_every: int = 200
    """Write a checkpoint every N steps (and at the end); 0: only at the end."""

    save_checkpoints: bool = True
    """Write checkpoints (every --save_every steps and at the end). --no_save_checkpoints writes
    none, for benchmarks (a d26 checkpoint is ~10 GB, hashed and synced to disk): such a run
    cannot be resumed, continued with --init_from or exported; metrics.jsonl, result.json and
    the tokenizer are still written."""

    log: tuple[LogChoice, ...] = ("jsonl",)
    """Where the run's metrics go. metrics.jsonl is always written (resume and plot_run read it);
    `tensorboard` adds <run_dir>/tensorboard/ (pip install -e '.[tensorboard]'), `wandb` a W&B run
    that follows W&B's own settings: WANDB_MODE, WANDB_PROJECT (default nanochat), ... (pip install
    -e '.[wandb]'). A resume continues both. docs/trackers.md"""

    log_every: int = 10
    """Where stdout is not a terminal (nohup, slurm, a pipe, a file): one plain line (step, loss,
    lr, tokens/s, MFU, ETA) every N steps and at the last, instead of a progress bar that would
    fill the log with refreshes. On a terminal the bar shows every step."""

    update_rms_every: int = 50
    """Every N steps and at the last, record the RMS of the optimizer's update per param group
    (update_rms_muon, update_rms_adamw, update_rms_adamw_no_decay in metrics.jsonl; train/ in
    TensorBoard and W&B): what each group's learning rate does. A sampled step holds a copy of
    the trained weights until its update is done. 0: never."""

    plot: bool = False
    """At the end of the run, draw <run_dir>/run.png: loss and validation bpb against tokens,
    tokens/s, MFU and the FP8 health map (what scripts/plot_run.py draws; pip install -e '.[plots]')."""

    run_dir: str = "runs/default"
    """Where checkpoints, metrics.jsonl and the tokenizer cache of this run go. A directory that
    already holds a run is never reused silently: continue it with --resume or replace it with
    --overwrite."""

    resume: bool = False
    """Continue from the newest checkpoint in --run_dir (model, optimizer, step, RNG, data
    position); it is verified against its checksum first. A finished run, or one already past
    --num_iterations, is refused: pass a larger --num_iterations to train on."""

    overwrite: bool = False
    """Start a fresh run in a --run_dir that already holds one: deletes its checkpoints,
    metrics.jsonl and result.json first (a checkpoint nanochat cannot tell it wrote, e.g. one
    without its manifest, is refused, never deleted). Without it (or --resume) such a directory
    is refused."""

    auto_resume: bool = False
    """What a job that may be restarted passes (torchrun --max-restarts, slurm --requeue): the
    same command line continues the run in --run_dir from its newest checkpoint when it holds
    this run, starts it when it holds none (from step 0 when this run died before its first
    checkpoint), says so and exits 0 when the run had finished, and refuses a different run (a
    flag --resume must keep differs). It never deletes anything. docs/distributed.md"""

    keep_checkpoints: int = 2
    """Keep the newest N checkpoints (DCP step directories in distributed runs; older ones are
    deleted after each save), so a damaged newest checkpoint still leaves one to resume from."""

    seed: int = kept(1337)
    """Seed for weights, data order and sampling."""

    compile: bool = True
    """torch.compile the training model (after FP8 conversion); --no_compile runs eagerly.
    torchao's FP8 layers are fast only compiled (eager casts run as separate kernels). If
    compiling fails (no C++ compiler for CPU code, an unsupported backend) the run warns once,
    trains eagerly and records the fallback. Compile time is reported on its own, not in tokens/s."""

    compile_scope: Literal["model", "blocks"] = "model"
    """What --compile compiles: the whole model as one graph, or each transformer block (one
    graph that every block reuses: compile time stops growing with depth). Per block compiles
    faster but trains slower (the embedding, head and loss run eagerly: 13% fewer tokens/s at
    d12 on an H200) and, with FP8, may recompile once per block; hence model."""

    fsdp: bool = False
    """Under torchrun: shard parameters with FSDP2 (fully_shard) instead of DDP."""

    tp: int = 1
    """Under torchrun: tensor parallelism over groups of this many consecutive ranks (keep a group
    within a node): each block's attention and MLP split over the group (docs/distributed.md).
    The world size must be a multiple; more than one group needs --fsdp over the groups. The
    heads, the key/value heads and the MLP's hidden features must divide by it."""

    num_samples: int = 3
    """Samples generated at the end of training (0: none)."""

    sample_tokens: int = 64
    """Tokens per generated sample."""

    temperature: float = 0.8
    """Sampling temperature (0: greedy)."""

    top_k: int = 50
    """Sample from the k most likely tokens (0: all)."""

    chat_template: str | None = None
    """How instruction records are rendered for a Hugging Face model: a built-in format (plain:
    prompt and answer joined, for base models; chatml; llama3) or a Jinja file. Default: the
    model's own chat template, or plain when it has none (logged, recorded as a fallback)."""

    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward pass instead of keeping
    them (torch.utils.checkpoint per block): activation memory drops to one block input per
    layer, at the cost of a second forward pass through every block."""

    master_weights: Literal["fp32", "bf16", "bf16_sr", "bf16_split"] = kept("fp32")
    """How parameters are stored and updated: fp32 (4 bytes a parameter, gradients 4); or in
    bf16 (2 + 2) with the fp32 update written by round to nearest (bf16: small updates are
    lost), stochastic rounding (bf16_sr: seeded by --seed, unbiased) or kept exactly with a
    16-bit remainder in the optimizer state (bf16_split: 2 more bytes). With --fp8_opt_level 2:
    ~6 bytes a parameter of training state (bf16_split ~8) instead of ~10; --optimizer muon
    alike, its matrices' one moment ~1.02 bytes. docs/master_weights.md."""

    master_weights_emulate: bool = kept(False)
    """With a bf16 --master_weights: keep the parameters as fp32 tensors holding bf16 values and
    round gradients to bf16 in the update, so the model computes in fp32 with bf16 master-weight
    numerics. For CPUs without fast bf16 matmuls (parity studies); saves no memory."""

    optimizer_in_backward: bool = False
    """Step each parameter inside the backward as soon as its gradient is ready and free that
    gradient: the gradients' memory is gone. Needs --grad_accum_steps 1 and --grad_clip 0 (there
    is no global norm before the last gradient); not under torchrun (DDP/FSDP reduce gradients
    after these steps). A parameter whose gradient is not finite is left unchanged. With
    --optimizer muon a matrix steps in its hook, its gradient being whole there."""

    def __post_init__(self) -> None:
        super().__post_init__()  # the groups' checks
        finite(self, "final_lr_frac", "weight_decay", "beta1", "beta2", "grad_clip", "temperature")
        if self.resume and self.overwrite:
            raise ValueError("--resume continues the run in --run_dir, --overwrite deletes it: give one")
        if self.auto_resume and (self.resume or self.overwrite):
            other = "--resume" if self.resume else "--overwrite"
            raise ValueError(f"--auto_resume decides by itself whether to continue the run in --run_dir; {other} "
                             f"{'forces that' if self.resume else 'deletes it'}: give one")
        if self.init_from is not None:
            if self.tokenizer_dir is not None:
                raise ValueError("--init_from brings the tokenizer its run was trained with (the embeddings "
                                 "know its token ids): drop --tokenizer_dir")
            if os.path.realpath(self.init_from) == os.path.realpath(self.run_dir):
                raise ValueError(f"--init_from {self.init_from} is also --run_dir: a new run would clobber the "
                                 "run it starts from. Give another --run_dir (or --resume to continue that run)")
        if self.keep_checkpoints < 1:
            raise ValueError(f"--keep_checkpoints must be >= 1 (the newest checkpoint), got {self.keep_checkpoints}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"--{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.run_dir.strip():
            raise ValueError("--run_dir is empty; give a directory, e.g. --run_dir runs/my_run")
        fp8 = self.fp8_config()  # the FP8 flags' own checks (FP8Config's)...
        try:  # ...and those of the tokens per forward pass, which the trainer sets
            dataclasses.replace(fp8, micro_batch_tokens=self.batch_size * self.seq_len)
        except ValueError as e:
            raise ValueError(flag_text(str(e))) from None
        if self.max_bad_steps < 1:
            raise ValueError(f"--max_bad_steps must be >= 1, got {self.max_bad_steps}")
        positive(self, "grad_accum_steps", "log_every", "tp")
        if self.tp > 1 and self.fp8 and self.fp8_recipe.startswith("mxfp8"):
            raise ValueError(f"--tp {self.tp} with --fp8_recipe {self.fp8_recipe}: torchao's MXFP8 layers have no "
                             "tensor-parallel styles (their block scales would span the split); use --fp8_recipe "
                             "tensorwise or rowwise with --tp, or mxfp8 with --fsdp alone")
        non_negative(self, "save_every", "grad_clip", "num_samples", "sample_tokens", "top_k", "weight_decay",
                      "temperature", "update_rms_every", "muon_momentum_warmup")
        if self.num_iterations == -1 and self.num_epochs < 1:
            raise ValueError(f"--num_epochs must be >= 1, got {self.num_epochs}")
        if not 0 <= self.final_lr_frac <= 1:
            raise ValueError(f"--final_lr_frac must be in [0, 1], got {self.final_lr_frac}")
        self._check_optimizer()

    @property
    def muon_beta(self) -> float:
        """--muon_momentum with its default filled in."""
        return MUON_MOMENTUM if self.muon_momentum is None else self.muon_momentum

    def _check_optimizer(self) -> None:
        if self.optimizer == "auto":  # the field holds what runs, so config.json and --resume see it
            object.__setattr__(self, "optimizer", "muon" if is_preset(self.model_name) else "adamw")
        muon_flags = [f"--{name}" for name in (*MUON_RATES, "muon_momentum") if getattr(self, name) is not None]
        muon_flags += [f"--{f.name}" for f in dataclasses.fields(self) if f.name in MUON_ADDITIONS
                       and getattr(self, f.name) != f.default]
        if self.optimizer != "muon" and muon_flags:
            raise ValueError(f"{' and '.join(muon_flags)} set Muon's hyperparameters, but --optimizer is "
                             f"{self.optimizer}: pass --optimizer muon, or drop {' and '.join(muon_flags)}")
        if self.optimizer == "muon":
            for name in MUON_RATES:
                lr = getattr(self, name)
                if lr is not None and not (math.isfinite(lr) and 0 < lr < 1):
                    raise ValueError(f"--{name} must be in (0, 1), got {lr}")
            momentum = self.muon_beta
            if not (math.isfinite(momentum) and 0 <= momentum < 1):
                raise ValueError(f"--muon_momentum must be in [0, 1), got {momentum}")
        if self.master_weights_emulate and self.master_weights == "fp32":
            raise ValueError("--master_weights_emulate emulates bf16 master weights: give --master_weights bf16, "
                             "bf16_sr or bf16_split with it")
        problem = self.in_backward_problem()
        if problem is not None:
            raise ValueError(problem)

    def in_backward_problem(self, torchrun: str | None = None) -> str | None:
        """Why --optimizer_in_backward cannot run with these settings, or under torchrun with the
        process layout `torchrun` (e.g. "ddp x2 (gloo)"; the trainer asks once the processes
        exist), else None. It steps each parameter inside the backward, so there is one
        micro-batch, no global gradient norm, and no gradient reduction after the steps."""
        if not self.optimizer_in_backward:
            return None
        if self.grad_accum_steps > 1:
            return (f"--optimizer_in_backward steps at every backward, so it cannot accumulate "
                    f"{self.grad_accum_steps} micro-batches: use --grad_accum_steps 1 (a larger "
                    "--batch_size, or activation checkpointing to afford one), or drop --optimizer_in_backward")
        if self.grad_clip > 0:
            return (f"--optimizer_in_backward steps each parameter before the global gradient norm "
                    f"exists, so --grad_clip {self.grad_clip:g} cannot be applied: pass --grad_clip 0, "
                    "or drop --optimizer_in_backward")
        if torchrun is not None:
            return (f"--optimizer_in_backward under torchrun ({torchrun}): DDP and FSDP reduce gradients "
                    "after the per-parameter steps would have run; train in one process or drop "
                    "--optimizer_in_backward")
        return None

    def to_dict(self) -> dict:
        """Plain dict (JSON- and weights_only-safe) for checkpoints and metrics."""
        d = dataclasses.asdict(self)
        d["fp8_skip"], d["log"] = list(self.fp8_skip), list(self.log)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """Inverse of to_dict; unknown keys (from a newer version) are an error naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"config has fields this version does not know: {unknown}")
        return cls(**d)


RESUME_MUST_MATCH = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata == RESUME)
"""The flags a --resume must share with its checkpoint (the fields marked `_kept`): they change
the model, the data stream or the optimizer's meaning. Everything else (--num_iterations,
--eval_every, ...) may differ, so a run can be extended. --batch_size is compared as the global
batch (batch_size x ranks) instead (nanochat.checkpoint)."""
