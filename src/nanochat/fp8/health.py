"""FP8 health: one statistics sample as the scalars every tracker logs, and its worst layers.

A statistics step (`stats_every`, nanochat.fp8.stats) measures, per FP8 layer and tensor role
(input, weight, grad_output), the share of non-zero values flushed to zero (underflow_pct), the
share clamped at the format's maximum (saturation_pct) and the signal-to-quantization-noise
ratio (sqnr_db). This module turns that sample, `{layer: {role: {stat: value}}}`, into the
figures a person watches, under one set of names for every consumer: TensorBoard and W&B
through `--log` (nanochat.report.trackers), the Hugging Face Trainer's log (FP8Trainer) and
FP8Training's summary.

    fp8/<role>_<stat>_worst, fp8/<role>_<stat>_mean   per role and statistic, over the layers
    fp8_<role>_<stat>/<layer>                         every layer (with `layers`)

Names group by their first path component, as both TensorBoard and W&B lay out panels: the
`fp8` section stays a short dashboard, and each per-layer statistic is a section of its own (a
Llama-3-8B's 224 FP8 layers make nine sections of 224 charts) rather than one section of 2,016.
The worst is the most underflow or saturation, the least SQNR. An exact cast's SQNR (infinite)
and a missing figure are left out. Plain Python: importing this loads neither torch nor torchao.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

WORST = {"underflow_pct": max, "saturation_pct": max, "sqnr_db": min}
"""The statistics a tracker gets, each with how the worst layer is picked."""


def health_values(stats: Mapping[str, Any]) -> Iterator[tuple[str, str, str, float]]:
    """(layer, role, statistic, value) of every finite figure of WORST in a sample, in its order."""
    for layer, roles in stats.items():
        for role, figures in (roles.items() if isinstance(roles, Mapping) else ()):
            for stat in WORST:
                v = figures.get(stat) if isinstance(figures, Mapping) else None
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    yield layer, role, stat, float(v)


def fp8_health(stats: Mapping[str, Any], *, layers: bool = True) -> dict[str, float]:
    """A sample's scalars under the names in the module docstring; `layers=False` leaves out
    the per-layer ones (the Hugging Face Trainer logs them only every few samples)."""
    out: dict[str, float] = {}
    per: dict[tuple[str, str], list[float]] = {}
    for layer, role, stat, v in health_values(stats):
        if layers:
            out[f"fp8_{role}_{stat}/{layer}"] = v
        per.setdefault((role, stat), []).append(v)
    for (role, stat), values in per.items():
        out[f"fp8/{role}_{stat}_worst"] = WORST[stat](values)
        out[f"fp8/{role}_{stat}_mean"] = sum(values) / len(values)
    return out


def worst_layers(stats: Mapping[str, Any], stat: str, n: int = 5) -> list[list[Any]]:
    """The `n` [layer, role, value] with the worst `stat` in a sample, worst first."""
    rows = [[layer, role, v] for layer, role, s, v in health_values(stats) if s == stat]
    return sorted(rows, key=lambda r: r[2], reverse=WORST[stat] is max)[:n]


__all__ = ["WORST", "fp8_health", "health_values", "worst_layers"]
