"""FP8Training, the FP8 side of a training loop, on a small MLP on CPU (emulated FP8).

Checked against hand counts and the model itself: mode auto calibrates on exactly `auto_steps`
eager steps and then reports the formats as fixed once (the moment to compile); the choices
survive state_dict -> load_state_dict into a fresh model (its layers cast the same formats, no
recalibration), and the state names the converted layers; with `enabled=False` nothing
converts, and `opt_level` still stores the moments in FP8 (FP8Tensor codes, not fp32). The step
guard (nanochat.train.guard) is checked in tests/test_guard.py.
"""

import torch
import torch.nn as nn

from nanochat.fp8 import FP8Config, FP8Optim, FP8Tensor, FP8Training, fp8_choices
from tests.conftest import mlp


def _steps(fp8: FP8Training, model: nn.Module, n: int) -> list[bool]:
    """n plain steps through FP8Training; returns end_step's answers."""
    fixed = []
    for step in range(n):
        with fp8.begin_step(step) as s:
            model(torch.randn(16, 128)).square().mean().backward()
        s.record()
        fp8.optimizer.step()
        fp8.optimizer.zero_grad()
        fixed.append(fp8.end_step(step))
    return fixed


def test_auto_calibrates_then_says_compile_and_its_state_round_trips():
    model = mlp(128, 256, 128)
    config = FP8Config(mode="auto", emulate=True, layers="all", auto_steps=3, stats_every=0)
    fp8 = FP8Training(model, config, torch.optim.AdamW(model.parameters()))
    assert fp8.report.converted == ["0", "2"]
    assert fp8.begin_step(0).eager and fp8.calibrating  # calibration runs on the eager model
    fp8 = FP8Training(model := mlp(128, 256, 128), config, torch.optim.AdamW(model.parameters()))
    assert _steps(fp8, model, 5) == [False, False, True, False, False]  # fixed after step 3, once
    assert not fp8.calibrating
    assert fp8.choices == fp8_choices(model) and set(fp8.choices) == {"0", "2"}

    state = fp8.state_dict()
    fresh = mlp(128, 256, 128)
    restored = FP8Training(fresh, config, torch.optim.AdamW(fresh.parameters()))
    restored.load_state_dict(state)
    assert restored.choices == fp8.choices and fp8_choices(fresh) == fp8.choices
    assert not restored.begin_step(0).eager  # no recalibration after a restore


def test_state_names_the_converted_layers():
    model = mlp(128, 256, 128)
    fp8 = FP8Training(model, FP8Config(emulate=True, layers="all", stats_every=0))
    assert fp8.state_dict()["fp8_converted"] == ["0", "2"] == fp8.report.converted
    assert FP8Training(mlp(128, 256, 128), FP8Config(enabled=False)).state_dict()["fp8_converted"] is None


def test_disabled_converts_nothing_and_opt_level_still_stores_fp8_moments():
    model = mlp(128, 256, 128)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fp8 = FP8Training(model, FP8Config(enabled=False), opt)
    assert fp8.report is None and fp8.optimizer is opt
    assert all(type(m) in (nn.Linear, nn.ReLU, nn.Sequential) for m in model.modules())
    step = fp8.begin_step(0)
    assert not step.eager and step.record() == {} and not fp8.end_step(0)

    model = mlp(128, 256, 128)
    fp8 = FP8Training(model, FP8Config(enabled=False, opt_level=2), torch.optim.AdamW(model.parameters()))
    assert fp8.report is None and isinstance(fp8.optimizer, FP8Optim)
    model(torch.randn(16, 128)).square().mean().backward()
    fp8.optimizer.step()
    weights = [p for p in model.parameters() if p.dim() == 2]  # 32768 values each: FP8 blocks fit
    assert all(isinstance(fp8.optimizer.state[p]["exp_avg"], FP8Tensor) for p in weights)
    assert fp8.fallbacks == ["`opt_level` 2: 2 tensors / 384 params keep fp32 moments (numel < 4096)"]  # biases
