"""nanochat.optim without FP8: the wrapper (wrapper.py) and its parts, against torch's optimizers.

- wrapper.py: with fp32 masters and the step after the backward, OptimWrapper is the wrapped
  optimizer (AdamW, SGD with momentum: 6 steps, torch.equal); a scheduler drives both.
- in_backward.py + step.py: stepped inside the backward, with fp32 moments, the parameters track
  torch.optim.AdamW stepped after it (the same update in another order of fp32 operations) within
  4 fp32 ulps (argued at the test); every gradient is freed.
- state.py: a state saved with FP8 moments (FP8Optim, level 2) loads into an OptimWrapper as the
  fp32 values it stands for (exp_avg dequantized, v = sqrt(v)^2, bit for bit); a moment of another
  shape is refused before anything is loaded; a quantized moment is recognized by its methods
  (FP8Tensor is one, plain tensors and Parameters are not) and `local` keeps it whole.
- backends.py: a compile failure falls back to eager and a native kernel failure to compiled,
  each recorded once, and the counts say how the step ran.
- state_bytes.py: the bytes planned before the first step equal those held after it (torch
  AdamW: 8 a parameter; bf16_split: 8 + 2), and the quantized formula is 1 + 4/256 a moment.
- nanochat.optim imports nothing of nanochat.fp8 (the layer order).
The master-weight rounding (master.py) is tests/test_master_weights.py's and
tests/test_fp8_optim_master.py's; FP8Optim, the format over this package, tests/test_fp8_optim.py's.

Modules: nanochat.optim.wrapper, nanochat.optim.step, nanochat.optim.in_backward,
nanochat.optim.backends, nanochat.optim.state, nanochat.optim.state_bytes.
"""

import subprocess
import sys

import pytest
import torch

from nanochat.fp8 import FP8Optim, FP8Tensor
from nanochat.optim import OptimWrapper, QuantizedState, dense, optimizer_bytes, optimizer_state_bytes
from nanochat.optim.backends import Backends
from nanochat.optim.state import local
from tests.conftest import last_bits, mlp


def _mlp(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return mlp(64, 128, 32, act=torch.nn.Tanh).to(dtype)


def _loss(model: torch.nn.Module, step: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step)).to(dtype)
    return model(x).float().square().mean()


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_fp32_masters_after_the_backward_is_the_wrapped_optimizer(kind):
    a, b = _mlp(), _mlp()

    def make(params):
        if kind == "sgd":
            return torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=0.1)
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)

    wrapped, plain = OptimWrapper(make(a.parameters())), make(b.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(wrapped, lambda s: 0.5**s)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(plain, lambda s: 0.5**s)
    for step in range(6):
        for model, opt in ((a, wrapped), (b, plain)):
            _loss(model, step).backward()
            opt.step()
            opt.zero_grad()
        sched.step()
        ref_sched.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert wrapped.optimizer.param_groups[0]["lr"] == plain.param_groups[0]["lr"] == 1e-2 * 0.5**6
    assert wrapped.step_backends() == {}  # nothing stepped by the wrapper itself


@pytest.mark.two_computations
def test_step_in_backward_tracks_adamw_after_the_backward():
    """3 steps at lr 1e-3. Both compute the same Adam update in fp32 (step.py's adam_step, eager,
    against torch's single-tensor AdamW); the order of operations differs (step_size * m / denom
    against addcdiv's m / denom * step_size, (1 - beta2) * g * g against addcmul), so an update
    differs by a few fp32 ulps of itself (~1e-10 here) and the parameter's rounding may land one
    ulp away per step: at most 3 ulps of the largest |p|, and one more under the perturbation
    pass (the reference starts and steps a last bit away). Measured: 1 ulp (7.5e-9)."""
    a, b = _mlp(), _mlp()
    with torch.no_grad():
        for p in b.parameters():
            p.copy_(last_bits(p))
    ours = OptimWrapper(torch.optim.AdamW(a.parameters(), lr=1e-3, weight_decay=0.1), backend="eager")
    handles = ours.step_in_backward()
    ref = torch.optim.AdamW(b.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    for step in range(3):
        _loss(a, step).backward()  # the step
        assert all(p.grad is None for p in a.parameters())
        norm, held_back = ours.backward_stats().tolist()  # read as a loop logs it: resets
        assert held_back == 0 and norm > 0
        _loss(b, step).backward()
        for p in b.parameters():
            p.grad = last_bits(p.grad)
        ref.step()
        ref.zero_grad()
    assert len(handles) == 4 and ours.step_backends() == {"eager": (4, 4)}  # one call per parameter
    for p, q, start in zip(a.parameters(), b.parameters(), _mlp().parameters()):
        ulp = torch.finfo(torch.float32).eps * q.abs().max().item()  # an fp32 ulp is at most eps * |x|
        torch.testing.assert_close(p, q, rtol=0, atol=4 * ulp)
        assert (p - start).abs().max() > 1e-4  # 3 steps of ~lr each moved it
    assert all(int(ours.state[p]["step"]) == 3 for p in a.parameters())


def test_fp8_moments_load_as_the_fp32_values_they_stand_for():
    model = _mlp(torch.bfloat16)
    fp8 = FP8Optim(torch.optim.AdamW(model.parameters(), lr=1e-2), opt_level=2, min_numel=256,
                   master_weights="bf16", backend="eager")
    _loss(model, 0, torch.bfloat16).backward()
    fp8.step()
    saved = fp8.state_dict()
    weight = next(model.parameters())  # [128, 64]: FP8 moments
    m, r = saved["state"][0]["exp_avg"], saved["state"][0]["exp_avg_sq_sqrt"]
    assert isinstance(m, FP8Tensor) and isinstance(r, FP8Tensor)

    plain = OptimWrapper(torch.optim.AdamW(model.parameters(), lr=1e-2), master_weights="bf16")
    plain.load_state_dict(saved)
    state = plain.state[weight]
    assert type(state["exp_avg"]) is torch.Tensor and state["exp_avg"].dtype == torch.float32
    assert torch.equal(state["exp_avg"], m.dequantize())
    assert torch.equal(state["exp_avg_sq"], r.dequantize() * r.dequantize()) and "exp_avg_sq_sqrt" not in state

    bad = {**saved, "state": {**saved["state"], 0: {**saved["state"][0], "exp_avg": torch.zeros(3)}}}
    fresh = OptimWrapper(torch.optim.AdamW(_mlp(torch.bfloat16).parameters(), lr=1e-2), master_weights="bf16")
    with pytest.raises(ValueError, match=r"parameter 0 \(param group 0, shape \(128, 64\)\): exp_avg has shape"):
        fresh.load_state_dict(bad)
    assert not fresh.state  # nothing was loaded


def test_a_quantized_state_is_recognized_by_its_methods():
    q = FP8Tensor.from_float(torch.randn(4, 256))
    assert isinstance(q, QuantizedState) and torch.equal(dense(q), q.dequantize())
    assert local(q) is q  # kept whole, not unwrapped to its codes
    plain = torch.randn(3)
    assert not isinstance(plain, QuantizedState) and dense(plain) is plain
    assert not isinstance(torch.nn.Parameter(plain), QuantizedState)


def test_backends_fall_back_once_each_and_count(monkeypatch):
    backends = Backends("Test", "auto")

    def step(xs, *, scale):
        for x in xs:
            x.mul_(scale)

    def broken_compile(fn, **kw):
        def run(*args, **flags):
            raise RuntimeError("no C++ compiler (test)")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    xs = [torch.ones(3), torch.ones(2)]
    backends.run("step", step, xs, scale=2.0)
    backends.run("step", step, xs, scale=2.0)
    assert all(torch.equal(x, torch.full_like(x, 4.0)) for x in xs)  # stepped eagerly, twice
    assert backends.counts == {"eager": (2, 4)} and not backends.compile
    assert len(backends.fallbacks) == 1 and "no C++ compiler (test)" in backends.fallbacks[0]

    def kernel():
        raise RuntimeError("kernel unavailable (test)")

    assert backends.run_native(kernel, 2) is False and not backends.native
    assert len(backends.fallbacks) == 2 and "kernel unavailable (test)" in backends.fallbacks[1]
    backends.reset()
    assert backends.run_native(lambda: None, 5) and backends.counts == {"native": (1, 5)}
    with pytest.raises(ValueError, match="backend must be auto, native, compile or eager"):
        Backends("Test", "fast")


def test_planned_bytes_equal_the_bytes_held_after_the_first_step():
    model = _mlp()
    n = sum(p.numel() for p in model.parameters())
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = optimizer_state_bytes(adamw)
    _loss(model, 0).backward()
    adamw.step()
    assert before == optimizer_state_bytes(adamw) == 8 * n

    split = _mlp(torch.bfloat16)
    wrapper = OptimWrapper(torch.optim.AdamW(split.parameters(), lr=1e-2), master_weights="bf16_split")
    before = wrapper.state_bytes()
    _loss(split, 0, torch.bfloat16).backward()
    wrapper.step()
    assert before == wrapper.state_bytes() == (8 + 2) * n  # fp32 moments and the 16-bit remainders
    assert optimizer_bytes(256, quantized=2, block_size=256) == 2 * (256 + 4)
    with pytest.raises(ValueError, match="block_size"):
        optimizer_bytes(256, quantized=1)


def test_optim_imports_nothing_of_fp8():
    code = "import sys, nanochat.optim; print(sorted(m for m in sys.modules if m.startswith('nanochat.fp8')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"
