"""MXFP8 (`recipe` mxfp8, mxfp8_wgrad_hp) through nanochat.fp8, on CPU with torchao's EMULATED kernels.

What is checked against what:
* conversion gives torchao's own MX layers (`MXFP8Linear`, EMULATED kernels, RCEIL scales,
  `wgrad_with_hp` for mxfp8_wgrad_hp) over the very Parameters of the model, with finite
  gradients; a Linear whose dims are not multiples of 32 stays in high precision with that reason;
* numerics: nanochat's MXLinear equals torchao's MXFP8Linear bit for bit (output and both
  gradients: the casts and GEMMs are torchao's, not ours); against the same fp32 nn.Linear the
  output and both gradients keep >= MX_DB (argued below), and <= 40 dB: they really are e4m3;
  mxfp8_wgrad_hp's weight gradient is the fp32 one; on gaussian tensors block scales do no worse
  than one scale per row (rowwise: within 0.5 dB; measured equal to 0.01 dB, since both scales
  are powers of two and a power-of-two scale changes no normal value's relative rounding: the two
  differ only where values fall to e4m3's subnormals, which test_fp8_stats.py counts);
* `mode` e5m2 and auto are refused with the MXFP8 recipes in one line naming the fix, and so is a
  token count that is not a multiple of 32 (in the config and in the layer's forward);
* the memory plan's premise: an MX layer keeps for its backward what a plain nn.Linear keeps
  (nanochat.train.memory counts no FP8 part).
The hardware rule, `layers` faster, statistics, the trainer, FSDP2 and export with MXFP8 are in
test_fp8_hardware.py, test_fp8_policy.py, test_fp8_stats.py, test_trainer_fp8.py,
test_distributed.py and test_hf_fp8.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.quantization.quantize_.common import KernelPreference

from nanochat.config import TrainConfig
from nanochat.fp8 import FP8Config, MXLinear, convert, fp8_disabled, restore_fp8
from tests.conftest import sqnr_db

MX = ("mxfp8", "mxfp8_wgrad_hp")
MX_DB = 26.5
"""Floor for an MX layer's output and gradients against fp32 on gaussian tensors. One e4m3 cast of
a normal value errs by at most 2^-4 of it (3 mantissa bits, round to nearest): uniform over the
binade that is ~31.5 dB for one cast (this file's stats table and BENCHMARKS.md section 8(c)
measure 31.3-32.5 dB). RCEIL's power-of-two block scale puts each block's amax in (224, 448], so
almost nothing falls to e4m3's subnormals and the figure is a single cast's. A GEMM's result
carries two independent casts' noise: ~28.5 dB, measured 28.5-29.1 dB (5 seeds, the three
tensors); the floor sits 2 dB under, while a wrong scale or e5m2 in place of e4m3 (-6 dB) lands
below it."""


class _Model(nn.Module):
    """Two MX-eligible Linears (one with a bias), one whose in_features (48) is a multiple of 16
    but not of 32, and an lm_head skipped by name."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(256, 512, bias=False)
        self.down = nn.Linear(512, 256, bias=True)
        self.odd = nn.Linear(48, 256, bias=False)
        self.lm_head = nn.Linear(256, 320, bias=False)

    def forward(self, x):
        return self.lm_head(self.down(torch.relu(self.up(x))) + self.odd(x[..., :48]))


def _fwd_bwd(model: nn.Sequential, x: torch.Tensor, g: torch.Tensor):
    x = x.clone().requires_grad_()
    y = model(x)
    y.backward(g)
    return y.detach(), x.grad, model[0].weight.grad


@pytest.mark.parametrize("recipe", MX)
def test_convert_gives_torchaos_mx_layers_over_the_same_parameters(recipe):
    torch.manual_seed(0)
    model = _Model()
    params = dict(model.named_parameters())
    report = convert(model, recipe=recipe, emulate=True, layers="all", min_dim=16)
    assert report.converted == ["up", "down"] and report.backend == "emulated"
    assert "divisible by 32" in report.skipped["odd"] and "skip_fqns" in report.skipped["lm_head"]
    for name in ("up", "down"):
        layer = model.get_submodule(name)
        assert isinstance(layer, MXLinear) and isinstance(layer, MXFP8Linear)  # torchao's layer
        assert layer.kernel_preference is KernelPreference.EMULATED
        assert layer.scale_calculation_mode is ScaleCalculationMode.RCEIL
        assert layer.wgrad_with_hp is (recipe == "mxfp8_wgrad_hp")
    assert dict(model.named_parameters()) == params  # the same Parameter objects: optimizer state stays valid
    reason = dict((la.name, la.reason) for la in report.layers)["up"]
    assert reason.startswith("input e4m3, weight e4m3, grad_output e4m3, one e8m0 scale per 32 values")
    assert ("grad_weight GEMM in high precision" in reason) is (recipe == "mxfp8_wgrad_hp")

    model(torch.randn(2, 32, 256)).square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    restore_fp8(model)
    assert type(model.up) is nn.Linear and dict(model.named_parameters()) == params


@pytest.mark.parametrize("recipe", MX)
def test_mx_layer_is_torchaos_mxfp8_linear_bit_for_bit(recipe):
    """The same casts and GEMMs as torchao's own layer: equal, not close."""
    torch.manual_seed(1)
    ours = nn.Sequential(nn.Linear(256, 512, bias=True))
    ref = MXFP8Linear(256, 512, bias=True, kernel_preference=KernelPreference.EMULATED,
                      scale_calculation_mode=ScaleCalculationMode.RCEIL, wgrad_with_hp=recipe == "mxfp8_wgrad_hp")
    ref.load_state_dict(ours[0].state_dict())
    convert(ours, recipe=recipe, emulate=True, layers="all", min_dim=16)
    x, g = torch.randn(4, 32, 256), torch.randn(4, 32, 512)
    for a, b in zip(_fwd_bwd(ours, x, g), _fwd_bwd(nn.Sequential(ref), x, g)):
        assert torch.equal(a, b)
    assert torch.equal(ours[0].bias.grad, ref.bias.grad)


@pytest.mark.parametrize("recipe", MX)
def test_mx_numerics_against_the_fp32_linear(recipe):
    """Output, grad input, grad weight vs the fp32 layer (5 seeds): within MX_DB and 40 dB; the
    worst over seeds at least rowwise's (one e4m3 scale per row) minus 0.5 dB."""
    worst = {r: [math.inf] * 3 for r in (recipe, "rowwise")}
    for seed in range(5):
        torch.manual_seed(seed)
        ref = nn.Sequential(nn.Linear(256, 256, bias=False))
        x, g = torch.randn(128, 256), torch.randn(128, 256)
        want = _fwd_bwd(ref, x, g)
        for r in worst:
            fp8 = copy.deepcopy(ref)
            fp8[0].weight.grad = None
            convert(fp8, recipe=r, emulate=True, layers="all", min_dim=16)
            got = _fwd_bwd(fp8, x, g)
            worst[r] = [min(w, sqnr_db(a, b)) for w, a, b in zip(worst[r], got, want)]
    out, grad_in, grad_w = worst[recipe]
    assert MX_DB <= out <= 40 and MX_DB <= grad_in <= 40, worst
    if recipe == "mxfp8_wgrad_hp":
        assert grad_w == math.inf, worst  # grad_output^T @ input in fp32: nn.Linear's own product
    else:
        assert MX_DB <= grad_w <= 40, worst
    assert all(m >= r - 0.5 for m, r in zip(worst[recipe], worst["rowwise"])), worst


def test_e5m2_and_auto_are_refused_with_mxfp8_in_one_line():
    for recipe in MX:
        for mode in ("e5m2", "auto"):
            with pytest.raises(ValueError) as e:
                FP8Config(recipe=recipe, mode=mode)
            msg = str(e.value)
            assert "\n" not in msg and f"`mode` {mode}" in msg and "e4m3" in msg, msg
            assert f"use `mode` e4m3 with `recipe` {recipe}" in msg, msg
    with pytest.raises(ValueError, match=r"--fp8_mode auto chooses e4m3 or e5m2.*"
                                         r"--fp8_mode e4m3 with --fp8_recipe mxfp8"):
        TrainConfig(fp8=True, fp8_recipe="mxfp8", fp8_mode="auto")
    assert FP8Config(recipe="mxfp8").role_dtypes() == {"input": "e4m3", "weight": "e4m3", "grad_output": "e4m3"}


def test_tokens_not_a_multiple_of_32_are_refused_before_the_backward():
    """mxfp8 blocks the weight-gradient GEMM's operands over 32 tokens; mxfp8_wgrad_hp does not."""
    with pytest.raises(ValueError, match=r"batch size x sequence length, here 30\) must be a multiple of 32.*"
                                         r"--fp8_recipe mxfp8_wgrad_hp"):
        TrainConfig(fp8=True, fp8_recipe="mxfp8", batch_size=3, seq_len=10)
    TrainConfig(fp8=True, fp8_recipe="mxfp8_wgrad_hp", batch_size=3, seq_len=10)
    model = nn.Sequential(nn.Linear(256, 256))
    convert(model, recipe="mxfp8", emulate=True, layers="all", min_dim=16)
    with pytest.raises(ValueError, match="'0': 30 tokens in this forward pass.*multiple of 32"):
        model(torch.randn(3, 10, 256))
    with torch.no_grad():  # no backward, no token blocks: evaluation at any length runs
        assert model(torch.randn(3, 10, 256)).shape == (3, 10, 256)
    with fp8_disabled(model):
        assert model(torch.randn(3, 10, 256)).shape == (3, 10, 256)
    wgrad_hp = nn.Sequential(nn.Linear(256, 256))
    convert(wgrad_hp, recipe="mxfp8_wgrad_hp", emulate=True, layers="all", min_dim=16)
    wgrad_hp(torch.randn(3, 10, 256)).sum().backward()
    assert torch.isfinite(wgrad_hp[0].weight.grad).all()


def test_cpu_autocast_is_refused_as_for_the_other_recipes():
    model = nn.Sequential(nn.Linear(256, 256))
    convert(model, recipe="mxfp8", emulate=True, layers="all", min_dim=16)
    with pytest.raises(RuntimeError, match=r"torch.autocast\('cpu'\).*fp8_disabled"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(32, 256))


@pytest.mark.parametrize("recipe", MX)
def test_mx_layer_keeps_for_its_backward_what_a_plain_linear_keeps(recipe):
    """The memory plan counts a Linear's activations without FP8 (nanochat.train.memory): an MX
    layer saves the same tensors, high-precision input and weight, byte for byte."""
    def saved(layer):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: sizes.append((t.dtype, t.numel())) or t, lambda t: t):
            layer(torch.randn(64, 256, requires_grad=True))
        return sorted(sizes, key=str)

    plain = nn.Sequential(nn.Linear(256, 512, bias=False))
    mx = copy.deepcopy(plain)
    convert(mx, recipe=recipe, emulate=True, layers="all", min_dim=16)
    assert saved(mx) == saved(plain) == sorted([(torch.float32, 64 * 256), (torch.float32, 512 * 256)], key=str)
