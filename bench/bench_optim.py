"""Benchmark FP8Optim against torch AdamW and torchao's AdamWFp8, in one process.

    .venv/bin/python bench/bench_optim.py --out bench_optim.json   # ~10 min on 2 CPU cores
    .venv/bin/python bench/bench_optim.py --quick                  # seconds: a dry run (tests)

(a) moment bytes per parameter: torch AdamW, torchao AdamWFp8, FP8Optim levels 0/1/2;
(b) median step time over --steps steps on --n_tensors x --dim^2 fp32 parameters (16M by default),
    all optimizers stepped round-robin so machine load hits them alike, the whole measurement
    repeated --repeats times; ratios to torch.optim.AdamW(fused=True), to torchao AdamWFp8, and
    level 1 to level 2 (on CPU: wall-clock at the default thread count and 1-thread CPU time);
(c) the same small GPT (nanochat.model.gpt, preset --preset) trained --train_steps steps on bytes of
    stdlib sources (vocab 256) with AdamW and with FP8Optim levels 1 and 2: final val loss, gap;
(e) --master: bytes per parameter of the whole training state (weights + gradients + optimizer
    state) and median step time for each --master_weights choice at FP8Optim level 2, against
    fp32 weights with torch AdamW(fused=True), same parameters and gradients, round-robin;
(d) --study: the second-moment representation study behind optim.py's choice (update error and
    worst update against fp32 Adam on gradients spanning 1e-8..1e2 inside every block);
(f) --alone: each optimizer alone on fresh parameters (nanochat.train.measure.optimizer_steps,
    which scripts/gpu_check.py's optim job runs): median step time, peak memory above the
    parameters and gradients, device reads a step, state bytes, the step's backend and fallbacks.
(g) --muon: Muon's step, torch.optim.Muon against FP8Optim's with FP8 momentum (Newton-Schulz in
    bf16, torch's math, and in fp32, the CPU default) and fused AdamW: state bytes and step time;
Machine load matters on a shared box: the script prints `os.getloadavg()` next to the figures.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import harness
from nanochat.common import format_table

# torch and the modules that load it are imported in the functions that use them: --help stays fast
if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, kw_only=True)
class BenchOptimConfig:
    """FP8Optim against torch AdamW and torchao's AdamWFp8: moment bytes, step time, training."""

    quick: bool = False
    """Tiny sizes, no compile, no torchao: a dry run in seconds (tests)."""
    n_tensors: int = 16
    """(b) number of parameter tensors."""
    dim: int = 1024
    """(b) each tensor is dim x dim fp32."""
    steps: int = 25
    """(b) timed steps per optimizer (the median is reported)."""
    repeats: int = 1
    """(b) repeat the timing this many times (each repeat prints its own table)."""
    device: str = "cpu"
    """(b) where the parameters live ("cuda": the compiled multi-tensor step; timed with syncs)."""
    torchao: bool = True
    """(b) also time torchao's AdamWFp8 (slow on CPU; --no-torchao skips it)."""
    preset: str = "d2"
    """(c) nanochat.model.gpt size preset trained with each optimizer."""
    train_steps: int = 300
    """(c) training steps per run."""
    study: bool = False
    """(d) also run the second-moment representation study."""
    skip_speed: bool = False
    """Skip (a) and (b)."""
    master: bool = False
    """(e) also time and size each --master_weights choice (level 2) against fused AdamW."""
    alone: bool = False
    """(f) also step each optimizer alone: step time, peak memory, device reads (--device cuda)."""
    skip_train: bool = False
    """Skip (c)."""
    muon: bool = False
    """(g) also time Muon's step: torch.optim.Muon against FP8Optim's (FP8 momentum, Newton-Schulz
    in bf16 as torch's and in fp32, the CPU default) and fused AdamW, on --muon_tensors matrices."""
    muon_tensors: int = 4
    """(g) number of --muon_dim^2 matrices (torch's bf16 Newton-Schulz takes seconds a 512^2 matrix
    on a CPU without bf16 units, hence few)."""
    muon_dim: int = 512
    """(g) each Muon matrix is muon_dim x muon_dim fp32."""
    muon_steps: int = 5
    """(g) timed steps per optimizer (the median is reported)."""
    out: str | None = None
    """Write all figures as JSON here."""

    def __post_init__(self) -> None:
        from nanochat.model.gpt import PRESETS

        for name in ("n_tensors", "dim", "steps", "train_steps", "repeats", "muon_tensors", "muon_dim", "muon_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.preset not in PRESETS:
            raise ValueError(f"--preset {self.preset!r} is not a size preset; use one of {', '.join(PRESETS)}")


QUICK = dict(n_tensors=2, dim=128, steps=3, train_steps=5, muon_tensors=2, muon_dim=64, muon_steps=2)


# ---- (a) + (b) ---------------------------------------------------------------------------------


def _optimizers(params_for, quick: bool, torchao: bool):
    """name -> optimizer over its own copy of the parameters."""
    import torch

    from nanochat.optim import FP8Optim

    opts = {"torch AdamW fused": torch.optim.AdamW(params_for("fused"), lr=1e-3, weight_decay=0.1, fused=True)}
    if torchao and not quick:
        from torchao.optim import AdamWFp8
        opts["torchao AdamWFp8"] = AdamWFp8(params_for("ao"), lr=1e-3, weight_decay=0.1)
    for level in (0, 1, 2):
        inner = torch.optim.AdamW(params_for(f"l{level}"), lr=1e-3, weight_decay=0.1, fused=True)
        opts[f"FP8Optim level {level}"] = FP8Optim(inner, opt_level=level, compile=not quick)
    return opts


def _moment_bytes(opt) -> float:
    import torch

    from nanochat.optim import FP8Optim

    if isinstance(opt, FP8Optim):
        return opt.state_bytes_per_param()
    total = n = 0
    for group in opt.param_groups:
        for p in group["params"]:
            n += p.numel()
            for key, value in opt.state[p].items():
                if key == "step" or not torch.is_tensor(value):
                    continue
                if hasattr(value, "codes"):  # torchao OptimStateFp8: codes + scale
                    total += value.codes.numel() * value.codes.element_size() + value.scale.numel() * 4
                else:
                    total += value.numel() * value.element_size()
    return total / n


def _median_step_ms(opts: dict, steps: int, clock, cuda: bool) -> dict[str, float]:
    """Each optimizer's median step in ms over `steps`, taken round-robin so that changes in the
    machine's load hit every optimizer alike."""
    runs = harness.interleave({name: lambda _, step=opt.step: harness.timed(step, cuda=cuda, clock=clock)
                               for name, opt in opts.items()}, steps)
    return {name: ms * 1e3 for name, ms in harness.medians(runs).items()}


def bench_speed(args) -> dict:
    import torch

    from nanochat.optim import FP8Optim

    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(args.dim, args.dim, generator=g).to(device) for _ in range(args.n_tensors)]
    grads = [(torch.randn(args.dim, args.dim, generator=g) * 1e-2).to(device) for _ in range(args.n_tensors)]
    made: dict[str, list] = {}

    def params_for(name):
        ps = [torch.nn.Parameter(b.clone()) for b in base]
        for p, gr in zip(ps, grads):
            p.grad = gr.clone()
        made[name] = ps
        return ps

    opts = _optimizers(params_for, args.quick, args.torchao)
    cuda = device.type == "cuda"

    def warm_up() -> None:  # state allocation and compilation
        for opt in opts.values():
            opt.step()
            opt.step()

    warm = harness.timed(warm_up, cuda=cuda)
    n = args.n_tensors * args.dim * args.dim
    results = {}
    backends = {name: opt.step_backends() for name, opt in opts.items() if isinstance(opt, FP8Optim)}
    # wall clock at the default thread count is what a run sees; on a loaded machine it also
    # measures how each implementation copes with contention (OpenMP barriers suffer most), so
    # the single-thread CPU time (process_time) is printed too: the work per step, load-independent
    threads = torch.get_num_threads()
    clocks = [("wall", threads, time.perf_counter)]
    if device.type == "cpu":
        clocks.append(("cpu", 1, time.process_time))
    for label, n_threads, clock in clocks:
        torch.set_num_threads(n_threads)
        runs = []
        for repeat in range(args.repeats):
            med = _median_step_ms(opts, args.steps, clock, cuda)
            vs_fused = harness.ratios(med, "torch AdamW fused")
            vs_ao = harness.ratios(med, "torchao AdamWFp8") if "torchao AdamWFp8" in med else {}
            rows, out = [], {}
            for name, opt in opts.items():
                bpp = _moment_bytes(opt)
                out[name] = dict(bytes_per_param=bpp, median_ms=med[name], vs_fused=vs_fused[name],
                                 vs_torchao=vs_ao.get(name), backend=backends.get(name))
                rows.append([name, f"{bpp:.3f}", f"{med[name]:.2f}", f"{vs_fused[name]:.2f}x",
                             f"{vs_ao[name]:.2f}x" if vs_ao else "-"])
            what = (f"wall-clock, {n_threads} threads" if label == "wall" else "CPU time (process_time), 1 thread")
            if device.type != "cpu":
                what = f"wall-clock on {torch.cuda.get_device_name(device)}, synchronized"
            l1_vs_l2 = med["FP8Optim level 1"] / med["FP8Optim level 2"]
            print(f"\n(a, b) {args.n_tensors} x {args.dim}^2 = {n / 1e6:.1f}M fp32 params, median of {args.steps} "
                  f"steps, {what}, repeat {repeat + 1}/{args.repeats}, {harness.load()} (warm-up incl. compile {warm:.0f} s)")
            print(format_table(["optimizer", "moment bytes/param", "step ms", "vs fused AdamW", "vs torchao"], rows))
            print(f"level 2 / fused AdamW {vs_fused['FP8Optim level 2']:.2f}x, level 1 / fused AdamW "
                  f"{vs_fused['FP8Optim level 1']:.2f}x, level 1 / level 2 {l1_vs_l2:.2f}x; "
                  f"FP8Optim step backends: {backends.get('FP8Optim level 2')}")
            runs.append(dict(results=out, level1_vs_level2=l1_vs_l2, load_after=os.getloadavg()))
        results[label] = dict(threads=n_threads, runs=runs, results=runs[-1]["results"],
                              load_after=os.getloadavg())
    torch.set_num_threads(threads)
    return dict(numel=n, device=str(device), **results)


# ---- (e) ---------------------------------------------------------------------------------------


def bench_master(args) -> dict:
    """Training-state bytes per parameter and step time per master-weight choice (level 2)."""
    import torch

    from nanochat.optim import FP8Optim

    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(args.dim, args.dim, generator=g) for _ in range(args.n_tensors)]
    grads = [torch.randn(args.dim, args.dim, generator=g) * 1e-2 for _ in range(args.n_tensors)]

    def params(dtype):
        ps = [torch.nn.Parameter(b.to(device, dtype)) for b in base]
        for p, gr in zip(ps, grads):
            p.grad = gr.to(device, dtype)
        return ps

    opts = {"fp32 weights, torch AdamW fused": torch.optim.AdamW(params(torch.float32), lr=1e-3,
                                                                  weight_decay=0.1, fused=True)}
    for master in ("fp32", "bf16", "bf16_sr", "bf16_split"):
        ps = params(torch.float32 if master == "fp32" else torch.bfloat16)
        opts[f"{master} weights, FP8Optim level 2"] = FP8Optim(
            torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1), opt_level=2, master_weights=master,
            compile=not args.quick)
    for opt in opts.values():  # state allocation, compilation
        opt.step()
        opt.step()
    med = _median_step_ms(opts, args.steps, time.perf_counter, device.type == "cuda")
    n = args.n_tensors * args.dim * args.dim
    vs_fused = harness.ratios(med, "fp32 weights, torch AdamW fused")
    rows, out = [], {}
    for name, opt in opts.items():
        ps = [p for grp in opt.param_groups for p in grp["params"]]
        weights = sum(p.numel() * p.element_size() for p in ps)
        grads_b = sum(p.grad.numel() * p.grad.element_size() for p in ps)
        state = opt.state_bytes() if isinstance(opt, FP8Optim) else _moment_bytes(opt) * n
        out[name] = dict(weights=weights / n, gradients=grads_b / n, optimizer=state / n,
                         total=(weights + grads_b + state) / n, median_ms=med[name], vs_fused=vs_fused[name],
                         backend=opt.step_backends() if isinstance(opt, FP8Optim) else None)
        rows.append([name, f"{weights / n:.0f}", f"{grads_b / n:.0f}", f"{state / n:.3f}",
                     f"{(weights + grads_b + state) / n:.3f}", f"{med[name]:.2f}", f"{vs_fused[name]:.2f}x"])
    print(f"\n(e) {n / 1e6:.1f}M params, training state per parameter and median of {args.steps} steps, "
          f"{torch.get_num_threads()} threads, {harness.load()}; FP8Optim backends: "
          f"{ {k: v['backend'] for k, v in out.items() if v['backend']} }")
    print(format_table(["weights / optimizer", "weight B", "grad B", "optimizer B", "state B/param", "step ms",
                        "vs fused AdamW"], rows))
    return dict(numel=n, device=str(device), results=out)


# ---- (f) ---------------------------------------------------------------------------------------

def bench_alone(args) -> dict:
    import torch

    from nanochat.train.measure import optimizer_steps

    device = torch.device(args.device)
    out = optimizer_steps(device, n_tensors=args.n_tensors, dim=args.dim, steps=args.steps, compile=not args.quick)
    peak = {name: v["peak_above_params_grads_bytes_per_param"] for name, v in out.items()}  # None off CUDA
    rows = [[name, f"{v['step_ms']:.2f}", f"{v['ratio_to_fused']:.2f}x", f"{v['state_bytes_per_param']:.3f}",
             "-" if peak[name] is None else f"{peak[name]:.2f}", v["device_reads_per_step"], v["backend"]]
            for name, v in out.items()]
    print(f"\n(f) {args.n_tensors} x {args.dim}^2 fp32 params on {device}, each optimizer alone, median of "
          f"{args.steps} steps, {harness.load()}")
    print(format_table(["optimizer", "step ms", "vs fused AdamW", "state B/param", "peak above params+grads B/param",
                        "device reads", "backend"], rows))
    return out


# ---- (g) ---------------------------------------------------------------------------------------

def bench_muon(args) -> dict:
    """Muon's step on --muon_tensors matrices, every optimizer on its own copy of the same
    parameters and gradients, round-robin; ratios to torch.optim.Muon and to fused AdamW."""
    import torch

    from nanochat.optim import FP8Optim

    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    shape = (args.muon_dim, args.muon_dim)
    base = [torch.randn(shape, generator=g).to(device) * 0.02 for _ in range(args.muon_tensors)]
    grads = [torch.randn(shape, generator=g).to(device) * 1e-2 for _ in range(args.muon_tensors)]

    def params():
        ps = [torch.nn.Parameter(b.clone()) for b in base]
        for p, gr in zip(ps, grads):
            p.grad = gr.clone()
        return ps

    def fp8_muon(ns: torch.dtype) -> FP8Optim:
        opt = FP8Optim(torch.optim.Muon(params(), lr=0.02), opt_level=1, compile=not args.quick)
        opt.muon_ns_dtype = ns
        return opt

    opts = {"torch AdamW fused": torch.optim.AdamW(params(), lr=1e-3, fused=device.type in ("cpu", "cuda")),
            "torch.optim.Muon": torch.optim.Muon(params(), lr=0.02),
            "FP8Optim(Muon) level 1, NS bf16": fp8_muon(torch.bfloat16),
            "FP8Optim(Muon) level 1, NS fp32": fp8_muon(torch.float32)}
    cuda = device.type == "cuda"
    warm = harness.timed(lambda: [opt.step() for opt in opts.values()], cuda=cuda)  # state and compile
    med = _median_step_ms(opts, args.muon_steps, time.perf_counter, cuda)
    vs_muon, vs_fused = harness.ratios(med, "torch.optim.Muon"), harness.ratios(med, "torch AdamW fused")
    out, rows = {}, []
    for name, opt in opts.items():
        bpp = _moment_bytes(opt)
        out[name] = dict(bytes_per_param=bpp, median_ms=med[name], vs_torch_muon=vs_muon[name],
                         vs_fused_adamw=vs_fused[name])
        rows.append([name, f"{bpp:.3f}", f"{med[name]:.1f}", f"{vs_muon[name]:.3g}x", f"{vs_fused[name]:.3g}x"])
    print(f"\n(g) Muon: {args.muon_tensors} x {args.muon_dim}^2 fp32 matrices on {device}, median of "
          f"{args.muon_steps} steps, {torch.get_num_threads()} threads, {harness.load()} (warm-up incl. compile "
          f"{warm:.0f} s)")
    print(format_table(["optimizer", "state bytes/param", "step ms", "vs torch.optim.Muon", "vs fused AdamW"], rows))
    return dict(shape=list(shape), tensors=args.muon_tensors, device=str(device), results=out)


# ---- (c) ---------------------------------------------------------------------------------------


def corpus_tokens() -> "torch.Tensor":
    """Bytes of a few stdlib sources: real text, vocab 256, no download."""
    import argparse as a, collections as c, dataclasses as d, inspect as i, json as j, typing as t

    import torch
    data = b"".join(pathlib.Path(m.__file__).read_bytes() for m in (a, c, d, i, j, t))
    return torch.tensor(list(data), dtype=torch.long)


def train_gpt(level, args, tokens, seq_len=64, batch=16):
    import torch

    from nanochat.device import seed_everything
    from nanochat.optim import FP8Optim
    from nanochat.model.gpt import GPT, preset_config

    seed_everything(0)
    model = GPT(preset_config(args.preset, vocab_size=256, seq_len=seq_len))
    model.init_weights()
    lr = 3e-3
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=False)
    if level is not None:
        opt = FP8Optim(opt, opt_level=level)  # native C kernel on CPU (tested against eager)
    split = int(0.9 * len(tokens))
    train, val = tokens[:split], tokens[split:]
    g = torch.Generator().manual_seed(0)
    steps = args.train_steps
    warmup = max(1, steps // 20)
    for step in range(steps):
        scale = min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        idx = torch.randint(0, len(train) - seq_len - 1, (batch,), generator=g)
        x = torch.stack([train[i:i + seq_len] for i in idx])
        y = torch.stack([train[i + 1:i + seq_len + 1] for i in idx])
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    with torch.no_grad():
        n = (len(val) - 1) // seq_len
        n = min(n, 4 if args.quick else 256)
        x = val[:n * seq_len].view(n, seq_len)
        y = val[1:n * seq_len + 1].view(n, seq_len)
        val_loss = model(x, y).item()
    return val_loss, loss.item()


def bench_train(args) -> dict:
    tokens = corpus_tokens()
    out, rows = {}, []
    t0 = time.perf_counter()
    ref_val, ref_train = train_gpt(None, args, tokens)
    out["AdamW"] = dict(val_loss=ref_val, train_loss=ref_train, rel_gap=0.0)
    rows.append(["torch AdamW", f"{ref_val:.4f}", "-"])
    for level in (1, 2):
        val, tr = train_gpt(level, args, tokens)
        gap = (val - ref_val) / ref_val
        out[f"FP8Optim level {level}"] = dict(val_loss=val, train_loss=tr, rel_gap=gap)
        rows.append([f"FP8Optim level {level}", f"{val:.4f}", f"{100 * gap:+.2f}%"])
    print(f"\n(c) GPT {args.preset}, vocab 256 (stdlib bytes, {len(tokens):,} tokens), {args.train_steps} steps, "
          f"batch 16 x 64, lr 3e-3 cosine, {time.perf_counter() - t0:.0f} s, {harness.load()}")
    print(format_table(["optimizer", "val loss", "gap vs AdamW"], rows))
    return out


# ---- (d) ---------------------------------------------------------------------------------------


def _store(x, how):
    """Quantize then dequantize a second moment v (fp32) the way `how` stores it."""
    import torch

    from nanochat.optim import FP8Tensor
    from nanochat.optim.moments import quantize_sqrt_v

    if how == "fp32":
        return x
    if how == "v e4m3 (torchao)":
        return FP8Tensor.from_float(x, dtype=torch.float8_e4m3fn).dequantize()
    if how == "v e5m2":
        return FP8Tensor.from_float(x, dtype=torch.float8_e5m2).dequantize()
    if how == "sqrt(v) e4m3, no floor":
        return FP8Tensor.from_float(x.sqrt(), dtype=torch.float8_e4m3fn).dequantize() ** 2
    if how == "sqrt(v) e4m3 + floor (ours)":
        return quantize_sqrt_v(x).dequantize() ** 2
    raise AssertionError(how)


def _study_run(grads, how, b1, b2, eps=1e-8):
    """Adam on a fixed gradient stream, m stored in e4m3 and v stored as `how`; per step the
    update m_hat / (sqrt(v_hat) + eps) (in units of lr)."""
    import torch

    from nanochat.optim import FP8Tensor

    m = torch.zeros_like(grads[0])
    v = torch.zeros_like(grads[0])
    updates = []
    for t, gr in enumerate(grads, start=1):
        m = m.lerp(gr, 1 - b1)
        v = v * b2 + (1 - b2) * gr * gr
        updates.append((m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps))
        if how != "fp32":
            m = FP8Tensor.from_float(m).dequantize()
            v = _store(v, how)
    return updates


def study(args) -> dict:
    """Each option runs its own quantized history against fp32 Adam's on the same gradients."""
    import torch

    n_blocks, steps = (8, 40) if args.quick else (64, 300)
    n = n_blocks * 256
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(n, generator=g)
    noise = [torch.randn(n, generator=g) for _ in range(steps)]
    scenarios = {
        # every block spans |g| 1e-8..1e2 (log-uniform): the widest range a block must hold
        "extreme": torch.logspace(-8, 2, n)[torch.randperm(n, generator=g)],
        # blocks at 1e-6..1 apart, within a block lognormal with a 1-decade sigma: typical layers
        "typical": (torch.logspace(-6, 0, n_blocks)[:, None]
                    * torch.exp(2.3 * torch.randn(n_blocks, 256, generator=g))).reshape(-1),
    }
    options = ["v e4m3 (torchao)", "v e5m2", "sqrt(v) e4m3, no floor", "sqrt(v) e4m3 + floor (ours)"]
    out, rows = {}, []
    for scen, mags in scenarios.items():
        for b2 in (0.95, 0.999):
            # a persistent mean plus noise; after 60% of the steps the gradients shrink 100x
            # (v must decay while m follows: where flushing to zero bites)
            grads = [mags * (mean + noise[t]) * (1.0 if t < 0.6 * steps else 0.01) for t in range(steps)]
            ref = _study_run(grads, "fp32", 0.9, b2)
            ref_worst = max(u.abs().max().item() for u in ref)
            for how in options:
                ups = _study_run(grads, how, 0.9, b2)
                # error of each element's update, relative to the typical update size (~1)
                err = torch.stack([(u - r).abs() for u, r in zip(ups, ref)])
                worst = max(u.abs().max().item() for u in ups)
                key = f"{scen} b2={b2} {how}"
                out[key] = dict(median_abs_update_err=err.median().item(),
                                p99_abs_update_err=err.flatten().kthvalue(int(0.99 * err.numel())).values.item(),
                                max_update_over_lr=worst, fp32_max_update_over_lr=ref_worst)
                rows.append([scen, b2, how, f"{out[key]['median_abs_update_err']:.4f}",
                             f"{out[key]['p99_abs_update_err']:.3f}", f"{worst:.2f}", f"{ref_worst:.2f}"])
    print(f"\n(d) second-moment storage (m in e4m3 throughout): {n} elements, {steps} steps, b1 0.9, "
          "|update - fp32 Adam's update| in units of lr")
    print(format_table(["gradients", "b2", "v stored as", "median err", "p99 err", "max |update|/lr",
                        "fp32 max"], rows))
    return out


def bench(args: BenchOptimConfig) -> dict:
    import torch

    from nanochat.device import resolve_device

    resolve_device(args.device)  # an unknown or absent device: one error line before any timing
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {harness.load()}")
    result: dict = dict(args={k: str(v) for k, v in dataclasses.asdict(args).items()}, load_start=os.getloadavg())
    if args.study or args.quick:
        result["study"] = study(args)
    if not args.skip_speed:
        result["speed"] = bench_speed(args)
    if args.master or args.quick:
        result["master"] = bench_master(args)
    if args.alone or args.quick:
        result["alone"] = bench_alone(args)
    if args.muon or args.quick:
        result["muon"] = bench_muon(args)
    if not args.skip_train:
        result["train"] = bench_train(args)
    result["load_end"] = os.getloadavg()
    return result


def main(argv: list[str] | None = None) -> int:
    return harness.main(BenchOptimConfig, bench, argv, quick=QUICK)


if __name__ == "__main__":
    sys.exit(main())
