"""CLI parsing of TrainConfig / TokTrainConfig (tyro), checked against the documented flags.

What a user relies on: both spellings of every flag (`--fp8_mode` and `--fp8-mode`), `-f` for
`--fp8` and `--no-fp8` to turn it off, and exit status 2 with a message naming the fix for a
bad value — including rules tyro cannot see (`--fp8_opt_level` without `--fp8`).
"""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from nanochat.config import TokTrainConfig, TrainConfig, parse_cli

ROOT = Path(__file__).resolve().parents[1]


def test_both_spellings_and_aliases():
    a = parse_cli(TrainConfig, ["--fp8", "--fp8_mode", "e5m2", "--fp8_opt_level", "2", "--model_name", "d2"])
    b = parse_cli(TrainConfig, ["-f", "--fp8-mode", "e5m2", "--fp8-opt-level", "2", "--model-name", "d2"])
    assert a == b
    assert (a.fp8, a.fp8_mode, a.fp8_opt_level, a.model_name) == (True, "e5m2", 2, "d2")
    assert parse_cli(TrainConfig, ["-f", "--no-fp8"]).fp8 is False
    assert parse_cli(TrainConfig, ["--no_fp8"]).fp8 is False
    assert parse_cli(TrainConfig, ["--num_iterations", "7", "--run_dir", "x", "--resume", "--compile",
                                   "--seed", "3", "--tokenizer_dir", "t", "--dataset_path", "d"]) == TrainConfig(
        num_iterations=7, run_dir="x", resume=True, compile=True, seed=3, tokenizer_dir="t", dataset_path="d")


@pytest.mark.parametrize("argv", [
    ["--fp8_mode", "e3m4"],              # not a choice
    ["--fp8_opt_level", "3"],            # not a choice
    ["--fp8_opt_level", "1"],            # needs --fp8 (__post_init__)
    ["--batch_size", "0"],
    ["--num_iterations", "0"],
])
def test_bad_values_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse_cli(TrainConfig, argv)
    assert e.value.code == 2


def test_opt_level_without_fp8_message_names_the_fix():
    with pytest.raises(ValueError, match="needs --fp8"):
        TrainConfig(fp8_opt_level=2)
    assert TrainConfig(fp8=True, fp8_opt_level=2).fp8_opt_level == 2


def test_help_shows_underscore_flags():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "base_train.py"), "--help"],
                         capture_output=True, text=True, env={"COLUMNS": "200", "PATH": ""}, check=True).stdout
    for flag in ("--model_name", "--dataset_path", "--num_iterations", "--run_dir", "--tokenizer_dir",
                 "--resume", "--seed", "--compile", "--fp8_mode", "--fp8_opt_level", "--fp8_recipe",
                 "--fp8_emulate", "-f, --fp8, --no_fp8"):
        assert flag in out, flag


def test_bad_choice_exits_2_from_the_script():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "base_train.py"), "--fp8_mode", "fp4"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "fp8_mode" in r.stderr or "fp8-mode" in r.stderr


def test_config_dict_round_trip():
    cfg = TrainConfig(fp8=True, fp8_mode="auto", fp8_skip=("lm_head", "*.c_q"))
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="does not know"):
        TrainConfig.from_dict({**cfg.to_dict(), "warp_drive": 1})


def test_tok_train_config_shares_fp8_flags():
    names = {f.name for f in dataclasses.fields(TokTrainConfig)}
    assert {"fp8", "fp8_mode", "fp8_opt_level", "fp8_recipe", "fp8_emulate"} <= names
