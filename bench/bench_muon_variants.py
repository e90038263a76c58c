"""What torch.optim.Muon lacks, each tried alone against plain Muon at equal steps, over seeds.

    .venv/bin/python bench/bench_muon_variants.py               # d4, 250 steps, 3 seeds: 12 runs
    .venv/bin/python bench/bench_muon_variants.py --reuse       # after an interruption: train what is missing
    .venv/bin/python bench/bench_muon_variants.py --quick --no_compile   # seconds: a dry run (tests)

Every run is --optimizer muon at --muon_lr (bench_optimizers' best at d4) with base_train's
other defaults; plain Muon is torch.optim.Muon's step with a constant momentum
(--muon_momentum_warmup 0), and a variant adds:

- momentum_warmup: --muon_momentum_warmup 100 (momentum from 0.85 to 0.95 over 100 steps)
- normuon: --muon_normuon (each neuron's update normalized by an EMA of its mean square)
- momentum_warmup+normuon: both

Polar Express coefficients and cautious weight decay were measured the same way and did not help
(BENCHMARKS.md 12(f)). Within a seed every run starts from the same weights and sees the same
batches, so a seed's difference is the variant's alone. Per seed: each run's final val bpb, its difference to plain
Muon's in percent, and the steps plain Muon needs to reach the variant's final bpb (`steps_to`;
"never" when the variant ends lower than plain Muon ever gets). A variant *helps* when its
final bpb is below plain Muon's on every seed; the verdicts are printed, the ones that do not
help too. Runs go to --out_dir/<variant>/seed-<seed>/ (bench_optimizers' layout and --reuse).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from dataclasses import dataclass
from typing import Any

import harness
from bench_optimizers import EqualStepsRuns, Variant, run
from nanochat.common import format_table

PLAIN = (("muon_momentum_warmup", 0),)
"""The baseline's fields: torch.optim.Muon's step, no momentum warmup (base_train's default has one)."""

ADDITIONS: dict[str, tuple[tuple[str, Any], ...]] = {
    "momentum_warmup": (("muon_momentum_warmup", 100),),
    "normuon": (("muon_momentum_warmup", 0), ("muon_normuon", True)),
    "momentum_warmup+normuon": (("muon_momentum_warmup", 100), ("muon_normuon", True)),
}
"""Each variant's NanoChatTrainer fields. momentum_warmup's 100 steps are 40% of a 250-step
run (karpathy/nanochat's 400 are a few percent of its runs; at 250 steps the warmup must end
early enough for the target momentum to matter)."""


@dataclass(frozen=True, kw_only=True)
class BenchMuonVariantsConfig(EqualStepsRuns):
    """Plain Muon against Muon with its additions, at equal steps, over seeds."""

    muon_lr: float = 0.02
    """Muon's peak learning rate of every run (bench_optimizers' best at d4); the AdamW groups at the
    recipe's rates (nanochat.optim.recipe)."""
    variants: tuple[str, ...] = tuple(ADDITIONS)
    """Which additions to try: momentum_warmup, normuon, and the two together."""
    seeds: tuple[int, ...] = (1, 2, 3)
    """Seeds; every variant and plain Muon train once per seed."""
    out_dir: str = "runs/bench_muon_variants"
    """Where the runs go."""

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = [v for v in self.variants if v not in ADDITIONS]
        if unknown:
            raise ValueError(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(ADDITIONS)}")
        if not self.seeds:
            raise ValueError("--seeds is empty; give at least one value")


QUICK = dict(model_name="d2", num_iterations=6, eval_every=3, eval_tokens=256, seq_len=32, batch_size=4,
             vocab_size=320, warmup_steps=2, seeds=(1,))


def bench(cfg: BenchMuonVariantsConfig) -> dict:
    done: dict = {}
    plain = Variant("muon", cfg.muon_lr, extra=PLAIN)
    tried = {name: Variant("muon", cfg.muon_lr, extra=ADDITIONS[name], label=name) for name in cfg.variants}
    runs = {s: {"plain": run(cfg, plain, s, done), **{n: run(cfg, v, s, done) for n, v in tried.items()}}
            for s in cfg.seeds}
    rows, per_variant = [], {}
    for name in cfg.variants:
        gaps, reached = [], []
        for s in cfg.seeds:
            base, r = runs[s]["plain"], runs[s][name]
            gap = 100 * (r["val_bpb"] - base["val_bpb"]) / base["val_bpb"]
            to = harness.steps_to(r["val_bpb"], base["val_step"], base["val_bpb_curve"])
            gaps.append(gap)
            reached.append(None if to is None else to / base["steps"])
            rows.append([name, s, f"{base['val_bpb']:.4f}", f"{r['val_bpb']:.4f}", f"{gap:+.2f}%",
                         "never" if to is None else f"{to:.0f}"])
        helps = all(g < 0 for g in gaps)
        per_variant[name] = dict(gap_pct=gaps, gap_mean_pct=statistics.fmean(gaps), helps=helps,
                                 plain_steps_to_variant_final=reached)
    print(f"\n{cfg.model_name}, {cfg.num_iterations} steps of {cfg.batch_size} x {cfg.seq_len}, Muon lr "
          f"{cfg.muon_lr:g}, seeds {' '.join(map(str, cfg.seeds))}: final val bpb ({harness.load()})")
    print(format_table(["variant", "seed", "plain Muon", "variant", "gap", "plain Muon's steps to it"], rows))
    for name, f in per_variant.items():
        print(f"{name}: mean gap {f['gap_mean_pct']:+.2f}%: "
              + ("helps (lower on every seed)" if f["helps"] else "does not help (not lower on every seed)"))
    return dict(config=dataclasses.asdict(cfg), variants=per_variant,
                runs={str(s): r for s, r in runs.items()})


def main(argv: list[str] | None = None) -> int:
    return harness.main(BenchMuonVariantsConfig, bench, argv, quick=QUICK)


if __name__ == "__main__":
    sys.exit(main())
