"""scripts/tok_train.py end to end on a tiny corpus: once as a user runs it (a subprocess), the
other cases in-process through its `main(argv)` (an interpreter start costs seconds on 2 cores).

Checked against: the saved directory (it must load with BPETokenizer.load and have the vocabulary
size asked for), the printed report (vocab, compression, fingerprint), the one-line FP8 note
exactly when an FP8 flag differs from its default, and exit status 2 with a message for an
invalid flag value and for a bad --dataset_path; a --tokenizer_dir that holds a tokenizer is
replaced only with --overwrite, a run's own never (its bytes before are the reference).
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nanochat.tokenizer import BPETokenizer
from tests.conftest import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tok_train.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_trains_saves_and_notes_fp8(small_corpus, tmp_path):
    out_dir = tmp_path / "tok"
    r = _run("--dataset_path", str(small_corpus), "--tokenizer_dir", str(out_dir), "--vocab_size", "300",
             "--fp8", "--fp8_mode", "e5m2")
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stdout.splitlines() if "do not apply to tokenizer training" in line]
    assert notes == ["note: --fp8, --fp8_mode do not apply to tokenizer training (it has no matmuls); ignored"]
    assert "vocab 300 (asked 300)" in r.stdout and "bytes/token" in r.stdout
    tok = BPETokenizer.load(out_dir)
    assert tok.vocab_size == 300 and tok.fingerprint in r.stdout
    assert tok.decode(tok.encode("def main():\n")) == "def main():\n"


def _main():
    return load_script("tok_train").main


def test_no_fp8_note_without_fp8_flags(small_corpus, tmp_path, capsys):
    assert _main()(["--dataset_path", str(small_corpus), "--tokenizer_dir", str(tmp_path / "t"),
                    "--vocab_size", "260"]) == 0
    out = capsys.readouterr().out
    assert "do not apply" not in out and "vocab 260" in out
    assert BPETokenizer.load(tmp_path / "t").vocab_size == 260


def test_bad_values_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        _main()(["--fp8_mode", "e3m4", "--tokenizer_dir", str(tmp_path / "t")])
    assert e.value.code == 2 and "e3m4" in capsys.readouterr().err
    assert _main()(["--dataset_path", str(tmp_path / "missing"), "--tokenizer_dir", str(tmp_path / "t")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def test_an_existing_tokenizer_is_replaced_only_with_overwrite_and_a_runs_never(small_corpus, tmp_path, capsys):
    """The directory's files before and after are the reference: a refused call changes none."""
    args = ["--dataset_path", str(small_corpus), "--vocab_size", "260"]
    tok_dir = tmp_path / "t"
    assert _main()([*args, "--tokenizer_dir", str(tok_dir)]) == 0
    before = {p.name: p.read_bytes() for p in tok_dir.iterdir()}
    capsys.readouterr()
    assert _main()([*args[:2], "--vocab_size", "270", "--tokenizer_dir", str(tok_dir)]) == 2
    err = capsys.readouterr().err
    assert "already holds a tokenizer" in err and "--overwrite" in err and "Traceback" not in err, err
    assert {p.name: p.read_bytes() for p in tok_dir.iterdir()} == before
    assert _main()([*args[:2], "--vocab_size", "270", "--tokenizer_dir", str(tok_dir), "--overwrite"]) == 0
    assert BPETokenizer.load(tok_dir).vocab_size == 270

    run_tok = tmp_path / "run" / "tokenizer"  # a run's own tokenizer, next to its metrics
    shutil.copytree(tok_dir, run_tok)
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    before = {p.name: p.read_bytes() for p in run_tok.iterdir()}
    capsys.readouterr()
    assert _main()([*args, "--tokenizer_dir", str(run_tok), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert f"is the tokenizer of the run in {tmp_path / 'run'}" in err and "never replaced" in err, err
    assert {p.name: p.read_bytes() for p in run_tok.iterdir()} == before
