"""bf16 master weights and the optimizer step inside the backward, against references:

- bf16_split: the joined master equals, bit for bit, an fp32-master run of the same code fed
  the same (bf16-representable) gradients;
- round to nearest stalls where fp32 moves (an update below half a bf16 step), stochastic
  rounding tracks fp32 on average (error bound stated below), split tracks it exactly;
- the step inside the backward equals the step after it (same kernels, bit for bit), frees
  every gradient, and leaves a parameter with a non-finite gradient untouched;
- the trainer: measured training-state bytes equal the memory plan's, a resumed run equals an
  uninterrupted one bit for bit, the in-backward step reads the device once; a step in which one
  parameter's gradient is NaN moves every other parameter, names that one and is not a skipped
  step, a step in which every gradient is NaN moves nothing and is (only those count toward
  --max_bad_steps, and a step that updated weights ends a run of them); the counts are the step
  guard's (TrainResult.guard_stats), none in fp8_stats without FP8.
The C kernel against the Python step per mode: tests/test_fp8_optim_master.py.
"""


import pytest
import torch

from nanochat.config import TrainConfig
from nanochat.optim import master as M
from nanochat.optim import FP8Optim
from nanochat.train.trainer import NanoChatTrainer
from tests.conftest import run_records, tiny_train_kwargs, train_until_first_save
from tests.test_trainer import _losses, count_reads_per_step

MODES = ("bf16", "bf16_sr", "bf16_split")


def _model(dtype):
    torch.manual_seed(0)
    # 128 x 64 = 8192 elements: FP8 state at levels 1-2; the LayerNorm keeps fp32 moments
    # initial weights bf16 values in every dtype: fp32 and bf16 runs start from the same master
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.Linear(128, 64))
    return model.to(torch.bfloat16).to(dtype)


def _grads(model, steps):
    """Per step, one bf16-representable gradient per parameter (the same for every run)."""
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(p.shape, generator=gen).bfloat16() for p in model.parameters()] for _ in range(steps)]


def _run(master, level, backend, grads, *, seed=0):
    model = _model(torch.float32 if master == "fp32" else torch.bfloat16)
    opt = FP8Optim(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), opt_level=level,
                   backend=backend, master_weights=master, seed=seed)
    if master == "fp32":  # our step for every tensor (not torch's AdamW for the fp32-state ones),
        opt.step_in_backward()  # as bf16 masters have; the hooks never fire: no backward here
    for gs in grads:
        for p, g in zip(model.parameters(), gs):
            p.grad = g.to(p.dtype)
        opt.step()
    return model, opt


@pytest.mark.parametrize("level,backend", [(0, "eager"), (2, "eager"), (2, "native")])
def test_split_master_is_the_fp32_master_bit_for_bit(level, backend):
    """The reference runs the same kernel (level 0 has no FP8 state, so no native kernel)."""
    grads = _grads(_model(torch.float32), 6)
    ref, _ = _run("fp32", level, backend, grads)
    split, opt = _run("bf16_split", level, backend, grads)
    for p_ref, p, in zip(ref.parameters(), split.parameters()):
        master = M.join(p, opt.state[p]["master_lo"])
        assert torch.equal(master.view(torch.int32), p_ref.detach().view(torch.int32))
        # the weight the model sees: the master's top half (truncated, at most one bf16 step off)
        assert torch.equal(p.view(torch.int16), (p_ref.detach().view(torch.int32) >> 16).to(torch.int16))


@pytest.mark.parametrize("backend", ["eager", "native"])
def test_round_to_nearest_stalls_where_sr_and_split_follow_fp32(backend):
    """Weights at 1.0, lr 1e-3, a constant gradient: Adam moves each weight by ~lr a step, less
    than half a bf16 step below 1.0 (2^-9), so round to nearest never moves; fp32 goes to ~0.95
    in 50 steps; stochastic rounding's mean over 16K weights follows fp32 (each weight's error
    is a sum of 50 independent roundings of at most one step 2^-8: sd ~0.014, the mean's ~1e-4;
    the bound 2e-3 is ~15 sd) and split equals it."""
    def run(master, steps=50):
        p = torch.nn.Parameter(torch.ones(16384, dtype=torch.float32 if master == "fp32" else torch.bfloat16))
        opt = FP8Optim(torch.optim.Adam([p], lr=1e-3), opt_level=2, backend=backend, master_weights=master, seed=5)
        for _ in range(steps):
            p.grad = torch.ones_like(p)
            opt.step()
        return p, opt

    fp32 = run("fp32")[0].detach()
    assert abs(fp32.mean().item() - 0.95) < 1e-3
    rne = run("bf16")[0]
    assert torch.all(rne == 1.0)  # stale: every update was rounded away
    sr = run("bf16_sr")[0]
    assert abs(sr.float().mean().item() - fp32.mean().item()) < 2e-3
    assert len(sr.unique()) > 1  # the weights spread: independent roundings
    split, opt = run("bf16_split")
    assert torch.allclose(M.join(split, opt.state[split]["master_lo"]), fp32, rtol=0, atol=1e-6)


def test_stochastic_rounding_is_seeded_and_reproducible():
    grads = _grads(_model(torch.float32), 4)
    a, _ = _run("bf16_sr", 2, "native", grads, seed=7)
    b, _ = _run("bf16_sr", 2, "native", grads, seed=7)
    c, _ = _run("bf16_sr", 2, "native", grads, seed=8)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))


@pytest.mark.parametrize("master", MODES)
def test_native_kernel_and_compiled_step_agree(master):
    """Same state, same gradients, one step: the C kernel and the compiled step differ only by
    fp32 rounding, so the bf16 weights agree to one bf16 step (measured: all but a few equal)."""
    grads = _grads(_model(torch.float32), 1)
    a, _ = _run(master, 2, "native", grads)
    b, _ = _run(master, 2, "compile", grads)
    for x, y in zip(a.parameters(), b.parameters()):
        step = torch.finfo(torch.bfloat16).eps * y.float().abs().clamp(min=1e-30)
        assert torch.all((x.float() - y.float()).abs() <= step * 2)
        assert (x == y).float().mean() > 0.99


def test_round_rne_is_the_bf16_cast_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 18, generator=gen) * torch.exp2(torch.randint(-140, 120, (1 << 18,), generator=gen).float())
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.4e38, -3.4e38, 1e-45, 1.00390625,
                            1.01171875, -1.00390625, 2.0**-133])  # ties to even, overflow, subnormals
    x = torch.cat([x, special])
    assert torch.equal(M.round_rne(x).view(torch.int32), x.to(torch.bfloat16).float().view(torch.int32))
    assert torch.isnan(M.round_rne(torch.tensor([float("nan")]))).all()


@pytest.mark.parametrize("backend", ["eager", "compile"])
@pytest.mark.parametrize("master", MODES)
def test_emulation_is_bf16_storage_in_every_backend(master, backend):
    """--master_weights_emulate (fp32 tensors holding bf16 values, gradients rounded to bf16) against
    real bf16 parameters fed the same gradients: the weights stay bf16 values and equal the bf16
    run's; bit for bit eagerly (the same arithmetic), to one bf16 step compiled (different kernels
    for the two dtypes; measured: all equal). The gradients are not bf16 values, so their rounding
    is tested too: a compiler drops an fp32 -> bf16 -> fp32 cast unless it is written in integers."""
    gen = torch.Generator().manual_seed(2)
    init = torch.randn(256, 64, generator=gen).bfloat16()
    grads = [torch.randn(256, 64, generator=gen) for _ in range(4)]

    def run(dtype):  # one tensor, fp32 moments: one compiled graph per dtype (the rounding is shared)
        p = torch.nn.Parameter(init.to(dtype))
        opt = FP8Optim(torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1), opt_level=0,
                       backend=backend, master_weights=master, seed=3, emulate=dtype == torch.float32)
        for g in grads:
            p.grad = g.to(dtype)
            opt.step()
        return [p.detach().float()]

    for emulated, real in zip(run(torch.float32), run(torch.bfloat16)):
        assert torch.equal(emulated.bfloat16().float(), emulated)  # bf16 values, every one
        if backend == "eager":
            assert torch.equal(emulated, real)
        else:
            step = torch.finfo(torch.bfloat16).eps * real.abs().clamp(min=1e-30)
            assert torch.all((emulated - real).abs() <= step * 2)
            assert (emulated == real).float().mean() > 0.99


def test_emulated_round_to_nearest_stalls_compiled():
    """The stale update under emulation, through the compiled step: weights at 1.0 (bf16 values in
    fp32 tensors), updates of ~lr 1e-3 below half a bf16 step: they never move."""
    p = torch.nn.Parameter(torch.ones(16384))
    opt = FP8Optim(torch.optim.Adam([p], lr=1e-3), opt_level=0, backend="compile", master_weights="bf16",
                   emulate=True)
    for _ in range(10):
        p.grad = torch.ones_like(p)
        opt.step()
    assert torch.all(p == 1.0)


@pytest.mark.parametrize("backend", ["eager", "native"])
@pytest.mark.parametrize("master", ["fp32", "bf16_sr"])
def test_step_in_backward_equals_the_step_after_it(master, backend):
    dtype = torch.float32 if master == "fp32" else torch.bfloat16
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    results = []
    for in_backward in (False, True):
        model = _model(dtype)
        opt = FP8Optim(torch.optim.AdamW(model.parameters(), lr=1e-2), opt_level=2, backend=backend,
                       master_weights=master, seed=3)
        handles = opt.step_in_backward()  # fp32 too: our step for the fp32-state tensors as well
        if not in_backward:
            for h in handles:
                h.remove()
        for _ in range(4):
            model(x).float().pow(2).mean().backward()
            if in_backward:
                assert all(p.grad is None for p in model.parameters())  # freed as they were used
                norm, skipped = opt.backward_stats().tolist()
                assert skipped == 0 and norm > 0
            else:
                opt.step()
                opt.zero_grad()
        results.append(model)
        if in_backward:
            assert opt.max_live_grad_bytes == 128 * 64 * dtype.itemsize  # the largest gradient
    assert all(torch.equal(a, b) for a, b in zip(results[0].parameters(), results[1].parameters()))


def test_a_nonfinite_gradient_leaves_its_parameter_untouched():
    model = _model(torch.bfloat16)
    opt = FP8Optim(torch.optim.AdamW(model.parameters(), lr=1e-2), opt_level=2, master_weights="bf16_split")
    opt.step_in_backward()
    first = model[0].weight
    x = torch.randn(8, 64).bfloat16()
    model(x).float().sum().backward()  # one good step: every parameter has state
    before = {p: p.detach().clone() for p in model.parameters()}
    state_before = {k: (v.codes.clone() if hasattr(v, "codes") else v.clone()) for k, v in opt.state[first].items()}
    first.register_hook(lambda g: torch.full_like(g, float("nan")))  # poison one gradient
    model(x).float().sum().backward()
    norm, skipped = opt.backward_stats().tolist()
    assert skipped == 1 and norm > 0
    assert torch.equal(first, before[first])
    for k, v in opt.state[first].items():
        assert torch.equal(v.codes if hasattr(v, "codes") else v, state_before[k]), k
    assert all(not torch.equal(p, before[p]) for p in model.parameters() if p is not first)


def test_bad_combinations_are_refused_with_the_fix():
    bf16 = _model(torch.bfloat16)
    with pytest.raises(ValueError, match="SGD"):
        FP8Optim(torch.optim.SGD(bf16.parameters(), lr=0.1, momentum=0.9), master_weights="bf16_sr")
    with pytest.raises(ValueError, match=r"model.to\(torch.bfloat16\)"):
        FP8Optim(torch.optim.AdamW(_model(torch.float32).parameters()), master_weights="bf16")
    with pytest.raises(ValueError, match="master_weights must be one of"):
        FP8Optim(torch.optim.AdamW(bf16.parameters()), master_weights="fp16")
    with pytest.raises(ValueError, match="--grad_accum_steps 1"):
        TrainConfig(optimizer_in_backward=True, grad_clip=0.0, grad_accum_steps=2)
    with pytest.raises(ValueError, match="--grad_clip 0"):
        TrainConfig(optimizer_in_backward=True)
    with pytest.raises(ValueError, match="--master_weights bf16"):
        TrainConfig(master_weights_emulate=True)


# ---------------------------------------------------------------------------------- the trainer
@pytest.mark.parametrize("extra", [
    dict(master_weights="bf16", fp8=True, fp8_emulate=True, fp8_layers="all", fp8_opt_level=2),
    dict(master_weights="bf16_split", fp8=True, fp8_emulate=True, fp8_layers="all", fp8_opt_level=2),
    dict(master_weights="bf16_sr", optimizer_in_backward=True, grad_clip=0.0),
], ids=["bf16-level2", "split-level2", "sr-in-backward"])
def test_measured_state_bytes_match_the_plan(small_corpus, tmp_path, extra):
    t = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "run", num_iterations=2, num_samples=0,
                                            **extra))
    r = t.train()
    assert r.state_bytes["weights"] == t.memory_plan.weights
    assert r.state_bytes["optimizer"] == t.memory_plan.optimizer
    if not extra.get("optimizer_in_backward"):  # in the backward: the plan's bound, not the count
        assert r.state_bytes["gradients"] == t.memory_plan.gradients
        assert r.state_bytes_per_param == pytest.approx(t.memory_plan.state_bytes_per_param, rel=1e-9)
    assert r.state_bytes_per_param < {"bf16": 6.5, "bf16_split": 8.5, "bf16_sr": 12.5}[extra["master_weights"]]


@pytest.mark.parametrize("extra", [
    dict(master_weights="bf16_sr", fp8=True, fp8_emulate=True, fp8_layers="all", fp8_opt_level=2),
    dict(master_weights="bf16_split", optimizer_in_backward=True, grad_clip=0.0),
], ids=["sr-level2", "split-in-backward"])
def test_resume_is_bitwise_identical(small_corpus, tmp_path, monkeypatch, extra):
    """What a checkpoint holds (the bf16 weights, bf16_split's remainders, step counts; bf16_sr's
    bits derive from --seed and the step) resumes exactly: eager, the same code twice."""
    kw = dict(num_iterations=6, save_every=3, num_samples=0, **extra)
    NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "full", **kw)).train()
    train_until_first_save(tiny_train_kwargs(small_corpus, tmp_path / "cut", **kw), monkeypatch)
    NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "cut", resume=True, **kw)).train()
    assert _losses(tmp_path / "cut") == _losses(tmp_path / "full")
    full = torch.load(tmp_path / "full" / "checkpoint-000006.pt", weights_only=True)["model"]
    cut = torch.load(tmp_path / "cut" / "checkpoint-000006.pt", weights_only=True)["model"]
    assert all(torch.equal(full[k], cut[k]) for k in full)


def test_the_in_backward_step_reads_the_device_once(small_corpus, tmp_path):
    kw = tiny_train_kwargs(small_corpus, tmp_path / "reads", num_iterations=5, fp8=True, fp8_emulate=True,
                           fp8_layers="all", fp8_opt_level=2, fp8_stats_every=0, num_samples=0,
                           master_weights="bf16_sr", optimizer_in_backward=True, grad_clip=0.0)
    assert count_reads_per_step(NanoChatTrainer(**kw)) == [1] * 5


POISONED = "transformer.h.1.mlp.c_fc.weight"
EVERY_GRADIENT_NAN, ONE_GRADIENT_NAN = (1, 4), 3  # steps


class NonFiniteGradients(NanoChatTrainer):
    """Makes gradients NaN from a hook: every parameter's at EVERY_GRADIENT_NAN, POISONED's at
    ONE_GRADIENT_NAN. Keeps a copy of the parameters before the first step and after each one."""

    def _setup(self):
        super()._setup()
        step = {"n": 0}
        self.model.register_forward_pre_hook(lambda module, args: step.update(n=step["n"] + 1))
        for name, p in self.model.named_parameters():
            p.register_hook(lambda g, name=name: torch.full_like(g, float("nan")) if step["n"] in EVERY_GRADIENT_NAN
                            or (step["n"] == ONE_GRADIENT_NAN and name == POISONED) else g)
        self.weights = [{n: p.detach().clone() for n, p in self.model.named_parameters()}]

    def train_step(self, step):  # after each step, skipped ones too
        record = super().train_step(step)
        self.weights.append({n: p.detach().clone() for n, p in self.model.named_parameters()})
        return record


def test_in_backward_step_with_some_nonfinite_gradients_is_not_a_skipped_step(small_corpus, tmp_path):
    """--optimizer_in_backward over 5 steps, --max_bad_steps 2. Step 3, one parameter's
    gradient NaN: that parameter keeps its value, every other one moves, the record names it
    (skipped_params 1, skipped_param_names) and the step is not a skipped step. Steps 1 and 4,
    every gradient NaN: nothing moves and each is a skipped step. Two skipped steps, never two
    in a row (steps 2 and 3 updated weights), so the run finishes."""
    t = NonFiniteGradients(**tiny_train_kwargs(small_corpus, tmp_path / "run", num_iterations=5, num_samples=0,
                                               optimizer_in_backward=True, grad_clip=0.0, max_bad_steps=2))
    r = t.train()
    records = {rec["step"]: rec for rec in run_records(tmp_path / "run") if "loss" in rec and "step" in rec}
    names = list(t.weights[0])
    step = ONE_GRADIENT_NAN
    assert records[step]["skipped_params"] == 1 and records[step]["skipped_param_names"] == [POISONED]
    assert "skipped" not in records[step]
    before, after = t.weights[step - 1], t.weights[step]
    assert torch.equal(after[POISONED], before[POISONED])
    assert all(not torch.equal(after[n], before[n]) for n in names if n != POISONED)
    for step in EVERY_GRADIENT_NAN:
        assert records[step]["skipped"] is True and records[step]["skipped_params"] == len(names)
        assert all(torch.equal(t.weights[step][n], t.weights[step - 1][n]) for n in names)
    assert all("skipped_params" not in records[s] for s in (2, 5))
    assert r.steps == 5 and r.guard_stats["skipped_steps"] == 2 and r.guard_stats["overflow_events"] == 2
    assert r.fp8_stats is None  # no FP8 in this run: the guard's counts are not FP8's
