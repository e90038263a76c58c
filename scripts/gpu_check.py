"""GPU check: nanochat's default training path on one CUDA GPU with FP8 tensor cores (sm_89+).

    bash scripts/gpu_check.sh                 # 8 minutes in all (--budget_s); figures in $OUT/gpu_check.json
    .venv/bin/python scripts/gpu_check.py --dry_run    # the same jobs at toy sizes on the CPU

A scheduler over the library's measurements (nanochat.train.measure and .linear_shapes, which
bench/bench_optim.py, bench_train.py and bench_fp8_linear.py take too): it runs them in priority
order within --budget_s and records them in one JSON, the tests' log and junit XML beside it.
Training runs are what a user runs: `NanoChatTrainer` with its defaults (the whole model
compiled, bf16 autocast over fp32 master weights; --big_model compiled per block to fit the
time), no checkpoints, on the stdlib's sources with a BPE trained on the fly (cached).
Jobs, in priority order (the figures no earlier run has first, FP8 `all` last):
  env     torch / torchao / GPU, what nanochat.fp8.detect decides per recipe, the MFU peak;
  tests   every test marked `gpu` (GPU_TEST_FILES): each test's outcome and full failure text
          (junit XML, the whole log in $OUT), kept when the time limit interrupts pytest;
  optim   measure.optimizer_steps: fused AdamW vs FP8Optim levels 0/1/2, each alone on --opt_tensors
          x --opt_dim^2 fp32 parameters: step time, peak memory, device reads, backend, fallbacks;
  stats   measure.stats_cost: tokens/s over one --fp8_stats_every period with its sampled
          step against the same steps without it (goal: <= 2%);
  train   measure.train_run at --model (d12) and --big_model (d26), bf16 vs FP8 --fp8_layers
          faster (the default): tokens/s, MFU, compile time, graph breaks, recompiles, peak memory;
  shapes  linear_shapes.time_shapes: bf16 vs FP8 tensorwise and rowwise per Linear shape of
          --shape_models at --shape_tokens rows, compiled, within --shapes_budget_s;
  all     both models with every Linear in FP8 (not repeated where faster converted every one),
          and measure.profile_step at --model (GEMM kernels, torch._scaled_mm calls, device reads);
  mxfp8   --model with every Linear in MXFP8 (--fp8_recipe mxfp8): only on sm_100+ (Blackwell),
          where it runs natively; on an Ada or Hopper GPU the row records why it did not run.
Also on request: scope (--compile_scope blocks against model), opt_levels, master.
Each measurement has an estimate (ESTIMATES_S); one that does not fit what is left of --budget_s
is skipped and listed. A training run during which dynamo hit its recompile limit ran partly
eager: its figures are kept but marked `invalid`, and no ratio or MFU is computed from them. The
JSON is rewritten after every measurement (each shape included), so a run stopped at any point
keeps what finished; gpu_check.sh stops it 25 s after --budget_s.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

# torch is imported in the functions that use it: --help stays fast
if TYPE_CHECKING:
    import torch

from nanochat.config.gpu_check import DRY_RUN, JOB_NAMES, GPUCheckConfig

ROOT = Path(__file__).resolve().parent.parent


# Seconds on an H100/H200 class GPU, compile included, from BENCHMARKS.md section 5 (H200, torch
# 2.11: d12 compiled whole in 20.4 s bf16 and 58.7 s FP8 e4m3, then ran 613k / 553k tokens/s;
# env, optim and the 17 GPU tests took <= 105 s together) and the reasoning beside each figure.
ESTIMATES_S = {
    "env": 5,
    "tests": 90,  # ~60 s for 17 in run 1; the 5 added to test_gpu.py since (3 instant _scaled_mm calls, 2
    # compiling a small MLP, ~4 s) and the 2 of test_fp8_optim.py / test_fp8_policy.py (d26's three shapes timed)
    "optim": 40,  # 4 optimizers: state creation, one compile per level, 10 steps over 537M parameters
    "stats": 80,  # d12 with every Linear in FP8, compiled first here (~59 s), then 201 steps of 53 ms
    "model/bf16": 35,  # compile 20 s, the tokenizer (BPE on the stdlib, first run only) ~10 s, 20 steps 1 s
    "model/fp8": 60,  # faster: ~10 s timing d12's three shapes (then cached), compile below 59 s since only
    # the 12 MLP up-projections carry FP8 casts, 20 steps
    "big/bf16": 25,  # per block: one block's graph (10 s for d12's, the same for d26's) + 20 steps of 16k tokens
    "big/fp8": 45,  # per block: 21 s + timing d26's three shapes (~10 s)
    "shape": 15,  # the shapes job runs --shapes_budget_s plus the shape started last: 3 compiles of a few
    # seconds, 2 x 3 x 3 x 10 timed steps (the Llama MLP's at 32768 rows: ~20 ms each)
    "model/fp8_all": 50,  # every Linear in FP8: stats compiled this graph, inductor's cache serves it (~25 s)
    "big/fp8_all": 45,  # run only where faster kept layers in bf16 (torchao's tables convert all of d26's)
    "model/fp8_mxfp8": 70,  # not yet run on a Blackwell GPU: d12 FP8 `all`'s ~60 s compile plus 20 steps, as a guess
    "scope": 120,  # d12 bf16 and FP8 compiled per block: 10 + 21 s compile (run 1)
    "opt_levels": 150,  # d12 FP8 at --fp8_opt_level 1 and 2, each compiling ~60 s
    "master": 220,  # three d12 FP8 runs with bf16 master weights, the first compiling ~60 s
}

GPU_TEST_FILES = ("tests/test_gpu.py", "tests/test_fp8_optim.py", "tests/test_fp8_policy.py")
"""The test files holding tests marked `gpu` (tests/test_gpu_check.py keeps this list complete):
the tests job runs `pytest -m gpu` on them, not on the whole suite, whose collection alone would
import every test module."""


class Interrupted(BaseException):
    """The time limit (SIGTERM from gpu_check.sh): the measurement running is recorded as cut."""


# ------------------------------------------------------------------------------------ findings
class Findings:
    """gpu_check.json: each measurement's figures, error or skip, rewritten (atomically) after
    every one. Keys are paths: "train/d12/bf16" is results["train"]["d12"]["bf16"]."""

    def __init__(self, path: Path, cfg: GPUCheckConfig):
        self.path, self.cfg, self.start = path, cfg, time.perf_counter()
        self.data: dict[str, Any] = {"config": dataclasses.asdict(cfg), "results": {}, "ratios": {},
                                     "errors": {}, "durations_s": {}, "skipped_for_time": []}
        self.save()

    def left_s(self) -> float:
        return self.cfg.budget_s - (time.perf_counter() - self.start)

    def measure(self, key: str, estimate_s: float, fn: Callable[[], Any]) -> Any:
        """fn()'s figures stored at `key`, unless its estimate does not fit what is left (skipped,
        None); an exception is recorded with its traceback (None) and the next measurement runs."""
        left = self.left_s()
        if estimate_s > left and not self.cfg.dry_run:
            self.data["skipped_for_time"].append(key)
            print(f"[gpu_check] {key}: skipped ({estimate_s:.0f} s estimated, {left:.0f} s left)", flush=True)
            self.save()
            return None
        t0, value = time.perf_counter(), None
        try:  # announced inside: a SIGTERM that lands right after the line still cuts this measurement
            print(f"[gpu_check] {key}: running ({left:.0f} s left)", flush=True)
            value = fn()
            self.put(key, value, save=False)
        except Interrupted:
            self.data["errors"][key] = "stopped by the time limit (SIGTERM) while running"
            raise
        except Exception as e:  # noqa: BLE001 -- one failing measurement must not cost the others
            self.data["errors"][key] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
            print(f"[gpu_check] {key}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        finally:
            self.data["durations_s"][key] = time.perf_counter() - t0
            self.data["ratios"] = ratios(self.data["results"])
            self.save()
        return value

    def put(self, key: str, value: Any, *, save: bool = True) -> None:
        *parents, name = key.split("/")
        node = self.data["results"]
        for p in parents:
            node = node.setdefault(p, {})
        node[name] = value
        if save:
            self.save()

    def save(self) -> None:
        from nanochat.fs import write_atomic

        write_atomic(self.path, json.dumps(self.data, indent=1, default=str))


def ratios(results: dict) -> dict:
    """FP8 / bf16 tokens/s and the MFUs of every model of the train and all jobs, where both sides
    ran; a run marked `invalid` (partly eager after dynamo's recompile limit) gives no figure here,
    only the reason."""
    out = {}
    for model, runs in (results.get("train") or {}).items():
        runs = {**runs, **((results.get("all") or {}).get(model) or {}),
                **((results.get("mxfp8") or {}).get(model) or {})}
        base = runs.get("bf16") or {}
        for kind, r in runs.items():
            if not isinstance(r, dict) or not r.get("tokens_per_sec"):
                continue
            if r.get("invalid") or base.get("invalid"):
                out[f"{model}_{kind}_invalid"] = r.get("invalid") or f"its bf16 run: {base['invalid']}"
                continue
            if base.get("tokens_per_sec") and kind != "bf16":
                out[f"{model}_{kind}_over_bf16_tokens_per_sec"] = r["tokens_per_sec"] / base["tokens_per_sec"]
            out[f"{model}_{kind}_mfu"] = r.get("mfu")
    return out


# ------------------------------------------------------------------------------------ helpers
def device_of(cfg: GPUCheckConfig) -> torch.device:
    import torch

    return torch.device("cpu" if cfg.dry_run else "cuda")


def trainer_kwargs(cfg: GPUCheckConfig, name: str, model: str, batch_size: int, *, fp8: bool) -> dict:
    """What every training run of the check shares: no evaluation, checkpoint or sample; FP8
    emulated in a dry run."""
    kw = dict(model_name=model, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, batch_size=batch_size,
              num_iterations=cfg.steps, warmup_steps=2, eval_every=0, eval_tokens=cfg.seq_len * batch_size,
              save_checkpoints=False, num_samples=0, device=str(device_of(cfg)),
              run_dir=str(Path(cfg.run_root) / name))
    if fp8 and cfg.dry_run:
        kw["fp8_emulate"] = True
    return kw


def run_pytest(args: list[str], out_dir: Path, name: str, timeout_s: float) -> dict:
    """pytest in a subprocess, its whole output in <name>.log and every test's outcome and full
    failure text from <name>.xml (junit). On timeout pytest is interrupted (SIGINT: it reports
    the tests that ran, writes the XML and names where the running one was), killed 30 s later
    if still running."""
    log, junit = out_dir / f"{name}.log", out_dir / f"{name}.xml"
    junit.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:logging", "-rA", "--tb=long",
           "--durations=0", f"--junitxml={junit}", *args]
    timed_out = False
    with open(log, "w") as f:
        # preexec_fn: pytest must take the SIGINT sent below even when this check runs as a
        # background job, which a shell starts with SIGINT ignored (and children inherit that)
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env=dict(os.environ, COLUMNS="200"),  # long test ids and values unwrapped
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.send_signal(signal.SIGINT)
            try:
                returncode = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                returncode = proc.wait()
    lines = log.read_text(errors="replace").strip().splitlines()
    out: dict[str, Any] = {
        "returncode": returncode, "timed_out": timed_out, "summary": lines[-1].strip("= ") if lines else "",
        "interrupted_at": next((line for line in lines if line.endswith(": KeyboardInterrupt")), None),
        "log": str(log), "junit": str(junit) if junit.is_file() else None, "outcomes": {}, "failures": {}}
    if junit.is_file():
        for case in ET.parse(junit).getroot().iter("testcase"):
            test = case.get("name")
            if test is None:  # the test an interrupt cut short: see interrupted_at
                continue
            kind = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
            out["outcomes"][test] = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(
                kind.tag if kind is not None else "", "passed")
            if kind is not None and kind.tag != "skipped":
                out["failures"][test] = f"{kind.get('message', '')}\n{kind.text or ''}"
    out["counts"] = dict(collections.Counter(out["outcomes"].values()))
    return out


# --------------------------------------------------------------------------------------- jobs
def job_env(cfg: GPUCheckConfig, findings: Findings) -> None:
    import torch

    def env() -> dict:
        import torchao

        from nanochat.fp8 import detect
        from nanochat.train.mfu import device_peak

        device = device_of(cfg)
        out = dict(python=platform.python_version(), torch=torch.__version__, torchao=torchao.__version__,
                   cuda=torch.version.cuda, device=str(device))
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(0)
            out.update(gpu=props.name, capability=list(torch.cuda.get_device_capability(0)),
                       memory_gib=props.total_memory / 2**30)
        peak = device_peak(device)
        out["mfu_peak"] = dataclasses.asdict(peak) if peak is not None else None
        out["fp8"] = {r: dataclasses.asdict(detect(device, emulate=cfg.dry_run, recipe=r))
                      for r in ("tensorwise", "rowwise", "mxfp8")}
        return out

    findings.measure("env", ESTIMATES_S["env"], env)


def job_tests(cfg: GPUCheckConfig, findings: Findings) -> None:
    # on the CPU every test skips (no CUDA device): the dry run rehearses the run and its report
    findings.measure("tests", ESTIMATES_S["tests"], lambda: run_pytest(
        ["-m", "gpu", *(str(ROOT / f) for f in GPU_TEST_FILES)], findings.path.parent, "gpu_tests",
        cfg.tests_timeout_s))


def job_optim(cfg: GPUCheckConfig, findings: Findings) -> None:
    def optim() -> dict:
        from nanochat.train.measure import optimizer_steps

        return optimizer_steps(device_of(cfg), n_tensors=cfg.opt_tensors, dim=cfg.opt_dim, steps=cfg.opt_steps,
                               optimizers=cfg.optimizers)

    findings.measure("optim", ESTIMATES_S["optim"], optim)


def job_stats(cfg: GPUCheckConfig, findings: Findings) -> None:
    """--model with every eligible Linear in FP8 (the most layers to sample), then its
    stats_cost: one --fp8_stats_every period timed step by step."""
    def stats() -> dict:
        from nanochat.train.measure import stats_cost, train_run

        kw = trainer_kwargs(cfg, "stats", cfg.model, cfg.batch_size, fp8=True)
        trainer, figures = train_run(kw, fp8=True, fp8_layers="all")
        invalid = {"invalid": figures["invalid"]} if "invalid" in figures else {}
        return {**invalid, "model": cfg.model, "fp8_converted_layers": figures["fp8_converted_layers"],
                **stats_cost(trainer, cfg.batch_size * cfg.seq_len)}

    findings.measure("stats", ESTIMATES_S["stats"], stats)


def _train_models(cfg: GPUCheckConfig) -> dict[str, tuple[str, int, dict]]:
    """model -> (role in ESTIMATES_S, batch size, its compile scope) of the train and all jobs."""
    models = {cfg.model: ("model", cfg.batch_size, {})}
    models.setdefault(cfg.big_model, ("big", cfg.big_batch_size, {"compile_scope": cfg.big_compile_scope}))
    return models


def _training(cfg: GPUCheckConfig, name: str, model: str, *, profile: bool = False, **over) -> Callable[[], dict]:
    """One train_run of `model` (its batch size and compile scope) with `over`, as a measurement;
    `profile` adds one profiled step."""
    def run() -> dict:
        from nanochat.train.measure import profile_step, train_run

        _, batch_size, scope = _train_models(cfg)[model]
        kw = trainer_kwargs(cfg, name, model, batch_size, fp8=over.get("fp8", False))
        trainer, figures = train_run(kw, **scope, **over)
        return {**figures, **profile_step(trainer)} if profile else figures
    return run


def job_train(cfg: GPUCheckConfig, findings: Findings) -> None:
    """bf16 vs FP8 `faster` (the default policy) at --model, then at --big_model: each run its own
    measurement, so that a side skipped for time or failing keeps the other."""
    for model, (role, _, _) in _train_models(cfg).items():
        findings.measure(f"train/{model}/bf16", ESTIMATES_S[f"{role}/bf16"], _training(cfg, f"{model}-bf16", model))
        findings.measure(f"train/{model}/fp8_faster", ESTIMATES_S[f"{role}/fp8"],
                         _training(cfg, f"{model}-fp8_faster", model, fp8=True, fp8_layers="faster"))


def job_shapes(cfg: GPUCheckConfig, findings: Findings) -> None:
    def shapes() -> dict:
        from nanochat.train.linear_shapes import time_shapes

        deadline = time.perf_counter() + cfg.shapes_budget_s
        return time_shapes(cfg.shape_models, device_of(cfg), tokens=cfg.shape_tokens, steps=10, repeats=3,
                           emulate=cfg.dry_run, deadline=deadline,
                           on_result=lambda key, figures: findings.put(f"shapes/shapes/{key}", figures))

    findings.measure("shapes", cfg.shapes_budget_s + ESTIMATES_S["shape"], shapes)


def job_all(cfg: GPUCheckConfig, findings: Findings) -> None:
    """FP8 `all` at both models, against train's bf16 runs; --model's adds one profiled step
    (GEMM kernels, device reads). Where `faster` converted every eligible Linear, `all` is the
    same run and is recorded as such, not repeated."""
    for model, (role, _, _) in _train_models(cfg).items():
        faster = ((findings.data["results"].get("train") or {}).get(model) or {}).get("fp8_faster") or {}
        if faster.get("fp8_kept_by_policy") == 0 and role != "model":
            findings.put(f"all/{model}/fp8_all", {"same_as": "train/fp8_faster", "why": (
                "--fp8_layers faster converted every eligible Linear, so `all` is the same run")})
            continue
        findings.measure(f"all/{model}/fp8_all", ESTIMATES_S[f"{role}/fp8_all"], _training(
            cfg, f"{model}-fp8_all", model, profile=role == "model", fp8=True, fp8_layers="all"))


def job_mxfp8(cfg: GPUCheckConfig, findings: Findings) -> None:
    """--model with every eligible Linear in MXFP8, against train's bf16 run (its ratio and MFU in
    `ratios`). Native MXFP8 needs sm_100+: elsewhere the row says why it did not run, rather than
    timing an emulation or a high-precision fallback (a dry run emulates it, to rehearse the row)."""
    from nanochat.fp8 import detect

    key = f"mxfp8/{cfg.model}/fp8_mxfp8"
    backend = detect(device_of(cfg), emulate=cfg.dry_run, recipe="mxfp8")
    if backend.backend == "fallback":
        findings.put(key, {"not_run": f"MXFP8 runs natively on sm_100+ (Blackwell) only: {backend.reason}"})
        return
    findings.measure(key, ESTIMATES_S["model/fp8_mxfp8"], _training(
        cfg, f"{cfg.model}-fp8_mxfp8", cfg.model, fp8=True, fp8_recipe="mxfp8", fp8_layers="all"))


def job_scope(cfg: GPUCheckConfig, findings: Findings) -> None:
    """--model compiled per block (--compile_scope blocks), bf16 and FP8: against train's whole-model runs."""
    for kind, over in (("bf16", {}), ("fp8", {"fp8": True})):
        findings.measure(f"scope/{kind}_blocks", ESTIMATES_S["scope"] / 2,
                         _training(cfg, f"{kind}-blocks", cfg.model, compile_scope="blocks", **over))


def job_opt_levels(cfg: GPUCheckConfig, findings: Findings) -> None:
    """--model with FP8 and the moments in FP8 (--fp8_opt_level 1, 2): tokens/s, peak memory."""
    for level in (1, 2):
        findings.measure(f"opt_levels/level{level}", ESTIMATES_S["opt_levels"] / 2,
                         _training(cfg, f"fp8-l{level}", cfg.model, fp8=True, fp8_opt_level=level))


def job_master(cfg: GPUCheckConfig, findings: Findings) -> None:
    """FP8 level-2 moments with each way of cutting the rest of the training state: bf16_sr
    masters, bf16_split, bf16_sr with the step inside the backward."""
    runs = {"bf16_sr": dict(master_weights="bf16_sr"), "bf16_split": dict(master_weights="bf16_split"),
            "bf16_sr_in_backward": dict(master_weights="bf16_sr", optimizer_in_backward=True, grad_clip=0.0)}
    for name, over in runs.items():
        findings.measure(f"master/{name}", ESTIMATES_S["master"] / 3,
                         _training(cfg, f"master-{name}", cfg.model, fp8=True, fp8_opt_level=2, **over))


JOBS: dict[str, Callable[[GPUCheckConfig, Findings], None]] = {
    "env": job_env, "tests": job_tests, "optim": job_optim, "stats": job_stats, "train": job_train,
    "shapes": job_shapes, "all": job_all, "mxfp8": job_mxfp8, "scope": job_scope, "opt_levels": job_opt_levels,
    "master": job_master}
assert tuple(JOBS) == JOB_NAMES, "every job GPUCheckConfig accepts has its function here"


def main(argv: list[str] | None = None) -> int:
    from nanochat.config import parse_cli

    cfg = parse_cli(GPUCheckConfig, argv)
    import torch  # after parsing: --help stays fast

    if cfg.dry_run:
        cfg = dataclasses.replace(cfg, **DRY_RUN)
    if not cfg.run_root:
        cfg = dataclasses.replace(cfg, run_root=tempfile.mkdtemp(prefix="nanochat-gpu-check-"))
    if not cfg.dry_run and not torch.cuda.is_available():
        print("error: no CUDA device; run with --dry_run to rehearse on the CPU", file=sys.stderr)
        return 2

    def stop(signum, frame):
        raise Interrupted

    signal.signal(signal.SIGTERM, stop)
    findings = Findings(Path(cfg.out), cfg)
    try:
        for name in cfg.jobs:
            JOBS[name](cfg, findings)
    except Interrupted:
        print("[gpu_check] stopped by the time limit; the JSON keeps every measurement that finished", flush=True)
        return 124
    print("[gpu_check] ratios: " + json.dumps(findings.data["ratios"]))
    print(f"[gpu_check] errors: {sorted(findings.data['errors'])}; skipped: {findings.data['skipped_for_time']}; "
          f"total {time.perf_counter() - findings.start:.0f} s; JSON: {findings.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
