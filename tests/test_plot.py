"""nanochat.report.plot and scripts/plot_run.py: the picture of a run, checked against the run's own files.

- the series drawn equal the values in metrics.jsonl, and the tokens axis is step x the tokens
  per step computed by hand from the run's config (batch_size x seq_len x grad_accum_steps x
  world size), read from a real tiny FP8 run's checkpoint and from a DCP checkpoint's trainer.json;
  without a checkpoint the axis is steps;
- metrics.jsonl is read forgivingly: malformed lines are skipped with one warning, `null` and
  bare `NaN` become gaps;
- the FP8 health map's grouping of a Llama-3-8B (32 blocks x 7 Linears = 224 layers) against the
  rows built by hand (each Linear over 6 blocks: 42 rows), and each cell against the maximum of
  its layers' values computed independently from the records;
- plot_run writes a valid PNG of a plausible size whose figure has the expected panels (the four
  curves, and 2 statistics x 3 roles for an FP8 run, none without FP8), the same bytes when drawn
  twice (the same code on the same input), and replaces only a PNG it drew itself;
- errors (no run directory, no metrics.jsonl, no matplotlib, a foreign --out) are one `error:`
  line with exit status 2, and leave a foreign file's bytes unchanged.
No tolerances: every comparison is of values copied from the files (float64 both sides).
"""

import json
import logging
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from nanochat.common import UsageError
from nanochat.report.plot import (INSTALL, MAX_ROWS, SOFTWARE, draw, group_layers, health_map, plot_run, read_metrics,
                           read_run, read_tokens_per_step)
from nanochat.train.trainer import NanoChatTrainer
from tests.conftest import load_script, run_records, tiny_train_kwargs

Image = pytest.importorskip("PIL.Image")  # comes with matplotlib: the `plots` and `dev` extras

CURVES = ["loss (nats per token)", "validation bits per byte", "throughput (tokens/s)",
          "MFU (% of the device's peak FLOP/s)"]
KINDS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
         "mlp.up_proj", "mlp.down_proj"]
LLAMA = [f"model.layers.{b}.{k}" for b in range(32) for k in KINDS]  # Llama-3-8B's FP8 Linears, in order


@pytest.fixture(scope="module")
def fp8_run(small_corpus, tmp_path_factory) -> Path:
    """A real d2 FP8 run (emulated): statistics every 2 steps, validation every 3."""
    run_dir = tmp_path_factory.mktemp("plot") / "fp8"
    NanoChatTrainer(**tiny_train_kwargs(small_corpus, run_dir, num_iterations=6, fp8=True, fp8_emulate=True,
                                        fp8_layers="all", fp8_stats_every=2, eval_every=3, num_samples=0)).train()
    return run_dir


def _write(path: Path, records: list) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _llama_records(steps=(10, 20, 30)) -> list[dict]:
    """Step records with FP8 statistics of 224 layers, random values spanning 0-50 %."""
    rng = np.random.default_rng(0)
    out = []
    for step in steps:
        stats = {n: {role: {"underflow_pct": float(rng.uniform(0, 50)), "saturation_pct": float(rng.uniform(0, 1))}
                     for role in ("input", "weight", "grad_output")} for n in LLAMA}
        out.append({"step": step, "loss": 3.0, "fp8_stats": stats})
    return out


def _script():
    return load_script("plot_run")


def _cli(capsys, *argv: str) -> tuple[int, list[str]]:
    """Run scripts/plot_run.py in this process: (exit status, its `error:` lines)."""
    capsys.readouterr()
    code = _script().main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-2000:]
    return code, [line for line in err.splitlines() if line.startswith("error:")]


def _titles(fig) -> list[str]:
    return [ax.get_title() for ax in fig.get_axes() if ax.get_title()]


def test_group_layers_llama3_8b_against_rows_built_by_hand():
    names = LLAMA + ["lm_head"]
    labels, members, grouping = group_layers(names, MAX_ROWS)
    expected_labels, expected_members = [], []
    for lo in range(0, 32, 6):  # the smallest block range that fits 48 rows: 6 blocks -> 6 x 7 + 1
        hi = min(lo + 5, 31)
        for k, kind in enumerate(KINDS):
            expected_labels.append(f"model.layers.{lo}-{hi}.{kind}")
            expected_members.append([b * 7 + k for b in range(lo, hi + 1)])
    assert labels == expected_labels + ["lm_head"]
    assert members == expected_members + [[224]]
    assert "225 layers in 43 rows" in grouping and "6 blocks" in grouping
    assert sorted(i for m in members for i in m) == list(range(225))  # every layer in one row
    assert group_layers(LLAMA, max_rows=224)[0] == LLAMA  # --max_rows 224: a row per layer
    d26 = [f"transformer.h.{b}.{k}" for b in range(26) for k in ("attn.c_q", "attn.c_k", "attn.c_v", "attn.c_proj",
                                                                  "mlp.c_fc", "mlp.c_proj")]
    labels, members, _ = group_layers(d26, MAX_ROWS)  # 4 blocks a row (3 would need 9 x 6 = 54 rows)
    assert len(labels) == 42 and labels[0] == "transformer.h.0-3.attn.c_q"
    assert labels[-1] == "transformer.h.24-25.mlp.c_proj"


def test_group_layers_small_models_and_models_without_blocks():
    d2 = [f"transformer.h.{b}.{k}" for b in range(2) for k in ("attn.c_q", "attn.c_k", "mlp.c_fc")]
    assert group_layers(d2, MAX_ROWS)[:2] == (d2, [[i] for i in range(6)])
    flat = [f"proj_{chr(97 + i // 26)}{chr(97 + i % 26)}" for i in range(100)]  # no numbered blocks
    labels, members, _ = group_layers(flat, MAX_ROWS)
    assert len(labels) <= MAX_ROWS
    assert [i for m in members for i in m] == list(range(100))  # consecutive runs, in order
    assert all(len(m) == 3 for m in members[:-1])


def test_health_map_cell_is_the_worst_layer_of_its_row():
    records = _llama_records(steps=(30, 10, 20))  # out of order in the file: columns sorted by step
    records[1]["fp8_stats"]["model.layers.0.mlp.up_proj"]["grad_output"]["underflow_pct"] = None  # written as null
    for b in range(6):  # a whole row not measured at one step: grey
        del records[2]["fp8_stats"][f"model.layers.{b}.self_attn.q_proj"]
    h = health_map(records, MAX_ROWS)
    assert h.steps == [10, 20, 30]
    assert list(h.values) == ["input", "weight", "grad_output"]
    _, members, _ = group_layers(LLAMA, MAX_ROWS)
    by_step = {r["step"]: r["fp8_stats"] for r in records}
    for role in h.values:
        for stat, image in h.values[role].items():
            assert image.shape == (42, 3)
            for row, m in enumerate(members):
                for col, step in enumerate(h.steps):
                    got = [by_step[step][LLAMA[i]][role][stat] for i in m if LLAMA[i] in by_step[step]]
                    got = [v for v in got if v is not None]
                    want = max(got) if got else math.nan
                    assert image[row, col] == want or (math.isnan(want) and math.isnan(image[row, col]))
    assert np.isnan(h.values["input"]["underflow_pct"][0, 1])  # q_proj of blocks 0-5 at step 20


def test_read_metrics_skips_malformed_lines_with_one_warning(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 5.0, "mfu": null}\n'
                    "not json\n"
                    "[1, 2]\n"
                    '{"step": 2, "loss": NaN, "val_bpb": 3.5}\n'
                    "\n"
                    '{"step": 3, "lo')  # cut by a kill
    records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["mfu"] is None and math.isnan(records[1]["loss"])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "skipped 3 malformed line(s), first line 2" in warnings[0], warnings


def test_series_and_tokens_axis_of_a_real_run(fp8_run):
    records = run_records(fp8_run)
    run = read_run(fp8_run)
    tokens = 8 * 32 * 1 * 1  # tiny_train_kwargs: batch_size 8, seq_len 32; one process, no accumulation
    assert run.tokens_per_step == tokens
    assert run.x_label.startswith(f"tokens ({tokens:,} per step = batch_size 8 x seq_len 32")
    steps = [r for r in records if "loss" in r]
    x, loss = run.series("loss")
    assert x.tolist() == [r["step"] * tokens for r in steps] and loss.tolist() == [r["loss"] for r in steps]
    vx, bpb = run.series("val_bpb")
    assert vx.tolist() == [3 * tokens, 6 * tokens]
    assert bpb.tolist() == [r["val_bpb"] for r in records if "val_bpb" in r]
    assert run.health.steps == [2, 4, 6]
    assert run.health.rows == json.loads((fp8_run / "result.json").read_text())["fp8_converted"]


def test_tokens_per_step_of_a_distributed_run_from_its_dcp_meta(tmp_path):
    """A DCP checkpoint's trainer.json as checkpoint.save_dcp writes it (config, world size and the
    data-parallel ranks; an older checkpoint has only the world size)."""
    run_dir = _write(tmp_path / "ddp", [{"step": 1, "loss": 5.0}])
    step_dir = run_dir / "checkpoint_dcp" / "step-000008"
    step_dir.mkdir(parents=True)
    (step_dir / "manifest.json").write_text("{}")  # what marks the step directory committed
    config = {"batch_size": 4, "seq_len": 128, "grad_accum_steps": 2, "model_name": "d2"}
    (step_dir / "trainer.json").write_text(json.dumps({"config": config, "world_size": 8, "step": 8}))
    assert read_tokens_per_step(run_dir) == (4 * 128 * 2 * 8,
                                             "batch_size 4 x seq_len 128 x grad_accum_steps 2 x data-parallel ranks 8")
    # --tp 2 on 8 ranks: 4 groups read the data, each pair the same batches
    (step_dir / "trainer.json").write_text(json.dumps({"config": config, "world_size": 8, "data_parallel": 4,
                                                       "step": 8}))
    assert read_tokens_per_step(run_dir)[0] == 4 * 128 * 2 * 4


def test_plot_run_draws_a_real_fp8_run(fp8_run):
    out = plot_run(fp8_run)
    assert out == fp8_run / "run.png"
    with Image.open(out) as image:
        assert image.format == "PNG" and image.width >= 1200 and image.height >= 900
        assert image.text["Software"] == SOFTWARE
    first = out.read_bytes()
    assert plot_run(fp8_run) == out  # its own picture is redrawn without --overwrite
    assert out.read_bytes() == first  # and comes out the same

    fig = draw(read_run(fp8_run))
    titles = _titles(fig)
    assert titles[:4] == CURVES
    assert titles[4:] == [f"{role}: {stat} %" for stat in ("underflow", "saturation")
                          for role in ("input", "weight", "grad_output")]
    mfu = next(ax for ax in fig.get_axes() if ax.get_title() == CURVES[3])
    assert [t.get_text() for t in mfu.texts] == ["MFU unknown (CPU, or not recorded)"]  # a CPU run


def test_a_run_without_fp8_draws_the_curves_only(tmp_path):
    records = [{"step": s, "loss": 5.0 - s / 10, "tokens_per_sec": 1000.0 + s, "mfu": 0.25 + s / 100}
               for s in range(1, 7)]
    records[3] = {"step": 4, "loss": None, "skipped": True, "nonfinite_at": "transformer.h.0.mlp.c_fc"}
    records[5].update(val_loss=4.5, val_bpb=3.1)
    run_dir = _write(tmp_path / "plain", records + [{"event": "fp8_summary", "layers": {}}])
    fig = draw(read_run(run_dir))
    assert _titles(fig) == CURVES
    axes = {ax.get_title(): ax for ax in fig.get_axes()}
    x, mfu = axes[CURVES[3]].get_lines()[0].get_data()
    assert list(x) == [1, 2, 3, 5, 6] and list(mfu) == [100 * r["mfu"] for r in records if "mfu" in r]
    assert axes[CURVES[3]].get_xlabel().startswith("optimizer step (tokens unknown: no checkpoint")
    skipped = [line for line in axes[CURVES[0]].get_lines() if line.get_label() == "skipped step (non-finite)"]
    assert len(skipped) == 1 and list(skipped[0].get_xdata()) == [4, 4]
    assert plot_run(run_dir, tmp_path / "plain.png").stat().st_size > 10_000


def test_plot_run_renders_a_llama3_8b_health_map(tmp_path):
    run_dir = _write(tmp_path / "llama", _llama_records())
    out = plot_run(run_dir, tokens_per_step=8 * 8192)
    with Image.open(out) as image:
        assert image.format == "PNG" and image.height >= 1500  # 42 labelled rows per panel
    fig = draw(read_run(run_dir))
    heatmap = next(ax for ax in fig.get_axes() if ax.get_title() == "grad_output: underflow %")
    left = next(ax for ax in fig.get_axes() if ax.get_title() == "input: underflow %")
    assert [t.get_text() for t in left.get_yticklabels()][:2] == ["0-5.self_attn.q_proj", "0-5.self_attn.k_proj"]
    assert len(left.get_yticklabels()) == 42 and left.get_ylabel() == "layer (model.layers.*)"
    assert heatmap.collections[0].get_array().shape == (42, 3)
    assert any("224 layers in 42 rows" in sub.get_suptitle() for sub in fig.subfigs)


def test_errors_are_one_line_and_exit_2(fp8_run, tmp_path, capsys, monkeypatch):
    code, errors = _cli(capsys, str(tmp_path / "missing"))
    assert code == 2 and len(errors) == 1 and "does not exist" in errors[0]
    (tmp_path / "empty").mkdir()
    code, errors = _cli(capsys, str(tmp_path / "empty"))
    assert code == 2 and len(errors) == 1 and "no metrics.jsonl" in errors[0]
    _write(tmp_path / "events", [{"event": "fp8_auto_choices", "choices": {}}])
    code, errors = _cli(capsys, str(tmp_path / "events"))
    assert code == 2 and len(errors) == 1 and "no step with a loss" in errors[0]

    with pytest.raises(SystemExit) as e:  # tyro's parse errors exit by themselves
        _script().main([str(fp8_run), "--max_rows", "0"])
    assert e.value.code == 2 and "--max_rows must be positive" in capsys.readouterr().err

    foreign = tmp_path / "mine.png"
    foreign.write_bytes(b"a file plot_run did not write")
    code, errors = _cli(capsys, str(fp8_run), "--out", str(foreign))
    assert code == 2 and len(errors) == 1 and "--overwrite" in errors[0]
    assert foreign.read_bytes() == b"a file plot_run did not write"
    assert _cli(capsys, str(fp8_run), "--out", str(foreign), "--overwrite") == (0, [])
    with Image.open(foreign) as image:
        assert image.format == "PNG"

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: import fails
    code, errors = _cli(capsys, str(fp8_run), "--out", str(tmp_path / "new.png"))
    assert code == 2 and len(errors) == 1 and INSTALL in errors[0]
    assert not (tmp_path / "new.png").exists()
    with pytest.raises(UsageError, match="matplotlib"):
        plot_run(fp8_run, tmp_path / "new.png")


def test_a_training_run_with_plot_draws_its_picture_and_refuses_a_foreign_one_first(small_corpus, tmp_path):
    """--plot: the run ends with <run_dir>/run.png, plot_run's picture of it (the same bytes as
    plot_run draws from the run's files afterwards). A run.png plot_run did not draw is refused
    before any work: the run directory is left as it was, the file untouched."""
    kw = tiny_train_kwargs(small_corpus, tmp_path / "run", num_iterations=4, eval_every=2, num_samples=0, plot=True)
    result = NanoChatTrainer(**kw).train()
    png = tmp_path / "run" / "run.png"
    with Image.open(png) as image:
        assert image.format == "PNG" and image.text["Software"] == SOFTWARE
    assert not any("--plot" in f for f in result.fallbacks)
    drawn = png.read_bytes()
    assert plot_run(tmp_path / "run", tokens_per_step=8 * 32).read_bytes() == drawn

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "run.png").write_bytes(b"someone's picture")
    with pytest.raises(UsageError, match=r"run.png exists and plot_run did not draw it; move it away, or drop --plot"):
        NanoChatTrainer(**{**kw, "run_dir": str(foreign)}).train()
    assert sorted(p.name for p in foreign.iterdir() if not p.name.startswith(".")) == ["run.png"]
    assert (foreign / "run.png").read_bytes() == b"someone's picture"
