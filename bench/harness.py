"""What every benchmark shares: the command line, --quick, --out, interleaved runs, medians and
ratios, peak RSS, and the machine a figure was measured on.

A benchmark is `python bench/<name>.py [flags]`: a frozen dataclass of its flags (tyro, as the
entrypoints' configs in nanochat.config), most with `quick` (then a QUICK dict of toy sizes) and
`out`, and a function from the config to its figures:

    def bench(cfg: BenchFooConfig) -> dict:          # prints its tables, returns its figures
        ...
    def main(argv: list[str] | None = None) -> int:  # run as a script: sys.exit(main())
        return harness.main(BenchFooConfig, bench, argv, quick=QUICK)

`main` parses the flags (a bad one: one `error:` line, exit 2), swaps QUICK's sizes in under
--quick (a dry run in seconds, which the tests run; its figures mean nothing), runs the benchmark
(an error: one line, exit 1 or 2) and writes its figures to --out as JSON next to `machine()`:
when, where and from which commit they were measured, which BENCHMARKS.md records with them.

Measuring: a baseline and its candidates run in one process, `interleave`d (round-robin, so that
a change in the machine's load hits every variant alike); each is reported as the median of its
runs (`medians`, `median_of`) and as its ratio to the baseline's (`ratios`), with the load average
beside them (`load`): most figures here come from a shared 2-core machine. Two training runs are
compared by their validation curves: `steps_to` is the step at which one reaches a loss,
`matched_steps_ratio` the steps one needs per step of the other at matched loss. `peak_rss_mb` is a
process's host memory high-water mark; a training run's CUDA peak is nanochat.train.measure's,
which scripts/gpu_check.py reports too.

nanochat's parse_cli (tyro) is imported when `main` runs, not here: a measured process imports
this module for `peak_rss_mb`, and its RSS must not grow by what it would not load otherwise.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import platform
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from nanochat.common import NanoChatError, run_main
from nanochat.fs import write_atomic

C = TypeVar("C")
T = TypeVar("T")


def main(config: type[C], bench: Callable[[C], dict | None], argv: list[str] | None = None, *,
         quick: Mapping[str, Any] | None = None) -> int:
    """A benchmark's command line: parse `config`'s flags, apply `quick` under --quick, run
    `bench(cfg)`, write the figures it returns to --out (a benchmark without `out` writes its
    own files or none; one with `debug` shows an error's traceback). Returns the exit status."""
    from nanochat.config import parse_cli

    cfg = parse_cli(config, argv)
    if getattr(cfg, "quick", False) and quick:
        cfg = dataclasses.replace(cfg, **quick)

    def run() -> None:
        figures = bench(cfg)
        out = getattr(cfg, "out", None)
        if out and figures is not None:
            write_json(out, {"machine": machine(), **figures})
            print(f"\nwrote {out}")

    return run_main(run, debug=getattr(cfg, "debug", False))


def write_json(path: str | os.PathLike, payload: dict[str, Any]) -> None:
    """`payload` as JSON at `path`, written whole or not at all; values JSON lacks as strings."""
    write_atomic(path, json.dumps(payload, indent=2, default=str) + "\n")


# ---------------------------------------------------------------------------------- measuring
def interleave(variants: Mapping[str, Callable[[int], T]], repeats: int) -> dict[str, list[T]]:
    """Each variant run `repeats` times round-robin (a, b, c, a, b, c, ...), so that a change in the
    machine's load hits every variant alike: name -> its results, in order. A variant is called
    with the repeat's index (0, 1, ...), to name what that run writes."""
    runs: dict[str, list[T]] = {name: [] for name in variants}
    for i in range(repeats):
        for name, fn in variants.items():
            runs[name].append(fn(i))
    return runs


def timed(fn: Callable[[], object], *, cuda: bool = False, clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of `fn()` by `clock`; with `cuda`, the device synchronized on both sides, so the
    figure is the GPU's work and not how fast the host queued it."""
    if cuda:
        import torch

        torch.cuda.synchronize()
    t = clock()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return clock() - t


def medians(runs: Mapping[str, Iterable[float]]) -> dict[str, float]:
    """Each variant's median over its runs (robust to the one run a load spike slowed)."""
    return {name: statistics.median(values) for name, values in runs.items()}


def median_of(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Records of the same measurement's repeats as one: each numeric field's median, every other
    field the first record's."""
    records = list(records)
    return {k: statistics.median(r[k] for r in records) if isinstance(v, (int, float)) and not isinstance(v, bool)
            else v for k, v in records[0].items()}


def steps_to(target: float, steps: list[int], values: list[float]) -> float | None:
    """The first step at which the curve reaches `target`, linear between evaluations; the first
    evaluation's step when it is already there (an upper bound: nothing is measured before it),
    None when it never does."""
    for i, (s, v) in enumerate(zip(steps, values)):
        if v <= target:
            if i == 0:
                return float(s)
            s0, v0 = steps[i - 1], values[i - 1]
            return s0 + (s - s0) * (v0 - target) / (v0 - v)
    return None


def run_logged(cmd: list[str], *, cwd: Path, env: dict[str, str], log: Path, timeout_s: float) -> dict[str, Any]:
    """`cmd` in a new session, stdout and stderr to `log`; killed with its process group after
    `timeout_s`. Returns the exit status (None: timed out), the wall time and the log's text."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = None
    return dict(rc=rc, wall_time_s=time.perf_counter() - t0, log=str(log), text=log.read_text(errors="replace"))


def checked(r: dict[str, Any], what: str, timeout_s: float) -> dict[str, Any]:
    """`run_logged`'s record `r`; one error naming `what`, why and the log unless it exited 0."""
    if r["rc"] != 0:
        tail = [line for line in r["text"].splitlines() if line.strip()][-1:] or ["(no output)"]
        why = f"timed out after {timeout_s:g} s" if r["rc"] is None else f"exit {r['rc']}"
        raise NanoChatError(f"{what} failed ({why}): {tail[0].strip()[:300]}; full log: {r['log']}")
    return r


def matched_steps_ratio(steps: list[int], values: list[float], ref_steps: list[int],
                        ref_values: list[float]) -> float | None:
    """A run's steps per reference step at matched loss, from the two validation curves: when it
    ends at or below the reference's final loss, the steps it takes to reach that loss over the
    reference's steps (<= 1); when it ends above, its steps over the steps the reference takes to
    reach its final loss (> 1). A run at this ratio times the reference's tokens/s ratio reaches
    the same loss that much sooner or later. None: no curve, or a reference that never gets there."""
    if not values or not ref_values:
        return None
    if values[-1] <= ref_values[-1]:
        to = steps_to(ref_values[-1], steps, values)
        return None if to is None else to / ref_steps[-1]
    to = steps_to(values[-1], ref_steps, ref_values)
    return None if not to else steps[-1] / to


def ratios(figures: Mapping[str, float], baseline: str) -> dict[str, float]:
    """Each figure over the baseline's (the baseline's own: 1.0)."""
    return {name: value / figures[baseline] for name, value in figures.items()}


def load() -> str:
    """The load average (1, 5, 15 minutes), printed next to figures that a busy machine moves."""
    return "loadavg %.2f %.2f %.2f" % os.getloadavg()


def peak_rss_mb(pid: int | str = "self") -> float | None:
    """A live process's peak resident memory (Linux's VmHWM), MB; None where it cannot be read.
    Not getrusage's ru_maxrss: Linux carries that over from the parent through fork and exec."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration, ValueError):
        return None


# ------------------------------------------------------------------------------------ machine
def commit() -> str:
    """The git commit this code runs from (+ "-dirty" with uncommitted changes), or "unknown"."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def machine() -> dict[str, Any]:
    """When, where and from which code a figure was measured."""
    import torch

    return dict(date=time.strftime("%Y-%m-%d %H:%M:%S %z"), python=platform.python_version(),
                torch=torch.__version__, torchao=importlib.metadata.version("torchao"), platform=platform.platform(),
                cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(),
                omp_num_threads=os.environ.get("OMP_NUM_THREADS"), loadavg=os.getloadavg(), commit=commit())
