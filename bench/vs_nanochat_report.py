"""The figures of bench/bench_vs_nanochat.py's runs: per-seed curves, finals, and the steps and time
each project needs to reach the other's final bpb (and ours to nanochat's best); and `merge`, which
joins the --out files of several invocations of the same settings into one report.

Why join: a sweep of three seeds at 1,000 steps of d4 takes hours of a 2-core machine, so it is
run in parts (in parallel, or one part at a time): one part with nanochat's run and others with
`--nanochat_runs 0`. `merge` takes them only when they measured the same thing: the same settings
(seeds aside), the same nanochat commit, the same corpus and tokenizers (their fingerprints), and
no seed twice.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import harness
from nanochat.common import format_table

PER_INVOCATION = ("seeds", "nanochat_runs", "out", "work_dir", "timeout_s", "merge", "nanochat_dir",
                  "nanochat_python")
"""Settings that may differ between the joined files: where and how often, not what was run."""


def reach(run: dict[str, Any], target: float, tokens_per_step: int) -> tuple[float | None, float | None]:
    """Steps until `run`'s curve first reaches `target`, and their seconds at its tokens/s."""
    to = harness.steps_to(target, run["val_step"], run["val_bpb_curve"])
    return to, None if to is None or not run["tokens_per_sec"] else to * tokens_per_step / run["tokens_per_sec"]


def at_first_evaluation(run: dict[str, Any], target: float) -> bool:
    """Whether `run` is at `target` already at its first evaluation: its steps to it are then an
    upper bound (nothing is measured before), not a crossing read between two evaluations."""
    return bool(run["val_bpb_curve"]) and run["val_bpb_curve"][0] <= target


def compare(a: dict[str, Any], b: dict[str, Any], tokens_per_step: int) -> dict[str, Any]:
    """How soon run `a` reaches `b`'s final val bpb: steps on a's curve, seconds at a's tokens/s."""
    to, seconds = reach(a, b["val_bpb"], tokens_per_step)
    return dict(steps=to, seconds=seconds, steps_ratio=None if to is None else to / b["steps"],
                upper_bound=at_first_evaluation(a, b["val_bpb"]))


def ratio_cell(ratio: float | None, ours_bound: bool, theirs_bound: bool) -> str:
    """A time ratio as printed: "<=" where only ours is an upper bound, "*" where nanochat's is
    (then the ratio bounds nothing: both may be far earlier than their first evaluations)."""
    if ratio is None:
        return "-"
    return ("<= " if ours_bound and not theirs_bound else "") + f"{ratio:.2f}x" + ("*" if theirs_bound else "")


def attention(nanochat_runs: list[dict[str, Any]]) -> str:
    """", attention sdpa" (or fa3, or both): how nanochat's runs attended; the FA3 kernel is faster
    on a GPU, so a time ratio against an SDPA run is not against nanochat at its best there."""
    kinds = sorted({r["attention"] for r in nanochat_runs if r.get("attention")})
    return f", attention {' and '.join(kinds)}" if kinds else ""


def report(config: dict[str, Any], runs: dict[str, list[dict[str, Any]]], commit: str) -> list[dict[str, Any]]:
    """Print the tables of `runs` (name -> runs in seed order; nanochat's may be fewer, or none)
    and return the per-seed comparisons with nanochat (none without a nanochat run)."""
    names = [n for n in runs if runs[n]]
    run = lambda n, i: runs[n][min(i, len(runs[n]) - 1)]  # noqa: E731  (nanochat's last for later seeds)
    print(f"\nd{config['depth']}, {config['num_iterations']} steps of {config['batch_size']} x {config['seq_len']}, "
          f"vocab {config['vocab_size']}, packing {config['packing']} (ours); nanochat {commit[:12]}"
          f"{attention(runs.get('nanochat', []))} ({harness.load()})")
    for i, seed in enumerate(config["seeds"]):
        curves = {n: dict(zip(run(n, i)["val_step"], run(n, i)["val_bpb_curve"])) for n in names}
        own = {n: dict(zip(run(n, i)["own_val_step"], run(n, i)["own_val_bpb_curve"])) for n in names}
        steps = sorted(set().union(*curves.values()))
        print(f"\nval bpb at each evaluation (seed {seed}): common_bpb over every validation document "
              "(each project's own evaluator in brackets)")
        cell = lambda n, st: "-" if st not in curves[n] else (  # noqa: E731
            f"{curves[n][st]:.4f}" + (f" ({own[n][st]:.4f})" if st in own[n] else ""))
        print(format_table(["step", *names], [[st, *(cell(n, st) for n in names)] for st in steps]))
    rows = [[n, f"{statistics.fmean(r['val_bpb'] for r in runs[n]):.4f}",
             f"{statistics.fmean(min(r['val_bpb_curve']) for r in runs[n]):.4f}",
             f"{statistics.fmean(r['own_val_bpb'] for r in runs[n]):.4f}",
             f"{statistics.median(r['tokens_per_sec'] or 0 for r in runs[n]):,.0f}",
             f"{statistics.median(r['wall_time_s'] for r in runs[n]):.0f}"] for n in names]
    counts = ", ".join(f"{n} {len(runs[n])}" for n in names)
    print(f"\nfinal (mean over each one's runs: {counts}; tokens/s and wall time: medians)")
    print(format_table(["run", "final val bpb", "best", "its own evaluator's final", "tokens/s", "wall s"], rows))
    if not runs.get("nanochat"):
        print("\nno nanochat run here: join this file with one that has one (--merge) to compare")
        return []
    return comparisons(config, runs)


def comparisons(config: dict[str, Any], runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per seed and our optimizer: steps and time to the other's final, the time ratio, the same
    to nanochat's best evaluation (where its curve rises before the end, its final is reached at
    the first evaluation and that ratio is only one of tokens/s), and the evaluations where ours
    is above nanochat's (our seed i against nanochat's run i, or its last). A target a run is past
    at its first evaluation is flagged `upper_bound` (nanochat's: `nanochat_upper_bound`)."""
    tokens_per_step = config["batch_size"] * config["seq_len"]
    out, rows = [], []
    fmt = lambda c: "never" if c["steps"] is None else ("<= " if c["upper_bound"] else "") + (  # noqa: E731
        f"{c['steps']:.0f} ({c['steps_ratio']:.2f}x)" + ("" if c["seconds"] is None else f", {c['seconds']:.0f} s"))
    for i, seed in enumerate(config["seeds"]):
        nc = runs["nanochat"][min(i, len(runs["nanochat"]) - 1)]
        for n in (n for n in runs if n != "nanochat"):
            o = runs[n][i]
            mine, theirs = dict(zip(o["val_step"], o["val_bpb_curve"])), dict(zip(nc["val_step"], nc["val_bpb_curve"]))
            rec = dict(seed=seed, ours=n, ours_to_nanochat=compare(o, nc, tokens_per_step),
                       nanochat_to_ours=compare(nc, o, tokens_per_step),
                       ours_above_at=[st for st in sorted(mine.keys() & theirs.keys()) if mine[st] > theirs[st]])
            to, theirs_s = rec["ours_to_nanochat"]["seconds"], compare(nc, nc, tokens_per_step)["seconds"]
            rec["time_ratio"] = None if to is None or not theirs_s else to / theirs_s
            best = min(nc["val_bpb_curve"])
            (steps, seconds), (_, theirs_s) = reach(o, best, tokens_per_step), reach(nc, best, tokens_per_step)
            rec.update(nanochat_best=best, ours_to_nanochat_best=dict(steps=steps, seconds=seconds,
                                                                      upper_bound=at_first_evaluation(o, best)),
                       best_time_ratio=None if seconds is None or not theirs_s else seconds / theirs_s,
                       nanochat_upper_bound=dict(final=at_first_evaluation(nc, nc["val_bpb"]),
                                                 best=at_first_evaluation(nc, best)))
            out.append(rec)
            ob, nb = rec["ours_to_nanochat_best"]["upper_bound"], rec["nanochat_upper_bound"]
            rows.append([seed, n, fmt(rec["ours_to_nanochat"]), fmt(rec["nanochat_to_ours"]),
                         ratio_cell(rec["time_ratio"], rec["ours_to_nanochat"]["upper_bound"], nb["final"]),
                         "never" if steps is None else ("<= " if ob else "") + f"{steps:.0f}" + (
                             "" if rec["best_time_ratio"] is None else
                             ", " + ratio_cell(rec["best_time_ratio"], ob, nb["best"])),
                         " ".join(map(str, rec["ours_above_at"])) or "none"])
    print("\nsteps (x the other's steps), time at the run's own tokens/s, to the other's final val bpb")
    print(format_table(["seed", "ours", "ours to nanochat's final", "nanochat to ours' final",
                        "our time / nanochat's, to its final", "to nanochat's best: our steps, time ratio",
                        "evaluations where ours is above"], rows))
    keys = ("ours_to_nanochat", "nanochat_to_ours", "ours_to_nanochat_best")
    if any(c[k]["upper_bound"] for c in out for k in keys) or any(any(c["nanochat_upper_bound"].values()) for c in out):
        print("<=: the run is there at its first evaluation, so its steps are an upper bound; *: nanochat is, so "
              "the ratio bounds nothing; a smaller --eval_every measures both")
    return out


def read_part(path: str, *, joined: bool) -> dict[str, Any]:
    """A --out file; one joined with others must carry the fingerprints that show they match."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--merge {path}: cannot read it as JSON ({e}); pass files bench_vs_nanochat wrote "
                         "with --out") from None
    need = {"config", "runs", "nanochat_commit"} | ({"fingerprints"} if joined else set())
    if not isinstance(data, dict) or not need <= data.keys():
        raise ValueError(f"--merge {path}: not a bench_vs_nanochat --out file with fingerprints; rerun that part "
                         "with this version of the bench")
    return data


def merge(paths: tuple[str, ...]) -> dict[str, Any]:
    """The report of several --out files as one run, after checking they measured the same thing."""
    parts = [read_part(p, joined=len(paths) > 1) for p in paths]
    first = parts[0]
    for p, d in zip(paths[1:], parts[1:]):
        for k in sorted(first["config"].keys() | d["config"].keys()):
            a, b = first["config"].get(k), d["config"].get(k)
            if k not in PER_INVOCATION and a != b:
                raise ValueError(f"--merge: {p} ran --{k} {b!r}, {paths[0]} ran {a!r}; join only runs of the "
                                 "same settings")
        for what, a, b in (("nanochat commit", first["nanochat_commit"], d["nanochat_commit"]),
                           *((f"{k} fingerprint", v, d["fingerprints"].get(k))
                             for k, v in first["fingerprints"].items())):
            if a != b:
                raise ValueError(f"--merge: {p} has another {what} than {paths[0]} ({b} vs {a}); join only runs "
                                 "of the same corpus, tokenizers and nanochat")
    seeds = [s for d in parts for s in d["config"]["seeds"]]
    if len(set(seeds)) < len(seeds):
        raise ValueError(f"--merge: a seed appears twice ({seeds}); join parts of different seeds")
    runs = {n: [r for d in parts for r in d["runs"][n]] for n in first["runs"]}
    if not runs["nanochat"]:
        raise ValueError("--merge: none of the files holds a nanochat run; run one part with --nanochat_runs 1")
    config = dict(first["config"], seeds=seeds, nanochat_runs=len(runs["nanochat"]), merge=list(paths))
    print(f"bench_vs_nanochat: joined {len(parts)} files: seeds {seeds}, nanochat runs {len(runs['nanochat'])}")
    return dict(config=config, nanochat_commit=first["nanochat_commit"], corpus=first["corpus"],
                fingerprints=first.get("fingerprints"), merged_from=[dict(path=p, machine=d.get("machine"))
                                                                 for p, d in zip(paths, parts)],
                comparisons=report(config, runs, first["nanochat_commit"]), runs=runs)
