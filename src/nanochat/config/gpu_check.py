"""GPUCheckConfig: the flags of scripts/gpu_check.py (its job list, budget and sizes)."""

from __future__ import annotations

from dataclasses import dataclass

JOB_NAMES = ("env", "tests", "optim", "stats", "train", "shapes", "all", "mxfp8", "scope", "opt_levels", "master")
"""gpu_check's jobs (its module docstring says what each measures); the first eight run by default."""


@dataclass(frozen=True, kw_only=True)
class GPUCheckConfig:
    """Flags of scripts/gpu_check.py; --dry_run swaps in toy sizes (DRY_RUN)."""

    out: str = ".cache/gpu_check/gpu_check.json"
    """The JSON file, rewritten after every measurement; the tests' log and junit XML go next to it."""
    dry_run: bool = False
    """Rehearse on the CPU: toy sizes, FP8 emulated; the figures mean nothing, the schema is the GPU run's."""
    budget_s: float = 440.0
    """Seconds for all measurements: one whose estimate does not fit what is left is skipped.
    gpu_check.sh stops the process 25 s later whatever happens: 8 minutes in all by default, to
    fit a short GPU reservation."""
    jobs: tuple[str, ...] = ("env", "tests", "optim", "stats", "train", "shapes", "all", "mxfp8")
    """Jobs to run, in this order."""
    model: str = "d12"
    """Preset of the train job's first model and of the stats job."""
    big_model: str = "d26"
    """Preset of the train job's second model."""
    batch_size: int = 16
    """Sequences per step of --model's runs."""
    big_batch_size: int = 8
    """Sequences per step of --big_model's runs."""
    big_compile_scope: str = "blocks"
    """--compile_scope of --big_model's runs. blocks: one block's graph compiled once and reused by
    every block, so compiling does not grow with depth and fits the time budget (a whole model
    compiles about 3x slower in FP8). bf16 and FP8 are compared under the same scope."""
    seq_len: int = 2048
    """Tokens per sequence of every training run."""
    vocab_size: int = 8192
    """BPE vocabulary trained on the stdlib for the training runs (cached after the first)."""
    steps: int = 20
    """Training steps per run (the compiling step is not in tokens/s)."""
    shape_models: tuple[str, ...] = ("llama3-8b", "d26", "d20", "d12")
    """Models whose Linear shapes the shapes job times, in priority order."""
    shape_tokens: tuple[int, ...] = (8192, 32768)
    """Rows of each shape's GEMMs."""
    shapes_budget_s: float = 40.0
    """The shapes job starts no new shape after this many seconds (the rest are listed); the first
    is always timed."""
    opt_tensors: int = 32
    """Parameter tensors of the optim job."""
    opt_dim: int = 4096
    """Each optim-job parameter is opt_dim x opt_dim fp32."""
    opt_steps: int = 10
    """Timed optimizer steps (median reported) after one that creates the state and compiles."""
    optimizers: tuple[str, ...] = ("adamw_fused", "fp8optim_l0", "fp8optim_l1", "fp8optim_l2")
    """What the optim job times (nanochat.train.measure.OPTIMIZERS); also fp8optim_l2_bf16,
    fp8optim_l2_bf16_sr, fp8optim_l2_bf16_split (level 2 with bf16 master weights)."""
    tests_timeout_s: float = 120.0
    """Interrupt the GPU tests after this many seconds (what ran is kept)."""
    run_root: str = ""
    """Where the runs' directories go (default: a temporary directory)."""

    def __post_init__(self) -> None:
        unknown = [j for j in self.jobs if j not in JOB_NAMES]
        if unknown:
            raise ValueError(f"--jobs: unknown job {' '.join(unknown)}; the jobs are {' '.join(JOB_NAMES)}")
        for name in ("budget_s", "tests_timeout_s"):
            if not getattr(self, name) > 0:  # also refuses nan
                raise ValueError(f"--{name} must be a positive number of seconds, got {getattr(self, name)}")


DRY_RUN = dict(model="d2", big_model="d2", batch_size=2, big_batch_size=2, seq_len=32, vocab_size=320,
               steps=3, shape_models=("d2",), shape_tokens=(64,), shapes_budget_s=0.0, opt_tensors=2,
               opt_dim=256, opt_steps=2)


__all__ = ["DRY_RUN", "GPUCheckConfig", "JOB_NAMES"]
