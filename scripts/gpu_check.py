"""GPU check: nanochat's FP8 speed, memory and correctness on one CUDA GPU, in one device call.

How to run it on the lent GPU machine (it has torch 2.11 but no torchao or tyro, and cannot
download anything, so the wheels travel with the call). From the project root:

    here, before the call:  ../shared/tools/gpu-wheels.sh     # torchao, tyro, ... -> .whl (~6 MB)
    the device call:        run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
    what comes back:        $OUT/gpu_check.json (every figure, error and job duration),
                            gpu_check.log (the summary table also ends the reply's output tail),
                            gpu_tests.log (pytest -m gpu), nvidia-smi.txt
    a rerun, only while the machine is warm and >= 4 min of device time are left, e.g.:
        run(command="bash scripts/gpu_check.sh --sections train --train_models d12:32 d20:16
            --target_model d12 --budget_s 200", carry=[".whl"], timeout_s=260)

`scripts/gpu_check.sh` installs the carried wheels into .site (exit 3 if they are missing or do not
install) and runs this script with the JSON in $OUT; the script exits 4 before measuring anything
when torchao or nanochat.fp8 does not import. Here, without a GPU,
`.venv/bin/python scripts/gpu_check.py --dry_run` runs every section at toy sizes on the CPU (FP8
emulated) and writes the same JSON; tests/test_gpu_check.py does that in `make test`, so this
script cannot rot between GPU sessions. .cache/BENCH_GPU.md is the page the figures go to.

What it measures (each figure next to its baseline from the same process, with the ratio):
  (a) micro: the d26 MLP (x [65536, 1664] -> c_fc 1664->6656 -> relu^2 -> c_proj 6656->1664),
      forward + backward, compiled: bf16 autocast vs FP8 for each --fp8_mode x recipe
      (tensorwise, rowwise; auto calibrates eagerly first, as the trainer does). Also which
      `torch._scaled_mm` operand pairings this GPU accepts.
  (b) train: tokens/s and peak memory of whole training steps (forward, backward, fused AdamW)
      on synthetic tokens, compiled, bf16 vs --fp8 for d26 (e4m3), d12 and d20 (every mode).
  (c) optim: step time and peak memory of ~1.07B fp32 parameters (64 x 4096 x 4096) under
      torch AdamW(fused=True), FP8Optim opt_level 0/1/2 and torchao's AdamWFp8.
  (d) tests: `pytest -m gpu tests/test_gpu.py` in a subprocess: pass/fail counts and output tail.
  targets: micro FP8 tensorwise >= 1.45x bf16; d26 training >= 1.25x bf16 tokens/s; level-2
      optimizer step no slower than fused AdamW; level-2 peak memory >= 6 bytes/param under level 0.

Budget. One call may run 10 minutes and a session has 15 minutes of device time, start included,
so everything must fit in ~8 minutes. Jobs run in priority order, not section order: the target
figures first (micro bf16 vs e4m3 tensorwise, d26 bf16 vs e4m3, the optimizers, the GPU tests),
then the rest (rowwise and auto micro configs, d12, d20, d26 auto). A job whose estimate (the
ESTIMATES_S guesses below, made before any GPU session; replace them with the `duration_s` the
JSON records) no longer fits in --budget_s is skipped and listed under `skipped_for_time`.
The JSON is rewritten after every job, so a call killed at its limit still returns what finished.
Configurations the GPU cannot run (e5m2 x e5m2 GEMMs, rowwise on an unsupported GPU) are
recorded as `unsupported` with the reason nanochat.fp8.hardware gives, at no cost (natively
nanochat runs --fp8_mode e5m2 as the e4m3/e5m2 hybrid, which `auto` starts from).

Why a tight loop of our own rather than NanoChatTrainer: the trainer needs a tokenizer and a
corpus, evaluates, checkpoints and syncs for logging every step; throughput here is the model,
the FP8 conversion, torch.compile and the optimizer, which this loop runs exactly as the trainer
does (fp32 master weights, bf16 autocast, `convert` before `torch.compile`). The optimizer in (b)
is fused AdamW for every run, so the bf16/FP8 ratio is the matmuls' alone; (c) covers FP8Optim.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import torch

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = 1

Section = Literal["micro", "train", "optim", "tests"]
Mode = Literal["e4m3", "e5m2", "auto"]
Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]


@dataclass(frozen=True, kw_only=True)
class CheckConfig:
    """Flags of scripts/gpu_check.py. Defaults are the device run; --dry_run swaps in toy sizes."""

    out: str = ".cache/gpu_check/gpu_check.json"
    """The JSON file (the wrapper passes $OUT/gpu_check.json); rewritten after every job."""

    dry_run: bool = False
    """Rehearse on the CPU: every section at toy sizes (DRY_RUN below), FP8 emulated, the figures
    meaningless; the JSON has the device run's schema."""

    budget_s: float = 450.0
    """Seconds for all jobs; a job whose estimate does not fit what is left is skipped (listed in
    the JSON). 450 s + ~30 s of wheel install and imports leave ~1 minute of a 540 s call."""

    sections: tuple[Section, ...] = ("micro", "train", "optim", "tests")
    """Which sections run."""

    modes: tuple[Mode, ...] = ("e4m3", "e5m2", "auto")
    """--fp8_mode values measured in micro and train (the first one is the target's)."""

    micro_model: str = "d26"
    """Size preset whose MLP the microbenchmark runs (d26: 1664 -> 6656 -> 1664)."""

    micro_tokens: int = 65536
    """Rows of the microbenchmark input (tokens of one batch: 32 x 2048)."""

    micro_recipes: tuple[Recipe, ...] = ("tensorwise", "rowwise")
    """FP8 scaling recipes measured in the microbenchmark (the first one is the target's)."""

    micro_iters: int = 20
    """Timed forward+backward iterations per microbenchmark config (the median is reported)."""

    train_models: tuple[str, ...] = ("d26:16:e4m3", "d12:32", "d20:16")
    """`preset:batch[:mode+mode]` per model of the training benchmark; without modes, every --modes
    value runs. d26 compiles for ~1.5 min a config, so by default it runs bf16 vs e4m3 only (the
    target); d12 and d20 run every mode, as time allows. Batches are meant to fit an H200 with fp32
    master weights, fp32 AdamW state and seq_len 2048; an OOM halves the batch once and says so."""

    target_model: str = "d26"
    """The model whose FP8/bf16 tokens/s ratio is the training target."""

    train_recipe: Recipe = "tensorwise"
    """Scaling recipe of the FP8 training runs."""

    seq_len: int = 2048
    """Tokens per sequence in the training benchmark."""

    vocab_size: int = 65536
    """Vocabulary of the training benchmark's models (nanochat's tokenizer size)."""

    train_warmup: int = 3
    """Untimed steps per training config (the first compiles)."""

    train_steps: int = 10
    """Timed steps per training config."""

    opt_tensors: int = 64
    """Parameter tensors of the optimizer benchmark."""

    opt_dim: int = 4096
    """Each optimizer-benchmark parameter is opt_dim x opt_dim fp32 (64 x 4096^2 = 1.07B)."""

    opt_warmup: int = 3
    """Untimed optimizer steps (the first creates state and compiles)."""

    opt_steps: int = 10
    """Timed optimizer steps."""

    tests_timeout_s: float = 150.0
    """Kill the GPU test subprocess after this many seconds (recorded as an error)."""

    compile: bool = True
    """torch.compile the micro and train models (the fair comparison: FP8 casts need fusion). The
    dry run does not: a CPU compile would not test inductor's CUDA code anyway, and costs ~3 s a
    config there. FP8Optim and AdamWFp8 compile their steps themselves, also in the dry run."""

    compile_backend: str = "inductor"
    """torch.compile backend of the micro and train models."""

    def __post_init__(self) -> None:
        specs = [parse_model_spec(s) for s in self.train_models]
        if "train" in self.sections and self.target_model not in {name for name, _, _ in specs}:
            raise ValueError(f"--target_model {self.target_model} is not among --train_models "
                             f"{' '.join(self.train_models)}; add it (e.g. {self.target_model}:16)")
        for name in ("micro_tokens", "micro_iters", "seq_len", "vocab_size", "train_steps", "opt_tensors",
                     "opt_dim", "opt_steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name} must be positive, got {getattr(self, name)}")
        if self.opt_dim * self.opt_dim % 256:
            raise ValueError(f"--opt_dim {self.opt_dim}: opt_dim^2 must be a multiple of 256 (the FP8 "
                             "block size of FP8Optim and AdamWFp8), e.g. 4096")


# The dry run: the same jobs at sizes two loaded CPU cores finish in well under a minute.
DRY_RUN = dict(micro_model="d2", micro_tokens=256, micro_iters=2, train_models=("d2:2",), target_model="d2",
               seq_len=32, vocab_size=256, train_warmup=1, train_steps=2, opt_tensors=2, opt_dim=256,
               opt_warmup=1, opt_steps=2, tests_timeout_s=120.0, compile=False)

# Seconds each job is expected to take on an H200, compile included. Guesses made before the first
# GPU session (an MLP compiles in ~15-20 s; a GPT in ~15 s plus ~1.8 s per transformer block, FP8
# graphs 1.3x that): replace them with the `duration_s` values of the first gpu_check.json.
ESTIMATES_S = {"probe": 5, "micro_bf16": 15, "micro_fp8": 20, "tests": 75, "optim_fused": 8,
               "optim_compiled": 15, "train_base": 15, "train_per_layer": 1.8, "train_fp8_factor": 1.3,
               "train_flops": 300e12}  # training FLOP/s assumed for the timed steps' estimate

TARGETS = {
    "micro_speedup": 1.45,   # issue #6: FP8 tensorwise MLP fwd+bwd vs bf16, both compiled
    "train_speedup": 1.25,   # issue #6: d26 tokens/s with --fp8 vs bf16
    "optim_step_ratio": 1.0,  # issue #6: level-2 step time / fused fp32 AdamW step time, at most
    "optim_mem_saving": 6.0,  # issue #6: bytes/param of peak memory level 0 minus level 2, at least
}
# AdamW hyperparameters of the optimizer benchmark (TrainConfig's defaults; any values would do).
OPT_HPARAMS = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def parse_model_spec(spec: str) -> tuple[str, int, tuple[str, ...] | None]:
    """'d26:16:e4m3+auto' -> ('d26', 16, ('e4m3', 'auto')); 'd12:32' -> ('d12', 32, None): all modes."""
    from nanochat.gpt import PRESETS

    parts = spec.split(":")
    usage = f"--train_models entries are preset:batch[:mode+mode], e.g. d26:16 or d26:16:e4m3; got {spec!r}"
    if len(parts) not in (2, 3) or not parts[1].isdigit() or int(parts[1]) <= 0:
        raise ValueError(usage)
    if parts[0] not in PRESETS:
        raise ValueError(f"{usage}: {parts[0]!r} is not a preset ({', '.join(PRESETS)})")
    modes = tuple(parts[2].split("+")) if len(parts) == 3 else None
    if modes is not None and not set(modes) <= {"e4m3", "e5m2", "auto"}:
        raise ValueError(f"{usage}: modes are e4m3, e5m2, auto joined by '+'")
    return parts[0], int(parts[1]), modes


def train_flops_per_token(name: str, cfg: CheckConfig) -> float:
    """GPT.flops_per_token of a preset, without building it: 6 per weight of the blocks and lm_head,
    plus attention's 12 * n_layer * n_embd * seq_len (gpt.py)."""
    from nanochat.gpt import PRESETS

    n_layer, n_embd = PRESETS[name]["n_layer"], PRESETS[name]["n_embd"]
    weights = 12 * n_layer * n_embd**2 + cfg.vocab_size * n_embd
    return 6 * weights + 12 * n_layer * n_embd * cfg.seq_len


class Unsupported(Exception):
    """This GPU (or torch's kernels) cannot run the configuration; the message says why."""


# ----------------------------------------------------------------------------------- measuring
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_iters(fn: Callable[[], Any], iters: int, device: torch.device) -> list[float]:
    """Milliseconds of each call of fn: CUDA events on a GPU (the GPU timeline, including any wait
    for the host), perf_counter on the CPU."""
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) for start, end in events]
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def timed_once(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds of one call, synchronized (the first call: compilation)."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def reset_peak(device: torch.device) -> int | None:
    """Start a peak-memory window; returns the bytes allocated now (None off CUDA)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def allocated_bytes(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def release(device: torch.device) -> None:
    """Between jobs: forget compiled graphs (each config would otherwise count against dynamo's
    recompile limit of the shared forward code) and hand cached memory back."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def summarize_ms(times: list[float]) -> dict:
    return dict(ms_median=statistics.median(times), ms_min=min(times), ms_max=max(times), ms_all=times)


def autocast_for(device: torch.device):
    """nanochat's policy: bf16 autocast on CUDA over fp32 master weights, plain fp32 elsewhere."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def baseline_name(device: torch.device) -> str:
    return "bf16" if device.type == "cuda" else "fp32"


def maybe_compile(module: torch.nn.Module, cfg: CheckConfig) -> torch.nn.Module:
    if not cfg.compile:
        return module
    # dynamic=False: a retry at another batch size compiles a static graph again, no symbolic shapes
    return torch.compile(module, backend=cfg.compile_backend, dynamic=False)


# -------------------------------------------------------------------------------------- FP8 help
def fp8_config(mode: str, recipe: str, cfg: CheckConfig):
    from nanochat.fp8 import FP8Config

    return FP8Config(mode=mode, recipe=recipe, emulate=cfg.dry_run)


def fp8_problem(device: torch.device, mode: str, recipe: str, cfg: CheckConfig) -> str | None:
    """Why this GPU cannot run mode x recipe natively (hardware.py's rules), or None."""
    from nanochat.fp8 import detect, native_gemm_problem
    from nanochat.fp8.linear import FP8_DTYPES

    hw = detect(device, emulate=cfg.dry_run, recipe=recipe)
    if hw.backend == "fallback":
        return hw.reason
    if hw.backend == "native":
        dtypes = fp8_config(mode, recipe, cfg).role_dtypes()
        problem = native_gemm_problem({role: FP8_DTYPES[d] for role, d in dtypes.items()}, recipe=recipe)
        if problem:
            # convert() would run the nearest legal formats (the hybrid, which `auto` measures) and
            # record a fallback; timing that under this name would report the hybrid as e5m2
            return f"{problem}; nanochat runs --fp8_mode {mode} as e4m3 input/weight + e5m2 gradients here"
    return None


def convert_checked(model: torch.nn.Module, mode: str, recipe: str, cfg: CheckConfig) -> dict:
    """convert() and insist that FP8 really runs (a fallback would time the baseline twice)."""
    from nanochat.fp8 import convert

    report = convert(model, fp8_config(mode, recipe, cfg))
    expected = "emulated" if cfg.dry_run else "native"
    if report.backend != expected or not report.converted or report.fallback:
        raise RuntimeError(f"FP8 conversion gave backend {report.backend} with {len(report.converted)} "
                           f"layers converted (expected {expected}): {report.fallback or report.reason}")
    return dict(backend=report.backend, converted=len(report.converted), skipped=len(report.skipped),
                fp8_flops_share=report.fp8_flops_share, summary=report.summary())


# ------------------------------------------------------------------------------- (a) micro
def micro_probe(device: torch.device) -> dict:
    """Which FP8 operand pairings `torch._scaled_mm` runs here, tensorwise and rowwise scaled.
    Checks nanochat.fp8.hardware's rules (no e5m2 x e5m2; rowwise wants an e4m3 second operand)
    against the real kernels. Each result is compared with the dequantized fp32 product."""
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    m = k = n = 64  # smallest that every kernel takes (dims multiple of 16); CPU reference is fast here
    gen = torch.Generator().manual_seed(0)
    rows = []
    for a_dtype in (e4, e5):
        for b_dtype in (e4, e5):
            for scaling in ("tensorwise", "rowwise"):
                a = torch.randn(m, k, generator=gen).to(device=device, dtype=a_dtype)
                b = torch.randn(n, k, generator=gen).to(device=device, dtype=b_dtype).t()  # column-major
                if scaling == "tensorwise":
                    sa = sb = torch.ones((), device=device)
                else:
                    sa, sb = torch.ones(m, 1, device=device), torch.ones(1, n, device=device)
                row = dict(a=str(a_dtype).removeprefix("torch."), b=str(b_dtype).removeprefix("torch."),
                           scaling=scaling)
                try:
                    out = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
                    ref = a.float() @ b.float()
                    row.update(ok=True, rel_err=((out.float() - ref).norm() / ref.norm()).item())
                except Exception as e:  # noqa: BLE001 - recording which pairings torch refuses
                    row.update(ok=False, error=f"{type(e).__name__}: {first_line(e)}")
                rows.append(row)
    return dict(status="ok", pairings=rows)


def micro_job(cfg: CheckConfig, device: torch.device, mode: str | None, recipe: str | None) -> dict:
    """Forward+backward of one nanochat MLP on [micro_tokens, n_embd] (mode None: the baseline)."""
    from nanochat.gpt import MLP, preset_config

    gpt_cfg = preset_config(cfg.micro_model, vocab_size=256, seq_len=16)
    m, k, n = cfg.micro_tokens, gpt_cfg.n_embd, gpt_cfg.intermediate_size
    result: dict[str, Any] = dict(shape=dict(tokens=m, n_embd=k, hidden=n))
    torch.manual_seed(0)
    with torch.device(device):
        mlp = MLP(gpt_cfg)  # fp32 master weights, default nn.Linear init (c_proj is not zero here)
    if mode is not None:
        result["fp8"] = convert_checked(mlp, mode, recipe, cfg)
    act_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(m, k, device=device, dtype=act_dtype, requires_grad=True)
    grad_out = torch.randn(m, k, device=device, dtype=act_dtype)
    params = list(mlp.parameters())
    autocast = autocast_for(device)
    model = mlp

    def step():
        for p in params:
            p.grad = None
        x.grad = None
        with autocast:
            y = model(x)
        y.backward(grad_out)

    if mode == "auto":
        result["fp8"]["auto"] = calibrate_auto(mlp, step, cfg, recipe)
    model = maybe_compile(mlp, cfg)
    result["first_step_s"] = timed_once(step, device)
    for _ in range(2):
        step()
    base = reset_peak(device)
    times = time_iters(step, cfg.micro_iters, device)
    result.update(summarize_ms(times))
    flops = 3 * 2 * (2 * m * k * n)  # 2 Linears x 3 GEMMs (output, grad_input, grad_weight) x 2mkn
    result["tflops"] = flops / (result["ms_median"] * 1e-3) / 1e12
    peak = peak_bytes(device)
    result["peak_mem_bytes"] = peak
    result["peak_extra_bytes"] = None if peak is None else peak - base
    return result


def calibrate_auto(model: torch.nn.Module, step: Callable[[], Any], cfg: CheckConfig, recipe: str) -> dict:
    """--fp8_mode auto as the trainer runs it: both formats measured on the real tensors for
    auto_steps eager steps (hooks), the formats fixed, and only then torch.compile. Returns how
    many layers chose which format per role, and the seconds calibration took."""
    from nanochat.fp8 import start_auto_calibration

    t0 = time.perf_counter()
    calib = start_auto_calibration(model, steps=fp8_config("auto", recipe, cfg).auto_steps)
    done = False
    while not done:
        step()
        done = calib.step()
    counts: dict[str, dict[str, int]] = {}
    for roles in calib.choices.values():
        for role, fmt in roles.items():
            counts.setdefault(role, {}).setdefault(fmt, 0)
            counts[role][fmt] += 1
    return dict(calibration_s=time.perf_counter() - t0, chosen=counts)


# ------------------------------------------------------------------------------- (b) train
def train_job(cfg: CheckConfig, device: torch.device, model_name: str, batch: int, mode: str | None) -> dict:
    """Steps of forward, backward, fused AdamW on synthetic tokens; on OOM, once at half the batch."""
    try:
        return train_run(cfg, device, model_name, batch, mode)
    except Exception as e:  # noqa: BLE001 - an OOM can also surface wrapped by the compiler
        if batch < 2 or not (isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e)):
            raise
        message = first_line(e)
    release(device)
    result = train_run(cfg, device, model_name, batch // 2, mode)
    result["note"] = f"out of memory at batch {batch} ({message[:200]}); measured at batch {batch // 2}"
    return result


def train_run(cfg: CheckConfig, device: torch.device, model_name: str, batch: int, mode: str | None) -> dict:
    from nanochat.gpt import GPT, preset_config

    gpt_cfg = preset_config(model_name, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len)
    torch.manual_seed(0)
    reset_peak(device)  # the peak of this job covers weights, grads, optimizer state, activations
    with torch.device(device):
        model = GPT(gpt_cfg)
    model.init_weights()
    result: dict[str, Any] = dict(batch=batch, seq_len=cfg.seq_len, n_params=model.num_params(),
                                  flops_per_token=model.flops_per_token())
    if mode is not None:
        result["fp8"] = convert_checked(model, mode, cfg.train_recipe, cfg)
    fused = dict(fused=True)  # the trainer's bf16 optimizer; the same for FP8 runs (see docstring)
    opt = torch.optim.AdamW(model.param_groups(OPT_HPARAMS["weight_decay"]), lr=1e-4,
                            betas=OPT_HPARAMS["betas"], eps=OPT_HPARAMS["eps"], **fused)
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):  # two batches alternate, so no step sees exactly the previous input
        tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen).to(device)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    autocast = autocast_for(device)
    losses: list[torch.Tensor] = []
    compiled = model

    def step():
        x, y = batches[len(losses) % 2]
        with autocast:
            loss = compiled(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    if mode == "auto":
        result["fp8"]["auto"] = calibrate_auto(model, step, cfg, cfg.train_recipe)
    compiled = maybe_compile(model, cfg)
    result["first_step_s"] = timed_once(step, device)
    for _ in range(max(0, cfg.train_warmup - 1)):
        step()
    times = time_iters(step, cfg.train_steps, device)
    result.update(summarize_ms(times))
    tokens_per_step = batch * cfg.seq_len
    result["tokens_per_s"] = tokens_per_step * len(times) / (sum(times) * 1e-3)
    result["tflops"] = result["tokens_per_s"] * result["flops_per_token"] / 1e12
    values = [v.item() for v in losses]
    result.update(loss_first=values[0], loss_last=values[-1])
    if not all(math.isfinite(v) for v in values):
        raise RuntimeError(f"non-finite training loss: {values}")
    result["peak_mem_bytes"] = peak_bytes(device)
    return result


# ------------------------------------------------------------------------------- (c) optim
OPTIMIZERS = ("adamw_fused", "fp8optim_l2", "fp8optim_l0", "fp8optim_l1", "torchao_adamw_fp8")


def make_optimizer(name: str, params: list[torch.nn.Parameter]):
    if name == "adamw_fused":
        return torch.optim.AdamW(params, fused=True, **OPT_HPARAMS)
    if name.startswith("fp8optim_l"):
        from nanochat.fp8.optim import FP8Optim

        # the inner AdamW as the trainer builds it under --fp8: torch's default (foreach on CUDA)
        return FP8Optim(torch.optim.AdamW(params, **OPT_HPARAMS), opt_level=int(name[-1]))
    if name == "torchao_adamw_fp8":
        from torchao.optim import AdamWFp8

        return AdamWFp8(params, **OPT_HPARAMS)
    raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZERS)}")


def fp8optim_backend(opt, device: torch.device) -> str:
    """Which of FP8Optim's step implementations ran (optim.py: native C kernel for fp32 on CPU,
    torch.compile, or eager after a logged fallback; level 0 is torch's own step). Read from its
    private flags: a diagnostic."""
    if getattr(opt, "opt_level", None) == 0:
        return "wrapped"  # level 0 is the wrapped torch optimizer's own step
    if getattr(opt, "_native", False) and device.type == "cpu":
        return "native"
    return "compile" if getattr(opt, "_compile", False) else "eager"


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor really holds; tensor subclasses (FP8Tensor, torchao's OptimStateFp8) are
    counted through their inner tensors."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(stored_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def optim_job(cfg: CheckConfig, device: torch.device, name: str) -> dict:
    n_params = cfg.opt_tensors * cfg.opt_dim * cfg.opt_dim
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for _ in range(cfg.opt_tensors):
        p = torch.nn.Parameter(torch.randn(cfg.opt_dim, cfg.opt_dim, device=device, generator=gen) * 0.02)
        p.grad = torch.randn(cfg.opt_dim, cfg.opt_dim, device=device, generator=gen) * 1e-3
        params.append(p)
    base = reset_peak(device)  # params + grads: what the optimizer adds is measured above this
    opt = make_optimizer(name, params)
    result: dict[str, Any] = dict(n_params=n_params, first_step_s=timed_once(opt.step, device))
    for _ in range(max(0, cfg.opt_warmup - 1)):
        opt.step()
    result.update(summarize_ms(time_iters(opt.step, cfg.opt_steps, device)))
    state = sum(stored_bytes(v) for s in opt.state.values() for k, v in s.items()
                if torch.is_tensor(v) and k != "step")
    result["state_bytes_per_param"] = state / n_params
    if hasattr(opt, "state_bytes"):  # FP8Optim's own count, which must agree with ours
        result["state_bytes_reported_per_param"] = opt.state_bytes() / n_params
    if hasattr(opt, "opt_level"):
        result["step_backend"] = fp8optim_backend(opt, device)
    peak, now = peak_bytes(device), allocated_bytes(device)
    result["peak_extra_bytes_per_param"] = None if peak is None else (peak - base) / n_params
    result["resident_extra_bytes_per_param"] = None if now is None else (now - base) / n_params
    result["peak_mem_bytes"] = peak
    return result


# ------------------------------------------------------------------------------- (d) tests
def tests_job(cfg: CheckConfig, device: torch.device, out_dir: Path) -> dict:
    """`pytest -m gpu tests/test_gpu.py` in a subprocess (its own CUDA context and compile caches).
    Off CUDA every test would skip itself, so the dry run does not start pytest (~12 s on a loaded
    CPU); `make test` imports and collects tests/test_gpu.py anyway."""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "tests/test_gpu.py", "-p", "no:cacheprovider"]
    result: dict[str, Any] = dict(command=" ".join(["python"] + cmd[1:]), returncode=None,
                                  **parse_pytest_counts(""), failed_tests=[], tail="")
    if device.type != "cuda":
        result.update(status="skipped", reason="no CUDA device: the GPU tests run only on the device "
                                               "(they skip themselves here)")
        return result
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=cfg.tests_timeout_s)
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        output = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        output += f"\n[gpu_check] killed after {cfg.tests_timeout_s:.0f} s (--tests_timeout_s)"
        rc = None
    (out_dir / "gpu_tests.log").write_text(output)
    counts = parse_pytest_counts(output)
    failed = re.findall(r"^(?:FAILED|ERROR) (.+)$", output, flags=re.MULTILINE)  # pytest's short summary
    result.update(returncode=rc, **counts, failed_tests=[f[:200] for f in failed], tail=output[-3000:])
    if rc is None:
        result.update(status="error", error=f"timed out after {cfg.tests_timeout_s:.0f} s")
    elif rc == 0 and counts["passed"] > 0:
        result["status"] = "ok"
    else:
        result.update(status="failed", error=f"pytest exit {rc}: {counts['failed']} failed, "
                                             f"{counts['errors']} errors, {counts['passed']} passed")
    return result


def parse_pytest_counts(output: str) -> dict[str, int]:
    """Counts by outcome from pytest's summary line ('3 passed, 1 failed, 2 skipped in 4.5s';
    with --collect-only '5 tests collected' or '5/9 tests collected (4 deselected)')."""
    counts = dict(passed=0, failed=0, skipped=0, errors=0, deselected=0, collected=0)
    words = r"passed|failed|skipped|errors?|deselected|tests? collected|no tests ran"
    lines = [line for line in output.splitlines() if re.search(rf"\b({words})\b", line)]
    if not lines:
        return counts
    summary = lines[-1]
    outcome = r"(\d+)(?:/\d+)? (passed|failed|skipped|errors?|deselected|tests? collected)"
    for number, word in re.findall(outcome, summary):
        key = "errors" if word.startswith("error") else "collected" if "collected" in word else word
        counts[key] += int(number)
    return counts


# --------------------------------------------------------------------------------- running
@dataclass
class Job:
    section: Section
    key: str
    """Where the result goes: micro/train/optim entries are keyed by config, e.g. 'fp8 e4m3 tensorwise'."""
    estimate_s: float
    fn: Callable[[], dict]
    fields: dict
    """Identifying fields copied into the result (mode, recipe, model, ...)."""
    precheck: Callable[[], str | None] | None = None
    """Returns why the config cannot run here (recorded as unsupported, no time spent), or None."""


def plan(cfg: CheckConfig, device: torch.device, out_dir: Path) -> list[Job]:
    """Every job, in the order they run: target figures first, the rest as time allows."""
    from nanochat.gpt import PRESETS

    est = (lambda s: 0.0) if cfg.dry_run else (lambda s: s)
    base = baseline_name(device)
    first_mode = cfg.modes[0] if cfg.modes else None
    first_recipe = cfg.micro_recipes[0] if cfg.micro_recipes else None
    jobs_first: list[Job] = []
    jobs_later: list[Job] = []

    if "micro" in cfg.sections:
        jobs_first.append(Job("micro", "scaled_mm_probe", est(ESTIMATES_S["probe"]),
                              lambda: micro_probe(device), {}))
        jobs_first.append(Job("micro", base, est(ESTIMATES_S["micro_bf16"]),
                              lambda: micro_job(cfg, device, None, None), dict(kind="baseline", precision=base)))
        for mode in cfg.modes:
            for recipe in cfg.micro_recipes:
                job = Job("micro", f"fp8 {mode} {recipe}", est(ESTIMATES_S["micro_fp8"]),
                          lambda mode=mode, recipe=recipe: micro_job(cfg, device, mode, recipe),
                          dict(kind="fp8", mode=mode, recipe=recipe),
                          precheck=lambda mode=mode, recipe=recipe: fp8_problem(device, mode, recipe, cfg))
                (jobs_first if (mode, recipe) == (first_mode, first_recipe) else jobs_later).append(job)

    train_first: list[Job] = []
    if "train" in cfg.sections:
        for spec in cfg.train_models:
            name, batch, spec_modes = parse_model_spec(spec)
            modes = [m for m in cfg.modes if spec_modes is None or m in spec_modes]
            n_layer = PRESETS[name]["n_layer"]
            run_s = ((cfg.train_warmup + cfg.train_steps) * batch * cfg.seq_len
                     * train_flops_per_token(name, cfg) / ESTIMATES_S["train_flops"])
            compile_s = ESTIMATES_S["train_base"] + ESTIMATES_S["train_per_layer"] * n_layer if cfg.compile else 0
            fp8_s = compile_s * ESTIMATES_S["train_fp8_factor"] + run_s
            for mode in (None, *modes):
                # a baseline is worth running only with an FP8 run beside it: it waits for room for both
                estimate = compile_s + run_s + (fp8_s if modes else 0) if mode is None else fp8_s
                job = Job("train", f"{name} {base if mode is None else 'fp8 ' + mode}", est(estimate),
                          lambda name=name, batch=batch, mode=mode: train_job(cfg, device, name, batch, mode),
                          dict(model=name, kind="baseline" if mode is None else "fp8", mode=mode,
                               recipe=None if mode is None else cfg.train_recipe, precision=base),
                          precheck=None if mode is None else
                          (lambda mode=mode: fp8_problem(device, mode, cfg.train_recipe, cfg)))
                is_target = name == cfg.target_model and mode in (None, first_mode)
                (train_first if is_target else jobs_later).append(job)

    optim_jobs: list[Job] = []
    if "optim" in cfg.sections:
        for name in OPTIMIZERS:
            estimate = ESTIMATES_S["optim_fused" if name in ("adamw_fused", "fp8optim_l0") else "optim_compiled"]
            optim_jobs.append(Job("optim", name, est(estimate), lambda name=name: optim_job(cfg, device, name),
                                  dict(optimizer=name)))

    tests = []
    if "tests" in cfg.sections:
        tests.append(Job("tests", "gpu_tests", est(min(ESTIMATES_S["tests"], cfg.tests_timeout_s)),
                         lambda: tests_job(cfg, device, out_dir), {}))
    return jobs_first + train_first + optim_jobs + tests + jobs_later


class Check:
    """Runs the jobs, keeps the report, writes the JSON after every job."""

    def __init__(self, cfg: CheckConfig, device: torch.device, out: Path):
        self.cfg, self.device, self.out = cfg, device, out
        self.t0 = time.perf_counter()
        self.report: dict[str, Any] = dict(
            schema=SCHEMA, dry_run=cfg.dry_run, env=environment(device), config=dataclasses.asdict(cfg),
            budget=dict(budget_s=cfg.budget_s, elapsed_s=0.0, skipped_for_time=[]),
            micro=dict(results={}), train=dict(results={}), optim=dict(results={}), tests={},
            targets={}, jobs=[], errors=[],
        )
        if cfg.dry_run:
            self.report["note"] = ("dry run on the CPU at toy sizes with FP8 emulated: the figures test "
                                   "the script, they say nothing about FP8 speed; targets are not judged")

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def run(self, job: Job) -> dict:
        entry: dict[str, Any] = dict(job.fields)
        t0 = time.perf_counter()
        try:
            reason = job.precheck() if job.precheck else None
            if reason:
                raise Unsupported(reason)
            left = self.cfg.budget_s - self.elapsed()
            if left <= 0 or job.estimate_s > left:
                entry.update(status="skipped",
                             reason=f"time budget: needs ~{job.estimate_s:.0f} s, {max(left, 0):.0f} s "
                                    f"of --budget_s {self.cfg.budget_s:.0f} left")
                self.report["budget"]["skipped_for_time"].append(f"{job.section}: {job.key}")
            else:
                entry.update(job.fn())
                entry.setdefault("status", "ok")
        except Unsupported as e:
            entry.update(status="unsupported", reason=str(e))
        except Exception as e:  # noqa: BLE001 - one failure must not lose the other sections
            entry.update(status="error", error=f"{type(e).__name__}: {first_line(e)}",
                         traceback=traceback.format_exc()[-2000:])
            self.report["errors"].append(f"{job.section} {job.key}: {type(e).__name__}: {first_line(e)}")
        finally:
            try:
                release(self.device)
            except Exception as e:  # noqa: BLE001
                self.report["errors"].append(f"release after {job.key}: {first_line(e)}")
        entry["duration_s"] = time.perf_counter() - t0
        if job.section == "tests":
            self.report["tests"] = entry
        else:
            self.report[job.section]["results"][job.key] = entry
        self.report["jobs"].append(dict(section=job.section, key=job.key, status=entry["status"],
                                        estimate_s=job.estimate_s, duration_s=entry["duration_s"]))
        print(f"[{self.elapsed():6.1f} s] {job.section:5s} {job.key:28s} {entry['status']:11s} "
              f"{one_line_figure(job.section, entry)}", flush=True)
        self.write()
        return entry

    def write(self) -> None:
        self.report["budget"]["elapsed_s"] = self.elapsed()
        derive(self.report)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.report, indent=1, default=str))
        os.replace(tmp, self.out)


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:500] if text else type(e).__name__


def one_line_figure(section: str, e: dict) -> str:
    if section == "tests" and "passed" in e:
        return f"{e['passed']} passed, {e['failed']} failed, {e['skipped']} skipped"
    if e.get("status") != "ok":
        return (e.get("reason") or e.get("error") or "")[:110]
    if section == "micro" and "ms_median" in e:
        return f"{e['ms_median']:.3f} ms  {e['tflops']:.1f} TFLOP/s"
    if section == "micro":
        return f"{sum(r['ok'] for r in e['pairings'])}/{len(e['pairings'])} pairings run"
    if section == "train":
        return f"{e['tokens_per_s']:,.0f} tok/s  batch {e['batch']}  1st step {e['first_step_s']:.1f} s"
    if section == "optim":
        backend = f"  step: {e['step_backend']}" if "step_backend" in e else ""
        return f"{e['ms_median']:.2f} ms/step  {e['state_bytes_per_param']:.3f} B/param state{backend}"
    return ""


# ------------------------------------------------------------------------------ derived figures
def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def derive(report: dict) -> None:
    """Ratios against each baseline and the four targets, from whatever has finished so far."""
    micro = report["micro"]["results"]
    base = next((e for e in micro.values() if e.get("kind") == "baseline" and e.get("status") == "ok"), None)
    for e in micro.values():
        if e.get("kind") == "fp8":
            e["speedup_vs_baseline"] = ratio(base["ms_median"], e.get("ms_median")) if base else None
    train = report["train"]["results"]
    for e in train.values():
        if e.get("kind") == "fp8":
            b = next((x for x in train.values() if x.get("model") == e["model"] and x.get("kind") == "baseline"
                      and x.get("status") == "ok"), None)
            e["speedup_vs_baseline"] = ratio(e.get("tokens_per_s"), b["tokens_per_s"]) if b else None
            e["peak_mem_ratio_vs_baseline"] = ratio(e.get("peak_mem_bytes"), b.get("peak_mem_bytes")) if b else None
    optim = report["optim"]["results"]
    fused = optim.get("adamw_fused") if optim.get("adamw_fused", {}).get("status") == "ok" else None
    for name, e in optim.items():
        if name != "adamw_fused":
            e["step_ratio_vs_fused"] = ratio(e.get("ms_median"), fused["ms_median"]) if fused else None

    cfg, dry = report["config"], report["dry_run"]
    mode, recipe = (cfg["modes"] or [None])[0], (cfg["micro_recipes"] or [None])[0]

    def target(value, need, higher_is_better, what, source):
        met = None if value is None or dry else (value >= need if higher_is_better else value <= need)
        return dict(value=value, target=need, op=">=" if higher_is_better else "<=", met=met, what=what,
                    source=source)

    mic = micro.get(f"fp8 {mode} {recipe}", {})
    tr = train.get(f"{cfg['target_model']} fp8 {mode}", {})
    l0, l2 = optim.get("fp8optim_l0", {}), optim.get("fp8optim_l2", {})
    saving = (l0["peak_extra_bytes_per_param"] - l2["peak_extra_bytes_per_param"]
              if l0.get("peak_extra_bytes_per_param") is not None
              and l2.get("peak_extra_bytes_per_param") is not None else None)
    report["targets"] = {
        "micro_speedup": target(mic.get("speedup_vs_baseline"), TARGETS["micro_speedup"], True,
                                f"MLP fwd+bwd, FP8 {mode} {recipe} vs {baseline_name_from(report)}, "
                                f"{'compiled' if cfg['compile'] else 'eager'}",
                                f"micro: fp8 {mode} {recipe}"),
        "train_speedup": target(tr.get("speedup_vs_baseline"), TARGETS["train_speedup"], True,
                                f"{cfg['target_model']} training tokens/s, FP8 {mode} vs "
                                f"{baseline_name_from(report)}",
                                f"train: {cfg['target_model']} fp8 {mode}"),
        "optim_step_ratio": target(l2.get("step_ratio_vs_fused"), TARGETS["optim_step_ratio"], False,
                                   "FP8Optim level-2 step time / fused fp32 AdamW step time",
                                   "optim: fp8optim_l2 vs adamw_fused"),
        "optim_mem_saving": target(saving, TARGETS["optim_mem_saving"], True,
                                   "peak optimizer memory, level 0 minus level 2, bytes/param (None off CUDA)",
                                   "optim: fp8optim_l0 - fp8optim_l2"),
    }


def baseline_name_from(report: dict) -> str:
    return "bf16" if report["env"].get("gpu_name") else "fp32"


# ------------------------------------------------------------------------------- environment
def environment(device: torch.device) -> dict:
    import torchao

    env: dict[str, Any] = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        host_python=platform.python_version(), torch=torch.__version__, torch_cuda=torch.version.cuda,
        torchao=getattr(torchao, "__version__", None), device=str(device), cpu_count=os.cpu_count(),
        gpu_name=None, capability=None, sm_count=None, gpu_memory_bytes=None, driver=None,
        git_commit=run_quiet(["git", "rev-parse", "HEAD"]), source_digest=source_digest(),
    )
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu_name=props.name, capability=list(torch.cuda.get_device_capability(device)),
                   sm_count=props.multi_processor_count, gpu_memory_bytes=props.total_memory,
                   driver=run_quiet(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]))
    return env


def source_digest() -> str:
    """sha256 (12 hex) of the code measured: src/nanochat, this script, tests/test_gpu.py. The device
    gets a copy of the working tree without .git, so this is what ties a JSON to a commit."""
    import hashlib

    digest = hashlib.sha256()
    files = sorted((ROOT / "src" / "nanochat").rglob("*.py")) + [ROOT / "scripts" / "gpu_check.py",
                                                                ROOT / "tests" / "test_gpu.py"]
    for path in files:
        if path.exists():
            digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def run_quiet(cmd: list[str]) -> str | None:
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=20)
        return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


# ------------------------------------------------------------------------------------ printing
def fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def status_text(e: dict) -> str:
    if e.get("status") == "ok":
        return "ok"
    return f"{e.get('status')}: {(e.get('reason') or e.get('error') or '')[:50]}"


def tables(report: dict) -> str:
    from nanochat.common import format_table

    out = []
    env = report["env"]
    out.append(f"gpu_check {'(DRY RUN, CPU, toy sizes: figures mean nothing) ' if report['dry_run'] else ''}"
               f"{env['date']} | {env['gpu_name'] or env['device']} cap {env['capability']} | driver "
               f"{env['driver']} | torch {env['torch']} (CUDA {env['torch_cuda']}) | torchao {env['torchao']}")
    micro = report["micro"]["results"]
    probe = micro.get("scaled_mm_probe")
    if probe and probe.get("status") == "ok":
        refused = [f"{r['a']}x{r['b']} {r['scaling']}" for r in probe["pairings"] if not r["ok"]]
        out.append(f"\n_scaled_mm pairings refused here: {', '.join(refused) or 'none'}")
    rows = [[k, status_text(e), fmt(e.get("ms_median"), ".3f"), fmt(e.get("tflops"), ".1f"),
             fmt(e.get("speedup_vs_baseline"), ".3f", "x"), gib(e.get("peak_mem_bytes")),
             fmt(e.get("first_step_s"), ".1f")]
            for k, e in micro.items() if k != "scaled_mm_probe"]
    if rows:
        shape = next((e["shape"] for e in micro.values() if "shape" in e), {})
        out.append(f"\n(a) micro: {report['config']['micro_model']} MLP fwd+bwd, x [{shape.get('tokens')}, "
                   f"{shape.get('n_embd')}] -> {shape.get('hidden')} -> {shape.get('n_embd')}")
        out.append(format_table(["config", "status", "ms", "TFLOP/s", "vs base", "peak GiB", "1st step s"], rows))
    rows = [[k, status_text(e), fmt(e.get("batch"), "d"), fmt(e.get("tokens_per_s"), ",.0f"),
             fmt(e.get("speedup_vs_baseline"), ".3f", "x"), fmt(e.get("ms_median"), ".1f"),
             fmt(e.get("tflops"), ".1f"), gib(e.get("peak_mem_bytes")), fmt(e.get("first_step_s"), ".1f")]
            for k, e in report["train"]["results"].items()]
    if rows:
        out.append(f"\n(b) train: seq {report['config']['seq_len']}, vocab {report['config']['vocab_size']}, "
                   f"fused AdamW, {report['config']['train_steps']} timed steps")
        out.append(format_table(["config", "status", "batch", "tok/s", "vs base", "ms/step", "TFLOP/s",
                                 "peak GiB", "1st step s"], rows))
    rows = [[k, status_text(e), fmt(e.get("ms_median"), ".2f"), fmt(e.get("step_ratio_vs_fused"), ".3f", "x"),
             fmt(e.get("state_bytes_per_param"), ".3f"), fmt(e.get("peak_extra_bytes_per_param"), ".3f"),
             fmt(e.get("first_step_s"), ".1f"), e.get("step_backend", "")]
            for k, e in report["optim"]["results"].items()]
    if rows:
        n = next((e["n_params"] for e in report["optim"]["results"].values() if "n_params" in e), None)
        out.append(f"\n(c) optim: {fmt(n, ',d')} fp32 params")
        out.append(format_table(["optimizer", "status", "ms/step", "vs fused", "state B/param",
                                 "peak extra B/param", "1st step s", "step"], rows))
    t = report["tests"]
    if t:
        out.append(f"\n(d) tests: {status_text(t)} | {t.get('passed', 0)} passed, {t.get('failed', 0)} failed, "
                   f"{t.get('skipped', 0)} skipped, {t.get('errors', 0)} errors")
        out.extend(f"    {name}" for name in t.get("failed_tests", []))
    rows = [[name, t["what"], fmt(t["value"], ".3f"), f"{t['op']} {t['target']}",
             {True: "MET", False: "NOT MET", None: "-"}[t["met"]]] for name, t in report["targets"].items()]
    out.append("\ntargets")
    out.append(format_table(["target", "figure", "value", "needs", "met"], rows))
    b = report["budget"]
    out.append(f"\n{b['elapsed_s']:.0f} s of --budget_s {b['budget_s']:.0f}; skipped for time: "
               f"{', '.join(b['skipped_for_time']) or 'none'}; errors: {len(report['errors'])}")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------- main
def import_problem() -> str | None:
    """Why torchao or nanochat.fp8 does not import here (the device's torch may be too old or new
    for the carried torchao), or None."""
    try:
        import torchao.float8  # noqa: F401
        import torchao.optim  # noqa: F401

        import nanochat.fp8  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure here means nothing can be measured
        return traceback.format_exc()
    return None


def main(argv: list[str] | None = None) -> int:
    problem = import_problem()
    if problem:
        print(f"{problem}\nerror: torchao or nanochat.fp8 does not import with torch {torch.__version__} "
              "(traceback above); nothing to measure. Carry a torchao that supports this torch: "
              "TORCHAO=torchao==X.Y.Z ../shared/tools/gpu-wheels.sh", file=sys.stderr)
        return 4
    from nanochat.config import parse_cli

    cfg = parse_cli(CheckConfig, argv)
    if cfg.dry_run:
        cfg = dataclasses.replace(cfg, **DRY_RUN)
        device = torch.device("cpu")
        # one thread: on a shared, loaded 2-core machine OpenMP's second thread waits for a core and
        # made each toy op ~20x slower (measured: 1.3 s vs 45 ms per emulated MLP step)
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            print("error: no CUDA device (torch.cuda.is_available() is False). This script measures a "
                  "GPU; on a machine without one run it with --dry_run.", file=sys.stderr)
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # a job that hangs past the budget gets its stack printed (into the reply's output tail) while
    # the device call is still alive to return it
    faulthandler.dump_traceback_later(cfg.budget_s + 45, exit=False)
    check = Check(cfg, device, out)
    env = check.report["env"]
    print(f"gpu_check: {env['gpu_name'] or 'CPU dry run'} | torch {env['torch']} (CUDA {env['torch_cuda']}) | "
          f"torchao {env['torchao']} | source {env['source_digest']} | budget {cfg.budget_s:.0f} s", flush=True)
    check.write()
    for job in plan(cfg, device, out.parent):
        check.run(job)
    check.write()
    faulthandler.cancel_dump_traceback_later()
    print("\n" + tables(check.report), flush=True)
    print(f"\nJSON: {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
