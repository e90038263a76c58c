"""FP8Tensor (nanochat.optim.moments.fp8) against torch's own float8 casts and against its dequantized value.

- encode/decode are bit-identical to `tensor.to(float8_*)` / `codes.float()` for every code and
  for random values including exact ties (round-to-nearest-even).
- Blockwise quantization error per element, for values in the format's normal range after
  scaling, is at most half an ulp: relative 2^-4 for e4m3 (3 mantissa bits), 2^-3 for e5m2 (2).
- Every op handler gives what the same op on `dequantize()` gives (slice, view, copy_, to, ...);
  an op outside the table raises NotImplementedError naming the op.
- torch.compile traces a function taking an FP8Tensor (flatten/unflatten), equal to eager.
- torch.save / torch.load(weights_only=True) round-trips codes and scales bit-exactly, and an
  optimizer state saved by an earlier release (tests/data/fp8_optim_state.pt, which names the
  class by its earlier module path, nanochat.fp8.tensor) still loads to the values stored beside
  it, in a process that imports only nanochat.optim (that path is a registered name, no module).
- A saved tensor whose codes, scales or block size disagree (a crafted file) still loads, and
  `layout_problem()` names the disagreement; sound tensors have none.
"""

from __future__ import annotations

import copy
import io
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from nanochat.optim.moments.codec import decode, encode
from nanochat.optim.moments.fp8 import FP8Tensor, implements

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _finite_codes(dtype):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codes.view(dtype).float()
    ok = torch.isfinite(values)
    return codes[ok], values[ok]


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_decode_is_torch_cast_for_every_code(dtype):
    codes, values = _finite_codes(dtype)
    assert torch.equal(decode(codes, dtype), values)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_encode_is_torch_cast_including_ties_and_subnormals(dtype):
    torch.manual_seed(0)
    fmax = torch.finfo(dtype).max
    _, values = _finite_codes(dtype)
    values = values.sort().values
    y = torch.cat([
        torch.randn(20000) * s for s in (1e-5, 1e-3, 0.1, 1.0, 30.0, fmax / 4)
    ] + [values, (values[1:] + values[:-1]) / 2])  # every code and every midpoint (ties)
    y = y.clamp(-fmax, fmax)
    assert torch.equal(encode(y, dtype), y.to(dtype).view(torch.uint8))


@pytest.mark.parametrize("dtype,bound,min_normal", [(E4M3, 2.0**-4, 2.0**-6), (E5M2, 2.0**-3, 2.0**-14)])
def test_blockwise_error_within_format_bound(dtype, bound, min_normal):
    torch.manual_seed(0)
    # 32 blocks whose magnitudes span 1e-6..1e3 across blocks and 4 decades within each block
    x = torch.randn(32, 256) * torch.logspace(-6, 3, 32)[:, None] * torch.logspace(-2, 2, 256)[None, :]
    q = FP8Tensor.from_float(x, dtype=dtype, block_size=256)
    scaled = x.abs() / q.scale[:, None]
    normal = scaled >= min_normal
    rel = ((q.dequantize() - x).abs() / x.abs())[normal]
    assert normal.float().mean() > 0.5
    assert rel.max().item() <= bound * (1 + 1e-6)
    # the block's largest element is exact (it lands on the largest code)
    idx = x.abs().argmax(dim=1)
    assert torch.allclose(q.dequantize().gather(1, idx[:, None]), x.gather(1, idx[:, None]), rtol=1e-6)


def test_zeros_and_appearance():
    z = FP8Tensor.zeros((4, 512), dtype=E5M2, block_size=128)
    assert z.shape == (4, 512) and z.dtype == torch.float32 and z.fp8_dtype == E5M2
    assert z.scale.shape == (16,) and torch.equal(z.dequantize(), torch.zeros(4, 512))
    assert z.nbytes_stored() == 4 * 512 + 16 * 4
    with pytest.raises(ValueError, match="divisible by block_size"):
        FP8Tensor.zeros((3, 100))


@pytest.fixture
def q():
    torch.manual_seed(0)
    return FP8Tensor.from_float(torch.randn(8, 64) * 3, block_size=128)


def test_detach_clone_deepcopy(q):
    for other in (q.detach(), q.clone(), copy.deepcopy(q)):
        assert isinstance(other, FP8Tensor)
        assert torch.equal(other.dequantize(), q.dequantize())
    c = q.clone()
    c.codes.zero_()
    assert not torch.equal(c.dequantize(), q.dequantize())  # clone owns its storage


def test_copy_between_formats_and_plain_tensors(q):
    same = FP8Tensor.zeros(q.shape, block_size=128)
    same.copy_(q)
    assert torch.equal(same.dequantize(), q.dequantize())
    x = torch.randn(8, 64)
    into = FP8Tensor.zeros(q.shape, dtype=E5M2, block_size=128)
    into.copy_(x)  # quantizes into the destination's format
    assert torch.equal(into.dequantize(), FP8Tensor.from_float(x, dtype=E5M2, block_size=128).dequantize())
    plain = torch.empty(8, 64)
    plain.copy_(q)
    assert torch.equal(plain, q.dequantize())


def test_to_device_and_dtype(q):
    m = q.to("meta")
    assert isinstance(m, FP8Tensor) and m.device.type == "meta" and m.codes.device.type == "meta"
    assert q.to(torch.float32) is q
    b = q.to(torch.bfloat16)
    assert type(b) is torch.Tensor and torch.equal(b, q.dequantize().bfloat16())
    e = torch.empty_like(q, device="meta")
    assert isinstance(e, FP8Tensor) and e.device.type == "meta"
    assert q.is_pinned() is False


def test_slice_and_view_equal_dequantize_then_op(q):
    assert torch.equal(q[2:6].dequantize(), q.dequantize()[2:6])  # 2 rows of 64 = one block of 128
    assert torch.equal(q.narrow(0, 4, 4).dequantize(), q.dequantize()[4:8])
    assert torch.equal(q.view(4, 128).dequantize(), q.dequantize().view(4, 128))
    with pytest.raises(ValueError, match="block boundaries"):
        q[1:3]


def test_unsupported_op_names_it(q):
    with pytest.raises(NotImplementedError, match=r"aten\.add\.Tensor"):
        q + 1
    with pytest.raises(NotImplementedError, match=r"aten\.mul\.Tensor"):
        q * q


def test_implements_refuses_double_registration():
    with pytest.raises(RuntimeError, match="already implemented"):
        implements([torch.ops.aten.detach.default])(lambda *a: None)


def test_compile_traces_subclass(q):
    fn = lambda t, y: t.dequantize() * y + 1  # noqa: E731
    y = torch.randn(8, 64)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, y), fn(q, y))
    # flatten/unflatten round trip is what the compiler relies on
    names, ctx = q.__tensor_flatten__()
    back = FP8Tensor.__tensor_unflatten__({n: getattr(q, n) for n in names}, ctx, q.shape, q.stride())
    assert torch.equal(back.dequantize(), q.dequantize())


def test_save_load_weights_only_bit_exact(q):
    buf = io.BytesIO()
    torch.save({"m": q}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["m"]
    assert isinstance(loaded, FP8Tensor) and loaded.block_size == 128 and loaded.fp8_dtype == E4M3
    assert torch.equal(loaded.codes.view(torch.uint8), q.codes.view(torch.uint8))
    assert torch.equal(loaded.scale, q.scale)
    buf.seek(0)
    on_meta = torch.load(buf, weights_only=True, map_location="meta")["m"]
    assert on_meta.device.type == "meta" and on_meta.codes.device.type == "meta"


def test_load_state_saved_by_earlier_release():
    # saved by an earlier release; users' checkpoints hold this pickled form (a wrapper subclass
    # rebuilt from its __dict__ of codes, scale, block_size), so it must keep loading unchanged
    saved = torch.load(Path(__file__).parent / "data" / "fp8_optim_state.pt", weights_only=True)
    st = saved["state"][0]
    assert float(st["step"]) == 3.0
    for name, fp8, block in (("exp_avg", E4M3, 128), ("exp_avg_sq_sqrt", E5M2, 64)):
        m = st[name]
        assert isinstance(m, FP8Tensor) and m.shape == (4, 64) and m.dtype == torch.float32
        assert m.fp8_dtype == fp8 and m.block_size == block and m.scale.shape == (256 // block,)
        assert torch.equal(m.dequantize(), saved["values"][name])
        assert torch.equal(m.clone().dequantize(), saved["values"][name])  # usable, not just loaded


def test_state_saved_before_the_move_loads_with_only_the_optimizer_imported():
    # the file pickles the class as nanochat.fp8.tensor.FP8Tensor; weights_only resolves that name
    # through the alias FP8Tensor registers, without a module of that name and without nanochat.fp8
    code = ("import sys, pathlib, importlib.util, torch, nanochat.optim\n"
            "saved = torch.load(pathlib.Path(sys.argv[1]), weights_only=True)\n"
            "m = saved['state'][0]['exp_avg']\n"
            "assert type(m) is nanochat.optim.FP8Tensor, type(m)\n"
            "assert torch.equal(m.dequantize(), saved['values']['exp_avg'])\n"
            "print(sorted(k for k in sys.modules if k.startswith('nanochat.fp8')))\n"
            "assert importlib.util.find_spec('nanochat.fp8.tensor') is None")
    data = Path(__file__).parent / "data" / "fp8_optim_state.pt"
    assert _pickled_modules(data) == {"nanochat.fp8.tensor"}  # what this test is about
    run = subprocess.run([sys.executable, "-c", code, str(data)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"


def _pickled_modules(path: Path) -> set[str]:
    """The nanochat module paths a torch.save archive's pickle names."""
    with zipfile.ZipFile(path) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    return {m.decode() for m in re.findall(rb"nanochat[\w.]*", pkl)}


def _saved_and_loaded(x):
    buf = io.BytesIO()
    torch.save(x, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("part,value,problem", [
    ("scale", torch.ones(3), r"scale must be float32 of shape \(4,\), one per block of 128; got torch.float32 \(3,\)"),
    ("scale", torch.ones(4, dtype=torch.float64), "scale must be float32"),
    ("codes", torch.zeros(128, dtype=E4M3), r"codes of shape \(128,\) in an FP8Tensor of shape \(8, 64\)"),
    ("codes", torch.zeros(8, 64, dtype=torch.uint8), "codes must be float8_e4m3fn or float8_e5m2, got torch.uint8"),
    ("codes", torch.zeros(1, dtype=E4M3).expand(8, 64), "contiguous"),
    ("block_size", 0, "block_size 0 does not divide its 512 elements"),
    ("block_size", 96, "block_size 96 does not divide"),
])
def test_layout_problem_names_what_a_loaded_tensor_got_wrong(q, part, value, problem):
    """torch.load(weights_only=True) rebuilds an FP8Tensor from its saved attributes without
    __init__'s checks: one whose parts disagree loads, and layout_problem() says what is wrong
    (FP8Optim refuses such state before a kernel reads it). Sound tensors, including the ones an
    earlier release saved, have none."""
    assert q.layout_problem() is None and _saved_and_loaded(q).layout_problem() is None
    saved = torch.load(Path(__file__).parent / "data" / "fp8_optim_state.pt", weights_only=True)
    assert all(saved["state"][0][k].layout_problem() is None for k in ("exp_avg", "exp_avg_sq_sqrt"))
    bad = q.clone()
    setattr(bad, part, value)
    loaded = _saved_and_loaded(bad)
    assert isinstance(loaded, FP8Tensor)
    assert re.search(problem, loaded.layout_problem())
