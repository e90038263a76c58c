"""Muon with bf16 master weights and stepped inside the backward, against the fp32-master step.

The reference is `muon_step` on an fp32 copy of the master (torch.optim.Muon's arithmetic:
tests/test_muon.py), Newton-Schulz in fp32 (the CPU's), from the same buffer and gradient. Each
mode is checked one step at a time from the state the bf16 run reached, over 4 steps:

- bf16 (round to nearest): the weight is the reference rounded to bf16 (torch.equal: the update
  is the same fp32 arithmetic, only the write differs), so within half a bf16 step of it,
  <= 2^-8 |reference| elementwise (8 significant bits).
- bf16_split: the master joined from the weight and its low halves IS the reference, bit for bit,
  at every step (all 32 bits are kept); the weight is its truncation, within one bf16 step
  (< 2^-7 |reference|).
- bf16_sr: each element is one of the reference's two bf16 neighbours, and over S = 64 seeds
  the mean approaches the reference: the RMS of (mean - reference) / ulp is at most 1/(2 sqrt(S))
  = 0.0625 for an unbiased rounding (a rounding up with probability f has variance f(1 - f) <=
  1/4 ulp^2); round to nearest, deterministic, gives ~1/sqrt(12) = 0.29, so the bound tells them
  apart (checked).
- In the backward (MuonAdamW through wrap_optimizer, d2 GPT, FP8 momentum, fp32 and bf16_sr
  masters): three steps equal the steps after the backward, torch.equal, weights and buffers:
  the same eager arithmetic on the same gradients, run in each matrix's hook instead of after.
  A Muon matrix whose gradient is NaN keeps its weight, buffer and bf16_sr step count, and is
  counted (backward_stats: 1 left unchanged, its per-parameter flag in param_groups order); the
  other parameters move.
- A bf16_split and a bf16_sr Muon state (low halves, step count) round-trip through state_dict
  and torch.load(weights_only=True) and the next step is bit for bit the uninterrupted one.

Modules: nanochat.optim.muon (muon_step, muon_tensors, MuonAdamW's in-backward),
nanochat.optim.wrapper (_step_muon, _muon_here), nanochat.optim.wrap, nanochat.optim.saved_state.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from nanochat.model.gpt import GPT, preset_config
from nanochat.optim import FP8Optim, MuonAdamW, OptimWrapper, muon_param_groups, wrap_optimizer
from nanochat.optim.master import read_master
from nanochat.optim.moments import MomentFormat
from nanochat.optim.muon import muon_flags, muon_hypers, muon_step

SHAPE, STEPS, SEEDS = (128, 256), 4, 64


def _grads(steps=STEPS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*SHAPE, generator=g).bfloat16() for _ in range(steps)]


def _wrapper(master: str, seed: int = 0, level: int = 0, p: nn.Parameter | None = None):
    """A bf16 matrix and the wrapper stepping it (fp32 momentum at level 0, FP8 at 1)."""
    if p is None:
        p = nn.Parameter((torch.randn(*SHAPE, generator=torch.Generator().manual_seed(0)) * 0.05).bfloat16())
    return p, FP8Optim(torch.optim.Muon([p], lr=0.02, weight_decay=0.1), opt_level=level, master_weights=master,
                       seed=seed, compile=False)


def _reference(p, opt, grad) -> torch.Tensor:
    """The fp32-master step from the state `opt` holds now: muon_step on copies."""
    state, group = opt.state.get(p, {}), opt.param_groups[0]
    master = read_master(p, state.get("master_lo")).clone()
    buf = state["momentum_buffer"].clone() if "momentum_buffer" in state else torch.zeros(SHAPE)
    with torch.no_grad():
        muon_step(master, grad, (buf,), *muon_hypers(group), **muon_flags(group, p.device, torch.float32),
                  m_format=MomentFormat)
    return master


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """bf16's step at |x|: 2^(e - 8) for |x| in [2^(e-1), 2^e) (8 significant bits)."""
    return torch.ldexp(torch.ones_like(x), torch.frexp(x).exponent - 8)


def test_bf16_is_the_fp32_step_rounded_to_nearest():
    p, opt = _wrapper("bf16")
    for grad in _grads():
        ref = _reference(p, opt, grad)
        p.grad = grad
        opt.step()
        assert torch.equal(p, ref.bfloat16())
        assert ((p.float() - ref).abs() <= 2.0**-8 * ref.abs()).all()
    assert opt.state[p]["momentum_buffer"].dtype == torch.float32  # stepped here, not torch's bf16 buffer


def test_bf16_split_keeps_the_fp32_master_bit_for_bit():
    p, opt = _wrapper("bf16_split")
    fp32 = nn.Parameter(p.detach().float())
    plain = OptimWrapper(torch.optim.Muon([fp32], lr=0.02, weight_decay=0.1), compile=False)
    for grad in _grads():
        ref = _reference(p, opt, grad)
        p.grad, fp32.grad = grad, grad.float()
        opt.step()
        plain.step()
        master = read_master(p, opt.state[p]["master_lo"])
        assert torch.equal(master, ref) and torch.equal(master, fp32)  # the fp32 run, every step
        assert ((p.float() - ref).abs() < 2.0**-7 * ref.abs()).all()


def _sr_step(seed: int, grad: torch.Tensor) -> torch.Tensor:
    p, opt = _wrapper("bf16_sr", seed=seed)
    p.grad = grad
    opt.step()
    return p.detach().float()


def test_bf16_sr_is_unbiased_over_seeds():
    grad = _grads(1)[0]
    p, opt = _wrapper("bf16_sr")
    ref = _reference(p, opt, grad)
    ulp = _ulp(ref)
    outs = torch.stack([_sr_step(seed, grad) for seed in range(SEEDS)])
    assert ((outs - ref).abs() < ulp).all()  # one of the two neighbours
    rms = lambda mean: ((mean - ref) / ulp).square().mean().sqrt().item()  # noqa: E731
    assert rms(outs.mean(0)) <= 1 / (2 * math.sqrt(SEEDS)), rms(outs.mean(0))
    assert rms(ref.bfloat16().float()) > 0.25  # round to nearest fails the bound
    assert len({o.sum().item() for o in outs}) > SEEDS // 2  # the seeds draw different bits


# ------------------------------------------------------------------------ in the backward, a model
def _d2(master: str, in_backward: bool):
    torch.manual_seed(0)
    model = GPT(preset_config("d2", vocab_size=320, seq_len=16))
    model.init_weights()
    if master != "fp32":
        model.to(torch.bfloat16)
    split = muon_param_groups(model)
    opt = MuonAdamW(torch.optim.Muon(split.muon, lr=0.02, weight_decay=0.1),
                    torch.optim.AdamW(split.adamw, lr=1e-2), placements=split.placements)
    opt = wrap_optimizer(opt, opt_level=1, master_weights=master, seed=3, in_backward=in_backward)
    for member in opt.optimizers:
        member.backends.compile = member.backends.native = False  # eager, both runs
    return model, opt


def _batches(n: int):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 320, (2, 17), generator=g) for _ in range(n)]


@pytest.mark.parametrize("master", ["fp32", "bf16_sr"])
def test_in_backward_muon_is_the_step_after_the_backward(master):
    models = {}
    for in_backward in (False, True):
        model, opt = _d2(master, in_backward)
        assert opt.in_backward == in_backward
        for x in _batches(3):
            model(x[:, :-1], x[:, 1:]).backward()
            if not in_backward:
                opt.step()
                opt.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in model.parameters())
        models[in_backward] = (model, opt)
    (after, opt_a), (inside, opt_b) = models[False], models[True]
    for (name, p), q in zip(after.named_parameters(), inside.parameters()):
        assert torch.equal(p, q), name
    for p, q in zip(opt_a.muon.param_groups[0]["params"], opt_b.muon.param_groups[0]["params"]):
        a, b = opt_a.muon.state[p]["momentum_buffer"], opt_b.muon.state[q]["momentum_buffer"]
        assert torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8)) and torch.equal(a.scale, b.scale)


def test_in_backward_muon_leaves_a_nonfinite_matrix_unchanged():
    model, opt = _d2("bf16_sr", in_backward=True)
    x = _batches(2)
    model(x[0][:, :-1], x[0][:, 1:]).backward()  # one good step: every parameter has state
    assert opt.backward_stats().tolist()[1] == 0  # read, as a loop reads each step's: the sums restart
    poisoned = model.transformer.h[1].mlp.c_fc.weight
    before = {p: p.detach().clone() for p in model.parameters()}
    state = opt.muon.state[poisoned]
    buf, step = state["momentum_buffer"].codes.clone(), state["step"].clone()
    poisoned.register_hook(lambda g: torch.full_like(g, float("nan")))
    model(x[1][:, :-1], x[1][:, 1:]).backward()
    stats = opt.backward_stats(per_param=True)
    norm, skipped, with_grad = stats[:3].tolist()
    hooked = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    assert skipped == 1 and with_grad == len(hooked) and math.isfinite(norm) and norm > 0
    assert stats[3:].tolist() == [1.0 if p is poisoned else 0.0 for p in hooked]
    assert torch.equal(poisoned, before[poisoned])
    assert torch.equal(state["momentum_buffer"].codes, buf) and torch.equal(state["step"], step)
    assert all(not torch.equal(p, before[p]) for p in model.parameters() if p is not poisoned)


# ------------------------------------------------------------------------ saved and loaded
@pytest.mark.parametrize("master", ["bf16_split", "bf16_sr"])
def test_a_bf16_master_muon_state_resumes_bit_for_bit(master):
    grads = _grads(5)
    p, opt = _wrapper(master, seed=7, level=1)
    for g in grads[:3]:
        p.grad = g
        opt.step()
    blob = io.BytesIO()
    torch.save(opt.state_dict(), blob)
    q, fresh = _wrapper(master, seed=7, level=1, p=nn.Parameter(p.detach().clone()))
    fresh.load_state_dict(torch.load(io.BytesIO(blob.getvalue()), weights_only=True))
    assert set(fresh.state[q]) == set(opt.state[p]) == {"momentum_buffer", "master_lo" if master == "bf16_split"
                                                        else "step"}
    for g in grads[3:]:
        p.grad, q.grad = g, g.clone()
        opt.step()
        fresh.step()
    assert torch.equal(p, q)
    if master == "bf16_split":
        assert torch.equal(opt.state[p]["master_lo"], fresh.state[q]["master_lo"])
