"""examples/slurm/train.sbatch, run by bash as slurm runs it on one node: slurm's variables set,
its two commands stubbed (`srun` runs the command after its own options as its one task,
`scontrol` answers `show hostnames` and records `requeue`). Checked against an uninterrupted run
in this process (one rank: the same eager CPU code, so equality is exact):

- the job's torchrun line trains a tiny d2 run; SIGTERM to torchrun, what --signal=TERM@120 sends
  the job step, stops it after a step with a checkpoint (torchrun passes it on to the rank), and
  the script requeues the job, since the run stopped before its end with new progress saved;
- the requeued job (the same script, SLURM_RESTART_COUNT=1) continues the run with --auto_resume
  to the uninterrupted run's losses, bit for bit, each step logged once; result.json records the
  requeue in its starts, and the finished job does not requeue again.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanochat.checkpoint import committed
from nanochat.train.trainer import NanoChatTrainer
from tests.conftest import kill_marked, run_records, tiny_train_kwargs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "slurm" / "train.sbatch"
STEPS = 60

SRUN = """#!/bin/bash
while [ "${1#-}" != "$1" ]; do shift; done  # srun's own options
echo $$ > "$SRUN_PID_FILE"
exec "$@"
"""
SCONTROL = """#!/bin/bash
case "$1 $2" in
    "show hostnames") printf '%s\\n' $3 ;;
    requeue*) echo "$@" >> "$SCONTROL_LOG" ;;
    *) exit 1 ;;
esac
"""


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run_records(run_dir) if "loss" in r}


def _flags(kw: dict) -> str:
    return " ".join(f"--{k}" if v is True else f"--no_{k}" if v is False else f"--{k} {v}" for k, v in kw.items())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """One run of the batch script, on one node."""

    def __init__(self, tmp: Path, run_dir: Path, flags: str, **slurm: str):
        stubs = tmp / "bin"
        stubs.mkdir(exist_ok=True)
        for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
            (stubs / name).write_text(text)
            (stubs / name).chmod(0o755)
        self.pid_file, self.requeues, self.marker = tmp / "srun.pid", tmp / "scontrol.log", f"slurm-{time.time_ns()}"
        self.pid_file.unlink(missing_ok=True)
        path = os.pathsep.join([str(stubs), str(Path(sys.executable).parent), os.environ["PATH"]])
        env = {**os.environ, "PATH": path, "OMP_NUM_THREADS": "1", "NANOCHAT_TEST_LAUNCH": self.marker,
               "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "127.0.0.1",
               "SLURM_GPUS_ON_NODE": "1", "RDZV_PORT": str(_free_port()), "RUN_DIR": str(run_dir),
               "TRAIN_FLAGS": flags, "SRUN_PID_FILE": str(self.pid_file), "SCONTROL_LOG": str(self.requeues), **slurm}
        self.proc = subprocess.Popen(["bash", str(SCRIPT)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def wait(self, timeout: float = 180) -> tuple[int, str]:
        """The script's exit status and output; on timeout every process it started is killed."""
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            killed = kill_marked(self.marker)
            out, _ = self.proc.communicate()
            pytest.fail(f"the batch script did not end within {timeout} s; killed {killed}\n{out[-3000:]}")
        return self.proc.returncode, out

    def requeued(self) -> list[str]:
        return self.requeues.read_text().splitlines() if self.requeues.exists() else []


def test_the_batch_script_stops_on_sigterm_requeues_and_its_requeue_finishes_the_run(small_corpus, tmp_path):
    kw = tiny_train_kwargs(small_corpus, tmp_path / "unused", num_iterations=STEPS, save_every=1000, num_samples=0)
    NanoChatTrainer(**{**kw, "run_dir": str(tmp_path / "full")}).train()  # the uninterrupted run
    flags = _flags({k: v for k, v in kw.items() if k != "run_dir"})
    run_dir = tmp_path / "run"

    job = Job(tmp_path, run_dir, flags)
    deadline = time.monotonic() + 120
    while not (run_dir / "metrics.jsonl").exists() or len(_losses(run_dir)) < 3:
        assert job.proc.poll() is None and time.monotonic() < deadline, job.wait()[1][-3000:]
        time.sleep(0.02)
    os.kill(int(job.pid_file.read_text()), signal.SIGTERM)  # torchrun: what slurm's --signal reaches
    status, out = job.wait()
    saved = committed(run_dir)[-1].step
    assert status == 1 and f"stopped by SIGTERM at step {saved}" in out, out[-3000:]  # torchrun's own status
    assert 3 <= saved < STEPS and not (run_dir / "result.json").exists()
    assert job.requeued() == ["requeue 4242"]

    job = Job(tmp_path, run_dir, flags, SLURM_RESTART_COUNT="1")  # the requeued job: the same script
    status, out = job.wait()
    assert status == 0, out[-3000:]
    assert [r["step"] for r in run_records(run_dir) if "loss" in r] == list(range(1, STEPS + 1))
    assert _losses(run_dir) == _losses(tmp_path / "full")
    starts = json.loads((run_dir / "result.json").read_text())["starts"]
    assert [(s["start"], s["from_step"], s["slurm_restart_count"]) for s in starts] == [
        ("fresh", 0, None), ("resume", saved, 1)]
    assert job.requeued() == ["requeue 4242"]  # finished: not again
