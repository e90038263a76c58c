"""The resume policy (nanochat.checkpoint.resume), checked against checkpoint metadata built the
way Checkpointer.save writes it (config.to_dict(), resolved_paths, world size, fingerprint):

- the same settings resume; every kept flag that differs is named, all in one error; a flag the
  checkpoint predates counts as its default;
- paths compare resolved (`tok/`, relative, resumes a run saved with the absolute path); the
  batch compares globally (8 x 2 ranks resumes as 16 x 1, not as 8 x 1); FP8 settings count
  (--fp8_layers); another tokenizer is refused;
- a checkpoint at the last step of a finished run, or past the last step, is refused;
- --init_from takes a preset of this run's --model_name only, with its tokenizer, checked by
  fingerprint; `setting_differences` (FP8Trainer's comparison too) lists exactly the keys that differ.
Whole runs that resume and refuse are tests/test_faults.py's and tests/test_init_from.py's.
"""

from __future__ import annotations

import json
import types

import pytest

from nanochat.checkpoint import PT, resume
from nanochat.common import UsageError
from nanochat.config import TrainConfig
from nanochat.tokenizer import BPETokenizer


def _meta(config: TrainConfig, *, world_size: int = 1, fingerprint: str = "tok-a") -> dict:
    return {"config": config.to_dict(), "resolved_paths": resume.resolved_paths(config), "world_size": world_size,
            "tokenizer_fingerprint": fingerprint, "step": 4}


def _check(meta: dict, config: TrainConfig, *, world_size: int = 1, fingerprint: str = "tok-a") -> None:
    resume.check_resume(meta, config, world_size=world_size, tokenizer=types.SimpleNamespace(fingerprint=fingerprint))


def test_the_same_settings_resume_and_every_difference_is_named(tmp_path):
    saved = TrainConfig(run_dir=str(tmp_path), seq_len=64, seed=1)
    _check(_meta(saved), TrainConfig(run_dir=str(tmp_path), seq_len=64, seed=1, num_iterations=999, eval_every=7))
    with pytest.raises(UsageError) as e:
        _check(_meta(saved), TrainConfig(run_dir=str(tmp_path), seq_len=128, seed=2, master_weights="bf16"))
    msg = str(e.value)
    assert msg.startswith("--resume: this run's settings differ from the checkpoint's (")
    for part in ("--seq_len: checkpoint 64 vs now 128", "--seed: checkpoint 1 vs now 2",
                 "--master_weights: checkpoint 'fp32' vs now 'bf16'"):
        assert part in msg, msg
    with pytest.raises(UsageError, match="to change the level, start a new run from these weights with --init_from"):
        _check(_meta(saved), TrainConfig(run_dir=str(tmp_path), seq_len=64, seed=1, fp8_opt_level=2))


def test_a_checkpoint_older_than_a_kept_flag_ran_at_its_default(tmp_path):
    """A checkpoint written before a kept flag existed holds no value for it: it ran at the
    flag's default (and before --optimizer, with AdamW), so it resumes where this run's value is
    that, and is refused where it is not."""
    meta = _meta(TrainConfig(run_dir=str(tmp_path), optimizer="adamw"))
    for newer in ("muon_normuon", "optimizer"):
        del meta["config"][newer]
    _check(meta, TrainConfig(run_dir=str(tmp_path), optimizer="adamw"))
    with pytest.raises(UsageError, match="--optimizer: checkpoint 'adamw' vs now 'muon'"):
        _check(meta, TrainConfig(run_dir=str(tmp_path)))  # auto: muon for the d4 preset


def test_paths_resolved_the_batch_global_and_fp8_layers_kept(tmp_path, monkeypatch):
    (tmp_path / "tok").mkdir()
    saved = TrainConfig(run_dir=str(tmp_path / "r"), tokenizer_dir=str(tmp_path / "tok"), batch_size=8)
    monkeypatch.chdir(tmp_path)
    meta = _meta(saved, world_size=2)
    _check(meta, TrainConfig(run_dir="r", tokenizer_dir="tok/", batch_size=16))  # same dir, 16 x 1 == 8 x 2
    _check(meta, TrainConfig(run_dir="r", tokenizer_dir="tok/", batch_size=4), world_size=4)
    with pytest.raises(UsageError, match=r"--batch_size: checkpoint '8 x 2 ranks' vs now '8 x 1 ranks'"):
        _check(meta, TrainConfig(run_dir="r", tokenizer_dir="tok/", batch_size=8))
    with pytest.raises(UsageError, match=r"--tokenizer_dir: checkpoint '.*tok' vs now 'other'"):
        _check(meta, TrainConfig(run_dir="r", tokenizer_dir="other", batch_size=16))
    with pytest.raises(UsageError, match=r"--fp8_layers: checkpoint 'all' vs now 'faster'"):
        _check(_meta(TrainConfig(fp8=True, fp8_emulate=True, fp8_layers="all")),
               TrainConfig(fp8=True, fp8_emulate=True, fp8_layers="faster"))


def test_another_tokenizer_is_refused(tmp_path):
    config = TrainConfig(run_dir=str(tmp_path))
    with pytest.raises(UsageError, match="--resume: the tokenizer differs from the one the checkpoint was trained"):
        _check(_meta(config, fingerprint="tok-a"), config, fingerprint="tok-b")


def test_a_resume_must_leave_steps_to_train(tmp_path):
    (tmp_path / "checkpoint-000008.pt").write_bytes(b"")
    c = PT.scan(tmp_path)[0]
    config = TrainConfig(run_dir=str(tmp_path), num_iterations=6)
    with pytest.raises(UsageError, match=r"already at step 8 \(checkpoint-000008\.pt\); --num_iterations 6 would"):
        resume.check_budget(c, config, 6)
    resume.check_budget(c, config, 8)  # the run died before its result.json: it resumes, to finish
    (tmp_path / "result.json").write_text(json.dumps({"steps": 8}))
    with pytest.raises(UsageError, match=r"already finished at step 8 \(its result.json\)"):
        resume.check_budget(c, config, 8)
    resume.check_budget(c, config, 10)


def test_init_from_takes_a_preset_of_this_model_with_its_tokenizer(tmp_path):
    src = tmp_path / "src"
    tok = BPETokenizer.train(["hello world, " * 50], 270)
    tok.save(src / "tokenizer")
    meta = {"config": {"model_name": "d2"}, "tokenizer_fingerprint": tok.fingerprint}
    assert resume.check_init_source(meta, TrainConfig(model_name="d2"), src).fingerprint == tok.fingerprint
    with pytest.raises(UsageError, match=r"holds a d2 model, --model_name is d4: pass --model_name d2"):
        resume.check_init_source(meta, TrainConfig(model_name="d4"), src)
    with pytest.raises(UsageError, match=r"trained the Hugging Face model org/x: continue from its export"):
        resume.check_init_source({**meta, "config": {"model_name": "org/x"}}, TrainConfig(model_name="d2"), src)
    with pytest.raises(UsageError, match="is not the tokenizer its checkpoint was trained with"):
        resume.check_init_source({**meta, "tokenizer_fingerprint": "other"}, TrainConfig(model_name="d2"), src)


def test_setting_differences_lists_exactly_the_differing_keys():
    saved, now = {"a": 1, "b": "x", "c": None}, {"a": 1, "b": "y", "d": 2}
    assert resume.setting_differences(saved, now, ("a", "b", "c", "d")) == {"b": ("x", "y"), "d": (None, 2)}
