"""The recipe's rates: each parameter group's peak learning rate for a Muon run trained from
scratch, derived from the run's width and tokens a step, as karpathy/nanochat derives its rates
from `--depth` and the batch.

A rate is tuned at one reference run and carried to others by a scaling rule. karpathy/nanochat
tunes at d12 (width 768) and 2**19 tokens a step and scales every rate by sqrt(B / 2**19); at
4,096 tokens a step that gives Muon 0.0018, which at d2 and d4 ends far above what 0.02 reaches
(BENCHMARKS.md 13). Our reference is a run we can sweep on a CPU, d4 at 4,096 tokens a step, each
group's rate there the best of a sweep (BENCHMARKS.md 14), carried by these rules:

- batch, every group: `sqrt(min(B, B_MAX) / B_REF)`. The square-root rule for Adam-like updates
  (Malladi et al., "On the SDEs and scaling rules for adaptive gradient algorithms", NeurIPS
  2022), which karpathy/nanochat applies to every group. Muon's measured optimum rises at least
  that fast from 2,048 to 8,192 tokens a step (x1.5 and x1.8 a doubling) and is flat around the
  rule's rate (BENCHMARKS.md 14); the AdamW groups' batch rule is the paper's, not measured here.
  Past B_MAX, the largest batch measured, the rates hold: the best rate stops rising once the
  batch passes the critical batch size (McCandlish et al., "An empirical model of large-batch
  training", 2018), and held there they land near karpathy/nanochat's, tuned at d12 and 2**19
  tokens a step: Muon 0.042 against 0.02, embedding 0.16 against 0.3, head 0.0082 against 0.008.
- width, Muon's matrices: none. An orthogonalized update has spectral norm ~1 at any width, and
  `sqrt(max(1, rows / columns))` per matrix (torch.optim.Muon's factor) keeps the step's size per
  unit of the matrix's scale (Bernstein and Newhouse, "Modular duality in deep learning", 2024);
  karpathy/nanochat keeps its matrix rate across depths alike.
- width, the embedding and the output head (AdamW): `(width / WIDTH_REF) ** -0.5`,
  karpathy/nanochat's rule for its AdamW groups; our d2 and d4 optima agree with it to within
  the sweep's grid (BENCHMARKS.md 14).
- norm weights and biases: `--lr`, unscaled (the presets have none).

A rate the user gives (--muon_lr, --embedding_lr, --head_lr) is taken as given, never scaled.

Weight decay (Muon's matrices and the output head; the embedding and vectors get none). Decoupled
decay makes the weights an exponential average of their recent updates over about 1 / (lr x
decay) steps (Wang and Aitchison, "How to set AdamW's weight decay as you scale model and dataset
size", arXiv 2405.13698). A run that sees each token once keeps WEIGHT_DECAY_REF: the matrices average
over 1 / (0.03 x 0.1) = 333 steps. Once a run repeats its data, an average longer than an epoch
sums several passes over the same text, and a small corpus gets memorized: on tiny Shakespeare
(72 steps an epoch, 1,000 steps) the validation loss rose from its best 2.31 to 3.42 bpb, a
training loss of 0.12 (BENCHMARKS.md 13). So a run that repeats its data keeps the matrices'
average within one epoch: `max(WEIGHT_DECAY_REF, 1 / (Muon's rate x steps an epoch))`. A corpus
whose epoch is longer than 333 steps at the reference rate is unchanged (the standard-library
corpus: 840 steps an epoch). A --weight_decay given is taken as given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

B_REF = 4096
"""Tokens a step of the reference run (16 x 256), that of every goal run of BENCHMARKS.md 13."""
B_MAX = 8192
"""The largest batch the rates were measured at (BENCHMARKS.md 14): past it they hold."""
WIDTH_REF = 256
"""Width of the reference run (d4)."""
MUON_REF = 0.03
"""Muon's rate at the reference (BENCHMARKS.md 14)."""
EMBEDDING_REF = 0.2
"""The embedding's AdamW rate at the reference (BENCHMARKS.md 14)."""
HEAD_REF = 0.01
"""The output head's AdamW rate at the reference (BENCHMARKS.md 14)."""
WEIGHT_DECAY_REF = 0.1
"""Decoupled weight decay of Muon's matrices and the output head while a run sees its data once."""


@dataclass(frozen=True)
class RecipeRates:
    """Each role's peak rate (MuonSplit's group roles), per role the rule that gave it, and the
    roles whose rate is a flag's value (`given`) rather than derived from the run's shape."""

    matrix: float
    embedding: float
    head: float
    vector: float
    rules: dict[str, str]
    given: frozenset[str] = frozenset()
    weight_decay: float = WEIGHT_DECAY_REF
    weight_decay_rule: str = f"{WEIGHT_DECAY_REF:g}"

    def for_role(self, role: str) -> float:
        return getattr(self, role)

    def derived(self, role: str) -> bool:
        """Whether the role's rate (or "weight_decay") follows from the run's shape, so may change
        with the recipe."""
        return role not in self.given

    def describe(self) -> str:
        """One line per role: its rate and where it came from, then the weight decay, for a run's header."""
        return "\n".join([*(f"{role}: {self.for_role(role):.4g} ({rule})" for role, rule in self.rules.items()),
                          f"weight decay: {self.weight_decay:.4g} ({self.weight_decay_rule})"])

    def as_dict(self) -> dict[str, float]:
        return {role: self.for_role(role) for role in self.rules}


def recipe_weight_decay(*, matrix_lr: float, steps_per_epoch: int | None, total_steps: int | None) -> tuple[float, str]:
    """The decay of a run whose matrices train at `matrix_lr` for `total_steps` steps of
    `steps_per_epoch` each (None: not known, taken as seen once), and the rule that gave it."""
    if steps_per_epoch is None or total_steps is None or total_steps <= steps_per_epoch:
        return WEIGHT_DECAY_REF, f"{WEIGHT_DECAY_REF:g}: the run sees its data once"
    epochs = f"{total_steps / steps_per_epoch:.3g} epochs of {steps_per_epoch} steps"
    within = 1.0 / (matrix_lr * steps_per_epoch)
    if within <= WEIGHT_DECAY_REF:
        return WEIGHT_DECAY_REF, (f"{WEIGHT_DECAY_REF:g}: {epochs}, 1 / (Muon's rate x steps an epoch) = "
                                  f"{within:.3g} is below it")
    return within, (f"1 / (Muon's rate {matrix_lr:.4g} x {steps_per_epoch} steps an epoch): the run repeats its "
                    f"data ({epochs}), the matrices' average is kept within one")


def recipe_rates(*, width: int, tokens_per_step: int, lr: float, muon_lr: float | None = None,
                 embedding_lr: float | None = None, head_lr: float | None = None, weight_decay: float | None = None,
                 steps_per_epoch: int | None = None, total_steps: int | None = None) -> RecipeRates:
    """Each group's peak rate for a run of `width` (the model's hidden size) and `tokens_per_step`
    (all ranks and micro-batches together), and the weight decay for `total_steps` steps of
    `steps_per_epoch` each; a value given is kept, the others follow the rules."""
    if width < 1 or tokens_per_step < 1:
        raise ValueError(f"width and tokens_per_step must be positive, got {width} and {tokens_per_step}")
    batch = math.sqrt(min(tokens_per_step, B_MAX) / B_REF)
    held = f", held at B = {B_MAX:,}" if tokens_per_step > B_MAX else ""
    shape = f"width {width}, {tokens_per_step:,} tokens a step"

    def pick(given: float | None, flag: str, ref: float, *, by_width: bool, note: str = "") -> tuple[float, str]:
        if given is not None:
            return given, f"{flag}, as given"
        width_rule = f" x (width / {WIDTH_REF}) ** -0.5" if by_width else ""
        scale = batch * ((width / WIDTH_REF) ** -0.5 if by_width else 1.0)
        return ref * scale, f"{ref:g}{width_rule} x sqrt(B / {B_REF}){held}{note}; {shape}"

    matrix = pick(muon_lr, "--muon_lr", MUON_REF, by_width=False, note=", x sqrt(max(1, rows / columns)) per matrix")
    embedding = pick(embedding_lr, "--embedding_lr", EMBEDDING_REF, by_width=True)
    head = pick(head_lr, "--head_lr", HEAD_REF, by_width=True)
    roles = dict(matrix=matrix, embedding=embedding, head=head, vector=(lr, "--lr, unscaled"))
    flags = (("matrix", muon_lr), ("embedding", embedding_lr), ("head", head_lr), ("weight_decay", weight_decay))
    given = {"vector"} | {role for role, flag in flags if flag is not None}
    decay = ((weight_decay, "--weight_decay, as given") if weight_decay is not None else
             recipe_weight_decay(matrix_lr=matrix[0], steps_per_epoch=steps_per_epoch, total_steps=total_steps))
    return RecipeRates(**{role: rate for role, (rate, _) in roles.items()},
                       rules={role: rule for role, (_, rule) in roles.items()}, given=frozenset(given),
                       weight_decay=decay[0], weight_decay_rule=decay[1])


__all__ = ["B_MAX", "B_REF", "EMBEDDING_REF", "HEAD_REF", "MUON_REF", "RecipeRates", "WEIGHT_DECAY_REF", "WIDTH_REF",
           "recipe_rates", "recipe_weight_decay"]
