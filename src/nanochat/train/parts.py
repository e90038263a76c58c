"""The parts of a run that the model's conversion and spread decide, built from its config.

Three decisions the trainer makes once, in this order, between building the model and the first
step: FP8's config (the flags plus what only the run knows: its micro-batch, the layers a resumed
run converted, FSDP's FP8 all-gather), the module a step calls (DDP, FSDP or TP, or the model
itself) and the optimizer (AdamW, or Muon with AdamW, as FP8Training wraps it), whose groups keep
their peak rates through a resume (keep_peaks). Functions of values, so each can be read, and
called, without a trainer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from nanochat.common import UsageError, warn_once
from nanochat.config import TrainConfig
from nanochat.config.fields import Fallbacks, ScheduleFields
from nanochat.fp8 import FP8Config, FP8Training
from nanochat.fp8.all_gather import fp8_all_gather_problem
from nanochat.model.gpt import GPT
from nanochat.model.parallelize import tp_plan
from nanochat.optim import MuonAdamW, muon_param_groups
from nanochat.optim.recipe import WEIGHT_DECAY_REF, RecipeRates, recipe_rates
from nanochat.optim.muon import NORMUON_BETA2
from nanochat.parallel.layout import Layout
from nanochat.parallel.wrap import wrap_model


def fp8_config(cfg: TrainConfig, model: GPT, layout: Layout,
               resumed: dict[str, Any] | None) -> tuple[FP8Config, str | None]:
    """The FP8 flags plus what only the trainer knows: the tokens per micro-batch (the M at
    which --fp8_layers faster times the layers), the layers a resumed run converted (`resumed`:
    its checkpoint's metadata), and whether FSDP all-gathers the FP8 weights in FP8 (decided
    before converting: torchao wraps the weights for it then); and why not, if it does not
    (None: it does, or no FSDP)."""
    config = dataclasses.replace(cfg.fp8_config(), micro_batch_tokens=cfg.batch_size * cfg.seq_len)
    saved = resumed.get("fp8_converted") if resumed is not None else None
    if cfg.fp8 and saved is not None:  # a checkpoint saved without the list: the rules decide
        config = dataclasses.replace(config, converted_layers=tuple(saved))
    problem = None
    if cfg.fp8 and layout.fsdp:
        problem = fp8_all_gather_problem(model, config, shards=layout.dp_size, tp=layout.tp)
        config = dataclasses.replace(config, fsdp_float8_all_gather=problem is None)
    return config, problem


def parallelize(cfg: TrainConfig, model: GPT, fp8: FP8Training, layout: Layout, *, device: torch.device,
                all_gather_problem: str | None, fallbacks: Fallbacks) -> tuple[torch.nn.Module, str]:
    """The module the training step calls for this world size (DDP around `model`, or `model`
    itself: one process, or split in place by TP and FSDP) and how it is spread
    (TrainResult.parallel). The layout's and the TP plan's fallbacks go to `fallbacks`."""
    plan = tp_plan(model, layout.tp) if layout.tp > 1 else None
    for note in layout.fallbacks + (plan.fallbacks if plan is not None else ()):
        fallbacks.add(note)
    if not layout.distributed:
        return model, layout.name
    parallel = layout.name
    if layout.fsdp and fp8.has_fp8_layers:
        parallel += (f", fp8 all-gather on ({len(fp8.report.converted)} layers' weights all-gathered in "
                     f"{cfg.fp8_mode}, scales precomputed after each optimizer step)"
                     if fp8.config.fsdp_float8_all_gather else f", fp8 all-gather off: {all_gather_problem}")
    return wrap_model(model, layout, device=device, blocks=model.transformer.h, plan=plan), parallel


LR_DEFAULT = ScheduleFields.lr
"""--lr's default: a Muon run given another rate for a model with no norm weight or bias is told
that the flag trains nothing."""


def build_optimizer(cfg: TrainConfig, model: GPT, fp8: FP8Training, device: torch.device, tokens_per_step: int,
                    *, steps_per_epoch: int | None = None,
                    total_steps: int | None = None) -> tuple[torch.optim.Optimizer, RecipeRates | None]:
    """--optimizer as FP8Training wraps it (FP8 moments: --fp8_opt_level; bf16 --master_weights;
    --optimizer_in_backward), built on the parameters a step trains: after FSDP has replaced
    them. adamw: AdamW at --lr, no weight decay on embeddings / norms / biases. muon: MuonAdamW,
    Muon for the hidden matrices and that AdamW for the rest (nanochat.optim.muon_param_groups),
    each group at the recipe's rate for this width and `tokens_per_step`, and the recipe's
    weight decay for `total_steps` of `steps_per_epoch` (nanochat.optim.recipe), which the rates
    come back with. Each group's `initial_lr` is its peak rate, which the schedule scales."""
    # fused: one kernel for all parameters (CPU and CUDA); FP8Optim steps its FP8-state
    # parameters itself and hands the rest to this same optimizer, so baselines match.
    adam = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, fused=device.type in ("cpu", "cuda"))
    if cfg.optimizer == "muon":
        split = muon_param_groups(model)
        if not split.muon:
            raise UsageError(f"--optimizer muon: {cfg.model_name} has no hidden nn.Linear matrix for Muon to train "
                             "(every parameter would go to AdamW); use --optimizer adamw")
        vectors = any(group["role"] == "vector" for group in split.adamw)
        if cfg.lr != LR_DEFAULT and not vectors:
            warn_once("lr-trains-nothing", f"--lr {cfg.lr:g} trains no parameter of {cfg.model_name} under --optimizer "
                      "muon: it sets the norms' and biases' rate, and this model has none; the matrices, the "
                      "embedding and the head train at the recipe's rates: give --muon_lr, --embedding_lr or "
                      "--head_lr, or --optimizer adamw")
        rates = recipe_rates(width=model.config.n_embd, tokens_per_step=tokens_per_step, lr=cfg.lr,
                             muon_lr=cfg.muon_lr, embedding_lr=cfg.embedding_lr, head_lr=cfg.head_lr,
                             weight_decay=cfg.weight_decay, steps_per_epoch=steps_per_epoch, total_steps=total_steps)
        if not vectors:  # the header's line for --lr says that it trains nothing here
            rates = dataclasses.replace(rates, rules={**rates.rules, "vector": f"--lr; unused: {cfg.model_name} "
                                                                                "has no norm weight or bias"})
        momentum = cfg.muon_beta
        muon = torch.optim.Muon(split.muon, lr=rates.matrix, momentum=momentum, nesterov=True,
                                weight_decay=rates.weight_decay)
        for group in muon.param_groups:  # what torch's step lacks; the wrapper steps such groups (muon.muon_flags)
            group["normuon"] = NORMUON_BETA2 if cfg.muon_normuon else 0.0
        optimizer = MuonAdamW(muon, torch.optim.AdamW(split.adamw, weight_decay=rates.weight_decay, **adam),
                              placements=split.placements)
        peaks = [rates.for_role(group["role"]) for group in optimizer.param_groups]
    else:
        decay = WEIGHT_DECAY_REF if cfg.weight_decay is None else cfg.weight_decay
        optimizer, rates = torch.optim.AdamW(model.param_groups(decay), **adam), None
        peaks = [cfg.lr] * len(optimizer.param_groups)
    for group, peak in zip(optimizer.param_groups, peaks):
        group["initial_lr"] = peak
    return fp8.wrap_optimizer(optimizer, master_weights=cfg.master_weights, seed=cfg.seed,
                              emulate=cfg.master_weights_emulate, in_backward=cfg.optimizer_in_backward), rates


def keep_peaks(optimizer: torch.optim.Optimizer, peaks: list[float], decays: list[float], roles: list[str | None],
               rates: RecipeRates | None) -> list[str]:
    """After a resume replaced the groups with the checkpoint's: each takes this run's peak and
    weight decay (`peaks`, `decays`, as build_optimizer set them) and keeps its role. Returns one
    line per group whose derived rate or decay differs from the checkpoint's (the recipe, or the
    run's epochs, changed since it was written); a changed flag is said with the other flags
    (nanochat.checkpoint.resume.changed_settings)."""
    changed = []
    for group, peak, decay, role in zip(optimizer.param_groups, peaks, decays, roles):
        saved, saved_decay = group.get("initial_lr", peak), group.get("weight_decay", decay)
        derived = role is not None and rates is not None and rates.derived(role)
        if derived and not math.isclose(saved, peak, rel_tol=1e-9):
            changed.append(f"resumed with the {role} group's peak learning rate changed from the checkpoint's "
                           f"{saved:.4g} to {peak:.4g} ({rates.rules[role]})")
        if rates is not None and rates.derived("weight_decay") and not math.isclose(saved_decay, decay, rel_tol=1e-9):
            changed.append(f"resumed with the {role} group's weight decay changed from the checkpoint's "
                           f"{saved_decay:.4g} to {decay:.4g} ({rates.weight_decay_rule})")
        group.update(initial_lr=peak, weight_decay=decay, **({"role": role} if role else {}))
    return changed


__all__ = ["build_optimizer", "fp8_config", "keep_peaks", "parallelize"]
