"""ParityConfig: the FP8 parity sweep's flags (`scripts/fp8_parity.py`, harness scripts/parity.py).

The sweep trains one model per mode and seed with base_train's model, data, batch, schedule and
device flags (the shared field groups), at its own smaller defaults, and compares the final
validation losses. `QUICK` is the smoke run's settings, applied by `resolved`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from nanochat.config.checks import non_negative, positive
from nanochat.config.fields import BatchFields, DataFields, DeviceFields, ModelFields, ScheduleFields
from nanochat.config.fp8 import MX_RECIPES, FP8Recipe

ParityMode = Literal["baseline", "e4m3", "e5m2", "auto", "auto-recheck", "bf16", "bf16_sr", "bf16_split",
                     "tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "mxfp8_wgrad_hp"]


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
    a recipe's name (tensorwise, rowwise, rowwise_with_gw_hp, mxfp8, mxfp8_wgrad_hp): e4m3 with
    that --fp8_recipe, whatever --recipe says, to compare recipes on the same seeds; and, to
    compare master weights instead of FP8, bf16, bf16_sr, bf16_split (--master_weights, no FP8;
    with --dtype bfloat16 so the baseline computes in bf16 too and only the weights' storage
    differs)."""

    recipe: FP8Recipe = "tensorwise"
    """torchao FP8 scaling recipe of the e4m3, e5m2 and auto modes (a recipe-named mode has its own)."""

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

    compile: bool = True
    """torch.compile every run, base_train's default. --no_compile: eager runs; emulated FP8 trains
    faster eager on a 2-core CPU (BENCHMARKS.md section 4, the recipe sweep)."""

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
        fp8_modes = [m for m in self.modes if m in ("e5m2", "auto", "auto-recheck")]
        if self.recipe in MX_RECIPES and fp8_modes:
            raise ValueError(f"--recipe {self.recipe} casts every operand to e4m3, so --modes {' '.join(fp8_modes)} "
                             f"cannot run with it: drop them, or give the MXFP8 recipes as modes (--modes baseline "
                             f"e4m3 {' '.join(MX_RECIPES)}) next to another --recipe")
        positive(self, "num_iterations", "jobs", "recheck_every")
        non_negative(self, "gap_target_pct", "auto_tolerance_pct")


QUICK = dict(model_name="d2", num_iterations=8, eval_every=4, eval_tokens=512, seq_len=32,
             batch_size=4, vocab_size=320, warmup_steps=2, lr=1e-2, recheck_every=2)
"""--quick: d2 (width 128, the smallest preset with FP8-eligible layers), 8 steps: more than
auto's 4 calibration steps (--fp8_auto_steps), so auto trains with its calibrated formats, and
auto-recheck re-checks at steps 6 and 8."""


def resolved(cfg: ParityConfig) -> ParityConfig:
    return dataclasses.replace(cfg, **QUICK) if cfg.quick else cfg
