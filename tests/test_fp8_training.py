"""FP8Training, the FP8 side of a training loop, on a small MLP on CPU (emulated FP8).

Checked against hand counts and the model itself: mode auto calibrates on exactly `auto_steps`
eager steps and then reports the formats as fixed once (the moment to compile); the choices
survive state_dict -> load_state_dict into a fresh model (its layers cast the same formats, no
recalibration); a non-finite gradient skips the step, names the layer, zeroes the gradients and
is counted, and `max_overflows` in a row stop the run; a clip is counted with its factor; with
`enabled=False` nothing converts and the guard still works.
"""

import math

import pytest
import torch
import torch.nn as nn

from nanochat.common import NanoChatError
from nanochat.fp8 import FP8Config, FP8Training, fp8_choices


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128))


def _steps(fp8: FP8Training, model: nn.Module, n: int) -> list[bool]:
    """n plain steps through FP8Training; returns end_step's answers."""
    fixed = []
    for step in range(n):
        with fp8.begin_step(step) as s:
            model(torch.randn(16, 128)).square().mean().backward()
        s.record()
        assert fp8.check_step(step, 1.0, 1.0) == {}
        fp8.optimizer.step()
        fp8.optimizer.zero_grad()
        fixed.append(fp8.end_step(step))
    return fixed


def test_auto_calibrates_then_says_compile_and_its_state_round_trips():
    model = _mlp()
    config = FP8Config(mode="auto", emulate=True, layers="all", auto_steps=3, stats_every=0)
    fp8 = FP8Training(model, config, torch.optim.AdamW(model.parameters()))
    assert fp8.report.converted == ["0", "2"]
    assert fp8.begin_step(0).eager and fp8.calibrating  # calibration runs on the eager model
    fp8 = FP8Training(model := _mlp(), config, torch.optim.AdamW(model.parameters()))
    assert _steps(fp8, model, 5) == [False, False, True, False, False]  # fixed after step 3, once
    assert not fp8.calibrating
    assert fp8.choices == fp8_choices(model) and set(fp8.choices) == {"0", "2"}

    state = fp8.state_dict()
    fresh = _mlp()
    restored = FP8Training(fresh, config, torch.optim.AdamW(fresh.parameters()))
    restored.load_state_dict(state)
    assert restored.choices == fp8.choices and fp8_choices(fresh) == fp8.choices
    assert not restored.begin_step(0).eager  # no recalibration after a restore


def test_nonfinite_steps_are_skipped_named_counted_and_stop_the_run():
    model = _mlp()
    fp8 = FP8Training(model, FP8Config(emulate=True, layers="all", max_overflows=2, stats_every=0),
                      torch.optim.SGD(model.parameters(), lr=0.1))
    with fp8.begin_step(0):
        model(torch.randn(4, 128)).sum().backward()
    model[2].weight.grad[0, 0] = math.inf
    record = fp8.check_step(0, 1.0, math.inf)
    assert record["skipped"] is True and record["nonfinite_at"].startswith("2.weight grad has 1 inf")
    assert all(p.grad is None for p in model.parameters())  # zeroed: the update is skipped
    assert fp8.check_step(1, 1.0, 2.0, max_norm=1.0) == {"clip_factor": 0.5}
    assert fp8.counters["overflow_events"] == 1 and fp8.counters["clip_events"] == 1
    fp8.check_step(2, math.nan, 1.0)
    with pytest.raises(NanoChatError, match="2 consecutive steps .* steps 3-4"):
        fp8.check_step(3, math.nan, 1.0, note=lambda: "no checkpoint")
    assert fp8.counters["skipped_steps"] == 3


def test_disabled_converts_nothing_and_still_guards():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fp8 = FP8Training(model, FP8Config(enabled=False), opt)
    assert fp8.report is None and fp8.optimizer is opt
    assert all(type(m) in (nn.Linear, nn.ReLU, nn.Sequential) for m in model.modules())
    step = fp8.begin_step(0)
    assert not step.eager and step.record() == {}
    assert fp8.check_step(0, math.inf, 1.0)["skipped"] is True
    assert not fp8.end_step(0) and fp8.summary()["skipped_steps"] == 1
