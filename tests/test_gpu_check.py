"""scripts/gpu_check.py and scripts/gpu_check.sh, rehearsed on the CPU so they cannot rot.

The GPU check runs only when a session is lent a GPU, with minutes to spare; a broken script there
wastes the session. So here:
* the wrapper runs the script's --dry_run (every section at toy sizes, FP8 emulated, the same
  code paths and JSON schema as the device run) and the JSON is checked field by field against
  what the device run must produce: every config of every section measured, positive times,
  ratios against each baseline, the optimizers' state bytes against FP8Tensor's arithmetic
  (fp32 moments 8 bytes/param, one FP8 moment 1 + 4/256 + 4, two 2 * (1 + 4/256)), memory
  fields present and None off CUDA, the GPU tests skipped with a note, every target present and
  unjudged;
* the wrapper exits non-zero, with a message, when torchao does not import or no wheels are there;
* the job runner: a job that raises is recorded as an error and the next one still runs, an
  unsupported configuration costs no time, a spent budget skips and lists the job;
* the pure helpers: pytest summary parsing, the preset:batch[:modes] flag.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through it
    spec.loader.exec_module(module)
    return module


gc = _load_script()


def _wrapper_env(out: Path, **extra) -> dict:
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, GPU_CHECK_SKIP_WHEELS="1")
    env.update(extra)
    env.pop("PYTHONPATH", None)
    return env


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry_run"], cwd=ROOT,
                          env=_wrapper_env(out), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text()), proc.stdout, out


def test_dry_run_writes_every_section(dry_run):
    report, stdout, out = dry_run
    assert report["schema"] == gc.SCHEMA and report["dry_run"] is True
    assert report["errors"] == [], report["errors"]
    assert report["budget"]["skipped_for_time"] == []
    env = report["env"]
    for key in ("date", "torch", "torchao", "gpu_name", "capability", "driver", "source_digest"):
        assert key in env
    assert env["gpu_name"] is None and env["capability"] is None and len(env["source_digest"]) == 12
    for name in ("gpu_check.json", "gpu_check.log"):
        assert (out / name).exists(), name
    assert "targets" in stdout and "(a) micro" in stdout and "(d) tests" in stdout


def test_dry_run_micro(dry_run):
    micro = dry_run[0]["micro"]["results"]
    probe = micro.pop("scaled_mm_probe")
    assert len(probe["pairings"]) == 8 and all(r["ok"] and r["rel_err"] < 0.01 for r in probe["pairings"])
    assert set(micro) == {"fp32"} | {f"fp8 {m} {r}" for m in ("e4m3", "e5m2", "auto")
                                     for r in ("tensorwise", "rowwise")}
    for name, e in micro.items():
        assert e["status"] == "ok", (name, e)
        assert e["ms_median"] > 0 and e["tflops"] > 0 and len(e["ms_all"]) == 2
        assert "peak_mem_bytes" in e and e["peak_mem_bytes"] is None
        assert e["shape"] == dict(tokens=256, n_embd=128, hidden=512)
        if name != "fp32":
            assert e["fp8"]["backend"] == "emulated" and e["fp8"]["converted"] == 2
            assert e["speedup_vs_baseline"] > 0
        if " auto " in name:  # calibrated (both formats measured) before compile, as the trainer does
            chosen = e["fp8"]["auto"]["chosen"]
            assert set(chosen) == {"input", "weight", "grad_output"}
            assert all(sum(fmts.values()) == 2 for fmts in chosen.values())


def test_dry_run_train(dry_run):
    train = dry_run[0]["train"]["results"]
    assert set(train) == {"d2 fp32", "d2 fp8 e4m3", "d2 fp8 e5m2", "d2 fp8 auto"}
    for name, e in train.items():
        assert e["status"] == "ok", (name, e)
        assert e["tokens_per_s"] > 0 and e["ms_median"] > 0 and e["batch"] == 2
        # a random-token model starts at ln(vocab) = 5.55; the loss is finite and about that
        assert abs(e["loss_first"] - 5.545) < 0.5 and abs(e["loss_last"] - 5.545) < 1.0
        assert e["peak_mem_bytes"] is None
        if e["kind"] == "fp8":
            assert e["fp8"]["converted"] == 12 and e["speedup_vs_baseline"] > 0
            assert "peak_mem_ratio_vs_baseline" in e
    assert sum(train["d2 fp8 auto"]["fp8"]["auto"]["chosen"]["input"].values()) == 12


def test_dry_run_optim(dry_run):
    optim = dry_run[0]["optim"]["results"]
    assert set(optim) == set(gc.OPTIMIZERS)
    expected = {"adamw_fused": 8.0, "fp8optim_l0": 8.0, "fp8optim_l1": 4 + 1 + 4 / 256,
                "fp8optim_l2": 2 * (1 + 4 / 256), "torchao_adamw_fp8": 2 * (1 + 4 / 256)}
    for name, e in optim.items():
        assert e["status"] == "ok", (name, e)
        assert e["ms_median"] > 0 and e["n_params"] == 2 * 256 * 256
        assert e["state_bytes_per_param"] == pytest.approx(expected[name], abs=1e-3), name
        assert e["peak_extra_bytes_per_param"] is None
        if name.startswith("fp8optim"):
            assert e["state_bytes_reported_per_param"] == pytest.approx(e["state_bytes_per_param"])
        if name in ("fp8optim_l1", "fp8optim_l2"):
            assert e["step_backend"] in ("native", "compile"), "FP8Optim fell back to its eager step"
        if name != "adamw_fused":
            assert e["step_ratio_vs_fused"] > 0


def test_dry_run_tests_and_targets(dry_run):
    report = dry_run[0]
    t = report["tests"]
    assert t["status"] == "skipped" and "pytest -m gpu" in t["command"] and "tests/test_gpu.py" in t["command"]
    targets = report["targets"]
    assert set(targets) == {"micro_speedup", "train_speedup", "optim_step_ratio", "optim_mem_saving"}
    for name, tgt in targets.items():
        assert tgt["met"] is None, name  # a dry run judges nothing
    for name in ("micro_speedup", "train_speedup", "optim_step_ratio"):
        assert targets[name]["value"] > 0
    assert targets["optim_mem_saving"]["value"] is None  # peak memory exists only on CUDA
    assert [j["key"] for j in report["jobs"]][:3] == ["scaled_mm_probe", "fp32", "fp8 e4m3 tensorwise"]


def test_wrapper_fails_loudly_without_torchao(tmp_path):
    fake = tmp_path / "fake"
    (fake / "torchao").mkdir(parents=True)
    (fake / "torchao" / "__init__.py").write_text("raise ImportError('simulated: torchao vs torch')\n")
    env = _wrapper_env(tmp_path / "out")
    env["PYTHONPATH"] = str(fake)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry_run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 4
    output = proc.stdout + proc.stderr  # the wrapper tees the script's stderr into its log
    assert "simulated" in output and "torchao or nanochat.fp8 does not import" in output
    assert not (tmp_path / "out" / "gpu_check.json").exists()


def test_wrapper_without_wheels_says_what_to_run(tmp_path):
    env = _wrapper_env(tmp_path / "out", GPU_CHECK_SKIP_WHEELS="0")
    # a copy of the wrapper in a tree without .whl/: it must stop before running anything
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "gpu_check.sh").write_text((ROOT / "scripts" / "gpu_check.sh").read_text())
    proc = subprocess.run(["bash", str(tmp_path / "scripts" / "gpu_check.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and "gpu-wheels.sh" in proc.stderr


def test_runner_records_errors_unsupported_and_budget(tmp_path):
    cfg = gc.CheckConfig(dry_run=True, budget_s=3600.0, out=str(tmp_path / "r.json"))
    check = gc.Check(cfg, torch.device("cpu"), Path(cfg.out))

    def boom():
        raise RuntimeError("kernel exploded\nsecond line")

    check.run(gc.Job("micro", "broken", 0.0, boom, dict(kind="fp8", mode="e4m3", recipe="tensorwise")))
    check.run(gc.Job("micro", "fine", 0.0, lambda: dict(ms_median=1.0, tflops=1.0), dict(kind="baseline")))
    check.run(gc.Job("micro", "e5m2 pair", 0.0, lambda: pytest.fail("must not run"), {},
                     precheck=lambda: "two e5m2 operands"))
    check.run(gc.Job("optim", "too long", 7200.0, lambda: pytest.fail("must not run"), {}))
    report = json.loads(Path(cfg.out).read_text())
    res = report["micro"]["results"]
    assert res["broken"]["status"] == "error" and res["broken"]["error"] == "RuntimeError: kernel exploded"
    assert "Traceback" in res["broken"]["traceback"]
    assert res["fine"]["status"] == "ok" and res["fine"]["duration_s"] >= 0
    assert res["e5m2 pair"] == dict(status="unsupported", reason="two e5m2 operands",
                                    duration_s=res["e5m2 pair"]["duration_s"])
    assert report["optim"]["results"]["too long"]["status"] == "skipped"
    assert report["budget"]["skipped_for_time"] == ["optim: too long"]
    assert report["errors"] == ["micro broken: RuntimeError: kernel exploded"]


def test_parse_pytest_counts():
    parse = gc.parse_pytest_counts
    assert parse("....\n3 passed, 1 failed, 2 skipped in 4.50s\n") == dict(
        passed=3, failed=1, skipped=2, errors=0, deselected=0, collected=0)
    assert parse("x\n1 failed, 14 passed, 2 errors in 80.1s")["errors"] == 2
    assert parse("15 tests collected in 4.77s")["collected"] == 15
    assert parse("5/9 tests collected (4 deselected) in 1.0s")["collected"] == 5
    assert parse("no tests ran in 0.01s")["passed"] == 0
    assert parse("")["passed"] == 0


def test_model_spec_flag():
    assert gc.parse_model_spec("d26:16") == ("d26", 16, None)
    assert gc.parse_model_spec("d12:32:e4m3+auto") == ("d12", 32, ("e4m3", "auto"))
    for bad in ("d26", "d26:0", "d26:x", "d99:4", "d26:16:e3m4"):
        with pytest.raises(ValueError, match="preset:batch"):
            gc.parse_model_spec(bad)
    with pytest.raises(ValueError, match="--target_model d20 is not among"):
        gc.CheckConfig(train_models=("d12:32",), target_model="d20")
