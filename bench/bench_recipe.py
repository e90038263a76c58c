"""Does the recipe's rate hold here? Each group at the recipe's rate against that rate scaled
down and up, the other groups held at theirs, at equal steps.

    .venv/bin/python bench/bench_recipe.py                       # d4, 300 steps of 16 x 256: 7 runs
    .venv/bin/python bench/bench_recipe.py --model_name d2 --batch_size 32 --num_iterations 150
    .venv/bin/python bench/bench_recipe.py --quick --no_compile  # seconds: a dry run (tests)

For a depth, batch and length (base_train's flags), nanochat.optim.recipe gives each group of a
Muon run its rate: the hidden matrices (Muon), the token embedding and the output head (AdamW).
Each group is trained at that rate times each of --factors while the others keep the recipe's;
the recipe's own run is shared by the groups. Per group: the final val bpb at every factor, the
best factor (flagged when it is the grid's edge: the optimum may lie beyond it), and the recipe's
gap to that best in percent. The recipe *holds* here when, for every group, no factor ends more
than --tolerance_pct below the recipe's own run (the mean over --seeds). Within a seed every run
starts from the same weights and sees the same batches. Runs go to --out_dir/<variant>/seed-<s>/
(bench_optimizers' layout and --reuse).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from dataclasses import dataclass

from typing import TYPE_CHECKING

import harness
from bench_optimizers import EqualStepsRuns, Variant, run
from nanochat.common import format_table

if TYPE_CHECKING:
    from nanochat.optim.recipe import RecipeRates

GROUPS = {"matrix": "muon_lr", "embedding": "embedding_lr", "head": "head_lr"}
"""Each group the recipe derives a rate for, and the NanoChatTrainer field that sets it."""


@dataclass(frozen=True, kw_only=True)
class BenchRecipeConfig(EqualStepsRuns):
    """The recipe's rate of each group against that rate scaled, at equal steps."""

    num_iterations: int = 300
    batch_size: int = 16
    groups: tuple[str, ...] = tuple(GROUPS)
    """Which groups to scale: matrix (Muon), embedding, head."""
    factors: tuple[float, ...] = (0.5, 2.0)
    """Each group's rate is tried at the recipe's times each of these (1 is the recipe's run)."""
    seeds: tuple[int, ...] = (1,)
    """Seeds; every run trains once per seed."""
    tolerance_pct: float = 0.3
    """The recipe holds when no factor ends more than this (percent of val bpb) below its own run."""
    out_dir: str = "runs/bench_recipe"
    """Where the runs go."""

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = [g for g in self.groups if g not in GROUPS]
        if unknown:
            raise ValueError(f"--groups: unknown {', '.join(unknown)}; choose from {', '.join(GROUPS)}")
        if not self.groups or not self.seeds or not self.factors:
            raise ValueError("--groups, --seeds and --factors each need at least one value")
        if any(not f > 0 or f == 1 for f in self.factors):
            raise ValueError(f"--factors must be positive and not 1 (the recipe's own run), got {self.factors}")


QUICK = dict(model_name="d2", num_iterations=6, eval_every=3, eval_tokens=256, seq_len=32, batch_size=4,
             vocab_size=320, warmup_steps=2, factors=(2.0,))


def rates_for(cfg: BenchRecipeConfig) -> RecipeRates:
    """The recipe's rates for this run's width and tokens a step (one process: batch x seq_len)."""
    from nanochat.model.gpt import preset_config  # torch: not for --help
    from nanochat.optim.recipe import recipe_rates

    width = preset_config(cfg.model_name, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len).n_embd
    return recipe_rates(width=width, tokens_per_step=cfg.batch_size * cfg.seq_len, lr=cfg.lr)


def variant(rates: RecipeRates, group: str | None = None, factor: float = 1.0) -> Variant:
    """A Muon run at the recipe's rates, `group`'s times `factor`; every rate set explicitly."""
    fields = {field: rates.for_role(g) * (factor if g == group else 1.0) for g, field in GROUPS.items()}
    extra = tuple((f, v) for f, v in fields.items() if f != "muon_lr")
    return Variant("muon", fields["muon_lr"], extra=extra, label="recipe" if group is None else f"{group}-x{factor:g}")


def bench(cfg: BenchRecipeConfig) -> dict:
    rates, done = rates_for(cfg), {}
    print(f"bench_recipe: {cfg.model_name}, {cfg.batch_size} x {cfg.seq_len} tokens a step: "
          + ", ".join(f"{g} {rates.for_role(g):.4g}" for g in cfg.groups), flush=True)

    def mean_bpb(v: Variant) -> float:
        return statistics.fmean(run(cfg, v, s, done)["val_bpb"] for s in cfg.seeds)

    base = mean_bpb(variant(rates))
    rows, per_group = [], {}
    for group in cfg.groups:
        tried = {1.0: base, **{f: mean_bpb(variant(rates, group, f)) for f in cfg.factors}}
        top = min(tried, key=tried.get)
        edge = top in (min(tried), max(tried))
        gap = 100 * (base - tried[top]) / tried[top]
        per_group[group] = dict(rate=rates.for_role(group), rule=rates.rules[group],
                                val_bpb={f"{f:g}": b for f, b in sorted(tried.items())}, best_factor=top,
                                best_at_grid_edge=edge, recipe_gap_pct=gap, holds=gap <= cfg.tolerance_pct)
        for f, b in sorted(tried.items()):
            mark = ("best" + (" (grid edge)" if edge else "")) if f == top else ""
            rows.append([group, f"{f:g}", f"{rates.for_role(group) * f:.4g}", f"{b:.4f}", mark])
    holds = all(g["holds"] for g in per_group.values())
    print(f"\n{cfg.model_name}, {cfg.num_iterations} steps of {cfg.batch_size} x {cfg.seq_len}, seeds "
          f"{' '.join(map(str, cfg.seeds))}: final val bpb ({harness.load()})")
    print(format_table(["group", "x recipe", "rate", "val bpb", ""], rows))
    for group, g in per_group.items():
        print(f"{group}: the recipe's rate is {g['recipe_gap_pct']:.2f}% above the best of its grid (x{g['best_factor']:g})")
    print(f"the recipe {'holds' if holds else 'does not hold'} here (every group within {cfg.tolerance_pct}% of its "
          f"grid's best)")
    return dict(config=dataclasses.asdict(cfg), rates=rates.as_dict(), groups=per_group, holds=holds,
                runs={v.name: {str(s): r for (vv, s), r in done.items() if vv == v} for v in {v for v, _ in done}})


def main(argv: list[str] | None = None) -> int:
    return harness.main(BenchRecipeConfig, bench, argv, quick=QUICK)


if __name__ == "__main__":
    sys.exit(main())
