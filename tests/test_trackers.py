"""nanochat.report.trackers: TensorBoard and W&B fed the records of metrics.jsonl, read back with each
tool's own reader and compared with the records themselves.

- a real tiny FP8 run (emulated, auto formats, statistics and validation steps, one step skipped
  for a non-finite loss) replayed into the trackers: every scalar of every record is in
  TensorBoard's event files (read with tensorboard's EventAccumulator) and in the W&B offline
  run (its .wandb file decoded with W&B's own protobuf schema) under the documented names, at its
  step; the FP8 per-layer series per role and statistic, with the worst (numpy) and the mean over
  layers; the events as texts (an auto switch's as describe_switch prints it); the config as
  hyperparameters (TensorBoard's HPARAMS plugin data); result.json's figures as the final summary;
- the names of a Llama-3-8B's 224 FP8 layers: nine sections of 224 charts, built by hand; they
  are nanochat.fp8.health's, which FP8Trainer logs too (without the per-layer ones between its
  `log_layers_every` samples); its five worst layers per statistic are numpy's sort's, an exact
  SQNR (infinite) is left out;
- resume: a real run wired to the trackers, killed after logging two steps past its checkpoint,
  then resumed: TensorBoard holds each step once, equal to metrics.jsonl, and W&B's second run
  has the first one's id; replayed, the steps logged after the checkpoint show the resumed run's
  values; a fresh start over a replaced run shows only its own steps and gets a new W&B id; W&B
  does not send the steps its run already holds; a restart from step 0 (--auto_resume before the
  first checkpoint) keeps the W&B id and shows each step once in TensorBoard;
- a tracker failing mid-run (ENOSPC) warns once, is recorded in `fallbacks`, and the other
  tracker still gets every record; one that cannot start is one error line before any step;
- a tracker whose package does not import is a one-line UsageError with the install command;
  ranks other than 0 write nothing.
Tolerances: TensorBoard stores scalars as float32, so a value read back equals the record's value
rounded to float32 (exactly: the same conversion); W&B stores JSON numbers, equal exactly. The
mean over layers is summed in forward order on both sides (the same code, so equal to the bit),
and against numpy's pairwise sum within 1e-12 relative (224 terms of float64 rounding).
"""
import errno
import json
import logging
import os
import signal
import struct
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from nanochat.common import NanoChatError, UsageError
from nanochat.fp8.health import fp8_health, worst_layers
from nanochat.fp8.training import describe_switch
from nanochat.report.plot import read_metrics
from nanochat.report.trackers import TENSORBOARD_DIR, WANDB_ID_FILE, Trackers, check_trackers, translate
from nanochat.train.metrics import MetricsLog
from nanochat.train.stop import Stopped
from nanochat.train.trainer import NanoChatTrainer
from tests.conftest import tiny_train_kwargs

pytest.importorskip("tensorboard")  # the `tensorboard` extra (and `dev`)
wandb = pytest.importorskip("wandb")  # the `wandb` extra (and `dev`)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from wandb.proto import wandb_internal_pb2  # noqa: E402

# metrics.jsonl's step fields and the names the trackers give them (module docstring)
NAMES = {"loss": "train/loss", "lr": "train/lr", "lrm": "train/lrm", "grad_norm": "train/grad_norm",
         "tokens_per_sec": "train/tokens_per_sec", "mfu": "train/mfu", "val_loss": "val/loss", "val_bpb": "val/bpb",
         "val_accuracy": "val/accuracy", "clip_factor": "events/clip_factor",
         "update_rms_muon": "train/update_rms_muon", "update_rms_adamw": "train/update_rms_adamw", "update_rms_adamw_no_decay": "train/update_rms_adamw_no_decay"}
FLAGS = {"skipped": "events/skipped", "calibrating": "fp8/calibrating"}  # true -> 1
ROLES = ("input", "weight", "grad_output")
STATS = {"underflow_pct": np.max, "saturation_pct": np.max, "sqnr_db": np.min}
CONFIG = {"model_name": "d2", "lr": 0.01, "fp8": True, "fp8_skip": ["lm_head"], "dataset_path": None}


class OneNaNStep(NanoChatTrainer):
    """The loss of step 6 is NaN: the step is skipped and the run goes on."""

    def _verdict(self, step, loss, votes, batch):
        return super()._verdict(step, loss * float("nan") if step == 5 else loss, votes, batch)


@pytest.fixture(scope="module")
def fp8_run(small_corpus, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("trackers") / "fp8"
    OneNaNStep(**tiny_train_kwargs(small_corpus, run_dir, num_iterations=9, fp8=True, fp8_emulate=True,
                                   fp8_layers="all", fp8_mode="auto", fp8_auto_steps=2, fp8_auto_recheck_every=4,
                                   fp8_stats_every=4, eval_every=3, grad_clip=0.5, num_samples=0)).train()
    return run_dir


@pytest.fixture(scope="module")
def records(fp8_run) -> list[dict]:
    recs = read_metrics(fp8_run / "metrics.jsonl")
    kinds = {r.get("event") for r in recs}
    # the run holds what the trackers must show: statistics, validation, a skipped step, events
    assert any("fp8_stats" in r for r in recs) and any("val_bpb" in r for r in recs), recs
    assert any(r.get("skipped") for r in recs) and {"fp8_auto_choices", "fp8_summary", "guard_summary"} <= kinds, kinds
    return recs


@pytest.fixture(autouse=True)
def _wandb_offline(tmp_path_factory, monkeypatch):
    """W&B offline and kept away from the user's settings (its own environment variables)."""
    home = tmp_path_factory.mktemp("wandb-home")
    for var, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
                       "WANDB_CONFIG_DIR": home / "config", "WANDB_CACHE_DIR": home / "cache",
                       "WANDB_DATA_DIR": home / "data"}.items():
        monkeypatch.setenv(var, str(value))
    for var in ("WANDB_PROJECT", "WANDB_NAME", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)


def _replay(log, run_dir, recs, result=None, **kw) -> Trackers:
    trackers = Trackers(log, run_dir, CONFIG, **kw)
    for rec in recs:
        trackers.record(rec)
    if result is not None:
        trackers.record_result(result)
    trackers.close()
    return trackers


def _tensorboard(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir / TENSORBOARD_DIR), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _tb_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = _tensorboard(run_dir)
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _tb_texts(run_dir: Path) -> dict[str, list[tuple[int, str]]]:
    acc = _tensorboard(run_dir)
    return {tag.removesuffix("/text_summary"): [(e.step, e.tensor_proto.string_val[0].decode())
                                                for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"] if tag.endswith("/text_summary")}


def _f32(v: float) -> float:
    return float(np.float32(v))


def _expected(recs: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """The series each step record gives, built from the documented names (not by the module)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in (r for r in recs if "event" not in r):
        for key, name in NAMES.items():
            if isinstance(r.get(key), (int, float)):
                out.setdefault(name, []).append((r["step"], r[key]))
        for key, name in FLAGS.items():
            if r.get(key):
                out.setdefault(name, []).append((r["step"], 1.0))
        for layer, roles in (r.get("fp8_stats") or {}).items():
            for role, stats in roles.items():
                for stat in STATS:
                    if stats.get(stat) is not None:
                        out.setdefault(f"fp8_{role}_{stat}/{layer}", []).append((r["step"], stats[stat]))
        for role in ROLES:
            for stat, worst in STATS.items():
                values = [roles[role][stat] for roles in (r.get("fp8_stats") or {}).values()
                          if roles.get(role, {}).get(stat) is not None]
                if values:  # the mean summed in forward order: the module's order, so equal to the bit
                    out.setdefault(f"fp8/{role}_{stat}_worst", []).append((r["step"], float(worst(values))))
                    out.setdefault(f"fp8/{role}_{stat}_mean", []).append((r["step"], sum(values) / len(values)))
    return out


def test_tensorboard_holds_every_scalar_of_a_real_fp8_run(fp8_run, records, tmp_path):
    numeric = {k for r in records if "event" not in r for k, v in r.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)} - {"step"}
    assert numeric <= set(NAMES), f"fields without a documented name: {numeric - set(NAMES)}"
    result = json.loads((fp8_run / "result.json").read_text())
    trackers = _replay(("jsonl", "tensorboard"), tmp_path, records, result)
    assert trackers.fallbacks == []
    got = _tb_scalars(tmp_path)
    expected = _expected(records)
    layers = {k for k in expected if k.startswith("fp8_")}
    assert len(layers) == 12 * 3 * 3  # d2: 12 FP8 Linears x 3 roles x 3 statistics
    for name, series in expected.items():
        assert got.get(name) == [(s, _f32(v)) for s, v in series], name
    skipped = [r["step"] for r in records if r.get("skipped")]
    assert [s for s, _ in got["events/skipped"]] == skipped and skipped
    # result.json as the final figures, at the last step
    last = max(r["step"] for r in records if "step" in r)
    for key in ("val_bpb", "val_loss", "train_loss", "tokens_per_sec", "steps", "num_params"):
        assert got[f"final/{key}"] == [(last, _f32(result[key]))], key
    # the step guard's counters, which survive a resume, as events; FP8's summary has none of them
    summary = [r for r in records if r.get("event") == "guard_summary"][-1]
    assert got["events/skipped_steps"][-1][1] == summary["skipped_steps"] == len(skipped)
    assert got["events/clip_events"][-1][1] == summary["clip_events"] == sum("clip_factor" in r for r in records)
    fp8_summary = [r for r in records if r.get("event") == "fp8_summary"][-1]
    assert got["events/stats_samples"][-1][1] == fp8_summary["stats_samples"] and "skipped_steps" not in fp8_summary

    texts = _tb_texts(tmp_path)
    (step, nonfinite), = texts["events/nonfinite"]
    assert step == skipped[0] and f"step {step}: non-finite, update skipped" in nonfinite
    choices = next(r["choices"] for r in records if r.get("event") == "fp8_auto_choices")
    table = texts["events/fp8_auto_choices"][0][1]
    for layer, roles in choices.items():
        assert f"| {layer} | {roles['input']} | {roles['weight']} | {roles['grad_output']} |" in table
    assert texts["events/guard_summary"][-1][1].startswith(f"step guard (end of training): "
                                                            f"{summary['overflow_events']} overflow events")
    assert texts["events/fp8_summary"][-1][1].startswith(f"fp8 summary (end of training): "
                                                          f"{fp8_summary['stats_samples']} stats samples")
    assert "| fp8_skip | [\"lm_head\"] |" in texts["config"][0][1] and texts["config"][0][0] == 0
    # the config in the HPARAMS tab, read with the plugin's own schema
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = _tensorboard(tmp_path).PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["model_name"].string_value == "d2" and start.hparams["lr"].number_value == 0.01
    assert start.hparams["fp8"].string_value == "true" and start.hparams["dataset_path"].string_value == "null"


def test_fp8_names_of_a_llama3_8b_stay_in_nine_sections_of_224():
    kinds = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj"]
    layers = [f"model.layers.{b}.{k}" for b in range(32) for k in kinds]
    rng = np.random.default_rng(0)
    stats = {n: {role: {"underflow_pct": float(rng.uniform(0, 50)), "saturation_pct": float(rng.uniform(0, 1)),
                        "sqnr_db": float(rng.uniform(10, 40)), "amax": 1.0, "dtype": "e4m3"} for role in ROLES}
             for n in layers}
    scalars, texts = translate({"step": 10, "loss": 2.0, "fp8_stats": stats})
    sections: dict[str, list[str]] = {}
    for name in scalars:
        section, _, rest = name.partition("/")
        sections.setdefault(section, []).append(rest)
    want = {f"fp8_{role}_{stat}": layers for role in ROLES for stat in STATS}
    assert {s: v for s, v in sections.items() if s.startswith("fp8_")} == want  # forward order kept
    assert sorted(sections["fp8"]) == sorted(f"{role}_{stat}_{how}" for role in ROLES for stat in STATS
                                             for how in ("worst", "mean"))
    for role in ROLES:
        for stat, worst in STATS.items():
            values = np.array([stats[n][role][stat] for n in layers])
            assert scalars[f"fp8/{role}_{stat}_worst"] == worst(values)
            assert scalars[f"fp8/{role}_{stat}_mean"] == pytest.approx(values.mean(), rel=1e-12)  # summation order
    assert scalars["train/loss"] == 2.0 and texts == {}
    # the same names wherever FP8 health is logged (FP8Trainer: per layer only every few samples)
    assert fp8_health(stats) == {k: v for k, v in scalars.items() if k.startswith("fp8")}
    assert fp8_health(stats, layers=False) == {k: v for k, v in scalars.items() if k.startswith("fp8/")}
    under = np.array([[stats[n][r]["underflow_pct"] for r in ROLES] for n in layers])
    top = np.argsort(-under, axis=None, kind="stable")[:5]
    assert worst_layers(stats, "underflow_pct") == [[layers[i // 3], ROLES[i % 3], under.flat[i]] for i in top]
    stats[layers[0]]["weight"]["sqnr_db"] = float("inf")  # an exact cast
    assert f"fp8_weight_sqnr_db/{layers[0]}" not in fp8_health(stats)
    lowest = min(v["sqnr_db"] for roles in stats.values() for v in roles.values())
    assert worst_layers(stats, "sqnr_db", n=1)[0][2] == lowest


def test_events_are_texts_at_their_step(tmp_path):
    """Events the fixture's run did not produce: an auto re-check's switch (at its own step: it
    comes before that step's record), a partial skip under --optimizer_in_backward, an event
    this module does not know (its JSON, at the last step logged)."""
    switch = {"event": "fp8_auto_switch", "layer": "transformer.h.0.attn.c_q", "role": "grad_output",
              "from": "e4m3", "to": "e5m2", "step": 8,
              "measured": {"e4m3": {"sqnr_db": 18.5, "underflow_pct": 3.25},
                           "e5m2": {"sqnr_db": 25.0, "underflow_pct": 0.0}}}
    partial = {"step": 8, "loss": 3.0, "lr": 1e-3, "grad_norm": 1.5, "skipped_params": 2,
               "skipped_param_names": ["lm_head.weight", "transformer.wte.weight"]}
    other = {"event": "data_epoch", "epoch": 2, "note": "reshuffled"}
    _replay(("tensorboard",), tmp_path, [{"step": 7, "loss": 3.1}, switch, partial, other])
    texts = _tb_texts(tmp_path)
    assert texts["events/fp8_auto_switch"] == [(8, f"step 8: {describe_switch(switch)}")]  # as the run prints it
    assert texts["events/nonfinite"] == [(8, "step 8: 2 parameter(s) with a non-finite gradient kept their values: "
                                             "lm_head.weight, transformer.wte.weight")]
    assert texts["events/data_epoch"] == [(8, "```\n" + json.dumps(other, indent=1) + "\n```")]
    scalars = _tb_scalars(tmp_path)
    assert scalars["events/skipped_params"] == [(8, 2.0)] and scalars["events/epoch"] == [(8, 2.0)]
    assert "events/skipped" not in scalars  # the step itself was taken


def _next_second() -> None:
    """TensorBoard reads a run's event files in name order, and W&B names an offline run's
    directory, by their creation second: two runs of one directory start in different seconds,
    as two processes do."""
    time.sleep(1.01 - time.time() % 1)


def test_resume_continues_the_tensorboard_run_without_duplicate_steps(records, tmp_path):
    steps = [r for r in records if "event" not in r]
    checkpoint, died = 3, 7  # the interrupted run logged steps 4..7 after its step-3 checkpoint
    # the interrupted run's values after the checkpoint are marked, to see which ones survive
    first = [{**r, "loss": r["loss"] + 100} if r["step"] > checkpoint and r.get("loss") is not None else r
             for r in steps if r["step"] <= died]
    _replay(("tensorboard",), tmp_path, first)
    _next_second()
    _replay(("tensorboard",), tmp_path, [r for r in steps if r["step"] > checkpoint], start_step=checkpoint)
    got = _tb_scalars(tmp_path)
    assert got["train/loss"] == [(r["step"], _f32(r["loss"])) for r in steps if r.get("loss") is not None]
    val = [(r["step"], _f32(r["val_bpb"])) for r in steps if "val_bpb" in r]
    assert got["val/bpb"] == val and len(val) == 2  # steps 3 and 9 (step 6 was skipped)


def test_a_real_run_killed_after_its_checkpoint_and_resumed_logs_each_step_once(small_corpus, tmp_path, monkeypatch):
    """`--log tensorboard wandb` on a run that dies right after logging step 6 (checkpoint at 4)
    and is resumed: TensorBoard shows each step once, with metrics.jsonl's values; W&B continues
    the same run id."""
    kw = tiny_train_kwargs(small_corpus, tmp_path, num_iterations=8, save_every=4, eval_every=4, num_samples=0,
                           log=("jsonl", "tensorboard", "wandb"))
    real_log = MetricsLog.log

    def dies_after_step_6(self, record):
        real_log(self, record)
        if record.get("step") == 6:
            raise KeyboardInterrupt  # steps 5 and 6 are logged again by the resumed run

    monkeypatch.setattr(MetricsLog, "log", dies_after_step_6)
    with pytest.raises(KeyboardInterrupt):
        NanoChatTrainer(**kw).train()  # train() closes the trackers on its way out: every event written
    monkeypatch.setattr(MetricsLog, "log", real_log)
    _next_second()
    NanoChatTrainer(**{**kw, "resume": True}).train()
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]  # each step once (trainer's)
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert _tb_scalars(tmp_path)["train/loss"] == [(r["step"], _f32(r["loss"])) for r in steps]
    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()
    first, second = _wandb_run(tmp_path, run_id, 0), _wandb_run(tmp_path, run_id, 1)
    assert first["id"] == second["id"] == run_id
    assert sorted(first["history"]) == list(range(1, 7)) and sorted(second["history"]) == [5, 6, 7, 8]
    assert (first["exit_code"], first["preempting"]) == (1, False)  # died: W&B shows it failed
    assert (second["exit_code"], second["preempting"]) == (0, False)


def test_a_run_stopped_by_sigterm_is_preempted_in_wandb_and_its_resume_finishes_it(small_corpus, tmp_path, monkeypatch):
    """SIGTERM (a scheduler's preemption) stops a run after a step with a checkpoint: W&B gets
    its preempting record and exit code 143, the state a run that will resume is in, not failed;
    the resumed run continues the same W&B run and finishes with 0."""
    kw = tiny_train_kwargs(small_corpus, tmp_path, num_iterations=6, save_every=10, eval_every=10, num_samples=0,
                           log=("jsonl", "wandb"))
    real_log = MetricsLog.log

    def sigterm_at_step_3(self, record):
        real_log(self, record)
        if record.get("step") == 3 and "loss" in record:
            os.kill(os.getpid(), signal.SIGTERM)  # handled after this step: a checkpoint, then Stopped

    monkeypatch.setattr(MetricsLog, "log", sigterm_at_step_3)
    with pytest.raises(Stopped) as stopped:
        NanoChatTrainer(**kw).train()
    assert stopped.value.code == 128 + signal.SIGTERM
    monkeypatch.setattr(MetricsLog, "log", real_log)
    _next_second()
    NanoChatTrainer(**{**kw, "resume": True}).train()
    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()
    first, second = _wandb_run(tmp_path, run_id, 0), _wandb_run(tmp_path, run_id, 1)
    assert (first["exit_code"], first["preempting"]) == (143, True)
    assert (second["exit_code"], second["preempting"]) == (0, False)
    assert sorted(first["history"]) == [1, 2, 3] and sorted(second["history"]) == [4, 5, 6]


def test_a_fresh_start_over_a_replaced_run_shows_only_its_own_steps(records, tmp_path):
    steps = [r for r in records if "event" not in r]
    _replay(("tensorboard",), tmp_path, steps)
    _next_second()
    _replay(("tensorboard",), tmp_path, steps[:3])  # --overwrite: a new run, 3 steps so far
    assert _tb_scalars(tmp_path)["train/loss"] == [(r["step"], _f32(r["loss"])) for r in steps[:3]]
    assert len(list((tmp_path / TENSORBOARD_DIR).iterdir())) == 2  # the replaced run's file is kept, hidden


def test_a_restart_from_step_0_continues_both_trackers_runs(records, tmp_path):
    """--auto_resume over a run that died before its first checkpoint starts again from step 0
    (`continuing`): the same W&B run id, and TensorBoard shows each step once, the restart's."""
    steps = [r for r in records if "event" not in r]
    first = [{**r, "loss": r["loss"] + 100} if r.get("loss") is not None else r for r in steps[:3]]
    _replay(("tensorboard", "wandb"), tmp_path, first)
    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()
    _next_second()
    _replay(("tensorboard", "wandb"), tmp_path, steps, continuing=True)
    assert (tmp_path / WANDB_ID_FILE).read_text().strip() == run_id
    assert _wandb_run(tmp_path, run_id, nth=1)["id"] == run_id
    assert _tb_scalars(tmp_path)["train/loss"] == [(r["step"], _f32(r["loss"])) for r in steps if r.get("loss") is not None]


def _wandb_records(path: Path):
    """The protobuf records of a .wandb file: W&B's header (":W&B", magic 0xBEE1, version 0),
    then LevelDB's log format: 32 KiB blocks of chunks, each with a 7-byte header (crc32,
    length, type: 1 whole, 2 first, 3 middle, 4 last); a block's tail under 7 bytes is padding."""
    data, block = path.read_bytes(), 32768
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):  # a chunk still being written
            return
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _wandb_run(run_dir: Path, run_id: str, nth: int = 0) -> dict:
    """The `nth` offline run of `run_id` in `run_dir`: its id, config, history rows by step
    (W&B's own keys `_step`, `_runtime`, `_timestamp` left out) and final summary."""
    files = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    # W&B's service process writes the file; finish() can return before the last records are on
    # disk, so the file is read once it holds the run's `exit` record (its last)
    for _ in range(600):
        records = list(_wandb_records(files[nth]))
        if any(rec.WhichOneof("record_type") == "exit" for rec in records):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"{files[nth]} has no exit record: W&B did not finish writing it within a minute")
    out = {"id": None, "config": {}, "history": {}, "summary": {}, "exit_code": None, "preempting": False}
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "exit":
            out["exit_code"] = rec.exit.exit_code
        elif kind == "preempting":
            out["preempting"] = True
        elif kind == "run":
            out["id"] = rec.run.run_id
            out["config"] = {i.key: json.loads(i.value_json) for i in rec.run.config.update if i.key != "_wandb"}
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            out["history"][rec.history.step.num] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif kind == "summary":
            out["summary"].update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                   for i in rec.summary.update})
    return out


def test_wandb_offline_run_holds_every_record_and_a_resume_keeps_its_id(fp8_run, records, tmp_path):
    result = json.loads((fp8_run / "result.json").read_text())
    (tmp_path / WANDB_ID_FILE).write_text("replaced1\n")  # a replaced run's (--overwrite): a new run starts
    trackers = _replay(("jsonl", "wandb"), tmp_path, records, result)
    assert trackers.fallbacks == []
    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()
    assert run_id != "replaced1" and not list((tmp_path / "wandb").glob("*replaced1*"))
    run = _wandb_run(tmp_path, run_id)
    assert run["id"] == run_id and run["config"] == CONFIG
    for name, series in _expected(records).items():
        assert [(s, run["history"][s].get(name)) for s, _ in series] == series, name
    last = max(r["step"] for r in records if "step" in r)
    assert run["summary"]["final/val_bpb"] == result["val_bpb"] and run["summary"]["final/steps"] == last
    skipped = next(r["step"] for r in records if r.get("skipped"))
    assert run["history"][skipped]["events/nonfinite"].startswith(f"step {skipped}: non-finite")

    # a resume from step 4 continues the run whose id the directory keeps
    _next_second()
    steps = [r for r in records if "event" not in r and r["step"] > 4]
    _replay(("wandb",), tmp_path, steps, start_step=4)
    resumed = _wandb_run(tmp_path, run_id, nth=1)
    assert resumed["id"] == run_id and sorted(resumed["history"]) == [r["step"] for r in steps]


def test_wandb_does_not_resend_steps_its_run_already_holds(records, tmp_path, monkeypatch, caplog):
    """W&B drops a step below its current one; a resumed online run's current step is the step
    after the last it holds (the server's answer, given here: offline runs start at 0)."""
    steps = [r for r in records if "event" not in r]
    holds = 6
    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "step", property(lambda self: holds + 1))
    with caplog.at_level(logging.INFO, logger="nanochat"):
        _replay(("wandb",), tmp_path, steps, start_step=3)
    run = _wandb_run(tmp_path, (tmp_path / WANDB_ID_FILE).read_text().strip())
    assert sorted(run["history"]) == [r["step"] for r in steps if r["step"] > holds]
    told = [m for m in caplog.messages if "already holds steps up to" in m]
    assert told == [f"--log wandb: run {run['id']} already holds steps up to {holds}; they are kept, not sent again"]


@pytest.mark.parametrize("failing", ["tensorboard", "wandb"])
def test_a_tracker_failing_mid_run_warns_once_and_the_other_gets_everything(records, tmp_path, monkeypatch,
                                                                             caplog, failing):
    from torch.utils.tensorboard import SummaryWriter

    calls = {"n": 0}

    def full_disk(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    owner, method = (SummaryWriter, "add_scalar") if failing == "tensorboard" else (wandb.sdk.wandb_run.Run, "log")
    real = getattr(owner, method)
    monkeypatch.setattr(owner, method, lambda self, *a, **k: full_disk(self, *a, **k))
    with caplog.at_level(logging.WARNING, logger="nanochat"):
        trackers = _replay(("tensorboard", "wandb"), tmp_path, records)  # no exception reaches the run
    warnings = [m for m in caplog.messages if m.startswith("WARNING: --log")]
    assert len(warnings) == 1 and trackers.fallbacks == [warnings[0].removeprefix("WARNING: ")]
    assert (f"--log {failing}: logging failed at step " in warnings[0] and "No space left on device" in warnings[0]
            and "metrics.jsonl and checkpoints go on" in warnings[0]), warnings
    loss = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    if failing == "tensorboard":  # W&B got every record
        run = _wandb_run(tmp_path, (tmp_path / WANDB_ID_FILE).read_text().strip())
        assert [(s, run["history"][s].get("train/loss")) for s, _ in loss] == loss
    else:
        assert _tb_scalars(tmp_path)["train/loss"] == [(s, _f32(v)) for s, v in loss]


def test_a_tracker_that_cannot_start_is_one_error_before_any_step(tmp_path, monkeypatch):
    def no_login(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty).\ncall wandb.login(key=[your_api_key])")

    monkeypatch.setattr(wandb, "init", no_login)
    with pytest.raises(NanoChatError) as e:
        Trackers(("tensorboard", "wandb"), tmp_path, CONFIG)
    message = str(e.value)
    assert "\n" not in message and "api_key not configured" in message and "WANDB_MODE=offline" in message
    assert not (tmp_path / WANDB_ID_FILE).exists()


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_a_tracker_that_is_not_installed_is_one_line_with_the_install_command(monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # what `import name` sees when it is not installed
    with pytest.raises(UsageError) as e:
        check_trackers(("jsonl", name))
    assert "\n" not in str(e.value) and str(e.value).endswith(f"install it with: pip install -e '.[{name}]'")
    check_trackers(("jsonl",))  # metrics.jsonl needs neither
    with pytest.raises(UsageError, match="--log 'csv' is not a tracker nanochat knows; give any of jsonl, "
                                         "tensorboard, wandb"):
        check_trackers(("csv",))


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_a_run_asking_for_a_tracker_that_is_not_installed_stops_before_any_work(small_corpus, tmp_path, monkeypatch,
                                                                               name):
    monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(UsageError, match=rf"pip install -e '\.\[{name}\]'"):
        NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "run", log=("jsonl", name))).train()
    assert not (tmp_path / "run").exists()  # refused before the run directory is made


def test_ranks_other_than_0_write_nothing(records, tmp_path):
    trackers = _replay(("tensorboard", "wandb"), tmp_path, records, rank=1)
    assert list(tmp_path.iterdir()) == [] and trackers.fallbacks == []
