"""bench/bench_vs_nanochat.py, karpathy/nanochat against ours on the same text.

Checked against: lines nanochat's base_train printed in real runs (its curve and the throughput
recomputed by hand from the step times); the corpus the bench writes, read back with pyarrow as
nanochat reads it (sorted shards, the last one validation) and with our own data code (the same
documents on the same sides), and the split recomputed from our rule; a --quick run's figures
recomputed from its runs (common_bpb's own checks: tests/test_common_bpb.py); joined parts'
comparisons recomputed by hand from `harness.steps_to`, a target a run is past at its first
evaluation marked as an upper bound. The --quick run needs a checkout of karpathy/nanochat and a
Python with its packages: NANOCHAT_DIR (and NANOCHAT_PYTHON, default this one); without them it
is skipped.
"""

import contextlib
import dataclasses
import io
import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import bench_vs_nanochat as bvn  # noqa: E402  (a benchmark, outside the package)
import harness  # noqa: E402
import vs_nanochat_report as report  # noqa: E402

# nanochat 92d63d4, scripts/base_train.py on CPU: --depth 2 --max-seq-len 64 --device-batch-size 4
# --total-batch-size 256 --num-iterations 6 --eval-every 3 (256 tokens a step).
TINY_LOG = """\
Total batch size 256 => gradient accumulation steps: 1
Step 00000 | Validation bpb: 4.084334
step 00000/00006 (0.00%) | loss: 6.239316 | lrm: 0.03 | dt: 62807.14ms | tok/sec: 4 | bf16_mfu: 0.00 | epoch: 1 pq: 0 rg: 0 | total time: 0.00m
step 00001/00006 (16.67%) | loss: 6.239134 | lrm: 0.05 | dt: 42.20ms | tok/sec: 6,065 | bf16_mfu: 0.00 | epoch: 1 pq: 0 rg: 0 | total time: 0.00m
step 00002/00006 (33.33%) | loss: 6.239064 | lrm: 0.07 | dt: 35.91ms | tok/sec: 7,128 | bf16_mfu: 0.00 | epoch: 1 pq: 0 rg: 0 | total time: 0.00m
Step 00003 | Validation bpb: 4.083846
step 00003/00006 (50.00%) | loss: 6.238439 | lrm: 0.10 | dt: 35.34ms | tok/sec: 7,244 | bf16_mfu: 0.00 | epoch: 1 pq: 0 rg: 0 | total time: 0.00m
step 00004/00006 (66.67%) | loss: 6.238159 | lrm: 0.12 | dt: 65.67ms | tok/sec: 3,898 | bf16_mfu: 0.00 | epoch: 1 pq: 0 rg: 1 | total time: 0.00m
step 00005/00006 (83.33%) | loss: 6.238063 | lrm: 0.15 | dt: 37.66ms | tok/sec: 6,797 | bf16_mfu: 0.00 | epoch: 1 pq: 0 rg: 1 | total time: 0.00m
Step 00006 | Validation bpb: 4.082634
Peak memory usage: 0.00MiB
Minimum validation bpb: 4.082634
"""


def test_parse_nanochat_log_reads_the_curve_and_the_timed_steps():
    r = bvn.parse_nanochat_log(TINY_LOG, 256)
    assert r["val_step"] == [0, 3, 6]
    assert r["val_bpb_curve"] == [4.084334, 4.083846, 4.082634]
    assert r["val_bpb"] == 4.082634 and r["steps"] == 6
    assert r["attention"] == "fa3"  # it said nothing of a fallback
    fallback = "WARNING: Flash Attention 3 not available, using PyTorch SDPA fallback\n"
    assert bvn.parse_nanochat_log(fallback + TINY_LOG, 256)["attention"] == "sdpa"
    assert report.attention([dict(attention="sdpa"), dict(attention="sdpa")]) == ", attention sdpa"
    assert report.attention([]) == ""
    # 10 steps or fewer: every step but the first (compile) is timed
    assert r["tokens_per_sec"] == pytest.approx(5 * 256 / (0.04220 + 0.03591 + 0.03534 + 0.06567 + 0.03766), rel=1e-9)


# The same script's d2 run (16 x 256 tokens a step, 300 steps), lines around its 10th step.
D2_LOG = """\
Step 00000 | Validation bpb: 3.041976
step 00009/00300 (3.00%) | loss: 8.296571 | lrm: 0.25 | dt: 2803.72ms | tok/sec: 1,460 | bf16_mfu: 0.00 | epoch: 1 pq: 0 rg: 1 | total time: 0.00m
step 00010/00300 (3.33%) | loss: 8.292392 | lrm: 0.28 | dt: 2811.82ms | tok/sec: 1,456 | bf16_mfu: 0.00 | epoch: 1 pq: 0 rg: 1 | total time: 0.00m
step 00011/00300 (3.67%) | loss: 8.283688 | lrm: 0.30 | dt: 2827.83ms | tok/sec: 1,448 | bf16_mfu: 0.00 | epoch: 1 pq: 0 rg: 1 | total time: 0.05m | eta: 13.6m
step 00012/00300 (4.00%) | loss: 8.273952 | lrm: 0.33 | dt: 2882.18ms | tok/sec: 1,421 | bf16_mfu: 0.00 | epoch: 1 pq: 0 rg: 1 | total time: 0.10m | eta: 13.7m
"""


def test_parse_nanochat_log_times_the_steps_after_the_tenth_as_nanochat_does():
    r = bvn.parse_nanochat_log(D2_LOG, 16 * 256)
    assert r["val_step"] == [0] and r["val_bpb"] == 3.041976
    assert r["tokens_per_sec"] == pytest.approx(2 * 4096 / (2.82783 + 2.88218), rel=1e-9)
    assert bvn.parse_nanochat_log("Step 00000 | Validation bpb: 3.0\n", 4096)["tokens_per_sec"] is None


def test_corpus_is_split_once_and_both_projects_read_the_same_documents(small_corpus, tmp_path):
    import pyarrow.parquet as pq
    from nanochat.data.plan import iter_documents, plan_sources
    from nanochat.data.sources import list_sources
    from nanochat.data.split import val_hash

    train, val, note = bvn.split_corpus(str(small_corpus), 700)
    # these 12 files: none hashes below VAL_FRACTION, so the smallest hash is the validation document
    docs = [d for _, d in iter_documents(plan_sources(list_sources(str(small_corpus))))]
    smallest = min(docs, key=lambda d: val_hash(d.id))
    assert "moved" in note and val == bvn.pieces(smallest.text, 700)
    assert train == [p for d in docs if d is not smallest for p in bvn.pieces(d.text, 700)]

    info = bvn.write_corpus(train, val, tmp_path, shard_docs=50, row_group=16)
    shards = sorted(Path(info["nanochat_data"]).glob("*.parquet"))  # nanochat: sorted, the last is val
    texts = [pq.read_table(p).column("text").to_pylist() for p in shards]
    assert len(shards) == info["train_shards"] + 1 == -(-len(train) // 50) + 1
    assert [t for shard in texts[:-1] for t in shard] == train and texts[-1] == val

    plan = plan_sources(list_sources(info["ours_corpus"]))
    skipped = Counter()
    ours = [(u.role, d.text) for u, d in iter_documents(plan, skipped)]
    assert [t for role, t in ours if role == "train"] == train
    assert [t for role, t in ours if role == "validation"] == val
    assert not skipped

    again = bvn.write_corpus(train[:10], val, tmp_path)  # a smaller corpus leaves no stale shard behind
    assert len(list(Path(again["nanochat_data"]).iterdir())) == 2


def test_pieces_cut_after_newlines_and_keep_the_text():
    blank = " " * 9 + "\n"
    text = "a = 1\n" * 30 + "x" * 25 + "\n" + blank + "b\n"
    out = bvn.pieces(text, 10)
    assert all(len(p) <= 10 for p in out)
    assert blank not in out and "".join(out) == text.replace(blank, "")  # only the blank piece is dropped
    assert all(p.endswith("\n") for p in out if "x" not in p)  # cut after a newline unless a line is longer
    assert bvn.pieces(text, 0) == [text] and bvn.pieces(" \n", 0) == []


def _main(argv):
    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        rc = bvn.main(argv)
    return rc, printed.getvalue(), errors.getvalue()


def test_bad_input_is_one_error_line_before_any_work(tmp_path):
    rc, _, err = _main(["--work_dir", str(tmp_path / "w")])
    assert rc == 2 and "--nanochat_dir is missing" in err
    rc, _, err = _main(["--nanochat_dir", str(tmp_path), "--work_dir", str(tmp_path / "w")])
    assert rc == 2 and "has no scripts/base_train.py" in err
    with pytest.raises(SystemExit) as exit_:  # a bad flag: the parser's one line
        _main(["--nanochat_dir", str(tmp_path), "--eval_tokens", "1000"])
    assert exit_.value.code == 2
    with pytest.raises(ValueError, match="not a multiple of batch_size x seq_len"):
        bvn.BenchVsNanochatConfig(nanochat_dir=str(tmp_path), eval_tokens=1000)
    with pytest.raises(ValueError, match="--nanochat_runs must be between 0 and the number of --seeds"):
        bvn.BenchVsNanochatConfig(nanochat_dir=str(tmp_path), seeds=(1, 2), nanochat_runs=3)
    assert not (tmp_path / "w").exists()


def _run(curve, steps=(100, 200, 300), tokens_per_sec=1000.0):
    """A run's record as the bench writes it (the common curve and its own beside it)."""
    return dict(val_step=list(steps), val_bpb_curve=list(curve), val_bpb=curve[-1], own_val_step=list(steps),
                own_val_bpb_curve=[v + 0.1 for v in curve], own_val_bpb=curve[-1] + 0.1, steps=steps[-1],
                tokens_per_sec=tokens_per_sec, wall_time_s=60.0)


def _part(path, seeds, nanochat, ours, **config):
    fingerprints = dict(train="t", val="v", nanochat_tokenizer="n", our_tokenizer="o")
    cfg = dict(dataclasses.asdict(bvn.BenchVsNanochatConfig(nanochat_dir="nc", seeds=seeds)),
               nanochat_runs=len(nanochat), work_dir=f"w{seeds[0]}", **config)
    path.write_text(json.dumps(dict(machine=dict(host="h"), config=cfg, nanochat_commit="abc", corpus=dict(val_docs=3),
                                    fingerprints=fingerprints, runs={"nanochat": nanochat, "ours-muon": ours})))
    return str(path)


def test_merge_joins_parts_as_one_run_of_every_seed(tmp_path):
    nc = _run([2.0, 1.7, 1.8], tokens_per_sec=800.0)  # lowest at step 200, then rising
    ours = [_run([1.9, 1.6, 1.5]), _run([2.1, 1.75, 1.6]), _run([2.2, 1.9, 1.82])]
    a = _part(tmp_path / "a.json", [1], [nc], ours[:1])
    b = _part(tmp_path / "b.json", [2, 3], [], ours[1:])
    rc, printed, err = _main(["--merge", a, b, "--out", str(tmp_path / "f.json")])
    assert rc == 0, err
    data = json.loads((tmp_path / "f.json").read_text())
    assert data["config"]["seeds"] == [1, 2, 3] and data["config"]["nanochat_runs"] == 1
    assert [m["path"] for m in data["merged_from"]] == [a, b] and data["runs"]["ours-muon"] == ours
    assert [c["seed"] for c in data["comparisons"]] == [1, 2, 3]
    nc_s = lambda steps: steps * 4096 / 800  # noqa: E731  (nanochat's seconds at its tokens/s)
    for c, o in zip(data["comparisons"], ours):  # each seed against nanochat's one run, by hand
        to = harness.steps_to(1.8, o["val_step"], o["val_bpb_curve"])
        assert c["ours_to_nanochat"]["steps"] == to
        assert c["nanochat_to_ours"]["steps"] == harness.steps_to(o["val_bpb"], nc["val_step"], nc["val_bpb_curve"])
        theirs = harness.steps_to(1.8, nc["val_step"], nc["val_bpb_curve"])
        assert c["time_ratio"] == (None if to is None else pytest.approx((to * 4096 / 1000) / nc_s(theirs)))
        best = harness.steps_to(1.7, o["val_step"], o["val_bpb_curve"])  # nanochat's best, reached at 200
        assert c["nanochat_best"] == 1.7 and c["ours_to_nanochat_best"]["steps"] == best
        assert c["best_time_ratio"] == (None if best is None else pytest.approx((best * 4096 / 1000) / nc_s(200)))
        assert c["ours_above_at"] == [st for st, v, w in zip((100, 200, 300), o["val_bpb_curve"],
                                                             nc["val_bpb_curve"]) if v > w]
    assert data["comparisons"][0]["ours_to_nanochat"]["steps"] == pytest.approx(100 + 100 * (1.9 - 1.8) / 0.3)
    assert data["comparisons"][0]["ours_to_nanochat_best"]["steps"] == pytest.approx(100 + 100 * (1.9 - 1.7) / 0.3)
    assert data["comparisons"][2]["ours_to_nanochat"]["steps"] is None  # seed 3 ends above nanochat's final
    assert data["comparisons"][2]["ours_above_at"] == [100, 200, 300]
    assert "joined 2 files" in printed and "never" in printed
    # every crossing here lies between two evaluations: no figure is only bounded by the first
    assert not any(c[k]["upper_bound"] for c in data["comparisons"]
                   for k in ("ours_to_nanochat", "nanochat_to_ours", "ours_to_nanochat_best"))
    assert not any(v for c in data["comparisons"] for v in c["nanochat_upper_bound"].values())
    assert "<=" not in printed and "upper bound" not in printed
    rc, again, err = _main(["--merge", str(tmp_path / "f.json")])  # one file: its report again
    assert rc == 0 and "ours-muon 3" in again, err


def test_a_target_already_reached_at_the_first_evaluation_is_marked_as_an_upper_bound(capsys):
    import vs_nanochat_report

    config = dataclasses.asdict(bvn.BenchVsNanochatConfig(nanochat_dir="nc", seeds=(1, 2)))
    # nanochat overfits: its final (2.1) is above its first evaluation, so its time to it is bounded
    nc = _run([1.9, 1.7, 2.1], tokens_per_sec=800.0)
    ours = [_run([1.8, 1.6, 1.65]), _run([1.65, 1.5, 1.55])]
    out = vs_nanochat_report.report(config, {"nanochat": [nc], "ours-muon": ours}, "abc")
    printed = capsys.readouterr().out
    for c in out:  # both at the final's level at step 100: the ratio is one of tokens/s only
        assert c["ours_to_nanochat"] == dict(steps=100.0, seconds=pytest.approx(409.6),
                                             steps_ratio=pytest.approx(1 / 3), upper_bound=True)
        assert c["nanochat_upper_bound"] == dict(final=True, best=False)
        assert c["time_ratio"] == pytest.approx(800 / 1000)
    # to nanochat's best (1.7, at step 200): seed 1 crosses between evaluations, seed 2 is past it at 100
    assert out[0]["ours_to_nanochat_best"]["upper_bound"] is False
    assert out[0]["ours_to_nanochat_best"]["steps"] == pytest.approx(100 + 100 * (1.8 - 1.7) / 0.2)
    assert out[1]["ours_to_nanochat_best"] == dict(steps=100.0, seconds=pytest.approx(409.6), upper_bound=True)
    assert out[1]["best_time_ratio"] == pytest.approx(409.6 / (200 * 4096 / 800))
    assert printed.count("0.80x*") == 2 and "<= 100, <= 0.40x" in printed and "upper bound" in printed


def test_a_part_without_nanochat_reports_ours_and_compares_nothing(capsys):
    import vs_nanochat_report

    config = dataclasses.asdict(bvn.BenchVsNanochatConfig(nanochat_dir="nc", seeds=(2, 3), nanochat_runs=0))
    runs = {"nanochat": [], "ours-muon": [_run([1.9, 1.6, 1.5]), _run([2.0, 1.7, 1.55])]}
    assert vs_nanochat_report.report(config, runs, "abc") == []
    printed = capsys.readouterr().out
    assert "no nanochat run here" in printed and "ours-muon 2" in printed and "1.5250" in printed  # mean final


def test_merge_refuses_parts_that_measured_different_things(tmp_path):
    nc, o = _run([2.0, 1.8, 1.7]), _run([1.9, 1.6, 1.5])
    a = _part(tmp_path / "a.json", [1], [nc], [o])
    cases = {"ran --depth 4": _part(tmp_path / "b.json", [2], [], [o], depth=4),
             "a seed appears twice": _part(tmp_path / "c.json", [1], [], [o]),
             "none of the files holds a nanochat run": None}
    for message, b in cases.items():
        files = [a, b] if b else [_part(tmp_path / "d.json", [2], [], [o]), _part(tmp_path / "e.json", [3], [], [o])]
        rc, _, err = _main(["--merge", *files, "--out", str(tmp_path / "f.json")])
        assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err
    other = json.loads(Path(a).read_text())
    other["fingerprints"]["our_tokenizer"] = "x"
    other["config"]["seeds"] = [5]
    (tmp_path / "g.json").write_text(json.dumps(other))
    rc, _, err = _main(["--merge", a, str(tmp_path / "g.json")])
    assert rc == 2 and "another our_tokenizer fingerprint" in err
    (tmp_path / "h.json").write_text("{")
    rc, _, err = _main(["--merge", a, str(tmp_path / "h.json")])
    assert rc == 2 and "cannot read it as JSON" in err
    assert not (tmp_path / "f.json").exists()


NANOCHAT_DIR = os.environ.get("NANOCHAT_DIR")


@pytest.mark.skipif(not NANOCHAT_DIR, reason="set NANOCHAT_DIR to a karpathy/nanochat checkout (and NANOCHAT_PYTHON "
                                              "to a Python with its packages) to run nanochat")
def test_quick_run_trains_both_and_recomputes_its_comparison(small_corpus, tmp_path):
    out = tmp_path / "figures.json"
    rc, printed, err = _main(["--quick", "--nanochat_dir", NANOCHAT_DIR, "--nanochat_python",
                              os.environ.get("NANOCHAT_PYTHON", sys.executable), "--dataset_path", str(small_corpus),
                              "--work_dir", str(tmp_path / "work"), "--out", str(out), "--seeds", "1", "2",
                              "--nanochat_runs", "1"])
    assert rc == 0, printed + err
    data = json.loads(out.read_text())
    assert len(data["runs"]["nanochat"]) == 1 and len(data["runs"]["ours-muon"]) == 2
    nc, ours = data["runs"]["nanochat"][0], data["runs"]["ours-muon"][0]
    assert nc["own_val_step"] == [0, 3, 6] and ours["own_val_step"] == [3, 6]  # nanochat also evaluates at 0
    # the common evaluator scored both projects' checkpoints at the same steps (nanochat saves none at 0)
    assert nc["val_step"] == ours["val_step"] == [3, 6]
    assert nc["val_bpb"] == nc["val_bpb_curve"][-1] and ours["val_bpb"] == ours["val_bpb_curve"][-1]
    assert nc["steps"] == ours["steps"] == 6
    c = data["comparisons"][0]
    assert c["ours_to_nanochat"]["steps"] == harness.steps_to(nc["val_bpb"], ours["val_step"], ours["val_bpb_curve"])
    assert c["nanochat_to_ours"]["steps"] == harness.steps_to(ours["val_bpb"], nc["val_step"], nc["val_bpb_curve"])
    mine, theirs = dict(zip(ours["val_step"], ours["val_bpb_curve"])), dict(zip(nc["val_step"], nc["val_bpb_curve"]))
    assert c["ours_above_at"] == [st for st in (3, 6) if mine[st] > theirs[st]]
    if c["ours_to_nanochat"]["seconds"] is not None:
        theirs_s = harness.steps_to(nc["val_bpb"], nc["val_step"], nc["val_bpb_curve"]) * 256 / nc["tokens_per_sec"]
        assert c["time_ratio"] == pytest.approx(c["ours_to_nanochat"]["seconds"] / theirs_s, rel=1e-9)
    # the second seed is compared with nanochat's one run
    assert [c["seed"] for c in data["comparisons"]] == [1, 2]
    second = data["runs"]["ours-muon"][1]
    assert data["comparisons"][1]["nanochat_to_ours"]["steps"] == harness.steps_to(
        second["val_bpb"], nc["val_step"], nc["val_bpb_curve"])
    assert data["corpus"]["val_docs"] > 0 and "val bpb at each evaluation" in printed
    assert set(data["fingerprints"]) == {"train", "val", "nanochat_tokenizer", "our_tokenizer"}
