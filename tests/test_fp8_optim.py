"""FP8Optim (nanochat.optim) against the torch optimizer it wraps.

- Level 0 is the wrapped optimizer: tests/test_optim.py's (with OptimWrapper, bit for bit).
- Levels 1 and 2, first step from zero state: the fused step's math equals torch's up to fp32
  rounding, 2 ulp of the parameter (the quantized state only enters from the second step on).
- Levels 1 and 2 track fp32 AdamW: on a quadratic (curvatures 0.1..10, lr decayed to 0) the
  parameters end within 5% (relative L2) of AdamW's and the loss within 0.1% of the start; and a tiny nanochat GPT trained 40 steps on stdlib bytes ends within 2% of AdamW's loss.
- One block of gradients spanning 1e-8..1e2: every per-step update stays <= 1.25 * lr, as fp32
  AdamW's does (the sqrt(v) floor; without it elements whose v flushes move by ~10 * lr).
- Compiled step (torch.compile) and the native CPU kernel: equal to the eager step (fp32
  rounding; codes on a rounding tie may differ by one step), changing lr every step does not
  recompile, and splitting blocks across threads changes nothing (torch.equal).
- The C kernel's portable, AVX2 and AVX-512 variants agree (fp32 rounding); its build cache is
  keyed on the CPU; it runs on torch's OpenMP runtime (no second one loaded);
  NANOCHAT_NATIVE_OPTIM=0 turns it off as a recorded fallback.
- Multi-tensor: the compile backend makes one compiled call per parameter shape a step (6
  tensors, 2 shapes: 2 calls) and matches the eager step; no step reads a value into Python or
  copies across devices (a dispatch mode counts aten._local_scalar_dense and such copies: 0);
  on CUDA (marked gpu) the same under torch.cuda.set_sync_debug_mode("error").
- Schedulers (LambdaLR, StepLR) and manual `param_groups[i]["lr"]` drive the wrapped optimizer.
- state_dict -> load_state_dict is bit-exact and loads with torch.load(weights_only=True); level
  2 <-> level 0 and plain AdamW -> level 2 convert within e4m3's 2^-4 relative error; a state
  converted from fp32 moments and the state the step writes for the same moments hold the same
  codes and scales (torch.equal: one quantizer).
- Unsupported optimizers and options raise errors listing what is supported.
- Loaded state: one state of a saved level-2 run replaced by one of another size, block count,
  dtype or layout (read back with weights_only=True) is refused by load_state_dict with a
  ValueError naming the parameter, and the optimizer is unchanged (its next step equals an
  untouched twin's, bit for bit). The C entry point, called in a subprocess, refuses every
  buffer smaller than its blocks need with a code naming it, touching nothing (exit status 0, no
  signal); a library built for another ABI is refused naming the file, and the step falls back
  (recorded). A native fallback inside step_in_backward keeps the guard: the parameters with a
  NaN gradient, their moments and step counts stay as they were.

Modules: nanochat.optim.wrapper (FP8Optim), nanochat.optim.moments.fp8 (E4M3Blocks),
nanochat.optim.adam with adam_kernel.c (the native CPU kernel, against the compiled step), and
nanochat.optim.backends (the kernel's build and the fallbacks).
"""

from __future__ import annotations

import io
import math
import pathlib

import pytest
import torch

from nanochat.device import DeviceReads
from nanochat.optim import FP8Optim, FP8Tensor, adam, backends
from nanochat.optim.adam import adam_step
from nanochat.optim.backends import host_scalar
from nanochat.optim.moments import C_CODEC
from tests.conftest import assert_close_but_few, last_bits, load_script

# Two implementations of the FP8-moment step (eager, compiled, the C kernel) compute the same
# formulas in another order, so their parameters agree to fp32 rounding (ROUNDING_ATOL, 8 ulp of
# the unit-scale parameters) - except where a last-bit difference lands a moment's FP8 code one
# step away (a value within a few ulp of an e4m3 rounding boundary: ~2^-23 / 2^-4 = 2^-19 of the
# codes per step, or on an exact tie). That element's m or sqrt(v) then moves by one quantum
# (<= 2^-3 relative), its update by <= ~0.3 of itself, and Adam's update is at most ~3 lr
# ((1 - b1) / sqrt(1 - b2) with the default betas): below lr per step, so below the sum of the
# step sizes in all. FLIP_FRACTION leaves a wide margin over 2^-19 per code per step.
ROUNDING_ATOL = 1e-6
FLIP_FRACTION = 1e-3


def assert_same_step(actual: torch.Tensor, expected: torch.Tensor, lrs: list[float], msg: str = "") -> None:
    """Parameters of two FP8-moment step implementations after steps of sizes `lrs` (see above)."""
    assert_close_but_few(actual, expected, atol=ROUNDING_ATOL, rtol=1e-6, bound=sum(lrs),
                         fraction=FLIP_FRACTION, msg=msg)


def _params(seed=0, shapes=((64, 128), (10,))):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


def _make(kind, params, **kw):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **kw)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2, weight_decay=0.1, **kw)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.1, **kw)
    if kind == "nesterov":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=0.1, nesterov=True, **kw)
    raise AssertionError(kind)


def _run(opt, params, steps, seed=1, perturb=()):
    """`steps` steps on seeded Gaussian gradients. `perturb`: the positions of the parameters whose
    gradients the perturbation pass moves by a last bit, on the side of a comparison that computes
    differently (tests/conftest.py)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=g)
            p.grad = last_bits(p.grad) if i in perturb else p.grad
        opt.step()


KINDS = ["adamw", "adam", "sgd", "nesterov"]


@pytest.mark.two_computations
@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_first_step_math_equals_torch(kind, level):
    ref_p, p = _params(), _params()
    ref = _make(kind, ref_p)
    opt = FP8Optim(_make(kind, p), opt_level=level, min_numel=256, compile=False)
    _run(ref, ref_p, 1)
    _run(opt, p, 1, perturb=(0,))
    assert isinstance(next(iter(opt.state[p[0]].values())) if kind in ("sgd", "nesterov")
                      else opt.state[p[0]]["exp_avg"], FP8Tensor)
    # same math, different operation order: parameters agree to fp32 rounding (2 ulp); Adam's first
    # step is lr * g / (|g| + eps), so a last-bit change of g does not grow
    ulp = torch.finfo(torch.float32).eps
    assert ((p[0] - ref_p[0]).abs() <= 2 * ulp * ref_p[0].abs().clamp(min=1)).all()
    assert torch.equal(ref_p[1], p[1])  # the small tensor stays fp32, stepped by torch itself


def assert_tracks_adamw_on_a_quadratic(level: int, device: str = "cpu", **fp8optim_kwargs) -> None:
    """f(x) = sum c_i (x_i - t_i)^2, curvatures 0.1..10 shuffled across blocks, lr decayed to 0:
    FP8Optim at `level` ends within 5% (trajectory distance) and 1e-3 of the start loss of fp32
    AdamW (measured on CPU: 2-3% and 1e-4). Shared with the CUDA twin in tests/test_gpu.py."""
    n = 8192
    c = torch.logspace(-1, 1, n)[torch.randperm(n, generator=torch.Generator().manual_seed(0))].to(device)
    t = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(device)

    def train(wrap, steps=200):
        x = torch.nn.Parameter(torch.zeros(n, device=device))
        opt = torch.optim.AdamW([x], lr=3e-2, betas=(0.9, 0.95), weight_decay=0.0)
        opt = FP8Optim(opt, opt_level=wrap, **fp8optim_kwargs) if wrap is not None else opt
        for i in range(steps):
            opt.param_groups[0]["lr"] = 3e-2 * (1 - i / steps)
            loss = (c * (x - t) ** 2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return x.detach(), (c * (x.detach() - t) ** 2).sum().item()

    (x_ref, ref), (x, got) = train(None), train(level)
    start = (c * t**2).sum().item()
    assert ref < 1e-2 * start  # the reference converges, so the comparison means something
    assert (x - x_ref).norm() <= 0.05 * x_ref.norm()
    assert abs(got - ref) <= 1e-3 * start


@pytest.mark.parametrize("level", [1, 2])
def test_quadratic_tracks_adamw(level):
    assert_tracks_adamw_on_a_quadratic(level, compile=False)


def _tiny_gpt_losses(level, steps=40):
    from nanochat.model.gpt import GPT, GPTConfig

    data = pathlib.Path(torch.__file__).read_bytes()[:40_000]
    tokens = torch.tensor(list(data), dtype=torch.long)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=32, n_layer=1, n_head=2, n_kv_head=2, n_embd=64))
    model.init_weights()
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=False)
    if level is not None:
        opt = FP8Optim(opt, opt_level=level, compile=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(0, len(tokens) - 33, (8,), generator=g)
        x = torch.stack([tokens[i:i + 32] for i in idx])
        y = torch.stack([tokens[i + 1:i + 33] for i in idx])
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    with torch.no_grad():
        x = tokens[30_000:30_000 + 32 * 64].view(64, 32)
        y = tokens[30_001:30_001 + 32 * 64].view(64, 32)
        return model(x, y).item(), opt


@pytest.mark.parametrize("level", [1, 2])
def test_tiny_gpt_tracks_adamw(level):
    ref, _ = _tiny_gpt_losses(None)
    got, opt = _tiny_gpt_losses(level)
    assert ref < math.log(256) - 0.5  # it learned something
    assert abs(got - ref) / ref <= 0.02
    assert "FP8Optim(AdamW" in opt.summary()


def test_extreme_gradients_in_one_block_do_not_blow_up():
    n = 4096
    mags = torch.logspace(-8, 2, n)  # 1e-8..1e2: 16 blocks, each spanning ~0.6 decades... and:
    mags = mags.view(16, 256).t().reshape(-1)  # ...interleaved so every block spans 1e-8..1e2
    signs = torch.where(torch.arange(n) % 3 == 0, -1.0, 1.0)
    lr = 1e-3

    def max_update(level):
        x = torch.nn.Parameter(torch.zeros(n))
        opt = torch.optim.AdamW([x], lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
        opt = FP8Optim(opt, opt_level=level, compile=False) if level is not None else opt
        worst = 0.0
        for step in range(100):
            prev = x.detach().clone()
            # constant gradients for 50 steps, then they shrink 100x (v must decay, m follows)
            x.grad = signs * mags * (1.0 if step < 50 else 0.01)
            opt.step()
            worst = max(worst, (x.detach() - prev).abs().max().item())
        return worst

    ref = max_update(None)
    got = max_update(2)
    assert ref <= 1.01 * lr
    assert got <= 1.25 * lr, f"FP8 update {got / lr:.2f} * lr (fp32 AdamW: {ref / lr:.2f} * lr)"


@pytest.mark.two_computations
def test_compiled_step_equals_eager_and_lr_changes_do_not_recompile():
    from torch._dynamo.utils import counters

    p_eager, p_comp = _params(shapes=((16, 256),)), _params(shapes=((16, 256),))
    eager = FP8Optim(torch.optim.AdamW(p_eager, lr=1e-2), opt_level=2, compile=False)
    comp = FP8Optim(torch.optim.AdamW(p_comp, lr=1e-2), opt_level=2, backend="compile")
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        grad = torch.randn(16, 256, generator=g)
        for opt, p in ((eager, p_eager), (comp, p_comp)):
            opt.param_groups[0]["lr"] = 1e-2 / (step + 1)  # a schedule
            p[0].grad = last_bits(grad) if opt is comp else grad.clone()
            opt.step()
    assert comp.backends.compile, "the compiled path fell back to eager"
    assert counters["stats"]["unique_graphs"] == 1
    assert_same_step(p_comp[0], p_eager[0], [1e-2 / (step + 1) for step in range(4)])
    for key in ("exp_avg", "exp_avg_sq_sqrt"):  # one e4m3 quantum apart at most (2^-3 relative)
        a, b = comp.state[p_comp[0]][key], eager.state[p_eager[0]][key]
        assert torch.allclose(a.dequantize(), b.dequantize(), rtol=2.0**-3, atol=1e-9)


@pytest.mark.two_computations
@pytest.mark.parametrize("kind", ["adamw", "adam"])
@pytest.mark.parametrize("level", [1, 2])
def test_native_cpu_kernel_equals_eager(kind, level):
    shapes = ((64, 256),)  # 64 blocks: one thread; the split across threads is checked below
    p_eager, p_nat = _params(shapes=shapes), _params(shapes=shapes)
    eager = FP8Optim(_make(kind, p_eager), opt_level=level, compile=False)
    native = FP8Optim(_make(kind, p_nat), opt_level=level, backend="native")
    _run(eager, p_eager, 5)
    _run(native, p_nat, 5, perturb=(0,))
    assert native.backends.native, "the native kernel did not build (see the logged warning)"
    # same formulas; the C compiler contracts a*b+c into FMAs: fp32 rounding, and a code sitting on
    # a rounding boundary may land one step away (assert_same_step)
    assert_same_step(p_nat[0], p_eager[0], [1e-2] * 5)
    for key, value in eager.state[p_eager[0]].items():
        if key != "step":
            a, b = native.state[p_nat[0]][key], value
            if isinstance(a, FP8Tensor):
                assert (a.codes.view(torch.uint8) != b.codes.view(torch.uint8)).float().mean() < 1e-3
                assert torch.allclose(a.scale, b.scale, rtol=1e-5)
            else:
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-9)


def test_native_kernel_threads_split_blocks():
    shapes = ((1024, 256),)  # 1024 blocks: split across 2 threads
    p1, p2 = _params(shapes=shapes), _params(shapes=shapes)
    one = FP8Optim(torch.optim.AdamW(p1, lr=1e-2), opt_level=2, backend="native")
    two = FP8Optim(torch.optim.AdamW(p2, lr=1e-2), opt_level=2, backend="native")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _run(one, p1, 3)
        torch.set_num_threads(2)
        _run(two, p2, 3)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(p1[0], p2[0])  # blocks are independent: the split changes nothing


@pytest.mark.two_computations
def test_kernel_isa_variants_agree(tmp_path):
    """The C source's portable decode/encode (CPUs without F16C/AVX2, e.g. ARM) against its
    AVX2+F16C and AVX-512 versions, each built where this CPU runs it (-march=x86-64-v3 needs
    AVX2, -march=native is whatever this CPU has): the same step within fp32 rounding (FMA
    contraction differs). The encoders are also equal bit for bit on every float (checked
    exhaustively by a C harness when they were written)."""
    import ctypes
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    libs = []
    builds = [("portable", "-march=x86-64"), ("native", "-march=native")]
    if torch.backends.cpu.get_cpu_capability() == "AVX512":  # native is the AVX-512 version here
        builds.insert(1, ("avx2", "-march=x86-64-v3"))
    for name, arch in builds:
        so = tmp_path / f"{name}.so"
        r = subprocess.run([cc, "-O3", arch, "-fopenmp-simd", "-fno-trapping-math", "-fno-math-errno", "-shared",
                            "-fPIC", f"-I{C_CODEC.parent}", "-o", str(so), str(adam.KERNEL_SOURCE), "-lm"],
                           capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot build with {arch}: {r.stderr[-200:]}")
        libs.append(adam.bind(ctypes.CDLL(str(so)), so))
    n, B = 64, 256
    g = torch.Generator().manual_seed(0)
    start = dict(p=torch.randn(n, B, generator=g), grad=torch.randn(n, B, generator=g) * 1e-2,
                 mc=torch.randint(0, 255, (n, B), dtype=torch.uint8, generator=g),
                 vc=torch.randint(0, 127, (n, B), dtype=torch.uint8, generator=g),
                 ms=torch.rand(n, generator=g) * 1e-3, vs=torch.rand(n, generator=g) * 1e-3)
    start["mc"][(start["mc"] & 0x7F) == 0x7F] = 0  # 0x7F / 0xFF are NaN in e4m3fn
    h = torch.tensor([[1e-3, 0.9, 0.999, 1e-8, 0.01, 1e-3, 0.03, 0.1, 0.001, 1 - 1e-5, 1.0]])  # TABLE_COLUMNS
    outs = []
    for i, lib in enumerate(libs):
        t = {k: v.clone() for k, v in start.items()}
        t["grad"] = last_bits(t["grad"]) if i else t["grad"]
        for _ in range(3):
            adam.adam([(t["p"], t["grad"], t["mc"], t["ms"], None, t["vc"], t["vs"])], h, B, True, True, lib=lib)
        outs.append(t)
    a = outs[0]
    assert not torch.equal(a["p"], start["p"])  # the step moved the weights
    for b in outs[1:]:
        assert_same_step(b["p"], a["p"], [1e-3] * 3)
        assert torch.allclose(a["ms"], b["ms"], rtol=1e-5) and torch.allclose(a["vs"], b["vs"], rtol=1e-5)
        for key in ("mc", "vc"):  # a code on a rounding tie may land one step away
            assert (a[key] != b[key]).float().mean() < 1e-3


def test_schedulers_drive_the_wrapped_lr():
    p = _params()
    inner = torch.optim.AdamW(p, lr=1.0)
    opt = FP8Optim(inner, opt_level=2, min_numel=256, compile=False)
    assert opt.param_groups is inner.param_groups
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    for step in range(3):
        assert inner.param_groups[0]["lr"] == 0.5**step
        _run(opt, p, 1)
        sched.step()
    step_sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.0)
    step_sched.step()  # lr -> 0: FP8 and fp32 params must not move
    before = [x.detach().clone() for x in p]
    _run(opt, p, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, p))


def test_trainer_usage_manual_lr_and_zero_grad():
    from nanochat.model.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=16, n_layer=1, n_head=2, n_kv_head=2, n_embd=64))
    model.init_weights()
    for level in (0, 1, 2):
        opt = FP8Optim(torch.optim.AdamW(model.param_groups(0.1), lr=1e-3, betas=(0.9, 0.95),
                                         weight_decay=0.1, fused=False), opt_level=level, compile=False)
        x = torch.randint(0, 256, (2, 16))
        for lr in (1e-3, 0.0):
            for group in opt.param_groups:
                group["lr"] = lr
            before = [q.detach().clone() for q in model.parameters()]
            model(x, x).backward()
            opt.step()
            opt.zero_grad()
            moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
            assert moved == (lr > 0)
            assert all(q.grad is None for q in model.parameters())
        sd = opt.state_dict()
        opt.load_state_dict(sd)


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _bits(x):
    return (x.codes.view(torch.uint8), x.scale) if isinstance(x, FP8Tensor) else (x,)


def test_a_converted_state_equals_the_stepped_one_bit_for_bit():
    """One quantizer: for the same fp32 moments, the state FP8Optim's (eager) step writes and the
    state load_state_dict converts from a plain AdamW state hold identical codes and scales. The
    fp32 twin runs the same adam_step from the values the FP8 state holds, so both sides quantize
    the same fp32 numbers; gradients span 1e-6..1e2 across blocks so the scales vary."""
    shape, g = (64, 256), torch.Generator().manual_seed(3)
    w = torch.nn.Parameter(torch.randn(shape, generator=g))
    stepped = FP8Optim(torch.optim.AdamW([w], lr=1e-2, weight_decay=0.1), opt_level=2, backend="eager")
    hypers = [host_scalar(x) for x in (1e-2, 0.9, 0.999, 1e-8, 0.1)]
    twin_p, step = w.detach().clone(), torch.zeros(())
    for _ in range(3):
        w.grad = torch.randn(shape, generator=g) * 10.0 ** torch.randint(-6, 3, (shape[0], 1), generator=g)
        state = stepped.state.get(w)
        m = state["exp_avg"].dequantize() if state else torch.zeros(shape)
        v = state["exp_avg_sq_sqrt"].dequantize() ** 2 if state else torch.zeros(shape)
        step += 1
        adam_step(twin_p, w.grad, (m,), (v,), None, step, *hypers, None, None, decoupled=True, master="fp32")
        stepped.step()
        plain = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(shape))], lr=1e-2)
        sd = plain.state_dict()
        sd["state"] = {0: {"step": step.clone(), "exp_avg": m, "exp_avg_sq": v}}
        converted = FP8Optim(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(shape))], lr=1e-2), opt_level=2)
        converted.load_state_dict(sd)
        ours, theirs = stepped.state[w], next(iter(converted.state.values()))
        for key in ("exp_avg", "exp_avg_sq_sqrt"):
            assert torch.equal(ours[key].codes.view(torch.uint8), theirs[key].codes.view(torch.uint8)), key
            assert torch.equal(ours[key].scale, theirs[key].scale), key


def test_state_dict_roundtrip_bit_exact_weights_only():
    p = _params()
    opt = FP8Optim(torch.optim.AdamW(p, lr=1e-2), opt_level=2, min_numel=256, compile=False)
    _run(opt, p, 3)
    sd = _roundtrip(opt.state_dict())
    p2 = [torch.nn.Parameter(x.detach().clone()) for x in p]
    opt2 = FP8Optim(torch.optim.AdamW(p2, lr=0.5), opt_level=2, min_numel=256, compile=False)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == 1e-2
    for a, b in zip(p, p2):
        for key, value in opt.state[a].items():
            assert all(torch.equal(x, y) for x, y in zip(_bits(value), _bits(opt2.state[b][key])))
    _run(opt, p, 2, seed=7)
    _run(opt2, p2, 2, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(p, p2))  # resumed training is identical
    meta = torch.load(io.BytesIO(_save_bytes(opt.state_dict())), weights_only=True, map_location="meta")
    assert meta["state"][0]["exp_avg"].device.type == "meta"


def _save_bytes(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_cross_level_and_plain_adamw_loading():
    p = _params()
    plain = torch.optim.AdamW(p, lr=1e-2)
    _run(plain, p, 3)
    m_ref = plain.state[p[0]]["exp_avg"].clone()
    v_ref = plain.state[p[0]]["exp_avg_sq"].clone()

    lvl2 = FP8Optim(torch.optim.AdamW(p, lr=1e-2), opt_level=2, min_numel=256, compile=False)
    lvl2.load_state_dict(_roundtrip(plain.state_dict()))
    st = lvl2.state[p[0]]
    assert isinstance(st["exp_avg"], FP8Tensor) and isinstance(st["exp_avg_sq_sqrt"], FP8Tensor)
    assert "exp_avg_sq" not in st
    assert torch.allclose(st["exp_avg"].dequantize(), m_ref, rtol=2.0**-4, atol=1e-3 * m_ref.abs().max().item())
    r = st["exp_avg_sq_sqrt"].dequantize()
    assert torch.allclose(r * r, v_ref, rtol=2 * 2.0**-4 + 2.0**-8, atol=1e-3 * v_ref.max().item())
    assert torch.equal(lvl2.state[p[1]]["exp_avg"], plain.state[p[1]]["exp_avg"])  # small: fp32

    lvl0 = FP8Optim(torch.optim.AdamW(p, lr=1e-2), opt_level=0, compile=False)
    lvl0.load_state_dict(_roundtrip(lvl2.state_dict()))
    st0 = lvl0.state[p[0]]
    assert type(st0["exp_avg"]) is torch.Tensor and type(st0["exp_avg_sq"]) is torch.Tensor
    assert torch.equal(st0["exp_avg"], st["exp_avg"].dequantize())
    assert torch.equal(st0["exp_avg_sq"], r * r)

    back = FP8Optim(torch.optim.AdamW(p, lr=1e-2), opt_level=2, min_numel=256, compile=False)
    back.load_state_dict(lvl0.state_dict())
    assert torch.equal(back.state[p[0]]["exp_avg"].dequantize(), st["exp_avg"].dequantize())
    _run(back, p, 1)  # and it steps

    sgd_p = _params()
    sgd = FP8Optim(_make("sgd", sgd_p), opt_level=1, min_numel=256, compile=False)
    _run(sgd, sgd_p, 2)
    sgd0 = FP8Optim(_make("sgd", sgd_p), opt_level=0, compile=False)
    sgd0.load_state_dict(sgd.state_dict())
    assert type(sgd0.state[sgd_p[0]]["momentum_buffer"]) is torch.Tensor


def test_unsupported_optimizers_and_options_are_refused():
    p = _params()
    with pytest.raises(TypeError, match="AdamW, torch.optim.Adam, torch.optim.SGD"):
        FP8Optim(torch.optim.RMSprop(p))
    with pytest.raises(ValueError, match="amsgrad=True"):
        FP8Optim(torch.optim.AdamW(p, amsgrad=True))
    with pytest.raises(ValueError, match="maximize=True"):
        FP8Optim(torch.optim.SGD(p, lr=0.1, momentum=0.9, maximize=True))
    with pytest.raises(ValueError, match="complex"):
        FP8Optim(torch.optim.Adam([torch.nn.Parameter(torch.zeros(4, dtype=torch.complex64))]))
    with pytest.raises(ValueError, match="opt_level"):
        FP8Optim(torch.optim.AdamW(p), opt_level=3)


def test_summary_logged_once(nanochat_log):
    p = _params(shapes=((64, 128), (10,), (5, 1000)))
    opt = FP8Optim(torch.optim.AdamW(p, lr=1e-3), opt_level=2, compile=False)
    _run(opt, p, 2)
    msgs = [r.getMessage() for r in nanochat_log.records if "FP8Optim(AdamW" in r.getMessage()]
    assert len(msgs) == 1
    assert "1 tensors / 8,192 params with FP8 state" in msgs[0]
    assert "numel < 4096" in msgs[0] and "numel % 256 != 0" in msgs[0]
    assert opt.fp32_states() == {"numel < 4096": (1, 10), "numel % 256 != 0": (1, 5000)}


def test_bench_optim_quick_dry_run(tmp_path):
    import json

    bench = load_script("bench_optim", "bench")
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    level2 = result["speed"]["wall"]["results"]["FP8Optim level 2"]
    assert abs(level2["bytes_per_param"] - 2 * (1 + 4 / 256)) < 1e-9
    assert set(result["train"]) == {"AdamW", "FP8Optim level 1", "FP8Optim level 2"}
    assert "extreme b2=0.999 sqrt(v) e4m3 + floor (ours)" in result["study"]
    muon = result["muon"]["results"]  # 64^2 matrices: FP8 momentum, 1 byte + a 4-byte scale per 256
    assert muon["torch.optim.Muon"]["bytes_per_param"] == 4.0
    assert abs(muon["FP8Optim(Muon) level 1, NS fp32"]["bytes_per_param"] - (1 + 4 / 256)) < 1e-9


@pytest.mark.two_computations
def test_kernel_fallback_is_recorded(monkeypatch):
    """Without the native kernel (no C compiler), the step falls back to torch.compile/eager,
    still matches the reference, and the fallback is recorded with its reason (TrainResult)."""
    monkeypatch.setattr(adam, "load_kernel", lambda: (_ for _ in ()).throw(RuntimeError("no C compiler (test)")))
    p = _params(shapes=((64, 128),))
    ref = [torch.nn.Parameter(x.detach().clone()) for x in p]
    opt = FP8Optim(torch.optim.AdamW(p, lr=1e-3), opt_level=2)  # CPU fp32 AdamW: native is tried first
    ref_opt = FP8Optim(torch.optim.AdamW(ref, lr=1e-3), opt_level=2, backend="eager")
    _run(opt, p, 2, perturb=(0,))
    _run(ref_opt, ref, 2)
    assert len(opt.fallbacks) == 1
    assert "native CPU kernel is unavailable" in opt.fallbacks[0] and "no C compiler (test)" in opt.fallbacks[0]
    for a, b in zip(p, ref):  # the compiled fallback computes what the eager reference does
        assert_same_step(a, b, [1e-3] * 2)


def _many_params(seed=0):
    """Six FP8-state matrices of two shapes in two param groups, and a small fp32-state bias."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(16, 256)] * 4 + [(32, 256)], [(16, 256), (10,)]
    return [[torch.nn.Parameter(torch.randn(*s, generator=g)) for s in group] for group in shapes]


def _grouped(kind, groups):
    decay, no_decay = groups
    if kind == "sgd":
        return torch.optim.SGD([dict(params=decay), dict(params=no_decay, weight_decay=0.0)], lr=1e-2,
                               momentum=0.9, weight_decay=0.1)
    return torch.optim.AdamW([dict(params=decay), dict(params=no_decay, weight_decay=0.0)], lr=1e-2,
                             weight_decay=0.1, fused=True)


@pytest.mark.two_computations
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_compiled_step_is_one_call_per_shape(kind, monkeypatch):
    """The compile backend steps the 6 FP8-state tensors (2 shapes, 2 param groups) in 2 compiled
    calls a step, not 6, and computes what the eager step does (assert_same_step; SGD's momentum
    step is at most lr x the gradient, ~4 lr here, so its bound is 4x)."""
    calls = []
    real_compile = torch.compile

    def counting_compile(fn, **kw):
        compiled = real_compile(fn, **kw)

        def counted(*args, **kwargs):
            calls.append(fn.__name__)
            return compiled(*args, **kwargs)
        return counted

    monkeypatch.setattr(torch, "compile", counting_compile)
    comp_groups, eager_groups = _many_params(), _many_params()
    comp = FP8Optim(_grouped(kind, comp_groups), opt_level=2, backend="compile")
    eager = FP8Optim(_grouped(kind, eager_groups), opt_level=2, backend="eager")
    per_step = []
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in sum(comp_groups, [])]
        for opt, groups in ((comp, comp_groups), (eager, eager_groups)):
            for group in opt.param_groups:
                group["lr"] = 1e-2 / (step + 1)
            for p, grad in zip(sum(groups, []), grads):
                p.grad = last_bits(grad) if opt is comp else grad.clone()
        calls.clear()
        comp.step()
        per_step.append(len(calls))
        eager.step()
    assert comp.backends.compile and not comp.fallbacks
    assert per_step == [2, 2, 2]
    assert comp.step_backends() == {"compile": (2, 6)}
    lrs = [1e-2 / (step + 1) * (4 if kind == "sgd" else 1) for step in range(3)]
    for a, b in zip(sum(comp_groups, []), sum(eager_groups, [])):
        assert_same_step(a, b, lrs)


@pytest.mark.parametrize("backend,level", [("native", 1), ("native", 2), ("eager", 2), ("compile", 2)])
def test_step_reads_no_values_from_the_device(backend, level, monkeypatch):
    """Steady-state steps (after the first, which allocates state and compiles): no value read
    into Python and no cross-device copy, for the FP8 tensors and the fp32 one stepped by fused
    AdamW. Reference: the old step read each parameter's step count with float().

    Dynamo does not trace under a dispatch mode, so the compiled calls run with the mode
    suspended: what they run cannot read a value either (fullgraph=True refuses the graph break
    an .item() makes), and everything around them is counted."""
    from torch.utils._python_dispatch import _disable_current_modes

    real_compile = torch.compile

    def compile_outside_the_mode(fn, **kw):
        compiled = real_compile(fn, **kw)

        def run(*args, **kwargs):
            with _disable_current_modes():
                return compiled(*args, **kwargs)
        return run

    monkeypatch.setattr(torch, "compile", compile_outside_the_mode)
    groups = _many_params()
    opt = FP8Optim(_grouped("adamw", groups), opt_level=level, backend=backend)
    params = sum(groups, [])
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        if step == 0:
            opt.step()
            continue
        opt.param_groups[0]["lr"] = 1e-2 / (step + 1)
        with DeviceReads(also_to_device=True) as mode:
            opt.step()
        assert mode.reads == [], mode.reads
    assert not opt.fallbacks
    assert all(opt.state[p]["step"].item() == 4 for p in params)


@pytest.mark.two_computations
def test_native_kernel_can_be_turned_off(monkeypatch):
    """NANOCHAT_NATIVE_OPTIM=0: the default backend skips the C kernel, records why, and the
    compiled step computes what the eager one does."""
    monkeypatch.setenv("NANOCHAT_NATIVE_OPTIM", "0")
    p = _params(shapes=((64, 128),))
    ref = [torch.nn.Parameter(x.detach().clone()) for x in p]
    opt = FP8Optim(torch.optim.AdamW(p, lr=1e-3), opt_level=2)
    ref_opt = FP8Optim(torch.optim.AdamW(ref, lr=1e-3), opt_level=2, backend="eager")
    _run(opt, p, 2, perturb=(0,))
    _run(ref_opt, ref, 2)
    assert len(opt.fallbacks) == 1 and "NANOCHAT_NATIVE_OPTIM=0" in opt.fallbacks[0]
    assert not opt.backends.native and opt.backends.compile
    assert_same_step(p[0], ref[0], [1e-3] * 2)


def test_kernel_cache_is_keyed_on_the_cpu(tmp_path, monkeypatch):
    """A cache directory shared by two machines: a CPU with other features gets its own build
    (the kernel is compiled with -march=native), the same CPU reuses its own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    builds = []
    for cpu in ("flags : sse2 avx2 f16c", "flags : sse2 avx2 f16c avx512f", "flags : sse2 avx2 f16c"):
        monkeypatch.setattr(backends, "_native", {})
        monkeypatch.setattr(backends, "_cpu_identity", lambda cpu=cpu: cpu)
        try:
            adam.load_kernel()
        except RuntimeError as e:
            pytest.skip(f"the kernel does not build here: {e}")
        builds.append(sorted(p.name for p in (tmp_path / "nanochat").glob("*.so")))
    assert len(builds[0]) == 1 and len(builds[1]) == 2 and builds[2] == builds[1]


@pytest.mark.gpu
@pytest.mark.parametrize("level", [1, 2])
def test_cuda_step_is_compiled_per_shape_and_never_syncs(level):
    """On CUDA the default backend is the compiled multi-tensor step: 6 FP8-state tensors of two
    shapes in 2 compiled calls a step; steady-state steps run under
    torch.cuda.set_sync_debug_mode("error"), which raises on any host-device synchronization
    (a blocking copy, .item()); parameters equal the eager step's on the same GPU within fp32
    rounding, up to a few codes one step away (assert_same_step)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")

    def on_cuda(groups):
        return [[torch.nn.Parameter(p.detach().cuda()) for p in group] for group in groups]

    comp_groups, eager_groups = on_cuda(_many_params()), on_cuda(_many_params())
    comp = FP8Optim(_grouped("adamw", comp_groups), opt_level=level)
    eager = FP8Optim(_grouped("adamw", eager_groups), opt_level=level, backend="eager")
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        grads = [torch.randn(p.shape, generator=g).cuda() for p in sum(comp_groups, [])]
        for opt, groups in ((comp, comp_groups), (eager, eager_groups)):
            for group in opt.param_groups:
                group["lr"] = 1e-2 / (step + 1)
            for p, grad in zip(sum(groups, []), grads):
                p.grad = grad.clone()
        torch.cuda.synchronize()
        if step > 0:  # the first step allocates state and compiles
            torch.cuda.set_sync_debug_mode("error")
        try:
            comp.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        eager.step()
    assert not comp.fallbacks
    assert comp.step_backends() == {"compile": (2, 6)}
    for a, b in zip(sum(comp_groups, []), sum(eager_groups, [])):
        assert_same_step(a.cpu(), b.cpu(), [1e-2 / (step + 1) for step in range(4)])


def test_kernel_threads_are_torchs_own():
    """Where torch's intra-op threads are OpenMP, the kernel is built with OpenMP and runs on
    torch's pool: one OpenMP runtime in the process (two would each start their own threads and
    oversubscribe the cores)."""
    if "OpenMP" not in torch.__config__.parallel_info() or not pathlib.Path("/proc/self/maps").exists():
        pytest.skip("torch without OpenMP, or no /proc to list the loaded libraries")
    try:
        lib = adam.load_kernel()
    except RuntimeError as e:
        pytest.skip(f"the kernel does not build here: {e}")
    assert hasattr(lib, "adam_parallel")
    runtimes = {line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) == 1, runtimes


# ---------------------------------------------------------------------------------------------
# Loaded state and the native kernel's memory safety
# ---------------------------------------------------------------------------------------------
def _fp8_with(**parts):
    """An FP8Tensor of a (64, 256) parameter's shape with some of its saved attributes replaced,
    as a crafted file can hold them (torch.load does not call __init__)."""
    x = FP8Tensor.from_float(torch.zeros(64, 256))
    for name, value in parts.items():
        setattr(x, name, value)
    return x


CRAFTED = {  # state key -> a value that does not fit a (64, 256) parameter at level 2
    "too small": ("exp_avg", lambda: FP8Tensor.from_float(torch.zeros(256))),
    "too large": ("exp_avg", lambda: FP8Tensor.from_float(torch.zeros(128, 256))),
    "fewer scales than blocks": ("exp_avg_sq_sqrt", lambda: _fp8_with(scale=torch.ones(3))),
    "codes smaller than the tensor": ("exp_avg", lambda: _fp8_with(codes=torch.zeros(256, dtype=torch.float8_e4m3fn))),
    "codes not FP8": ("exp_avg", lambda: _fp8_with(codes=torch.zeros(64, 256, dtype=torch.uint8))),
    "scales not fp32": ("exp_avg", lambda: _fp8_with(scale=torch.ones(64, dtype=torch.float64))),
    "codes of one byte, strides 0": (
        "exp_avg", lambda: _fp8_with(codes=torch.zeros(1, dtype=torch.float8_e4m3fn).expand(64, 256))),
    "fp32 moment too small": ("exp_avg", lambda: torch.zeros(100)),
    "fp32 moment of one element, strides 0": ("exp_avg", lambda: torch.zeros(1).expand(64, 256)),
    "integer moment": ("exp_avg", lambda: torch.zeros(64, 256, dtype=torch.int32)),
    "step not a scalar": ("step", lambda: torch.zeros(3)),
    "unknown state": ("max_exp_avg_sq", lambda: torch.zeros(64, 256)),
}


def _state_bits(opt, params):
    return [[b.clone() for v in opt.state[p].values() for b in _bits(v)] for p in params]


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_loaded_state_that_does_not_fit_is_refused_before_anything_changes(case):
    """A state dict saved by a level-2 run, one state of parameter 0 replaced, written and read
    back with torch.load(weights_only=True): load_state_dict raises one ValueError naming the
    parameter and the state, and the optimizer holds exactly what it held (states bit for bit,
    group hyperparameters), so its next step equals that of a twin that never saw the file."""
    key, make = CRAFTED[case]
    shapes = ((64, 256), (10,))
    saved = _params(shapes=shapes)
    src = FP8Optim(torch.optim.AdamW(saved, lr=1e-2), opt_level=2, backend="eager")
    _run(src, saved, 2)
    sd = src.state_dict()
    sd["state"][0][key] = make()
    sd = _roundtrip(sd)
    opts, params = [], []
    for _ in range(2):  # the loader and its twin, in the same state
        p = _params(seed=3, shapes=shapes)
        opt = FP8Optim(torch.optim.AdamW(p, lr=0.5), opt_level=2, backend="eager")
        _run(opt, p, 1)
        opts.append(opt)
        params.append(p)
    before = _state_bits(opts[0], params[0])
    with pytest.raises(ValueError, match=rf"parameter 0 \(param group 0, shape \(64, 256\)\): .*{key}"):
        opts[0].load_state_dict(sd)
    assert opts[0].param_groups[0]["lr"] == 0.5
    after = _state_bits(opts[0], params[0])
    assert all(torch.equal(a, b) for xs, ys in zip(before, after) for a, b in zip(xs, ys))
    for opt, p in zip(opts, params):
        _run(opt, p, 1, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(*params))


KERNEL_SIZE_CHECK = r'''
import ctypes
import torch
from nanochat.optim import FP8Optim, FP8Tensor, adam
from nanochat.optim.backends import extent

lib = adam.load_kernel()
B, NB, W = 256, 4, len(adam.KernelRow._fields)
FIELDS = adam.KernelRow._fields


def row(mode, vfp8, nb=NB):
    """Consistent buffers for nb blocks; g random so that a step would change everything."""
    wide = torch.float32 if mode == 0 else torch.bfloat16
    r = dict(p=torch.randn(nb, B).to(wide), g=torch.randn(nb, B).to(wide), m_codes=torch.zeros(nb, B, dtype=torch.uint8),
             m_scale=torch.ones(nb), ok=torch.tensor(True), h=adam.adam_table([torch.tensor(1.0)], [dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8,
                                                                             weight_decay=0.0)])[0])
    if vfp8:
        r.update(v_codes=torch.zeros(nb, B, dtype=torch.uint8), v_scale=torch.ones(nb))
    else:
        r["v"] = torch.zeros(nb, B)
    if mode == 3:
        r["lo"] = torch.zeros(nb, B, dtype=torch.int16)
    if mode == 2:
        r["salt"] = torch.tensor(7, dtype=torch.uint32)
    return r


def call(r, mode, vfp8, nb=NB, B=B, sizes=None):
    """adam_dynamic on one tensor: the sizes each buffer's allocation holds, unless given."""
    xs = [r.get(f) for f in FIELDS]
    ptrs = (ctypes.c_void_p * W)(*[None if x is None else x.data_ptr() for x in xs])
    size = (ctypes.c_int64 * W)(*(sizes or [extent(x) for x in xs]))
    return lib.adam_dynamic(1, ptrs, size, (ctypes.c_int64 * 1)(nb), nb, 128, ctypes.byref(ctypes.c_int64(0)), B,
                            1, int(vfp8), mode)


def unchanged(r, ref):
    return all(torch.equal(r[k], ref[k]) for k in ref)


for mode in range(4):
    for vfp8 in (True, False):
        r = row(mode, vfp8)
        used = [k for k in FIELDS if k in r]
        for k in used:  # each buffer one block short, or missing (the guard may be): refused, nothing touched
            shorts = ([r[k][:-1].clone()] if r[k].dim() else []) + ([None] if k != "ok" else [])
            for short in shorts:
                bad = dict(r, **{k: short})
                ref = {f: v.clone() for f, v in bad.items() if v is not None}
                got = call(bad, mode, vfp8)
                assert got == 2 + FIELDS.index(k), (mode, vfp8, k, got)
                assert unchanged(bad, ref), (mode, vfp8, k)
        # the same buffers, declared one byte smaller than the tensors' blocks need
        for i, k in enumerate(FIELDS):
            if k in used:
                sizes = [extent(r.get(f)) for f in FIELDS]
                sizes[i] = {"h": 44}.get(k, r[k].numel() * r[k].element_size()) - 1
                assert call(r, mode, vfp8, sizes=sizes) == 2 + i, (mode, k)
        ref = {f: v.clone() for f, v in r.items()}
        assert call(r, mode, vfp8) == 0 and not torch.equal(r["p"], ref["p"])  # consistent: it steps
r = row(0, True)
assert call(r, 0, True, nb=NB + 1) == 2 + FIELDS.index("p")  # more blocks than p holds
assert call(r, 0, True, nb=-1) == 2 + FIELDS.index("p")
assert call(r, 0, True, B=12) == 1 and call(r, 0, True, B=2048) == 1 and call(r, 7, True) == 1
# through the Python binding: a ValueError naming the buffer, not the fallback's RuntimeError
r = row(0, True)
p0 = r["p"].clone()
try:
    adam.adam([(r["p"], r["g"], r["m_codes"][:2].clone(), r["m_scale"], None, r["v_codes"], r["v_scale"])],
                r["h"].view(1, -1).clone(), B, True, True)
    raise AssertionError("not refused")
except ValueError as e:
    assert "m_codes buffer of tensor 0 holds 512 bytes, too few for its 4 blocks of 256" in str(e), e
assert torch.equal(r["p"], p0)
# the heap corruption a crafted checkpoint caused, with the load-time check bypassed: a moment of
# 256 elements put in the state of a (64, 256) parameter directly
w = torch.nn.Parameter(torch.randn(64, 256))
opt = FP8Optim(torch.optim.AdamW([w], lr=1e-2), opt_level=2, backend="native")
w.grad = torch.randn(64, 256)
opt.step()
opt.state[w]["exp_avg"] = FP8Tensor.from_float(torch.zeros(256))
w0 = w.detach().clone()
try:
    opt.step()
    raise AssertionError("not refused")
except ValueError as e:
    assert "m_codes buffer of tensor 0 holds 256 bytes, too few for its 64 blocks" in str(e), e
assert torch.equal(w, w0) and opt.step_backends() == {}
print("refused cleanly")
'''


def test_kernel_checks_every_buffer_size_it_is_given(tmp_path):
    """The C entry point against tables that do not describe their memory, in a subprocess (a
    write out of bounds could abort it or corrupt its heap): in every master mode, with v in FP8
    and in fp32, each buffer one block too small, missing, or declared one byte short is refused
    with the code naming it, and no buffer changes; so are too many blocks, a block size that is
    not a multiple of 8 or above 1024, and an unknown mode; a consistent table steps. Through the
    Python binding the refusal is a ValueError naming the buffer, also for FP8Optim's step with
    a 256-element moment put in a (64, 256) parameter's state directly (the crafted checkpoint
    that corrupted the heap, past the load-time check). The process exits normally (no
    signal)."""
    import os
    import subprocess
    import sys

    try:
        adam.load_kernel()
    except RuntimeError as e:
        pytest.skip(f"the native kernel does not build here: {e}")
    script = tmp_path / "check.py"
    script.write_text(KERNEL_SIZE_CHECK)
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(adam.__file__).parents[2]), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "refused cleanly" in r.stdout


def test_kernel_built_for_another_abi_is_refused_and_the_step_falls_back(tmp_path, monkeypatch):
    """A library compiled from a source with another ABI version is refused on load with one line
    naming the file, both versions and the fix; with Python expecting another table layout than
    the cached build reports, the optimizer falls back to the compiled step and records why (that
    step's numbers: test_kernel_fallback_is_recorded)."""
    import ctypes
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    source = adam.KERNEL_SOURCE.read_text()
    assert f"#define ABI_VERSION {adam.KERNEL_ABI[2]}\n" in source
    src = tmp_path / "k.c"
    src.write_text(source.replace(f"#define ABI_VERSION {adam.KERNEL_ABI[2]}\n", "#define ABI_VERSION 99\n"))
    so = tmp_path / "k.so"
    subprocess.run([cc, "-O1", "-fopenmp-simd", "-shared", "-fPIC", f"-I{C_CODEC.parent}", "-o", str(so), str(src),
                    "-lm"], check=True)
    with pytest.raises(RuntimeError, match=rf"kernel {so} was built for ABI v99 with 11 buffers and 11 hyper"
                                           rf"parameters per tensor; this nanochat expects v2 .*delete {so} to rebuild"):
        adam.bind(ctypes.CDLL(str(so)), so)

    nargs, width, version = adam.KERNEL_ABI
    monkeypatch.setattr(adam, "KERNEL_ABI", (nargs + 1, width, version))
    monkeypatch.setattr(backends, "_native", {})
    p = _params(shapes=((64, 128),))
    opt = FP8Optim(torch.optim.AdamW(p, lr=1e-3), opt_level=2)
    _run(opt, p, 2)
    if "ABI" not in "".join(opt.fallbacks):
        pytest.skip(f"the native kernel does not build here: {opt.fallbacks}")
    assert len(opt.fallbacks) == 1 and f"with {nargs} buffers" in opt.fallbacks[0], opt.fallbacks
    assert opt.step_backends() == {"compile": (1, 1)}  # the second step: the compiled one only


def test_fallback_from_the_kernel_keeps_the_in_backward_guard(monkeypatch):
    """The native kernel fails on the first step inside the backward, the step in which both
    FP8-state weights get a NaN gradient: the fallback steps them compiled with their guard, so
    they, their moments and their step counts stay as they were (the fresh state), while the
    parameters with finite gradients move and stay finite."""
    monkeypatch.setattr(adam, "load_kernel", lambda: (_ for _ in ()).throw(RuntimeError("no C compiler (test)")))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.Linear(128, 64))
    opt = FP8Optim(torch.optim.AdamW(model.parameters(), lr=1e-2), opt_level=2)
    opt.step_in_backward()
    poisoned = [model[0].weight, model[2].weight]  # 8192 elements each: FP8 state, the native kernel's
    for w in poisoned:
        w.register_hook(lambda g: torch.full_like(g, float("nan")))
    before = {p: p.detach().clone() for p in model.parameters()}
    model(torch.randn(8, 64)).sum().backward()
    assert len(opt.fallbacks) == 1 and "no C compiler (test)" in opt.fallbacks[0]
    norm, skipped = opt.backward_stats().tolist()
    assert skipped == 2 and math.isfinite(norm)
    for w in poisoned:
        assert torch.equal(w, before[w])
        st = opt.state[w]
        assert st["step"].item() == 0
        for key in ("exp_avg", "exp_avg_sq_sqrt"):  # as made: codes 0, scales 1
            assert torch.equal(st[key].codes.view(torch.uint8), torch.zeros(w.shape, dtype=torch.uint8)), key
            assert torch.equal(st[key].scale, torch.ones_like(st[key].scale)), key
    for p in model.parameters():
        if all(p is not w for w in poisoned):
            assert torch.isfinite(p).all() and not torch.equal(p, before[p])
            assert opt.state[p]["step"].item() == 1
