"""A picture of a training run: loss and validation bits per byte against tokens, tokens/s and
MFU, and an FP8 health map, drawn from the files the run leaves in its directory.

    plot_run("runs/d12")        # writes runs/d12/run.png; scripts/plot_run.py from the shell

It reads `metrics.jsonl` (a line per step, FP8 statistics on the steps --fp8_stats_every
samples, events), `result.json` once the run has finished, and the newest checkpoint's config
for the tokens of one step (batch_size x seq_len x grad_accum_steps x world size); without a
checkpoint the x axis is the step and its label says why. The file is read while the run may
still be writing it: a malformed line is skipped with one warning, `null` and `NaN` are gaps,
fields it does not know are ignored.

The FP8 health map has a row per layer and a column per statistics step, one panel per tensor
role (input, weight, grad_output) for underflow (non-zero values flushed to 0) and one for
saturation (values clipped at the format's largest). One colour scale for all panels, fixed from
0 to 100 % and logarithmic above 0.01 %: the shares that matter span 0.001 % to tens of percent,
and a colour means the same share in every panel and every run. Above `max_rows` layers (d26 has
156, a Llama-3-8B 32 blocks x 7 Linears = 224) a row is one Linear over a range of blocks
(`model.layers.0-5.mlp.up_proj`), coloured by its worst layer so that one bad layer is not
averaged away; the title says how the rows were grouped.

matplotlib is optional (`pip install -e '.[plots]'`). Drawing uses a Figure on an Agg canvas,
not pyplot, so it changes no global state (a notebook's backend stays as it was).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from nanochat.common import UsageError
from nanochat.config.tools import MAX_ROWS
from nanochat.fs import write_atomic

if TYPE_CHECKING:
    from matplotlib.figure import Figure

logger = logging.getLogger("nanochat")

STATS = {"underflow_pct": "underflow %", "saturation_pct": "saturation %"}
SOFTWARE = "nanochat plot_run"
"""The PNG's Software field: how plot_run recognises a picture it drew and may replace."""
INSTALL = "pip install -e '.[plots]'"


@dataclass
class HealthMap:
    """FP8 statistics as images: values[role][stat] is [rows, columns], NaN where not measured."""

    rows: list[str]
    """Row labels: a layer, or a Linear over a block range (see group_layers)."""
    steps: list[int]
    """The statistics step of each column."""
    values: dict[str, dict[str, np.ndarray]]
    grouping: str
    """How layers became rows, for the title."""


@dataclass
class Run:
    """What a run directory holds, ready to draw."""

    name: str
    records: list[dict[str, Any]]
    """The step records of metrics.jsonl, in file order (events left out)."""
    tokens_per_step: int | None
    x_label: str
    result: dict[str, Any] | None = None
    health: HealthMap | None = None
    notes: list[str] = field(default_factory=list)
    """What the title should say besides the results (e.g. FP8 on but never sampled)."""

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(x, values) of every step record holding `key`; None and non-numbers become NaN."""
        recs = [r for r in self.records if key in r]
        x = np.array([r["step"] for r in recs], dtype=np.float64) * (self.tokens_per_step or 1)
        return x, np.array([_number(r[key]) for r in recs], dtype=np.float64)


def _number(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every JSON object of a metrics.jsonl; malformed lines (a line cut by a kill, text that is
    not JSON, a JSON value that is not an object) are skipped with one warning."""
    records, bad = [], []
    for number, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)  # bare NaN/Infinity are accepted, as json.dumps writes them
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            bad.append(f"line {number}: {e}")
            continue
        if isinstance(rec, dict):
            records.append(rec)
        else:
            bad.append(f"line {number}: a JSON {type(rec).__name__}, not an object")
    if bad:
        logger.warning("WARNING: %s: skipped %d malformed line(s), first %s", path, len(bad), bad[0])
    return records


def read_tokens_per_step(run_dir: str | os.PathLike) -> tuple[int | None, str]:
    """(tokens of one optimizer step, how they were found) from the config of the run's newest
    checkpoint; (None, why not) when there is none or it does not load."""
    from nanochat import checkpoint  # on use: it brings torch, which the rest of a plot does not need

    found = checkpoint.committed(run_dir)
    if not found:
        return None, "no checkpoint to read the batch size from"
    newest = found[-1]
    meta, why = newest.storage.read(newest, ())  # a .pt memory-mapped (its weights are not read), a DCP trainer.json
    try:
        if why is not None:
            raise ValueError(why)
        c, world = meta["config"], int(meta.get("data_parallel", meta.get("world_size", 1)))
        sizes = [int(c["batch_size"]), int(c["seq_len"]), int(c.get("grad_accum_steps", 1)), world]
    except Exception as e:  # noqa: BLE001 -- any unreadable checkpoint: the plot falls back to steps
        return None, f"checkpoint {newest.path.name} does not give the batch size ({type(e).__name__}: {e})"
    names = ("batch_size", "seq_len", "grad_accum_steps", "data-parallel ranks")
    return math.prod(sizes), " x ".join(f"{n} {v}" for n, v in zip(names, sizes))


def _block_of(name: str) -> tuple[int | None, str]:
    """(block index, the name with it replaced by `*`): `h.3.mlp.c_fc` -> (3, `h.*.mlp.c_fc`);
    a name without a numeric part (`lm_head`) -> (None, name)."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return int(p), ".".join(parts[:i] + ["*"] + parts[i + 1:])
    return None, name


def group_layers(names: list[str], max_rows: int = MAX_ROWS) -> tuple[list[str], list[list[int]], str]:
    """The health map's rows: (labels, the indices into `names` each row covers, a description).

    Up to `max_rows` names: one row each. Beyond: the smallest range of blocks such that each
    Linear over each range is one row and the rows fit (`h.0-5.attn.c_q`), in model order.
    A model with more distinct Linears per block than rows (or without numbered blocks) is cut
    into runs of consecutive layers instead."""
    if len(names) <= max_rows:
        return list(names), [[i] for i in range(len(names))], f"{len(names)} layers, one per row"
    parsed = [_block_of(n) for n in names]
    blocks = sorted({b for b, _ in parsed if b is not None})
    position = {b: i for i, b in enumerate(blocks)}
    for span in range(2, len(blocks) + 1):
        rows: dict[tuple, list[int]] = {}  # insertion order: model order of each row's first layer
        for i, (b, pattern) in enumerate(parsed):
            key = (None, names[i]) if b is None else (position[b] // span, pattern)
            rows.setdefault(key, []).append(i)
        if len(rows) <= max_rows:
            labels = []
            for (r, pattern), members in rows.items():
                if r is None:
                    labels.append(pattern)
                    continue
                lo, hi = blocks[r * span], blocks[min(len(blocks), (r + 1) * span) - 1]
                labels.append(pattern.replace("*", str(lo) if lo == hi else f"{lo}-{hi}", 1))
            return labels, list(rows.values()), (f"{len(names)} layers in {len(rows)} rows: each Linear over "
                                                  f"{span} blocks, coloured by its worst layer")
    per = math.ceil(len(names) / max_rows)
    members = [list(range(i, min(i + per, len(names)))) for i in range(0, len(names), per)]
    labels = [f"{names[m[0]]} (+{len(m) - 1})" for m in members]
    return labels, members, (f"{len(names)} layers in {len(members)} rows of {per} consecutive layers, "
                             "coloured by the worst")


def health_map(records: list[dict[str, Any]], max_rows: int = MAX_ROWS) -> HealthMap | None:
    """The FP8 statistics of the step records (layer -> role -> {underflow_pct, ...}) as images;
    None when no step sampled them."""
    sampled = [r for r in records if isinstance(r.get("fp8_stats"), dict) and r["fp8_stats"]]
    sampled = list({r["step"]: r for r in sorted(sampled, key=lambda r: r["step"])}.values())  # a step once
    if not sampled:
        return None
    layers: dict[str, None] = {}  # dicts as ordered sets: order of first appearance (forward order)
    roles: dict[str, None] = {}
    for r in sampled:
        for name, per_role in r["fp8_stats"].items():
            layers[name] = None
            roles.update(dict.fromkeys(per_role if isinstance(per_role, dict) else ()))
    names = list(layers)
    labels, members, grouping = group_layers(names, max_rows)
    index = {n: i for i, n in enumerate(names)}
    values: dict[str, dict[str, np.ndarray]] = {}
    for role in roles:
        values[role] = {}
        for stat in STATS:
            per_layer = np.full((len(names), len(sampled)), np.nan)
            for col, r in enumerate(sampled):
                for name, per_role in r["fp8_stats"].items():
                    st = per_role.get(role) if isinstance(per_role, dict) else None
                    if isinstance(st, dict):
                        per_layer[index[name], col] = _number(st.get(stat))
            # fmax ignores NaN (a layer not measured), and stays NaN only when no layer was
            values[role][stat] = np.stack([np.fmax.reduce(per_layer[m], axis=0) for m in members])
    return HealthMap(rows=labels, steps=[r["step"] for r in sampled], values=values, grouping=grouping)


def read_run(run_dir: str | os.PathLike, *, tokens_per_step: int | None = None, max_rows: int = MAX_ROWS) -> Run:
    """Everything plot_run draws, from `run_dir` (`tokens_per_step`: when the caller knows it)."""
    run_dir = Path(run_dir)
    records = [r for r in read_metrics(run_dir / "metrics.jsonl")
               if "event" not in r and isinstance(r.get("step"), int) and not isinstance(r["step"], bool)]
    if not any("loss" in r or "val_loss" in r for r in records):
        raise UsageError(f"{run_dir / 'metrics.jsonl'} holds no step with a loss yet; plot the run once it "
                         "has logged its first step")
    how = ""
    if tokens_per_step is None:
        tokens_per_step, how = read_tokens_per_step(run_dir)
    if tokens_per_step is None:
        logger.warning("WARNING: plot: %s: %s; the x axis is optimizer steps, not tokens", run_dir, how)
        x_label = f"optimizer step (tokens unknown: {how})"
    else:
        x_label = f"tokens ({tokens_per_step:,} per step{' = ' + how if how else ''})"
    result = None
    if (run_dir / "result.json").is_file():
        try:
            result = json.loads((run_dir / "result.json").read_text(encoding="utf-8"))
        except ValueError as e:
            logger.warning("WARNING: plot: %s is not valid JSON (%s); drawn without it", run_dir / "result.json", e)
    run = Run(name=run_dir.resolve().name, records=records, tokens_per_step=tokens_per_step, x_label=x_label,
              result=result if isinstance(result, dict) else None, health=health_map(records, max_rows))
    if run.result is None:
        run.notes.append("no result.json: the run is unfinished or stopped")
    elif run.health is None and run.result.get("fp8_backend", "off") != "off":
        run.notes.append("FP8 on, but no statistics step (--fp8_stats_every 0): no health map")
    return run


def draw(run: Run) -> Figure:
    """The run as a matplotlib Figure on an Agg canvas: loss, validation bpb, tokens/s and MFU
    against tokens; below them the FP8 health map when the run sampled FP8 statistics."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    curves_height = 6.0
    map_height = 0.0 if run.health is None else max(2.5, 0.125 * len(run.health.rows) + 1.3)
    fig = Figure(figsize=(16, 0.5 + curves_height + 2 * map_height), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(_title(run), fontsize=12)
    if run.health is None:
        _draw_curves(run, fig)
    else:
        top, bottom = fig.subfigures(2, 1, height_ratios=[curves_height, 2 * map_height])
        _draw_curves(run, top)
        _draw_health(run.health, bottom)
    return fig


def _title(run: Run) -> str:
    r, parts = run.result or {}, [run.name]
    if "steps" in r:
        parts.append(f"{r['steps']} steps")
    if r:
        for key, text in (("val_bpb", "val bpb {:.4f}"), ("tokens_per_sec", "{:,.0f} tokens/s")):
            if math.isfinite(_number(r.get(key))):
                parts.append(text.format(r[key]))
        parts.append(f"FP8 {r.get('fp8_backend', 'off')}")
        if r.get("fallbacks"):
            parts.append(f"{len(r['fallbacks'])} fallback(s), see result.json")
    return " | ".join(parts + run.notes)


def _tokens(value: float, _pos=None) -> str:
    """An axis tick as a count: 1.5M, 20B."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= div:
            return f"{value / div:g}{suffix}"
    return f"{value:g}"


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="grey")


def _draw_curves(run: Run, fig) -> None:
    from matplotlib.ticker import FuncFormatter

    (ax_loss, ax_bpb), (ax_tps, ax_mfu) = fig.subplots(2, 2, sharex=True)
    scale = run.tokens_per_step or 1
    ax_loss.plot(*run.series("loss"), lw=0.8, color="C0", label="train")
    vx, val = run.series("val_loss")
    if np.isfinite(val).any():
        ax_loss.plot(vx, val, "o-", ms=3, color="C1", label="validation")
    skipped = [r["step"] * scale for r in run.records if r.get("skipped")]
    for i, x in enumerate(skipped):  # a non-finite loss or gradient: the update was dropped
        ax_loss.axvline(x, color="red", lw=0.6, alpha=0.6, label=None if i else "skipped step (non-finite)")
    ax_loss.legend(fontsize=8)
    ax_loss.set(title="loss (nats per token)")

    bx, bpb = run.series("val_bpb")
    if np.isfinite(bpb).any():
        ax_bpb.plot(bx, bpb, "o-", ms=3, color="C1")
    else:
        _empty(ax_bpb, "no validation yet (--eval_every)")
    ax_bpb.set(title="validation bits per byte")

    ax_tps.plot(*run.series("tokens_per_sec"), lw=0.8, color="C2")
    steady = _number((run.result or {}).get("tokens_per_sec"))
    if math.isfinite(steady):
        ax_tps.axhline(steady, ls="--", lw=0.8, color="grey", label=f"result: {steady:,.0f} tokens/s")
        ax_tps.legend(fontsize=8)
    ax_tps.yaxis.set_major_formatter(FuncFormatter(_tokens))
    ax_tps.set(title="throughput (tokens/s)", xlabel=run.x_label)

    mx, mfu = run.series("mfu")
    if np.isfinite(mfu).any():
        ax_mfu.plot(mx, 100 * mfu, lw=0.8, color="C3")
    else:
        _empty(ax_mfu, "MFU unknown (CPU, or not recorded)")
        ax_mfu.set_yticks([])
    ax_mfu.set(title="MFU (% of the device's peak FLOP/s)", xlabel=run.x_label)
    if run.tokens_per_step:
        ax_mfu.xaxis.set_major_formatter(FuncFormatter(_tokens))  # shared by all four
    for ax in (ax_loss, ax_bpb, ax_tps, ax_mfu):
        ax.grid(alpha=0.3)


def _draw_health(h: HealthMap, fig) -> None:
    from matplotlib import colormaps
    from matplotlib.colors import SymLogNorm

    roles = list(h.values)
    axes = fig.subplots(len(STATS), len(roles), sharex=True, sharey=True, squeeze=False)
    norm = SymLogNorm(linthresh=0.01, linscale=0.3, vmin=0, vmax=100, base=10)
    cmap = colormaps["magma_r"].with_extremes(bad="#c8c8c8")
    # cells span the steps between their neighbours' midpoints, so the x axis is in steps even
    # when the samples are not evenly spaced (auto's re-checks sample between --fp8_stats_every)
    steps = np.asarray(h.steps, dtype=np.float64)
    mid = (steps[1:] + steps[:-1]) / 2 if len(steps) > 1 else steps + 0.5
    x_edges = np.concatenate([[2 * steps[0] - mid[0]], mid, [2 * steps[-1] - mid[-1]]])
    y_edges = np.arange(len(h.rows) + 1) - 0.5
    for i, (stat, stat_label) in enumerate(STATS.items()):
        for j, role in enumerate(roles):
            image = axes[i, j].pcolormesh(x_edges, y_edges, np.ma.masked_invalid(h.values[role][stat]),
                                          cmap=cmap, norm=norm)
            axes[i, j].set_title(f"{role}: {stat_label}", fontsize=10)
    prefix = _common_prefix(h.rows)
    axes[0, 0].set_yticks(range(len(h.rows)), [r[len(prefix) + 1:] if prefix else r for r in h.rows])
    axes[0, 0].set_ylim(len(h.rows) - 0.5, -0.5)  # the first layer on top
    for ax in axes[:, 0]:
        ax.tick_params(axis="y", labelsize=6.5 if len(h.rows) > 24 else 8)
        ax.set_ylabel(f"layer ({prefix}.*)" if prefix else "layer")
    for ax in axes[-1]:
        ax.set_xlabel("statistics step")
    fig.colorbar(image, ax=axes, ticks=[0, 0.01, 0.1, 1, 10, 100], format="%g", shrink=0.6,
                 label="% of values (log scale above 0.01 %)")
    fig.suptitle(f"FP8 health: {h.grouping}; grey: not measured", fontsize=11)


def _common_prefix(labels: list[str]) -> str:
    """The dotted path all labels start with (`transformer.h`), leaving each a non-empty rest."""
    parts = [label.split(".") for label in labels]
    n = 0
    while all(len(p) > n + 1 and p[n] == parts[0][n] for p in parts):
        n += 1
    return ".".join(parts[0][:n])


def _drawn_by_plot_run(path: str | os.PathLike) -> bool:
    """Whether `path` is a PNG this module wrote (its Software field; PIL comes with matplotlib)."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            return getattr(image, "text", {}).get("Software") == SOFTWARE
    except OSError:  # not an image, unreadable
        return False


def check_can_draw(run_dir: Path, out: str | os.PathLike | None = None, *, overwrite: bool = False,
                   flag: str = "--out") -> Path:
    """Where the picture goes (default <run_dir>/run.png), once matplotlib imports and `out` is
    not someone else's file; a UsageError otherwise. `flag` names the option in the message."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(f"plotting needs matplotlib, which is not installed: {INSTALL}") from None
    out = Path(run_dir) / "run.png" if out is None else Path(out)
    if out.is_dir():
        raise UsageError(f"{flag} {out} is a directory; give a file name, e.g. {out / 'run.png'}")
    # A picture plot_run drew is redrawn from the run's files, which is what running it again is
    # for; anything else at `out` may be someone's file, so replacing it takes --overwrite.
    if out.exists() and not overwrite and not _drawn_by_plot_run(out):
        fix = ("pass --overwrite to replace it, or choose another --out" if flag == "--out"
               else f"move it away, or drop {flag}")
        raise UsageError(f"{out} exists and plot_run did not draw it; {fix}")
    return out


def plot_after_run(run_dir: Path, tokens_per_step: int) -> str | None:
    """A training run's --plot: draw <run_dir>/run.png once the run is complete (checkpoint,
    result.json). Returns None, or why it could not be drawn, for the run to record as a fallback:
    the run's results stand whatever matplotlib or the disk do now."""
    try:
        print(f"plot: {plot_run(run_dir, tokens_per_step=tokens_per_step)}")
        return None
    except Exception as e:  # noqa: BLE001 -- matplotlib's or the disk's
        return (f"--plot: drawing {Path(run_dir) / 'run.png'} failed ({type(e).__name__}: {e}); draw it later "
                f"with: python scripts/plot_run.py {run_dir}")


def plot_run(run_dir: str | os.PathLike, out: str | os.PathLike | None = None, *, overwrite: bool = False,
             tokens_per_step: int | None = None, max_rows: int = MAX_ROWS) -> Path:
    """Draw `run_dir` (see the module docstring) into the PNG `out`, default <run_dir>/run.png;
    returns its path. `tokens_per_step`: when the caller knows it (the trainer does); otherwise
    read from the run's newest checkpoint. Raises UsageError, before drawing, for a missing run
    directory or metrics.jsonl, a missing matplotlib, or an `out` that plot_run did not draw
    (unless `overwrite`)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"run directory {run_dir} does not exist; give the directory a training run wrote "
                         "(base_train's --run_dir)")
    if not (run_dir / "metrics.jsonl").is_file():
        raise UsageError(f"{run_dir} has no metrics.jsonl: not a training run directory, or its run has not "
                         "logged a step yet; give the directory a training run wrote (base_train's --run_dir)")
    out = check_can_draw(run_dir, out, overwrite=overwrite)
    fig = draw(read_run(run_dir, tokens_per_step=tokens_per_step, max_rows=max_rows))
    write_atomic(out, lambda f: fig.savefig(f, format="png", dpi=100, metadata={"Software": SOFTWARE}))
    return out
