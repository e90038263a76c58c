"""scripts/gpu_check.py and scripts/gpu_check.sh, rehearsed on the CPU so they cannot rot.

The GPU run is short and rare; a script that breaks there wastes it. Here the wrapper runs the
script's --dry_run (the same jobs and JSON at toy sizes, FP8 emulated) and the JSON is checked
against what the GPU run must produce: every job ran without error, the trainer's figures are
positive and finite, the profiled FP8 step read the device once (the trainer's one read), the
optimizer job compares every level against fused AdamW with FP8Optim's state bytes (8, 1 + 4/256 + 4,
2 * (1 + 4/256) per parameter), and the wrapper refuses, with exit 4, an interpreter on which
torchao does not import.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, NANOCHAT_CACHE=str(out / "cache"))
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry_run",
                           "--jobs", "env", "fp8", "optim", "tests"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text())


def test_dry_run_runs_every_job_and_reports_figures(dry_run):
    assert dry_run["errors"] == {} and dry_run["skipped_for_time"] == []
    assert set(dry_run["results"]) == {"env", "fp8", "optim", "tests"}
    fp8 = dry_run["results"]["fp8"]
    assert fp8["fp8_backend"] == "emulated" and fp8["fallbacks"] == []
    assert fp8["tokens_per_sec"] > 0 and fp8["compile_time_s"] > 0 and math.isfinite(fp8["val_loss"])
    assert fp8["device_reads_in_step"] == 1  # the trainer's one read per steady-state step
    assert fp8["graph_breaks"] >= 0 and fp8["peak_gib"] is None  # no CUDA memory figures on the CPU
    assert dry_run["results"]["env"]["fp8"]["tensorwise"]["backend"] == "emulated"


def test_dry_run_optimizer_job_against_fused_adamw(dry_run):
    opt = dry_run["results"]["optim"]
    assert opt["adamw_fused"]["ratio_to_fused"] == 1.0
    expected = {"fp8optim_l0": 8.0, "fp8optim_l1": 1 + 4 / 256 + 4, "fp8optim_l2": 2 * (1 + 4 / 256)}
    for name, bytes_per_param in expected.items():
        assert opt[name]["state_bytes_per_param"] == pytest.approx(bytes_per_param), name
        assert opt[name]["step_ms"] > 0 and opt[name]["fallbacks"] == []


def test_wrapper_exits_4_when_torchao_does_not_import(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")  # -S: no site-packages
    fake.chmod(0o755)
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=str(fake), WHEELS=str(tmp_path / "no-wheels"))
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry_run"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4 and "does not import" in proc.stderr
