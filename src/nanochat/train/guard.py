"""StepGuard: whether a step's update may touch the weights, decided in one device read.

After the backward pass, and before the optimizer steps, a loop must know two things it can only
learn on the host: is the loss finite, and is the gradient norm? A step with inf/nan in either
would write inf/nan into the weights (and Adam's moments keep it forever), so its gradients are
dropped instead, the update is skipped, and the layer where the non-finite values began is named
(nanochat.fp8.stats.first_nonfinite_layer: the first module in forward order whose output or
gradient holds them; the forward is re-run eagerly when the loss itself is not finite).
`max_bad_steps` such steps in a row stop the run: the learning rate or the data is wrong, and
skipping more would only burn time. A finite step is clipped to `max_norm` and the clip counted.

    guard = StepGuard(model, max_bad_steps=10)
    loss.backward()
    verdict = guard.check(step, loss, params, max_norm=1.0)   # loss and norm: one device read
    if not verdict.skipped:
        optimizer.step()
    ...checkpoint = {..., **guard.state_dict()}; on resume guard.load_state_dict(checkpoint)

`check` is `measure` (the values on the device, no read) then the `Reading`'s `judge` on those
values read: a loop with values of its own to read in the same step (nanochat's stop votes)
reads both in one `host_read` and hands each part its own.

Nothing here is FP8's: overflows are what low precision makes more likely, but a bf16 or fp32 run
needs the same guard (nanochat's trainer runs it always). So the guard owns its counts
(`counters`, `summary`), its checkpointed state and its limit; FP8's objects hold none of them.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, NamedTuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from nanochat.common import NanoChatError, logger
from nanochat.device import host_read
from nanochat.fp8.stats import first_nonfinite_layer

COUNTERS = {"overflow_events": 0, "skipped_steps": 0, "clip_events": 0, "min_clip_factor": None}
"""What a StepGuard counts: non-finite steps (each is an overflow event and a skipped step),
clipped steps, and the smallest clip factor (max_norm / norm) so far."""


class Verdict(NamedTuple):
    """One step as the guard saw it: the loss and gradient norm on the host, and `flags` for the
    step's metrics record (`skipped` and `nonfinite_at`, or `clip_factor` when it clipped)."""

    loss: float
    grad_norm: float
    flags: dict[str, Any]

    @property
    def skipped(self) -> bool:
        return bool(self.flags.get("skipped"))


class Reading(NamedTuple):
    """A step's check before its device read: `values` (1-D, on the device) and `judge`, the
    verdict on them once read (host_read(values), or a slice of a read the caller made)."""

    values: torch.Tensor
    judge: Callable[[list[float]], Verdict]


class StepGuard:
    """Skips non-finite steps (naming the layer), counts and applies clipping (module docstring)."""

    def __init__(self, model: nn.Module, *, max_bad_steps: int = 10):
        if max_bad_steps < 1:
            raise ValueError(f"max_bad_steps must be >= 1, got {max_bad_steps}")
        self.model = model
        self.max_bad_steps = max_bad_steps
        """Consecutive non-finite steps that stop the run (--max_bad_steps)."""
        self.counters: dict[str, Any] = dict(COUNTERS)
        self._in_a_row, self._bad_since = 0, 0

    def check(self, step: int, loss: torch.Tensor, params: Iterable[torch.Tensor], *, max_norm: float = math.inf,
              clip: bool = True, rerun: Callable[[], object] | None = None,
              note: Callable[[], str] | None = None) -> Verdict:
        """After the backward pass of step `step` (0-based): the global norm of `params`' gradients,
        then `loss` and that norm read together (one device read); `decide` on them; a finite step
        is clipped to `max_norm` unless `clip` is False (a caller that clips itself)."""
        reading = self.measure(step, loss, params, max_norm=max_norm, clip=clip, rerun=rerun, note=note)
        return reading.judge(host_read(reading.values))

    def check_in_backward(self, step: int, loss: torch.Tensor, optimizer: Any, *,
                          note: Callable[[], str] | None = None) -> Verdict:
        """A step whose update ran inside the backward, in one device read (`measure_in_backward`)."""
        reading = self.measure_in_backward(step, loss, optimizer, note=note)
        return reading.judge(host_read(reading.values))

    def measure(self, step: int, loss: torch.Tensor, params: Iterable[torch.Tensor], *,
                max_norm: float = math.inf, clip: bool = True, rerun: Callable[[], object] | None = None,
                note: Callable[[], str] | None = None) -> Reading:
        """`check` up to its device read: [loss, gradient norm] on the device, and the judgement
        of those values once read (which clips a finite step)."""
        params = list(params)
        # the norm first, clipping after: a non-finite norm must leave the gradients as they are
        # (clip_grad_norm_ would scale all of them by nan) so that the culprit can be named
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if isinstance(norm, DTensor):  # FSDP: the norm over every rank's shard
            norm = norm.full_tensor()

        def judge(values: list[float]) -> Verdict:
            loss_value, grad_norm = values
            flags = self.decide(step, loss_value, grad_norm, max_norm=max_norm, rerun=rerun, note=note)
            if clip and not flags.get("skipped"):
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
            return Verdict(loss_value, grad_norm, flags)

        return Reading(torch.stack([loss.float(), norm.float().to(loss.device)]), judge)

    def measure_in_backward(self, step: int, loss: torch.Tensor, optimizer: Any, *,
                            note: Callable[[], str] | None = None) -> Reading:
        """A step whose update ran inside the backward (FP8Optim.step_in_backward, which left any
        parameter with a non-finite gradient unchanged), up to its device read: the loss, the norm
        of the finite gradients and, when some were not finite, `skipped_params` (how many
        parameters kept their values) and `skipped_param_names`. The step counts as skipped
        (`decide`: the counters, the stop after `max_bad_steps`) only when nothing was updated:
        the loss was not finite, or every parameter with a gradient kept its value."""
        stats = optimizer.backward_stats(per_param=True)
        stats = torch.zeros(3, device=loss.device) if stats is None else stats

        def judge(values: list[float]) -> Verdict:
            loss_value, grad_norm, skipped, with_grad = values[:4]
            nothing_updated = not math.isfinite(loss_value) or (skipped and skipped == with_grad)
            flags: dict[str, Any] = {}
            if skipped:
                names = {id(p): n for n, p in self.model.named_parameters()}
                hooked = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
                flags["skipped_params"] = int(skipped)
                flags["skipped_param_names"] = [names.get(id(p), f"#{i}") for i, (p, bad) in
                                                enumerate(zip(hooked, values[4:])) if bad]
                if not nothing_updated:
                    logger.warning("step %d: non-finite gradient of %s; left unchanged, the other parameters "
                                   "updated", step + 1, ", ".join(flags["skipped_param_names"]))
            # a finite norm ends a run of skipped steps
            flags.update(self.decide(step, loss_value, math.nan if nothing_updated else grad_norm, note=note))
            return Verdict(loss_value, grad_norm, flags)

        return Reading(torch.cat([loss.float().view(1), stats.to(loss.device)]), judge)

    def decide(self, step: int, loss: float, grad_norm: float, *, max_norm: float = math.inf,
               rerun: Callable[[], object] | None = None, note: Callable[[], str] | None = None) -> dict[str, Any]:
        """The verdict on host values (for a loop that reads them itself): what to add to the
        step's metrics. A non-finite loss or norm: every gradient of the model is dropped (the
        update must be skipped), the first non-finite layer is named (`rerun` re-runs the forward
        when the loss itself is not finite), and after `max_bad_steps` such steps in a row a
        NanoChatError stops the run (`note()`: which checkpoint is good). Otherwise a clip is
        counted when the norm exceeds `max_norm`; a finite step ends a run of skipped ones."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return self._skip(step, loss_finite=math.isfinite(loss), rerun=rerun, note=note)
        self._in_a_row = 0
        if grad_norm <= max_norm:
            return {}
        factor = max_norm / grad_norm
        prev = self.counters["min_clip_factor"]
        self.counters["clip_events"] += 1
        self.counters["min_clip_factor"] = factor if prev is None else min(prev, factor)
        return {"clip_factor": factor}

    def _skip(self, step: int, *, loss_finite: bool, rerun, note) -> dict[str, Any]:
        where = first_nonfinite_layer(self.model, run=None if loss_finite else rerun)
        where = where or "unknown (no module output or gradient is non-finite on a re-run)"
        self.counters["overflow_events"] += 1
        self.counters["skipped_steps"] += 1
        self._in_a_row += 1
        self._bad_since = step + 1 if self._in_a_row == 1 else self._bad_since
        logger.warning("step %d: non-finite %s, first at %s; update skipped (%d in a row)",
                       step + 1, "gradient" if loss_finite else "loss", where, self._in_a_row)
        for p in self.model.parameters():
            p.grad = None
        if self._in_a_row >= self.max_bad_steps:
            raise NanoChatError(
                f"{self._in_a_row} consecutive steps with non-finite loss or gradients, steps "
                f"{self._bad_since}-{step + 1} (last first seen at {where}); stopping at step {step + 1}. "
                f"{note() if note else 'No checkpoint was named'}: lower the learning rate, check the data, "
                "or try FP8 mode e5m2 / auto (more range for gradients)")
        return {"skipped": True, "nonfinite_at": where}

    # ------------------------------------------------------------------ reports and checkpoints
    def summary(self) -> dict[str, Any]:
        """The counts so far (plain, JSON-ready): TrainResult.guard_stats, the summary event."""
        return dict(self.counters)

    def summary_text(self, label: str) -> str:
        """The counts as the line a run prints, headed by `label` (e.g. "end of training")."""
        c = self.counters
        clip = f", smallest clip factor {c['min_clip_factor']:.3f}" if c["min_clip_factor"] is not None else ""
        return (f"step guard ({label}): {c['skipped_steps']} skipped steps (non-finite loss or gradients), "
                f"{c['clip_events']} clipping events{clip}")

    def state_dict(self) -> dict[str, Any]:
        """Plain data (JSON-safe) under one key, so it can sit beside a loop's own in one
        checkpoint dict: {"guard": the counters}."""
        return {"guard": dict(self.counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters from `state` (a whole checkpoint dict may be passed)."""
        self.counters.update(state.get("guard") or {})


__all__ = ["COUNTERS", "Reading", "StepGuard", "Verdict"]
