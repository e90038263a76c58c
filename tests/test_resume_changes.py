"""A resumed run says what it takes differently from its checkpoint: one warning line for each
flag that may differ and does (from what, to what), and for the learning-rate schedule's flags
the rate at the next step under the checkpoint's settings and under this run's. Checked through
the trainer: this run's rate against the rate its first step logs in metrics.jsonl, the
checkpoint's against its schedule's floor (a finished run's schedule past its last step)."""

from __future__ import annotations

import logging
import re

import pytest

from nanochat.checkpoint.resume import changed_settings
from nanochat.config import TrainConfig
from tests.conftest import run_records, tiny_train_kwargs


def _lrs(run_dir) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in run_records(run_dir) if "lr" in r}


def _warnings(caplog) -> list[str]:
    """The distinct warning lines about changed settings (caplog may hold a record once per phase
    handler), in order."""
    lines = [r.getMessage() for r in caplog.records
             if r.levelno == logging.WARNING and "resumed with" in r.getMessage()]
    return list(dict.fromkeys(lines))


def test_a_finished_run_extended_and_a_changed_lr_are_each_said_with_the_rates(small_corpus, tmp_path, nanochat_log):
    caplog = nanochat_log
    from nanochat.train.trainer import NanoChatTrainer

    run_dir = tmp_path / "run"
    kw = tiny_train_kwargs(small_corpus, run_dir, num_iterations=6, warmup_steps=2, num_samples=0)
    NanoChatTrainer(**kw).train()
    first = _lrs(run_dir)

    caplog.clear()
    NanoChatTrainer(**{**kw, "num_iterations": 12, "resume": True}).train()
    lines = _warnings(caplog)
    assert len(lines) == 1, lines
    resumed = _lrs(run_dir)
    m = re.fullmatch(r"resumed with --num_iterations changed from the checkpoint's 6 to 12; the learning rate at "
                     r"step 7 is (\S+), (\S+) under the checkpoint's settings", lines[0])
    assert m, lines[0]
    assert float(m[1]) == pytest.approx(resumed[7], rel=1e-2)  # the rate step 7 trained at (3 digits shown)
    floor = TrainConfig(**kw).lr * TrainConfig(**kw).final_lr_frac
    assert float(m[2]) == pytest.approx(floor, rel=1e-2)  # the finished schedule past its end: its floor
    assert first[6] < resumed[7] / 2  # the premise: the rate jumps from the finished run's last one

    caplog.clear()
    NanoChatTrainer(**{**kw, "num_iterations": 14, "lr": 2e-2, "auto_resume": True}).train()
    lines = _warnings(caplog)
    assert len(lines) == 2 and all("\n" not in line for line in lines), lines
    assert lines[0].startswith("resumed with --num_iterations changed from the checkpoint's 12 to 14; the learning "
                               "rate at step 13 is "), lines
    assert lines[1].startswith("resumed with --lr changed from the checkpoint's 0.01 to 0.02; the learning rate at "
                               "step 13 is "), lines
    assert float(lines[1].split(" is ")[1].split(",")[0]) == pytest.approx(_lrs(run_dir)[13], rel=1e-2)


def test_nothing_is_said_when_only_how_the_run_starts_differs(tmp_path):
    cfg = TrainConfig(**tiny_train_kwargs(tmp_path, tmp_path / "r", resume=True))
    saved = TrainConfig(**tiny_train_kwargs(tmp_path, tmp_path / "r", batch_size=4)).to_dict()
    assert changed_settings({"config": saved, "step": 3}, cfg, 30) == []
    saved_eval = {**saved, "batch_size": cfg.batch_size, "eval_every": 5}
    assert changed_settings({"config": saved_eval, "step": 3}, cfg, 30) == [
        "resumed with --eval_every changed from the checkpoint's 5 to 0"]
