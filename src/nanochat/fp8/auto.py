"""FP8 mode auto: the FP8 format of each layer's input, weight and grad_output, by measurement.

During the first K steps the layers train with the hybrid (e4m3 forward operands, e5m2
gradients) while hooks simulate, on the real tensors with each layer's own scaling, what both
formats would do to every cast. Then, per layer and role:
  1. a format that flushes > 1 percentage point more of the non-zero values to zero than the
     other is out (SQNR alone cannot see underflow: it weighs errors by energy);
  2. of the rest the higher SQNR wins; within 0.1 dB the hybrid default stands;
  3. the choice is made runnable on CUDA FP8 kernels (no GEMM with two e5m2 operands), also in
     emulation, so a choice calibrated on a CPU applies on a GPU unchanged.
The choices are a plain dict `{layer: {role: "e4m3"|"e5m2"}}`, kept in checkpoints and applied
on resume by `apply_fp8_choices` without recalibrating. Calibrate eagerly (the hooks change the
graph), then compile: `FP8Training` does this in the right order.

`recheck_choices` (`auto_recheck_every`) applies the same rules to later steps and switches a
role after RECHECK_CONFIRM consecutive disagreements, with hysteresis. Under DDP/FSDP the
counts are all-reduced first, so every rank decides alike. The measurements behind each rule:
docs/fp8.md.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from nanochat.fp8 import _torchao  # noqa: F401  (first: torchao imported with its log noise muted)
from torchao.float8.config import ScalingGranularity, ScalingType
from torchao.float8.float8_linear import Float8Linear
from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear

from nanochat.common import format_table, logger
from nanochat.fp8.hardware import native_gemm_problem
from nanochat.fp8.conversion import (
    CAST_FIELDS, FP8_DTYPES, HYBRID, ROLES, fp8_layers, fp8_report, layer_dtypes, with_dtypes,
)
from nanochat.fp8.stats import CastCounts, RoleHooks, all_reduce_counts, flush_counts, role_counts

TIE_DB = 0.1
"""SQNR differences within this many dB are ties (well under the ~6 dB one mantissa bit makes)."""
UNDERFLOW_MARGIN_PCT = 1.0
"""A format flushing this many more % of the non-zero values to zero than the other is out."""
RECHECK_HYSTERESIS = 0.5
"""Re-checks: a format not in use must be within this fraction of the underflow margin to win
back a role. Without it, roles hovering near the margin switched back and forth (BENCHMARKS.md
§4, re-check hysteresis)."""


def recipe_of(config) -> str:
    """The torchao recipe a Float8LinearConfig was built from (for the native kernel rules)."""
    if any(getattr(config, f).scaling_type is ScalingType.DISABLED for fs in CAST_FIELDS.values() for f in fs):
        return "rowwise_with_gw_hp"
    if config.cast_config_input.scaling_granularity is ScalingGranularity.AXISWISE:
        return "rowwise"
    return "tensorwise"


def choose_format(counts: dict[str, CastCounts], role: str, *, tie_db: float = TIE_DB,
                  underflow_margin_pct: float = UNDERFLOW_MARGIN_PCT, incumbent: str | None = None) -> str:
    """'e4m3' or 'e5m2' for one role from both formats' measured counts (rules 1-2 above).

    `incumbent` (a re-check: the format in use) gets hysteresis: it stays eligible within the
    full underflow margin, the other format only within half of it, so a share of flushed values
    hovering around the margin does not switch the role back and forth."""
    least = min(c.underflow_pct for c in counts.values())

    def margin(d: str) -> float:
        return underflow_margin_pct if incumbent in (None, d) else underflow_margin_pct * RECHECK_HYSTERESIS

    eligible = {d: c for d, c in counts.items() if c.underflow_pct <= least + margin(d)}
    if len(eligible) == 1:
        return next(iter(eligible))
    e4, e5 = eligible["e4m3"].sqnr_db, eligible["e5m2"].sqnr_db
    if e4 == e5 or abs(e4 - e5) <= tie_db:  # (inf == inf: both exact)
        return HYBRID[role]
    return "e4m3" if e4 > e5 else "e5m2"


def measure(x: torch.Tensor, *, axis: int | None = None, round_pow2: bool = False) -> dict[str, CastCounts]:
    """Both formats' counts for one cast of a tensor (for synthetic tensors and tests)."""
    return {name: CastCounts().add(x, dt, axis=axis, round_pow2=round_pow2) for name, dt in FP8_DTYPES.items()}


def make_native_legal(choice: dict[str, str], counts: dict[str, dict[str, CastCounts]], recipe: str) -> dict[str, str]:
    """Rule 3: flip e5m2 roles back to e4m3, cheapest first, until CUDA's kernels accept the set."""
    choice = dict(choice)
    while native_gemm_problem({r: FP8_DTYPES[d] for r, d in choice.items()}, recipe=recipe):
        e5_roles = [r for r in ROLES if choice[r] == "e5m2"]
        if recipe != "tensorwise" and choice["weight"] == "e5m2":
            flip = "weight"
        else:
            def cost(role):  # what going back to e4m3 costs: underflow first, then SQNR
                c = counts.get(role)
                if not c:
                    return (0.0, 0.0)
                return (c["e4m3"].underflow_pct - c["e5m2"].underflow_pct, c["e5m2"].sqnr_db - c["e4m3"].sqnr_db)
            flip = min(e5_roles, key=cost)
        choice[flip] = "e4m3"
    return choice


class AutoCalibration:
    """Hooks measuring both formats on every FP8 layer; `step()` counts steps, `finalize()` decides."""

    def __init__(self, model: nn.Module, steps: int = 4, *, tie_db: float = TIE_DB,
                 underflow_margin_pct: float = UNDERFLOW_MARGIN_PCT):
        if steps < 1:
            raise ValueError(f"calibration needs at least 1 step, got {steps}")
        self.model = model
        self.layers = fp8_layers(model)
        mx = [n for n, m in self.layers.items() if isinstance(m, MXFP8Linear)]
        if mx:
            raise ValueError(f"mode auto chooses e4m3 or e5m2 per role, but MXFP8 layers (e.g. {mx[0]}) cast to e4m3 "
                             "only: calibrate a model converted with a tensorwise or rowwise recipe")
        if not self.layers:
            raise ValueError("start_auto_calibration: the model has no FP8 layers; call convert(model, "
                             "mode='auto') first (on a fallback backend nothing converts and there is "
                             "nothing to calibrate)")
        self.steps, self.steps_done = steps, 0
        self.tie_db, self.underflow_margin_pct = tie_db, underflow_margin_pct
        self.counts: dict[str, dict[str, dict[str, CastCounts]]] = {}
        self.choices: dict[str, dict[str, str]] | None = None
        self._hooks = RoleHooks(self.layers, self._record)

    def _record(self, name: str, layer: Float8Linear, role: str, x: torch.Tensor) -> None:
        slot = self.counts.setdefault(name, {}).setdefault(role, {d: CastCounts() for d in FP8_DTYPES})
        for dname, dtype in FP8_DTYPES.items():
            role_counts(layer, role, x, dtype, slot[dname])

    def step(self) -> bool:
        """Call once per optimizer step; after `steps` calls, finalize and return True."""
        if self.choices is not None:
            return True
        self.steps_done += 1
        if self.steps_done >= self.steps:
            self.finalize()
            return True
        return False

    def finalize(self) -> dict[str, dict[str, str]]:
        """Decide, apply to the model, remove the hooks; returns {layer: {role: dtype name}}."""
        if self.choices is not None:
            return self.choices
        self.close()
        if not self.counts:
            raise RuntimeError("auto calibration saw no forward pass of an FP8 layer; run training "
                               "steps between start_auto_calibration() and finalize()")
        flush_counts(c for roles in self.counts.values() for fmts in roles.values() for c in fmts.values())
        all_reduce_counts(self.counts)  # under DDP/FSDP: every rank decides on the global batch
        choices = {}
        for name, layer in self.layers.items():
            measured = self.counts.get(name, {})
            choice = {role: choose_format(measured[role], role, tie_db=self.tie_db,
                                          underflow_margin_pct=self.underflow_margin_pct)
                      if role in measured else HYBRID[role] for role in ROLES}
            choices[name] = make_native_legal(choice, measured, recipe_of(layer.config))
        apply_fp8_choices(self.model, choices)
        self.choices = choices
        logger.info("fp8 auto: formats fixed after %d step(s)\n%s", self.steps_done, self.table())
        return choices

    def close(self) -> None:
        """Remove the hooks without deciding (e.g. the run stops during calibration)."""
        self._hooks.remove()

    def measurements(self) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
        """layer -> role -> format -> {sqnr_db, underflow_pct, saturation_pct} (plain floats)."""
        return {n: {r: {d: {"sqnr_db": c.sqnr_db, "underflow_pct": c.underflow_pct,
                            "saturation_pct": c.saturation_pct} for d, c in fmts.items()}
                    for r, fmts in roles.items()} for n, roles in self.counts.items()}

    def table(self) -> str:
        rows = []
        for name, roles in self.counts.items():
            for role, fmts in roles.items():
                chosen = self.choices[name][role] if self.choices else "-"
                rows.append([name, role, f"{fmts['e4m3'].sqnr_db:.1f}", f"{fmts['e5m2'].sqnr_db:.1f}",
                             f"{fmts['e4m3'].underflow_pct:.2f}", f"{fmts['e5m2'].underflow_pct:.2f}", chosen])
        return format_table(["layer", "role", "e4m3 dB", "e5m2 dB", "e4m3 underflow %",
                             "e5m2 underflow %", "chosen"], rows)


RECHECK_CONFIRM = 2
"""A re-check switches a role only after the rule picked the other format at this many
consecutive samples: one sampled step is one batch, and a role near the underflow margin would
otherwise flip back and forth (each flip of a compiled model costs a recompile)."""


def recheck_choices(model: nn.Module, measured: dict[str, dict[str, dict[str, CastCounts]]],
                    pending: dict[str, int], *, confirm: int = RECHECK_CONFIRM, tie_db: float = TIE_DB,
                    underflow_margin_pct: float = UNDERFLOW_MARGIN_PCT) -> list[dict]:
    """`auto_recheck_every`: after calibration, apply the same rule (1-3 above, with the
    incumbent's hysteresis, see `choose_format`) to a later step's measurement of both formats
    (`FP8StatsSampler(both_formats=True).format_counts()`).

    A role whose current format the rule no longer picks counts one in `pending` (`"layer/role"`
    -> consecutive disagreements; mutated in place, store it with the choices so a resumed run
    continues the count); at `confirm` it switches. Switches are applied to the model (the same
    `with_dtypes` rebuild as calibration) and returned as
    `[{"layer", "role", "from", "to", "measured": {fmt: {sqnr_db, underflow_pct}}}]`.
    Calibrated choices are only ever changed by this function, so a run without re-check keeps
    its formats for good. Under DDP/FSDP call it with counts merged over the ranks."""
    switches = []
    for name, layer in fp8_layers(model).items():
        roles = measured.get(name)
        if not roles:
            continue
        current = layer_dtypes(layer)
        wanted = {role: choose_format(roles[role], role, tie_db=tie_db, underflow_margin_pct=underflow_margin_pct,
                                      incumbent=current[role])
                  if role in roles else current[role] for role in ROLES}
        recipe = recipe_of(layer.config)
        wanted = make_native_legal(wanted, roles, recipe)
        new = dict(current)
        for role in ROLES:
            key = f"{name}/{role}"
            if wanted[role] == current[role]:
                pending.pop(key, None)
                continue
            pending[key] = pending.get(key, 0) + 1
            if pending[key] >= confirm:
                new[role] = wanted[role]
        # a partner role still waiting for confirmation can make a half-applied set illegal on CUDA
        new = make_native_legal(new, roles, recipe)
        if new == current:
            continue
        layer.config = with_dtypes(layer.config, new)
        for role in ROLES:
            if new[role] != current[role]:
                pending.pop(f"{name}/{role}", None)
                switches.append(dict(layer=name, role=role, **{"from": current[role], "to": new[role]},
                                     measured={d: {"sqnr_db": c.sqnr_db, "underflow_pct": c.underflow_pct}
                                               for d, c in roles.get(role, {}).items()}))
    return switches


def start_auto_calibration(model: nn.Module, steps: int = 4, **kwargs) -> AutoCalibration:
    """Install the measuring hooks on every FP8 layer of `model` (see the module docstring)."""
    return AutoCalibration(model, steps, **kwargs)


def fp8_choices(model: nn.Module) -> dict[str, dict[str, str]]:
    """{layer: {role: 'e4m3'|'e5m2'}} as the model's FP8 layers cast now (a plain dict)."""
    return {name: layer_dtypes(layer) for name, layer in fp8_layers(model).items()}


def apply_fp8_choices(model: nn.Module, choices: dict[str, dict[str, str]]) -> None:
    """Set each named FP8 layer's per-role formats (e.g. from a checkpoint), without calibrating."""
    layers = fp8_layers(model)
    unknown = sorted(set(choices) - set(layers))
    if unknown:
        raise ValueError(f"FP8 choices name layers that are not FP8 layers of this model: {unknown[:5]}"
                         f"{' ...' if len(unknown) > 5 else ''}. Convert the model with the same "
                         "`skip_fqns` / `min_dim` / `layers` as the run that saved them (`layers` faster "
                         "decides by this GPU's timings; `layers` all converts the same layers anywhere).")
    report = fp8_report(model)
    for name, choice in choices.items():
        if set(choice) != set(ROLES) or not set(choice.values()) <= set(FP8_DTYPES):
            raise ValueError(f"FP8 choice for {name!r} must map each of {ROLES} to 'e4m3' or 'e5m2', got {choice}")
        layer = layers[name]
        if report is not None and report.backend == "native":
            problem = native_gemm_problem({r: FP8_DTYPES[d] for r, d in choice.items()},
                                          recipe=recipe_of(layer.config))
            if problem:
                raise ValueError(f"FP8 choice for {name!r} cannot run on this GPU: {problem}")
        layer.config = with_dtypes(layer.config, choice)


CHOICES_TABLE_ROWS = 24
"""Layers auto's choice table lists one per row; past this it groups them (a d26 has 156 FP8
layers: a row each is a page no one reads, grouped it is one row per Linear of the block
unless some blocks chose otherwise)."""


def choices_table(choices: dict[str, dict[str, str]], max_rows: int = CHOICES_TABLE_ROWS) -> str:
    """Auto's choices as the table a run prints once, when they are fixed: a row per layer up
    to `max_rows` layers; beyond, a row per Linear of the block (the layer name with its block
    number as `*`) and formats chosen, with how many layers chose them and which blocks."""
    head = f"fp8 auto: formats chosen by measurement ({len(choices)} layers)"
    if len(choices) <= max_rows:
        rows = [[name, *(roles.get(r, "-") for r in ROLES)] for name, roles in choices.items()]
        return head + "\n" + format_table(["layer", *ROLES], rows)
    groups: dict[tuple[str, tuple[str, ...]], list[int | None]] = {}
    for name, roles in choices.items():  # in model order: the first layer of a group places its row
        parts = name.split(".")
        at = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        pattern = name if at is None else ".".join(parts[:at] + ["*"] + parts[at + 1:])
        groups.setdefault((pattern, tuple(roles.get(r, "-") for r in ROLES)), []).append(
            None if at is None else int(parts[at]))
    rows = [[pattern, *formats, len(blocks), block_ranges(blocks)] for (pattern, formats), blocks in groups.items()]
    return (head + ", grouped by Linear and formats\n"
            + format_table(["layer", *ROLES, "layers", "blocks"], rows))


def block_ranges(blocks: list[int | None]) -> str:
    """Block numbers as ranges, `0-11, 14, 16-25`; "-" for layers outside any block (None)."""
    spans: list[list[int]] = []
    for b in sorted({b for b in blocks if b is not None}):
        if spans and b == spans[-1][1] + 1:
            spans[-1][1] = b
        else:
            spans.append([b, b])
    return ", ".join(f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in spans) or "-"

__all__ = ["CHOICES_TABLE_ROWS", "AutoCalibration", "apply_fp8_choices", "block_ranges", "choices_table",
           "choose_format", "fp8_choices", "make_native_legal", "measure", "recheck_choices", "recipe_of",
           "start_auto_calibration"]
