"""Faults a run must survive or report, each checked against a reference that cannot be faked
(the trainer's Checkpointer, nanochat.checkpoint.checkpointer, and the run directory's rules):

- kill -9 at seeded random points of training and of saving (mid-write, between the file's and
  its manifest's rename), in a subprocess: `--resume` continues from a complete checkpoint and
  the run's losses, its final weights, metrics.jsonl (each step once) and result.json's train
  loss equal an uninterrupted run's bit for bit (the same eager CPU code runs in both, so
  equality is exact);
- flipped bytes in the newest checkpoint are refused naming it and the previous good one, which
  then resumes; a NaN written into a weight is never saved, and the stop names a checkpoint that
  verifies and is finite (one with a NaN under a valid manifest is passed over, and --resume
  refuses it); metrics.jsonl is strict JSON (a skipped step's loss is null); a write failing
  with ENOSPC leaves the previous checkpoint intact;
- nothing nanochat cannot prove it wrote is deleted or overwritten (the directory's bytes before
  and after are the reference): a run directory holding a run is refused without
  --resume/--overwrite; a .pt without its manifest is refused by a fresh start and --overwrite,
  and as the newest checkpoint by --resume; a checkpoint planted under another step's name is
  refused; a second process on a run directory is refused (the lock dies with its holder, kill
  -9 included); resuming a finished run, or below its step, is refused;
- --auto_resume, the same command run again after a death: it continues from the checkpoint
  with the uninterrupted run's losses, weights and train loss bit for bit, or starts again from
  step 0 when the run died before its first checkpoint (each step logged once); result.json
  counts the restarts and says where each started from; a finished run says so and exits 0; a
  different run (another --seed in its checkpoint or in its records' start record, or records
  that name no run) is one error line, and --resume or --overwrite with it a config error;
  nothing in the directory changes;
- the last checkpoint is written before the final evaluation, so a failure there keeps it, and
  also when the last step was skipped;
- user and environment errors exit 2 (usage) or 1 (runtime) with one `error:` line naming the
  file or flag, and no traceback (`--debug` shows it); checks that need no training fail before
  the first step (no metrics written).
"""

import concurrent.futures
import contextlib
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nanochat import checkpoint
from nanochat.checkpoint import committed, load_checkpoint
from nanochat.common import NanoChatError, UsageError
from nanochat.fs import AtomicFile
from nanochat.train.evaluation import Evaluator
from nanochat.rundir import LOCK_NAME
from nanochat.train.trainer import NanoChatTrainer
from tests.conftest import load_script, run_dir_held_elsewhere, run_records, tiny_train_kwargs

ROOT = Path(__file__).resolve().parents[1]
STEPS, SAVE_EVERY = 8, 2
WRITES_PER_SAVE = 319
"""torch.save's write calls for one d2 checkpoint (counted); a mid-write kill picks one of them."""


@pytest.fixture(autouse=True)
def _log_to_this_tests_stderr():
    """setup_logging binds its handler to the sys.stderr of its first call, and capsys replaces
    sys.stderr per test: each test starts unbound, whichever test ran first."""
    from nanochat.common import logger

    logger.handlers.clear()


def _kw(corpus, run_dir, **over):
    return tiny_train_kwargs(corpus, run_dir, **{"num_iterations": STEPS, "save_every": SAVE_EVERY,
                                                 "num_samples": 0, **over})


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run_records(run_dir) if "loss" in r}


def _contents(d: Path) -> dict[str, bytes]:
    """Every file under `d` and its bytes, but the run lock's (each start records its pid there)."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file() and p.name != LOCK_NAME}


def _script(name: str):
    return load_script(name)


def _argv(kw: dict) -> list[str]:
    out = []
    for k, v in kw.items():
        if isinstance(v, bool):
            out += [f"--{k}" if v else f"--no_{k}"]  # --no_compile: the eager run the kwargs ask for
        else:
            out += [f"--{k}", str(v)]
    return out


def _cli(capsys, kw: dict, *extra: str, script: str = "base_train") -> tuple[int, str]:
    """Run an entrypoint in this process: (exit status, the stderr lines starting with error:)."""
    capsys.readouterr()
    try:
        code = _script(script).main([*_argv(kw), *extra])
    except SystemExit as e:  # parse errors exit from tyro / parse_cli
        code = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-2000:]
    return code, [l for l in err.splitlines() if l.startswith("error:")]


@pytest.fixture(scope="module")
def reference_run(small_corpus, tmp_path_factory):
    """The uninterrupted run: its directory (checkpoints of steps 6 and 8), losses, final weights
    and reported train loss."""
    run_dir = tmp_path_factory.mktemp("faults") / "full"
    trainer = NanoChatTrainer(**_kw(small_corpus, run_dir))
    result = trainer.train()
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    return run_dir, _losses(run_dir), weights, result.train_loss


@pytest.fixture(scope="module")
def reference(reference_run):
    """The uninterrupted run's losses, final weights and reported train loss."""
    return reference_run[1:]


def _finished_copy(reference_run, small_corpus, tmp_path) -> tuple[Path, dict]:
    """A copy of the uninterrupted run's directory, to damage, and its kwargs: what the run
    left, without training it again."""
    run_dir = tmp_path / "r"
    shutil.copytree(reference_run[0], run_dir, ignore=shutil.ignore_patterns(LOCK_NAME))
    return run_dir, _kw(small_corpus, run_dir)


# A child that trains and SIGKILLs itself at a chosen point (deterministic per seed).
CHILD = r"""
import json, os, signal, sys
from nanochat.checkpoint import pt, store
from nanochat.fs import AtomicFile
from nanochat.train.trainer import NanoChatTrainer
kw, point, save_no, n = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
saves = {"n": 0}
real_save = store.save_checkpoint
def counting_save(*a, **k):
    saves["n"] += 1
    return real_save(*a, **k)
store.save_checkpoint = counting_save
if point == "write":      # the n-th write of torch.save in save number save_no
    real_write, calls = AtomicFile.write, {"n": 0}
    def write(self, data):
        if saves["n"] == save_no:
            calls["n"] += 1
            if calls["n"] == n:
                die()
        return real_write(self, data)
    AtomicFile.write = write
elif point == "rename":   # before the n-th rename (1: the .pt, 2: its manifest) of save save_no
    real_replace, calls = os.replace, {"n": 0}
    def replace(src, dst):
        if saves["n"] == save_no and os.path.basename(dst).startswith("checkpoint-"):
            calls["n"] += 1
            if calls["n"] == n:
                die()
        return real_replace(src, dst)
    pt.os.replace = replace
elif point == "step":     # after step n's update, before it is logged
    from nanochat.train.metrics import MetricsLog
    real_log = MetricsLog.log
    def log(self, record):
        if record.get("step") == n and "loss" in record:
            die()
        return real_log(self, record)
    MetricsLog.log = log
NanoChatTrainer(**kw).train()
"""


def _kill_point(seed: int) -> tuple[str, int, int]:
    """(where, save number, n) for a seed: every kind of point is covered by seeds 0-2."""
    rng = random.Random(seed)
    kind = ("write", "rename", "step")[seed % 3]
    if kind == "write":
        return kind, rng.randint(2, STEPS // SAVE_EVERY), rng.randint(1, WRITES_PER_SAVE)
    if kind == "rename":
        return kind, rng.randint(2, STEPS // SAVE_EVERY), rng.randint(1, 2)
    return kind, 0, rng.randint(SAVE_EVERY + 1, STEPS - 1)


# seeded points, and the last step between its checkpoint and its metrics line (the final
# evaluation runs in between). Seed 3 kills mid-write as seed 0 does, in another save: the same
# code path (a partly written temporary, the previous save intact), so it runs with -m slow only.
KILL_POINTS = [pytest.param(_kill_point(s), marks=pytest.mark.slow) if s == 3 else _kill_point(s) for s in range(5)]


@pytest.fixture(scope="module")
def killed_runs(small_corpus, tmp_path_factory, request) -> dict[tuple, tuple[Path, subprocess.CompletedProcess]]:
    """Each selected kill point's child (CHILD), killed there: its run directory and its exit. As
    many run at a time as there are cores: each trains on one (the suite runs one thread), so on
    2 cores two take the time of one."""
    points = sorted({item.callspec.params["point"] for item in request.session.items
                     if getattr(item, "originalname", "") == "test_kill_9_then_resume_matches_uninterrupted"})

    def run(point: tuple) -> tuple[Path, subprocess.CompletedProcess]:
        run_dir = tmp_path_factory.mktemp("kill") / "cut"
        kw = _kw(small_corpus, run_dir)
        return run_dir, subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(kw), point[0], str(point[1]), str(point[2])],
            capture_output=True, text=True, timeout=300,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])})

    with pytest.MonkeyPatch.context() as m:  # the cache each test gets (conftest), for every child
        m.setenv("NANOCHAT_CACHE", str(tmp_path_factory.getbasetemp() / "nanochat-cache"))
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            return dict(zip(points, pool.map(run, points)))


@pytest.mark.parametrize("point", KILL_POINTS + [("step", 0, STEPS)], ids=str)
def test_kill_9_then_resume_matches_uninterrupted(small_corpus, reference, killed_runs, point):
    ref_losses, ref_weights, ref_train_loss = reference
    run_dir, r = killed_runs[point]
    assert r.returncode == -signal.SIGKILL, (point, r.returncode, r.stderr[-3000:])
    before = {c.step for c in committed(run_dir)}
    assert before, point  # every kill point comes after the first complete save

    trainer = NanoChatTrainer(**_kw(small_corpus, run_dir, resume=True))
    trainer.train()
    # result.json reports what the uninterrupted run did (the last losses: the same floats summed
    # in the same order), also when the kill left no step to run, and is strict JSON
    result = json.loads((run_dir / "result.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert result["train_loss"] == ref_train_loss and result["tokens_per_sec"] > 0, (point, result)
    steps = [rec["step"] for rec in run_records(run_dir) if "loss" in rec]
    assert steps == list(range(1, STEPS + 1)), (point, steps)  # each step logged once, in order
    assert _losses(run_dir) == ref_losses, point
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, ref_weights[name]), (point, name)
    # what the killed save left is gone; the newest --keep_checkpoints remain, all verified
    names = sorted(p.name for p in run_dir.iterdir() if p.name.startswith((".checkpoint", "checkpoint")))
    assert names == ["checkpoint-000006.json", "checkpoint-000006.pt", "checkpoint-000008.json",
                     "checkpoint-000008.pt"], (point, names)


def test_kill_9_at_a_random_time(small_corpus, tmp_path, reference):
    """A SIGKILL from outside at a random instant (wherever it lands: setup, a step, a save)."""
    ref_losses, _, _ = reference
    run_dir = tmp_path / "cut"
    kw = _kw(small_corpus, run_dir)
    proc = subprocess.Popen([sys.executable, "-c", "import json, sys\nfrom nanochat.train.trainer import "
                             "NanoChatTrainer\nNanoChatTrainer(**json.loads(sys.argv[1])).train()", json.dumps(kw)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    # wait for the first checkpoint, then kill within the next ~0.5 s (the run's remaining steps)
    deadline = time.monotonic() + 120
    while not committed(run_dir) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(random.Random(7).uniform(0, 0.5))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if (run_dir / "result.json").exists():  # the kill came after the run had finished: nothing to resume
        with pytest.raises(UsageError, match="already finished"):
            NanoChatTrainer(**_kw(small_corpus, run_dir, resume=True)).train()
    else:
        NanoChatTrainer(**_kw(small_corpus, run_dir, resume=True)).train()
    assert _losses(run_dir) == ref_losses
    assert [rec["step"] for rec in run_records(run_dir) if "loss" in rec] == list(range(1, STEPS + 1))


def test_flipped_bytes_are_detected_and_the_previous_checkpoint_resumes(small_corpus, tmp_path, reference_run,
                                                                       reference, capsys):
    run_dir, kw = _finished_copy(reference_run, small_corpus, tmp_path)
    newest = committed(run_dir)[-1]
    data = bytearray(newest.path.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 200):
        data[i] ^= 0xFF
    newest.path.write_bytes(bytes(data))
    code, errors = _cli(capsys, {**kw, "resume": True, "num_iterations": STEPS + 2})  # the run finished: extend it
    assert code == 1 and len(errors) == 1, errors
    assert "checkpoint-000008.pt is not usable" in errors[0] and "sha256" in errors[0]
    assert "checkpoint-000006.pt (step 6) verifies" in errors[0]
    # the fix the message gives: delete the bad one, resume from step 6 (steps 7-8 run again)
    newest.path.unlink()
    newest.manifest.unlink()
    NanoChatTrainer(**{**kw, "resume": True}).train()
    assert _losses(run_dir) == reference[0]
    assert [r["step"] for r in run_records(run_dir) if "loss" in r] == list(range(1, STEPS + 1))


@pytest.mark.parametrize("damage", ["truncated", "zeroed", "foreign"])
def test_damaged_checkpoint_is_one_error_line(small_corpus, tmp_path, capsys, damage):
    run_dir = tmp_path / "r"
    kw = _kw(small_corpus, run_dir, num_iterations=2)
    NanoChatTrainer(**kw).train()
    path = committed(run_dir)[-1].path
    size = path.stat().st_size
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[: size // 2])
    elif damage == "zeroed":
        path.write_bytes(bytes(size))
    else:
        torch.save({"weights": torch.ones(3)}, path)
    code, errors = _cli(capsys, {**kw, "resume": True, "num_iterations": 3})
    assert code == 1 and len(errors) == 1 and "checkpoint-000002.pt is not usable" in errors[0], errors


class NaNWriter(NanoChatTrainer):
    """Writes a NaN into one weight right after the optimizer update of step `at`."""

    at = 0

    def train_step(self, step: int) -> dict:
        record = super().train_step(step)
        self._updates = getattr(self, "_updates", 0) + (not record.get("skipped"))
        if self._updates == self.at and not record.get("skipped"):
            with torch.no_grad():
                self.model.transformer.h[0].attn.c_q.weight[0, 0] = float("nan")
        return record


def test_nan_in_a_weight_is_never_saved(small_corpus, tmp_path):
    NaNWriter.at = 4  # the update just before the step-4 save
    run_dir = tmp_path / "r"
    with pytest.raises(NanoChatError, match=r"step 4: not saving.*c_q\.weight.*checkpoint-000002\.pt \(step 2, "
                                            r"verified, finite\)"):
        NaNWriter(**_kw(small_corpus, run_dir)).train()
    assert [c.step for c in committed(run_dir)] == [2]
    assert all(torch.isfinite(t).all() for t in load_checkpoint(run_dir)["model"].values())


def test_overflow_stop_names_the_bad_steps_and_a_good_checkpoint(small_corpus, tmp_path, capsys):
    NaNWriter.at = 5  # after the step-4 save: every later loss is NaN, steps 6.. are skipped
    run_dir = tmp_path / "r"
    with pytest.raises(NanoChatError, match=r"steps 6-8.*stopping at step 8.*checkpoint-000004\.pt \(step 4, verified"):
        NaNWriter(**_kw(small_corpus, run_dir, max_bad_steps=3, num_iterations=20)).train()
    assert [c.step for c in committed(run_dir)] == [2, 4]


def test_enospc_keeps_the_previous_checkpoint(small_corpus, tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "r"
    kw = _kw(small_corpus, run_dir)
    real_write = AtomicFile.write

    def full_after_first_save(self, data):
        if committed(run_dir) and self.size > 4096:
            self.error = OSError(errno.ENOSPC, "No space left on device")
            raise self.error
        return real_write(self, data)

    monkeypatch.setattr(AtomicFile, "write", full_after_first_save)
    code, errors = _cli(capsys, kw)
    assert code == 1 and len(errors) == 1, errors
    assert "no space left" in errors[0] and "checkpoint-000004.pt" in errors[0]
    assert "checkpoint-000002.pt is intact" in errors[0]
    monkeypatch.undo()
    assert sorted(p.name for p in run_dir.glob("*checkpoint*")) == ["checkpoint-000002.json", "checkpoint-000002.pt"]
    assert load_checkpoint(run_dir)["step"] == 2


def test_a_run_directory_is_never_clobbered(small_corpus, tmp_path, capsys):
    run_dir = tmp_path / "r"
    kw = _kw(small_corpus, run_dir, num_iterations=2)
    NanoChatTrainer(**kw).train()
    before = _contents(run_dir)
    code, errors = _cli(capsys, kw)
    assert code == 2 and len(errors) == 1 and "--resume" in errors[0] and "--overwrite" in errors[0], errors
    assert _contents(run_dir) == before
    code, _ = _cli(capsys, {**kw, "num_iterations": 4}, "--overwrite")
    assert code == 0
    assert [c.step for c in committed(run_dir)] == [2, 4]
    assert [r["step"] for r in run_records(run_dir) if "loss" in r] == [1, 2, 3, 4]


def test_resume_compares_resolved_paths(small_corpus, tmp_path, monkeypatch):
    tok = tmp_path / "tok"
    NanoChatTrainer(**_kw(small_corpus, tmp_path / "first", num_iterations=1)).train()
    import shutil

    shutil.copytree(tmp_path / "first" / "tokenizer", tok)
    monkeypatch.chdir(tmp_path)
    NanoChatTrainer(**_kw(small_corpus, tmp_path / "r", num_iterations=2, tokenizer_dir="tok/")).train()
    NanoChatTrainer(**_kw(small_corpus, "r", num_iterations=3, tokenizer_dir=str(tok), resume=True)).train()
    assert committed(tmp_path / "r")[-1].step == 3


def test_errors_before_work_are_one_line(small_corpus, tmp_path, capsys, monkeypatch):
    """Each case: exit status, one error line naming what to fix, and no step was run."""
    kw = _kw(small_corpus, tmp_path / "r")
    (tmp_path / "a_file").write_text("not a directory")
    cases = [
        (dict(device="tpu9"), 2, "--device 'tpu9'"),
        (dict(seq_len=8192, batch_size=1), 2, "one evaluation window needs seq_len+1 = 8193"),
        (dict(run_dir=str(tmp_path / "a_file" / "sub")), 2, "not writable"),
        (dict(run_dir=str(small_corpus / "runs" / "r")), 2, "is inside --dataset_path"),
    ]
    for over, want_code, want in cases:
        code, errors = _cli(capsys, {**kw, **over})
        assert code == want_code and len(errors) == 1 and want in errors[0], (over, code, errors)
    assert not (tmp_path / "r" / "metrics.jsonl").exists()
    # values tyro parses are checked by TrainConfig at parse time: one error line, exit 2
    # (tests/test_config.py and tests/test_cli_errors.py check that shape)
    for over, want in ((dict(temperature=-1), "--temperature must be >= 0"),
                       (dict(weight_decay="nan"), "--weight_decay must be a finite number")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            _script("base_train").main(_argv({**kw, **over}))
        err = capsys.readouterr().err
        assert e.value.code == 2 and want in err and "Traceback" not in err, err

    real = Path.write_bytes

    def read_only_dir(self, data):  # root ignores permission bits, so the refusal is simulated
        if self.name.startswith(".write-probe"):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", read_only_dir)
    code, errors = _cli(capsys, kw)
    assert code == 2 and "is not writable (Permission denied)" in errors[0], errors
    monkeypatch.undo()

    monkeypatch.setattr("nanochat.train.preflight.shutil.disk_usage", lambda p: type("U", (), {"free": 1000})())
    code, errors = _cli(capsys, kw)
    assert code == 1 and "1000 B free" in errors[0] and "one checkpoint needs" in errors[0], errors
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


@pytest.mark.parametrize("meta, want", [
    ("[1, 2]", "holds a JSON list"),
    ("no-fingerprint", "'fingerprint' is missing"),
    ("bad-regex", "Parsing error"),
])
def test_broken_tokenizer_meta_names_the_file(small_corpus, tmp_path, capsys, meta, want):
    NanoChatTrainer(**_kw(small_corpus, tmp_path / "first", num_iterations=1)).train()
    tok = tmp_path / "first" / "tokenizer"
    path = tok / "tokenizer_meta.json"
    d = json.loads(path.read_text())
    if meta == "no-fingerprint":
        del d["fingerprint"]
        path.write_text(json.dumps(d))
    elif meta == "bad-regex":
        d["pattern"] = "(unclosed"
        path.write_text(json.dumps(d))
    else:
        path.write_text(meta)
    code, errors = _cli(capsys, _kw(small_corpus, tmp_path / "r", tokenizer_dir=str(tok)))
    assert code == 2 and len(errors) == 1 and want in errors[0] and "tokenizer_meta.json" in errors[0], errors


def test_malformed_hf_tokenizer_names_the_file(small_corpus, tmp_path, capsys):
    """(A malformed config.json next to a valid tokenizer: tests/test_hf.py.)"""
    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    (model_dir / "tokenizer.json").write_text("{}")
    code, errors = _cli(capsys, _kw(small_corpus, tmp_path / "r", model_name=str(model_dir)))
    assert code == 2 and len(errors) == 1 and "hf/tokenizer.json is not a tokenizer" in errors[0], errors


def test_the_summary_has_a_samples_heading_only_over_samples(small_corpus, tmp_path, capsys):
    main = _script("base_train").main
    for n, heading in ((0, False), (1, True)):
        capsys.readouterr()
        assert main([*_argv(_kw(small_corpus, tmp_path / f"r{n}", num_iterations=2, num_samples=n))]) == 0
        out = capsys.readouterr().out
        assert ("\nsamples:\n" in out) is heading and out.count('  "') == n, out


def test_debug_shows_the_traceback(small_corpus, tmp_path, capsys):
    capsys.readouterr()
    code = _script("base_train").main([*_argv(_kw(small_corpus, tmp_path / "r")), "--device", "tpu9", "--debug"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" in err and "error: --device 'tpu9'" in err


def test_fp8_with_bf16_on_cpu_is_one_consistent_error(small_corpus, tmp_path):
    """Checked in a subprocess: the whole stderr, logging included, is the one error line."""
    kw = _kw(small_corpus, tmp_path / "r", fp8=True, dtype="bfloat16")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "base_train.py"), *_argv(kw)],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr
    assert r.stderr.startswith("error: --fp8 with --dtype bfloat16 on cpu")


def test_config_rejects_bad_types_and_values_at_construction():
    for bad in (dict(batch_size=2.5), dict(fp8="yes"), dict(weight_decay=float("nan")), dict(fp8_mode="fp4"),
                dict(fp8=True, fp8_opt_level=3), dict(temperature=-1), dict(lr=float("inf")),
                dict(beta2=1.0), dict(keep_checkpoints=0), dict(resume=True, overwrite=True)):
        with pytest.raises(ValueError):
            NanoChatTrainer(**bad)
    with pytest.raises(UsageError):
        raise UsageError("a UsageError is a ValueError")  # callers that catch ValueError keep working


def test_final_checkpoint_is_saved_before_the_final_evaluation(small_corpus, tmp_path, monkeypatch):
    def failing_evaluation(self):
        raise NanoChatError("evaluation failed")

    monkeypatch.setattr(Evaluator, "loss", failing_evaluation)
    run_dir = tmp_path / "r"
    with pytest.raises(NanoChatError, match="evaluation failed"):
        NanoChatTrainer(**_kw(small_corpus, run_dir, save_every=0, eval_every=0)).train()
    assert [c.step for c in committed(run_dir)] == [STEPS]  # the trained weights survive


def test_tok_train_unwritable_output_is_one_line(small_corpus, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code, errors = _cli(capsys, {"dataset_path": str(small_corpus), "vocab_size": 300,
                                 "tokenizer_dir": str(blocker / "tok")}, script="tok_train")
    assert code == 2 and len(errors) == 1 and str(blocker) in errors[0], errors


# ------------------------------------------------------- what nanochat cannot prove it wrote
def test_a_checkpoint_without_its_manifest_is_never_deleted(small_corpus, tmp_path, reference_run, capsys):
    """A copied-in .pt without its manifest: a fresh start and --overwrite are refused, naming it;
    its bytes stay (it is not deleted as "left by an interrupted save")."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "checkpoint-000006.pt").write_bytes((reference_run[0] / "checkpoint-000006.pt").read_bytes())
    before = _contents(d)
    kw = _kw(small_corpus, d, num_iterations=2)
    for extra in ((), ("--overwrite",)):
        code, errors = _cli(capsys, kw, *extra)
        assert code == 2 and len(errors) == 1 and "checkpoint-000006.pt" in errors[0], (extra, errors)
        assert _contents(d) == before, extra
    assert "move them out" in errors[0]  # --overwrite deletes only checkpoints it can tell it wrote


def test_resume_refuses_a_newest_checkpoint_without_manifest(small_corpus, tmp_path, reference_run, capsys):
    """The newest checkpoint's manifest deleted: --resume refuses (naming it and step 6) instead
    of deleting it and silently resuming two steps back; nothing in the directory changes."""
    run_dir, kw = _finished_copy(reference_run, small_corpus, tmp_path)
    (run_dir / "checkpoint-000008.json").unlink()
    before = _contents(run_dir)
    code, errors = _cli(capsys, {**kw, "resume": True, "num_iterations": STEPS + 2})
    assert code == 2 and len(errors) == 1, errors
    assert "checkpoint-000008.pt has no manifest" in errors[0] and "continue from step 6" in errors[0], errors
    assert _contents(run_dir) == before


def test_a_planted_checkpoint_is_refused_and_nothing_rotated(small_corpus, tmp_path, reference_run, capsys):
    """checkpoint-000010.pt (+ manifest) holding step 6: --resume refuses it, one line, and the
    real checkpoints survive (resuming at step 6 would replace step 8 and rotate it away)."""
    run_dir, kw = _finished_copy(reference_run, small_corpus, tmp_path)
    for suffix in (".pt", ".json"):
        (run_dir / f"checkpoint-000010{suffix}").write_bytes((run_dir / f"checkpoint-000006{suffix}").read_bytes())
    before = _contents(run_dir)
    code, errors = _cli(capsys, {**kw, "resume": True, "num_iterations": 12})
    assert code == 1 and len(errors) == 1, errors
    assert "checkpoint-000010.pt is not usable" in errors[0] and "checkpoint-000006.pt (step 6)" in errors[0], errors
    assert _contents(run_dir) == before


def test_a_second_process_on_a_run_dir_is_refused_until_the_holder_dies(small_corpus, tmp_path, capsys):
    """The lock taken as the trainer takes it, by another process: a start is refused with its
    pid (exit 2, nothing written); after kill -9 of the holder the kernel has released the
    lock, and a start succeeds."""
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    kw = _kw(small_corpus, run_dir, num_iterations=2)
    with run_dir_held_elsewhere(run_dir) as holder:
        code, errors = _cli(capsys, kw)
        assert code == 2 and len(errors) == 1, errors
        assert f"is in use by another nanochat process (pid {holder.pid} on " in errors[0], errors
        assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_NAME]
    code, errors = _cli(capsys, kw)
    assert code == 0 and [c.step for c in committed(run_dir)] == [2], errors


def test_resuming_a_finished_run_or_below_its_step_is_refused(small_corpus, tmp_path, capsys):
    """Both would train nothing: refused before any work, result.json and metrics.jsonl unchanged
    (not rewritten with a nan train loss and nan tokens/s)."""
    run_dir = tmp_path / "r"
    kw = _kw(small_corpus, run_dir)
    NanoChatTrainer(**kw).train()
    before = _contents(run_dir)
    code, errors = _cli(capsys, {**kw, "resume": True})
    assert code == 2 and len(errors) == 1 and "already finished at step 8 (its result.json)" in errors[0], errors
    code, errors = _cli(capsys, {**kw, "resume": True, "num_iterations": 6})
    assert code == 2 and len(errors) == 1, errors
    assert "already at step 8" in errors[0] and "--num_iterations 6 would train nothing" in errors[0], errors
    assert _contents(run_dir) == before
    code, _ = _cli(capsys, {**kw, "resume": True, "num_iterations": 10})  # extending it is what resume is for
    result = json.loads((run_dir / "result.json").read_text())
    assert code == 0 and result["steps"] == 10 and result["train_loss"] > 0 and result["tokens_per_sec"] > 0


class PlantedNaN(NaNWriter):
    """After the step-4 save, rewrites checkpoint 4 with a NaN weight (a valid manifest around
    it), then poisons the weights so that later steps are skipped and the run stops."""

    def _save(self, step, record=None):
        super()._save(step, record)
        if step == 4:
            payload = load_checkpoint(self.run_dir)
            payload["model"]["lm_head.weight"][0, 0] = float("nan")
            payload.pop("format_version")
            checkpoint.save_checkpoint(self.run_dir, payload, keep=5)


def test_the_stop_names_a_checkpoint_that_is_finite_and_resume_refuses_nan(small_corpus, tmp_path, capsys):
    PlantedNaN.at = 5
    run_dir = tmp_path / "r"
    kw = _kw(small_corpus, run_dir, max_bad_steps=3, num_iterations=20)
    with pytest.raises(NanoChatError, match=r"stopping at step 8.*checkpoint-000002\.pt \(step 2, verified, finite\)"):
        PlantedNaN(**kw).train()
    # metrics.jsonl is strict JSON: the skipped steps' non-finite losses are null, the field kept
    strict = run_records(run_dir)
    skipped = [r for r in strict if r.get("skipped")]
    assert [r["step"] for r in skipped] == [6, 7] and all("loss" in r and r["loss"] is None for r in skipped)
    before = _contents(run_dir)
    code, errors = _cli(capsys, {**kw, "resume": True})
    assert code == 1 and len(errors) == 1, errors
    assert "checkpoint-000004.pt holds inf/nan (1 of" in errors[0] and "lm_head.weight" in errors[0], errors
    assert _contents(run_dir) == before


class SkipLastStep(NanoChatTrainer):
    """An infinite gradient in the last step: the step is skipped, the weights stay as they were."""

    def _setup(self):
        super()._setup()
        calls = {"n": 0}

        def hook(grad):
            calls["n"] += 1
            return grad * float("inf") if calls["n"] == self.total_steps else grad

        self.model.lm_head.weight.register_hook(hook)


def test_a_skipped_last_step_still_ends_with_a_final_checkpoint(small_corpus, tmp_path):
    run_dir = tmp_path / "r"
    trainer = SkipLastStep(**_kw(small_corpus, run_dir, save_every=0))
    trainer.train()
    assert [r["step"] for r in run_records(run_dir) if r.get("skipped")] == [STEPS]
    assert [c.step for c in committed(run_dir)] == [STEPS]
    saved = load_checkpoint(run_dir)["model"]
    assert all(torch.equal(saved[k], v) for k, v in trainer.model.state_dict().items())


@pytest.mark.parametrize("drop", ["config", "data"])
def test_a_checkpoint_lacking_keys_is_one_line_on_resume(small_corpus, tmp_path, capsys, drop):
    run_dir = tmp_path / "r"
    kw = _kw(small_corpus, run_dir, num_iterations=2)
    NanoChatTrainer(**kw).train()
    payload = load_checkpoint(run_dir)
    del payload[drop], payload["format_version"]
    checkpoint.save_checkpoint(run_dir, payload)  # a manifest that verifies
    code, errors = _cli(capsys, {**kw, "resume": True, "num_iterations": 3})
    assert code == 1 and len(errors) == 1 and f"lacks '{drop}'" in errors[0], errors


def test_a_fresh_run_never_replaces_another_tokenizer_in_its_run_dir(small_corpus, tmp_path, capsys):
    from nanochat.tokenizer import BPETokenizer

    run_dir = tmp_path / "r"
    BPETokenizer.train([(small_corpus / "heapq.py").read_text()], 270).save(run_dir / "tokenizer")
    before = _contents(run_dir)
    kw = _kw(small_corpus, run_dir, num_iterations=2)
    code, errors = _cli(capsys, kw)
    assert code == 2 and len(errors) == 1 and "already holds a tokenizer" in errors[0], errors
    assert _contents(run_dir) == before and not (run_dir / "metrics.jsonl").exists()
    code, _ = _cli(capsys, kw, "--overwrite")
    assert code == 0 and BPETokenizer.load(run_dir / "tokenizer").vocab_size == 320


# ------------------------------------------------------------------------- --auto_resume
@contextlib.contextmanager
def _dies_after_logging_step(n: int):
    """A run started in the block dies (KeyboardInterrupt) right after logging step `n`."""
    from nanochat.train.metrics import MetricsLog

    real_log = MetricsLog.log

    def log(self, record):
        real_log(self, record)
        if record.get("step") == n and "loss" in record:
            raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(MetricsLog, "log", log)
        with pytest.raises(KeyboardInterrupt):
            yield


def _starts(result) -> list[tuple]:
    return [(s["start"], s["from_step"], s["checkpoint"]) for s in result["starts"]]


@pytest.fixture(scope="module")
def auto_resumed(small_corpus, tmp_path_factory):
    """The same --auto_resume command twice: the first start dies after logging step 3 (its
    checkpoint is step 2's), the second continues the run to its end. Its run directory, the
    second start's trainer and result."""
    run_dir = tmp_path_factory.mktemp("auto") / "r"
    kw = _kw(small_corpus, run_dir, auto_resume=True)
    with _dies_after_logging_step(3):
        NanoChatTrainer(**kw).train()
    assert [c.step for c in committed(run_dir)] == [2]
    trainer = NanoChatTrainer(**kw)
    return run_dir, trainer, trainer.train()


def test_auto_resume_continues_a_killed_run_exactly(auto_resumed, reference):
    """The continued run's losses, final weights and train loss are the uninterrupted run's bit
    for bit (the same eager CPU code); result.json counts the restart and where it resumed from."""
    ref_losses, ref_weights, ref_train_loss = reference
    run_dir, trainer, result = auto_resumed
    assert _losses(run_dir) == ref_losses and result.train_loss == ref_train_loss
    assert [r["step"] for r in run_records(run_dir) if "loss" in r] == list(range(1, STEPS + 1))
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, ref_weights[name]), name
    saved = json.loads((run_dir / "result.json").read_text())
    assert saved["restarts"] == 1 and _starts(saved) == [("fresh", 0, None), ("resume", 2, "checkpoint-000002.pt")]
    assert [r["event"] for r in run_records(run_dir) if r.get("event") == "start"] == ["start", "start"]


def test_auto_resume_reports_a_finished_run_and_refuses_others_changing_nothing(
        small_corpus, auto_resumed, tmp_path, capsys, caplog):
    """A finished run says so and exits 0; a different run is refused in one line: one whose
    checkpoint has another --seed, and records without a checkpoint whose start record has
    another --seed or that have none; a finished run without a checkpoint is done at its own
    length and refused at another. Nothing in any directory changes."""
    import shutil

    run_dir = auto_resumed[0]
    kw = _kw(small_corpus, run_dir, auto_resume=True)
    before = _contents(run_dir)
    code, errors = _cli(capsys, kw)
    assert code == 0 and not errors, errors
    assert f"--auto_resume: the run in {run_dir} already finished at step {STEPS} (its result.json)" in caplog.text
    code, errors = _cli(capsys, {**kw, "seed": 7})
    assert code == 2 and len(errors) == 1, errors
    assert errors[0].startswith(f"error: --auto_resume: {run_dir} holds a different run: its checkpoint's settings "
                                "differ from this run's (--seed: checkpoint 1337 vs now 7)"), errors
    assert _contents(run_dir) == before
    for extra in ({"resume": True}, {"overwrite": True}):  # a config error, before any work
        code, errors = _cli(capsys, {**kw, **extra})
        assert code == 2 and len(errors) == 1 and "--auto_resume decides by itself" in errors[0], errors

    records = tmp_path / "records"  # a run's records and result, no checkpoint (--no_save_checkpoints)
    records.mkdir()
    for name in ("metrics.jsonl", "result.json"):
        shutil.copy(run_dir / name, records / name)
    kw = {**kw, "run_dir": str(records)}
    before = _contents(records)
    caplog.clear()
    code, errors = _cli(capsys, kw)
    assert code == 0 and not errors and f"the run in {records} already finished at step 8" in caplog.text, errors
    code, errors = _cli(capsys, {**kw, "num_iterations": 10})
    assert code == 2 and len(errors) == 1 and "kept no checkpoint to continue from" in errors[0], errors
    code, errors = _cli(capsys, {**kw, "seed": 7})
    assert code == 2 and len(errors) == 1, errors
    assert "holds a different run, which saved no checkpoint" in errors[0] and "--seed: recorded 1337 vs now 7" in errors[0]
    assert _contents(records) == before
    lines = (records / "metrics.jsonl").read_text().splitlines(keepends=True)
    (records / "metrics.jsonl").write_text("".join(line for line in lines if '"event": "start"' not in line))
    before = _contents(records)
    code, errors = _cli(capsys, kw)
    assert code == 2 and len(errors) == 1 and "no start record that says which run wrote them" in errors[0], errors
    assert _contents(records) == before


def test_auto_resume_restarts_from_step_0_a_run_lost_before_its_first_checkpoint(small_corpus, tmp_path, reference):
    run_dir = tmp_path / "r"
    kw = _kw(small_corpus, run_dir, auto_resume=True)
    with _dies_after_logging_step(1):
        NanoChatTrainer(**kw).train()
    assert not committed(run_dir) and [r["step"] for r in run_records(run_dir) if "loss" in r] == [1]
    result = NanoChatTrainer(**kw).train()
    assert [r["step"] for r in run_records(run_dir) if "loss" in r] == list(range(1, STEPS + 1))  # each once
    assert _losses(run_dir) == reference[0]
    assert result.restarts == 1 and _starts(result.to_dict()) == [("fresh", 0, None), ("restart", 0, None)]
