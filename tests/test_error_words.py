"""Errors and leftovers name what the user can act on. Checked against the words of each
message: NANOCHAT_CACHE naming a file is an error naming the variable; a file-size limit hit
while the token store is written (a real RLIMIT_FSIZE in a child process) names the file and the
limit; a corpus file deleted after it was listed is said to have disappeared, by the reader and
by the store's build; a killed write's result.json temporary is removed under the run's lock; the
resume command of a run in a slurm job names the job's sbatch script and the agent command."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from nanochat.common import DistEnv, UsageError, cache_root, describe_error
from nanochat.config import TrainConfig
from nanochat.data.build import build_store
from nanochat.data.plan import plan_sources
from nanochat.data.read import read_unit
from nanochat.data.sources import DataError, list_sources
from nanochat.tokenizer import BPETokenizer
from nanochat.train.stop import resume_command

ROOT = Path(__file__).resolve().parents[1]


def test_nanochat_cache_naming_a_file_is_an_error_naming_the_variable(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    for value, part in ((tmp_path / "file", "it"), (tmp_path / "file" / "sub", f"{tmp_path / 'file'}, part of it,")):
        monkeypatch.setenv("NANOCHAT_CACHE", str(value))
        with pytest.raises(UsageError) as e:
            cache_root()
        assert str(e.value) == (f"NANOCHAT_CACHE {value}: {part} is not a directory; point NANOCHAT_CACHE at a "
                                "directory (created if missing)")
        assert describe_error(e.value) == (2, str(e.value))
    monkeypatch.setenv("NANOCHAT_CACHE", str(tmp_path / "new" / "cache"))
    assert cache_root() == tmp_path / "new" / "cache"  # missing: created by whoever writes there


CHILD = """
import resource, sys
from pathlib import Path
from nanochat.common import run_main
from nanochat.data.prepare import prepare_data
from nanochat.tokenizer import BPETokenizer
corpus, cache = Path(sys.argv[1]), Path(sys.argv[2])
tok = BPETokenizer.train([p.read_text() for p in sorted(corpus.iterdir())], 300, progress=False)
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, resource.RLIM_INFINITY))  # Python ignores SIGXFSZ: EFBIG
sys.exit(run_main(lambda: prepare_data(corpus, tokenizer=tok, cache_root=cache, workers=1, progress=False)))
"""


def _corpus(root: Path, n: int = 4, words: int = 4000) -> Path:
    root.mkdir()
    for i in range(n):
        (root / f"doc{i}.txt").write_text(" ".join(f"word{(i * 31 + k) % 97}" for k in range(words)) + "\n")
    return root


def test_a_file_size_limit_during_the_store_build_names_the_file_and_the_limit(tmp_path):
    corpus = _corpus(tmp_path / "corpus")
    r = subprocess.run([sys.executable, "-c", CHILD, str(corpus), str(tmp_path / "cache")], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and last.startswith(f"error: cannot write {tmp_path / 'cache'}"), r.stderr[-2000:]
    assert ": File too large, over the file-size limit (ulimit -f" in last and "ulimit -f unlimited" in last, last
    assert "Traceback" not in r.stderr and "[Errno 27]" not in last, r.stderr[-2000:]


def test_a_corpus_file_deleted_after_listing_is_said_to_have_disappeared(tmp_path):
    corpus = _corpus(tmp_path / "corpus", n=3, words=300)
    tok = BPETokenizer.train([p.read_text() for p in sorted(corpus.iterdir())], 300, progress=False)
    plan = plan_sources(list_sources(corpus))
    (corpus / "doc1.txt").unlink()
    unit = next(u for u in plan.units if u.path == "doc1.txt")
    with pytest.raises(DataError) as e:
        list(read_unit(corpus, unit, Counter()))
    assert str(e.value).startswith(f"{corpus / 'doc1.txt'}: this corpus file disappeared while the corpus was being "
                                   "read (deleted or moved after it was listed"), e.value
    with pytest.raises(DataError, match=r"doc1.txt: this corpus file disappeared .* run again to use the corpus"):
        build_store(plan, tok, tmp_path / "store", workers=1, progress=False)
    assert "check the path given on the command line" not in str(e.value)


def test_an_interrupted_result_json_write_leaves_nothing_after_the_next_start(tmp_path):
    from nanochat.checkpoint import clean_interrupted

    run = tmp_path / "run"
    run.mkdir()
    (run / ".result.json.tmp-4242-0badcafe").write_text("{")
    (run / ".metrics.jsonl.tmp-4242-12345678").write_text("")
    (run / ".result.json.tmp-notours").write_text("")  # not a name nanochat writes: left alone
    notes = clean_interrupted(run)
    assert sorted(p.name for p in run.iterdir() if p.name != ".nanochat.lock") == [".result.json.tmp-notours"]
    assert f"removed {run / '.result.json.tmp-4242-0badcafe'}, left by an interrupted write of result.json" in notes
    assert f"removed {run / '.metrics.jsonl.tmp-4242-12345678'}, left by an interrupted write of metrics.jsonl" in notes


def test_the_resume_command_in_a_slurm_job_names_its_sbatch_and_agent_command(monkeypatch):
    cfg = TrainConfig(model_name="d2", run_dir="runs/a", num_iterations=50)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert resume_command(cfg, DistEnv(world_size=2)).startswith("torchrun --standalone --nproc_per_node=2 ")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NAME", "nanochat")
    line = resume_command(cfg, DistEnv(world_size=2))
    head = ("sbatch with the script of slurm job 77 (nanochat), its step running: srun torchrun --nnodes=1 "
            "--nproc_per_node=2 <your rendezvous flags> scripts/base_train.py ")
    assert line.startswith(head) and "--standalone" not in line, line
    assert shlex.split(line[len(head):])[-1] == "--resume"
