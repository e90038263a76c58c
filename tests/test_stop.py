"""SIGTERM and Ctrl-C end a run after a step with a checkpoint that resumes exactly; a rank whose
peer died ends with one error line. What is checked against what:

- against an uninterrupted run (in this process; the same eager CPU code, so equality is exact):
  a real scripts/base_train.py process sent SIGTERM, or one SIGINT, from outside at whatever
  step it has reached exits 143 / 130 with the stop line last on stderr (the step, the
  checkpoint of that step, the resume command) and no traceback; the printed command, run as
  printed, finishes the run with the uninterrupted run's losses (each step once) and final
  weights, bit for bit. A second SIGINT (the run sends both to itself during a step) stops at
  once: exit 130, no checkpoint of that step, the line names the newest one, which resumes to
  the same losses;
- --no_save_checkpoints says in the line that the run cannot be resumed; a signal before the
  first step stops at once; a handler the program installed is kept, and Python's own handlers
  are back after the run; the step a signal arrives in still reads the device once (the request
  rides in the loss's read) and decides the stop;
- the resume command parses (tyro) back to the run's config with --resume; gloo's and NCCL's
  words for a rank that is gone are told from other errors;
- under torchrun (2 gloo ranks, one process's output per file): kill -9 of rank 1 ends rank 0 by
  itself within seconds, exit status 1, its stderr ending in one `error:` line and holding no
  traceback; the run resumes, and SIGTERM sent to rank 1 alone stops both ranks after the same
  step (their DCP checkpoint of it is collective: ranks that disagreed would never finish it),
  exit status 143 each, the line printed once; the printed command finishes the run with the
  losses of an uninterrupted 2-rank run, bit for bit (the same code and reduction order);
- under torchrun --max-restarts 2 with --auto_resume: rank 1 killed before the first checkpoint,
  then after one; the worker group restarts twice (from step 0, then from the checkpoint) and
  the job exits 0 with the uninterrupted 2-rank run's losses and validation loss, bit for bit,
  and result.json records both restarts.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nanochat.checkpoint import committed, load_checkpoint
from nanochat.common import DistEnv
from nanochat.device import DeviceReads
from nanochat.config import TrainConfig, parse_cli
from nanochat.train.stop import Stopped, resume_command
from nanochat.train.trainer import NanoChatTrainer
from tests.conftest import tiny_train_kwargs

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).parent / "torchrun"
STEPS, SAVE_EVERY = 60, 5
LINE = re.compile(r"stopped by (SIGTERM|SIGINT) at step (\d+); (\S+) saved; resume: (.+)")


@pytest.fixture(autouse=True)
def _log_to_this_tests_stderr():
    from nanochat.common import logger

    logger.handlers.clear()


def _kw(corpus: Path, run_dir: Path, **over) -> dict:
    return tiny_train_kwargs(corpus, run_dir, **{"num_iterations": STEPS, "save_every": SAVE_EVERY,
                                                 "num_samples": 0, **over})


def _flags(kw: dict) -> list[str]:
    out = []
    for k, v in kw.items():
        if isinstance(v, bool):
            out += [f"--{k}" if v else f"--no_{k}"]
        else:
            out += [f"--{k}", str(v)]
    return out


def _records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's complete lines (a run may be writing the last one)."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]] if path.exists() else []


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(run_dir) if "loss" in r}


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]), OMP_NUM_THREADS="1")


def _wait_for_steps(run_dir: Path, n: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while len(_losses(run_dir)) < n:
        assert proc.poll() is None, f"the run ended (status {proc.returncode}) before step {n}"
        assert time.monotonic() < deadline, f"no step {n} within {timeout} s"
        time.sleep(0.02)


def _run_printed(command: str, **kwargs) -> subprocess.CompletedProcess:
    """A printed resume command, run as printed ('python' and 'torchrun' are this environment's)."""
    words = shlex.split(command)
    words[0] = {"python": sys.executable, "torchrun": str(TORCHRUN)}[words[0]]
    return subprocess.run(words, cwd=ROOT, env=_env(), capture_output=True, text=True, **kwargs)


@pytest.fixture(scope="module")
def reference(small_corpus, tmp_path_factory):
    """The uninterrupted run: its losses and final weights."""
    run_dir = tmp_path_factory.mktemp("stop") / "full"
    trainer = NanoChatTrainer(**_kw(small_corpus, run_dir))
    trainer.train()
    return _losses(run_dir), {k: v.clone() for k, v in trainer.model.state_dict().items()}


# ------------------------------------------------------------------------- one process
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_finishes_the_step_saves_it_and_the_printed_command_resumes_exactly(
        small_corpus, tmp_path, reference, signum):
    ref_losses, ref_weights = reference
    run_dir = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "base_train.py"),
                             *_flags(_kw(small_corpus, run_dir))],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_steps(run_dir, 3, proc)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    m = LINE.fullmatch(err.strip().splitlines()[-1])
    assert m and m[1] == signal.Signals(signum).name, err[-2000:]
    step = int(m[2])
    assert 3 <= step < STEPS
    assert m[3] == str(run_dir / f"checkpoint-{step:06d}.pt") and committed(run_dir)[-1].step == step
    assert sorted(_losses(run_dir)) == list(range(1, step + 1))  # the step in flight finished, logged once

    r = _run_printed(m[4], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [rec["step"] for rec in _records(run_dir) if "loss" in rec] == list(range(1, STEPS + 1))
    assert _losses(run_dir) == ref_losses
    final = load_checkpoint(run_dir)
    assert final["step"] == STEPS
    for name, value in ref_weights.items():
        assert torch.equal(final["model"][name], value), name


SECOND_SIGINT = r"""
import json, os, signal, sys
from nanochat.train.metrics import MetricsLog
from nanochat.train.trainer import NanoChatTrainer
kw, at = json.loads(sys.argv[1]), int(sys.argv[2])
real_log = MetricsLog.log
def log(self, record):
    if record.get("step") == at and "loss" in record:
        os.kill(os.getpid(), signal.SIGINT)  # the first: the step would finish and be saved...
        os.kill(os.getpid(), signal.SIGINT)  # ...the second stops at once, before the step is logged
    return real_log(self, record)
MetricsLog.log = log
NanoChatTrainer(**kw).train()
"""


def test_a_second_sigint_stops_at_once_leaving_the_newest_checkpoint(small_corpus, tmp_path, reference):
    run_dir = tmp_path / "r"
    kw = _kw(small_corpus, run_dir)
    r = subprocess.run([sys.executable, "-c", SECOND_SIGINT, json.dumps(kw), "7"], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 130 and "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"stopped at once by a second SIGINT during step 7; the newest checkpoint is "
                           f"{run_dir / 'checkpoint-000005.pt'} (step 5); resume: "), last
    assert "SIGINT received: finishing the step in flight" in r.stderr  # what the first one said
    assert committed(run_dir)[-1].step == 5 and sorted(_losses(run_dir)) == list(range(1, 7))
    NanoChatTrainer(**{**kw, "resume": True}).train()
    assert _losses(run_dir) == reference[0]


class SignalInStep(NanoChatTrainer):
    """Sends itself `signum` as step `at` (1-based) begins: the step is in flight."""

    signum, at = signal.SIGTERM, 3

    def train_step(self, step):
        if step + 1 == self.at:
            os.kill(os.getpid(), self.signum)
        return super().train_step(step)


def test_the_step_a_signal_arrives_in_reads_once_and_decides_the_stop(small_corpus, tmp_path, capsys):
    """--no_save_checkpoints: nothing to resume, and the line says so."""
    trainer = SignalInStep(**_kw(small_corpus, tmp_path / "r", save_checkpoints=False))
    reads, step_fn = [], trainer.train_step

    def counted(step):
        with DeviceReads() as r:
            out = step_fn(step)
        reads.append(r.count)
        return out

    trainer.train_step = counted
    with pytest.raises(Stopped) as e:
        trainer.train()
    assert e.value.code == 143 and isinstance(e.value, SystemExit)
    assert e.value.message == ("stopped by SIGTERM at step 3; no checkpoint saved (--no_save_checkpoints): this run "
                               "cannot be resumed")
    assert capsys.readouterr().err.strip().splitlines()[-1] == e.value.message
    assert reads == [1, 1, 1] and trainer.stop.agreed == signal.SIGTERM  # decided from step 3's one read
    assert not list((tmp_path / "r").glob("checkpoint*")) and sorted(_losses(tmp_path / "r")) == [1, 2, 3]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # Python's own handlers are back
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_signal_before_the_first_step_stops_at_once(small_corpus, tmp_path, monkeypatch):
    from nanochat.checkpoint import Checkpointer

    real_prepare = Checkpointer.prepare

    def prepare(self):
        os.kill(os.getpid(), signal.SIGTERM)
        real_prepare(self)

    monkeypatch.setattr(Checkpointer, "prepare", prepare)
    with pytest.raises(Stopped) as e:
        NanoChatTrainer(**_kw(small_corpus, tmp_path / "r")).train()
    assert e.value.code == 143
    assert e.value.message == "stopped at once by SIGTERM before the first step; no checkpoint of this run was saved"
    assert not (tmp_path / "r").exists()  # the run directory is created last


def test_a_handler_the_program_installed_is_kept(small_corpus, tmp_path):
    got = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        result = SignalInStep(**_kw(small_corpus, tmp_path / "r", num_iterations=4)).train()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert got == [signal.SIGTERM] and result.steps == 4  # its handler ran; the run was not stopped


def test_the_resume_command_parses_back_to_the_run(monkeypatch):
    cfg = TrainConfig(model_name="d2", run_dir="runs/a b", dataset_path="data dir", fp8=True, fp8_emulate=True,
                      fp8_opt_level=2, fp8_skip=("lm_head", "attn.c_q"), log=("jsonl", "tensorboard"), compile=False,
                      save_checkpoints=False, lr=3e-4, num_iterations=50, overwrite=True, debug=True)
    words = shlex.split(resume_command(cfg, DistEnv()))
    assert words[:2] == ["python", "scripts/base_train.py"] and words[-1] == "--resume"
    assert parse_cli(TrainConfig, words[2:]) == TrainConfig(**{**cfg.__dict__, "overwrite": False, "debug": False,
                                                               "resume": True})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resume_command(cfg, DistEnv(world_size=2)).startswith(
        "torchrun --standalone --nproc_per_node=2 scripts/base_train.py ")
    assert resume_command(cfg, DistEnv(world_size=4)).startswith("torchrun --nnodes=2 ")


def test_the_resume_command_and_the_lost_peer_line_follow_auto_resume(monkeypatch, tmp_path):
    """A run that was given --auto_resume is resumed by its own command line; a rank that lost a
    peer under torchrun --max-restarts says the restart continues the run (--auto_resume) or would
    refuse its directory (without), and names the command where no restart is left."""
    from types import SimpleNamespace

    from nanochat.train.stop import lost_peer_message

    cfg = TrainConfig(model_name="d2", run_dir="runs/r", auto_resume=True, num_iterations=50)
    words = shlex.split(resume_command(cfg, DistEnv()))
    assert words[-1] == "--auto_resume" and "--resume" not in words
    assert parse_cli(TrainConfig, words[2:]) == cfg
    newest = SimpleNamespace(path=tmp_path / "checkpoint_dcp" / "step-000005", step=5)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    line = lost_peer_message("gloo: Connection reset by peer", newest, "cmd", auto_resume=True)
    assert line.endswith("(step 5); torchrun restarts the worker group (1 of its --max-restarts left) and "
                         "--auto_resume continues the run from it"), line
    line = lost_peer_message("gloo: Connection reset by peer", newest, "cmd", auto_resume=False)
    assert "which refuses a --run_dir holding a run: pass --auto_resume" in line, line
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")  # none left
    assert lost_peer_message("gloo: x", newest, "cmd", auto_resume=True).endswith("resume: cmd")


def test_a_lost_peer_is_told_from_other_errors():
    """gloo's and NCCL's words for a rank that is gone; any other error keeps its own report."""
    from nanochat.common import NanoChatError
    from nanochat.parallel.process_group import lost_peer

    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1436: "
                        "Connection reset by peer. This is typically caused by a remote worker hanging")
    assert lost_peer(gloo) == "gloo: Connection reset by peer"
    assert lost_peer(torch.distributed.DistBackendError("NCCL communicator was aborted on rank 0")) == (
        "NCCL: NCCL communicator was aborted")
    for other in (RuntimeError("CUDA out of memory"), NanoChatError("gloo: Connection reset by peer (quoted)"),
                  ValueError("Connection reset by peer")):
        assert lost_peer(other) is None, other


# --------------------------------------------------------------------------- torchrun
def _launched(marker: str, restart: int | None = None) -> dict[int, int]:
    """rank (-1: torchrun itself) -> pid of the live processes whose environment holds `marker`:
    only this launch's, never a process that reuses the pid of one of them after it exited;
    with `restart`, only the ranks of that restart of the worker group (TORCHELASTIC_RESTART_COUNT)."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"NANOCHAT_TEST_LAUNCH={marker}".encode() in env:
            if restart is not None and f"TORCHELASTIC_RESTART_COUNT={restart}".encode() not in env:
                continue
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), -1)
            out[rank] = int(proc.name)
    return out


class Launch:
    """One torchrun launch (`torchrun <args>`, as printed), each rank's stdout and stderr in files
    of its own under `logs`."""

    def __init__(self, command: str, logs: Path, **env: str):
        self.logs, self.marker = logs, f"{os.getpid()}-{logs.name}-{time.monotonic_ns()}"
        words = shlex.split(command)
        assert words[0] == "torchrun", words
        self.proc = subprocess.Popen(
            [str(TORCHRUN), "--log-dir", str(logs), "--redirects", "3", *words[1:]],
            cwd=ROOT, env={**_env(), **env, "NANOCHAT_TEST_LAUNCH": self.marker}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True)
        deadline = time.monotonic() + 60
        while len(ranks := _launched(self.marker)) < 3:
            assert self.proc.poll() is None and time.monotonic() < deadline, "torchrun did not start 2 ranks"
            time.sleep(0.1)
        self.ranks = {r: pid for r, pid in ranks.items() if r >= 0}

    def wait(self, timeout: float) -> str:
        """torchrun's own stderr once it exited. On timeout every process of the launch is killed
        by its pid (each rank runs in a session of its own) and the test fails: a run that hangs
        on its way out, after its results, fails here too."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"torchrun did not exit within {timeout} s; its ranks were killed")
            time.sleep(0.1)
        return self.proc.communicate()[1]

    def kill(self) -> None:
        for pid in _launched(self.marker).values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.communicate()

    def rank_pid(self, rank: int, restart: int, timeout: float = 120) -> int:
        """The pid of `rank` in the worker group of `restart`, once it runs."""
        deadline = time.monotonic() + timeout
        while rank not in (ranks := _launched(self.marker, restart)):
            assert self.proc.poll() is None, f"torchrun ended (status {self.proc.returncode}) before restart {restart}"
            assert time.monotonic() < deadline, f"no rank {rank} of restart {restart} within {timeout} s"
            time.sleep(0.05)
        return ranks[rank]

    def stderr(self, rank: int, attempt: int = 0) -> str:
        return next(self.logs.glob(f"*/attempt_{attempt}/{rank}/stderr.log")).read_text()


def _exit_status(torchrun_stderr: str, rank: int) -> int:
    """A rank's exit status from torchrun's failure report."""
    m = re.search(rf"rank\s*: {rank} \(local_rank: {rank}\)\s*\n\s*exitcode\s*: (-?\d+)", torchrun_stderr)
    assert m, torchrun_stderr[-2000:]
    return int(m[1])


TORCHRUN_2 = f"torchrun --standalone --nproc_per_node=2 {shlex.quote(str(ROOT / 'scripts' / 'base_train.py'))} "


@pytest.fixture(scope="module")
def torchrun_full(small_corpus, tmp_path_factory) -> Path:
    """The uninterrupted 2-rank run (4 sequences per rank): its run directory."""
    out = tmp_path_factory.mktemp("torchrun")
    full = Launch(TORCHRUN_2 + shlex.join(_flags(_kw(small_corpus, out / "full", batch_size=4))), out / "logs-full")
    try:
        full.wait(timeout=120)
    finally:
        full.kill()
    return out / "full"


def test_torchrun_a_killed_rank_then_sigterm_to_one_rank_then_resume(small_corpus, tmp_path, torchrun_full):
    kw = _kw(small_corpus, tmp_path / "r", batch_size=4)
    run_dir = Path(kw["run_dir"])
    torchrun = TORCHRUN_2

    # kill -9 of rank 1: rank 0 ends by itself (torchrun would SIGKILL it 30 s after its SIGTERM)
    launch = Launch(torchrun + shlex.join(_flags(kw)), tmp_path / "logs-a")
    try:
        _wait_for_steps(run_dir, SAVE_EVERY + 1, launch.proc)
        os.kill(launch.ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        report = launch.wait(timeout=120)
    finally:
        launch.kill()
    assert time.monotonic() - killed < 25
    assert _exit_status(report, 0) == 1 and _exit_status(report, 1) == -signal.SIGKILL
    err = launch.stderr(0)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and err.strip().endswith(errors[0]) and "Traceback" not in err, err[-3000:]
    assert "rank 0 lost its connection to another rank of this run (gloo: " in errors[0], errors
    saved = json.loads((run_dir / "checkpoint_dcp" / "LATEST").read_text())["step"]
    assert f"checkpoint_dcp/step-{saved:06d} (step {saved})" in errors[0] and "--resume" in errors[0], errors

    # resumed, then SIGTERM to rank 1 alone: both ranks stop after the same step
    launch = Launch(torchrun + shlex.join([*_flags(kw), "--resume"]), tmp_path / "logs-b")
    try:
        _wait_for_steps(run_dir, saved + 3, launch.proc)
        os.kill(launch.ranks[1], signal.SIGTERM)
        report = launch.wait(timeout=120)
    finally:
        launch.kill()
    assert _exit_status(report, 0) == _exit_status(report, 1) == 143
    err0, err1 = launch.stderr(0), launch.stderr(1)
    assert "Traceback" not in err0 + err1 and "stopped by" not in err1, err0[-2000:] + err1[-2000:]
    m = LINE.fullmatch(err0.strip().splitlines()[-1])
    assert m and m[1] == "SIGTERM", err0[-2000:]
    step = int(m[2])
    assert m[3] == str(run_dir / "checkpoint_dcp" / f"step-{step:06d}")
    assert json.loads((run_dir / "checkpoint_dcp" / "LATEST").read_text())["step"] == step > saved + 2
    assert m[4].startswith("torchrun --standalone --nproc_per_node=2 ")

    launch = Launch(m[4], tmp_path / "logs-c")  # the printed command
    try:
        launch.wait(timeout=120)
    finally:
        launch.kill()
    assert [rec["step"] for rec in _records(run_dir) if "loss" in rec] == list(range(1, STEPS + 1))
    assert _losses(run_dir) == _losses(torchrun_full)


def test_torchrun_restarts_rank_losses_and_auto_resume_ends_as_the_uninterrupted_run(
        small_corpus, tmp_path, torchrun_full):
    """torchrun --max-restarts 2 with --auto_resume: rank 1 killed (SIGKILL) before the first
    checkpoint, then after one. The worker group restarts from step 0, then from the newest
    checkpoint; the job exits 0 with the uninterrupted run's losses and validation loss, bit for
    bit (the same code and reduction order), each step logged once, and result.json records both
    restarts, where each started from and torchrun's restart counters. A stopped rank (SIGSTOP)
    holds its peer at the next collective, so the first kill lands before any checkpoint."""
    kw = _kw(small_corpus, tmp_path / "r", batch_size=4, auto_resume=True)
    run_dir = Path(kw["run_dir"])
    command = TORCHRUN_2.replace("--nproc_per_node=2", "--nproc_per_node=2 --max-restarts=2") + shlex.join(_flags(kw))
    # torchrun's own environment: each restart forms its group under a store prefix of its own
    launch = Launch(command, tmp_path / "logs")
    try:
        _wait_for_steps(run_dir, 1, launch.proc)
        os.kill(launch.rank_pid(1, restart=0), signal.SIGSTOP)
        assert not committed(run_dir) and len(_losses(run_dir)) < SAVE_EVERY
        os.kill(launch.rank_pid(1, restart=0), signal.SIGKILL)
        rank1 = launch.rank_pid(1, restart=1)
        deadline = time.monotonic() + 120
        while not committed(run_dir) or len(_losses(run_dir)) <= committed(run_dir)[-1].step:
            assert launch.proc.poll() is None and time.monotonic() < deadline, "restart 1 saved no checkpoint"
            time.sleep(0.02)
        os.kill(rank1, signal.SIGKILL)
        launch.wait(timeout=180)
    finally:
        launch.kill()
    assert launch.proc.returncode == 0, launch.stderr(0, attempt=2)[-3000:]
    assert "torchrun restarts the worker group (2 of its --max-restarts left) and --auto_resume continues the run " \
           "from step 0" in launch.stderr(0, attempt=0).strip().splitlines()[-1]
    assert [rec["step"] for rec in _records(run_dir) if "loss" in rec] == list(range(1, STEPS + 1))
    assert _losses(run_dir) == _losses(torchrun_full)
    result, full = (json.loads((d / "result.json").read_text()) for d in (run_dir, torchrun_full))
    print(f"restarted: val loss {result['val_loss']!r}, step {STEPS} loss {_losses(run_dir)[STEPS]!r}; "
          f"uninterrupted: {full['val_loss']!r}, {_losses(torchrun_full)[STEPS]!r}")  # shown with -s
    assert result["val_loss"] == full["val_loss"] and result["restarts"] == 2, result
    (first, restart, resume) = result["starts"]
    assert (first["start"], restart["start"], resume["start"]) == ("fresh", "restart", "resume")
    assert [s["torchelastic_restart_count"] for s in result["starts"]] == [0, 1, 2]
    step = resume["from_step"]
    assert step >= SAVE_EVERY and resume["checkpoint"] == f"checkpoint_dcp/step-{step:06d}", resume
