"""nanochat.fp8.auto: per-layer, per-role FP8 format choice by measurement.

Checked against tensors whose right answer is known: a gaussian (narrow range: e4m3's extra
mantissa bit wins, ~6 dB) and values log-uniform over 1e-6..1e3 (wider than e4m3's ~18 binades
under one scale: e4m3 flushes a third of them, e5m2 none -> e5m2, although e4m3's SQNR is
higher, which is why the underflow rule exists), with tensorwise and rowwise scaling; then a
calibration in a real training loop, the native-kernel rule, and choices surviving a
weights_only save and re-apply. --fp8_auto_recheck_every: the same rule on later measurements switches
a role only after RECHECK_CONFIRM consecutive disagreements, never leaves a set CUDA cannot run,
and a compiled model follows a switch (its output keeps FP8_SAME_CASTS_DB against the eager model's:
inductor's vectorized C++ and eager ATen round differently, so never bit for bit). The choice
table: a row per layer up to 24 layers; past that grouped by Linear and formats, and read back
it gives every layer's formats (the grouping loses nothing) with the count and block ranges.
"""

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat.fp8 import (
    apply_fp8_choices, collect_fp8_stats, convert, fp8_choices, fp8_report, recheck_choices, start_auto_calibration,
)
from nanochat.fp8.auto import (
    RECHECK_HYSTERESIS, UNDERFLOW_MARGIN_PCT, block_ranges, choices_table, choose_format, make_native_legal, measure,
)
from nanochat.fp8.stats import CastCounts
from nanochat.fp8.hardware import native_gemm_problem
from nanochat.fp8.conversion import FP8_DTYPES
from tests.conftest import FP8_SAME_CASTS_DB, last_bits, mlp, sqnr_db


def _log_uniform(shape, lo=1e-6, hi=1e3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.empty(shape).uniform_(torch.log(torch.tensor(lo)).item(),
                                                torch.log(torch.tensor(hi)).item(), generator=gen))
    return mag * torch.randn(shape, generator=gen).sign()


def test_gaussian_picks_e4m3_for_every_role():
    counts = measure(torch.randn(256, 256, generator=torch.Generator().manual_seed(0)))
    assert counts["e4m3"].sqnr_db - counts["e5m2"].sqnr_db > 5  # one mantissa bit ~ 6 dB
    for role in ("input", "weight", "grad_output"):
        assert choose_format(counts, role) == "e4m3"


@pytest.mark.parametrize("axis", [None, -1])  # tensorwise, rowwise
def test_wide_range_picks_e5m2_although_e4m3_has_more_sqnr(axis):
    counts = measure(_log_uniform((256, 256)), axis=axis, round_pow2=axis is not None)
    # measured: e4m3 flushes 37% (tensorwise) / 39% (rowwise) of the entries, e5m2 none; SQNR
    # still favours e4m3 by ~6 dB (31.8 vs 25.7 dB tensorwise)
    assert counts["e4m3"].underflow_pct > 30 and counts["e5m2"].underflow_pct == 0
    assert counts["e4m3"].sqnr_db > counts["e5m2"].sqnr_db
    for role in ("input", "weight", "grad_output"):
        assert choose_format(counts, role) == "e5m2"


def test_rowwise_scaling_rescues_e4m3_when_only_the_rows_differ():
    # gaussian rows whose magnitudes span 1e-6..1e2: one scale flushes the small rows in e4m3,
    # a scale per row does not
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen) * (10.0 ** (torch.arange(64) % 9 - 6)).unsqueeze(1)
    assert choose_format(measure(x), "grad_output") == "e5m2"
    assert choose_format(measure(x, axis=-1, round_pow2=True), "grad_output") == "e4m3"


def test_ties_keep_the_hybrid_default():
    x = torch.tensor([[1.0, 2.0, 4.0, -0.5]])  # power-of-two scale: exact in both formats
    counts = measure(x, axis=-1, round_pow2=True)
    assert counts["e4m3"].sqnr_db == counts["e5m2"].sqnr_db == float("inf")
    assert choose_format(counts, "input") == choose_format(counts, "weight") == "e4m3"
    assert choose_format(counts, "grad_output") == "e5m2"


def test_native_rule_flips_the_cheapest_e5m2_role():
    g = measure(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)))  # e4m3 +6 dB
    wide = measure(_log_uniform((64, 64)))                                        # e4m3 +6 dB too
    counts = {"input": wide, "weight": g, "grad_output": g}
    all_e5 = {"input": "e5m2", "weight": "e5m2", "grad_output": "e5m2"}
    legal = make_native_legal(all_e5, counts, "tensorwise")
    # weight and grad_output flush nothing in e4m3, the wide input does: they flip, it stays
    assert legal == {"input": "e5m2", "weight": "e4m3", "grad_output": "e4m3"}
    assert make_native_legal({"input": "e4m3", "weight": "e5m2", "grad_output": "e4m3"}, counts,
                             "rowwise")["weight"] == "e4m3"  # rowwise needs an e4m3 weight
    ok = {"input": "e5m2", "weight": "e4m3", "grad_output": "e4m3"}
    assert make_native_legal(ok, counts, "tensorwise") == ok


def _mlp(seed=0):
    return mlp(128, 128, 128, act=nn.GELU, seed=seed)


def test_calibration_in_a_training_loop_then_reapply_from_a_checkpoint(tmp_path):
    model = _mlp()
    fresh = copy.deepcopy(model)
    convert(model, mode="auto", emulate=True, layers="all")
    assert fp8_choices(model)["0"] == {"input": "e4m3", "weight": "e4m3", "grad_output": "e5m2"}
    # layer 0 sees wide-range inputs, layer 2 sees GELU outputs (narrow)
    x = _log_uniform((64, 128), lo=1e-6, hi=1e2, seed=1)
    target = torch.randn(64, 128, generator=torch.Generator().manual_seed(2)) * 0.1
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    calib = start_auto_calibration(model, steps=2)
    losses, done = [], []
    for _ in range(6):
        loss = F.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        done.append(calib.step())
    assert done == [False, True, True, True, True, True]
    choices = calib.choices
    # layer 0: the input flushes ~30% in e4m3 -> e5m2; its grad_output (~7% in e4m3) would be
    # e5m2 too, but input and grad_output meet in the grad_weight GEMM, which CUDA cannot run in
    # e5m2 x e5m2: the role whose underflow grows least goes back to e4m3
    assert choices["0"] == {"input": "e5m2", "weight": "e4m3", "grad_output": "e4m3"}
    assert choices["2"]["weight"] == "e4m3"
    assert fp8_choices(model) == choices  # applied to the layers' torchao configs
    measured = calib.measurements()["0"]["input"]
    assert measured["e4m3"]["underflow_pct"] > 1 and measured["e5m2"]["underflow_pct"] == 0
    assert "chosen" in calib.table()
    assert losses[-1] < losses[0]
    assert not model[0]._forward_hooks  # hooks removed after finalize

    torch.save({"fp8_choices": choices}, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=True)["fp8_choices"]
    fresh.load_state_dict(model.state_dict())
    convert(fresh, mode="auto", emulate=True, layers="all")
    apply_fp8_choices(fresh, loaded)
    assert fp8_choices(fresh) == choices
    assert torch.equal(fresh(x), model(x))


def test_apply_fp8_choices_validates():
    model = _mlp()
    convert(model, mode="auto", emulate=True, layers="all")
    e4 = {"input": "e4m3", "weight": "e4m3", "grad_output": "e4m3"}
    with pytest.raises(ValueError, match="not FP8 layers"):
        apply_fp8_choices(model, {"nope": e4})
    with pytest.raises(ValueError, match="'e4m3' or 'e5m2'"):
        apply_fp8_choices(model, {"0": {**e4, "weight": "fp8"}})
    import dataclasses
    model._nanochat_fp8_report = dataclasses.replace(fp8_report(model), backend="native")
    with pytest.raises(ValueError, match="cannot run on this GPU"):
        apply_fp8_choices(model, {"0": {"input": "e5m2", "weight": "e5m2", "grad_output": "e4m3"}})


def test_calibration_needs_fp8_layers_and_a_forward():
    with pytest.raises(ValueError, match="no FP8 layers"):
        start_auto_calibration(_mlp())
    model = _mlp()
    convert(model, mode="auto", emulate=True, layers="all")
    with pytest.raises(RuntimeError, match="no forward pass"):
        start_auto_calibration(model).finalize()


E4 = {"input": "e4m3", "weight": "e4m3", "grad_output": "e4m3"}


def _measured(grad_output):
    narrow = measure(torch.randn(64, 128, generator=torch.Generator().manual_seed(3)))
    return {"input": narrow, "weight": narrow, "grad_output": grad_output}


def test_recheck_switches_only_after_consecutive_disagreements():
    model = _mlp()
    convert(model, mode="auto", emulate=True, layers="all")
    apply_fp8_choices(model, {"0": E4, "2": E4})
    wide, narrow = measure(_log_uniform((64, 128))), measure(torch.randn(64, 128))
    pending = {}
    # sample 1: layer 0's gradient now flushes >30% in e4m3 -> the rule wants e5m2: pending only
    assert recheck_choices(model, {"0": _measured(wide), "2": _measured(narrow)}, pending) == []
    assert pending == {"0/grad_output": 1} and fp8_choices(model)["0"] == E4
    # sample 2 agrees with the calibration again: the count resets
    assert recheck_choices(model, {"0": _measured(narrow)}, pending) == [] and pending == {}
    # two disagreements in a row: switch, with the measurements that decided it
    recheck_choices(model, {"0": _measured(wide)}, pending)
    switches = recheck_choices(model, {"0": _measured(wide)}, pending)
    assert [(s["layer"], s["role"], s["from"], s["to"]) for s in switches] == [("0", "grad_output", "e4m3", "e5m2")]
    m = switches[0]["measured"]
    assert m["e4m3"]["underflow_pct"] > 30 and m["e5m2"]["underflow_pct"] == 0
    assert fp8_choices(model)["0"] == {**E4, "grad_output": "e5m2"} and fp8_choices(model)["2"] == E4
    assert pending == {}
    # and back, by the same rule, when e4m3 stops flushing (its ~6 dB more SQNR wins again)
    recheck_choices(model, {"0": _measured(narrow)}, pending)
    assert [s["to"] for s in recheck_choices(model, {"0": _measured(narrow)}, pending)] == ["e4m3"]


def _counts(underflow_pct, sqnr_db):
    n = 100_000  # signal 1, noise 10^(-dB/10): CastCounts' own SQNR formula gives sqnr_db back
    return CastCounts(numel=n, nonzero=n, underflow=round(n * underflow_pct / 100), signal=1.0,
                      noise=10 ** (-sqnr_db / 10))


def test_recheck_hysteresis_keeps_the_incumbent_near_the_margin():
    # e4m3 flushes 0.8 points more than e5m2: inside the 1-point margin (e4m3 wins on SQNR), but
    # outside half of it, so a role already moved to e5m2 stays there
    assert UNDERFLOW_MARGIN_PCT * RECHECK_HYSTERESIS < 0.8 < UNDERFLOW_MARGIN_PCT
    counts = {"e4m3": _counts(0.8, 31.5), "e5m2": _counts(0.0, 25.5)}
    assert counts["e4m3"].sqnr_db == pytest.approx(31.5) and counts["e4m3"].underflow_pct == 0.8
    assert choose_format(counts, "grad_output") == "e4m3"                     # calibration
    assert choose_format(counts, "grad_output", incumbent="e4m3") == "e4m3"   # stays
    assert choose_format(counts, "grad_output", incumbent="e5m2") == "e5m2"   # no way back yet
    back = {"e4m3": _counts(0.4, 31.5), "e5m2": _counts(0.0, 25.5)}
    assert choose_format(back, "grad_output", incumbent="e5m2") == "e4m3"     # within half: back
    out = {"e4m3": _counts(1.2, 31.5), "e5m2": _counts(0.0, 25.5)}
    assert choose_format(out, "grad_output", incumbent="e4m3") == "e5m2"      # beyond the margin


def test_recheck_never_applies_a_set_cuda_cannot_run():
    # Counts that confirm input's switch to e5m2 one sample before grad_output's switch back to
    # e4m3 (here: a pending count carried in from a checkpoint): applying input's alone would put
    # e5m2 x e5m2 into the grad_weight GEMM, so the cheaper e5m2 role goes back to e4m3 at once.
    model = _mlp()
    convert(model, mode="auto", emulate=True, layers="all")
    start = {**E4, "grad_output": "e5m2"}
    apply_fp8_choices(model, {"0": start, "2": start})
    wide, narrow = measure(_log_uniform((64, 128))), measure(torch.randn(64, 128))
    pending = {"0/input": 1}
    switches = recheck_choices(model, {"0": {"input": wide, "weight": narrow, "grad_output": narrow}}, pending)
    now = fp8_choices(model)["0"]
    assert native_gemm_problem({r: FP8_DTYPES[d] for r, d in now.items()}, recipe="tensorwise") is None
    assert now == {"input": "e5m2", "weight": "e4m3", "grad_output": "e4m3"}
    assert {(s["role"], s["to"]) for s in switches} == {("input", "e5m2"), ("grad_output", "e4m3")}


@pytest.mark.two_computations
def test_recheck_measures_real_steps_and_a_compiled_model_follows_the_switch():
    model = _mlp()
    convert(model, mode="auto", emulate=True, layers="all")
    apply_fp8_choices(model, {"0": E4, "2": E4})
    compiled = torch.compile(model)
    x = _log_uniform((64, 128), lo=1e-6, hi=1e2, seed=1)  # layer 0's input flushes in e4m3
    before = compiled(x)
    pending = {}
    for _ in range(2):
        with collect_fp8_stats(model, both_formats=True) as sampler:
            model(x).square().mean().backward()
        counts = sampler.format_counts()
        assert set(counts["0"]["input"]) == {"e4m3", "e5m2"}
        # the sampler's own figures are those of the format each role is really cast to
        assert sampler.results()["0"]["input"].underflow_pct == counts["0"]["input"]["e4m3"].underflow_pct
        switches = recheck_choices(model, counts, pending)
    assert ("0", "input", "e5m2") in {(s["layer"], s["role"], s["to"]) for s in switches}
    after = compiled(last_bits(x))  # torch.compile guards on the layer's config: it recompiles
    eager = model(x)
    assert sqnr_db(after, eager) >= FP8_SAME_CASTS_DB, sqnr_db(after, eager)  # it follows the switch ...
    assert sqnr_db(before, eager) < 30, sqnr_db(before, eager)  # ... which re-cast layer 0's input


def _table_rows(table: str) -> list[list[str]]:
    """The rows of a printed table (its heading, column names and rule left out)."""
    return [re.split(r"\s{2,}", line.strip()) for line in table.splitlines()[3:]]


def test_choice_table_groups_past_24_layers_and_loses_nothing():
    linears = ["attn.c_q", "attn.c_k", "attn.c_v", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
    hybrid = {"input": "e4m3", "weight": "e4m3", "grad_output": "e5m2"}
    choices = {f"transformer.h.{b}.{n}": dict(hybrid) for b in range(26) for n in linears}  # d26: 156 layers
    for b in (3, 4, 5, 17):
        choices[f"transformer.h.{b}.mlp.c_fc"]["grad_output"] = "e4m3"
    choices["lm_head"] = dict(hybrid)  # a layer outside the blocks
    table = choices_table(choices)
    assert table.startswith("fp8 auto: formats chosen by measurement (157 layers), grouped by Linear and formats")
    rows = _table_rows(table)
    assert len(rows) == 8  # 6 Linears, c_fc twice (two format sets), lm_head
    assert rows[4] == ["transformer.h.*.mlp.c_fc", "e4m3", "e4m3", "e5m2", "22", "0-2, 6-16, 18-25"]
    assert rows[6] == ["transformer.h.*.mlp.c_fc", "e4m3", "e4m3", "e4m3", "4", "3-5, 17"]
    read_back = {}
    for pattern, *formats, count, blocks in rows:
        numbers = [n for part in blocks.split(", ") if part != "-"
                   for n in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)]
        assert int(count) == max(1, len(numbers))
        for name in [pattern.replace("*", str(n)) for n in numbers] or [pattern]:
            read_back[name] = dict(zip(("input", "weight", "grad_output"), formats))
    assert read_back == choices
    few = {name: roles for name, roles in choices.items() if ".h.0." in name or ".h.1." in name}
    assert [row[0] for row in _table_rows(choices_table(few))] == list(few)  # 12 layers: a row each
    assert block_ranges([7, 1, 2, 3, 9, 8]) == "1-3, 7-9" and block_ranges([None]) == "-"
