"""The update's RMS per param group (nanochat.train.updates, --update_rms_every).

Checked against: SGD without momentum, whose update is exactly -lr * grad, so its RMS is lr times
the gradient's RMS, computed here by hand (tolerance 1e-6 relative: fp32 sums of squares of a few
thousand elements, far above their rounding); a frozen group and a skipped step record nothing;
the group names follow the optimizers and their weight decay; a Muon run writes the figures at
the sampled steps only, and the trackers name them train/update_rms_<group>.
"""

import pytest
import torch

from nanochat.optim import FP8Optim, MuonAdamW
from nanochat.report.trackers import translate
from nanochat.train.trainer import NanoChatTrainer
from nanochat.train.updates import UpdateRMS, group_names
from tests.conftest import run_records, tiny_train_kwargs


def test_sgd_update_rms_is_lr_times_the_gradient_rms():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(100))
    frozen = torch.nn.Parameter(torch.randn(8), requires_grad=False)
    opt = torch.optim.SGD([{"params": [a], "lr": 0.1, "weight_decay": 0.0},
                           {"params": [b, frozen], "lr": 0.03, "weight_decay": 0.0}])
    rms = UpdateRMS(opt, every=2, total_steps=5)
    got = []
    for step in range(5):
        a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
        ga, gb = a.grad.clone(), b.grad.clone()
        rms.before(step)
        opt.step()
        got.append((rms.record(), ga, gb))
    assert [bool(r) for r, _, _ in got] == [False, True, False, True, True]  # every 2nd step and the last
    for r, ga, gb in got:
        if r:
            assert r["update_rms_sgd_no_decay_1"] == pytest.approx(0.1 * ga.square().mean().sqrt().item(), rel=1e-6)
            assert r["update_rms_sgd_no_decay_2"] == pytest.approx(0.03 * gb.square().mean().sqrt().item(), rel=1e-6)
    rms.before(3)
    rms.drop()  # a skipped step: no update, nothing recorded
    assert rms.record() == {}


def test_group_names_follow_the_optimizer_and_its_decay():
    m, e, n = (torch.nn.Parameter(torch.randn(256, 256)), torch.nn.Parameter(torch.randn(64, 16)),
               torch.nn.Parameter(torch.randn(16)))
    muon = FP8Optim(torch.optim.Muon([m], lr=0.02, weight_decay=0.1), opt_level=1, compile=False)
    adamw = torch.optim.AdamW([{"params": [e], "weight_decay": 0.1}, {"params": [n], "weight_decay": 0.0}])
    assert group_names(MuonAdamW(muon, adamw)) == ["muon", "adamw", "adamw_no_decay"]
    assert group_names(torch.optim.AdamW([e, n], weight_decay=0.0)) == ["adamw_no_decay"]


def test_a_muon_run_records_each_groups_update_rms_at_the_sampled_steps(small_corpus, tmp_path):
    kw = tiny_train_kwargs(small_corpus, tmp_path / "run", optimizer="muon", num_iterations=7, update_rms_every=3,
                           num_samples=0)
    trainer = NanoChatTrainer(**kw)
    trainer.train()
    names = group_names(trainer.optimizer)
    assert names[0] == "muon" and len(names) == len(trainer.optimizer.param_groups)
    steps = {r["step"]: r for r in run_records(tmp_path / "run") if "loss" in r}
    for step, r in steps.items():
        sampled = {k: v for k, v in r.items() if k.startswith("update_rms_")}
        if step in (3, 6, 7):
            assert set(sampled) == {f"update_rms_{n}" for n in names}, r
            # Muon's update: lr x sqrt(max(1, A/B)) x an orthogonalized matrix's entries, whose RMS
            # is ~1/sqrt(max(A, B)) (singular values ~1): nonzero and below the lr itself
            assert 0 < sampled["update_rms_muon"] < 0.02, r
            scalars, _ = translate(r)
            assert scalars["train/update_rms_muon"] == sampled["update_rms_muon"]
        else:
            assert not sampled, r


def test_update_rms_every_must_not_be_negative():
    from nanochat.config import TrainConfig

    with pytest.raises(ValueError, match="--update_rms_every") as e:
        TrainConfig(update_rms_every=-1)
    assert "\n" not in str(e.value)
