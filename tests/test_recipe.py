"""The recipe's rates (nanochat.optim.recipe.recipe_rates) against each rule written out by hand.

- At the reference run (WIDTH_REF, B_REF tokens a step) every derived rate is its reference
  constant, exactly (each factor is 1.0).
- Batch: a quarter of the tokens a step halves every group's rate (the square-root rule); past
  B_MAX, the largest batch measured, every rate holds at its value there. Width: 4x the width halves the embedding's and
  the head's rates and leaves Muon's (its per-shape factor carries it). Compared to fp64 rounding
  of a few products (rel 1e-12).
- A rate given is kept as given, its rule says so and it is not counted derived (a resume warns only of
  derived rates); --lr is the vectors' rate whatever the shape, and a flag's.
- Weight decay: WEIGHT_DECAY_REF for a run that sees its data once (or whose epochs are not
  known), and for one that repeats a corpus whose epoch is long enough that 1 / (Muon's rate x
  steps an epoch) is below it (the standard library's 840 steps); 1 / (Muon's rate x steps an
  epoch) for one that repeats a small corpus (tiny Shakespeare's 72 steps: 0.463), at any
  number of epochs past one; a --weight_decay given is kept and not derived. Each rule's text
  says which branch it took.
- A width or batch that is not positive is refused with one line.
- The rates a 48-GPU d26 run would get (width 1664, 2**20 tokens a step) are finite and inside the
  range the documents cite (docs/muon.md): Muon 0.02-0.05, embedding below 1, head below 0.1.
"""

from __future__ import annotations

import math

import pytest

from nanochat.optim.recipe import (
    B_MAX, B_REF, EMBEDDING_REF, HEAD_REF, MUON_REF, WEIGHT_DECAY_REF, WIDTH_REF, recipe_rates, recipe_weight_decay,
)


def test_the_reference_run_gets_the_reference_rates():
    r = recipe_rates(width=WIDTH_REF, tokens_per_step=B_REF, lr=1e-3)
    assert (r.matrix, r.embedding, r.head, r.vector) == (MUON_REF, EMBEDDING_REF, HEAD_REF, 1e-3)
    assert set(r.rules) == {"matrix", "embedding", "head", "vector"} and r.as_dict()["head"] == HEAD_REF


def test_batch_scales_every_group_by_its_square_root_up_to_the_largest_batch_measured():
    assert B_REF < B_MAX
    small = recipe_rates(width=WIDTH_REF, tokens_per_step=B_REF // 4, lr=1e-3)
    assert small.matrix == pytest.approx(MUON_REF / 2, rel=1e-12)
    assert small.embedding == pytest.approx(EMBEDDING_REF / 2, rel=1e-12)
    assert small.head == pytest.approx(HEAD_REF / 2, rel=1e-12)
    at_max = recipe_rates(width=WIDTH_REF, tokens_per_step=B_MAX, lr=1e-3)
    past = recipe_rates(width=WIDTH_REF, tokens_per_step=64 * B_MAX, lr=1e-3)
    assert at_max.matrix == pytest.approx(MUON_REF * math.sqrt(B_MAX / B_REF), rel=1e-12)
    assert (past.matrix, past.embedding, past.head) == (at_max.matrix, at_max.embedding, at_max.head)
    assert all("held" in rule for role, rule in past.rules.items() if role != "vector")
    assert not any("held" in rule for rule in at_max.rules.values())


def test_width_scales_the_adamw_groups_by_its_inverse_square_root_and_leaves_muon():
    wide = recipe_rates(width=4 * WIDTH_REF, tokens_per_step=B_REF, lr=1e-3)
    assert wide.matrix == MUON_REF
    assert wide.embedding == pytest.approx(EMBEDDING_REF / 2, rel=1e-12)
    assert wide.head == pytest.approx(HEAD_REF / 2, rel=1e-12)
    assert wide.vector == 1e-3
    assert [role for role in wide.rules if wide.derived(role)] == ["matrix", "embedding", "head"]


def test_a_rate_given_is_kept_and_said_to_be():
    r = recipe_rates(width=3 * WIDTH_REF, tokens_per_step=7 * B_REF, lr=2e-3, muon_lr=0.011, embedding_lr=0.05,
                     head_lr=0.004)
    assert (r.matrix, r.embedding, r.head, r.vector) == (0.011, 0.05, 0.004, 2e-3)
    assert r.rules == {"matrix": "--muon_lr, as given", "embedding": "--embedding_lr, as given",
                       "head": "--head_lr, as given", "vector": "--lr, unscaled"}
    assert not any(r.derived(role) for role in r.rules)
    lines = r.describe().splitlines()
    assert len(lines) == 5 and lines[0].startswith("matrix: 0.011 (") and lines[-1].startswith("weight decay: 0.1 (")


def test_weight_decay_keeps_the_matrices_average_within_an_epoch_once_a_run_repeats_its_data():
    for steps_per_epoch, total_steps in ((None, None), (72, 72), (840, 300), (840, 1000)):
        decay, rule = recipe_weight_decay(matrix_lr=MUON_REF, steps_per_epoch=steps_per_epoch, total_steps=total_steps)
        assert decay == WEIGHT_DECAY_REF and rule.startswith(f"{WEIGHT_DECAY_REF:g}: "), (steps_per_epoch, total_steps)
    assert "0.0397 is below it" in recipe_weight_decay(matrix_lr=MUON_REF, steps_per_epoch=840, total_steps=1000)[1]
    for total_steps in (73, 300, 1000):
        decay, rule = recipe_weight_decay(matrix_lr=MUON_REF, steps_per_epoch=72, total_steps=total_steps)
        assert decay == pytest.approx(1 / (MUON_REF * 72), rel=1e-12) and "the run repeats its data" in rule
    r = recipe_rates(width=WIDTH_REF, tokens_per_step=B_REF, lr=1e-3, steps_per_epoch=72, total_steps=1000)
    assert round(r.weight_decay, 3) == 0.463 and r.derived("weight_decay")
    given = recipe_rates(width=WIDTH_REF, tokens_per_step=B_REF, lr=1e-3, weight_decay=0.2, steps_per_epoch=72,
                         total_steps=1000)
    assert given.weight_decay == 0.2 and not given.derived("weight_decay")
    assert given.weight_decay_rule == "--weight_decay, as given"


@pytest.mark.parametrize("width, tokens", [(0, B_REF), (WIDTH_REF, 0), (-1, B_REF)])
def test_a_shape_that_is_not_positive_is_refused(width, tokens):
    with pytest.raises(ValueError) as e:
        recipe_rates(width=width, tokens_per_step=tokens, lr=1e-3)
    assert "must be positive" in str(e.value) and "\n" not in str(e.value)


def test_a_d26_run_at_a_million_tokens_a_step_gets_rates_in_the_published_range():
    r = recipe_rates(width=1664, tokens_per_step=2 ** 20, lr=3e-3)
    assert 0.02 <= r.matrix <= 0.05
    assert 0 < r.embedding < 1 and 0 < r.head < 0.1
