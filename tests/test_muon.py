"""Muon (nanochat.optim.muon, in OptimWrapper/FP8Optim) against torch.optim.Muon.

- muon_step is torch.optim.Muon's step: eager, with an fp32 momentum buffer and Newton-Schulz in
  bf16 (torch's dtype), 5 steps of wide, tall and square matrices, Nesterov on and off, each
  adjust_lr_fn, weight decay: torch.equal parameters and buffers. At opt_level 0 with torch's bf16
  FP8Optim is the wrapped torch.optim.Muon (torch.equal); on a CPU by default a wrapper steps the
  fp32 momentum itself, Newton-Schulz in fp32: torch's step with its iteration in fp32 (torch.equal).
- Newton-Schulz in fp32 (the CPU default) is within 1e-5 (relative Frobenius) of the same
  iteration in float64; torch's bf16 is over 1e-3 from it (each of its 15 products rounded to 8
  bits, 2^-9 each): the reason fp32 is the CPU default.
- FP8 momentum (opt_level 1) against fp32 momentum (the same step, fp32 Newton-Schulz) on
  minibatch least squares, 40 steps: the full-data loss within 1% relative at every step
  (measured 0.1%); the buffer within 2^-4 of fp32's after the first write (one e4m3 rounding;
  measured 2.6%) and within 15% after 40 (e4m3's rounding of a 5%-increment average drifts:
  measured 7.9%). A buffer never written (momentum lost) or read transposed (a layout bug) moves
  the loss by over 10% (measured 46% and 59%).
- The compiled FP8 step equals the eager one to fp32 rounding (argued at the test), and a
  changing lr does not recompile.
- state_dict -> torch.load(weights_only=True) -> a fresh FP8Optim resumes bit for bit; a plain
  torch.optim.Muon state loads into FP8Optim as the quantizer's codes of its buffer (torch.equal
  with E4M3Blocks.quantize), and an FP8 state into a level-0 wrapper as its dequantized values.
- NorMuon (--muon_normuon): after its first step every neuron's update has one RMS and the
  update its norm (float64 by hand); its EMA is state a checkpoint carries (bit for bit).
- muon_param_groups on the d2 GPT: the 12 block matrices go to Muon, the embedding and lm_head
  to AdamW (tied: one entry); 1-D parameters to AdamW; each parameter exactly once; each group
  named by its role (matrix, head, embedding, vector), the embedding and vectors undecayed.
- MuonAdamW steps as its two optimizers stepped apart (torch.equal, under one LambdaLR), resumes
  from its state_dict bit for bit (an lr set through it after the load reaches both), reports its members' fallbacks, refuses a parameter in both
  and a foreign state dict.
- Bytes: Muon's state is 4 bytes a parameter in fp32, 1 + 4/256 with FP8 momentum, planned before
  the first step as held after it; a MuonAdamW holds the sum of its two.
- Refused with the fix in the message: bf16 master weights over an fp32 matrix, and the step in
  the backward on a MuonAdamW whose members are plain torch optimizers (bf16 masters and the
  step in the backward themselves: tests/test_muon_master.py).

Modules: nanochat.optim.muon, nanochat.optim.wrapper (_step_muon), nanochat.optim.saved_state,
nanochat.optim.state_bytes.
"""

from __future__ import annotations

import copy
import dataclasses
import io

import pytest
import torch
from torch import nn

from nanochat.model.gpt import GPT, preset_config
from nanochat.optim import (FP8Optim, FP8Tensor, MuonAdamW, OptimWrapper, muon_param_groups, optimizer_fallbacks,
                            optimizer_state_bytes)
from nanochat.optim.moments import E4M3Blocks, MomentFormat
from nanochat.optim.muon import NS_COEFFICIENTS, muon_flags, muon_hypers, muon_step, newton_schulz, normalize_neurons
from tests.conftest import last_bits


def _matrix(shape, seed=0, scale=0.1) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale)


def _grads(shape, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(steps)]


@pytest.mark.parametrize("shape, nesterov, adjust", [((64, 96), True, None), ((96, 64), False, "match_rms_adamw"),
                                                     ((128, 32), True, "original"), ((48, 48), False, None)])
def test_eager_bf16_step_is_torch_muon_bit_for_bit(shape, nesterov, adjust):
    theirs, ours = _matrix(shape), _matrix(shape)
    opt = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust)
    group, buf = opt.param_groups[0], torch.zeros(shape)
    for step, grad in enumerate(_grads(shape, 5)):
        group["lr"] = 0.02 / (step + 1)
        theirs.grad = grad.clone()
        opt.step()
        with torch.no_grad():
            muon_step(ours, grad, (buf,), *muon_hypers(group), **muon_flags(group, ours.device, torch.bfloat16),
                      m_format=MomentFormat)
    assert torch.equal(ours, theirs)
    assert torch.equal(buf, opt.state[theirs]["momentum_buffer"])


def test_opt_level_0_is_the_wrapped_muon():
    """With torch's Newton-Schulz dtype (bf16) the wrapper leaves the step to torch.optim.Muon."""
    a, b = _matrix((128, 64)), _matrix((128, 64))
    wrapped = FP8Optim(torch.optim.Muon([a], lr=0.02), opt_level=0, compile=False)
    wrapped.muon_ns_dtype = torch.bfloat16
    plain = torch.optim.Muon([b], lr=0.02)
    for grad in _grads((128, 64), 4):
        for p, opt in ((a, wrapped), (b, plain)):
            p.grad = grad.clone()
            opt.step()
    assert torch.equal(a, b)
    assert torch.equal(wrapped.state[a]["momentum_buffer"], plain.state[b]["momentum_buffer"])


def test_level_0_on_a_cpu_steps_fp32_momentum_with_fp32_newton_schulz(monkeypatch):
    """Off CUDA a wrapper steps Muon's fp32 momentum itself, with Newton-Schulz in fp32: the step
    torch.optim.Muon takes with its iteration run in fp32 instead of bf16 (torch.equal, eager),
    and the buffer stays torch's fp32 tensor (its state dict loads into torch.optim.Muon)."""
    import torch.optim._muon as torch_muon

    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz",
                        lambda g, coefficients, steps, eps: newton_schulz(g, coefficients, steps, eps, torch.float32))
    a, b = _matrix((128, 64)), _matrix((128, 64))
    wrapped = OptimWrapper(torch.optim.Muon([a], lr=0.02, weight_decay=0.1), compile=False)
    plain = torch.optim.Muon([b], lr=0.02, weight_decay=0.1)
    for grad in _grads((128, 64), 4):
        for p, opt in ((a, wrapped), (b, plain)):
            p.grad = grad.clone()
            opt.step()
    assert wrapped.step_backends() == {"eager": (1, 1)}  # stepped here, not by torch
    assert torch.equal(a, b)
    assert torch.equal(wrapped.state[a]["momentum_buffer"], plain.state[b]["momentum_buffer"])
    torch.optim.Muon([_matrix((128, 64))], lr=0.02).load_state_dict(wrapped.state_dict())


@pytest.mark.parametrize("shape", [(128, 64), (64, 256)])
def test_newton_schulz_fp32_is_float64s_and_bf16_is_not(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    exact = newton_schulz(x, NS_COEFFICIENTS, 5, 1e-7, torch.float64)

    def error(dtype):
        o = newton_schulz(x.float(), NS_COEFFICIENTS, 5, 1e-7, dtype).double()
        return ((o - exact).norm() / exact.norm()).item()

    # fp32: 15 products, each rounded at 2^-24 relative times sqrt(K) accumulation: ~1e-6 measured
    assert error(torch.float32) < 1e-5
    assert error(torch.bfloat16) > 1e-3


# ------------------------------------------------------------------------ FP8 momentum, trained
LS_SHAPE, LS_ROWS, LS_STEPS = (128, 64), 1024, 40


def _least_squares(make_step, steps=LS_STEPS):
    """Minibatch least squares (batch 32 of 1024 noisy rows) from W = 0 under a linear lr decay:
    the full-data loss after each step, and the momentum buffer with an fp32 shadow of it (the
    same gradients averaged in fp32) after the last. make_step(W) -> (step, buffer, param group)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(LS_ROWS, LS_SHAPE[0], generator=g)
    y = x @ (torch.randn(*LS_SHAPE, generator=g) / 11) + 0.5 * torch.randn(LS_ROWS, LS_SHAPE[1], generator=g)
    w = nn.Parameter(torch.zeros(LS_SHAPE))
    step, buffer, group = make_step(w)
    shadow, losses = torch.zeros(LS_SHAPE), []
    batches = torch.Generator().manual_seed(1)
    for i in range(steps):
        group["lr"] = 0.02 * (1 - i / steps)
        idx = torch.randint(0, LS_ROWS, (32,), generator=batches)
        w.grad = None
        (x[idx] @ w - y[idx]).square().mean().backward()
        shadow.lerp_(w.grad, 1 - group["momentum"])
        step()
        with torch.no_grad():
            losses.append((x @ w - y).square().mean().item())
    return torch.tensor(losses), buffer(), shadow


def _reference(w):
    """fp32 momentum stepped by muon_step (torch's arithmetic, test above) with fp32 Newton-Schulz."""
    group = torch.optim.Muon([w], lr=0.02).param_groups[0]
    buf = torch.zeros(LS_SHAPE)

    def step():
        with torch.no_grad():
            muon_step(w, w.grad, (buf,), *muon_hypers(group), **muon_flags(group, w.device, torch.float32),
                      m_format=MomentFormat)
    return step, lambda: buf, group


def _fp8(fmt: type[E4M3Blocks] = E4M3Blocks):
    def make(w):
        opt = FP8Optim(torch.optim.Muon([w], lr=0.02), opt_level=1, compile=False)
        opt.moments = fmt(1)  # the format under test (a mutant below)
        return opt.step, lambda: opt.state[w]["momentum_buffer"].dequantize(), opt.param_groups[0]
    return make


class _NoWrite(E4M3Blocks):  # mutant: the buffer is never written back (momentum lost)
    @staticmethod
    def write(m, new, ok):
        return 0.0


class _Transposed(E4M3Blocks):  # mutant: the blocks read as the transposed matrix's
    @staticmethod
    def read(m):
        return E4M3Blocks.read(m).reshape(LS_SHAPE[::-1]).T.reshape(-1, 256)


def test_fp8_momentum_tracks_fp32_on_least_squares():
    ref, _, _ = _least_squares(_reference)
    fp8, buf, shadow = _least_squares(_fp8())
    rel = ((fp8 - ref).abs() / ref).max().item()
    assert rel < 0.01, f"FP8 momentum's loss {rel:.2%} from fp32 momentum's"
    assert ((buf - shadow).norm() / shadow.norm()).item() < 0.15
    # one write: (1 - momentum) * grad rounded once to e4m3 (3 mantissa bits: within 2^-4 relative)
    _, first, shadow = _least_squares(_fp8(), steps=1)
    assert ((first - shadow).norm() / shadow.norm()).item() < 2.0**-4
    for mutant in (_NoWrite, _Transposed):
        bad, _, _ = _least_squares(_fp8(mutant))
        assert ((bad - ref).abs() / ref).max().item() > 0.1, f"{mutant.__name__} passed the bound"


# ------------------------------------------------------------------------ compiled, saved, loaded
@pytest.mark.two_computations
def test_compiled_fp8_step_equals_eager_and_lr_changes_do_not_recompile():
    from torch._dynamo.utils import counters

    shape = (64, 256)
    p_eager, p_comp, p0 = _matrix(shape), _matrix(shape), _matrix(shape)
    eager = FP8Optim(torch.optim.Muon([p_eager], lr=0.02), opt_level=1, compile=False)
    comp = FP8Optim(torch.optim.Muon([p_comp], lr=0.02), opt_level=1, backend="compile")
    torch._dynamo.reset()
    counters.clear()
    for step, grad in enumerate(_grads(shape, 3)):
        for opt, p in ((eager, p_eager), (comp, p_comp)):
            opt.param_groups[0]["lr"] = 0.02 / (step + 1)
            p.grad = last_bits(grad) if opt is comp else grad.clone()
            opt.step()
    assert comp.backends.compile and comp.step_backends() == {"compile": (1, 1)}
    assert counters["stats"]["unique_graphs"] == 1
    # The same formulas, reduced in another order (the norm, the fused lerp): ~1e-6 of the update
    # (measured 1.5e-6). A last-bit difference can land one of the 16384 e4m3 codes a quantum
    # away (~2^-19 of them a step; 2^-3 of that element): <= 2^-3 / sqrt(16384) = 1e-3 of the
    # buffer's norm, which Newton-Schulz (normalized, smooth) passes on at about that size. 2e-3
    # leaves a factor 2; a wrong coefficient, lr factor or Nesterov term moves it by > 1e-2.
    moved = (p_eager - p0).norm()
    assert ((p_comp - p_eager).norm() / moved).item() < 2e-3


def _pair(seed=0):
    """A Muon-sized matrix (FP8 momentum) and a small one (fp32, stepped by torch.optim.Muon)."""
    return [_matrix((128, 64), seed), _matrix((8, 8), seed + 1)]


def _run(opt, params, grads):
    for grad in grads:
        for p, g in zip(params, grad):
            p.grad = g.clone()
        opt.step()


def test_state_dict_round_trip_resumes_bit_for_bit():
    grads = [[torch.randn(128, 64, generator=torch.Generator().manual_seed(s)),
              torch.randn(8, 8, generator=torch.Generator().manual_seed(100 + s))] for s in range(6)]
    a = _pair()
    opt_a = FP8Optim(torch.optim.Muon(a, lr=0.02), opt_level=1, compile=False)
    _run(opt_a, a, grads[:3])
    assert isinstance(opt_a.state[a[0]]["momentum_buffer"], FP8Tensor)
    assert not isinstance(opt_a.state[a[1]]["momentum_buffer"], FP8Tensor)  # 64 elements: fp32
    blob = io.BytesIO()
    torch.save(opt_a.state_dict(), blob)
    b = [nn.Parameter(p.detach().clone()) for p in a]
    opt_b = FP8Optim(torch.optim.Muon(b, lr=0.02), opt_level=1, compile=False)
    opt_b.load_state_dict(torch.load(io.BytesIO(blob.getvalue()), weights_only=True))
    _run(opt_a, a, grads[3:])
    _run(opt_b, b, grads[3:])
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)
    ma, mb = opt_a.state[a[0]]["momentum_buffer"], opt_b.state[b[0]]["momentum_buffer"]
    assert torch.equal(ma.codes.view(torch.uint8), mb.codes.view(torch.uint8)) and torch.equal(ma.scale, mb.scale)


@pytest.mark.parametrize("shape", [(12, 5), (5, 12)])
def test_normuon_evens_the_neurons_and_keeps_the_norm(shape):
    """NorMuon's first step from a zero EMA: every neuron (a row of a tall matrix, a column of a
    wide one) ends with the same RMS, the update's Frobenius norm unchanged, and the EMA is
    (1 - beta2) x each neuron's mean square; float64 by hand, to 1e-6 relative (fp32 rounding of
    a few dozen products). With ok False the EMA stays as it was."""
    o = torch.randn(*shape, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.1, 3, shape[0])[:, None]
    dim = -1 if shape[0] >= shape[1] else -2
    v = torch.zeros((shape[0], 1) if dim == -1 else (1, shape[1]))
    out = normalize_neurons(o, v, 0.9)
    want_v = 0.1 * o.double().square().mean(dim=dim, keepdim=True)
    assert torch.allclose(v.double(), want_v, rtol=1e-6)
    neuron_rms = out.double().square().mean(dim=dim).sqrt()
    assert torch.allclose(neuron_rms, torch.full_like(neuron_rms, o.double().norm() / o.numel() ** 0.5), rtol=1e-6)
    before = v.clone()
    normalize_neurons(o * 2, v, 0.9, ok=torch.tensor(False))
    assert torch.equal(v, before)


def test_a_normuon_fp8_optimizer_resumes_bit_for_bit():
    """--muon_normuon's EMA is optimizer state: saved, loaded, and the steps after equal."""
    grads = [[torch.randn(128, 64, generator=torch.Generator().manual_seed(s)),
              torch.randn(8, 8, generator=torch.Generator().manual_seed(100 + s))] for s in range(6)]

    def make(params):
        opt = torch.optim.Muon(params, lr=0.02)
        opt.param_groups[0]["normuon"] = 0.9
        return FP8Optim(opt, opt_level=1, compile=False)

    a = _pair()
    opt_a = make(a)
    _run(opt_a, a, grads[:3])
    assert opt_a.state[a[0]]["neuron_variance"].shape == (128, 1)
    blob = io.BytesIO()
    torch.save(opt_a.state_dict(), blob)
    b = [nn.Parameter(p.detach().clone()) for p in a]
    opt_b = make(b)
    opt_b.load_state_dict(torch.load(io.BytesIO(blob.getvalue()), weights_only=True))
    _run(opt_a, a, grads[3:])
    _run(opt_b, b, grads[3:])
    assert all(torch.equal(pa, pb) for pa, pb in zip(a, b))
    assert torch.equal(opt_a.state[a[0]]["neuron_variance"], opt_b.state[b[0]]["neuron_variance"])


def test_fp32_muon_state_converts_to_fp8_and_back():
    grads = [[torch.randn(128, 64, generator=torch.Generator().manual_seed(s)), torch.randn(8, 8)] for s in range(3)]
    plain_params = _pair()
    plain = torch.optim.Muon(plain_params, lr=0.02)
    _run(plain, plain_params, grads)
    buf = plain.state[plain_params[0]]["momentum_buffer"]
    fp8_params = [nn.Parameter(p.detach().clone()) for p in plain_params]
    fp8 = FP8Optim(torch.optim.Muon(fp8_params, lr=0.02), opt_level=1, compile=False)
    fp8.load_state_dict(plain.state_dict())
    loaded = fp8.state[fp8_params[0]]["momentum_buffer"]
    expected = E4M3Blocks(1).quantize(buf)  # the one quantizer, which the step writes with
    assert isinstance(loaded, FP8Tensor)
    assert torch.equal(loaded.codes.view(torch.uint8), expected.codes.view(torch.uint8))
    assert torch.equal(loaded.scale, expected.scale)
    assert torch.equal(fp8.state[fp8_params[1]]["momentum_buffer"], plain.state[plain_params[1]]["momentum_buffer"])
    # back: a level-0 wrapper (torch.optim.Muon steps) holds the values the codes stand for
    back_params = [nn.Parameter(p.detach().clone()) for p in plain_params]
    back = OptimWrapper(torch.optim.Muon(back_params, lr=0.02), compile=False)
    back.load_state_dict(fp8.state_dict())
    dense = back.state[back_params[0]]["momentum_buffer"]
    assert type(dense) is torch.Tensor and torch.equal(dense, loaded.dequantize())
    _run(back, back_params, grads[:1])  # and it steps
    _run(fp8, fp8_params, grads[:1])


# ------------------------------------------------------------------------ a whole model
def _d2(**over) -> GPT:
    with torch.device("meta"):
        return GPT(dataclasses.replace(preset_config("d2", vocab_size=320, seq_len=32), **over))


def test_param_split_on_the_d2_gpt():
    split = muon_param_groups(_d2())
    where = {pl.name: pl.optimizer for pl in split.placements}
    blocks = [f"transformer.h.{i}.{m}.weight" for i in range(2)
              for m in ("attn.c_q", "attn.c_k", "attn.c_v", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert sorted(n for n, o in where.items() if o == "muon") == sorted(blocks)
    assert {n: o for n, o in where.items() if o != "muon"} == {"transformer.wte.weight": "adamw",
                                                                "lm_head.weight": "adamw"}
    reasons = {pl.name: pl.reason for pl in split.placements}
    assert reasons["lm_head.weight"] == "output head" and reasons["transformer.wte.weight"] == "nn.Embedding"
    assert "muon: 12 tensors / 393,216 params" in split.summary()

    tied = _d2(tie_embeddings=True, norm_weight=True, qkv_bias=True)
    split = muon_param_groups(tied)
    grouped = [p for g in split.muon + split.adamw for p in g["params"]]
    assert len(grouped) == len({id(p) for p in grouped}) == len(list(tied.parameters()))
    assert sum(pl.optimizer == "muon" for pl in split.placements) == 12
    reasons = {pl.name: pl.reason for pl in split.placements}
    assert reasons["transformer.wte.weight"] == "nn.Embedding (tied with the output head)"
    assert "lm_head.weight" not in reasons  # the tied weight is listed once, as the embedding
    assert reasons["transformer.h.0.attn.c_q.bias"].startswith("1-D")
    roles = {g["role"]: g for g in split.muon + split.adamw}
    assert list(roles) == ["matrix", "embedding", "vector"]  # tied: no head of its own
    assert roles["embedding"]["weight_decay"] == roles["vector"]["weight_decay"] == 0.0
    assert [p is tied.transformer.wte.weight for p in roles["embedding"]["params"]] == [True]
    assert all(p.ndim == 1 for p in roles["vector"]["params"])
    untied = muon_param_groups(_d2())
    assert [g["role"] for g in untied.adamw] == ["head", "embedding"]  # no norm weights or biases at d2
    assert "weight_decay" not in untied.adamw[0]  # the head decays at AdamW's rate


class _Tiny(nn.Module):
    """An embedding, a hidden Linear, a norm, and a head found by its vocabulary (no lm_head)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.hidden, self.norm, self.out = nn.Embedding(64, 32), nn.Linear(32, 32), nn.LayerNorm(32), \
            nn.Linear(32, 64)

    def forward(self, idx):
        return self.out(self.norm(torch.relu(self.hidden(self.emb(idx)))))


def _muon_adamw(model):
    split = muon_param_groups(model)
    return torch.optim.Muon(split.muon, lr=0.02), torch.optim.AdamW(split.adamw, lr=1e-3, weight_decay=0.1)


def _train(model, opt, scheds, steps, start=0):
    for s in range(start, start + steps):
        idx = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(s))
        nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
        for o in opt:
            o.step()
            o.zero_grad()
        for sched in scheds:
            sched.step()


def test_muon_adamw_steps_both_resumes_and_refuses():
    a, b = _Tiny(), _Tiny()
    split = muon_param_groups(a)
    assert [pl.name for pl in split.placements if pl.optimizer == "muon"] == ["hidden.weight"]
    assert dict((pl.name, pl.reason) for pl in split.placements)["out.weight"] == "output head"
    both = MuonAdamW(*_muon_adamw(a))
    apart = _muon_adamw(b)
    decay = lambda s: 1 - s / 10  # noqa: E731
    _train(a, [both], [torch.optim.lr_scheduler.LambdaLR(both, decay)], 3)
    _train(b, apart, [torch.optim.lr_scheduler.LambdaLR(o, decay) for o in apart], 3)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert optimizer_state_bytes(both) == sum(optimizer_state_bytes(o) for o in apart) == 4 * 32 * 32 + 8 * (
        sum(p.numel() for p in a.parameters()) - 32 * 32)

    blob = io.BytesIO()
    torch.save(both.state_dict(), blob)
    c = copy.deepcopy(a)
    resumed = MuonAdamW(*_muon_adamw(c))
    resumed.load_state_dict(torch.load(io.BytesIO(blob.getvalue()), weights_only=True))
    for opt in (both, resumed):  # a schedule after the resume reaches the members' loaded groups
        for group in opt.param_groups:
            group["lr"] *= 0.5
    assert [g["lr"] for g in resumed.muon.param_groups + resumed.adamw.param_groups] == \
        [g["lr"] for g in both.param_groups]
    _train(a, [both], [], 2, start=3)
    _train(c, [resumed], [], 2, start=3)
    for pa, pc in zip(a.parameters(), c.parameters()):
        assert torch.equal(pa, pc)

    # a wrapped member's fallbacks are the container's: the 32x32 matrix keeps fp32 momentum
    wrapped = MuonAdamW(FP8Optim(torch.optim.Muon(muon_param_groups(c).muon), opt_level=1),
                        torch.optim.AdamW(muon_param_groups(c).adamw))
    assert [n for n in optimizer_fallbacks(wrapped) if "numel < 4096" in n] != []
    with pytest.raises(ValueError, match="appear in both the Muon and the AdamW optimizer"):
        MuonAdamW(torch.optim.Muon([a.hidden.weight]), torch.optim.AdamW([a.hidden.weight, a.norm.weight]))
    with pytest.raises(ValueError, match="holds 'muon' and 'adamw'"):
        resumed.load_state_dict(resumed.muon.state_dict())
    with pytest.raises(ValueError, match="add the group to MuonAdamW.muon"):
        resumed.add_param_group(dict(params=[nn.Parameter(torch.zeros(2))]))


# ------------------------------------------------------------------------ bytes, refusals
def test_state_bytes_per_parameter():
    n = 256 * 256
    for level, per_param in ((0, 4.0), (1, 1 + 4 / 256), (2, 1 + 4 / 256)):
        p = _matrix((256, 256))
        opt = FP8Optim(torch.optim.Muon([p], lr=0.02), opt_level=level, compile=False)
        planned = optimizer_state_bytes(opt)
        p.grad = torch.randn(256, 256)
        opt.step()
        assert planned == optimizer_state_bytes(opt) == per_param * n, level
        assert opt.state_bytes_per_param() == per_param
    plain = torch.optim.Muon([_matrix((256, 256))], lr=0.02)
    assert optimizer_state_bytes(plain) == 4 * n  # one moment, not Adam's two


def test_unsupported_muon_settings_are_refused():
    p = _matrix((128, 64))
    with pytest.raises(ValueError, match=r"keeps the parameters in torch.bfloat16.*model.to\(torch.bfloat16\)"):
        FP8Optim(torch.optim.Muon([p]), opt_level=1, master_weights="bf16")  # an fp32 matrix
    plain = MuonAdamW(*_muon_adamw(_Tiny()))
    with pytest.raises(ValueError, match="step_in_backward needs both members wrapped"):
        plain.step_in_backward()
