"""scripts/gpu_check.py and scripts/gpu_check.sh, rehearsed on the CPU so they cannot rot.

The GPU run is short and rare; a script that breaks there wastes it. Here the wrapper runs the
script's --dry_run (the same jobs and JSON at toy sizes, FP8 emulated) and the JSON is checked
against what the GPU run must produce:
- every default job ran without error and none was skipped, in the order the docstring gives
  (the figures no earlier run has first, FP8 `all` last);
- tests: every test marked `gpu` in the suite reported from the junit XML (all skipped on a CPU),
  those of test_fp8_policy.py (which times layers through `time_fwd_bwd`) and test_fp8_optim.py
  included, the log kept; GPU_TEST_FILES names exactly the files holding such tests;
- shapes: the first shape timed (bf16, tensorwise, rowwise, positive) whatever the budget, the
  others listed as not timed (the dry run's --shapes_budget_s is 0, so the outcome does not
  depend on the machine's speed);
- train and all: bf16 and FP8 runs with positive, finite figures, no checkpoint in their run
  directories, no MFU on a CPU; the profiled FP8 step read the device once (the trainer's read);
- optim: every level against fused AdamW with FP8Optim's state bytes (8, 1 + 4/256 + 4,
  2 * (1 + 4/256) per parameter);
- stats: tokens/s over one statistics period, with and without its sampled step;
- mxfp8: the dry run trains --model with every Linear in MXFP8 (emulated), its ratio to bf16
  computed; on a GPU without sm_100 (faked: an H100) the row says it did not run and why.
And, each against a reference: stopped by the wrapper's time limit, the check exits 124 with a
whole JSON that names the measurement it cut and keeps every one that finished; pytest
interrupted by its timeout keeps its log and the outcomes and failure texts of the tests that
finished (junit), and names where it stopped; the shapes job's Llama shapes are
Meta-Llama-3-8B's published ones; the wrapper refuses, with exit 4, an interpreter on which
torchao does not import, and its import probe covers every dependency pyproject.toml declares;
its time limit follows --budget_s, whose default (8 minutes in all) it shares with the script;
a function that reaches dynamo's recompile limit (real, on the CPU) marks its run `invalid`, and
an invalid run gives no ratio and no MFU.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import load_script

ROOT = Path(__file__).resolve().parent.parent


def _script(name: str):
    return load_script(name)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, NANOCHAT_CACHE=str(out / "cache"))
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry_run",
                           "--run_root", str(out / "runs")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "gpu_check.json").read_text())


def test_dry_run_runs_every_job_and_reports_figures(dry_run):
    out, report = dry_run
    assert report["errors"] == {} and report["skipped_for_time"] == []
    assert list(report["results"]) == ["env", "tests", "optim", "stats", "train", "shapes", "all", "mxfp8"]
    runs = {**report["results"]["train"]["d2"], **report["results"]["all"]["d2"]}
    for kind in runs:
        r = runs[kind]
        assert r["tokens_per_sec"] > 0 and r["compile_time_s"] > 0 and math.isfinite(r["val_loss"])
        assert r["mfu"] is None and r["flops_per_token"] > 0  # no listed peak for a CPU
        assert r["graph_breaks"] >= 0 and r["peak_gib"] is None  # no CUDA memory figures on the CPU
    assert set(runs) == {"bf16", "fp8_faster", "fp8_all"} and not any("invalid" in r for r in runs.values())
    fp8 = runs["fp8_all"]  # every Linear in FP8
    assert fp8["fp8_backend"] == "emulated" and fp8["fallbacks"] == []
    assert fp8["fp8_converted_layers"] == 12  # d2: 2 blocks x 6 Linears (lm_head stays in high precision)
    assert fp8["device_reads_in_step"] == 1  # the trainer's one read per steady-state step
    for kind in runs:  # --no_save_checkpoints: the run's files, no checkpoint
        assert (out / "runs" / f"d2-{kind}" / "result.json").is_file()
        assert not list((out / "runs" / f"d2-{kind}").glob("checkpoint*"))
    assert report["results"]["env"]["fp8"]["tensorwise"]["backend"] == "emulated"
    assert report["results"]["env"]["mfu_peak"] is None


def test_dry_run_reports_each_gpu_test(dry_run):
    out, report = dry_run
    tests = report["results"]["tests"]
    assert tests["returncode"] == 0 and not tests["timed_out"] and Path(tests["log"]).is_file()
    assert len(tests["outcomes"]) >= 20 and set(tests["outcomes"].values()) == {"skipped"}  # no CUDA here
    assert "test_compiled_fp8_matches_eager[emulate_precision_casts-rowwise]" in tests["outcomes"]
    assert "test_gpu_timing_path_measures_and_decides" in tests["outcomes"]  # time_fwd_bwd on the GPU
    assert "test_cuda_step_is_compiled_per_shape_and_never_syncs[2]" in tests["outcomes"]


def test_gpu_test_files_are_every_file_with_a_gpu_test():
    gpu_check = _script("gpu_check")
    marker = re.compile(r"^\s*(@pytest\.mark\.gpu\b|pytest\.mark\.gpu,)", re.M)  # a decorator or pytestmark
    marked = sorted(f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py") if marker.search(p.read_text()))
    assert sorted(gpu_check.GPU_TEST_FILES) == marked


def test_dry_run_times_shapes_within_the_budget(dry_run):
    shapes = dry_run[1]["results"]["shapes"]
    assert list(shapes["shapes"]) == ["128x128"] and shapes["not_timed"] == ["128x512", "512x128"]
    timed = shapes["shapes"]["128x128"]
    assert timed["layers"] == {"d2": ["attn.c_q", "attn.c_k", "attn.c_v", "attn.c_proj"]}
    figures = timed["tokens"]["64"]
    assert all(figures[f"{v}_ms"] > 0 for v in ("bf16", "tensorwise", "rowwise"))


def test_dry_run_optimizer_job_against_fused_adamw(dry_run):
    opt = dry_run[1]["results"]["optim"]
    assert opt["adamw_fused"]["ratio_to_fused"] == 1.0
    expected = {"fp8optim_l0": 8.0, "fp8optim_l1": 1 + 4 / 256 + 4, "fp8optim_l2": 2 * (1 + 4 / 256)}
    for name, bytes_per_param in expected.items():
        assert opt[name]["state_bytes_per_param"] == pytest.approx(bytes_per_param), name
        assert opt[name]["step_ms"] > 0 and opt[name]["fallbacks"] == []


def test_dry_run_trains_the_mxfp8_row(dry_run):
    run = dry_run[1]["results"]["mxfp8"]["d2"]["fp8_mxfp8"]
    assert run["fp8_backend"] == "emulated" and run["fp8_converted_layers"] == 12 and run["fallbacks"] == []
    assert run["tokens_per_sec"] > 0 and math.isfinite(run["val_loss"])
    assert run["settings"]["fp8_recipe"] == "mxfp8"
    assert dry_run[1]["ratios"]["d2_fp8_mxfp8_over_bf16_tokens_per_sec"] > 0
    assert dry_run[1]["results"]["env"]["fp8"]["mxfp8"]["backend"] == "emulated"


def test_mxfp8_row_before_blackwell_says_why_it_did_not_run(tmp_path, monkeypatch):
    import torch

    gpu_check = _script("gpu_check")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    monkeypatch.setattr(torch.version, "hip", None)
    cfg = gpu_check.GPUCheckConfig(out=str(tmp_path / "gpu_check.json"), jobs=("mxfp8",))
    findings = gpu_check.Findings(Path(cfg.out), cfg)
    gpu_check.job_mxfp8(cfg, findings)
    row = json.loads(Path(cfg.out).read_text())["results"]["mxfp8"]["d12"]["fp8_mxfp8"]
    assert row["not_run"].startswith("MXFP8 runs natively on sm_100+ (Blackwell) only: NVIDIA H200 (sm_90)")
    assert findings.data["errors"] == {} and findings.data["ratios"] == {}


def test_dry_run_measures_a_statistics_period(dry_run):
    stats = dry_run[1]["results"]["stats"]
    assert stats["period"] == 200 and stats["fp8_converted_layers"] > 0
    assert 0 < stats["tokens_per_sec_with_stats"] and 0 < stats["tokens_per_sec_without"]
    assert stats["sampled_step_s"] > 0 and math.isfinite(stats["overhead_pct"])


def test_time_limit_stops_the_check_and_keeps_what_finished(tmp_path):
    """The SIGTERM gpu_check.sh's `timeout` sends at its limit, sent here once env and tests have
    finished and the stats job is running (so the test does not depend on this machine's speed):
    exit 124, the running measurement recorded as cut, every finished one kept, the JSON whole."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", NANOCHAT_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = tmp_path / "gpu_check.json"
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry_run", "--out", str(out)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[gpu_check] stats: running"):
                proc.send_signal(signal.SIGTERM)
                break
        rest, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    stdout = "".join(lines) + rest
    assert proc.returncode == 124 and "stopped by the time limit" in stdout, stdout[-2000:]
    report = json.loads(out.read_text())  # whole: written atomically
    cut = [key for key, error in report["errors"].items() if error.startswith("stopped by the time limit")]
    assert report["errors"].keys() == set(cut) and cut == ["stats"], report["errors"]
    assert {"env", "tests", "optim"} <= set(report["results"])
    for key in set(report["durations_s"]) - set(cut):  # every measurement that finished is there
        node = report["results"]
        for part in key.split("/"):
            node = node[part]


def test_pytest_stopped_by_the_time_limit_keeps_what_ran(tmp_path):
    gpu_check = _script("gpu_check")
    (tmp_path / "test_three.py").write_text(
        "import time\n"
        "def test_fast():\n    print('printed by test_fast')\n"
        "def test_fails():\n    value = 1\n    assert value == 2, 'the value was not two'\n"
        "def test_hangs():\n    time.sleep(600)\n")
    out = gpu_check.run_pytest([str(tmp_path / "test_three.py")], tmp_path, "three", timeout_s=15)
    assert out["timed_out"] and out["interrupted_at"].endswith("test_three.py:8: KeyboardInterrupt")
    assert out["outcomes"] == {"test_fast": "passed", "test_fails": "failed"}
    assert "the value was not two" in out["failures"]["test_fails"] and "assert 1 == 2" in out["failures"]["test_fails"]
    assert "printed by test_fast" in (tmp_path / "three.log").read_text()


def test_shapes_of_llama3_8b_and_d12():
    from nanochat.train.linear_shapes import linear_shapes

    assert linear_shapes("llama3-8b") == {
        (4096, 4096): ["attn.c_q", "attn.c_proj"], (4096, 1024): ["attn.c_k", "attn.c_v"],
        (4096, 14336): ["mlp.c_fc", "mlp.c_gate"], (14336, 4096): ["mlp.c_proj"]}
    assert linear_shapes("d12") == {(768, 768): ["attn.c_q", "attn.c_k", "attn.c_v", "attn.c_proj"],
                                          (768, 3072): ["mlp.c_fc"], (3072, 768): ["mlp.c_proj"]}


def test_wrapper_exits_4_when_torchao_does_not_import(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")  # -S: no site-packages
    fake.chmod(0o755)
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=str(fake), WHEELS=str(tmp_path / "no-wheels"))
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry_run"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4 and "does not import" in proc.stderr and "make install TORCH=torch" in proc.stderr


def test_the_import_probe_covers_every_declared_dependency():
    """What a job needs must fail the wrapper's probe (exit 4, one message), not every later job."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].replace("-", "_") for d in deps}
    probe = re.search(r'^PROBE="([^"]+)"', (ROOT / "scripts" / "gpu_check.sh").read_text(), re.M)[1].split()
    assert declared <= set(probe) and "pytest" in probe, declared - set(probe)


def test_the_wrappers_limit_follows_the_budget(tmp_path):
    """gpu_check.sh stops the script 25 s after --budget_s: its default is the script's (440 s,
    8 minutes in all), and a --budget_s given sets it (a stand-in interpreter reports the limit)."""
    gpu_check = _script("gpu_check")
    sh = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert f"BUDGET_S={gpu_check.GPUCheckConfig.budget_s:g}\n" in sh
    assert gpu_check.GPUCheckConfig.budget_s + 25 + 10 <= 480  # TERM at +25 s, KILL 10 s later
    fake = tmp_path / "python"  # imports succeed; gpu_check.py prints the parent's timeout arguments
    fake.write_text("#!/bin/sh\ncase \"$1\" in -c) exit 0;; esac\n"
                    "tr '\\0' ' ' < /proc/$PPID/cmdline; echo\n")
    fake.chmod(0o755)
    for args, limit in (((), "465"), (("--budget_s", "100"), "125"), (("--budget_s=60.5",), "86")):
        r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60, env=dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=str(fake)))
        assert r.returncode == 0 and f"timeout -k 10 {limit} " in r.stdout, (args, r.stdout, r.stderr)


def test_a_run_that_hit_the_recompile_limit_is_invalid_and_gives_no_ratio():
    """A function recompiled past dynamo's limit (for real: a new constant per call, limit 1):
    RecompileLog reports it; a run so marked gives no ratio or MFU, the valid ones still do."""
    import torch

    from nanochat.train.measure import RecompileLog

    gpu_check = _script("gpu_check")

    def f(x, k):
        return x * k

    compiled = torch.compile(f, backend="eager")
    log = RecompileLog()
    with torch._dynamo.config.patch(recompile_limit=1), log:
        for k in range(3):
            compiled(torch.ones(2), k)
    assert log.limit_hit is not None and log.limit_hit.startswith("torch._dynamo hit config.recompile_limit (1)")
    results = {"train": {"d26": {"bf16": {"tokens_per_sec": 100.0, "mfu": 0.3},
                                 "fp8_faster": {"tokens_per_sec": 45.0, "mfu": 0.1, "invalid": "limit hit"}},
                         "d12": {"bf16": {"tokens_per_sec": 100.0, "mfu": 0.3},
                                 "fp8_faster": {"tokens_per_sec": 90.0, "mfu": 0.25}}},
               "all": {"d12": {"fp8_all": {"tokens_per_sec": 80.0, "mfu": 0.2}}}}
    assert gpu_check.ratios(results) == {
        "d26_bf16_mfu": 0.3, "d26_fp8_faster_invalid": "limit hit", "d12_bf16_mfu": 0.3,
        "d12_fp8_faster_over_bf16_tokens_per_sec": 0.9, "d12_fp8_faster_mfu": 0.25,
        "d12_fp8_all_over_bf16_tokens_per_sec": 0.8, "d12_fp8_all_mfu": 0.2}
