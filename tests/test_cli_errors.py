"""Every script's errors as the README promises them, checked by running the script as a user
does (a subprocess, nothing patched): the exit status (2 for a bad flag or input, 1 for a failed
run) and the whole output, which for an error found before any work is exactly one line,
`error: ...`, naming the flag or path and the fix (each case lists the fragments it must hold).

The cases cover each kind of rejection once per script that owns it: tyro's own parse errors
(not a choice, not a number, a missing value, an unknown flag), the config dataclasses' checks,
and the inputs only a run can look at (a run directory without a checkpoint or a tokenizer, a
tokenizer that is not the checkpoint's, a checkpoint without weights, an unknown model, an unknown
device; base_train's input paths, checked at start-up before the corpus is read: a missing
--init_from or --tokenizer_dir, --chat_template with a preset model, a --run_dir that is a
symbolic link looping or leading nowhere, a file where --log tensorboard writes its directory;
eval and export_hf on a run in progress that has saved no checkpoint yet; export_hf of a preset's
run). They fail before any model is built, a few seconds each. `--help` is checked to still print the flags.

Modules: every script's config (nanochat.config.tools, nanochat.config.export,
nanochat.config.gpu_check) and the benchmarks' (bench/), and their checks, as a user meets them.
"""

import concurrent.futures
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanochat.checkpoint import load_checkpoint, save_checkpoint
from nanochat.common import describe_error
from nanochat.tokenizer import BPETokenizer
from nanochat.train.trainer import NanoChatTrainer
from tests.conftest import run_dir_held_elsewhere, tiny_train_kwargs

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """scripts/<name>.py, or a path from the repository's root without .py ("bench/bench_train")."""
    path = ROOT / f"{name}.py" if "/" in name else ROOT / "scripts" / f"{name}.py"
    return subprocess.run([sys.executable, str(path), *argv], cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "120"})


@pytest.fixture(scope="module")
def paths(small_corpus, tmp_path_factory) -> dict[str, str]:
    """A finished one-step run, a copy whose tokenizer/ is another tokenizer, a copy without one,
    a copy whose checkpoint holds no weights, an empty directory and a path that does not exist."""
    root = tmp_path_factory.mktemp("cli_errors")
    run = root / "run"
    NanoChatTrainer(**tiny_train_kwargs(small_corpus, run, num_iterations=1, num_samples=0)).train()
    mismatched, no_tokenizer = root / "mismatched", root / "no_tokenizer"
    for copy in (mismatched, no_tokenizer):
        shutil.copytree(run, copy)
        shutil.rmtree(copy / "tokenizer")
    text = [p.read_text() for p in sorted(small_corpus.iterdir())]
    BPETokenizer.train(text, 300, progress=False).save(mismatched / "tokenizer")
    no_weights = root / "no_weights"
    shutil.copytree(run / "tokenizer", no_weights / "tokenizer")
    payload = load_checkpoint(run)
    del payload["model"], payload["format_version"]
    save_checkpoint(no_weights, payload)  # its manifest verifies: only the key is missing
    (root / "empty").mkdir()
    (root / "loop").symlink_to(root / "loop")
    (root / "dangling").symlink_to(root / "missing")
    (root / "tb_file" / "tensorboard").parent.mkdir()
    (root / "tb_file" / "tensorboard").write_text("not a directory")
    return dict(root=str(root), corpus=str(small_corpus), run=str(run), mismatched=str(mismatched),
                no_tokenizer=str(no_tokenizer), no_weights=str(no_weights), empty=str(root / "empty"),
                missing=str(root / "missing"), loop=str(root / "loop"), dangling=str(root / "dangling"),
                tb_file=str(root / "tb_file"))


DATA = ["--dataset_path", "{corpus}"]
CASES = [
    # tyro's parse errors, reworded by parse_cli (each kind for TrainConfig: tests/test_config.py)
    ("base_train", ["--fp8_mode", "e4m5"], 2, ["--fp8_mode: 'e4m5' is not one of e4m3, e5m2, auto", "give one"]),
    ("base_train", ["--log", "jsonl", "csv"], 2, ["--log", "'csv' is not one of jsonl, tensorboard, wandb"]),
    ("base_train", ["--fp8-mod", "e4m3"], 2, ["unknown flag --fp8-mod", "did you mean --fp8_mode?", "--help"]),
    ("eval", ["--run_dir", "{run}", "--eval_tokens", "many"], 2, ["--eval_tokens: invalid literal", "it takes an int"]),
    ("bench/bench_memory", ["--preset", "llama9"], 2, ["--preset: 'llama9' is not one of llama3-8b, llama3-1b"]),
    ("bench/bench_fp8_linear", ["--modes", "e4m5"], 2, ["--modes: 'e4m5' is not one of e4m3, e5m2, auto"]),
    # the config dataclasses' own checks (__post_init__)
    ("base_train", ["--lr", "nan"], 2, ["--lr must be a finite number, got nan"]),
    ("base_train", ["--optimizer", "adamw", "--muon_lr", "0.01"], 2,
     ["--muon_lr set Muon's hyperparameters", "pass --optimizer muon"]),
    ("tok_train", ["--vocab_size", "10"], 2, ["--vocab_size must be >= 260", "got 10"]),
    ("eval", DATA, 2, ["give exactly one of --run_dir", "--model_name"]),
    ("eval", ["--model_name", "org/name"], 2, ["--dataset_path is missing", "--model_name org/name has no corpus"]),
    ("export_hf", ["--out_dir", "{missing}"], 2, ["give exactly one of --run_dir", "--model_name"]),
    ("bench/fp8_parity", ["--modes", "e4m3"], 2, ["add baseline to --modes", "--modes baseline e4m3"]),
    ("base_train", ["--fp8", "--fp8_recipe", "mxfp8", "--fp8_mode", "e5m2"], 2,
     ["--fp8_mode e5m2 asks for e5m2 operands, but --fp8_recipe mxfp8 casts every operand to e4m3",
      "use --fp8_mode e4m3 with --fp8_recipe mxfp8"]),
    ("bench/fp8_parity", ["--recipe", "mxfp8"], 2,
     ["--recipe mxfp8 casts every operand to e4m3, so --modes e5m2 auto auto-recheck cannot run with it",
      "--modes baseline e4m3 mxfp8 mxfp8_wgrad_hp"]),
    ("bench/bench_train", ["--repeats", "0"], 2, ["--repeats must be >= 1"]),
    ("bench/bench_distributed", ["--repeats", "0"], 2, ["--repeats must be >= 1"]),
    ("bench/bench_distributed", ["--models", "d3"], 2, ["--models 'd3' is not a size preset", "d2, d4"]),
    ("export_hf", ["--model_name", "d4", "--out_dir", "{missing}", "--quantize_all"], 2,
     ["--quantize_all and --sqnr_floor_db choose what --quantize stores in FP8", "add --quantize fp8"]),
    ("bench/bench_export", ["--repeats", "0"], 2, ["--repeats and --steps must be >= 1"]),
    ("bench/bench_optim", ["--preset", "d3"], 2, ["--preset 'd3' is not a size preset", "d2, d4"]),
    ("bench/bench_memory", ["--seq_len", "0", "--plan_only"], 2, ["--seq_len must be >= 1"]),
    ("bench/bench_fp8_linear", ["--steps", "0"], 2, ["--steps must be >= 1"]),
    ("gpu_check", ["--jobs", "nonsense", "--dry_run"], 2, ["--jobs: unknown job nonsense", "env tests optim stats train shapes all"]),
    ("gpu_check", ["--budget_s", "nan", "--dry_run"], 2, ["--budget_s must be a positive number"]),
    # what only a run can look at
    ("eval", [*DATA, "--run_dir", "{missing}"], 2,
     ["--run_dir {missing}", "no such directory", "point --run_dir at"]),
    ("eval", [*DATA, "--run_dir", "{empty}"], 2, ["--run_dir {empty} holds no checkpoint", "point --run_dir at"]),
    ("eval", [*DATA, "--run_dir", "{no_tokenizer}", "--device", "cpu"], 2, ["tokenizer/ directory is missing", "restore it"]),
    ("eval", [*DATA, "--run_dir", "{mismatched}", "--device", "cpu"], 2,
     ["{mismatched}/tokenizer is not the tokenizer its checkpoint was trained with", "restore the run's own"]),
    ("eval", [*DATA, "--run_dir", "{no_weights}", "--device", "cpu"], 1,
     ["checkpoint-000001.pt is not usable", "it lacks 'model'"]),
    ("eval", [*DATA, "--model_name", "no-such-org/no-such-model"], 2, ["'no-such-org/no-such-model' not found"]),
    ("eval", [*DATA, "--model_name", "d4"], 2, ["'d4' is a nanochat preset", "--run_dir"]),
    ("eval", [*DATA, "--run_dir", "{run}", "--device", "tpu9"], 2, ["--device 'tpu9'", "use cpu, cuda"]),
    ("base_train", [*DATA, "--device", "cpu", "--init_from", "{missing}"], 2,
     ["--init_from {missing}: no such directory", "give the --run_dir of a finished run"]),
    ("base_train", [*DATA, "--device", "cpu", "--tokenizer_dir", "{missing}"], 2,
     ["--tokenizer_dir {missing}: no such directory", "scripts/tok_train.py --tokenizer_dir {missing}"]),
    ("base_train", [*DATA, "--device", "cpu", "--model_name", "d2", "--chat_template", "chatml"], 2,
     ["--chat_template chatml: nanochat's own tokenizer", "applies to Hugging Face models", "Drop the flag"]),
    ("base_train", [*DATA, "--device", "cpu", "--run_dir", "{loop}"], 2,
     ["--run_dir {loop}: {loop} is a symbolic link that loops", "point --run_dir at a directory"]),
    ("base_train", [*DATA, "--device", "cpu", "--run_dir", "{dangling}/sub"], 2,
     ["--run_dir {dangling}/sub: {dangling} is a symbolic link to {missing}, which does not exist"]),
    ("base_train", [*DATA, "--device", "cpu", "--run_dir", "{tb_file}", "--log", "jsonl", "tensorboard"], 2,
     ["{tb_file}/tensorboard, but that path exists and is not a directory", "drop tensorboard from --log"]),
    ("export_hf", ["--out_dir", "{root}/out", "--run_dir", "{missing}"], 2,
     ["--run_dir {missing}", "no such directory"]),
    ("export_hf", ["--out_dir", "{root}/out", "--run_dir", "{mismatched}"], 2,
     ["{mismatched}/tokenizer is not the tokenizer its checkpoint was trained with", "restore the run's own"]),
    ("export_hf", ["--out_dir", "{root}/out", "--run_dir", "{run}"], 2,
     ["'d2' is a nanochat preset", "cannot be exported for transformers", "checkpoint-<step>.pt"]),
    ("export_hf", ["--out_dir", "{root}/out", "--run_dir", "{run}", "--quantize", "fp8"], 2,  # imports torchao
     ["'d2' is a nanochat preset", "cannot be exported for transformers"]),
    ("bench/bench_optim", ["--quick", "--device", "tpu9"], 2, ["--device 'tpu9'"]),
    ("base_train", ["--dataset_path", "/dev/null", "--device", "cpu", "--run_dir", "{root}/devnull"], 2,
     ["--dataset_path /dev/null is not a regular file (a FIFO, socket or device"]),
]


@pytest.fixture(scope="module")
def case_runs(paths, tmp_path_factory, request) -> dict[int, subprocess.CompletedProcess]:
    """The selected CASES run, each in a process of its own in a directory of its own, as many at
    a time as there are cores: each spends its seconds importing torch on one core (the suite
    runs one thread), so on 2 cores two take the time of one."""
    selected = sorted({item.callspec.params["case"] for item in request.session.items
                       if getattr(item, "originalname", "") == "test_error_is_one_line_with_its_exit_status"})

    def run(case: int) -> subprocess.CompletedProcess:
        script, argv, _, _ = CASES[case]
        return _script(script, [a.format(**paths) for a in argv], tmp_path_factory.mktemp(f"case{case}"))

    with pytest.MonkeyPatch.context() as m:  # the cache each test gets (conftest), for every run
        m.setenv("NANOCHAT_CACHE", str(tmp_path_factory.getbasetemp() / "nanochat-cache"))
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            return dict(zip(selected, pool.map(run, selected)))


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]} {' '.join(c[1])}" for c in CASES])
def test_error_is_one_line_with_its_exit_status(paths, case_runs, case):
    _, _, code, fragments = CASES[case]
    r = case_runs[case]
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert r.returncode == code and len(lines) == 1 and lines[0].startswith("error: "), (r.returncode, lines)
    for fragment in fragments:
        assert fragment.format(**paths) in lines[0], (fragment, lines[0])


@pytest.mark.parametrize("script", ["export_hf", "eval"])
def test_a_run_in_progress_without_a_checkpoint_says_so(paths, tmp_path, script):
    """The run directory's lock held by another process, as a training run holds it before its
    first checkpoint: not only "holds no checkpoint", but that a run is in progress, and whose."""
    run_dir = tmp_path / "running"
    run_dir.mkdir()
    with run_dir_held_elsewhere(run_dir) as holder:
        argv = ["--out_dir", str(tmp_path / "out")] if script == "export_hf" else DATA
        r = _script(script, [*[a.format(**paths) for a in argv], "--run_dir", str(run_dir)], tmp_path)
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, lines
    assert f"--run_dir {run_dir} holds no checkpoint yet: a training run is in progress there (pid {holder.pid} on" \
        in lines[0], lines


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the benchmark runs")
def test_bench_memory_without_cuda_points_at_plan_only(tmp_path):
    r = _script("bench/bench_memory", [], tmp_path)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.startswith("error: no CUDA device"), r.stderr
    assert "--plan_only" in r.stderr and len(r.stderr.splitlines()) == 1


def test_parity_sweep_with_a_failed_run_exits_1(paths, tmp_path):
    """Every run fails (the run it starts from holds a d2 model, not d4): the report is printed,
    then one error line naming the failed run, exit status 1 (it exited 0, "targets: all met")."""
    r = _script("bench/fp8_parity", ["--model_name", "d4", "--modes", "baseline", "--seeds", "1",
                                     "--num_iterations", "2", "--seq_len", "32", "--batch_size", "2", "--vocab_size",
                                     "320", "--eval_tokens", "512", "--device", "cpu", "--dataset_path", paths["corpus"],
                                     "--init_from", paths["run"], "--out_dir", str(tmp_path / "parity")], tmp_path)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode == 1 and len(errors) == 1 and r.stderr.rstrip().endswith(errors[0]), r.stderr[-3000:]
    assert "1 of 1 runs failed: seed 1 baseline" in errors[0] and "holds a d2 model" in errors[0]
    assert "parity.json" in errors[0] and "targets: NOT all met" in r.stdout


def test_parity_refuses_a_missing_init_from_before_any_run(paths, tmp_path):
    """Checked once before the sweep, exit status 2 (not an error per run with exit status 0)."""
    r = _script("bench/fp8_parity", ["--quick", "--modes", "baseline", "--seeds", "1", "--init_from", paths["missing"],
                                     "--dataset_path", paths["corpus"], "--out_dir", str(tmp_path / "parity")], tmp_path)
    last = r.stderr.rstrip().splitlines()[-1]
    assert r.returncode == 2 and last.startswith(f"error: --init_from {paths['missing']}: no run there"), r.stderr
    assert "the --run_dir of a finished base_train run" in last and not (tmp_path / "parity" / "seed-1").exists()


@pytest.mark.parametrize("script, flags", [
    ("eval", ["--dataset_path", "--run_dir", "--model_name", "--debug"]),
    ("bench/bench_memory", ["--preset", "--plan_only"]),
    ("bench/bench_fp8_linear", ["--modes", "--steps"]),
])
def test_help_still_prints_the_flags(tmp_path, script, flags):
    r = _script(script, ["--help"], tmp_path)
    assert r.returncode == 0 and "usage:" in r.stdout and r.stderr == "", r.stderr
    for flag in flags:
        assert flag in r.stdout, flag


@pytest.mark.parametrize("error, code", [
    (FileNotFoundError("tokenizer directory t does not exist; make one with: python scripts/tok_train.py"), 2),
    (FileNotFoundError(2, "No such file or directory", "data.txt"), 2),
    (OSError("a device error without errno"), 1),
])
def test_os_errors_with_a_message_of_their_own_keep_it(error, code):
    """A library's FileNotFoundError raised with its own message (no errno) is bad input, exit 2
    (not 1, a failed run), and its message is printed as written."""
    got_code, message = describe_error(error)
    want = str(error) if error.strerror is None else "data.txt: No such file or directory; check the path"
    assert got_code == code and message.startswith(want), message


def test_torchao_import_noise_is_muted_on_a_cpu_build_and_kept_on_a_cuda_one(monkeypatch):
    """What torchao logs when its prebuilt CUDA kernels do not load is dropped by a torch without
    CUDA (every entrypoint: setup_logging) and kept by one with CUDA, where it may explain a
    fallback; torch's Enum deprecation is dropped on both. Other lines of those loggers pass."""
    import logging

    from nanochat.common import mute_import_noise

    mute_import_noise()
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            if not any(r is record for r in seen):  # a child logger's record reaches its parent's handler too
                seen.append(record)

    handler = Keep()
    lines = {"torchao": "Failed to load /x/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: no",
             "torch.utils._pytree": "<enum 'K'> is an Enum subclass and is now natively supported by torch.compile",
             "torchao.kernel.intmm": "Warning: Detected no triton, on systems without Triton certain kernels"}
    for name in lines:
        logging.getLogger(name).addHandler(handler)
    try:
        for cuda in (None, "12.8"):
            monkeypatch.setattr(torch.version, "cuda", cuda)
            for name, line in lines.items():
                logging.getLogger(name).warning(line)
            logging.getLogger("torchao").warning("something else torchao says")
        assert [r.getMessage() for r in seen] == ["something else torchao says", lines["torchao"],
                                                  lines["torchao.kernel.intmm"], "something else torchao says"]
    finally:
        for name in lines:
            logging.getLogger(name).removeHandler(handler)


def test_a_real_torchao_import_failure_still_shows(tmp_path):
    code = "import sys; sys.modules['torchao.float8'] = None; import nanochat.fp8.layers"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert r.returncode == 1 and "ModuleNotFoundError" in r.stderr and "torchao.float8" in r.stderr, r.stderr[-2000:]
