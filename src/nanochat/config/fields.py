"""The field groups: flags two or more entrypoints share, each declared once.

A group is a frozen dataclass mixin (ModelFields, DataFields, BatchFields, ScheduleFields,
DeviceFields, SourceFields, ScriptFields, FP8Fields) that the configs inherit, so the flags keep
their flat names (`--seq_len`, not `--batch.seq_len`) and tyro reads each field's help from the
docstring under it, in the group. Each group checks its own values in `__post_init__`, chained through
`super()` down to nanochat.config.checks.Checked. Flat names because the flags are the documented
interface and the same names are NanoChatTrainer's keyword arguments (alternatives:
docs/design.md).

The FP8 flags are generated from nanochat.config.fp8.FP8Config (type, help text, checks), each
named by `FP8_FLAGS`, so FP8 has one definition: a flag's help is the `tyro.conf.arg(help=...)`
in its FP8Config field's annotation, with the field names shown as flags. `flag_text` rewrites
FP8Config's messages the same way, `flags_in_log` what nanochat.fp8 logs during a CLI run, and a
run's `Fallbacks` (built with `translate=flag_text`) the fallbacks it records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import typing
from dataclasses import dataclass
from typing import Annotated, Callable, Iterable, Iterator, Literal

import tyro

from nanochat.common import logger
from nanochat.config.checks import RESUME, Checked, check_vocab_size, finite, kept, non_negative, positive
from nanochat.config.fp8 import RESUME_FIELDS, FP8Config

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


class Fallbacks:
    """Every fallback a run took, with its reason, in the order taken: TrainResult.fallbacks.

    One collector per run, handed to each part as it is built. A part that falls back calls
    `add(message)`: the message is logged once, as a warning, and recorded. A part that keeps
    its own list as it runs (an optimizer's backends, the trackers), and says each entry itself,
    is `follow`ed: its entries are read when the collector is. `translate` rewrites every message
    once, as it is recorded: `flag_text` for a run configured by flags, where nanochat.fp8's
    messages name FP8Config's fields (`emulate` becomes --fp8_emulate). Iterating gives the
    messages; a message recorded twice is kept once."""

    def __init__(self, translate: Callable[[str], str] = str):
        self.translate = translate
        self._taken: list[str] = []
        self._followed: list[Callable[[], Iterable[str]]] = []

    def add(self, message: str, *, said: bool = False) -> None:
        """Record `message`, and log it unless the part that fell back has `said` it already."""
        text = self.translate(message)
        if text in self._taken:
            return
        self._taken.append(text)
        if not said:
            logger.warning("WARNING: %s", text)

    def follow(self, entries: Callable[[], Iterable[str]]) -> None:
        """A part's own fallbacks, read (`entries()`) whenever the collector is."""
        self._followed.append(entries)

    def __iter__(self) -> Iterator[str]:
        seen = list(self._taken)
        for entries in self._followed:
            seen += [t for t in map(self.translate, entries()) if t not in seen]
        return iter(seen)


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
    flt = _FlagText()
    logger.addFilter(flt)
    try:
        yield
    finally:
        logger.removeFilter(flt)


def _fp8_fields() -> type:
    """The FP8 flags as a field group, generated from FP8Config; RESUME_FIELDS are kept on resume."""
    hints, fields = typing.get_type_hints(FP8Config, include_extras=True), []
    for f in dataclasses.fields(FP8Config):
        if f.name not in FP8_FLAGS:
            continue
        if typing.get_origin(hints[f.name]) is not Annotated:
            raise TypeError(f"FP8Config.{f.name} has a flag (--{FP8_FLAGS[f.name]}), so its annotation must carry "
                            "its help: Annotated[<type>, tyro.conf.arg(help=...)]")
        typ, conf = typing.get_args(hints[f.name])
        arg = tyro.conf.arg(help=flag_text(" ".join(conf.help.split())),
                            aliases=("-f",) if f.name == "enabled" else None)
        default = False if f.name == "enabled" else f.default
        field = dataclasses.field(default=default, metadata=RESUME if f.name in RESUME_FIELDS else {})
        fields.append((FP8_FLAGS[f.name], Annotated[typ, arg], field))

    def fp8_config(self) -> FP8Config:
        """The FP8Config these flags describe (raises ValueError naming the flags)."""
        try:
            return FP8Config(**{name: getattr(self, flag) for name, flag in FP8_FLAGS.items()})
        except ValueError as e:
            raise ValueError(flag_text(str(e))) from None

    return dataclasses.make_dataclass(
        "FP8Fields", fields, bases=(Checked,), namespace={
            "fp8_config": fp8_config, "__module__": __name__,
            "__doc__": "The FP8 flags, generated from nanochat.fp8.FP8Config (base_train, tok_train)."},
        frozen=True, kw_only=True)


FP8Fields = _fp8_fields()


PRESET_DEPTHS = (2, 4, 6, 8, 12, 20, 24, 26)
"""The size presets' depths: `--model_name d<depth>` (nanochat.model.gpt.PRESETS: width 64 x depth)."""


def is_preset(model_name: str) -> bool:
    """Whether `model_name` names one of our size presets (else a Hugging Face model)."""
    return model_name in {f"d{depth}" for depth in PRESET_DEPTHS}


@dataclass(frozen=True, kw_only=True)
class ModelFields(Checked):
    """Which model trains, and from which weights (base_train, fp8_parity)."""

    model_name: str = kept("d4")
    """Model: a size preset (d2, d4, d6, d8, d12, d20, d24, d26: depth d, width 64*d), a local
    Hugging Face directory, or a hub id found in the local Hugging Face cache."""

    init_from: str | None = kept(None)
    """Start from the weights of another run of a preset model: the newest verified checkpoint in
    that run directory (fine-tuning a model pretrained with nanochat on other data, e.g. with
    --optimizer adamw at a lower --lr: under Muon, --lr sets only norm weights and biases).
    Its model and tokenizer are used (--model_name must name the same preset; the run's tokenizer
    replaces --tokenizer_dir and --vocab_size); the optimizer, step count, learning-rate schedule
    and data order start fresh. A run of a Hugging Face model is continued from its export
    (scripts/export_hf.py, then --model_name <that directory>)."""


@dataclass(frozen=True, kw_only=True)
class DataFields(Checked):
    """The corpus and the tokenizer trained on it (base_train, fp8_parity)."""

    dataset_path: str | None = kept(None)
    """A text file or a directory of .txt, .md, .py, .jsonl or .parquet files. Records with a
    "text" field are plain text; records with prompt/completion, chat "messages", or ARC-style
    question/choices/answerKey are instruction data, formatted with the model's chat template and
    scored on the answer tokens only. Default: this Python's own standard-library sources."""

    vocab_size: int = kept(4096)
    """Vocabulary size of a tokenizer trained on the fly (ignored with --tokenizer_dir)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_vocab_size(self)


@dataclass(frozen=True, kw_only=True)
class BatchFields(Checked):
    """How tokens are cut into sequences and batches, in training and evaluation (base_train,
    fp8_parity, eval)."""

    seq_len: int = kept(256)
    """Tokens per sequence: the training context (a preset's context length), and the window
    evaluation scores (a longer multiple-choice prompt keeps its last seq_len tokens)."""

    packing: Literal["stream", "bestfit"] = kept("stream")
    """How plain text is cut into sequences, for training and validation alike. stream: every
    seq_len tokens of the corpus (most sequences begin inside a document). bestfit: every
    sequence begins at a document's start; documents are placed whole, the largest that fits
    first, and one is cropped to fill the sequence, its tail dropped (the cropped share is
    logged: ~35% at seq_len 2048 on web text). Instruction data always packs its records whole:
    bestfit is refused there."""

    batch_size: int = 16
    """Sequences per forward pass on each device."""

    eval_tokens: int = 32768
    """Validation tokens per evaluation: the loss scores windows spread evenly over the validation
    split, the multiple-choice accuracy questions spread over it within as many prompt tokens (at
    least one)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(self, "seq_len", "batch_size", "eval_tokens")


@dataclass(frozen=True, kw_only=True)
class ScheduleFields(Checked):
    """How long a run trains, at which learning rate, and how often it evaluates (base_train,
    fp8_parity)."""

    num_iterations: int = -1
    """Optimizer steps to run; -1 means as many as --num_epochs needs."""

    lr: float = 3e-3
    """Peak learning rate of AdamW: of every parameter with --optimizer adamw; with muon, of norm
    weights and biases only (the presets have none; the recipe sets the other groups' rates)."""

    warmup_steps: int = 20
    """Linear warmup steps from 0 to each group's peak rate (then cosine decay)."""

    eval_every: int = 100
    """Measure validation loss and bits per byte every N steps (and at the end); 0: only at the end."""

    def __post_init__(self) -> None:
        super().__post_init__()
        finite(self, "lr")
        if self.num_iterations == 0 or self.num_iterations < -1:
            raise ValueError(f"--num_iterations must be -1 (use --num_epochs) or positive, got {self.num_iterations}")
        if not 0 < self.lr < 1:
            raise ValueError(f"--lr must be in (0, 1), got {self.lr}")
        non_negative(self, "warmup_steps", "eval_every")


@dataclass(frozen=True, kw_only=True)
class DeviceFields(Checked):
    """Where and in which precision the model computes (base_train, fp8_parity, eval)."""

    device: str = "auto"
    """cuda, cpu, mps, or auto (cuda if available)."""

    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype: auto is bfloat16 autocast on CUDA and float32 elsewhere."""


@dataclass(frozen=True, kw_only=True)
class ScriptFields(Checked):
    """What every script's command line has (base_train, tok_train, tokenize_corpus, eval,
    export_hf, plot_run, fp8_parity)."""

    debug: bool = False
    """Show the full traceback of an error instead of the one-line message."""


@dataclass(frozen=True, kw_only=True)
class SourceFields(Checked):
    """The model a script reads: a training run's checkpoint, or a model as loaded (exactly one)."""

    run_dir: str | None = None
    """A training run directory: its newest checkpoint and its saved tokenizer (and chat template)."""

    model_name: str | None = None
    """Instead of --run_dir: a local Hugging Face directory or a cached hub id, as loaded."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.run_dir is None) == (self.model_name is None):
            raise ValueError("give exactly one of --run_dir (a trained run) or --model_name (a model as loaded)")
