"""A training setup measured from outside its loop: a whole run, a statistics period, a profiled
step, an optimizer step alone.

scripts/gpu_check.py takes these figures on a GPU; bench/bench_train.py and bench/bench_optim.py
take the same ones on any device. What each adds to what a run reports itself (TrainResult):
- `train_run`: the run's compile health -- dynamo's graph breaks, its first recompile reasons, and
  whether a function hit dynamo's recompile limit (it then runs eagerly, so the run's tokens/s is
  not the compiled model's: the run is marked `invalid`) -- and its CUDA peak memory;
- `stats_cost`: what FP8 statistics cost, one --fp8_stats_every period timed step by step;
- `profile_step`: one more step under torch.profiler (which GEMM kernels ran, how many
  torch._scaled_mm calls) and under a device-read counter;
- `optimizer_steps`: fused AdamW against FP8Optim at each level, each alone on parameters of its
  own: median step time, peak memory above the parameters and gradients, the step's backend.
Every step timed here is synchronized on both sides on CUDA, so a figure is the GPU's work.
"""

from __future__ import annotations

import gc
import logging
import re
import statistics
import time
from typing import Any

import torch
from torch._dynamo.utils import counters

from nanochat.device import DeviceReads, resolve_device
from nanochat.optim import FP8Optim
from nanochat.train.trainer import NanoChatTrainer

RECOMPILE_LIMIT_HIT = "torch._dynamo hit config."
"""How dynamo's warning begins when a function reached its recompile limit and runs eagerly from
then on (torch/_dynamo/convert_frame.py)."""


def reset_memory(device: torch.device) -> None:
    """Drop what the last measurement left: dynamo's graphs (the next one traces afresh; inductor's
    on-disk cache may still serve it), its tensors, and CUDA's peak-memory counter."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: torch.device) -> float | None:
    """CUDA's peak allocated memory since the last `reset_memory`, GiB; None off CUDA."""
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


class RecompileLog(logging.Handler):
    """The first recompile reasons dynamo logs while the block runs (why a graph was not reused),
    and `limit_hit`: dynamo's warning that a function reached its recompile limit (it then runs
    eagerly), or None."""

    def __init__(self):
        super().__init__()
        self.reasons: list[str] = []
        self.limit_hit: str | None = None

    def emit(self, record):
        message = record.getMessage()
        if message.startswith(RECOMPILE_LIMIT_HIT) and self.limit_hit is None:
            self.limit_hit = " ".join(message.split("\n")[:3])[:600]
        elif len(self.reasons) < 3:
            self.reasons.append(message[:600])

    def __enter__(self):
        torch._logging.set_logs(recompiles=True)
        self.logger = logging.getLogger("torch._dynamo")
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
        torch._logging.set_logs()


def graph_breaks() -> dict[str, Any]:
    """dynamo's graph breaks and unique graphs since its counters were last cleared."""
    return {"graph_breaks": sum(counters["graph_break"].values()),
            "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
            "break_reasons": dict(list(counters["graph_break"].items())[:5])}


def train_run(kw: dict, **over) -> tuple[NanoChatTrainer, dict]:
    """NanoChatTrainer(**kw, **over) trained in this process: the trainer (for more steps) and its
    figures: TrainResult's fields (the layer lists as counts, without samples and statistics),
    `over` as `settings`, graph breaks, recompile reasons, peak memory, and `invalid` where dynamo
    hit its recompile limit."""
    kw = {**kw, **over}
    reset_memory(resolve_device(kw.get("device", "auto")))
    counters.clear()
    recompiles = RecompileLog()
    trainer = NanoChatTrainer(**kw)
    with recompiles:
        r = trainer.train()
    bulky = ("samples", "fp8_stats", "fp8_converted", "fp8_skipped")
    figures = {k: v for k, v in r.to_dict().items() if k not in bulky}
    report = trainer.fp8.report
    figures.update(settings=over, model=kw["model_name"], batch_size=kw["batch_size"],
                   fp8_converted_layers=len(r.fp8_converted), fp8_skipped_layers=len(r.fp8_skipped),
                   peak_gib=peak_gib(trainer.device),
                   fp8_kept_by_policy=report.kept_by_layers if report is not None else None,
                   recompile_reasons=recompiles.reasons[:3], **graph_breaks())
    if recompiles.limit_hit:
        figures["invalid"] = f"dynamo hit its recompile limit, so part of the model ran eagerly: {recompiles.limit_hit}"
    return trainer, figures


def timed_step(trainer: NanoChatTrainer, step: int) -> float:
    """Seconds of trainer.train_step(step), the device synchronized on both sides."""
    cuda = trainer.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    trainer.train_step(step)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def stats_cost(trainer: NanoChatTrainer, tokens_per_step: int) -> dict:
    """What FP8 statistics cost a trained FP8 run: one period of --fp8_stats_every steps timed one
    by one, the last being the period's sampled step. tokens/s over the period against the same
    steps without the sampled one, i.e. statistics off (a step that samples nothing runs exactly
    as with statistics off)."""
    period = trainer.config.fp8_stats_every
    if not period:
        raise ValueError("stats_cost: the run samples no FP8 statistics (--fp8_stats_every 0 or no --fp8); "
                         "time a run with --fp8 and statistics on")
    # step s samples when (s + 1) % period == 0: warm up on one (its first eager run of the model),
    # then time steps period .. 2 period - 1
    timed_step(trainer, period - 1)
    times = [timed_step(trainer, s) for s in range(period, 2 * period)]
    with_stats, without = period * tokens_per_step / sum(times), (period - 1) * tokens_per_step / sum(times[:-1])
    return {"period": period, "tokens_per_sec_with_stats": with_stats, "tokens_per_sec_without": without,
            "overhead_pct": 100 * (1 - with_stats / without), "sampled_step_s": times[-1],
            "median_step_s": statistics.median(times[:-1]),
            "sampled_step_costs_steps": times[-1] / statistics.median(times[:-1]) - 1}


def profile_step(trainer: NanoChatTrainer) -> dict:
    """One more training step under the profiler (GEMM kernel names) and a device-read counter."""
    from torch.profiler import ProfilerActivity, profile

    cuda, last = trainer.device.type == "cuda", trainer.total_steps - 1
    reads = DeviceReads()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    trainer.train_step(last)  # a steady-state step first (no recompiles below)
    with reads:
        trainer.train_step(last)
    with profile(activities=activities) as prof:
        trainer.train_step(last)
        if cuda:
            torch.cuda.synchronize()
    kernels: dict[str, int] = {}
    for e in prof.key_averages():
        if re.search(r"gemm|_mm|matmul|xmma|cutlass|nvjet", e.key, re.I) and (
                not cuda or getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA):
            kernels[e.key[:160]] = e.count
    scaled_mm = sum(e.count for e in prof.key_averages() if e.key == "aten::_scaled_mm")
    return {"gemm_kernels": kernels, "scaled_mm_calls": scaled_mm, "device_reads_in_step": reads.count}


# ----------------------------------------------------------------------------- optimizer steps
OPTIMIZERS = ("adamw_fused", "fp8optim_l0", "fp8optim_l1", "fp8optim_l2")
"""What `optimizer_steps` steps by default: fused AdamW, then FP8Optim at each level."""
MASTER_OPTIMIZERS = ("fp8optim_l2_bf16", "fp8optim_l2_bf16_sr", "fp8optim_l2_bf16_split")
"""Also accepted by `optimizer_steps`: level 2 with bf16 master weights (--master_weights)."""


def optimizer_steps(device: torch.device, *, n_tensors: int, dim: int, steps: int,
                    optimizers: tuple[str, ...] = OPTIMIZERS, compile: bool = True) -> dict:
    """AdamW(fused=True) against FP8Optim, one optimizer at a time on its own n_tensors x dim^2
    parameters (same values and gradients): name -> the figures of `_step_alone`, with each
    median step time's ratio to fused AdamW's."""
    unknown = [n for n in optimizers if n not in OPTIMIZERS + MASTER_OPTIMIZERS]
    if unknown:
        raise ValueError(f"unknown optimizer {' '.join(unknown)}; use {' '.join(OPTIMIZERS + MASTER_OPTIMIZERS)}")
    out = {name: _step_alone(name, device, n_tensors, dim, steps, compile) for name in optimizers}
    base = out.get("adamw_fused", {}).get("step_ms")
    for v in out.values():
        v["ratio_to_fused"] = v["step_ms"] / base if base else None
    return out


def _step_alone(name: str, device: torch.device, n_tensors: int, dim: int, steps: int, compile: bool) -> dict:
    """One optimizer's first step (state creation, compile), then the median of `steps` synchronized
    steps, one step under a device-read counter, and the peak memory above its parameters and grads."""
    reset_memory(device)
    master = name.split("_l2_")[1] if "_l2_" in name else "fp32"
    dtype = torch.float32 if master == "fp32" else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(dim, dim, device=device, generator=g).to(dtype)) for _ in range(n_tensors)]
    for p in params:
        p.grad = (torch.randn(p.shape, device=device, generator=g) * 1e-3).to(dtype)
    opt = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    if name != "adamw_fused":
        opt = FP8Optim(opt, opt_level=int(name[len("fp8optim_l")]), master_weights=master, compile=compile)
    cuda = device.type == "cuda"
    before = torch.cuda.memory_allocated() if cuda else 0
    opt.step()
    times = []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    reads = DeviceReads()
    with reads:
        opt.step()
    n = n_tensors * dim ** 2
    state = opt.state_bytes() / n if isinstance(opt, FP8Optim) else 8.0
    peak = torch.cuda.max_memory_allocated() - before if cuda else None
    return dict(step_ms=1e3 * statistics.median(times), device_reads_per_step=reads.count,
                state_bytes_per_param=state, training_state_bytes_per_param=2 * dtype.itemsize + state,
                peak_above_params_grads_bytes_per_param=None if peak is None else peak / n,
                backend=_backend(opt), fallbacks=list(getattr(opt, "fallbacks", [])))


def _backend(opt) -> str | dict:
    """torch's fused step, or FP8Optim.step_backends(): backend -> (calls, tensors) of the last step."""
    if not hasattr(opt, "step_backends"):
        return "torch fused"
    return opt.step_backends() or "torch fused (level 0: the wrapped AdamW steps every tensor)"


__all__ = ["MASTER_OPTIMIZERS", "OPTIMIZERS", "RecompileLog", "graph_breaks", "optimizer_steps", "peak_gib",
           "profile_step", "reset_memory", "stats_cost", "timed_step", "train_run"]
