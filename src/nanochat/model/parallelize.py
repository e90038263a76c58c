"""The GPT's tensor-parallel plan: which of its layers split over a group of ranks, and how.

Megatron's layout. Per block, q/k/v and the MLP's first Linear (and its gate) split their output
features over the group (column-wise), the attention's and the MLP's output projections their
input features (row-wise, one all-reduce each), so the residual stream stays whole on every rank
and a block costs two all-reduces forward and two backward. The embedding splits its rows and
the head its columns over the vocabulary where it divides, their outputs gathered whole. The
attention reads its head count from the projections' local width (gpt.py).

Names only: nanochat.parallel.wrap applies the plan (with torchao's FP8 styles for tensorwise
FP8 layers), so the model stays plain torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from nanochat.model.gpt import GPT, GPTConfig

Split = Literal["colwise", "rowwise", "embedding", "head"]
"""How one module splits: a Linear's output features (colwise) or input features (rowwise), an
embedding's rows over the vocabulary (input and output whole), a head's columns over the
vocabulary (output gathered whole)."""


@dataclass(frozen=True)
class TPPlan:
    """`splits`: each split module's name and how it splits, in the order to apply them; every
    other parameter stays whole on every rank. `fallbacks`: what stays whole that could split,
    with the reason (the run records them)."""

    splits: dict[str, Split]
    fallbacks: tuple[str, ...] = ()


def tp_problem(config: GPTConfig, tp: int) -> str | None:
    """Why a GPT of `config` cannot split its layers over `--tp tp` ranks, else None: each rank
    must hold whole heads and an equal share of the MLP's hidden features."""
    sizes = {"n_head": config.n_head, "n_kv_head": config.n_kv_head, "intermediate_size": config.intermediate_size}
    bad = [f"{name} {n}" for name, n in sizes.items() if n % tp]
    if not bad:
        return None
    return (f"--tp {tp}: the model's {', '.join(bad)} do not divide by {tp}, and each rank must hold whole heads "
            f"and an equal share of the MLP; choose --tp among the common divisors (e.g. "
            f"{math.gcd(*sizes.values())} or a divisor of it)")


def vocab_parallel_problem(config: GPTConfig, tp: int) -> str | None:
    """Why the embedding and the head of `config` stay whole on every rank under `--tp tp`,
    else None (they split the vocabulary)."""
    if config.tie_embeddings:
        return "tied embedding and head stay whole on every rank under --tp (one weight, two layouts)"
    if config.vocab_size % tp:
        return (f"the vocabulary ({config.vocab_size}) does not divide by --tp {tp}: the embedding and the head "
                "stay whole on every rank")
    return None


def tp_plan(model: GPT, tp: int) -> TPPlan:
    """`model`'s plan over `tp` ranks (module docstring); its config passed `tp_problem`."""
    splits: dict[str, Split] = {}
    for i, block in enumerate(model.transformer.h):
        gate = ("mlp.c_gate",) if block.mlp.c_gate is not None else ()
        for name in ("attn.c_q", "attn.c_k", "attn.c_v", "mlp.c_fc", *gate):
            splits[f"transformer.h.{i}.{name}"] = "colwise"
        for name in ("attn.c_proj", "mlp.c_proj"):
            splits[f"transformer.h.{i}.{name}"] = "rowwise"
    whole = vocab_parallel_problem(model.config, tp)
    if whole is None:
        splits.update({"transformer.wte": "embedding", "lm_head": "head"})
    return TPPlan(splits, fallbacks=() if whole is None else (f"tp: {whole}",))


__all__ = ["Split", "TPPlan", "tp_plan", "tp_problem", "vocab_parallel_problem"]
