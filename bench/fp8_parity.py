"""FP8 parity: does FP8 training reach the loss of high-precision training, over several seeds?

    OMP_NUM_THREADS=1 python bench/fp8_parity.py            # the default config (~65 min, 1 core)
    OMP_NUM_THREADS=1 python bench/fp8_parity.py --jobs 2   # two runs at once (~half the time)
    python bench/fp8_parity.py --quick --seeds 1            # a seconds-long smoke run

It trains the same model on the same data and tokenizer once per mode -- `baseline` (no FP8),
`e4m3`, `e5m2`, `auto` (calibrated in the first steps, then fixed), `auto-recheck` (auto with
`--fp8_auto_recheck_every --recheck_every`), or a recipe's name (e4m3 with that recipe: mxfp8
beside tensorwise and rowwise) -- for each seed in `--seeds`. Within a seed every
mode starts from the same weights and sees the same batches, so a seed's gap is FP8's alone:

    gap[seed, mode] = (val_loss[seed, mode] - val_loss[seed, baseline]) / val_loss[seed, baseline]

Beside the gap, each mode's steps per baseline step at matched val loss
(`harness.matched_steps_ratio`: below 1 when it reaches the baseline's final loss before the last
step, above 1 when the baseline reaches the mode's final loss first): the factor a device's
tokens/s ratio of FP8 over high precision is divided by to give FP8's time to the same loss.

Targets: every FP8 mode within +-`--gap_target_pct` of the baseline for every seed, and each
auto mode no worse than the best fixed mode on the mean over seeds (`--auto_tolerance_pct`).
Why several seeds, what is held equal between runs, where FP8 runs natively or emulated, and
how the default config was chosen: docs/fp8_parity.md.

Runs go to `out_dir/seed-<seed>/<mode>/` (the trainer's run directory plus `parity_run.json`);
`parity.json` (the figures, with the machine: harness.machine) and `parity.png` (needs
matplotlib: `pip install -e '.[plots]'`) are rewritten after each finished run, so an
interrupted sweep keeps what finished. A run that fails is recorded in parity.json and the sweep
goes on; the exit status is then 1, with one `error:` line after the report naming the failed runs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib.util
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import harness
from nanochat.common import NanoChatError, format_table
from nanochat.config.checks import non_negative, positive
from nanochat.config.fields import BatchFields, DataFields, DeviceFields, ModelFields, ScheduleFields, ScriptFields
from nanochat.config.fp8 import MX_RECIPES, RECIPES, FP8Recipe

ParityMode = Literal["baseline", "e4m3", "e5m2", "auto", "auto-recheck", "bf16", "bf16_sr", "bf16_split",
                     "tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "mxfp8_wgrad_hp"]


@dataclass(frozen=True, kw_only=True)
class ParityConfig(ScriptFields, DeviceFields, ScheduleFields, BatchFields, DataFields, ModelFields):
    """Train one model per FP8 mode and seed (same weights and data within a seed); compare
    final val losses.

    The model, data, batch, schedule and device flags are base_train's, given to every run; the
    defaults below make a d4 sweep of minutes a run on CPU (FP8 needs width >= 128, d2 or more;
    it runs natively where the device supports the recipe, emulated elsewhere). Every mode
    evaluates the same validation tokens at the same steps: the curve points of the plot. With
    --init_from every run starts from that run's weights: parity of fine-tuning, where updates
    are small against the weights (what bf16 round-to-nearest master weights lose). --debug shows
    the traceback of an error of the sweep itself; a failed run's is always printed."""

    num_iterations: int = 300
    """Optimizer steps per mode (parity has no --num_epochs)."""

    eval_every: int = 25  # parity's own defaults; the flags' help is base_train's
    eval_tokens: int = 4096
    seq_len: int = 128
    batch_size: int = 4

    modes: tuple[ParityMode, ...] = ("baseline", "e4m3", "e5m2", "auto", "auto-recheck")
    """Modes to train, in this order: baseline (no FP8, fp32 master weights), e4m3, e5m2, auto
    (--fp8_mode auto) and auto-recheck (--fp8_mode auto --fp8_auto_recheck_every --recheck_every);
    a recipe's name (tensorwise, rowwise, rowwise_with_gw_hp, mxfp8, mxfp8_wgrad_hp): e4m3 with
    that --fp8_recipe, whatever --recipe says, to compare recipes on the same seeds; and, to
    compare master weights instead of FP8, bf16, bf16_sr, bf16_split (--master_weights, no FP8;
    with --dtype bfloat16 so the baseline computes in bf16 too and only the weights' storage
    differs)."""

    recipe: FP8Recipe = "tensorwise"
    """torchao FP8 scaling recipe of the e4m3, e5m2 and auto modes (a recipe-named mode has its own)."""

    seeds: tuple[int, ...] = (1337, 1338, 1339, 1340, 1341)
    """Seeds of the weights and the data order; every mode trains once per seed. One seed cannot
    rank the modes (their order changes with the rounding of a single step); the spread over
    seeds is reported next to every gap."""

    jobs: int = 1
    """Runs trained at once, in separate processes (each with cpu_count / jobs threads; output
    to each run's train.log). 2 halves the wall time on two idle cores; 1 keeps output live."""

    reuse: bool = False
    """Take finished runs from --out_dir whose recorded training settings equal this invocation's
    instead of training them again (e.g. after an interrupted sweep, or to add seeds). Each
    reused run keeps the commit it was trained on, printed and in parity.json."""

    recheck_every: int = 25
    """--fp8_auto_recheck_every of the auto-recheck mode: re-measure both formats every N steps
    and switch a role after 2 disagreeing re-checks in a row. 25 = every evaluation point of the
    default run (the e4m3 gradient underflow it is for showed by step 50)."""

    out_dir: str = "runs/fp8_parity"
    """Where the per-mode runs, parity.json and parity.png go."""

    gap_target_pct: float = 1.0
    """Target: every FP8 mode's final val loss within this many percent of the baseline's."""

    auto_tolerance_pct: float = 0.2
    """Target: auto's mean final val loss over the seeds at most the best fixed mode's mean
    times (1 + this/100); 0 is strict. A policy (a fifth of --gap_target_pct); the paired
    difference's standard error over the seeds is printed next to it."""

    quick: bool = False
    """Smoke run in seconds (d2, 8 steps, seq_len 32, tiny eval): replaces the size and schedule
    flags above with QUICK's values. Its figures check the harness, not FP8."""

    master_weights_emulate: bool = False
    """The master-weight modes with --master_weights_emulate: bf16 numerics, fp32 compute (for
    CPUs whose bf16 matmuls are slow; the baseline computes in fp32 then, with --dtype float32)."""

    fp8_opt_level: Literal[0, 1, 2] = 0
    """--fp8_opt_level of every run: the baseline's, the FP8 modes' and the master-weight modes'
    Adam moments in FP8 (it needs no FP8 matmuls), so that only the mode differs. 0: fp32 moments."""

    optimizer: Literal["auto", "adamw", "muon"] = "auto"
    """--optimizer of every run. auto: Muon with AdamW for a preset, at the recipe's rates (base_train's
    default); adamw: every parameter at --lr, which a fine-tune from --init_from at a lower rate needs
    (under Muon, --lr sets only norm weights and biases, which the presets have none of)."""

    compile: bool = True
    """torch.compile every run, base_train's default. --no_compile: eager runs, which on a CPU train
    emulated FP8 faster than compiled ones."""

    def __post_init__(self) -> None:
        super().__post_init__()  # the groups' checks
        if not self.modes:
            raise ValueError("--modes is empty; give at least: --modes baseline e4m3")
        if len(set(self.modes)) != len(self.modes):
            raise ValueError(f"--modes lists a mode twice: {' '.join(self.modes)}")
        if "baseline" not in self.modes:
            raise ValueError("gaps are measured against the baseline: add baseline to --modes "
                             f"(e.g. --modes baseline {' '.join(self.modes)})")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"--seeds needs distinct seeds, at least one, got {' '.join(map(str, self.seeds)) or 'none'}")
        fp8_modes = [m for m in self.modes if m in ("e5m2", "auto", "auto-recheck")]
        if self.recipe in MX_RECIPES and fp8_modes:
            raise ValueError(f"--recipe {self.recipe} casts every operand to e4m3, so --modes {' '.join(fp8_modes)} "
                             f"cannot run with it: drop them, or give the MXFP8 recipes as modes (--modes baseline "
                             f"e4m3 {' '.join(MX_RECIPES)}) next to another --recipe")
        positive(self, "num_iterations", "jobs", "recheck_every")
        non_negative(self, "gap_target_pct", "auto_tolerance_pct")


QUICK = dict(model_name="d2", num_iterations=8, eval_every=4, eval_tokens=512, seq_len=32,
             batch_size=4, vocab_size=320, warmup_steps=2, recheck_every=2)
"""--quick: d2 (width 128, the smallest preset with FP8-eligible layers), 8 steps: more than
auto's 4 calibration steps (--fp8_auto_steps), so auto trains with its calibrated formats, and
auto-recheck re-checks at steps 6 and 8."""

FIXED_MODES = ("e4m3", "e5m2")
AUTO_MODES = ("auto", "auto-recheck")
MASTER_MODES = ("bf16", "bf16_sr", "bf16_split")
"""--master_weights choices compared with the baseline's fp32 master weights (no FP8 matmuls)."""
NOISE_TARGET_MODES = ("bf16_sr", "bf16_split")
"""Master-weight modes whose target is the seed noise (bf16, round to nearest, is reported only:
it is the configuration that shows the stale-update problem)."""


# ------------------------------------------------------------------------------------- running
def train_kwargs(cfg: ParityConfig, mode: str, seed: int, *, emulate: bool) -> dict[str, Any]:
    """NanoChatTrainer fields of one run: everything equal but the seed and the FP8 flags."""
    kw = dict(model_name=cfg.model_name, dataset_path=cfg.dataset_path, vocab_size=cfg.vocab_size,
              seq_len=cfg.seq_len, batch_size=cfg.batch_size, num_iterations=cfg.num_iterations,
              warmup_steps=cfg.warmup_steps, lr=cfg.lr, eval_every=cfg.eval_every,
              eval_tokens=cfg.eval_tokens, seed=seed, device=cfg.device,
              run_dir=str(run_dir_of(cfg, seed, mode)),
              save_every=0, num_samples=0, dtype=cfg.dtype,  # one checkpoint at the end, no sampling
              init_from=cfg.init_from, compile=cfg.compile, optimizer=cfg.optimizer)
    if cfg.fp8_opt_level:  # FP8 moments in every mode (they need no FP8 layers): the same optimizer
        kw.update(fp8_opt_level=cfg.fp8_opt_level)
    if mode in MASTER_MODES:
        kw.update(master_weights=mode, master_weights_emulate=cfg.master_weights_emulate)
    elif mode in RECIPES:  # a recipe beside the others: e4m3, the one format every recipe runs
        kw.update(fp8=True, fp8_mode="e4m3", fp8_recipe=mode, fp8_emulate=emulate, fp8_layers="all")
    elif mode != "baseline":
        # --fp8_layers all: parity measures FP8's numerics on every eligible layer; which layers
        # the default (faster) would keep in bf16 depends on speed, not on what is compared here
        kw.update(fp8=True, fp8_mode="auto" if mode in AUTO_MODES else mode, fp8_recipe=cfg.recipe,
                  fp8_emulate=emulate, fp8_layers="all")
    if mode == "auto-recheck":
        kw.update(fp8_auto_recheck_every=cfg.recheck_every)
    return kw


def mode_recipe(cfg: ParityConfig, mode: str) -> str:
    """The FP8 recipe a mode trains with: its own name for a recipe mode, else --recipe."""
    return mode if mode in RECIPES else cfg.recipe


def run_dir_of(cfg: ParityConfig, seed: int, mode: str) -> Path:
    return Path(cfg.out_dir) / f"seed-{seed}" / mode


def read_curves(run_dir: Path) -> dict[str, list]:
    """Train loss per step, val loss / bpb per eval step, and the worst FP8 underflow seen at any
    sampled step (`[layer, role, pct, step]`, largest first), from the run's metrics.jsonl."""
    curves: dict[str, list] = {"step": [], "loss": [], "val_step": [], "val_loss": [], "val_bpb": [],
                               "worst_underflow": [], "auto_switches": []}
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return curves
    worst: dict[tuple[str, str], tuple[float, int]] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "fp8_auto_switch":
            curves["auto_switches"].append([rec["step"], rec["layer"], rec["role"], rec["to"]])
        if not rec.get("skipped") and "loss" in rec:
            curves["step"].append(rec["step"])
            curves["loss"].append(rec["loss"])
        if "val_loss" in rec:
            curves["val_step"].append(rec["step"])
            curves["val_loss"].append(rec["val_loss"])
            curves["val_bpb"].append(rec["val_bpb"])
        # per-step FP8 statistics (every --fp8_stats_every steps): {layer: {role: {underflow_pct, ...}}}
        for layer, roles in (rec.get("fp8_stats") or {}).items():
            for role, st in (roles if isinstance(roles, dict) else {}).items():
                pct = st.get("underflow_pct") if isinstance(st, dict) else None
                if pct is not None and pct > worst.get((layer, role), (-1.0, 0))[0]:
                    worst[(layer, role)] = (pct, rec["step"])
    ranked = sorted(worst.items(), key=lambda kv: -kv[1][0])[:5]
    curves["worst_underflow"] = [[layer, role, pct, step] for (layer, role), (pct, step) in ranked]
    return curves


EVALUATION = "windows spread over the validation split"
"""How the trainer's validation loss picks its windows (nanochat.data.batches.val_batches): a run
recorded under another protocol scored other text and is never reused."""


def run_one(kw: dict[str, Any], mode: str, seed: int, *, emulate: bool) -> dict[str, Any]:
    """Train one run; its figures, or the error that stopped it (the other runs still go on).
    Writes `parity_run.json` (settings + figures) into the run directory for `--reuse`."""
    from nanochat.train.trainer import NanoChatTrainer

    print(f"\n=== fp8 parity: seed {seed}, {mode} "
          f"({'no FP8' if mode == 'baseline' else 'FP8 ' + ('emulated' if emulate else 'native')}) ===", flush=True)
    t0 = time.perf_counter()
    base = dict(mode=mode, seed=seed, commit=harness.commit(), reused=False)
    try:
        r = NanoChatTrainer(**kw, overwrite=True).train()  # a run not reused is trained again
    except Exception as e:  # noqa: BLE001 -- recorded in parity.json and in the table, never hidden
        traceback.print_exc()
        return dict(base, error=f"{type(e).__name__}: {e}", wall_time_s=time.perf_counter() - t0,
                    curves=read_curves(Path(kw["run_dir"])))
    record = dict(base, error=None, val_loss=r.val_loss, val_bpb=r.val_bpb, train_loss=r.train_loss,
                  wall_time_s=r.wall_time_s, tokens_per_sec=r.tokens_per_sec, steps=r.steps,
                  fp8_backend=r.fp8_backend, fp8_converted=len(r.fp8_converted),
                  fp8_choices=r.fp8_choices, fallbacks=r.fallbacks, fp8_stats=r.fp8_stats,
                  run_dir=r.run_dir, curves=read_curves(Path(r.run_dir)))
    harness.write_json(Path(kw["run_dir"]) / "parity_run.json", dict(settings=kw, evaluation=EVALUATION, record=record))
    return record


def reusable(kw: dict[str, Any]) -> dict[str, Any] | None:
    """The recorded figures of a finished run with exactly these training settings, or None."""
    path = Path(kw["run_dir"]) / "parity_run.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if (saved.get("settings") != json.loads(json.dumps(kw)) or saved.get("evaluation") != EVALUATION
            or saved.get("record", {}).get("error")):
        return None
    return dict(saved["record"], reused=True)


def _worker(kw: dict[str, Any], mode: str, seed: int, emulate: bool, threads: int) -> dict[str, Any]:
    """One run in a pool process: its output goes to `run_dir/train.log`, not the shared terminal."""
    import torch

    torch.set_num_threads(threads)
    log = Path(kw["run_dir"]) / "train.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush(), sys.stderr.flush()
    with open(log, "w") as f:  # file descriptors, so C-level and logging output follow too
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    try:
        return run_one(kw, mode, seed, emulate=emulate)
    finally:
        sys.stdout.flush(), sys.stderr.flush()


def prepare_data(cfg: ParityConfig) -> None:
    """Train the tokenizer and build the corpus's token store once, where every run finds them,
    so that runs (parallel ones above all) do not each wait for them; a corpus or --init_from
    that cannot be used is one error before any run instead of one per run."""
    from nanochat.common import UsageError, cache_root
    from nanochat.data.prepare import prepare_data as prepare
    from nanochat.tokenizer import BPETokenizer

    if cfg.init_from is not None and not (Path(cfg.init_from) / "tokenizer").is_dir():
        raise UsageError(f"--init_from {cfg.init_from}: no run there (no tokenizer/); give the --run_dir of a "
                         "finished base_train run")
    # the tokenizer the runs take from the run they start from, or the one trained on the corpus
    tok = BPETokenizer.load(Path(cfg.init_from) / "tokenizer") if cfg.init_from is not None else None
    prepare(cfg.dataset_path, tokenizer=tok, vocab_size=cfg.vocab_size, cache_root=cache_root())


def run_all(cfg: ParityConfig, *, emulated: set[str],
            on_result: Callable[[dict[str, dict[str, dict]]], None]) -> dict[str, dict[str, dict]]:
    """Every (seed, mode) run: {str(seed): {mode: record}}; `on_result(runs)` after each one.
    `emulated`: the recipes this device has no FP8 kernels for (their modes run emulated)."""
    runs: dict[str, dict[str, dict]] = {str(s): {} for s in cfg.seeds}
    todo = []
    for seed in cfg.seeds:
        for mode in cfg.modes:
            emulate = mode_recipe(cfg, mode) in emulated
            kw = train_kwargs(cfg, mode, seed, emulate=emulate)
            old = reusable(kw) if cfg.reuse else None
            if old is not None:
                print(f"fp8 parity: seed {seed}, {mode}: reusing the finished run in {kw['run_dir']} "
                      f"(commit {old.get('commit')})", flush=True)
                runs[str(seed)][mode] = old
                on_result(runs)
            else:
                todo.append((kw, mode, seed, emulate))
    if not todo:
        return runs
    prepare_data(cfg)
    if cfg.jobs == 1:
        for kw, mode, seed, emulate in todo:
            runs[str(seed)][mode] = run_one(kw, mode, seed, emulate=emulate)
            on_result(runs)
        return runs

    threads = max(1, (os.cpu_count() or 1) // cfg.jobs)
    print(f"fp8 parity: {len(todo)} runs, {cfg.jobs} at a time, {threads} thread(s) each; "
          "each run's output goes to its run_dir/train.log", flush=True)
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that already holds torch threads
    with concurrent.futures.ProcessPoolExecutor(cfg.jobs, mp_context=ctx) as pool:
        futures = {pool.submit(_worker, kw, mode, seed, emulate, threads): (kw, mode, seed)
                   for kw, mode, seed, emulate in todo}
        for fut in concurrent.futures.as_completed(futures):
            kw, mode, seed = futures[fut]
            try:
                rec = fut.result()
            except Exception as e:  # noqa: BLE001 -- a worker that died (e.g. killed for memory)
                rec = dict(mode=mode, seed=seed, error=f"{type(e).__name__}: {e}", wall_time_s=float("nan"),
                           reused=False, curves=read_curves(Path(kw["run_dir"])))
            runs[str(seed)][mode] = rec
            done = sum(len(m) for m in runs.values())
            what = rec["error"] or f"val loss {rec['val_loss']:.4f} in {rec['wall_time_s']:.0f} s"
            print(f"fp8 parity: [{done}/{len(cfg.seeds) * len(cfg.modes)}] seed {seed}, {mode}: {what}", flush=True)
            on_result(runs)
    return runs


# ------------------------------------------------------------------------------------- figures
def rel_gap_pct(value: float, reference: float) -> float:
    """(value - reference) / reference in percent; nan when either is missing or not finite."""
    if not (math.isfinite(value) and math.isfinite(reference)) or reference == 0:
        return float("nan")
    return 100.0 * (value - reference) / reference


def final(results: dict[str, dict], mode: str, key: str = "val_loss") -> float:
    r = results.get(mode)
    v = r.get(key) if r and not r.get("error") else None
    return float(v) if v is not None else float("nan")


def add_gaps(results: dict[str, dict]) -> None:
    """Each mode's relative gap (val loss and val bpb) to the seed's baseline, in percent, and its
    steps per baseline step at matched val loss (harness.matched_steps_ratio), in place."""
    base = (results.get("baseline") or {}).get("curves") or {}
    for mode, r in results.items():
        r["gap_pct"] = rel_gap_pct(final(results, mode), final(results, "baseline"))
        r["bpb_gap_pct"] = rel_gap_pct(final(results, mode, "val_bpb"), final(results, "baseline", "val_bpb"))
        c = r.get("curves") or {}
        ok = not r.get("error") and base.get("val_loss")
        r["matched_steps"] = harness.matched_steps_ratio(c.get("val_step", []), c.get("val_loss", []),
                                                         base["val_step"], base["val_loss"]) if ok else None


def _mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (nan if any value is missing; sd nan for one value)."""
    if not values or not all(math.isfinite(v) for v in values):
        return float("nan"), float("nan")
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else float("nan")


def summarize(cfg: ParityConfig, runs: dict[str, dict[str, dict]]) -> dict[str, dict[str, Any]]:
    """Per mode over the seeds: val losses and gaps (each seed's), mean and sd of both."""
    out = {}
    for mode in cfg.modes:
        losses = [final(runs.get(str(s), {}), mode) for s in cfg.seeds]
        gaps = [runs.get(str(s), {}).get(mode, {}).get("gap_pct", float("nan")) for s in cfg.seeds]
        bpb = [final(runs.get(str(s), {}), mode, "val_bpb") for s in cfg.seeds]
        matched = [runs.get(str(s), {}).get(mode, {}).get("matched_steps") for s in cfg.seeds]
        matched = [float("nan") if m is None else m for m in matched]
        (lm, ls), (gm, gs), (bm, _) = _mean_sd(losses), _mean_sd(gaps), _mean_sd(bpb)
        out[mode] = dict(val_losses=losses, gaps_pct=gaps, val_loss_mean=lm, val_loss_sd=ls,
                         gap_mean_pct=gm, gap_sd_pct=gs, val_bpb_mean=bm, matched_steps=matched,
                         matched_steps_mean=_mean_sd(matched)[0],
                         runs=sum(1 for s in cfg.seeds if mode in runs.get(str(s), {})))
    return out


def check_targets(cfg: ParityConfig, summary: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The two targets, per mode and overall. A failed or missing run misses."""
    within = {m: bool(all(math.isfinite(g) and abs(g) <= cfg.gap_target_pct for g in s["gaps_pct"]))
              for m, s in summary.items() if m != "baseline"}
    out: dict[str, Any] = {"gap_target_pct": cfg.gap_target_pct, "within_gap": within}
    # master weights: the mean gap against the seed noise, the baseline's own sd over the seeds
    base = summary.get("baseline", {})
    noise = 100 * base.get("val_loss_sd", math.nan) / base.get("val_loss_mean", math.nan) \
        if base.get("val_loss_mean") else math.nan
    out["master_vs_seed_noise"] = {
        m: dict(gap_mean_pct=summary[m]["gap_mean_pct"], gap_sd_pct=summary[m]["gap_sd_pct"], noise_pct=noise,
                target=m in NOISE_TARGET_MODES,
                met=bool(math.isfinite(summary[m]["gap_mean_pct"]) and abs(summary[m]["gap_mean_pct"]) <= noise))
        for m in MASTER_MODES if m in summary}
    fixed = [m for m in FIXED_MODES if m in cfg.modes]
    autos = [m for m in AUTO_MODES if m in cfg.modes]
    out["auto_vs_best_fixed"] = {}
    if autos and fixed:
        means = {m: summary[m]["val_loss_mean"] for m in fixed if math.isfinite(summary[m]["val_loss_mean"])}
        best = min(means, key=means.get) if means else None
        limit = means[best] * (1 + cfg.auto_tolerance_pct / 100) if best else float("nan")
        for mode in autos:
            auto = summary[mode]["val_loss_mean"]
            # paired per-seed differences auto - best, in % of best: their mean and standard error
            diffs = [rel_gap_pct(a, b) for a, b in zip(summary[mode]["val_losses"], summary[best]["val_losses"])] \
                if best else []
            d_mean, d_sd = _mean_sd(diffs)
            out["auto_vs_best_fixed"][mode] = dict(
                best_fixed_mode=best, best_fixed_val_loss=means.get(best, float("nan")) if best else float("nan"),
                auto_val_loss=auto, tolerance_pct=cfg.auto_tolerance_pct, limit=limit,
                paired_diffs_pct=diffs, diff_mean_pct=d_mean,
                diff_se_pct=d_sd / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan"),
                met=bool(math.isfinite(auto) and math.isfinite(limit) and auto <= limit),
            )
    out["all_met"] = (math.isfinite(base.get("val_loss_mean", math.nan))  # every baseline run finished
                      and all(v for m, v in within.items() if m not in MASTER_MODES)
                      and all(a["met"] for a in out["auto_vs_best_fixed"].values())
                      and all(a["met"] for a in out["master_vs_seed_noise"].values() if a["target"]))
    return out


def _fmt(v: float, spec: str) -> str:
    return format(v, spec) if math.isfinite(v) else "-"


def report(cfg: ParityConfig, runs: dict[str, dict[str, dict]], summary: dict[str, dict[str, Any]],
           targets: dict[str, Any]) -> str:
    """The printed result: one row per seed and mode, the means, the targets, what FP8 did."""
    rows = []
    for seed in cfg.seeds:
        for mode in cfg.modes:
            r = runs.get(str(seed), {}).get(mode)
            if r is None:
                rows.append([seed, mode, "not run", "", "", "", "", ""])
            elif r.get("error"):
                rows.append([seed, mode, "ERROR", "", "", "", "", _fmt(r["wall_time_s"], ".0f")])
            else:
                gap = "-" if mode == "baseline" else f"{r['gap_pct']:+.3f}%"
                rows.append([seed, mode, r["fp8_backend"], f"{r['val_loss']:.4f}", gap, f"{r['val_bpb']:.4f}",
                             f"{r['train_loss']:.4f}", f"{r['wall_time_s']:.0f}" + (" (reused)" if r.get("reused") else "")])
    lines = [format_table(["seed", "mode", "fp8", "val loss", "gap", "val bpb", "train loss", "wall s"], rows), ""]
    n = len(cfg.seeds)
    mrows = []
    for mode, s in summary.items():
        verdict = "(reference)" if mode == "baseline" else ("met" if targets["within_gap"][mode] else "MISSED")
        gaps = [g for g in s["gaps_pct"] if math.isfinite(g)]
        rng = f"{min(gaps):+.3f}% .. {max(gaps):+.3f}%" if gaps and mode != "baseline" else "-"
        ms = [m for m in s["matched_steps"] if math.isfinite(m)]
        matched = "-" if mode == "baseline" or not ms else (
            f"{_fmt(s['matched_steps_mean'], '.3f')}x ({min(ms):.3f} .. {max(ms):.3f})")
        mrows.append([mode, f"{s['runs']}/{n}", _fmt(s["val_loss_mean"], ".4f"), _fmt(s["val_loss_sd"], ".4f"),
                      "-" if mode == "baseline" else _fmt(s["gap_mean_pct"], "+.3f") + "%",
                      "-" if mode == "baseline" else _fmt(s["gap_sd_pct"], ".3f") + "%", rng, matched, verdict])
    lines.append(format_table(["mode", "runs", "mean val loss", "sd", "mean gap", "gap sd", "gap range (seeds)",
                               "steps at matched loss (x baseline)", f"every |gap| <= {cfg.gap_target_pct:g}%"],
                              mrows))
    for seed in cfg.seeds:
        for mode in cfg.modes:
            r = runs.get(str(seed), {}).get(mode) or {}
            tag = f"seed {seed} {mode}"
            if r.get("error"):
                lines.append(f"{tag}: failed: {r['error']}")
            for f in r.get("fallbacks") or []:
                lines.append(f"{tag}: fallback: {f}")
            curves = r.get("curves") or {}
            top = [t for t in curves.get("worst_underflow") or [] if t[2] > 0]
            if top:  # the trainer's sampled FP8 statistics: where FP8 loses small values to zero
                lines.append(f"{tag}: most underflow at a sampled step (% of non-zero values flushed): "
                             + ", ".join(f"{layer} {role} {pct:.1f}% (step {step})" for layer, role, pct, step in top[:3]))
            if mode in AUTO_MODES and r and not r.get("error"):
                lines.append(f"{tag}: " + describe_choices(r.get("fp8_choices"), curves.get("auto_switches") or []))
    for mode, a in targets["auto_vs_best_fixed"].items():
        best = a["best_fixed_mode"] or "none finished"
        lines.append(
            f"{mode} vs best fixed mode ({best}), mean over {n} seed(s): {_fmt(a['auto_val_loss'], '.4f')} <= "
            f"{_fmt(a['limit'], '.4f')} (best {_fmt(a['best_fixed_val_loss'], '.4f')} x (1 + {a['tolerance_pct']:g}%)): "
            f"{'met' if a['met'] else 'MISSED'}; paired difference {mode} - {best} "
            f"{_fmt(a['diff_mean_pct'], '+.3f')}% +- {_fmt(a['diff_se_pct'], '.3f')}% (standard error)")
    for mode, a in targets["master_vs_seed_noise"].items():
        lines.append(
            f"--master_weights {mode} vs fp32 master weights, mean over {n} seed(s): gap {_fmt(a['gap_mean_pct'], '+.3f')}% "
            f"(sd {_fmt(a['gap_sd_pct'], '.3f')}%) against the seed noise {_fmt(a['noise_pct'], '.3f')}% (the baseline's "
            f"sd over seeds): {'within' if a['met'] else 'OUTSIDE'}" + ("" if a["target"] else " (reported, not a target)"))
    lines.append(f"targets: {'all met' if targets['all_met'] else 'NOT all met'}"
                 + ("  (--quick: a smoke run, these figures say nothing about FP8)" if cfg.quick else ""))
    return "\n".join(lines)


def describe_choices(choices: dict[str, dict[str, str]] | None, switches: list) -> str:
    """auto's formats in one line: layer count per role and format, plus any re-check switches."""
    if not choices:
        return ("no calibrated formats recorded (fp8_choices empty): trained with auto's "
                "pre-calibration default, e4m3 forward / e5m2 gradients")
    picked = Counter(f"{role} {dt}" for layer in choices.values() for role, dt in layer.items())
    text = "final formats (layers per role and format): " + ", ".join(f"{k}: {v}" for k, v in sorted(picked.items()))
    if switches:
        text += f"; {len(switches)} re-check switch(es): " + ", ".join(
            f"step {s} {layer} {role} -> {to}" for s, layer, role, to in switches[:4]) + (" ..." if len(switches) > 4 else "")
    return text


def ema(values: list[float], beta: float) -> list[float]:
    """Bias-corrected exponential moving average (Adam's correction: early points are not pulled
    toward 0)."""
    out, m = [], 0.0
    for i, v in enumerate(values, 1):
        m = beta * m + (1 - beta) * v
        out.append(m / (1 - beta ** i))
    return out


def plot(cfg: ParityConfig, runs: dict[str, dict[str, dict]], path: Path) -> None:
    """Left: train loss (EMA) and val loss of the first seed. Right: val loss gap to the baseline
    per eval step, mean over seeds as a line, the seeds' range as a band."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt

    fig, (ax, axg) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    beta = 1 - 1 / max(5, cfg.num_iterations // 10)  # ~10% of the run, at least 5 steps
    first = runs.get(str(cfg.seeds[0]), {})
    for i, mode in enumerate(cfg.modes):
        r, color = first.get(mode), f"C{i}"
        if not r:
            continue
        c = r["curves"]
        end = " (failed)" if r.get("error") else f", final {r['val_loss']:.4f}"
        if c["step"]:
            ax.plot(c["step"], ema(c["loss"], beta), color=color, lw=1.3, label=f"{mode} train (EMA)")
        if c["val_step"]:
            ax.plot(c["val_step"], c["val_loss"], "o", color=color, ms=5, mfc="none", label=f"{mode} val{end}")
        if mode == "baseline":
            continue
        per_step: dict[int, list[float]] = {}
        for seed in cfg.seeds:
            rs = runs.get(str(seed), {})
            if mode not in rs or "baseline" not in rs:
                continue
            base = dict(zip(rs["baseline"]["curves"]["val_step"], rs["baseline"]["curves"]["val_loss"]))
            for s, v in zip(rs[mode]["curves"]["val_step"], rs[mode]["curves"]["val_loss"]):
                if s in base:
                    per_step.setdefault(s, []).append(rel_gap_pct(v, base[s]))
        if per_step:
            steps = sorted(per_step)
            axg.plot(steps, [statistics.fmean(per_step[s]) for s in steps], "o-", color=color, ms=4,
                     label=f"{mode} (mean of {max(len(v) for v in per_step.values())})")
            axg.fill_between(steps, [min(per_step[s]) for s in steps], [max(per_step[s]) for s in steps],
                             color=color, alpha=0.2, lw=0, zorder=1)
    ax.set(xlabel="step", ylabel="loss (nats/token)",
           title=f"{cfg.model_name}, {cfg.batch_size}x{cfg.seq_len} tokens/step, seed {cfg.seeds[0]}, {cfg.recipe}")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    axg.axhspan(-cfg.gap_target_pct, cfg.gap_target_pct, color="0.92", zorder=0,
                label=f"+-{cfg.gap_target_pct:g}% target")
    axg.axhline(0, color="k", lw=0.8)
    axg.set(xlabel="step", ylabel="val loss gap to baseline (%)",
            title=f"gap to baseline; band: range over {len(cfg.seeds)} seed(s)")
    axg.legend(fontsize=8)
    axg.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def environment(cfg: ParityConfig, device) -> dict[str, Any]:
    from nanochat.fp8 import detect

    return dict(harness.machine(), jobs=cfg.jobs, device=str(device),
                fp8_hardware={r: detect(device, emulate=False, recipe=r).reason for r in dict.fromkeys(
                    mode_recipe(cfg, m) for m in cfg.modes if m not in ("baseline", *MASTER_MODES))})


def run_parity(cfg: ParityConfig) -> dict[str, Any]:
    """Run (or reuse) every seed x mode, print the report, write parity.json / parity.png; returns
    the parity.json payload."""
    from nanochat.device import resolve_device
    from nanochat.fp8 import detect

    device = resolve_device(cfg.device)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(cfg, device)
    emulated = {r for r in env["fp8_hardware"] if detect(device, emulate=False, recipe=r).backend != "native"}
    where = "; ".join(f"{r} {'emulated' if r in emulated else 'native'} ({why})"
                      for r, why in env["fp8_hardware"].items())
    print(f"fp8 parity: modes {' '.join(cfg.modes)} x seeds {' '.join(map(str, cfg.seeds))} on {device}, "
          f"FP8 {where or 'not used'}", flush=True)
    t_start = time.perf_counter()
    payload: dict[str, Any] = {}
    plots = importlib.util.find_spec("matplotlib") is not None
    if not plots:
        print("fp8 parity: matplotlib is not installed, so no parity.png (pip install -e '.[plots]')", flush=True)

    def on_result(runs: dict[str, dict[str, dict]]) -> None:
        for results in runs.values():
            add_gaps(results)
        summary = summarize(cfg, runs)
        env["loadavg_end"] = os.getloadavg()
        env["total_wall_time_s"] = time.perf_counter() - t_start
        payload.update(config=dataclasses.asdict(cfg), environment=env, runs=runs, summary=summary,
                       targets=check_targets(cfg, summary))
        harness.write_json(out / "parity.json", payload)
        if plots:
            plot(cfg, runs, out / "parity.png")

    runs = run_all(cfg, emulated=emulated, on_result=on_result)
    on_result(runs)
    print("\n" + report(cfg, runs, payload["summary"], payload["targets"]))
    print(f"\n{sum(len(m) for m in runs.values())} runs in {env['total_wall_time_s']:.0f} s; figures: "
          f"{out / 'parity.json'}" + (f", curves: {out / 'parity.png'}" if plots else ""), flush=True)
    return payload


def sweep(cfg: ParityConfig) -> None:
    """run_parity; a run that failed is an error after the report (exit status 1)."""
    runs = [(seed, mode, r) for seed, modes in run_parity(cfg)["runs"].items() for mode, r in modes.items()]
    failed = [f"seed {seed} {mode} ({r['error'].splitlines()[0][:200]})" for seed, mode, r in runs if r.get("error")]
    if failed:
        raise NanoChatError(f"{len(failed)} of {len(runs)} runs failed: {'; '.join(failed[:3])}"
                            + (" ..." if len(failed) > 3 else "") + f"; the errors are in {cfg.out_dir}/"
                            "parity.json, the tracebacks above (with --jobs > 1: in each run's train.log)")


def main(argv: list[str] | None = None) -> int:
    return harness.main(ParityConfig, sweep, argv, quick=QUICK)


if __name__ == "__main__":
    sys.exit(main())
