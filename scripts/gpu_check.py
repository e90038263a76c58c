"""GPU check: nanochat's default training path on one CUDA GPU with FP8 tensor cores (sm_89+).

    bash scripts/gpu_check.sh                 # ~8 minutes; figures in $OUT/gpu_check.json
    .venv/bin/python scripts/gpu_check.py --dry_run    # the same jobs at toy sizes on the CPU

Every job runs what a user runs: `NanoChatTrainer` with its defaults (the whole model compiled,
bf16 autocast over fp32 master weights), on this Python's standard-library sources with a
BPE tokenizer trained on the fly (cached after the first job). Jobs, in priority order:
  env       torch / torchao / GPU, and what nanochat.fp8.detect decides for each recipe;
  bf16      d12 without FP8: tokens/s, compile time, graph breaks, recompile reasons, peak memory;
  fp8       the same with --fp8 (e4m3, tensorwise), then one profiled step: the GEMM kernels that
            ran and the calls of torch._scaled_mm (proof that FP8 GEMMs run), device reads in the step;
  optim     fused AdamW vs FP8Optim levels 0/1/2 on --opt_tensors x --opt_dim^2 fp32 parameters:
            step time, peak memory, the step's backend and fallbacks;
  opt_levels d12 --fp8 at --fp8_opt_level 1 and 2: tokens/s and peak memory of whole steps;
  scope     d12 bf16 and FP8 compiled per block (--compile_scope blocks): compile time and
            tokens/s against the whole-model default;
  big       --big_model (d26) bf16 vs FP8: the speedup at a size where GEMMs dominate;
  tests     `pytest -m gpu tests/test_gpu.py`.
Each job has an estimate (ESTIMATES_S, seconds on an H100/H200 class GPU, compile included); one
that does not fit what is left of --budget_s is skipped and listed. The JSON is rewritten after
each job, so a run stopped at any point keeps what finished.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, kw_only=True)
class GPUCheckConfig:
    """Flags of scripts/gpu_check.py; --dry_run swaps in toy sizes (DRY_RUN)."""

    out: str = ".cache/gpu_check/gpu_check.json"
    """The JSON file, rewritten after every job."""
    dry_run: bool = False
    """Rehearse on the CPU: toy sizes, FP8 emulated; the figures mean nothing, the schema is the GPU run's."""
    budget_s: float = 420.0
    """Seconds for all jobs; a job whose estimate does not fit what is left is skipped."""
    jobs: tuple[str, ...] = ("env", "bf16", "fp8", "optim", "opt_levels", "scope", "big", "tests", "master")
    """Jobs to run, in this order."""
    model: str = "d12"
    """Preset of the bf16 / fp8 / opt_levels / scope jobs."""
    big_model: str = "d26"
    """Preset of the big job."""
    batch_size: int = 16
    """Sequences per step of the d12 jobs."""
    big_batch_size: int = 8
    """Sequences per step of the big job."""
    seq_len: int = 2048
    """Tokens per sequence of every training job."""
    vocab_size: int = 8192
    """BPE vocabulary trained on the stdlib for the training jobs (cached after the first)."""
    steps: int = 20
    """Training steps per job (the compiling step is not in tokens/s)."""
    opt_tensors: int = 32
    """Parameter tensors of the optim job."""
    opt_dim: int = 4096
    """Each optim-job parameter is opt_dim x opt_dim fp32."""
    opt_steps: int = 10
    """Timed optimizer steps (median reported) after one that creates the state and compiles."""
    tests_timeout_s: float = 150.0
    """Stop the GPU tests after this many seconds (recorded as an error)."""
    run_root: str = ""
    """Where the runs' directories go (default: a temporary directory)."""

    def __post_init__(self) -> None:
        unknown = [j for j in self.jobs if j not in JOBS]
        if unknown:
            raise ValueError(f"--jobs: unknown job {' '.join(unknown)}; the jobs are {' '.join(JOBS)}")
        for name in ("budget_s", "tests_timeout_s"):
            if not getattr(self, name) > 0:  # also refuses nan
                raise ValueError(f"--{name} must be a positive number of seconds, got {getattr(self, name)}")


DRY_RUN = dict(model="d2", big_model="d2", batch_size=2, big_batch_size=2, seq_len=32, vocab_size=320,
               steps=3, opt_tensors=2, opt_dim=256, opt_steps=2, tests_timeout_s=120.0)

ESTIMATES_S = {"env": 5, "bf16": 75, "fp8": 80, "optim": 40, "opt_levels": 100, "scope": 120,
               "big": 180, "tests": 70, "master": 150}


# ------------------------------------------------------------------------------------ helpers
def device_of(cfg: GPUCheckConfig) -> torch.device:
    return torch.device("cpu" if cfg.dry_run else "cuda")


def reset_memory(device: torch.device) -> None:
    torch._dynamo.reset()  # each job compiles from scratch: compile times are first runs'
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def graph_breaks() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {"graph_breaks": sum(counters["graph_break"].values()),
            "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
            "break_reasons": dict(list(counters["graph_break"].items())[:5])}


def trainer_kwargs(cfg: GPUCheckConfig, name: str, model: str, batch_size: int, **over) -> dict:
    kw = dict(model_name=model, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, batch_size=batch_size,
              num_iterations=cfg.steps, warmup_steps=2, eval_every=0, eval_tokens=cfg.seq_len * batch_size,
              save_every=0, num_samples=0, device=str(device_of(cfg)),
              run_dir=str(Path(cfg.run_root) / name))
    if over.get("fp8") and cfg.dry_run:
        over = dict(over, fp8_emulate=True)
    kw.update(over)
    return kw


def train(cfg: GPUCheckConfig, name: str, model: str, batch_size: int, *, profile: bool = False,
          **over) -> dict:
    """One NanoChatTrainer run; its figures, graph breaks, peak memory and (profile) the kernels
    and device reads of one more step."""
    from torch._dynamo.utils import counters

    from nanochat.trainer import NanoChatTrainer

    device = device_of(cfg)
    reset_memory(device)
    counters.clear()
    recompiles = RecompileLog()
    trainer = NanoChatTrainer(**trainer_kwargs(cfg, name, model, batch_size, **over))
    with recompiles:
        r = trainer.train()
    out = dict(settings=over, model=model, batch_size=batch_size, tokens_per_sec=r.tokens_per_sec,
               compile_time_s=r.compile_time_s, wall_time_s=r.wall_time_s, train_loss=r.train_loss,
               val_loss=r.val_loss, fp8_backend=r.fp8_backend, fallbacks=r.fallbacks,
               optimizer_state_bytes=r.optimizer_state_bytes, num_params=r.num_params,
               state_bytes_per_param=r.state_bytes_per_param, state_bytes=r.state_bytes,
               peak_gib=peak_gib(device), recompile_reasons=recompiles.reasons[:3], **graph_breaks())
    if profile:
        out.update(profile_step(trainer, device))
    return out


def profile_step(trainer, device: torch.device) -> dict:
    """One more training step under the profiler (GEMM kernel names) and a device-read counter."""
    from torch.profiler import ProfilerActivity, profile

    from nanochat.common import DeviceReads

    reads = DeviceReads()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    trainer._train_step(trainer.total_steps - 1)  # a steady-state step first (no recompiles below)
    with reads:
        trainer._train_step(trainer.total_steps - 1)
    with profile(activities=activities) as prof:
        trainer._train_step(trainer.total_steps - 1)
        if device.type == "cuda":
            torch.cuda.synchronize()
    kernels: dict[str, int] = {}
    for e in prof.key_averages():
        name = e.key
        if re.search(r"gemm|_mm|matmul|xmma|cutlass|nvjet", name, re.I) and (
                device.type != "cuda" or getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA):
            kernels[name[:160]] = e.count
    scaled_mm = sum(e.count for e in prof.key_averages() if e.key == "aten::_scaled_mm")
    out = {"gemm_kernels": kernels, "scaled_mm_calls": scaled_mm, "device_reads_in_step": reads.count}
    period = trainer.config.fp8_stats_every
    if period:  # what one statistics step costs, in steps: sets the default period (<= 2%)
        normal = [timed_step(trainer, 2 * period - 2, device) for _ in range(3)]
        sampled = [timed_step(trainer, 2 * period - 1, device) for _ in range(2)][-1:]  # 1st: eager warmup
        cost = sampled[0] / statistics.median(normal) - 1
        out.update(step_s=statistics.median(normal), stats_step_s=sampled[0], stats_step_cost_steps=cost,
                   stats_overhead_pct_at_default=100 * cost / period)
    return out


def timed_step(trainer, step: int, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    trainer._train_step(step)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


class RecompileLog(logging.Handler):
    """The first recompile reasons dynamo logs while the block runs (why a graph was not reused)."""

    def __init__(self):
        super().__init__()
        self.reasons: list[str] = []

    def emit(self, record):
        if len(self.reasons) < 3:
            self.reasons.append(record.getMessage()[:600])

    def __enter__(self):
        torch._logging.set_logs(recompiles=True)
        self.logger = logging.getLogger("torch._dynamo")
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
        torch._logging.set_logs()


# --------------------------------------------------------------------------------------- jobs
def job_env(cfg: GPUCheckConfig) -> dict:
    import torchao

    from nanochat.fp8 import detect

    device = device_of(cfg)
    out = dict(python=platform.python_version(), torch=torch.__version__, torchao=torchao.__version__,
               cuda=torch.version.cuda, device=str(device))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, capability=list(torch.cuda.get_device_capability(0)),
                   memory_gib=props.total_memory / 2**30)
    out["fp8"] = {r: dataclasses.asdict(detect(device, emulate=cfg.dry_run, recipe=r))
                  for r in ("tensorwise", "rowwise")}
    return out


def job_bf16(cfg):
    return train(cfg, "bf16", cfg.model, cfg.batch_size)


def job_fp8(cfg):
    return train(cfg, "fp8", cfg.model, cfg.batch_size, profile=True, fp8=True)


def job_opt_levels(cfg):
    return {f"level{lvl}": train(cfg, f"fp8-l{lvl}", cfg.model, cfg.batch_size, fp8=True, fp8_opt_level=lvl)
            for lvl in (1, 2)}


def job_scope(cfg):
    return {"bf16_blocks": train(cfg, "bf16-blocks", cfg.model, cfg.batch_size, compile_scope="blocks"),
            "fp8_blocks": train(cfg, "fp8-blocks", cfg.model, cfg.batch_size, fp8=True, compile_scope="blocks")}


def job_big(cfg):
    return {"bf16": train(cfg, "big-bf16", cfg.big_model, cfg.big_batch_size),
            "fp8": train(cfg, "big-fp8", cfg.big_model, cfg.big_batch_size, fp8=True)}


def job_optim(cfg: GPUCheckConfig) -> dict:
    """Step time and peak memory: AdamW(fused=True) vs FP8Optim levels 0/1/2, same parameters."""
    from nanochat.common import DeviceReads
    from nanochat.fp8 import FP8Optim

    device = device_of(cfg)
    out = {}
    for name in ("adamw_fused", "fp8optim_l0", "fp8optim_l1", "fp8optim_l2", "fp8optim_l2_bf16",
                 "fp8optim_l2_bf16_sr", "fp8optim_l2_bf16_split"):
        reset_memory(device)
        master = name.split("_l2_")[1] if "_l2_" in name else "fp32"
        dtype = torch.float32 if master == "fp32" else torch.bfloat16
        g = torch.Generator(device=device).manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(cfg.opt_dim, cfg.opt_dim, device=device, generator=g).to(dtype))
                  for _ in range(cfg.opt_tensors)]
        for p in params:
            p.grad = (torch.randn(p.shape, device=device, generator=g) * 1e-3).to(dtype)
        opt = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        if name != "adamw_fused":
            opt = FP8Optim(opt, opt_level=int(name[len("fp8optim_l")]), master_weights=master)
        before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        opt.step()  # creates the state and compiles
        times = []
        for _ in range(cfg.opt_steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        reads = DeviceReads()
        with reads:
            opt.step()
        n = cfg.opt_tensors * cfg.opt_dim ** 2
        peak = torch.cuda.max_memory_allocated() - before if device.type == "cuda" else None
        out[name] = dict(step_ms=1e3 * statistics.median(times), device_reads_per_step=reads.count,
                         state_bytes_per_param=(opt.state_bytes() / n if hasattr(opt, "state_bytes") else 8.0),
                         training_state_bytes_per_param=2 * dtype.itemsize + (
                             opt.state_bytes() / n if hasattr(opt, "state_bytes") else 8.0),
                         peak_above_params_grads_bytes_per_param=None if peak is None else peak / n,
                         backend=step_backend(opt),
                         fallbacks=list(getattr(opt, "fallbacks", [])))
        del opt, params
    base = out["adamw_fused"]["step_ms"]
    for v in out.values():
        v["ratio_to_fused"] = v["step_ms"] / base
    return out


def job_master(cfg):
    """Training with FP8 level-2 moments and each way of cutting the rest of the training state:
    bf16_sr masters, bf16_split, bf16_sr with the step inside the backward; tokens/s, measured
    state bytes per parameter and peak memory next to the fp32-master run of the opt_levels job."""
    fp8 = dict(fp8=True, fp8_opt_level=2)
    return {"bf16_sr": train(cfg, "master-bf16_sr", cfg.model, cfg.batch_size, master_weights="bf16_sr", **fp8),
            "bf16_split": train(cfg, "master-bf16_split", cfg.model, cfg.batch_size, master_weights="bf16_split",
                                **fp8),
            "bf16_sr_in_backward": train(cfg, "master-bf16_sr-bwd", cfg.model, cfg.batch_size,
                                         master_weights="bf16_sr", optimizer_in_backward=True, grad_clip=0.0, **fp8)}


def step_backend(opt) -> str | dict:
    """torch's fused step, or FP8Optim.step_backends(): backend -> (calls, tensors) of the last step."""
    if not hasattr(opt, "step_backends"):
        return "torch fused"
    return opt.step_backends() or "torch fused (level 0: the wrapped AdamW steps every tensor)"


def job_tests(cfg: GPUCheckConfig) -> dict:
    if cfg.dry_run:
        return {"skipped": "dry run: the GPU tests need a CUDA device"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           "-p", "no:logging", "-rf", "--tb=line",
                           str(ROOT / "tests" / "test_gpu.py")], cwd=ROOT, capture_output=True, text=True,
                          timeout=cfg.tests_timeout_s)
    tail = (proc.stdout + proc.stderr)[-4000:]
    return {"returncode": proc.returncode, "summary": tail.strip().splitlines()[-1] if tail.strip() else "",
            "tail": tail}


JOBS: dict[str, Callable[[GPUCheckConfig], Any]] = {
    "env": job_env, "bf16": job_bf16, "fp8": job_fp8, "optim": job_optim, "opt_levels": job_opt_levels,
    "scope": job_scope, "big": job_big, "tests": job_tests, "master": job_master}


def ratios(results: dict) -> dict:
    """FP8 / bf16 tokens/s, whole-model vs per-block compile time, where both sides ran."""
    r = results.get("results", {})
    out = {}

    def tps(x):
        return x.get("tokens_per_sec") if isinstance(x, dict) else None

    if tps(r.get("bf16")) and tps(r.get("fp8")):
        out["fp8_over_bf16_tokens_per_sec"] = r["fp8"]["tokens_per_sec"] / r["bf16"]["tokens_per_sec"]
    big = r.get("big") or {}
    if tps(big.get("bf16")) and tps(big.get("fp8")):
        out["big_fp8_over_bf16_tokens_per_sec"] = big["fp8"]["tokens_per_sec"] / big["bf16"]["tokens_per_sec"]
    scope = r.get("scope") or {}
    for kind in ("bf16", "fp8"):
        whole, blocks = r.get(kind), scope.get(f"{kind}_blocks")
        if tps(whole) and tps(blocks):
            out[f"{kind}_compile_s_model_vs_blocks"] = [whole["compile_time_s"], blocks["compile_time_s"]]
            out[f"{kind}_tokens_per_sec_blocks_over_model"] = blocks["tokens_per_sec"] / whole["tokens_per_sec"]
    return out


def main(argv: list[str] | None = None) -> int:
    from nanochat.config import parse_cli

    cfg = parse_cli(GPUCheckConfig, argv)
    if cfg.dry_run:
        cfg = dataclasses.replace(cfg, **DRY_RUN)
    if not cfg.run_root:
        cfg = dataclasses.replace(cfg, run_root=tempfile.mkdtemp(prefix="nanochat-gpu-check-"))
    if not cfg.dry_run and not torch.cuda.is_available():
        print("error: no CUDA device; run with --dry_run to rehearse on the CPU", file=sys.stderr)
        return 2
    out_path = Path(cfg.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    results: dict[str, Any] = {"config": dataclasses.asdict(cfg), "results": {}, "errors": {},
                               "durations_s": {}, "skipped_for_time": []}
    for name in cfg.jobs:
        left = cfg.budget_s - (time.perf_counter() - t_start)
        if ESTIMATES_S[name] > left and not cfg.dry_run:
            results["skipped_for_time"].append(name)
            print(f"[gpu_check] {name}: skipped ({ESTIMATES_S[name]} s estimated, {left:.0f} s left)", flush=True)
            continue
        print(f"[gpu_check] {name}: running ({left:.0f} s left)", flush=True)
        t0 = time.perf_counter()
        try:
            results["results"][name] = JOBS[name](cfg)
        except Exception as e:  # noqa: BLE001 -- one failing job must not cost the others' figures
            results["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
            print(f"[gpu_check] {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        results["durations_s"][name] = time.perf_counter() - t0
        results["ratios"] = ratios(results)
        out_path.write_text(json.dumps(results, indent=1, default=str))
    summary = {k: v for k, v in results["ratios"].items()}
    print("[gpu_check] ratios: " + json.dumps(summary))
    print(f"[gpu_check] errors: {sorted(results['errors'])}; skipped: {results['skipped_for_time']}; "
          f"total {time.perf_counter() - t_start:.0f} s; JSON: {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
