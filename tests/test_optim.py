"""nanochat.optim without FP8: the wrapper (wrapper.py) and its parts, against torch's optimizers.

- wrapper.py: with fp32 masters and the step after the backward, OptimWrapper and FP8Optim at
  level 0 are the wrapped optimizer (AdamW, Adam, SGD with momentum and dampening, nesterov: 20
  steps, torch.equal); a scheduler drives them; level 0 holds 8 bytes a parameter (Adam), 4 (SGD).
- in_backward.py + adam.py: stepped inside the backward, with fp32 moments, the parameters track
  torch.optim.AdamW stepped after it (the same update in another order of fp32 operations) within
  what a few ulps of gradient become through Adam's division by sqrt(v) (argued at the test);
  every gradient is freed.
- saved_state.py: a state saved with FP8 moments (FP8Optim, level 2) loads into an OptimWrapper as the
  fp32 values it stands for (exp_avg dequantized, v = sqrt(v)^2, bit for bit); a moment of another
  shape is refused before anything is loaded; a quantized moment is recognized by its methods
  (FP8Tensor is one, plain tensors and Parameters are not) and `local` keeps it whole.
- backends.py: a compile failure falls back to eager and a native kernel failure to compiled,
  each recorded once, and the counts say how the step ran.
- state_bytes.py: the bytes planned before the first step equal those held after it (torch
  AdamW: 8 a parameter; bf16_split: 8 + 2; FP8Optim level 1 <= 5.05, level 2 <= 2.05, and
  state_bytes_per_param times the parameters), and the quantized formula is 1 + 4/256 a moment.
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
from nanochat.optim.shards import local
from tests.conftest import last_bits, mlp


def _mlp(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return mlp(64, 128, 32, act=torch.nn.Tanh).to(dtype)


def _loss(model: torch.nn.Module, step: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step)).to(dtype)
    return model(x).float().square().mean()


@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd", "nesterov"])
def test_fp32_masters_after_the_backward_is_the_wrapped_optimizer(kind):
    """OptimWrapper, and FP8Optim at level 0, are the optimizer they wrap: 20 steps under a
    scheduler give bit-identical parameters (torch.equal) and the same lr; FP8Optim's state is 8
    bytes a parameter for Adam(W), 4 for SGD's momentum."""
    a, b, c = _mlp(), _mlp(), _mlp()

    def make(params):
        if kind in ("sgd", "nesterov"):
            return torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=0.1,
                                   **({"nesterov": True} if kind == "nesterov" else {"dampening": 0.1}))
        return getattr(torch.optim, {"adamw": "AdamW", "adam": "Adam"}[kind])(params, lr=1e-2, weight_decay=0.1)

    wrapped, plain = OptimWrapper(make(a.parameters())), make(b.parameters())
    level0 = FP8Optim(make(c.parameters()), opt_level=0, compile=False)
    scheds = [torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s) for opt in (wrapped, plain, level0)]
    for step in range(20):
        for model, opt in ((a, wrapped), (b, plain), (c, level0)):
            _loss(model, step).backward()
            opt.step()
            opt.zero_grad()
        for sched in scheds:
            sched.step()
    assert all(torch.equal(p, q) and torch.equal(r, q) for p, q, r in zip(a.parameters(), b.parameters(),
                                                                          c.parameters()))
    lrs = {opt.param_groups[0]["lr"] for opt in (wrapped, plain, level0)}
    assert lrs == {1e-2 * 0.9**20}, lrs
    assert wrapped.step_backends() == {}  # nothing stepped by the wrapper itself
    assert level0.state_bytes_per_param() == (4.0 if kind in ("sgd", "nesterov") else 8.0)


def _adam_gap(ours: dict, ref: dict, dg: torch.Tensor, t: int, lr: float) -> torch.Tensor:
    """How far two AdamW updates (torch's default betas and eps) may differ per element at step t
    when their gradients differed by at most `dg` at every step so far (fp32 rounding of m folded
    in): lr (1 + r) dg / D + lr 2 (t + 5) u r, D = sqrt(v_hat) + eps and r = |m_hat| / D, each
    the larger of the two sides'. The test's docstring argues it."""
    bc1, bc2, u = 1 - 0.9**t, 1 - 0.999**t, torch.finfo(torch.float32).eps
    d = [(s["exp_avg_sq"] / bc2).sqrt() + 1e-8 for s in (ours, ref)]
    r = torch.maximum(ours["exp_avg"].abs() / bc1 / d[0], ref["exp_avg"].abs() / bc1 / d[1])
    return lr * ((1 + r) * dg / torch.maximum(*d) + 2 * (t + 5) * u * r)


@pytest.mark.two_computations
def test_step_in_backward_tracks_adamw_after_the_backward():
    """3 steps at lr 1e-3: adam.py's adam_step (eager) against torch's single-tensor AdamW, the
    same fp32 math in another order, on gradients g_a and g_b = g_a + d that differ by fp32
    rounding (under the perturbation pass the reference starts a last bit away and its gradients
    are moved by one). |d| <= 2^-16 max|g| is asserted (measured <= 4.6 u max|g|, u = 2^-23, over
    40 last_bits seeds), so the bound below cannot absorb a gradient that a wrong step disturbed.
    Adam's update m_hat / D, D = sqrt(v_hat) + eps, is scale-free in g: it moves by what d is
    relative to D, not by ulps of p. Per element, with d_t the largest |d| up to step t, m_hat and
    sqrt(v_hat) (a weighted mean of g, a weighted root-mean-square of g, weights summing to 1)
    each move by at most d_t (the latter by the triangle inequality), so
      |m_a/D_a - m_b/D_b| <= |m_a - m_b| / D_a + (|m_b| / D_b) |D_b - D_a| / D_a <= (1 + r) d_t / D
    with r = |m_hat| / D (~1 here) and D on either side (the larger is taken). An element whose
    gradient cancels to ~1e-6 (d relative ~1e-3) has D ~ |g| and takes a visible step (8.2e-8,
    5 ulps of the largest |p|, with ATen's scalar kernels), one with D >> d hardly moves. fp32
    rounding adds, per side: <= 2 t u max|g| to m_hat (a lerp per step, the bias correction;
    counted in d_t), (t + 5) u r to the update (v's products and sum per step, the sqrt, the
    divisions, the step size), half an ulp of p twice (the decay, the update). The bound: the
    start's gap plus, per step, lr times the above and u max(|p_a|, |p_b|). Measured under
    `make test-numerics`: at most 0.40 of it (0.61 over 40 last_bits seeds). Each of beta1 0.89,
    beta2 0.998, eps 1e-7, weight decay 0.11, no bias correction, the decay after the update
    breaks the bound (by 20x to 1300x), and all but beta2 and the decay break the gradient check."""
    a, b = _mlp(), _mlp()
    with torch.no_grad():
        for p in b.parameters():
            p.copy_(last_bits(p))
    bound = [(p - q).abs() for p, q in zip(a.parameters(), b.parameters())]  # the start's gap
    ours = OptimWrapper(torch.optim.AdamW(a.parameters(), lr=1e-3, weight_decay=0.1), backend="eager")
    handles = ours.step_in_backward()
    seen = {}  # a's gradients as autograd hands them to the step
    for i, p in enumerate(a.parameters()):
        p.register_hook(lambda g, i=i: seen.__setitem__(i, g.clone()))
    ref = torch.optim.AdamW(b.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    u = torch.finfo(torch.float32).eps  # 2^-23: an fp32 ulp of x is at most u * |x|
    dg = [torch.zeros_like(p) for p in b.parameters()]
    g_max = [torch.zeros_like(p) for p in b.parameters()]
    for step in range(3):
        _loss(a, step).backward()  # the step
        assert all(p.grad is None for p in a.parameters())
        norm, held_back = ours.backward_stats().tolist()  # read as a loop logs it: resets
        assert held_back == 0 and norm > 0
        _loss(b, step).backward()
        for p in b.parameters():
            p.grad = last_bits(p.grad)
        ref.step()
        for i, (p, q) in enumerate(zip(a.parameters(), b.parameters())):
            d = (seen[i] - q.grad).abs()
            assert d.max() <= 2**-16 * q.grad.abs().max(), f"{tuple(p.shape)}: gradients {d.max():.3g} apart"
            g_max[i] = torch.maximum(g_max[i], torch.maximum(seen[i].abs(), q.grad.abs()))
            dg[i] = torch.maximum(dg[i], d + 4 * (step + 1) * u * g_max[i])
            bound[i] += _adam_gap(ours.state[p], ref.state[q], dg[i], step + 1, 1e-3)
            bound[i] += u * torch.maximum(p.abs(), q.abs()).detach()
        ref.zero_grad()
    assert len(handles) == 4 and ours.step_backends() == {"eager": (4, 4)}  # one call per parameter
    for p, q, start, limit in zip(a.parameters(), b.parameters(), _mlp().parameters(), bound):
        diff = (p - q).abs()
        worst = (diff / limit).argmax()
        assert (diff <= limit).all(), f"{tuple(p.shape)}: {diff.flatten()[worst]:.3g} > {limit.flatten()[worst]:.3g}"
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

    p = [torch.nn.Parameter(torch.randn(64, 256)) for _ in range(2)]
    for level, bound in ((1, 5.05), (2, 2.05)):  # FP8 m, fp32 v; both FP8 (1 byte and a scale per 256)
        opt = FP8Optim(torch.optim.AdamW(p, lr=1e-3), opt_level=level, compile=False)
        planned = opt.state_bytes()
        sum(q.square().sum() for q in p).backward()
        opt.step()
        opt.zero_grad()
        assert opt.state_bytes() == planned
        assert opt.state_bytes_per_param() <= bound
        assert opt.state_bytes() == round(opt.state_bytes_per_param() * 2 * 64 * 256)
    assert optimizer_bytes(256, quantized=2, block_size=256) == 2 * (256 + 4)
    with pytest.raises(ValueError, match="block_size"):
        optimizer_bytes(256, quantized=1)


def test_optim_imports_nothing_of_fp8():
    code = "import sys, nanochat.optim; print(sorted(m for m in sys.modules if m.startswith('nanochat.fp8')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"
