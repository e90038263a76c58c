"""StepGuard, the check between a step's backward and its update, on a small MLP on CPU (no FP8).

Checked against hand counts, the model's own gradients and torch: a non-finite gradient or loss
skips the step, names the layer where it began, drops every gradient and is counted, and
`max_bad_steps` in a row stop the run naming the steps; a finite step ends such a run; a clip is
counted with its factor and the gradients equal torch.nn.utils.clip_grad_norm_'s (the same norm
and the same scaling kernel: bit for bit); `check` reads the device once (loss and norm
together), and `measure` leaves that read to a caller that reads values of its own with it. The
guard owns its counts and their checkpointed state: FP8Training's summary and state hold none of
them, and a saved state (through JSON) restores each part's own counts.
"""

import json
import math

import pytest
import torch
import torch.nn as nn

from nanochat.common import NanoChatError
from nanochat.device import DeviceReads, host_read
from nanochat.fp8 import FP8Config, FP8Training
from nanochat.train.guard import StepGuard
from tests.conftest import mlp


def _backward(model: nn.Module) -> torch.Tensor:
    loss = model(torch.randn(4, 128)).sum()
    loss.backward()
    return loss.detach()


def test_nonfinite_steps_are_skipped_named_counted_and_stop_the_run():
    model = mlp(128, 256, 128)
    guard = StepGuard(model, max_bad_steps=2)
    _backward(model)
    model[2].weight.grad[0, 0] = math.inf
    record = guard.decide(0, 1.0, math.inf)
    assert record["skipped"] is True and record["nonfinite_at"].startswith("2.weight grad has 1 inf")
    assert all(p.grad is None for p in model.parameters())  # dropped: the update is skipped
    assert guard.decide(1, 1.0, 2.0, max_norm=1.0) == {"clip_factor": 0.5}
    assert guard.counters["overflow_events"] == 1 and guard.counters["clip_events"] == 1
    guard.decide(2, math.nan, 1.0)
    with pytest.raises(NanoChatError, match="2 consecutive steps .* steps 3-4"):
        guard.decide(3, math.nan, 1.0, note=lambda: "no checkpoint")
    assert guard.counters["skipped_steps"] == 3


def test_check_reads_once_clips_as_torch_and_skips_without_touching_the_weights():
    model, reference = mlp(128, 256, 128), mlp(128, 256, 128)
    loss = _backward(model)
    for p, q in zip(model.parameters(), reference.parameters()):
        q.grad = p.grad.clone()
    guard = StepGuard(model)
    with DeviceReads() as reads:
        verdict = guard.check(0, loss, model.parameters(), max_norm=0.5)
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    assert reads.count == 1 and not verdict.skipped and verdict.loss == loss.item()
    assert verdict.grad_norm == norm.item() and verdict.flags == {"clip_factor": 0.5 / norm.item()}
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))

    before = [p.detach().clone() for p in model.parameters()]
    verdict = guard.check(1, torch.tensor(math.nan), model.parameters(), max_norm=0.5, rerun=lambda: model(
        torch.full((1, 128), math.nan)))
    assert verdict.skipped and verdict.flags["nonfinite_at"].startswith("0: output has 0 inf, 256 nan")
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_the_guard_owns_its_counts_and_their_checkpoint_state():
    model = mlp(128, 256, 128)
    fp8 = FP8Training(model, FP8Config(enabled=False))
    guard = StepGuard(model)
    assert guard.decide(0, math.inf, 1.0)["skipped"] is True
    assert guard.decide(1, 1.0, 4.0, max_norm=1.0) == {"clip_factor": 0.25}
    counts = {"overflow_events": 1, "skipped_steps": 1, "clip_events": 1, "min_clip_factor": 0.25}
    assert guard.summary() == counts
    assert guard.summary_text("end").startswith("step guard (end): 1 skipped steps")
    guard_keys = set(counts)
    assert not guard_keys & set(fp8.summary()) and fp8.state_dict()["counters"] == {"stats_samples": 0}
    fp8.counters["stats_samples"] = 3
    checkpoint = json.loads(json.dumps({**fp8.state_dict(), **guard.state_dict()}))  # as trainer.json holds it
    resumed, resumed_fp8 = StepGuard(mlp(128, 256, 128)), FP8Training(mlp(128, 256, 128), FP8Config(enabled=False))
    resumed.load_state_dict(checkpoint)
    resumed_fp8.load_state_dict(checkpoint)
    assert resumed.counters == counts
    assert resumed_fp8.counters == {"stats_samples": 3}


def test_measure_leaves_the_one_read_to_the_caller_and_judges_as_check():
    """A loop that reads values of its own in the same read (the trainer's stop votes) gets the
    verdict `check` gives, clipping included, and still reads the device once."""
    model, reference = mlp(128, 256, 128), mlp(128, 256, 128)
    loss = _backward(model)
    for p, q in zip(model.parameters(), reference.parameters()):
        q.grad = p.grad.clone()
    expected = StepGuard(reference).check(0, loss, reference.parameters(), max_norm=0.5)
    guard, own = StepGuard(model), torch.tensor([0.0, 1.0])
    with DeviceReads() as reads:
        reading = guard.measure(0, loss, model.parameters(), max_norm=0.5)
        values = host_read(torch.cat([reading.values, own]))
        verdict = reading.judge(values[:reading.values.numel()])
    assert reads.count == 1 and values[reading.values.numel():] == [0.0, 1.0]
    assert verdict == expected
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
