"""nanochat.fp8.stats: FP8 cast statistics against hand counts, and the non-finite locator.

Hand-made tensors whose fate under an FP8 cast can be worked out on paper (the format limits:
e4m3 max 448, smallest subnormal 2^-9, so values under 2^-10 flush; e5m2 max 57344, smallest
subnormal 2^-16), compared with what `tensor_stats` counts; then the sampler's hooks on a
converted layer against the same counts computed directly from the tensors it saw. MXFP8 (one
e8m0 scale per block of 32): hand counts where block scales keep what a row's scale flushes, and
the sampler on MX layers against torchao's own casts of the same tensors, counted here.
"""

import copy
import math

import pytest
import torch
import torch.nn as nn

from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.mx_tensor import MXTensor

from nanochat.fp8 import (
    FP8StatsSampler, collect_fp8_stats, convert, first_nonfinite_layer, fp8_disabled, start_auto_calibration,
    tensor_stats,
)
from nanochat.fp8.stats import CastCounts, CastStats, role_counts

X = torch.tensor([0.0, 1e-6, -1e-6, 1.0, 500.0, -600.0, 3.0, 0.001])


def test_hand_counts_with_a_given_scale():
    s = tensor_stats(X, "e4m3", scale=1.0)
    # +-1e-6 flush to +-0 (both count; -0 is zero); 0.001 > 2^-10 rounds up to 2^-9: kept.
    assert s.underflow_pct == pytest.approx(100 * 2 / 7)
    # 500 and -600 exceed 448: clipped. 2 of 8 elements.
    assert s.saturation_pct == pytest.approx(100 * 2 / 8)
    assert s.amax == 600.0 and s.scale == 1.0 and s.dtype == "e4m3"
    # error: 1e-6 twice, 500 -> 448, -600 -> -448, 0.001 -> 2^-9 (1.0 and 3.0 are exact)
    noise = 2 * 1e-12 + 52**2 + 152**2 + (2**-9 - 0.001) ** 2
    signal = float((X.double() ** 2).sum())
    assert s.sqnr_db == pytest.approx(10 * math.log10(signal / noise), abs=1e-3)

    s5 = tensor_stats(X, "e5m2", scale=1.0)
    assert s5.underflow_pct == pytest.approx(100 * 2 / 7)  # 1e-6 < 2^-17: still flushes
    assert s5.saturation_pct == 0.0


def test_hand_counts_with_dynamic_scaling():
    s = tensor_stats(X, "e4m3")
    # scale = 448 / 600: 0.001 * 0.747 = 7.5e-4 < 2^-10 now flushes too -> 3 of 7
    assert s.scale == pytest.approx(448 / 600)
    assert s.underflow_pct == pytest.approx(100 * 3 / 7)
    # the amax element lands on 448 (up to fp32 rounding of the scale): nothing is clipped
    assert s.saturation_pct == 0.0
    # a negative value that flushes becomes -0 and counts; an input -0 is not "non-zero"
    neg = tensor_stats(torch.tensor([-1e-9, -0.0, 1.0]), "e4m3", scale=1.0)
    assert neg.underflow_pct == pytest.approx(50.0)


def test_rowwise_scales_each_row():
    x = torch.tensor([[1000.0, 1e-3], [1e-3, 1e-3]])
    # one scale (448/1000): every 1e-3 becomes 4.5e-4 < 2^-10 and flushes: 3 of 4
    assert tensor_stats(x, "e4m3").underflow_pct == pytest.approx(75.0)
    # per row: row 0 as before (1 flush), row 1 scaled to 448: nothing flushes -> 1 of 4
    assert tensor_stats(x, "e4m3", axis=-1).underflow_pct == pytest.approx(25.0)
    # power-of-two rounding (torchao's rowwise recipes) rounds the scale down
    s = tensor_stats(x, "e4m3", axis=-1, round_pow2=True)
    assert s.scale == 2.0 ** math.floor(math.log2(448 / 1000))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_sampler_matches_direct_counts_and_removes_its_hooks(recipe):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128, bias=False))
    convert(model, mode="auto", recipe=recipe, emulate=True, layers="all")
    layer = model[0]
    x, g = torch.randn(4, 8, 128), torch.randn(4, 8, 128)
    with collect_fp8_stats(model) as sampler:
        model(x).backward(g)
    res = sampler.results()["0"]
    assert {r: s.dtype for r, s in res.items()} == {"input": "e4m3", "weight": "e4m3", "grad_output": "e5m2"}
    for role, t, dt in (("input", x, torch.float8_e4m3fn), ("weight", layer.weight, torch.float8_e4m3fn),
                        ("grad_output", g, torch.float8_e5m2)):
        direct = role_counts(layer, role, t, dt)
        assert res[role].numel == direct.numel and res[role].sqnr_db == pytest.approx(direct.sqnr_db)
        assert res[role].underflow_pct == direct.underflow_pct
    casts = 1 if recipe == "rowwise_with_gw_hp" else 2  # grad_weight GEMM in high precision
    assert res["input"].numel == casts * x.numel()
    assert sampler.as_dict()["0"]["weight"]["dtype"] == "e4m3"
    assert "grad_output" in sampler.table()
    # hooks are gone: another step leaves the results unchanged
    model(x).backward(g)
    assert sampler.results()["0"]["input"].numel == res["input"].numel
    assert not layer._forward_hooks


def test_mx_blocks_scale_each_32_values_by_hand():
    """One row of 64: an outlier 1000 and 63 values of 1e-3. One scale for the row (rowwise's
    power of two, 2^-2) flushes all 63 (1e-3 / 4 < 2^-10, half e4m3's smallest subnormal). MXFP8's
    RCEIL scale per block of 32 is 2^ceil(log2(amax / 448)): 4 for block 0, whose 31 small values
    flush the same way; 2^-18 for block 1, where 1e-3 becomes 262.1 and rounds to 256 (e4m3's
    step is 32 there): none flushes. Nothing saturates (RCEIL maps each amax to at most 448)."""
    x = torch.full((1, 64), 1e-3)
    x[0, 0] = 1000.0
    assert tensor_stats(x, "e4m3", axis=-1, round_pow2=True).underflow_pct == pytest.approx(100 * 63 / 64)
    mx = CastStats.of("e4m3", CastCounts().add_mx(x, axis=-1, scaling_mode=ScaleCalculationMode.RCEIL))
    assert mx.underflow_pct == pytest.approx(100 * 31 / 64) and mx.saturation_pct == 0.0
    assert mx.amax == 1000.0 and mx.scale == 0.25  # the smallest block scale: block 0's 1 / 4
    # 1000 / 4 = 250 rounds to 256 (step 16 in [128, 256)): 1024; block 1: 256 * 2^-18 each
    noise = (1024 - 1000) ** 2 + 31 * 1e-3**2 + 32 * (1e-3 - 256 * 2.0**-18) ** 2
    signal = 1000**2 + 63 * 1e-3**2
    assert mx.sqnr_db == pytest.approx(10 * math.log10(signal / noise), abs=1e-3)
    # blocks along the first dim: the transposed tensor gives the same counts
    col = CastStats.of("e4m3", CastCounts().add_mx(x.t(), axis=0, scaling_mode=ScaleCalculationMode.RCEIL))
    assert (col.underflow_pct, col.sqnr_db) == (mx.underflow_pct, mx.sqnr_db)


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_wgrad_hp"])
def test_sampler_on_mx_layers_counts_torchaos_own_casts(recipe):
    """Reference: every cast torchao's mx_mm makes of a role (MXTensor.to_mx along K, and along
    the tokens for the weight-gradient GEMM unless mxfp8_wgrad_hp), dequantized by torchao and
    counted here by hand: the same numel, underflow and SQNR."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256, bias=False))
    convert(model, recipe=recipe, emulate=True, layers="all", min_dim=16)
    layer = model[0]
    x, g = torch.randn(4, 32, 128), torch.randn(4, 32, 256)
    x[..., 5] *= 2.0**14  # an outlier channel: its blocks' scales, not the row's
    with collect_fp8_stats(model) as sampler:
        model(x).backward(g)
    res = sampler.results()["0"]
    wgrad_hp = recipe == "mxfp8_wgrad_hp"
    for role, t in (("input", x), ("weight", layer.weight), ("grad_output", g)):
        t2d = t.detach().reshape(-1, t.shape[-1])
        casts = [t2d] + ([] if wgrad_hp and role != "weight" else [t2d.t().contiguous()])
        nonzero = underflow = signal = noise = 0
        for c in casts:
            back = MXTensor.to_mx(c, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL).dequantize(torch.float32)
            nonzero += int((c != 0).sum())
            underflow += int(((c != 0) & (back == 0)).sum())
            signal += float(c.double().square().sum())
            noise += float((c.double() - back.double()).square().sum())
        assert res[role].dtype == "e4m3" and res[role].numel == sum(c.numel() for c in casts), role
        assert res[role].underflow_pct == pytest.approx(100 * underflow / nonzero), role
        # (stats squares in fp32, summed in fp64; here all in fp64: 2^-24 relative, ~1e-7 dB)
        assert res[role].sqnr_db == pytest.approx(10 * math.log10(signal / noise), abs=1e-5), role
        assert res[role].saturation_pct == 0.0
    with pytest.raises(ValueError, match="MXFP8 layers .* cast to e4m3 only"):
        collect_fp8_stats(model, both_formats=True)
    with pytest.raises(ValueError, match="mode auto chooses e4m3 or e5m2 per role, but MXFP8 layers"):
        start_auto_calibration(model)


def test_sampler_skips_layers_running_in_high_precision():
    model = nn.Sequential(nn.Linear(128, 128))
    convert(model, emulate=True, layers="all")
    with FP8StatsSampler(model) as sampler, fp8_disabled(model):
        model(torch.randn(8, 128)).sum().backward()
    assert sampler.results() == {}


def test_first_nonfinite_layer_by_output_and_by_gradient():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 16))
    x = torch.randn(4, 16)
    assert first_nonfinite_layer(model, run=lambda: model(x)) is None
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken[2].weight[0, 0] = float("inf")
    where = first_nonfinite_layer(broken, run=lambda: broken(x))
    assert where.startswith("2: output has") and "inf" in where

    # gradients: an inf born in layer 2's backward reaches layer 0 too; layer 3 stays finite
    model(x).sum().backward()
    assert first_nonfinite_layer(model) is None
    for i in (0, 2):
        model[i].weight.grad[0, 0] = float("inf")
    assert first_nonfinite_layer(model).startswith("2.weight grad has 1 inf, 0 nan")
