"""CLI parsing of TrainConfig / TokTrainConfig (tyro), checked against the documented flags.

What a user relies on: both spellings of every flag (`--fp8_mode` and `--fp8-mode`), `-f` for
`--fp8` and `--no-fp8` to turn it off, and exit status 2 with one `error:` line naming the flag
and the fix for a bad value, whether tyro finds it (not a choice, not a number, an unknown
flag) or the config does (`--fp8_mode` without `--fp8`); `--fp8_opt_level` alone is accepted
(FP8 moments need no FP8 layers). `--help` is tyro's, unchanged, each flag's help once, as
written in its field group; each FP8 flag's help is FP8Config's, also from an install of
bytecode alone. The Python API gets the same checks at construction: wrong types, non-finite or
out-of-range hyperparameters. The step guard's limit is --max_bad_steps. Every script's `--help`
loads no torch (checked in a subprocess: the torch modules in sys.modules afterwards must be none).

The package under test, nanochat.config: checks.py (types and ranges at construction), fields.py
(the shared groups, the FP8 flags), train.py, tools.py, export.py, gpu_check.py (the configs), cli.py
(parse_cli), fp8.py (FP8Config, also tests/test_fp8_*.py).

Modules: nanochat.config.cli, nanochat.config.checks, nanochat.config.fields,
nanochat.config.train, nanochat.config.fp8.
"""

import compileall
import dataclasses
import logging
import math
import shutil
import subprocess
import sys
import typing
from pathlib import Path
from typing import Annotated

import pytest
import tyro

from nanochat.config import FP8_FLAGS, FP8Config, TokTrainConfig, TrainConfig, flag_text, parse_cli

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


@pytest.mark.parametrize("argv, fragments", [
    (["--fp8_mode", "e3m4"], ["--fp8_mode: 'e3m4' is not one of e4m3, e5m2, auto"]),   # tyro: not a choice
    (["--fp8_opt_level", "3"], ["--fp8_opt_level: '3' is not one of 0, 1, 2"]),
    (["--batch_size", "2.5"], ["--batch_size", "'2.5'", "it takes an int"]),            # tyro: not a number
    (["--fp8_skip", "a", "--lr"], ["--lr is missing its value; give a float"]),         # tyro: no value
    (["--tokenizer_dir"], ["--tokenizer_dir is missing its value; give a str"]),
    (["--warp_drive", "1"], ["unknown flag --warp_drive", "--help lists the flags"]),  # tyro: unknown flag
    (["--model-nam", "d2"], ["unknown flag --model-nam (did you mean --model_name?)"]),
    (["d2"], ["unexpected argument d2", "every value follows its --flag"]),
    (["--fp8_mode", "e5m2"], ["--fp8_mode 'e5m2' describes FP8 layers", "turn on --fp8"]),  # __post_init__
    (["--batch_size", "0"], ["--batch_size must be positive, got 0"]),
    (["--num_iterations", "0"], ["--num_iterations must be -1", "or positive"]),
    (["--lr", "nan"], ["--lr must be a finite number, got nan"]),
    (["--keep_checkpoints", "0"], ["--keep_checkpoints must be >= 1"]),
    (["--run_dir", "r", "--init_from", "r"], ["--init_from r is also --run_dir", "Give another --run_dir"]),
])
def test_bad_values_are_one_error_line_exit_2(argv, fragments, capsys):
    """tyro's own parse errors and TrainConfig's checks alike: one line on stderr (tyro drew a
    box for both), naming the flag and what to give."""
    with pytest.raises(SystemExit) as e:
        parse_cli(TrainConfig, argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and len(err.splitlines()) == 1 and err.startswith("error: "), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _WithPositional:
    """A CLI with a positional argument (as scripts/plot_run.py's RUN_DIR)."""

    run_dir: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="RUN_DIR")]
    """A run directory."""

    def __post_init__(self) -> None:
        if not self.run_dir.strip():
            raise ValueError("RUN_DIR is empty; give a run directory")


@pytest.mark.parametrize("argv, message", [
    ([], "error: RUN_DIR is required (it has no default): give RUN_DIR, a str"),
    (["a", "b"], "error: unexpected argument b: every value follows its --flag"),
    ([" "], "error: RUN_DIR is empty; give a run directory"),
])
def test_positional_arguments_are_named_as_help_shows_them(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_cli(_WithPositional, argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith(message), err
    assert parse_cli(_WithPositional, ["runs/x"]).run_dir == "runs/x"


def test_help_is_tyros_own(capsys, monkeypatch):
    """parse_cli parses a copy of the dataclass without its checks: the help must not change."""
    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit):
        tyro.cli(TrainConfig, args=["--help"], use_underscores=True)
    want = capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        parse_cli(TrainConfig, ["--help"])
    assert e.value.code == 0 and capsys.readouterr().out == want and "--keep_checkpoints" in want


def test_opt_level_needs_no_fp8_and_the_layer_flags_do():
    """--fp8_opt_level configures the optimizer, not FP8 layers: accepted without --fp8; every flag
    that describes FP8 layers is refused without it, naming the fix (the --fp8 run accepts it)."""
    assert TrainConfig(fp8_opt_level=2).fp8_config().opt_level == 2
    assert parse_cli(TrainConfig, ["--fp8_opt_level", "2"]).fp8 is False
    for flag, value in (("fp8_mode", "auto"), ("fp8_recipe", "rowwise"), ("fp8_layers", "all"), ("fp8_emulate", True),
                        ("fp8_skip", ("*",)), ("fp8_min_dim", 64), ("fp8_auto_steps", 2), ("fp8_stats_every", 0)):
        with pytest.raises(ValueError, match=f"--{flag} .* describes FP8 layers.*turn on --fp8, or drop --{flag}"):
            TrainConfig(**{flag: value})
        TrainConfig(fp8=True, **{flag: value})


def test_help_shows_each_shared_flag_once_with_its_group_doc():
    """The field groups (tyro reads docstrings through inheritance): base_train, fp8_parity and
    eval show --seq_len and --device with the one docstring written for them."""
    for script in ("scripts/base_train", "bench/fp8_parity", "scripts/eval"):
        out = subprocess.run([sys.executable, str(ROOT / f"{script}.py"), "--help"], capture_output=True,
                             text=True, check=True, env={"COLUMNS": "400", "PATH": "", "PYTHONPATH": str(ROOT / "src")}
                             ).stdout
        assert out.count("--seq_len INT") == 1 and out.count("Tokens per sequence: the training context") == 1, out
        assert out.count("--device STR") == 1 and out.count("cuda, cpu, mps, or auto (cuda if available)") == 1, out


SCRIPTS = sorted(f"{folder}/{p.name}" for folder in ("scripts", "bench") for p in (ROOT / folder).glob("*.py")
                 if "__main__" in p.read_text())
# Runs a script's or a benchmark's `--help` as `python script.py --help` would (its folder first on
# sys.path), then lists the torch modules it loaded: nanochat.config and nanochat.common import no
# torch, and every script parses its flags before importing what needs it.
HELP_PROBE = """
import runpy, sys
script = sys.argv[1]
sys.path.insert(0, script.rsplit("/", 1)[0])
sys.argv = [script, "--help"]
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as e:
    assert e.code in (0, None), e.code
print("loaded:", sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "torchao")))
"""


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_imports_no_torch(script):
    """--help answers without loading torch (seconds at import): the reference is the empty list."""
    r = subprocess.run([sys.executable, "-c", HELP_PROBE, str(ROOT / script)], capture_output=True,
                       text=True, timeout=120, env={"COLUMNS": "120", "PATH": "", "PYTHONPATH": str(ROOT / "src")})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--help" in r.stdout and r.stdout.rstrip().endswith("loaded: []"), r.stdout[-2000:]


# `--help` from an install of bytecode only: the nanochat package compiled next to its sources
# (compileall's legacy layout, importable without them), the sources then deleted.
SOURCELESS_HELP = """
import inspect
from nanochat.config import TrainConfig, parse_cli
from nanochat.config.fp8 import FP8Config
try:
    inspect.getsource(FP8Config)
except OSError:
    print("FP8Config has no source")
parse_cli(TrainConfig, ["--help"])
"""


def test_help_shows_the_fp8_help_from_bytecode_alone(tmp_path):
    """Each FP8 flag's help is FP8Config's (the reference: its `tyro.conf.arg(help=...)`, the
    field names shown as flags), also where the source files are gone: a zipapp, a stripped image."""
    shutil.copytree(ROOT / "src" / "nanochat", tmp_path / "nanochat", ignore=shutil.ignore_patterns("__pycache__"))
    assert compileall.compile_dir(tmp_path / "nanochat", quiet=1, legacy=True)
    for source in (tmp_path / "nanochat").rglob("*.py"):
        source.unlink()
    r = subprocess.run([sys.executable, "-c", SOURCELESS_HELP], capture_output=True, text=True, timeout=120,
                       env={"COLUMNS": "200", "PATH": "", "PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("FP8Config has no source"), r.stdout[:500]
    shown = " ".join(r.stdout.replace("\u2502", " ").split())  # the help box's borders out, lines joined
    hints = typing.get_type_hints(FP8Config, include_extras=True)
    for name, flag in FP8_FLAGS.items():
        help_text = flag_text(" ".join(typing.get_args(hints[name])[1].help.split()))
        assert f"--{flag}" in shown and help_text in shown, (flag, help_text)
    assert "FP8 format of the matmul operands" in shown and "during the first --fp8_auto_steps steps" in shown


def test_help_shows_underscore_flags():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "base_train.py"), "--help"],
                         capture_output=True, text=True, check=True,
                         env={"COLUMNS": "200", "PATH": "", "PYTHONPATH": str(ROOT / "src")}).stdout
    for flag in ("--model_name", "--dataset_path", "--num_iterations", "--run_dir", "--tokenizer_dir",
                 "--resume", "--overwrite", "--keep_checkpoints", "--debug", "--seed", "--compile",
                 "--fp8_mode", "--fp8_opt_level", "--fp8_recipe", "--fp8_emulate", "-f, --fp8, --no_fp8"):
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


def test_max_bad_steps(caplog):
    assert TrainConfig().max_bad_steps == 10 and TrainConfig(max_bad_steps=3).max_bad_steps == 3
    with caplog.at_level(logging.WARNING, logger="nanochat"):
        assert parse_cli(TrainConfig, ["--max_bad_steps", "4"]).max_bad_steps == 4
    assert not caplog.records


def test_tok_train_config_shares_fp8_flags():
    names = {f.name for f in dataclasses.fields(TokTrainConfig)}
    assert {"fp8", "fp8_mode", "fp8_opt_level", "fp8_recipe", "fp8_emulate"} <= names


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch_size=2.5), "--batch_size must be an int, got 2.5"),
    (dict(fp8="yes"), "--fp8 must be a bool, got 'yes'"),
    (dict(fp8_mode="e3m4"), "--fp8_mode must be one of 'e4m3', 'e5m2', 'auto'"),
    (dict(fp8=True, fp8_opt_level=True), "--fp8_opt_level must be one of 0, 1, 2, got True"),
    (dict(weight_decay=math.nan), "--weight_decay must be a finite number"),
    (dict(lr=math.inf), "--lr must be a finite number"),
    (dict(grad_clip=math.nan), "--grad_clip must be a finite number"),
    (dict(beta1=1.0), r"--beta1 must be in \[0, 1\)"),
    (dict(temperature=-1.0), "--temperature must be >= 0"),
    (dict(keep_checkpoints=0), "--keep_checkpoints must be >= 1"),
    (dict(max_bad_steps=0), "--max_bad_steps must be >= 1"),
    (dict(resume=True, overwrite=True), "give one"),
    (dict(run_dir=""), "--run_dir is empty"),
])
def test_api_values_are_checked_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kwargs)


def test_paths_and_lists_from_python_are_normalized():
    cfg = TrainConfig(run_dir=Path("runs") / "x", fp8_skip=["lm_head"])
    assert cfg.run_dir == "runs/x" and cfg.fp8_skip == ("lm_head",)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
