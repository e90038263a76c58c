"""Every entrypoint's configuration: one frozen dataclass each, the single source of `--help`.

tyro turns these dataclasses into CLIs (`scripts/base_train.py`, `scripts/tok_train.py`), the
attribute docstring under each field becomes its help text, `NanoChatTrainer(**kwargs)` takes
the same field names, and checkpoints store the config as a plain dict (`dataclasses.asdict`)
so a run can be resumed and inspected without unpickling anything.

Flags are shown with underscores (`--fp8_mode`); tyro also accepts the hyphenated spelling
(`--fp8-mode`). `parse_cli` turns every rejected command line, tyro's parse errors and the
`__post_init__` checks alike, into one `error:` line naming the flag and the fix, exit status 2.

A flag two entrypoints share is declared once, in a field group (a frozen dataclass mixin:
ModelFields, DataFields, BatchFields, ScheduleFields, DeviceFields, FP8Fields) that the configs
inherit, so the flags keep their flat names and tyro reads each field's docstring from the group.
Each group checks its own values (`__post_init__`, chained through `super()`); what a value
means for the machine or the files (a device, a path) is checked at start-up (nanochat.train.preflight).
The FP8 flags are generated from `nanochat.fp8.FP8Config` (field, type, help text and checks),
each named by `FP8_FLAGS`, so FP8 has one definition. `RESUME_MUST_MATCH` (what a --resume must
share with its checkpoint) is read off the fields marked `_kept`.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import functools
import inspect
import logging
import math
import os
import re
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Literal, TypeVar

import tyro

from nanochat.config.fp8 import FP8Config, FP8Recipe
from nanochat.model.hf_fp8 import SQNR_FLOOR_DB, Quantize
from nanochat.report.plot import MAX_ROWS
from nanochat.report.trackers import LogChoice

FP8_FLAGS = {
    "enabled": "fp8", "mode": "fp8_mode", "recipe": "fp8_recipe", "layers": "fp8_layers", "emulate": "fp8_emulate",
    "opt_level": "fp8_opt_level", "skip_fqns": "fp8_skip", "min_dim": "fp8_min_dim",
    "auto_steps": "fp8_auto_steps", "auto_recheck_every": "fp8_auto_recheck_every",
    "stats_every": "fp8_stats_every",
}
"""FP8Config field -> the flag that sets it. The flags are generated from FP8Config (type, help
text, validation); only their names, `-f` and `--fp8`'s default (off) are the CLI's own. A field
without a flag (`fsdp_float8_all_gather`) is decided by the trainer, not the user."""


def flag_text(text: str) -> str:
    """An FP8Config message or help text as the CLI shows it: `mode` becomes --fp8_mode."""
    return re.sub(r"`(\w+)`", lambda m: "--" + FP8_FLAGS[m[1]] if m[1] in FP8_FLAGS else m[0], text)


_said: set[str] = set()


def _say_once(key: str, message: str) -> None:
    """A warning the first time `key` is seen in this process (nanochat.common.warn_once's
    wording; this module stays free of torch so that --help is fast)."""
    if key not in _said:
        _said.add(key)
        logging.getLogger("nanochat").warning("WARNING: %s", message)
class _FlagText(logging.Filter):
    """Log records as the CLI's user reads them: nanochat.fp8 names FP8Config's fields (`emulate`),
    a run configured by TrainConfig has flags (--fp8_emulate)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if (text := flag_text(message)) != message:
            record.msg, record.args = text, ()
        return True


@contextlib.contextmanager
def flags_in_log():
    """Within the block, what the nanochat logger prints names FP8 settings by their flags."""
    from nanochat.common import logger

    flt = _FlagText()
    logger.addFilter(flt)
    try:
        yield
    finally:
        logger.removeFilter(flt)


def _attribute_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (what tyro shows as help)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body, docs = tree.body[0].body, {}
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


class _Checked:
    """The root of every config's checks: `__post_init__` runs the groups' checks through
    `super()`, and here, first, turns pathlib.Path values (API callers) into the str the field
    holds and lists into tuples (configs stay JSON and hashable), then checks every type."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, os.PathLike):
                object.__setattr__(self, f.name, os.fspath(value))
            elif isinstance(value, list):
                object.__setattr__(self, f.name, tuple(value))
        _check_types(self)


_RESUME = {"resume": "must match"}


def _kept(default):
    """A field a --resume must share with its checkpoint: it changes the model, the data stream or
    the optimizer's meaning (RESUME_MUST_MATCH)."""
    return dataclasses.field(default=default, metadata=_RESUME)


def _fp8_fields() -> type:
    """The FP8 flags as a field group, generated from FP8Config; RESUME_FIELDS are kept on resume."""
    from nanochat.config.fp8 import RESUME_FIELDS

    hints, docs = typing.get_type_hints(FP8Config), _attribute_docs(FP8Config)
    fields = []
    for f in dataclasses.fields(FP8Config):
        if f.name not in FP8_FLAGS:
            continue
        arg = tyro.conf.arg(help=flag_text(docs[f.name]), aliases=("-f",) if f.name == "enabled" else None)
        default = False if f.name == "enabled" else f.default
        field = dataclasses.field(default=default, metadata=_RESUME if f.name in RESUME_FIELDS else {})
        fields.append((FP8_FLAGS[f.name], Annotated[hints[f.name], arg], field))

    def fp8_config(self) -> FP8Config:
        """The FP8Config these flags describe (raises ValueError naming the flags)."""
        try:
            return FP8Config(**{name: getattr(self, flag) for name, flag in FP8_FLAGS.items()})
        except ValueError as e:
            raise ValueError(flag_text(str(e))) from None

    return dataclasses.make_dataclass(
        "FP8Fields", fields, bases=(_Checked,), namespace={
            "fp8_config": fp8_config, "__module__": __name__,
            "__doc__": "The FP8 flags, generated from nanochat.fp8.FP8Config (base_train, tok_train)."},
        frozen=True, kw_only=True)


FP8Fields = _fp8_fields()


@dataclass(frozen=True, kw_only=True)
class ModelFields(_Checked):
    """Which model trains, and from which weights (base_train, fp8_parity)."""

    model_name: str = _kept("d4")
    """Model: a size preset (d2, d4, d6, d8, d12, d20, d26: depth d, width 64*d), a local
    Hugging Face directory, or a hub id found in the local Hugging Face cache."""

    init_from: str | None = _kept(None)
    """Start from the weights of another run of a preset model: the newest verified checkpoint in
    that run directory (fine-tuning a model pretrained with nanochat, e.g. at a lower --lr on other data).
    Its model and tokenizer are used (--model_name must name the same preset; the run's tokenizer
    replaces --tokenizer_dir and --vocab_size); the optimizer, step count, learning-rate schedule
    and data order start fresh. A run of a Hugging Face model is continued from its export
    (scripts/export_hf.py, then --model_name <that directory>)."""


@dataclass(frozen=True, kw_only=True)
class DataFields(_Checked):
    """The corpus and the tokenizer trained on it (base_train, fp8_parity)."""

    dataset_path: str | None = _kept(None)
    """A text file or a directory of .txt, .md, .py, .jsonl or .parquet files. Records with a
    "text" field are plain text; records with prompt/completion, chat "messages", or ARC-style
    question/choices/answerKey are instruction data, formatted with the model's chat template and
    scored on the answer tokens only. Default: this Python's own standard-library sources."""

    vocab_size: int = _kept(4096)
    """Vocabulary size of a tokenizer trained on the fly (ignored with --tokenizer_dir)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_vocab_size(self)


@dataclass(frozen=True, kw_only=True)
class BatchFields(_Checked):
    """How tokens are cut into sequences and batches, in training and evaluation (base_train,
    fp8_parity, eval)."""

    seq_len: int = _kept(256)
    """Tokens per sequence: the training context (a preset's context length), and the window
    evaluation scores (a longer multiple-choice prompt keeps its last seq_len tokens)."""

    batch_size: int = 16
    """Sequences per forward pass on each device."""

    eval_tokens: int = 32768
    """Validation tokens per evaluation (the loss; the multiple-choice accuracy scores the records
    within as many prompt tokens, at least one)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "seq_len", "batch_size", "eval_tokens")


@dataclass(frozen=True, kw_only=True)
class ScheduleFields(_Checked):
    """How long a run trains, at which learning rate, and how often it evaluates (base_train,
    fp8_parity)."""

    num_iterations: int = -1
    """Optimizer steps to run; -1 means as many as --num_epochs needs."""

    lr: float = 3e-3
    """Peak learning rate of AdamW."""

    warmup_steps: int = 20
    """Linear warmup steps from 0 to --lr (then cosine decay)."""

    eval_every: int = 100
    """Measure validation loss and bits per byte every N steps (and at the end); 0: only at the end."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _finite(self, "lr")
        if self.num_iterations == 0 or self.num_iterations < -1:
            raise ValueError(f"--num_iterations must be -1 (use --num_epochs) or positive, got {self.num_iterations}")
        if not 0 < self.lr < 1:
            raise ValueError(f"--lr must be in (0, 1), got {self.lr}")
        _non_negative(self, "warmup_steps", "eval_every")


@dataclass(frozen=True, kw_only=True)
class DeviceFields(_Checked):
    """Where and in which precision the model computes (base_train, fp8_parity, eval)."""

    device: str = "auto"
    """cuda, cpu, mps, or auto (cuda if available)."""

    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype: auto is bfloat16 autocast on CUDA and float32 elsewhere."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig(DeviceFields, ScheduleFields, BatchFields, DataFields, ModelFields, FP8Fields):  # type: ignore[misc]
    """Train (or continue training) a GPT on a corpus. `scripts/base_train.py`."""

    # --help lists the groups' flags last base first (FP8, model, data, batches, schedule,
    # device), then these

    tokenizer_dir: str | None = _kept(None)
    """A tokenizer saved by scripts/tok_train.py. Default: train one on the corpus (cached)."""

    grad_accum_steps: int = _kept(1)
    """Forward/backward passes per optimizer step (effective batch = batch_size * this * ranks)."""

    num_epochs: int = 1
    """Full passes over the training tokens (ignored when --num_iterations is set)."""

    final_lr_frac: float = 0.1
    """The learning rate decays (cosine) from --lr to this fraction of it at the last step."""

    weight_decay: float = 0.1
    """AdamW weight decay for matrices (norms, biases and embeddings get none)."""

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

    fp8_max_overflows: int | None = None
    """The former name of --max_bad_steps (the guard is not FP8's): sets it, and says so once."""

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

    keep_checkpoints: int = 2
    """Keep the newest N checkpoints (DCP step directories in distributed runs; older ones are
    deleted after each save), so a damaged newest checkpoint still leaves one to resume from."""

    seed: int = _kept(1337)
    """Seed for weights, data order and sampling."""

    compile: bool = True
    """torch.compile the training model (after FP8 conversion); --no_compile runs eagerly.
    torchao's FP8 layers are fast only compiled (eager casts run as separate kernels). If
    compiling fails (no C++ compiler for CPU code, an unsupported backend) the run warns once,
    trains eagerly and records the fallback. Compile time is reported on its own, not in tokens/s."""

    compile_scope: Literal["model", "blocks"] = "model"
    """What --compile compiles: the whole model as one graph, or each transformer block (one
    graph that every block reuses: compile time stops growing with depth). Measured on an H200
    at d12 (BENCHMARKS.md): per block halves compile time but costs 13% of bf16 tokens/s (the
    embedding, head and loss run eagerly) and, with FP8, recompiles per block; hence model."""

    fsdp: bool = False
    """Under torchrun: shard parameters with FSDP2 (fully_shard) instead of DDP."""

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

    master_weights: Literal["fp32", "bf16", "bf16_sr", "bf16_split"] = _kept("fp32")
    """How parameters are stored and updated: fp32 (4 bytes a parameter, gradients 4); or in
    bf16 (2 + 2) with the fp32 update written by round to nearest (bf16: small updates are
    lost), stochastic rounding (bf16_sr: seeded by --seed, unbiased) or kept exactly with a
    16-bit remainder in the optimizer state (bf16_split: 2 more bytes). With --fp8_opt_level 2:
    ~6 bytes a parameter of training state (bf16_split ~8) instead of ~10. docs/master_weights.md."""

    master_weights_emulate: bool = _kept(False)
    """With a bf16 --master_weights: keep the parameters as fp32 tensors holding bf16 values and
    round gradients to bf16 in the update, so the model computes in fp32 with bf16 master-weight
    numerics. For CPUs without fast bf16 matmuls (parity studies); saves no memory."""

    optimizer_in_backward: bool = False
    """Step each parameter inside the backward as soon as its gradient is ready and free that
    gradient: the gradients' memory is gone. Needs --grad_accum_steps 1 and --grad_clip 0 (there
    is no global norm before the last gradient); not under torchrun (DDP/FSDP reduce gradients
    after these steps). A parameter whose gradient is not finite is left unchanged."""

    debug: bool = False
    """Show the full traceback of an error instead of the one-line message."""

    def __post_init__(self) -> None:
        super().__post_init__()  # the groups' checks
        _finite(self, "final_lr_frac", "weight_decay", "beta1", "beta2", "grad_clip", "temperature")
        if self.resume and self.overwrite:
            raise ValueError("--resume continues the run in --run_dir, --overwrite deletes it: give one")
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
        self.fp8_config()  # the FP8 flags' own checks (FP8Config's)
        if self.fp8_max_overflows is not None:
            if self.max_bad_steps not in (TrainConfig.max_bad_steps, self.fp8_max_overflows):
                raise ValueError(f"--fp8_max_overflows {self.fp8_max_overflows} is the former name of --max_bad_steps "
                                 f"{self.max_bad_steps}: give --max_bad_steps only")
            object.__setattr__(self, "max_bad_steps", self.fp8_max_overflows)
            _say_once("fp8_max_overflows", "--fp8_max_overflows is the former name of --max_bad_steps (the step "
                      "guard runs in every run, FP8 or not): use --max_bad_steps")
        if self.max_bad_steps < 1:
            raise ValueError(f"--max_bad_steps must be >= 1, got {self.max_bad_steps}")
        _positive(self, "grad_accum_steps")
        _non_negative(self, "save_every", "grad_clip", "num_samples", "sample_tokens", "top_k", "weight_decay",
                      "temperature")
        if self.num_iterations == -1 and self.num_epochs < 1:
            raise ValueError(f"--num_epochs must be >= 1, got {self.num_epochs}")
        if not 0 <= self.final_lr_frac <= 1:
            raise ValueError(f"--final_lr_frac must be in [0, 1], got {self.final_lr_frac}")
        self._check_optimizer()

    def _check_optimizer(self) -> None:
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


RESUME_MUST_MATCH = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata == _RESUME)
"""The flags a --resume must share with its checkpoint (the fields marked `_kept`): they change
the model, the data stream or the optimizer's meaning. Everything else (--num_iterations,
--eval_every, ...) may differ, so a run can be extended. --batch_size is compared as the global
batch (batch_size x ranks) instead (nanochat.checkpoint)."""


@dataclass(frozen=True, kw_only=True)
class TokTrainConfig(FP8Fields):  # type: ignore[misc, valid-type]
    """Train a BPE tokenizer on a corpus and save it. `scripts/tok_train.py`.

    The FP8 flags are accepted so one command line works for both scripts; they do not apply here
    (tokenizer training has no matmuls) and the script says so.
    """

    dataset_path: str | None = None
    """Corpus to train on (same forms as base_train's --dataset_path). Default: the Python
    standard-library sources."""

    tokenizer_dir: str = "runs/tokenizer"
    """Directory to write the tokenizer to. One that already holds a tokenizer is refused without
    --overwrite; a run's own tokenizer/ (next to its checkpoints) always."""

    overwrite: bool = False
    """Replace the tokenizer already in --tokenizer_dir (never a run's)."""

    vocab_size: int = 4096
    """Vocabulary size including the 256 byte tokens and the special tokens."""

    max_chars: int = 20_000_000
    """Train on at most this many characters of the corpus (BPE merges converge long before)."""

    debug: bool = False
    """Show the full traceback of an error instead of the one-line message."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_vocab_size(self)
        _positive(self, "max_chars")


@dataclass(frozen=True, kw_only=True)
class TokenizeConfig(DataFields):
    """Tokenize a corpus once into its token store, the memory-mapped files every run and rank
    reads (on a CPU node, or before torchrun); base_train builds the same store on first use.
    `scripts/tokenize_corpus.py`."""

    tokenizer_dir: str | None = None
    """The tokenizer: nanochat's (scripts/tok_train.py, as base_train's --tokenizer_dir) or a Hugging
    Face model directory (its tokenizer.json, as base_train's --model_name uses). Default: the one
    base_train trains on the corpus with --vocab_size (cached)."""

    chat_template: str | None = None
    """Instruction records with a Hugging Face tokenizer: as base_train's --chat_template."""

    workers: int = 0
    """Processes that tokenize in parallel; 0: one per CPU core this process may use."""

    verify: bool = False
    """Check the existing store instead of building: re-read every file and compare it with the
    sha256 recorded at build time (exit 1 on a difference)."""

    debug: bool = False
    """Show the full traceback of an error instead of the one-line message."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _non_negative(self, "workers")


@dataclass(frozen=True, kw_only=True)
class SourceFields(_Checked):
    """The model a script reads: a training run's checkpoint, or a model as loaded (exactly one)."""

    run_dir: str | None = None
    """A training run directory: its newest checkpoint and its saved tokenizer (and chat template)."""

    model_name: str | None = None
    """Instead of --run_dir: a local Hugging Face directory or a cached hub id, as loaded."""

    debug: bool = False
    """Show the full traceback of an error instead of the one-line message."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.run_dir is None) == (self.model_name is None):
            raise ValueError("give exactly one of --run_dir (a trained run) or --model_name (a model as loaded)")


@dataclass(frozen=True, kw_only=True)
class ExportConfig(SourceFields):
    """Export a run's checkpoint, or a model as loaded, to a Hugging Face model directory."""

    out_dir: str
    """Directory to write config.json, model.safetensors and the tokenizer files to. It must be
    new or empty, unless --overwrite."""

    overwrite: bool = False
    """Replace a non-empty --out_dir whole, once the export is complete (never the model or run
    the export reads from)."""

    quantize: Quantize = "none"
    """none: fp32 weights. fp8: every block Linear's weight in float8 e4m3 with an fp32 scale per
    output channel, activations quantized per token at run time (compressed-tensors FP8_DYNAMIC,
    which vLLM, SGLang and transformers load); fp8_block: one scale per 128x128 block (FP8_BLOCK).
    Embeddings, lm_head, norms and the Linears the run trained in high precision stay bf16."""

    quantize_all: bool = False
    """With --quantize: also quantize the Linears the run trained in high precision and those
    under --sqnr_floor_db (lm_head, embeddings and norms stay bf16)."""

    sqnr_floor_db: float = SQNR_FLOOR_DB
    """With --quantize: a Linear whose FP8 weight SQNR is below this stays bf16 (e4m3 gives 24.6 dB
    at worst and ~31.5 dB on typical weights; docs/hf.md)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.quantize == "none" and (self.quantize_all or self.sqnr_floor_db != SQNR_FLOOR_DB):
            raise ValueError("--quantize_all and --sqnr_floor_db choose what --quantize stores in FP8; add "
                             "--quantize fp8 (or fp8_block)")
        if not math.isfinite(self.sqnr_floor_db):
            raise ValueError(f"--sqnr_floor_db must be a finite number of dB, got {self.sqnr_floor_db}")


@dataclass(frozen=True, kw_only=True)
class EvalConfig(SourceFields, DeviceFields, BatchFields):
    """Evaluate a model on a dataset without training: validation loss and, for multiple-choice
    records, accuracy. `scripts/eval.py`."""

    dataset_path: str
    """The dataset (as base_train's --dataset_path); its validation split is evaluated (split
    files: the validation files; otherwise the same hash split as training)."""

    chat_template: str | None = None
    """As base_train's --chat_template. Default: the run's saved template, or the model's own, or
    plain when it has none."""


@dataclass(frozen=True, kw_only=True)
class PlotConfig(_Checked):
    """Draw a training run: loss and validation bpb against tokens, tokens/s, MFU and the FP8
    health map (underflow and saturation per layer and statistics step). `scripts/plot_run.py`."""

    run_dir: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="RUN_DIR")]
    """A training run directory (base_train's --run_dir): its metrics.jsonl, result.json and checkpoint."""

    out: str | None = None
    """The PNG to write. Default: RUN_DIR/run.png."""

    overwrite: bool = False
    """Replace --out even when it is a file plot_run did not draw (a picture it drew is always redrawn)."""

    max_rows: int = MAX_ROWS
    """Rows of the FP8 health map before layers are grouped (each Linear over a range of blocks)."""

    debug: bool = False
    """Show the full traceback of an error instead of the one-line message."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "max_rows")


ParityMode = Literal["baseline", "e4m3", "e5m2", "auto", "auto-recheck", "bf16", "bf16_sr", "bf16_split"]


@dataclass(frozen=True, kw_only=True)
class ParityConfig(DeviceFields, ScheduleFields, BatchFields, DataFields, ModelFields):
    """Train one model per FP8 mode and seed (same weights and data within a seed); compare
    final val losses. `scripts/fp8_parity.py` (the harness: scripts/parity.py).

    The model, data, batch, schedule and device flags are base_train's, given to every run; the
    defaults below make a d4 sweep of minutes a run on CPU (FP8 needs width >= 128, d2 or more;
    it runs natively where the device supports the recipe, emulated elsewhere). Every mode
    evaluates the same validation tokens at the same steps: the curve points of the plot. With
    --init_from every run starts from that run's weights: parity of fine-tuning, where updates
    are small against the weights (what bf16 round-to-nearest master weights lose)."""

    num_iterations: int = 300
    """Optimizer steps per mode (parity has no --num_epochs)."""

    eval_every: int = 25  # parity's own defaults; the flags' help is base_train's
    eval_tokens: int = 4096
    seq_len: int = 128
    batch_size: int = 4

    modes: tuple[ParityMode, ...] = ("baseline", "e4m3", "e5m2", "auto", "auto-recheck")
    """Modes to train, in this order: baseline (no FP8, fp32 master weights), e4m3, e5m2, auto
    (--fp8_mode auto) and auto-recheck (--fp8_mode auto --fp8_auto_recheck_every --recheck_every);
    and, to compare master weights instead of FP8, bf16, bf16_sr, bf16_split (--master_weights,
    no FP8; with --dtype bfloat16 so the baseline computes in bf16 too and only the weights'
    storage differs)."""

    recipe: FP8Recipe = "tensorwise"
    """torchao FP8 scaling recipe for every FP8 mode."""

    seeds: tuple[int, ...] = (1337, 1338, 1339, 1340, 1341)
    """Seeds of the weights and the data order; every mode trains once per seed. One seed cannot
    rank the modes (their order changes with the rounding of a single step); the spread over
    seeds is reported next to every gap."""

    jobs: int = 1
    """Runs trained at once, in separate processes (each with cpu_count / jobs threads; output
    to each run's train.log). 2 halves the wall time on two idle cores; 1 keeps output live."""

    reuse: bool = False
    """Take finished runs from --out_dir whose recorded training settings equal this invocation's
    instead of training them again (e.g. after an interrupted sweep, or to add seeds). Each
    reused run keeps the commit it was trained on, printed and in parity.json."""

    recheck_every: int = 25
    """--fp8_auto_recheck_every of the auto-recheck mode: re-measure both formats every N steps
    and switch a role after 2 disagreeing re-checks in a row. 25 = every evaluation point of the
    default run (the e4m3 gradient underflow it is for showed by step 50)."""

    out_dir: str = "runs/fp8_parity"
    """Where the per-mode runs, parity.json and parity.png go."""

    gap_target_pct: float = 1.0
    """Target: every FP8 mode's final val loss within this many percent of the baseline's."""

    auto_tolerance_pct: float = 0.2
    """Target: auto's mean final val loss over the seeds at most the best fixed mode's mean
    times (1 + this/100); 0 is strict. A policy (a fifth of --gap_target_pct); the paired
    difference's standard error over the seeds is printed next to it."""

    quick: bool = False
    """Smoke run in seconds (d2, 8 steps, seq_len 32, tiny eval): replaces the size and schedule
    flags above with QUICK's values. Its figures check the harness, not FP8."""

    master_weights_emulate: bool = False
    """The master-weight modes with --master_weights_emulate: bf16 numerics, fp32 compute (for
    CPUs whose bf16 matmuls are slow; the baseline computes in fp32 then, with --dtype float32)."""

    fp8_opt_level: Literal[0, 1, 2] = 0
    """--fp8_opt_level of every run: the baseline's, the FP8 modes' and the master-weight modes'
    Adam moments in FP8 (it needs no FP8 matmuls), so that only the mode differs. 0: fp32 moments."""

    debug: bool = False
    """Show the full traceback of an error of the sweep itself instead of the one-line message
    (a failed run's traceback is always printed)."""

    def __post_init__(self) -> None:
        super().__post_init__()  # the groups' checks
        if not self.modes:
            raise ValueError("--modes is empty; give at least: --modes baseline e4m3")
        if len(set(self.modes)) != len(self.modes):
            raise ValueError(f"--modes lists a mode twice: {' '.join(self.modes)}")
        if "baseline" not in self.modes:
            raise ValueError("gaps are measured against the baseline: add baseline to --modes "
                             f"(e.g. --modes baseline {' '.join(self.modes)})")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"--seeds needs distinct seeds, at least one, got {' '.join(map(str, self.seeds)) or 'none'}")
        _positive(self, "num_iterations", "jobs", "recheck_every")
        _non_negative(self, "gap_target_pct", "auto_tolerance_pct")


QUICK = dict(model_name="d2", num_iterations=8, eval_every=4, eval_tokens=512, seq_len=32,
             batch_size=4, vocab_size=320, warmup_steps=2, lr=1e-2, recheck_every=2)
"""--quick: d2 (width 128, the smallest preset with FP8-eligible layers), 8 steps: more than
auto's 4 calibration steps (--fp8_auto_steps), so auto trains with its calibrated formats, and
auto-recheck re-checks at steps 6 and 8."""


def resolved(cfg: ParityConfig) -> ParityConfig:
    return dataclasses.replace(cfg, **QUICK) if cfg.quick else cfg


def _matches(value, hint) -> bool:
    """Whether `value` has the annotated type (the subset of typing these configs use)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return _matches(value, args[0])
    if origin is Literal:
        return any(type(value) is type(a) and value == a for a in args)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if origin is tuple:
        return isinstance(value, tuple) and all(_matches(v, args[0]) for v in value)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return _describe(args[0])
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is tuple:
        return f"a tuple, each {_describe(args[0])}"
    if hint is type(None):
        return "None"
    return f"{'an' if hint.__name__[0] in 'aeiou' else 'a'} {hint.__name__}"


def _check_types(cfg) -> None:
    """The CLI checks types itself; this catches the Python API's mistakes (batch_size=2.5,
    fp8="yes") at construction instead of deep inside training."""
    hints = typing.get_type_hints(type(cfg), include_extras=True)
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if not _matches(value, hints[f.name]):
            raise ValueError(f"--{f.name} must be {_describe(hints[f.name])}, got {value!r} "
                             f"({type(value).__name__})")


def _finite(cfg, *names: str) -> None:
    for n in names:
        if not math.isfinite(getattr(cfg, n)):
            raise ValueError(f"--{n} must be a finite number, got {getattr(cfg, n)}")


def _check_vocab_size(cfg) -> None:
    if cfg.vocab_size < 260:
        raise ValueError(f"--vocab_size must be >= 260 (256 bytes + special tokens), got {cfg.vocab_size}")


def _positive(cfg, *names: str) -> None:
    for n in names:
        if getattr(cfg, n) <= 0:
            raise ValueError(f"--{n} must be positive, got {getattr(cfg, n)}")


def _non_negative(cfg, *names: str) -> None:
    for n in names:
        if getattr(cfg, n) < 0:
            raise ValueError(f"--{n} must be >= 0, got {getattr(cfg, n)}")


C = TypeVar("C")


def parse_cli(cls: type[C], args: list[str] | None = None) -> C:
    """Parse argv into `cls`. Every rejection is one `error: ...` line on stderr and exit status
    2: tyro's own (an unknown flag, a value that is not a choice or not a number, a missing value)
    and `cls.__post_init__`'s checks, which run here, after tyro, so their message is printed as
    written (tyro would draw it in a box). `--help` is tyro's, unchanged."""
    try:
        with _one_line_parse_errors(cls):
            parsed = tyro.cli(_unchecked(cls), args=args, use_underscores=True)
        return cls(**{f.name: getattr(parsed, f.name) for f in dataclasses.fields(cls) if f.init})
    except (ValueError, _Rejected) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


@functools.cache
def _unchecked(cls: type) -> type:
    """`cls` without its `__post_init__`: the fields, defaults and help tyro reads, and no checks,
    so tyro never sees (and boxes) a ValueError; parse_cli constructs `cls` itself."""
    namespace = {"__post_init__": lambda self: None, "__doc__": cls.__doc__, "__module__": cls.__module__}
    return dataclasses.make_dataclass(cls.__name__, [], bases=(cls,), namespace=namespace,
                                      frozen=True, kw_only=True)


class _Rejected(Exception):
    """A parse error of tyro's, reworded as parse_cli's one line."""


def _one_line_parse_errors(cls: type) -> contextlib.AbstractContextManager:
    """While tyro parses: its errors for a bad command line raise `_Rejected` with one line naming
    the flag and the fix instead of printing a box. This uses tyro's parse-error hook
    (`tyro._errors`, marked experimental by tyro); a tyro without it, or a kind of error not
    handled here, keeps tyro's own message (still exit status 2)."""
    try:
        from tyro import _errors
    except ImportError:
        return contextlib.nullcontext()
    hints = typing.get_type_hints(cls, include_extras=True)

    def flag(argument) -> tuple[str, str]:
        """(--flag, what it takes) of one of tyro's argument definitions."""
        lowered = getattr(argument, "lowered", None)
        names = getattr(lowered, "name_or_flags", None) or ("an argument",)
        name = next((n for n in names if n.startswith("--")), names[0])
        hint = hints.get(getattr(lowered, "dest", None) or name.lstrip("-"))
        if not name.startswith("-"):  # a positional argument: named as --help shows it (RUN_DIR)
            name = getattr(lowered, "metavar", None) or name
        if typing.get_origin(hint) in (typing.Union, types.UnionType):  # `str | None`: "None" is the default
            hint = typing.Union[tuple(a for a in typing.get_args(hint) if a is not type(None))]
        return name, _describe(hint) if hint is not None else "a value"

    def hook(event) -> None:
        help_hint = f"{event.prog} --help lists the flags"
        if isinstance(event, _errors.InvalidChoice):
            name, _ = flag(event.argument)
            raise _Rejected(f"{name}: {event.value!r} is not one of {', '.join(event.choices)}; "
                            f"give one of those ({event.prog} --help says what each does)")
        if isinstance(event, _errors.BadValue):
            name, takes = flag(event.argument)
            if event.reason == "too_few_values":
                raise _Rejected(f"{name} is missing its value; give {takes} after it")
            raise _Rejected(f"{name} takes no value here (got {event.offending_value!r}); {help_hint}")
        if isinstance(event, _errors.InstantiationFailure) and event.argument is not None:
            name, takes = flag(event.argument)
            raise _Rejected(f"{name}: {event.message}; it takes {takes}")
        if isinstance(event, _errors.MissingArgs):
            missing = [flag(a.arg) for a in event.missing_arguments]
            raise _Rejected(f"{', '.join(n for n, _ in missing)} is required (it has no default): give "
                            + ", ".join(f"{n} followed by {takes}" if n.startswith("-") else f"{n}, {takes}"
                                        for n, takes in missing))
        if isinstance(event, _errors.UnrecognizedArgs):
            unknown = [t for t in event.tokens if t.startswith("-")]
            if not unknown:
                raise _Rejected(f"unexpected argument {' '.join(event.tokens)}: every value follows its --flag, "
                                f"and on/off flags take none; {help_hint}")
            typed = unknown[0].split("=")[0].lstrip("-").replace("-", "_")
            near = difflib.get_close_matches(typed, [f.name for f in dataclasses.fields(cls)], n=1)
            raise _Rejected(f"unknown flag {' '.join(unknown)}"
                            + (f" (did you mean --{near[0]}?)" if near else "") + f"; {help_hint}")

    return _errors.on_parse_error(hook)
