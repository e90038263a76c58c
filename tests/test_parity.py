"""bench/fp8_parity.py, the FP8-vs-high-precision parity sweep, on `--quick` runs.

Checked against: the harness's own raw outputs, recomputed here. Every seed x mode (baseline,
e4m3, e5m2, auto) finished with a finite final val loss; each FP8 mode really ran FP8 (emulated
on CPU, layers converted, a val loss that differs from the baseline's -- otherwise parity would
hold trivially); each gap in parity.json equals (mode - baseline) / baseline of the same seed,
recomputed from the final val losses (and bpb) in the same file, to 1e-9, and each mode's steps at
matched loss from the two curves there (harness.matched_steps_ratio, checked on hand-made curves in
test_bench_optimizers.py); the means, standard
deviations and the paired auto-vs-best difference equal statistics.fmean/stdev of those figures;
the target verdicts follow from them and the stated tolerances (also on hand-made numbers either
side of each threshold); runs in parallel processes give the same figures as in-process runs
(bit for bit: same seed, same data, one thread each); --reuse takes finished runs and trains
only what is missing; the PNG is a PNG; the printed tables have a row per seed and mode. The
quick runs' figures say nothing about FP8 quality (d2, 8 steps): that is the default run's job.
They run eager (--no_compile): the sweep's logic is the same either way, and the compiled trainer
is tested in test_trainer.py.
"""

import contextlib
import io
import json
import math
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# importable by name, as --jobs's worker processes import it (they get this process's sys.path)
sys.path.insert(0, str(ROOT / "bench"))
import fp8_parity as parity  # noqa: E402  (a benchmark, outside the package)
from fp8_parity import QUICK, ParityConfig  # noqa: E402
import harness  # noqa: E402

MODES = ("baseline", "e4m3", "e5m2", "auto", "auto-recheck")
SEEDS = (1, 2)


def _run(argv):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = parity.main(argv)
    return rc, printed.getvalue()


@pytest.fixture(scope="module")
def quick_run(small_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    rc, printed = _run(["--quick", "--no_compile", "--seeds", *map(str, SEEDS), "--dataset_path", str(small_corpus),
                        "--out_dir", str(out), "--device", "cpu"])
    return out, rc, printed


def test_quick_run_records_every_seed_and_mode_with_gaps_recomputed(quick_run):
    out, rc, printed = quick_run
    assert rc == 0
    data = json.loads((out / "parity.json").read_text())
    runs = data["runs"]
    assert sorted(runs) == sorted(map(str, SEEDS))
    for seed in map(str, SEEDS):
        results = runs[seed]
        assert tuple(results) == MODES
        for mode in MODES:
            r = results[mode]
            assert r["error"] is None, f"{seed} {mode} failed: {r['error']}"
            assert r["seed"] == int(seed) and not r["reused"]
            assert math.isfinite(r["val_loss"]) and math.isfinite(r["val_bpb"]), mode
            assert r["steps"] == QUICK["num_iterations"]
            assert r["curves"]["val_step"][-1] == r["steps"]  # the final eval is in the curve
            assert r["curves"]["val_loss"][-1] == r["val_loss"]
        base = results["baseline"]
        assert base["fp8_backend"] == "off" and base["gap_pct"] == 0.0
        for mode in MODES[1:]:
            r = results[mode]
            assert r["fp8_backend"] == "emulated" and r["fp8_converted"] > 0, mode
            assert r["val_loss"] != base["val_loss"], f"{mode} reproduced the baseline bit for bit: no FP8 ran"
            want = 100 * (r["val_loss"] - base["val_loss"]) / base["val_loss"]
            assert r["gap_pct"] == pytest.approx(want, rel=1e-9, abs=1e-12)
            want_bpb = 100 * (r["val_bpb"] - base["val_bpb"]) / base["val_bpb"]
            assert r["bpb_gap_pct"] == pytest.approx(want_bpb, rel=1e-9, abs=1e-12)
            c, b = r["curves"], base["curves"]
            assert r["matched_steps"] == harness.matched_steps_ratio(c["val_step"], c["val_loss"], b["val_step"],
                                                                     b["val_loss"])
    assert runs["1"]["baseline"]["val_loss"] != runs["2"]["baseline"]["val_loss"]  # seeds differ

    summary, targets = data["summary"], data["targets"]
    for mode in MODES:
        losses = [runs[s][mode]["val_loss"] for s in map(str, SEEDS)]
        gaps = [runs[s][mode]["gap_pct"] for s in map(str, SEEDS)]
        assert summary[mode]["val_loss_mean"] == pytest.approx(statistics.fmean(losses), rel=1e-12)
        assert summary[mode]["val_loss_sd"] == pytest.approx(statistics.stdev(losses), rel=1e-9)
        assert summary[mode]["gap_mean_pct"] == pytest.approx(statistics.fmean(gaps), rel=1e-9, abs=1e-12)
        matched = [runs[s][mode]["matched_steps"] for s in map(str, SEEDS)]
        if mode != "baseline" and None not in matched:
            assert summary[mode]["matched_steps_mean"] == pytest.approx(statistics.fmean(matched), rel=1e-12)
        if mode != "baseline":
            limit = data["config"]["gap_target_pct"]
            assert targets["within_gap"][mode] == all(abs(g) <= limit for g in gaps)

    best = min(("e4m3", "e5m2"), key=lambda m: summary[m]["val_loss_mean"])
    limit = summary[best]["val_loss_mean"] * (1 + data["config"]["auto_tolerance_pct"] / 100)
    assert sorted(targets["auto_vs_best_fixed"]) == ["auto", "auto-recheck"]
    for mode, a in targets["auto_vs_best_fixed"].items():
        assert a["best_fixed_mode"] == best
        assert a["met"] == (summary[mode]["val_loss_mean"] <= limit)
        diffs = [100 * (runs[s][mode]["val_loss"] - runs[s][best]["val_loss"]) / runs[s][best]["val_loss"]
                 for s in map(str, SEEDS)]
        assert a["diff_mean_pct"] == pytest.approx(statistics.fmean(diffs), rel=1e-9, abs=1e-12)
        assert a["diff_se_pct"] == pytest.approx(statistics.stdev(diffs) / math.sqrt(2), rel=1e-9)
    assert targets["all_met"] == (all(targets["within_gap"].values())
                                  and all(a["met"] for a in targets["auto_vs_best_fixed"].values()))
    # auto-recheck is auto with re-checks: the same calibration, then its own run directory and flag
    for seed in map(str, SEEDS):
        settings = json.loads((out / f"seed-{seed}" / "auto-recheck" / "parity_run.json").read_text())["settings"]
        assert settings["fp8_mode"] == "auto" and settings["fp8_auto_recheck_every"] == QUICK["recheck_every"]

    png = (out / "parity.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(png) > 10_000  # two panels of curves, not an empty canvas

    table = printed[printed.index("seed "):]
    for seed in SEEDS:
        for mode in MODES:
            assert any(line.split()[:2] == [str(seed), mode] for line in table.splitlines()), (seed, mode)
    assert "auto vs best fixed mode" in table and "targets:" in table


def test_parallel_jobs_and_reuse_give_the_same_figures(quick_run, small_corpus, tmp_path):
    """Seed 1's baseline and e4m3 again, as 2 parallel processes: bit-equal val losses. Then
    --reuse with one more seed trains only that seed's runs."""
    out, _, _ = quick_run
    ref = json.loads((out / "parity.json").read_text())["runs"]["1"]
    common = ["--quick", "--no_compile", "--dataset_path", str(small_corpus), "--device", "cpu", "--modes", "baseline",
              "e4m3",
              "--out_dir", str(tmp_path)]
    rc, printed = _run(common + ["--seeds", "1", "--jobs", "2"])
    assert rc == 0 and "2 at a time" in printed
    got = json.loads((tmp_path / "parity.json").read_text())["runs"]["1"]
    for mode in ("baseline", "e4m3"):
        assert got[mode]["val_loss"] == ref[mode]["val_loss"], mode
        assert (tmp_path / "seed-1" / mode / "train.log").stat().st_size > 0  # the run's output went there

    rc, printed = _run(common + ["--seeds", "1", "3", "--reuse"])
    runs = json.loads((tmp_path / "parity.json").read_text())["runs"]
    assert runs["1"]["baseline"]["reused"] and runs["1"]["e4m3"]["reused"]
    assert not runs["3"]["baseline"]["reused"] and not runs["3"]["e4m3"]["reused"]
    assert runs["1"]["e4m3"]["val_loss"] == ref["e4m3"]["val_loss"]
    assert "(reused)" in printed


def test_reuse_needs_the_same_settings_and_validation_windows(tmp_path):
    """A finished run is reused only when its settings and the evaluation protocol it was scored
    with are this invocation's: a run scored on other validation windows is trained again."""
    kw = dict(model_name="d2", seed=1, run_dir=str(tmp_path))
    record = dict(error=None, val_loss=4.0)
    path = tmp_path / "parity_run.json"
    path.write_text(json.dumps(dict(settings=kw, evaluation=parity.EVALUATION, record=record)))
    assert parity.reusable(kw) == dict(record, reused=True)
    assert parity.reusable(dict(kw, seed=2)) is None
    path.write_text(json.dumps(dict(settings=kw, record=record)))  # recorded before the protocol was named
    assert parity.reusable(kw) is None
    path.write_text(json.dumps(dict(settings=kw, evaluation=parity.EVALUATION, record=dict(record, error="boom"))))
    assert parity.reusable(kw) is None


def _runs(**val_losses_per_seed):
    """{seed: {mode: record}} from mode=[loss per seed] keyword arguments, gaps added."""
    n = len(next(iter(val_losses_per_seed.values())))
    runs = {str(i): {m: dict(error=None, val_loss=v[i], val_bpb=v[i] / 2) for m, v in val_losses_per_seed.items()}
            for i in range(n)}
    for results in runs.values():
        parity.add_gaps(results)
    return runs


def _targets(cfg, runs):
    return parity.check_targets(cfg, parity.summarize(cfg, runs))


def test_targets_follow_the_stated_tolerances():
    cfg = ParityConfig(gap_target_pct=1.0, auto_tolerance_pct=0.2, seeds=(0,))
    # e4m3 +0.99% (in), e5m2 -1.01% (out: the band is two-sided), auto 0.19% above e5m2 (in)
    t = _targets(cfg, _runs(baseline=[4.0], e4m3=[4.0396], e5m2=[3.9596], auto=[3.9596 * 1.0019],
                            **{"auto-recheck": [3.9596]}))
    assert t["within_gap"] == {"e4m3": True, "e5m2": False, "auto": True, "auto-recheck": False}
    a = t["auto_vs_best_fixed"]["auto"]
    assert a["best_fixed_mode"] == "e5m2" and a["met"]
    assert not t["all_met"]
    # auto 0.21% above the best fixed mode misses; with a strict tolerance, equal still passes
    t = _targets(cfg, _runs(baseline=[4.0], e4m3=[4.0], e5m2=[4.01], auto=[4.0 * 1.0021], **{"auto-recheck": [4.0]}))
    assert not t["auto_vs_best_fixed"]["auto"]["met"] and t["auto_vs_best_fixed"]["auto-recheck"]["met"]
    assert not t["all_met"]  # every auto mode must meet it
    strict = ParityConfig(auto_tolerance_pct=0.0, seeds=(0,))
    assert _targets(strict, _runs(baseline=[4.0], e4m3=[4.0], e5m2=[4.01], auto=[4.0], **{"auto-recheck": [4.0]}))["all_met"]


def test_targets_over_seeds_use_every_seed_and_the_means():
    cfg = ParityConfig(seeds=(0, 1, 2))
    # e4m3 is within 1% on two seeds and out on one: missed. auto is worse than e5m2 on one seed
    # by 0.5% but better on the other two: on the means it is 0.03% below e5m2 -> met.
    runs = _runs(baseline=[4.0, 4.1, 4.2], e4m3=[4.0, 4.1, 4.25], e5m2=[4.01, 4.11, 4.19],
                 auto=[4.01 * 1.005, 4.10, 4.17], **{"auto-recheck": [4.0, 4.1, 4.2]})
    t = _targets(cfg, runs)
    assert t["within_gap"] == {"e4m3": False, "e5m2": True, "auto": True, "auto-recheck": True}
    a = t["auto_vs_best_fixed"]["auto"]
    assert a["best_fixed_mode"] == "e5m2" and a["met"]
    assert a["auto_val_loss"] == pytest.approx(statistics.fmean([4.01 * 1.005, 4.10, 4.17]))
    assert len(a["paired_diffs_pct"]) == 3 and a["paired_diffs_pct"][0] == pytest.approx(0.5)


def test_failed_run_misses_its_target():
    runs = _runs(baseline=[4.0, 4.0], e4m3=[4.0, 4.0], e5m2=[4.0, 4.0], auto=[4.0, 4.0], **{"auto-recheck": [4.0, 4.0]})
    runs["1"]["e5m2"] = dict(error="RuntimeError: boom")
    parity.add_gaps(runs["1"])
    t = _targets(ParityConfig(seeds=(0, 1)), runs)
    assert t["within_gap"]["e5m2"] is False and not t["all_met"]
    assert t["auto_vs_best_fixed"]["auto"]["best_fixed_mode"] == "e4m3"


def test_recipe_modes_train_e4m3_with_their_recipe_beside_the_others():
    """A recipe-named mode is e4m3 with that recipe, whatever --recipe says; emulated only where
    the device has no kernel for it (run_all decides per mode's recipe)."""
    cfg = ParityConfig(modes=("baseline", "e4m3", "rowwise", "mxfp8", "mxfp8_wgrad_hp"), recipe="tensorwise",
                       compile=False)
    kw = {m: parity.train_kwargs(cfg, m, 1, emulate=True) for m in cfg.modes}
    assert "fp8" not in kw["baseline"] and kw["baseline"]["compile"] is False
    assert (kw["e4m3"]["fp8_mode"], kw["e4m3"]["fp8_recipe"]) == ("e4m3", "tensorwise")
    for mode in ("rowwise", "mxfp8", "mxfp8_wgrad_hp"):
        assert (kw[mode]["fp8_mode"], kw[mode]["fp8_recipe"], kw[mode]["fp8_layers"]) == ("e4m3", mode, "all")
        assert parity.mode_recipe(cfg, mode) == mode
    assert parity.mode_recipe(cfg, "e4m3") == "tensorwise"
    with pytest.raises(ValueError, match="--recipe mxfp8 casts every operand to e4m3, so --modes e5m2 auto"):
        ParityConfig(recipe="mxfp8")
    assert ParityConfig(recipe="mxfp8", modes=("baseline", "e4m3")).recipe == "mxfp8"


@pytest.mark.parametrize("argv", [["--modes", "e4m3", "auto"], ["--modes", "baseline", "e4m3", "e4m3"],
                                  ["--num_iterations", "0"], ["--seeds", "1", "1"], ["--jobs", "0"]])
def test_bad_flags_exit_2_before_training(argv, tmp_path):
    with pytest.raises(SystemExit) as e:
        _run(argv + ["--out_dir", str(tmp_path / "never")])
    assert e.value.code == 2
    assert not (tmp_path / "never").exists()
