"""bench/bench_optimizers.py, AdamW against Muon at equal steps, on a `--quick` run; and
bench/bench_muon_variants.py, Muon with and without its additions.

Checked against: hand-made curves for `steps_to` (the interpolation, the first evaluation, never)
and `matched_steps_ratio` (either run ahead, equal curves), and the runs' own records, recomputed here: the sweep's best rate is the one with the lowest
final val bpb of the runs it trained; the per-seed steps and time ratios and FP8 momentum's gap
follow from those runs' curves and tokens/s (to 1e-9); --reuse trains nothing again. The quick
runs' figures say nothing about the optimizers (d2, 6 steps): that is the default run's job.
"""

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import bench_optimizers as bo  # noqa: E402  (a benchmark, outside the package)
import harness  # noqa: E402


def _run(argv):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = bo.main(argv)
    return rc, printed.getvalue()


def test_steps_to_interpolates_between_evaluations():
    steps, values = [50, 100, 150], [3.0, 2.0, 1.0]
    assert harness.steps_to(1.5, steps, values) == pytest.approx(125.0)
    assert harness.steps_to(2.0, steps, values) == pytest.approx(100.0)
    assert harness.steps_to(3.5, steps, values) == 50.0  # reached by the first evaluation: its step bounds it
    assert harness.steps_to(0.5, steps, values) is None
    assert harness.steps_to(2.5, [50, 100, 150], [3.0, 3.0, 2.0]) == pytest.approx(125.0)  # a flat stretch first


def test_matched_steps_ratio_is_steps_per_reference_step_at_the_lower_final_loss():
    ref_steps, ref = [100, 200, 300], [3.0, 2.0, 1.0]
    # ends below the reference: reaches its final 1.0 at step 250 of 300
    assert harness.matched_steps_ratio([100, 200, 300], [2.0, 1.5, 0.5], ref_steps, ref) == pytest.approx(250 / 300)
    # ends above, at 1.5: the reference gets there at step 250, this run needed 300
    assert harness.matched_steps_ratio([100, 200, 300], [3.0, 2.5, 1.5], ref_steps, ref) == pytest.approx(300 / 250)
    assert harness.matched_steps_ratio(ref_steps, ref, ref_steps, ref) == pytest.approx(1.0)
    # ends above everything the reference measured before its first evaluation: that step bounds it
    assert harness.matched_steps_ratio([100, 200, 300], [9.0, 8.0, 4.0], ref_steps, ref) == pytest.approx(3.0)
    assert harness.matched_steps_ratio([], [], ref_steps, ref) is None


@pytest.fixture(scope="module")
def quick_run(small_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_optimizers")
    argv = ["--quick", "--no_compile", "--dataset_path", str(small_corpus), "--out_dir", str(out / "runs"),
            "--device", "cpu"]  # QUICK's grid: AdamW at 3e-3 and 1e-2, Muon at 0.02, seed 1
    rc, printed = _run([*argv, "--out", str(out / "figures.json")])
    return out, argv, rc, printed


def test_quick_run_picks_the_best_rate_and_recomputes_from_its_runs(quick_run):
    out, _, rc, printed = quick_run
    assert rc == 0, printed
    data = json.loads((out / "figures.json").read_text())
    runs_root = out / "runs"

    def record(name):
        return json.loads((runs_root / name / "seed-1" / "bench_run.json").read_text())["record"]

    adamw = {lr: record(f"adamw-lr{lr}")["val_bpb"] for lr in ("0.003", "0.01")}
    assert data["sweep"]["adamw"]["best"] == float(min(adamw, key=adamw.get))
    best_a = f"adamw-lr{data['sweep']['adamw']['best']:g}"
    a, m, f = record(best_a), record("muon-lr0.02"), record("muon-lr0.02-fp8m")
    assert m["val_step"] == [3, 6] and len(m["val_bpb_curve"]) == 2
    seed = data["seeds"][0]
    to = harness.steps_to(a["val_bpb"], m["val_step"], m["val_bpb_curve"])
    assert seed["muon_steps_to_adamw"] == to
    if to is not None:
        tokens = 4 * 32
        assert seed["steps_ratio"] == pytest.approx(to / a["steps"], abs=1e-9)
        assert seed["time_ratio"] == pytest.approx((to * tokens / m["tokens_per_sec"])
                                                   / (a["steps"] * tokens / a["tokens_per_sec"]), abs=1e-9)
    assert seed["fp8_gap_pct"] == pytest.approx(100 * (f["val_bpb"] - m["val_bpb"]) / m["val_bpb"], abs=1e-9)
    assert f["state_bytes_per_param"] < m["state_bytes_per_param"]  # FP8 momentum really stored in FP8
    assert "Muon FP8 momentum" in printed and "best" in printed


def test_reuse_trains_nothing_again(quick_run):
    out, argv, rc, _ = quick_run
    assert rc == 0
    rc2, printed = _run([*argv, "--reuse"])
    assert rc2 == 0, printed
    assert printed.count(": reused (") == 4 and " ..." not in printed


def test_muon_variants_quick_run_recomputes_its_gaps_from_its_runs(small_corpus, tmp_path):
    """bench_muon_variants: each variant's gap and verdict follow from its runs' own records
    (to 1e-9), and each run was given its setting (the trainer's fields in bench_run.json)."""
    import bench_muon_variants as bmv

    out = tmp_path / "runs"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = bmv.main(["--quick", "--no_compile", "--dataset_path", str(small_corpus), "--out_dir", str(out),
                       "--device", "cpu", "--variants", "momentum_warmup", "--out", str(tmp_path / "f.json")])
    assert rc == 0, printed.getvalue()
    data = json.loads((tmp_path / "f.json").read_text())["variants"]["momentum_warmup"]
    base, var = (json.loads((out / name / "seed-1" / "bench_run.json").read_text())
                 for name in ("muon-lr0.02", "muon-lr0.02-momentum_warmup"))
    gap = 100 * (var["record"]["val_bpb"] - base["record"]["val_bpb"]) / base["record"]["val_bpb"]
    assert data["gap_pct"] == [pytest.approx(gap, abs=1e-9)] and data["helps"] == (gap < 0)
    assert base["settings"]["muon_momentum_warmup"] == 0 and var["settings"]["muon_momentum_warmup"] == 100
    with pytest.raises(SystemExit) as e:  # removed: a one-line error, nothing trained
        bmv.main(["--variants", "polar_express", "--out_dir", str(tmp_path / "none")])
    assert e.value.code == 2 and not (tmp_path / "none").exists()
