"""The native Adam kernel (nanochat/optim/adam_kernel.c through `adam.adam`) with bf16 master
weights (nanochat.optim.master) and its per-tensor guard flag.
- bf16, bf16_sr, bf16_split, each with v in FP8 (level 2) or fp32 (level 1), Adam and AdamW, 4
  steps on 4 tensors of 2-3 blocks: equal to the eager Python step (nanochat.optim.adam's
  `adam_step` with the FP8 format, E4M3Blocks) on the fp32 master followed by master.py's
  `write_master` (its `sr_bits` for bf16_sr). The fp32 math
  differs by FMA contraction, so >= 99% of the bf16 weights are equal and none is more than one
  bf16 ulp away; moments as the fp32 kernel's test (codes on a rounding tie one step away).
- bf16_split keeps the fp32 master: join(p, lo) equals the fp32 kernel's step on an fp32 copy
  bit for bit (the kernel steps the joined master with the fp32 code).
- bf16 rounds ties to even (a crafted table puts x exactly half an ulp above p).
- The guard: a tensor whose flag is False is left byte for byte; a True flag is no flag.
- bf16_sr is deterministic (same salt, same bits; also split across 2 threads) and salted.
- A NaN update stays NaN in every bf16 mode (no carry into the exponent).
"""

from __future__ import annotations

import pytest
import torch

from nanochat.optim import adam
from nanochat.optim.adam import adam_step
from nanochat.optim.backends import host_scalar
from nanochat.optim.master import join, read_master, sr_bits, write_master
from nanochat.optim.moments import E4M3Blocks, MomentFormat
from tests.conftest import assert_close_but_few, last_bits

B = 256
SHAPES = ((3, B), (2, B), (3, B), (2, B))  # [n_blocks, B]: 2-3 blocks each
MODES = ("bf16", "bf16_sr", "bf16_split")
GROUP = dict(lr=5e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SALTS = [0x9E3779B9, 7, 0xFFFFFFFF, 123456789]


@pytest.fixture(scope="module", autouse=True)
def _lib():
    try:
        adam.load_kernel()
    except RuntimeError as e:
        pytest.skip(f"the native kernel does not build here: {e}")


def _state(mode: str, v_fp8: bool, seed: int = 0, shapes=SHAPES) -> list[dict]:
    """Per tensor: p (bf16, or fp32 for mode fp32), lo (bf16_split), moments with random codes
    and scales (so the first step already reads quantized state), a float32 step count."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in shapes:
        n = shape[0]
        p = torch.randn(shape, generator=g)
        mc = torch.randint(0, 255, shape, dtype=torch.uint8, generator=g)
        mc[(mc & 0x7F) == 0x7F] = 0  # 0x7F / 0xFF are NaN in e4m3fn
        st = dict(p=p if mode == "fp32" else p.to(torch.bfloat16), mc=mc, ms=torch.rand(n, generator=g) * 1e-2,
                  step=torch.tensor(0.0))
        if mode == "bf16_split":
            st["lo"] = torch.randint(-2**15, 2**15, shape, dtype=torch.int16, generator=g)
        if v_fp8:
            st["vc"] = torch.randint(0, 127, shape, dtype=torch.uint8, generator=g)
            st["vs"] = torch.rand(n, generator=g) * 1e-2
        else:
            st["v"] = torch.rand(shape, generator=g) * 1e-4
        out.append(st)
    return out


def _clone(states: list[dict]) -> list[dict]:
    return [{k: v.clone() for k, v in st.items()} for st in states]


def _grads(states: list[dict], step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(st["p"].shape, generator=g) * 1e-2).to(dtype) for st in states]


def _native_step(states, grads, mode, decoupled, v_fp8, *, salts=SALTS, oks=None):
    for st in states:
        st["step"] += 1  # counted first, as FP8Optim does
    tensors = [(st["p"], g, st["mc"], st["ms"], st.get("v"), st.get("vc"), st.get("vs"), st.get("lo"))
               for st, g in zip(states, grads)]
    h = adam.adam_table([st["step"] for st in states], [GROUP] * len(states))
    adam.adam(tensors, h, B, decoupled, v_fp8, master=mode, salts=salts[:len(states)], oks=oks)


def _reference_step(states, grads, mode, decoupled, v_fp8, salts=SALTS):
    hypers = [host_scalar(x) for x in (GROUP["lr"], *GROUP["betas"], GROUP["eps"], GROUP["weight_decay"])]
    for st, g, salt in zip(states, grads, salts):
        st["step"] += 1
        x = read_master(st["p"], st.get("lo")).clone()  # the fp32 master
        v = (st["vc"], st["vs"]) if v_fp8 else (st["v"],)
        adam_step(x, g.float(), (st["mc"], st["ms"]), v, None, st["step"], *hypers, None, None, decoupled=decoupled,
                  master="fp32", m_format=E4M3Blocks, v_format=E4M3Blocks if v_fp8 else MomentFormat)
        write_master(st["p"], x, mode, lo=st.get("lo"), bits16=sr_bits(salt, st["step"], x.shape))


def _ordered(bf: torch.Tensor) -> torch.Tensor:
    """bf16 -> int32 that counts bf16 ulps monotonically across zero."""
    u = bf.view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.where(u >= 0x8000, -(u & 0x7FFF), u)


def _assert_moments_close(a: dict, b: dict, v_fp8: bool):
    for key in ("mc", "vc") if v_fp8 else ("mc",):
        diff = (a[key].to(torch.int32) - b[key].to(torch.int32)).abs()
        # a code on a rounding tie may land one step away (the sign bit never differs here)
        assert diff.max() <= 1 and (diff > 0).float().mean() < 2e-3, (key, int((diff > 0).sum()))
    for key in ("ms", "vs") if v_fp8 else ("ms",):
        assert torch.allclose(a[key], b[key], rtol=1e-5)
    if not v_fp8:
        assert torch.allclose(a["v"], b["v"], rtol=1e-5, atol=1e-12)


@pytest.mark.two_computations
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("v_fp8", [True, False])
def test_bf16_modes_equal_the_python_reference(mode, decoupled, v_fp8):
    """The perturbation pass moves the kernel's fp32 moment scales by a last bit: what its other
    order of fp32 arithmetic does. The bf16 weights hold: an update differing in its last bits
    crosses a bf16 rounding boundary (2^-8 relative apart) only rarely, and then by one ulp. The
    split's fp32 master is compared as fp32 step results (assert_close_but_few): rounding, except
    where a moment's code lands one step away and that element's update moves by < lr a step."""
    nat = _state(mode, v_fp8)
    ref = _clone(nat)
    for st in nat:
        for key in ("ms", "vs", "v"):
            if key in st:
                st[key] = last_bits(st[key])
    start = torch.cat([st["p"].flatten() for st in nat])
    for step in range(4):
        grads = _grads(nat, step, torch.bfloat16)
        _native_step(nat, grads, mode, decoupled, v_fp8)
        _reference_step(ref, grads, mode, decoupled, v_fp8)
    p_nat = torch.cat([st["p"].flatten() for st in nat])
    p_ref = torch.cat([st["p"].flatten() for st in ref])
    assert (p_nat != start).float().mean() > 0.5  # the steps moved most weights
    ulps = (_ordered(p_nat) - _ordered(p_ref)).abs()
    assert (ulps == 0).float().mean() >= 0.99 and ulps.max() <= 1, (int((ulps > 0).sum()), int(ulps.max()))
    if mode == "bf16_split":  # the fp32 master, to fp32 rounding (FMA contraction)
        m_nat = torch.cat([join(st["p"], st["lo"]).flatten() for st in nat])
        m_ref = torch.cat([join(st["p"], st["lo"]).flatten() for st in ref])
        assert_close_but_few(m_nat, m_ref, atol=2e-5, bound=4 * GROUP["lr"], fraction=1e-3)
    for a, b in zip(nat, ref):
        _assert_moments_close(a, b, v_fp8)


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("v_fp8", [True, False])
def test_split_master_is_the_fp32_step(decoupled, v_fp8):
    split = _state("bf16_split", v_fp8)
    f32 = _clone(split)
    for st in f32:  # the fp32 master the split pair holds, stepped by the fp32 kernel
        st["p"] = join(st.pop("p"), st.pop("lo")).clone()
    for step in range(4):
        grads = _grads(split, step, torch.bfloat16)
        _native_step(split, grads, "bf16_split", decoupled, v_fp8)
        _native_step(f32, [g.float() for g in grads], "fp32", decoupled, v_fp8)
    for a, b in zip(split, f32):
        assert torch.equal(join(a["p"], a["lo"]), b["p"])
        for key in a:
            if key not in ("p", "lo"):
                assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("mode", ("fp32", *MODES))
@pytest.mark.parametrize("v_fp8", [True, False])
def test_guard_false_leaves_the_tensor_and_true_is_no_guard(mode, v_fp8):
    start = _state(mode, v_fp8)
    dtype = torch.float32 if mode == "fp32" else torch.bfloat16
    plain, guarded = _clone(start), _clone(start)
    oks = [torch.tensor(ok) for ok in (True, False, True, False)]
    for step in range(2):
        grads = _grads(start, step, dtype)
        _native_step(plain, grads, mode, True, v_fp8)
        _native_step(guarded, grads, mode, True, v_fp8, oks=oks)
    for t, (a, b, s) in enumerate(zip(plain, guarded, start)):
        for key in s:
            if key == "step":
                continue
            if oks[t]:
                assert torch.equal(a[key], b[key]), (t, key)  # a True flag changes nothing
            else:
                assert torch.equal(b[key], s[key]), (t, key)  # left byte for byte
                assert not torch.equal(a[key], s[key]), (t, key)  # which the step would have changed


def test_stochastic_rounding_is_deterministic_and_salted():
    runs = []
    for salts in (SALTS, SALTS, [s ^ 1 for s in SALTS]):
        st = _state("bf16_sr", True)
        for step in range(3):
            _native_step(st, _grads(st, step, torch.bfloat16), "bf16_sr", True, True, salts=salts)
        runs.append(torch.cat([s["p"].flatten() for s in st]))
    assert torch.equal(runs[0], runs[1])
    assert (runs[0] != runs[2]).float().mean() > 0.05  # another salt rounds other elements up


def test_stochastic_rounding_does_not_depend_on_the_thread_split():
    shapes = ((512, B), (640, B))  # 1152 blocks: 2 threads
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            st = _state("bf16_sr", True, shapes=shapes)
            for step in range(2):
                _native_step(st, _grads(st, step, torch.bfloat16), "bf16_sr", True, True)
            outs.append(torch.cat([s["p"].flatten() for s in st]))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("mode", MODES)
def test_nan_stays_nan(mode):
    (st,) = _state(mode, True, shapes=((1, B),))
    g = torch.zeros(1, B, dtype=torch.bfloat16)
    g[0, 5] = float("nan")
    _native_step([st], [g], mode, True, True)
    x = read_master(st["p"], st.get("lo"))
    assert torch.isnan(x[0, 5]) and torch.isnan(x).sum() == 1


def test_wrong_dtypes_are_refused():
    st = _state("fp32", True, shapes=((1, B),))
    with pytest.raises(TypeError):
        _native_step(st, _grads(st, 0, torch.float32), "bf16", True, True)
    st = _state("bf16", True, shapes=((1, B),))
    with pytest.raises(TypeError):  # bf16_split without its remainder
        _native_step(st, _grads(st, 0, torch.bfloat16), "bf16_split", True, True)


def test_bf16_rounds_ties_to_even():
    """A table with step size 0 and weight decay factor 1 + 2^-8 makes the fp32 result
    x = p + p / 256: for p = +-2^k exactly half a bf16 ulp above p (a tie, kept at the even p),
    for other p an ordinary rounding. Compared with torch's conversion (round to nearest even)."""
    (st,) = _state("bf16", True, shapes=((1, B),))
    k = torch.arange(B) % 24 - 12
    p = torch.where(torch.arange(B) % 2 == 0, 2.0**k, torch.randn(B, generator=torch.Generator().manual_seed(3)))
    p = (p * torch.where(torch.arange(B) % 4 < 2, 1.0, -1.0)).to(torch.bfloat16).view(1, B)
    st["p"] = p.clone()
    st["step"] += 1
    h = adam.adam_table([st["step"]], [GROUP])
    h[:, 5] = 0.0  # step size
    h[:, 9] = 1.0 + 2.0**-8  # decoupled weight decay factor
    g = torch.zeros(1, B, dtype=torch.bfloat16)
    adam.adam([(st["p"], g, st["mc"], st["ms"], None, st["vc"], st["vs"], None)], h, B, True, True, master="bf16")
    expect = (p.float() * (1.0 + 2.0**-8)).to(torch.bfloat16)
    assert torch.equal(st["p"], expect)
    assert torch.equal(st["p"][0, ::2], p[0, ::2])  # the ties stayed at the even neighbour
