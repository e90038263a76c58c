"""NanoChatTrainer end to end on CPU, against references that cannot be faked:

- learning: the loss after 30 steps is well below the loss at step 1 (ratio stated below);
- resume: a run interrupted right after a checkpoint and resumed logs *bitwise* the same
  losses for the following steps as an uninterrupted run (CPU, no compile);
- bad input fails before training, with a message that names the problem;
- the CLI entrypoint trains and reports val bpb; with its output in a file, one plain line per
  --log_every steps and no `\r` (nanochat.train.progress: a bar on a terminal, lines elsewhere);
  FP8 on CPU falls back (recorded) or emulates;
- every fallback goes to one list, logged once (nanochat.config.fields.Fallbacks).

Modules: nanochat.train.trainer, nanochat.train.run_data, and the public names
(nanochat.trainer, nanochat.fp8, nanochat.engine, nanochat.hf_trainer).
"""

import contextlib
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanochat import rundir
from nanochat.checkpoint import committed
from nanochat.device import DeviceReads
from nanochat.config import TrainConfig, parse_cli
from nanochat.train.progress import Progress, format_eta
from nanochat.train.trainer import NanoChatTrainer, lr_multiplier
from tests.conftest import perturbed_init, run_records, tiny_train_kwargs, train_until_first_save

ROOT = Path(__file__).resolve().parents[1]


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run_records(run_dir) if "loss" in r}  # event lines carry no loss


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
    assert committed(tmp_path / "run")[-1].step == 30
    assert json.loads((tmp_path / "run" / "result.json").read_text())["steps"] == 30


def test_resume_is_bitwise_identical(small_corpus, tmp_path, monkeypatch):
    kw = dict(num_iterations=8, save_every=4, eval_every=4, num_samples=0)
    NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "full", **kw)).train()
    reference = _losses(tmp_path / "full")

    train_until_first_save(tiny_train_kwargs(small_corpus, tmp_path / "cut", **kw), monkeypatch)  # dies at step 4
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


def test_the_documented_import_paths_are_the_ones_that_train():
    """The names README, docs and examples import stay where they say, and are the objects the
    package's own modules define (not copies that could drift)."""
    import nanochat
    import nanochat.engine
    import nanochat.fp8 as fp8
    from nanochat.trainer import NanoChatTrainer as public, TrainResult, lr_multiplier as public_lr

    import nanochat.train.trainer as impl
    assert (public, TrainResult, public_lr) == (impl.NanoChatTrainer, impl.TrainResult, impl.lr_multiplier)
    assert nanochat.NanoChatTrainer is public and nanochat.TrainConfig is TrainConfig
    for name in ("apply_fp8", "restore_fp8", "FP8Training", "FP8Config"):
        assert name in fp8.__all__ and getattr(fp8, name).__module__.startswith(("nanochat.fp8.", "nanochat.config."))
    import nanochat.optim as optim
    for name in ("FP8Optim", "FP8Tensor"):  # the optimizer's moments, re-exported by nanochat.fp8
        assert name in fp8.__all__ and getattr(fp8, name) is getattr(optim, name)
        assert getattr(fp8, name).__module__.startswith("nanochat.optim.")
    assert callable(nanochat.engine.generate)
    pytest.importorskip("transformers")
    from nanochat.hf_trainer import FP8Trainer
    assert FP8Trainer.__module__ == "nanochat.hf_trainer"


def test_fallbacks_are_one_list_each_logged_once_and_named_by_flags(caplog):
    """The run's one collector (nanochat.config.fields.Fallbacks): a fallback is logged once and
    recorded once, FP8Config's fields shown as the CLI's flags; a part that keeps its own list
    (the optimizer's backends, the trackers) is read with it, entries it adds later included."""
    from nanochat.config import fields

    fallbacks, own = fields.Fallbacks(translate=fields.flag_text), []
    fallbacks.follow(lambda: own)
    fallbacks.add("fp8: `emulate` is slow")
    fallbacks.add("fp8: `emulate` is slow")
    fallbacks.add("said by its part", said=True)
    own.append("a tracker failed")
    assert list(fallbacks) == ["fp8: --fp8_emulate is slow", "said by its part", "a tracker failed"]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "WARNING: fp8: --fp8_emulate is slow"]


def test_lr_schedule_warmup_then_decay():
    ms = [lr_multiplier(s, 100, 10, 0.1) for s in range(100)]
    assert ms[0] == pytest.approx(0.1) and ms[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(ms[10:], ms[11:]))
    assert ms[-1] == pytest.approx(0.1, abs=1e-3)


def test_cli_log_in_a_file_is_one_plain_line_per_log_every(small_corpus, tmp_path):
    """The CLI with stdout and stderr in a file (nohup, slurm): no `\r` anywhere, the tokenizer's
    training and the token store's build included (a fresh cache makes both run); between the
    header and the end-of-run summary, one line per --log_every steps (10, 20, ... 60) and the
    evaluations, nothing else; each line's loss is metrics.jsonl's, with lr, tokens/s, MFU, ETA."""
    run = tmp_path / "cli"
    kw = tiny_train_kwargs(small_corpus, run, num_iterations=60, eval_every=30, log_every=10, num_samples=0)
    argv = ["--no_compile", *(a for k, v in kw.items() if k != "compile" for a in (f"--{k}", str(v)))]
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "base_train.py"), *argv], stdout=f,
                           stderr=subprocess.STDOUT, cwd=tmp_path, timeout=300,
                           env={**os.environ, "NANOCHAT_CACHE": str(tmp_path / "cache")})
    text = log.read_text()
    assert r.returncode == 0, text[-3000:]
    assert "\r" not in text
    assert "tokenizer: training" in text and "building it" in text  # both progresses ran, here
    lines = text.splitlines()
    header_end = next(i for i, line in enumerate(lines) if line.startswith("mfu "))  # the run table's last row
    summary = next(i for i, line in enumerate(lines) if line.startswith("step guard (end of training)"))
    body = lines[header_end + 1:summary]
    progress = [re.fullmatch(r"step (\d+)/60 \([\d.]+%\) \| loss ([\d.]+) \| lr [\d.e+-]+ \| [\d,]+ tok/s \| "
                             r"mfu (-|[\d.]+%) \| eta \S+", line) for line in body]
    evals = [re.fullmatch(r"step (\d+): val loss [\d.]+, val bpb [\d.]+", line) for line in body]
    assert all(p or e for p, e in zip(progress, evals)), body
    losses = _losses(run)
    assert [(int(p[1]), p[2]) for p in progress if p] == [(s, f"{losses[s]:.4f}") for s in range(10, 61, 10)]
    assert [int(e[1]) for e in evals if e] == [30, 60]


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_elsewhere(capsys):
    """Progress, both ways, against the lines written out here: on a terminal a bar redrawn on
    stderr (`\r`) and nothing on stdout; elsewhere one line every `every` steps and the last,
    nothing on stderr; a skipped step (no tokens/s) prints no line. A run whose groups have peaks
    of their own (Muon's) shows the multiplier `lrm` for `lr`."""
    record = {"loss": 1.5, "lr": 1e-3, "tokens_per_sec": 1000.0}
    bar = Progress(22, 0, every=5, tokens_per_step=100, terminal=True)
    for done in range(1, 23):
        bar.update(done, dict(record), 0.25)
    bar.close()
    out, err = capsys.readouterr()
    assert out == "" and "\r" in err and "loss=1.500" in err and "mfu=25.0%" in err
    lines = Progress(22, 0, every=5, tokens_per_step=100, terminal=False)
    for done in range(1, 23):
        lines.update(done, {"loss": float("nan"), "lr": 1e-3, "skipped": True} if done == 10 else dict(record), None)
    lines.write("step 22: val loss 1.0000, val bpb 2.0000")
    out, err = capsys.readouterr()
    assert err == "" and out.splitlines() == [
        "step 5/22 (22.7%) | loss 1.5000 | lr 1.00e-03 | 1,000 tok/s | mfu - | eta 2s",  # 17 x 100 / 1000 s
        "step 15/22 (68.2%) | loss 1.5000 | lr 1.00e-03 | 1,000 tok/s | mfu - | eta 1s",
        "step 20/22 (90.9%) | loss 1.5000 | lr 1.00e-03 | 1,000 tok/s | mfu - | eta 0s",
        "step 22/22 (100.0%) | loss 1.5000 | lr 1.00e-03 | 1,000 tok/s | mfu - | eta 0s",
        "step 22: val loss 1.0000, val bpb 2.0000"]
    per_group = Progress(5, 0, every=5, tokens_per_step=100, terminal=False, per_group=True)
    for done in range(1, 6):
        per_group.update(done, dict(record, lrm=0.5), None)
    assert capsys.readouterr().out == "step 5/5 (100.0%) | loss 1.5000 | lrm 0.50 | 1,000 tok/s | mfu - | eta 0s\n"
    assert [format_eta(s) for s in (7.4, 185, 3725, float("nan"))] == ["7s", "3m05s", "1h02m", "?"]


def test_cli_missing_dataset_exits_2(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "base_train.py"), "--dataset_path",
                        str(tmp_path / "nope"), "--run_dir", str(tmp_path / "run")],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 2
    assert "nope" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.two_computations
def test_grad_accumulation_matches_one_big_batch(small_corpus, tmp_path, monkeypatch):
    """2 micro-batches of 4 against 1 batch of 8 (the same 8 windows), compared where the
    comparison is stable:

    - the gradient handed to the first optimizer step: per tensor, |g_acc - g_big| <= 1e-5 |g_big|
      in the 2-norm. Each element is a sum over the batch's 8 x 32 positions (and the backward's
      reductions over the width), split in two and reordered; fp32 reordering moves a sum of n terms
      by at most about n * 2^-24 of the sum of their magnitudes (1.5e-5 for n = 256), typically
      sqrt(n) * 2^-24 (1e-6); the norm is carried by the large elements, where cancellation is mild.
    - the loss at each of 3 steps: relative 1e-5. Weights are not compared: Adam divides by
      sqrt(v) + eps, so an element whose gradient is near zero (common behind ReLU^2) turns a last-bit
      difference into a step of a sizeable fraction of lr (measured: 1.8e-4 after 3 steps at lr 1e-2
      under the perturbation pass, 169 weights beyond rtol 1e-4). The loss is a mean over 256 fp32
      terms (reordering: ~1e-7), and the weights Adam pulls apart are those whose gradient is near
      zero, so their first-order effect on the loss, gradient x difference, is smaller still
      (measured: 8e-8 with and without the perturbation)."""
    grads = {}
    real_step = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        grads.setdefault(self.run, [p.grad.clone() for g in self.param_groups for p in g["params"]])
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    for run, kw in (("big", dict(batch_size=8)), ("acc", dict(batch_size=4, grad_accum_steps=2))):
        monkeypatch.setattr(torch.optim.AdamW, "run", run, raising=False)
        with perturbed_init() if run == "acc" else contextlib.nullcontext():
            NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / run, num_iterations=3, num_samples=0,
                                                **kw)).train()
    for i, (a, b) in enumerate(zip(grads["acc"], grads["big"], strict=True)):
        assert (a - b).norm() <= 1e-5 * b.norm(), (i, ((a - b).norm() / b.norm()).item())
    big, acc = _losses(tmp_path / "big"), _losses(tmp_path / "acc")
    for s in (1, 2, 3):
        assert acc[s] == pytest.approx(big[s], rel=1e-5), (s, acc[s], big[s])


def test_compile_is_the_default():
    assert TrainConfig().compile is True and TrainConfig().compile_scope == "model"
    assert parse_cli(TrainConfig, ["--no_compile"]).compile is False


@pytest.mark.two_computations
@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_compile_with_fp8_trains_like_eager(small_corpus, tmp_path, scope):
    """--fp8 --fp8_emulate, compiled whole (the default) or per block: the losses equal the eager
    run's within 1e-3 relative, the loss falls, the compiling step's time is reported apart from
    tokens/s, and evaluation runs the eager model.

    The bound: inductor reorders fp32 arithmetic, which moves the step-1 loss by ~1e-7; through
    the FP8 casts a last-bit difference lands a few codes one quantum away, and Adam amplifies the
    difference in the weights whose gradients are near zero (see the accumulation test above), so
    it grows step by step: measured 8e-8, 1e-6, 7e-6 at steps 2-4 under the perturbation pass, two
    orders below 1e-3. The bound catches a compiled step that trains differently (wrong gradients,
    a lost update); a compiled graph that casts differently is caught by test_fp8_linear's compiled
    SQNR test, since FP8's own effect on these early losses is only ~3e-4."""
    kw = dict(num_iterations=4, num_samples=0, fp8=True, fp8_emulate=True, fp8_layers="all")
    eager_result = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "eager", **kw)).train()
    with perturbed_init():
        result = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "compiled", compile=True,
                                                     compile_scope=scope, **kw)).train()
    eager, compiled = _losses(tmp_path / "eager"), _losses(tmp_path / "compiled")
    for step in eager:
        assert compiled[step] == pytest.approx(eager[step], rel=1e-3), step
    assert compiled[4] < compiled[1]
    assert eager_result.compile_time_s == 0 and result.compile_time_s > 0
    assert not any("compile" in f for f in result.fallbacks)
    assert result.val_loss == pytest.approx(eager_result.val_loss, rel=1e-3)


def test_a_failing_compile_falls_back_to_eager_once(small_corpus, tmp_path, monkeypatch):
    """No usable C++ compiler: one recorded fallback naming --no_compile, and the run trains
    exactly as an eager one does (the same eager code: losses bitwise equal)."""
    import torch._inductor.config as inductor_config

    kw = dict(num_iterations=3, num_samples=0)
    NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "eager", **kw)).train()
    # no kernel compiled by an earlier test may be reused, from disk or from memory
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    from torch._inductor import codecache

    for cache in ("PyCodeCache", "CppCodeCache", "CppPythonBindingsCodeCache", "CppWrapperCodeCache"):
        if hasattr(getattr(codecache, cache, None), "cache_clear"):
            getattr(codecache, cache).cache_clear()
    # inductor's own patch: monkeypatch's undo would leave cpp.cxx hidden for the later tests
    with inductor_config.patch({"cpp.cxx": ("/nonexistent/c++",), "fx_graph_cache": False}):
        result = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "broken", compile=True, **kw)).train()
    compile_fallbacks = [f for f in result.fallbacks if f.startswith("compile:")]
    assert len(compile_fallbacks) == 1 and "--no_compile" in compile_fallbacks[0]
    assert _losses(tmp_path / "broken") == _losses(tmp_path / "eager")


def count_reads_per_step(trainer: NanoChatTrainer) -> list[int]:
    """Run `trainer.train()` with every step's device reads counted; one entry per step."""
    per_step: list[int] = []
    step_fn = trainer.train_step

    def counted(step):
        with DeviceReads() as reads:
            out = step_fn(step)
        per_step.append(reads.count)
        return out

    trainer.train_step = counted
    trainer.train()
    return per_step


def test_a_training_step_reads_the_device_once(small_corpus, tmp_path):
    """--fp8 --fp8_emulate --fp8_opt_level 2: one device read per steady-state step (loss, norm and
    the non-finite check travel together); a step sampling FP8 statistics adds one (all layers'
    counts in one read); auto's calibration steps read nothing more, its deciding step one per
    layer role at most (outside the steady state)."""
    kw = tiny_train_kwargs(small_corpus, tmp_path / "reads", num_iterations=12, fp8=True, fp8_emulate=True,
                           fp8_layers="all", fp8_opt_level=2, fp8_stats_every=4, num_samples=0)
    reads = count_reads_per_step(NanoChatTrainer(**kw))
    stats_steps = {3, 7, 11}  # steps 4, 8, 12 (0-based here)
    assert [r for i, r in enumerate(reads) if i not in stats_steps] == [1] * 9
    assert all(reads[i] <= 2 for i in stats_steps), reads


def test_no_save_checkpoints_writes_none(small_corpus, tmp_path):
    """--no_save_checkpoints (benchmarks): no checkpoint at --save_every nor at the end, the rest
    of the run's files as usual, and such a run cannot be resumed (refused, naming why)."""
    assert parse_cli(TrainConfig, ["--no_save_checkpoints"]).save_checkpoints is False
    with pytest.raises(ValueError, match="--save_checkpoints must be"):
        TrainConfig(save_checkpoints="no")
    kw = dict(num_iterations=4, save_every=2, num_samples=0)
    result = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "run", save_checkpoints=False, **kw)).train()
    assert result.steps == 4
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name != rundir.LOCK_NAME) == [
        "metrics.jsonl", "result.json", "sources.json", "tokenizer"]
    with pytest.raises(ValueError, match="--resume: no checkpoint"):
        NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "run", resume=True, **kw)).train()
