"""The configs of the smaller entrypoints: tokenizer training, corpus tokenizing, evaluation and
the run picture (`scripts/tok_train.py`, `tokenize_corpus.py`, `eval.py`, `plot_run.py`).

Each is a frozen dataclass built from the shared field groups (nanochat.config.fields) plus its
own flags, checked at construction like TrainConfig. The export's config has its own module
(nanochat.config.export: its quantization constants come with it), as has the GPU check's
(nanochat.config.gpu_check).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import tyro

from nanochat.config.checks import check_vocab_size, non_negative, positive
from nanochat.config.fields import BatchFields, DataFields, DeviceFields, FP8Fields, ScriptFields, SourceFields

MAX_ROWS = 48
"""Health-map rows before layers are grouped (scripts/plot_run.py --max_rows, nanochat.report.plot):
48 labelled rows at 6.5 pt fill a ~7 inch panel, the most that stays legible (d12's 72 layers and
beyond are grouped)."""


@dataclass(frozen=True, kw_only=True)
class TokTrainConfig(ScriptFields, FP8Fields):  # type: ignore[misc, valid-type]
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

    def __post_init__(self) -> None:
        super().__post_init__()
        check_vocab_size(self)
        positive(self, "max_chars")


@dataclass(frozen=True, kw_only=True)
class TokenizeConfig(ScriptFields, DataFields):
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
    """Check the existing store instead of building: re-read every file of the token store and
    compare it with the sha256 its manifest recorded at build time (exit 1 on a difference). The
    corpus's own files are checked by size and modification time, as every start does."""

    def __post_init__(self) -> None:
        super().__post_init__()
        non_negative(self, "workers")


@dataclass(frozen=True, kw_only=True)
class EvalConfig(ScriptFields, SourceFields, DeviceFields, BatchFields):
    """Evaluate a model on a dataset without training: validation loss and, for multiple-choice
    records, accuracy. `scripts/eval.py`."""

    dataset_path: str | None = None
    """The dataset (as base_train's --dataset_path); its validation split is evaluated (split
    files: the validation files; otherwise the same hash split as training). Default with
    --run_dir: the run's own (the built-in corpus for a run trained without --dataset_path);
    required with --model_name."""

    chat_template: str | None = None
    """As base_train's --chat_template. Default: the run's saved template, or the model's own, or
    plain when it has none."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dataset_path is None and self.model_name is not None:
            raise ValueError(f"--dataset_path is missing: --model_name {self.model_name} has no corpus of its own; "
                             "give the dataset whose validation split to evaluate")


@dataclass(frozen=True, kw_only=True)
class PlotConfig(ScriptFields):
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

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(self, "max_rows")
