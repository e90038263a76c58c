"""FP8Training: FP8 as one component of a training loop, called at fixed points.

A loop that trains in FP8 must do things in an order: convert before torch.compile, calibrate
`mode="auto"` eagerly and compile only once the formats are fixed, sample statistics on some
steps (eagerly: their hooks would make a compiled model recompile), re-check auto's choices, and
keep the auto choices and the converted layers in checkpoints. This object holds that order:

    fp8 = FP8Training(model, FP8Config(mode="auto", opt_level=2))  # converts now
    optimizer = fp8.wrap_optimizer(torch.optim.AdamW(model.parameters()))  # FP8Optim (opt_level)
    guard = StepGuard(model)                      # nanochat.train.guard: skips non-finite steps (not FP8's)
    for step in range(steps):
        with fp8.begin_step(step) as s:           # s.eager: run the uncompiled model this step
            loss = (model if s.eager or compiled is None else compiled)(x, y); loss.backward()
        record = s.record() | guard.check(step, loss, params, max_norm=1.0).flags  # clips too
        if record.get("skipped"): continue        # non-finite: gradients already dropped
        optimizer.step(); optimizer.zero_grad()
        fp8.end_step(step)                        # True when auto's formats were just fixed
        if compiled is None and not fp8.calibrating: compiled = torch.compile(model)
    summary = fp8.summary()                       # and guard.summary(): each its own counts

`examples/custom_loop.py` runs it on a transformers model. With `FP8Config(enabled=False)` it
converts nothing; `opt_level` still stores the moments in FP8. `wrap_optimizer` gives the loop's
optimizer the moments `opt_level` asks for (nanochat.optim.wrap_optimizer, where the optimizer's
other options live: bf16 master weights, the step in the backward), and `fallbacks` lists the
conversion's and that optimizer's: recorded in the loop's nanochat.config.fields.Fallbacks when one is
passed, so a run keeps one list. It never reads the device except where its docstrings say so.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

import torch
import torch.nn as nn

from nanochat.fp8 import _torchao  # noqa: F401  (first: torchao imported with its log noise muted)
from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

from nanochat.common import format_table, logger, print0
from nanochat.fp8.auto import apply_fp8_choices, choices_table, fp8_choices, recheck_choices, start_auto_calibration
from nanochat.fp8.health import worst_layers
from nanochat.config.fields import Fallbacks
from nanochat.config.fp8 import FP8Config
from nanochat.fp8.conversion import ROLES, convert, fp8_disabled, is_fp8_model
from nanochat.fp8.stats import FP8StatsSampler, collect_fp8_stats
from nanochat.optim import optimizer_fallbacks, wrap_optimizer


class FP8Step:
    """One training step as FP8Training sees it: a context manager around its forward and
    backward passes (installs the statistics hooks on a sampled step)."""

    def __init__(self, *, calibrating: bool, recheck: bool, sampler: FP8StatsSampler | None, owner: FP8Training):
        self.calibrating, self.recheck, self.sampler, self._owner = calibrating, recheck, sampler, owner

    @property
    def eager(self) -> bool:
        """Run the uncompiled model: auto is calibrating, or this step samples statistics."""
        return self.calibrating or self.sampler is not None

    def __enter__(self) -> "FP8Step":
        if self.sampler is not None:
            self.sampler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.sampler is not None:
            self.sampler.__exit__(*exc)

    def record(self) -> dict[str, Any]:
        """What to add to the step's metrics: `calibrating`, or the sampled `fp8_stats` (all-reduced
        over ranks: every rank must call it; one device read for all layers)."""
        if self.sampler is None:
            return {"calibrating": True} if self.calibrating else {}
        self.sampler.all_reduce()
        owner = self._owner
        owner.last_stats = self.sampler.as_dict()
        owner.counters["stats_samples"] += 1
        return {**({"calibrating": True} if self.calibrating else {}), "fp8_stats": owner.last_stats}


class FP8Training:
    """Converts `model` now; then called at fixed points of each step (see the module docstring)."""

    def __init__(self, model: nn.Module, config: FP8Config | None = None,
                 optimizer: torch.optim.Optimizer | None = None, *, fallbacks: Fallbacks | None = None):
        self.model = model
        self.config = config = config if config is not None else FP8Config()
        self.report = convert(model, config) if config.enabled else None
        self._fallbacks = fallbacks if fallbacks is not None else Fallbacks()
        """Where this object's fallbacks are recorded: the loop's collector, or its own."""
        for message in (self.report.fallback, self.report.layers_fallback) if self.report else ():
            if message:  # the conversion said it as it fell back
                self._fallbacks.add(message, said=True)
        self._fallbacks.follow(lambda: optimizer_fallbacks(self.optimizer))
        self.counters: dict[str, Any] = {"stats_samples": 0}
        """Statistics steps sampled so far; the summary and the checkpoint state carry it."""
        self.choices: dict[str, dict[str, str]] | None = None
        """mode auto: layer -> role -> 'e4m3' | 'e5m2', once calibrated (or restored)."""
        self.switches: list[dict[str, Any]] = []
        self.pending: dict[str, int] = {}
        self.last_stats: dict[str, Any] | None = None
        self.events: list[dict[str, Any]] = []
        """Metrics records (auto's choices, re-check switches) for the caller's log; `pop_events`."""
        self._calibration = None
        self._started = False
        self._step: FP8Step | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        """The optimizer `wrap_optimizer` returned (None until then)."""
        if optimizer is not None:
            self.wrap_optimizer(optimizer)

    @property
    def has_fp8_layers(self) -> bool:
        return self.report is not None and bool(self.report.converted)

    @property
    def calibrating(self) -> bool:
        return self._calibration is not None

    @property
    def fallbacks(self) -> list[str]:
        """Every fallback taken so far, with its reason: no FP8 hardware, skipped layers, a short
        calibration, and the optimizer's (moments kept fp32, a step backend that fell back); with
        the loop's collector passed in, the loop's too. Fields are named as `field` unless the
        collector translates them (nanochat.config.flag_text: the CLI's flags)."""
        return list(self._fallbacks)

    def add_fallback(self, message: str) -> None:
        """Record a fallback a caller took on FP8's behalf (e.g. a checkpoint without FP8 state)."""
        self._fallbacks.add(message, said=True)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, **options: Any) -> torch.optim.Optimizer:
        """The optimizer the loop steps: nanochat.optim.wrap_optimizer(optimizer, opt_level=
        config.opt_level, **options), FP8Optim for FP8 moments (`optimizer` built on the
        parameters the loop trains: after FSDP wraps). `options` are that function's
        (master_weights, seed, emulate, in_backward). Becomes `self.optimizer`, whose fallbacks
        `fallbacks` reports."""
        self.optimizer = wrap_optimizer(optimizer, opt_level=self.config.opt_level, **options)
        return self.optimizer

    def high_precision(self):
        """Context: the FP8 layers run F.linear in high precision (evaluation, generation)."""
        return fp8_disabled(self.model) if is_fp8_model(self.model) else contextlib.nullcontext()

    # ----------------------------------------------------------------- each step
    def begin_step(self, step: int) -> FP8Step:
        """Decide what step `step` (0-based) does: calibrate, sample statistics, re-check."""
        c = self.config
        if not self._started:
            self._started = True
            if c.mode == "auto" and self.has_fp8_layers and self.choices is None:
                self._calibration = start_auto_calibration(self.model, steps=c.auto_steps)
                logger.info("fp8 auto: measuring e4m3 and e5m2 on every FP8 layer for %d step(s)", c.auto_steps)
        recheck = bool(c.auto_recheck_every and (step + 1) % c.auto_recheck_every == 0
                       and self.has_fp8_layers and not self.calibrating and self.choices)
        sample = recheck or bool(self.has_fp8_layers and c.stats_every and (step + 1) % c.stats_every == 0)
        self._step = FP8Step(calibrating=self.calibrating, recheck=recheck, owner=self,
                             sampler=collect_fp8_stats(self.model, both_formats=recheck) if sample else None)
        return self._step

    def end_step(self, step: int) -> bool:
        """After the optimizer step: count a calibration step, apply a re-check, precompute FSDP's
        FP8 all-gather scales. True when auto's formats were fixed by this step: compile now."""
        fixed = False
        if self._calibration is not None and self._calibration.step():
            self.choices, self._calibration, fixed = self._calibration.choices, None, True
            print0(self.choices_table())
            self.events.append({"event": "fp8_auto_choices", "choices": self.choices})
        if self._step is not None and self._step.recheck:
            self._apply_recheck(step + 1)
        self._step = None
        if self.has_fp8_layers and self.config.fsdp_float8_all_gather:
            # one all-reduce for every weight's scale; layers not yet sharded by FSDP2 are left alone
            precompute_float8_dynamic_scale_for_fsdp(self.model)
        return fixed

    def _apply_recheck(self, step: int) -> None:
        """Switch roles the calibration rule now assigns to the other format (confirmed over
        consecutive re-checks; fp8.auto.recheck_choices). A compiled model recompiles by itself:
        torch.compile guards on each layer's config."""
        switches = recheck_choices(self.model, self._step.sampler.format_counts(), self.pending)
        if not switches:
            return
        self.choices = fp8_choices(self.model)
        for sw in switches:
            sw["step"] = step
            self.events.append({"event": "fp8_auto_switch", **sw})
        self.switches += switches
        print0(f"fp8 auto re-check at step {step}: " + "; ".join(describe_switch(sw) for sw in switches))

    def pop_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events

    def finish(self) -> None:
        """At the end of training: a calibration the run did not complete is dropped (recorded)."""
        if self._calibration is not None:  # keep the hybrid
            self._calibration.close()
            self._calibration = None
            self._fallbacks.add(
                f"fp8 auto: the run ended after fewer than `auto_steps` {self.config.auto_steps} steps; "
                "formats stayed at the hybrid default (e4m3 forward, e5m2 gradients)")

    # ------------------------------------------------------------------ reports
    def summary(self) -> dict[str, Any]:
        """stats_samples, the five layers with most underflow and saturation in the last sample, the
        auto choices and switches, and the last sample's statistics (plain, JSON-ready)."""
        layers = self.last_stats or {}
        return {**self.counters, "top_underflow": worst_layers(layers, "underflow_pct"),
                "top_saturation": worst_layers(layers, "saturation_pct"),
                "choices": self.choices, "auto_switches": list(self.switches), "layers": layers}

    def summary_text(self, summary: dict[str, Any], label: str) -> str:
        """`summary` as the lines a run prints, headed by `label` (e.g. "epoch 2")."""
        lines = [f"fp8 summary ({label}): statistics from {summary['stats_samples']} sampled step(s)"]
        if summary["layers"]:
            rows = []
            for heading, key in (("most underflow", "top_underflow"), ("most saturation", "top_saturation")):
                top = [(n, r, v) for n, r, v in summary[key] if v > 0]
                rows += [[heading, f"{n} ({r})", f"{v:.3f} %"] for n, r, v in top]
                if not top:
                    rows.append([heading, "none: 0 % in every layer and role", ""])
            lines.append(format_table(["", "layer (role)", "share of values"], rows))
        if self.choices:  # the table itself printed once, when the formats were fixed
            lines.append(choices_line(self.choices))
        if self.config.auto_recheck_every:
            lines.append(f"fp8 auto re-check: {len(self.switches)} switch(es)"
                         + "".join(f"\n  step {sw['step']}: {describe_switch(sw)}" for sw in self.switches))
        return "\n".join(lines)

    def choices_table(self) -> str:
        """Auto's choices as a table, grouped past fp8.auto.CHOICES_TABLE_ROWS layers."""
        return choices_table(self.choices or {})

    # --------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Plain data (JSON-safe), keys prefixed so they can sit beside a loop's own in one
        checkpoint dict: stats_samples, auto's choices, re-check switches and pending counts, and
        the converted layers (None without FP8 layers). A resumed run converts exactly those:
        read `fp8_converted` before building this object and pass it as
        `FP8Config.converted_layers`; load_state_dict restores the rest."""
        return {"counters": dict(self.counters), "fp8_choices": self.choices,
                "fp8_auto_switches": list(self.switches), "fp8_auto_pending": dict(self.pending),
                "fp8_converted": list(self.report.converted) if self.report is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore stats_samples and auto's choices (applied to the model: no recalibration).
        Other keys of `state` are ignored, so a whole checkpoint dict may be passed."""
        self.counters.update(state.get("counters") or {})
        if state.get("fp8_choices"):
            apply_fp8_choices(self.model, state["fp8_choices"])
            self.choices = state["fp8_choices"]
            self.switches = list(state.get("fp8_auto_switches") or [])
            self.pending = dict(state.get("fp8_auto_pending") or {})
            logger.info("fp8 auto: formats restored from the checkpoint (no recalibration)")


def choices_line(choices: dict[str, dict[str, str]]) -> str:
    """Auto's choices counted per role, one line: `fp8 auto: 24 layers; input e4m3 x24; ...`."""
    counts = {r: Counter(roles[r] for roles in choices.values() if r in roles) for r in ROLES}
    return f"fp8 auto: {len(choices)} layers; " + "; ".join(
        f"{r} " + ", ".join(f"{d} x{n}" for d, n in c.most_common()) for r, c in counts.items() if c)


def describe_switch(sw: dict[str, Any]) -> str:
    m = sw.get("measured", {})
    figs = ", ".join(f"{d} {v['underflow_pct']:.2f}% underflow / {v['sqnr_db']:.1f} dB" for d, v in m.items())
    return f"{sw['layer']} {sw['role']} {sw['from']} -> {sw['to']} ({figs})"


__all__ = ["FP8Step", "FP8Training", "choices_line", "describe_switch"]
