"""FP8 in the training loop (CPU, emulated FP8), checked against an uninterrupted run or hand counts:

- an inf injected into one layer's gradient skips exactly that step, is counted by the step guard
  (TrainResult.guard_stats, not fp8_stats), and the run names the layer; M such steps in a row
  stop the run and leave the last checkpoint loadable;
- `--fp8_mode auto` fixes formats after --fp8_auto_steps (their table printed once), stores them
  in the checkpoint, and a resumed run reuses them (no recalibration) and logs bitwise the same
  losses as a run that was never interrupted;
- sampled statistics and the end-of-run summary reach TrainResult.fp8_stats and metrics.jsonl;
- --fp8_auto_recheck_every switches a role after two disagreeing re-checks (here a doctored measurement:
  e4m3 flushing every gradient value), logs and reports the switch, keeps it in the checkpoint
  with the pending count, and a resumed run switches at the same step, losses bitwise equal;
- on CPU without --fp8_emulate, --fp8 warns once (naming --fp8_emulate), records the fallback and
  still trains;
- --resume with another --fp8_opt_level is refused, saying that FP8Optim would load it and
  --init_from changes it;
- --fp8_opt_level 2 without --fp8: no FP8 layer, FP8Tensor moments where the blocks fit, the
  training state per parameter its tensors' bytes exactly (fp32 weights and gradients 4 + 4,
  moments 2 x (1 + 4/256) or fp32's 8), and the same losses, bit for bit, as a run that stores
  the moments the same way with FP8 "on" but no layer converted (--fp8 --fp8_skip '*'): the very
  same computation.
- --fp8_recipe mxfp8 (emulated) trains, evaluates, samples statistics and resumes bit for bit;
  without --fp8_emulate on CPU it warns once, records the fallback naming what MXFP8 needs, trains;
The emulated runs pass --fp8_layers all: a d2 model is too small for FP8 to be faster, so the
default would keep every layer in bf16 (that default is tests/test_fp8_policy.py's).
"""

import math
import re

import pytest
import torch

from nanochat.checkpoint import load_checkpoint
from nanochat.fp8 import FP8Tensor
from nanochat.train.trainer import NanoChatTrainer
from tests.conftest import run_records, tiny_train_kwargs, train_until_first_save, warnings_in

POISONED = "transformer.h.1.mlp.c_fc"


def _records(run_dir):
    return run_records(run_dir)


class PoisonedTrainer(NanoChatTrainer):
    """Multiplies one layer's weight gradient by inf on the steps listed in `bad_steps`."""

    bad_steps: set[int] = set()

    def _setup(self):
        super()._setup()
        calls = {"n": 0}
        weight = dict(self.model.named_parameters())[POISONED + ".weight"]

        def hook(grad):
            calls["n"] += 1  # one backward per step (grad_accum_steps=1)
            return grad * float("inf") if calls["n"] in self.bad_steps else grad

        weight.register_hook(hook)


def test_injected_inf_skips_the_step_and_names_the_layer(small_corpus, tmp_path):
    PoisonedTrainer.bad_steps = {3}
    kw = tiny_train_kwargs(small_corpus, tmp_path / "inf", num_iterations=6, fp8=True, fp8_emulate=True,
                           fp8_layers="all", num_samples=0)
    result = PoisonedTrainer(**kw).train()
    recs = [r for r in _records(tmp_path / "inf") if "step" in r]
    skipped = [r for r in recs if r.get("skipped")]
    assert [r["step"] for r in skipped] == [3]
    assert POISONED in skipped[0]["nonfinite_at"]
    assert result.guard_stats["overflow_events"] == 1 and result.guard_stats["skipped_steps"] == 1
    assert not {"overflow_events", "skipped_steps", "clip_events"} & set(result.fp8_stats)  # FP8's only
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in recs if not r.get("skipped"))


def test_consecutive_overflows_stop_and_keep_the_checkpoint(small_corpus, tmp_path):
    PoisonedTrainer.bad_steps = set(range(5, 100))
    kw = tiny_train_kwargs(small_corpus, tmp_path / "stop", num_iterations=20, save_every=2, fp8=True,
                           fp8_emulate=True, fp8_layers="all", max_bad_steps=3, num_samples=0)
    with pytest.raises(RuntimeError, match=f"3 consecutive.*{POISONED}.*checkpoint"):
        PoisonedTrainer(**kw).train()
    ckpt = load_checkpoint(tmp_path / "stop")
    assert ckpt["step"] == 4  # the last good step; nothing was written after the overflows began
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values())


def test_auto_choices_survive_resume_bitwise(small_corpus, tmp_path, monkeypatch, capsys):
    kw = dict(num_iterations=6, save_every=3, fp8=True, fp8_emulate=True, fp8_layers="all", fp8_mode="auto",
              fp8_auto_steps=2, fp8_stats_every=2, num_samples=0)
    full = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "full", **kw)).train()
    out = capsys.readouterr().out
    assert out.count("fp8 auto: formats chosen by measurement") == 1  # the table once, when fixed
    assert re.search(rf"fp8 auto: {len(full.fp8_choices)} layers; input e[45]m[23] x\d+", out)  # summaries count them
    assert full.fp8_choices and set(full.fp8_choices) == set(full.fp8_converted)
    assert all(set(roles) == {"input", "weight", "grad_output"} for roles in full.fp8_choices.values())

    train_until_first_save(tiny_train_kwargs(small_corpus, tmp_path / "cut", **kw), monkeypatch)
    assert load_checkpoint(tmp_path / "cut")["fp8_choices"] == full.fp8_choices
    resumed = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "cut", resume=True, **kw)).train()
    assert resumed.fp8_choices == full.fp8_choices
    events = [r for r in _records(tmp_path / "cut") if r.get("event") == "fp8_auto_choices"]
    assert len(events) == 1  # calibrated once, before the interruption; not again after resume
    ref = {r["step"]: r["loss"] for r in _records(tmp_path / "full") if "step" in r}
    got = {r["step"]: r["loss"] for r in _records(tmp_path / "cut") if "step" in r}
    assert got == ref

    stats = full.fp8_stats
    assert stats["stats_samples"] == 3 and stats["layers"]
    some = next(iter(stats["layers"].values()))
    assert {"amax", "scale", "underflow_pct", "saturation_pct", "sqnr_db"} <= set(some["input"])
    assert len(stats["top_underflow"]) == 5 and stats["choices"] == full.fp8_choices
    assert any(r.get("event") == "fp8_summary" for r in _records(tmp_path / "full"))


def test_auto_recheck_switches_reports_and_resumes_bitwise(small_corpus, tmp_path, monkeypatch):
    from nanochat.fp8.stats import FP8StatsSampler

    real = FP8StatsSampler.format_counts

    def e4m3_gradients_flush(self):  # as if every grad_output value flushed to zero in e4m3
        counts = real(self)
        for roles in counts.values():
            c = roles["grad_output"]["e4m3"]
            c.underflow = c.nonzero
        return counts

    monkeypatch.setattr(FP8StatsSampler, "format_counts", e4m3_gradients_flush)
    kw = dict(num_iterations=8, save_every=5, fp8=True, fp8_emulate=True, fp8_layers="all", fp8_mode="auto",
              fp8_auto_steps=2, fp8_stats_every=0, fp8_auto_recheck_every=2, num_samples=0)
    full = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "full", **kw)).train()
    # calibrated after step 2 (all e4m3 on this data); samples at 4 (pending) and 6 (switch)
    switches = full.fp8_stats["auto_switches"]
    assert switches and {s["step"] for s in switches} == {6}
    assert {(s["role"], s["from"], s["to"]) for s in switches} == {("grad_output", "e4m3", "e5m2")}
    calibrated = next(r["choices"] for r in _records(tmp_path / "full") if r.get("event") == "fp8_auto_choices")
    assert {s["layer"] for s in switches} == {n for n, roles in calibrated.items() if roles["grad_output"] == "e4m3"}
    assert all(roles["grad_output"] == "e5m2" for roles in full.fp8_choices.values())
    logged = [r for r in _records(tmp_path / "full") if r.get("event") == "fp8_auto_switch"]
    assert len(logged) == len(switches)

    train_until_first_save(tiny_train_kwargs(small_corpus, tmp_path / "cut", **kw), monkeypatch)
    ckpt = load_checkpoint(tmp_path / "cut")
    assert ckpt["step"] == 5 and ckpt["fp8_auto_switches"] == []
    assert set(ckpt["fp8_auto_pending"].values()) == {1}  # one disagreement (step 4) so far
    resumed = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "cut", resume=True, **kw)).train()
    assert resumed.fp8_choices == full.fp8_choices
    assert resumed.fp8_stats["auto_switches"] == switches
    ref = {r["step"]: r["loss"] for r in _records(tmp_path / "full") if "step" in r and "loss" in r}
    got = {r["step"]: r["loss"] for r in _records(tmp_path / "cut") if "step" in r and "loss" in r}
    assert got == ref


def test_auto_recheck_needs_auto_mode():
    from nanochat.config import TrainConfig

    with pytest.raises(ValueError, match="--fp8_auto_recheck_every.*--fp8_mode auto"):
        TrainConfig(fp8=True, fp8_mode="e4m3", fp8_auto_recheck_every=50)
    with pytest.raises(ValueError, match=">= 0"):
        TrainConfig(fp8=True, fp8_mode="auto", fp8_auto_recheck_every=-1)


def test_cpu_fallback_warns_once_and_trains(small_corpus, tmp_path, monkeypatch, nanochat_log):
    from nanochat import common

    monkeypatch.setattr(common, "_warned", set())  # warned once per process: maybe by an earlier test
    result = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "fb", num_iterations=8, fp8=True,
                                                 fp8_opt_level=1, num_samples=0)).train()
    warnings = warnings_in(nanochat_log)
    assert result.fp8_backend == "fallback" and result.fp8_converted == []
    assert len(result.fallbacks) == 1 and "--fp8_emulate" in result.fallbacks[0]
    # the warning the user reads names the flag too, not FP8Config's field
    fallback = [w for w in warnings if "FP8 requested but not available" in w]
    assert len(fallback) == 1 and "--fp8_emulate" in fallback[0] and "`emulate`" not in fallback[0], warnings
    assert "--fp8_skip 'lm_head'" in result.fp8_skipped["lm_head"]  # fp8's `skip_fqns`, as the CLI names it
    losses = [r["loss"] for r in _records(tmp_path / "fb") if "step" in r]
    assert losses[-1] < losses[0]
    assert result.optimizer_state_bytes < 8 * result.num_params  # FP8 moments work without FP8 matmuls


def test_resume_refuses_another_opt_level_and_says_what_loads_it(small_corpus, tmp_path):
    """README: FP8Optim loads a level-2 state at level 0 (tests/test_fp8_optim.py), --resume does not."""
    from nanochat.common import UsageError

    kw = tiny_train_kwargs(small_corpus, tmp_path / "r", num_iterations=2, fp8_opt_level=2, num_samples=0)
    NanoChatTrainer(**kw).train()
    with pytest.raises(UsageError) as e:
        NanoChatTrainer(**{**kw, "fp8_opt_level": 0, "num_iterations": 3, "resume": True}).train()
    assert "--fp8_opt_level: checkpoint 2 vs now 0" in str(e.value)
    assert "FP8Optim loads moments saved at another --fp8_opt_level" in str(e.value) and "--init_from" in str(e.value)


def test_fp8_summaries_are_logged_under_their_own_label(small_corpus, tmp_path):
    """Each fp8_summary line of metrics.jsonl carries the label it was made for ("epoch N" after
    an epoch, "end of training" at the end), also when its table lists layers (sampled statistics)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("bisect.py", "colorsys.py", "keyword.py"):  # ~10 KB: an epoch is a few steps
        (corpus / name).write_text((small_corpus / name).read_text())
    kw = tiny_train_kwargs(corpus, tmp_path / "lab", num_iterations=1, fp8=True, fp8_emulate=True, fp8_layers="all",
                           fp8_stats_every=1, num_samples=0)
    steps_per_epoch = NanoChatTrainer(**kw)
    steps_per_epoch._setup()
    n = steps_per_epoch.data.steps_per_epoch
    assert 1 <= n <= 20, n
    kw.update(num_iterations=n + 2, overwrite=True)
    NanoChatTrainer(**kw).train()
    labels = [r["label"] for r in _records(tmp_path / "lab") if r.get("event") == "fp8_summary"]
    assert labels == ["epoch 1", "end of training"]
    summaries = [r for r in _records(tmp_path / "lab") if r.get("event") == "fp8_summary"]
    assert all(s["layers"] for s in summaries)  # the case under test: summaries that list layers


def test_fp8_moments_without_fp8_layers(small_corpus, tmp_path):
    kw = dict(num_iterations=4, num_samples=0, fp8_opt_level=2)
    trainer = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "moments", **kw))
    result = trainer.train()
    assert result.fp8_backend == "off" and result.fp8_converted == []
    assert result.fallbacks == []  # no FP8 hardware needed, and every d2 tensor fits whole blocks
    params = list(trainer.model.parameters())
    fp8 = {p: p.numel() >= 4096 and p.numel() % 256 == 0 for p in params}  # FP8Optim's rule
    assert all(isinstance(trainer.optimizer.state[p]["exp_avg_sq_sqrt" if fp8[p] else "exp_avg_sq"], FP8Tensor)
               == fp8[p] for p in params)
    n = sum(p.numel() for p in params)
    expected = sum(p.numel() * (4 + 4 + (2 * (1 + 4 / 256) if fp8[p] else 8)) for p in params) / n
    assert result.state_bytes_per_param == pytest.approx(expected, rel=1e-12) and expected == 4 + 4 + 2 * (1 + 4 / 256)

    reference = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "skip_all", fp8=True, fp8_emulate=True,
                                                    fp8_skip=("*",), **kw)).train()
    assert reference.fp8_converted == []
    losses = [[r["loss"] for r in _records(tmp_path / run) if "loss" in r] for run in ("moments", "skip_all")]
    assert len(losses[0]) == 4 and losses[0] == losses[1]


def test_mxfp8_d2_trains_resumes_bitwise_and_evaluates(small_corpus, tmp_path, monkeypatch):
    """--fp8 --fp8_emulate --fp8_recipe mxfp8 --fp8_layers all on d2 (torchao's MXFP8Linear with its
    EMULATED kernels): every eligible layer converts, the losses fall, evaluation runs (in high
    precision), statistics are sampled from MX layers, and a run interrupted after its step-3
    checkpoint resumes to the uninterrupted run's losses bit for bit. --fp8_recipe is a resume
    field: resuming it as tensorwise is refused, naming both."""
    from nanochat.common import UsageError

    kw = dict(num_iterations=6, save_every=3, eval_every=3, fp8=True, fp8_emulate=True, fp8_recipe="mxfp8",
              fp8_layers="all", fp8_stats_every=2, num_samples=0)
    full = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "full", **kw)).train()
    assert full.fp8_backend == "emulated" and len(full.fp8_converted) == 12 and full.fallbacks == []
    assert set(full.fp8_skipped) == {"lm_head"}
    records = _records(tmp_path / "full")
    losses = [r["loss"] for r in records if "step" in r and "loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6] and math.isfinite(full.val_loss)
    stats = full.fp8_stats["layers"]["transformer.h.0.mlp.c_fc"]
    assert {s["dtype"] for s in stats.values()} == {"e4m3"} and all(s["sqnr_db"] > 20 for s in stats.values())

    train_until_first_save(tiny_train_kwargs(small_corpus, tmp_path / "cut", **kw), monkeypatch)
    resumed = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "cut", resume=True, **kw)).train()
    ref = {r["step"]: r["loss"] for r in records if "step" in r and "loss" in r}
    got = {r["step"]: r["loss"] for r in _records(tmp_path / "cut") if "step" in r and "loss" in r}
    assert got == ref and resumed.val_loss == full.val_loss

    with pytest.raises(UsageError) as e:
        NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "cut", resume=True,
                                            **{**kw, "num_iterations": 8, "fp8_recipe": "tensorwise"})).train()
    assert "--fp8_recipe: checkpoint 'mxfp8' vs now 'tensorwise'" in str(e.value)


def test_mxfp8_without_emulate_on_cpu_warns_once_and_trains(small_corpus, tmp_path, monkeypatch, nanochat_log):
    """No FP8 hardware here: the run warns once naming the recipe and what it needs (and
    --fp8_emulate), records the fallback, and trains in high precision."""
    from nanochat import common

    monkeypatch.setattr(common, "_warned", set())
    result = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "fb", num_iterations=6, fp8=True,
                                                 fp8_recipe="mxfp8", fp8_layers="all", num_samples=0)).train()
    warnings = warnings_in(nanochat_log)
    assert result.fp8_backend == "fallback" and result.fp8_converted == []
    (line,) = result.fallbacks
    assert "--fp8_emulate" in line and "10.0+" in line and "--fp8_recipe mxfp8" in line, line
    assert len([w for w in warnings if "FP8 requested but not available" in w]) == 1, warnings
    losses = [r["loss"] for r in _records(tmp_path / "fb") if "step" in r]
    assert losses[-1] < losses[0]
