"""NanoChatTrainer end to end on CPU, against references that cannot be faked:

- learning: the loss after 30 steps is well below the loss at step 1 (ratio stated below);
- resume: a run interrupted right after a checkpoint and resumed logs *bitwise* the same
  losses for the following steps as an uninterrupted run (CPU, no compile);
- bad input fails before training, with a message that names the problem;
- the CLI entrypoint trains and reports val bpb; FP8 on CPU falls back (recorded) or emulates.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nanochat.checkpoint import latest_checkpoint
from nanochat.trainer import NanoChatTrainer, lr_multiplier
from tests.conftest import tiny_train_kwargs

ROOT = Path(__file__).resolve().parents[1]


def _losses(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if "loss" in r}  # event lines carry no loss


def test_loss_falls_and_result_is_complete(small_corpus, tmp_path):
    result = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "run")).train()
    losses = _losses(tmp_path / "run")
    first = losses[1]
    last = sum(losses[s] for s in range(26, 31)) / 5
    assert last < 0.75 * first, (first, last)  # measured 0.68 (5.77 -> 3.92) at lr 1e-2
    assert 0 < result.val_bpb < 8.0  # 8 bits/byte = uniform over bytes
    assert result.steps == 30 and result.tokens_per_sec > 0 and result.wall_time_s > 0
    assert result.fallbacks == [] and result.fp8_backend == "off"
    assert len(result.samples) == 1
    assert result.optimizer_state_bytes == 8 * result.num_params
    assert latest_checkpoint(tmp_path / "run").step == 30
    assert json.loads((tmp_path / "run" / "result.json").read_text())["steps"] == 30


def test_resume_is_bitwise_identical(small_corpus, tmp_path, monkeypatch):
    kw = dict(num_iterations=8, save_every=4, eval_every=4, num_samples=0)
    NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "full", **kw)).train()
    reference = _losses(tmp_path / "full")

    real_save = NanoChatTrainer._save

    def crash_after_first_save(self, step):
        real_save(self, step)
        raise KeyboardInterrupt  # the process dies right after checkpointing step 4

    monkeypatch.setattr(NanoChatTrainer, "_save", crash_after_first_save)
    with pytest.raises(KeyboardInterrupt):
        NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "cut", **kw)).train()
    monkeypatch.setattr(NanoChatTrainer, "_save", real_save)
    NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "cut", resume=True, **kw)).train()
    resumed = _losses(tmp_path / "cut")
    for step in range(1, 9):
        assert resumed[step] == reference[step], (step, resumed[step], reference[step])


def test_resume_with_different_model_is_refused(small_corpus, tmp_path):
    NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "r", num_iterations=2, num_samples=0)).train()
    with pytest.raises(ValueError, match="model_name"):
        NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "r", model_name="d4", resume=True)).train()


def test_data_errors_come_before_training(tmp_path):
    with pytest.raises(Exception, match="does not exist|not found|No such"):
        NanoChatTrainer(**tiny_train_kwargs(tmp_path / "missing", tmp_path / "run")).train()
    assert not (tmp_path / "run").exists()


def test_unknown_field_names_the_fields():
    with pytest.raises(TypeError, match="fp8_mode"):
        NanoChatTrainer(fp8_mod="e5m2")


def test_lr_schedule_warmup_then_decay():
    ms = [lr_multiplier(s, 100, 10, 0.1) for s in range(100)]
    assert ms[0] == pytest.approx(0.1) and ms[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(ms[10:], ms[11:]))
    assert ms[-1] == pytest.approx(0.1, abs=1e-3)


def test_cli_trains_and_reports(small_corpus, tmp_path):
    kw = tiny_train_kwargs(small_corpus, tmp_path / "cli", num_iterations=5)
    argv = []
    for k, v in kw.items():
        argv += [f"--{k}", str(v)]
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "base_train.py"), *argv],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "val bpb" in r.stdout


def test_cli_missing_dataset_exits_2(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "base_train.py"), "--dataset_path",
                        str(tmp_path / "nope"), "--run_dir", str(tmp_path / "run")],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 2
    assert "nope" in r.stderr and "Traceback" not in r.stderr


def test_grad_accumulation_matches_one_big_batch(small_corpus, tmp_path):
    """2 micro-batches of 4 equal 1 batch of 8 (the same 8 windows): same first-step loss and
    the same weights after several steps, up to fp32 summation order (rtol 1e-4 stated)."""
    import torch

    big = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "big", batch_size=8,
                                              num_iterations=3, num_samples=0))
    big.train()
    acc = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "acc", batch_size=4,
                                              grad_accum_steps=2, num_iterations=3, num_samples=0))
    acc.train()
    assert _losses(tmp_path / "acc")[1] == pytest.approx(_losses(tmp_path / "big")[1], rel=1e-5)
    for (name, a), b in zip(big.model.state_dict().items(), acc.model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)


def test_compile_with_fp8_trains_like_eager(small_corpus, tmp_path):
    """--compile --fp8 --fp8_emulate: the compiled model's losses equal the eager run's within
    1e-3 relative (inductor reorders fp32 arithmetic), and the loss falls."""
    kw = dict(num_iterations=4, num_samples=0, fp8=True, fp8_emulate=True)
    NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "eager", **kw)).train()
    NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "compiled", compile=True, **kw)).train()
    eager, compiled = _losses(tmp_path / "eager"), _losses(tmp_path / "compiled")
    for step in eager:
        assert compiled[step] == pytest.approx(eager[step], rel=1e-3), step
    assert compiled[4] < compiled[1]
