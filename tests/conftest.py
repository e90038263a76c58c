"""Shared fixtures: a small real-text corpus and an isolated cache for tokenizers and tokens."""

import os
import sysconfig
from pathlib import Path

# One intra-op thread for the whole suite, subprocesses included: the tests use tiny shapes that
# gain nothing from a second thread, and on a loaded 2-core machine OpenMP's spin-waiting made a
# d2 emulated-FP8 step 20x slower with 2 threads than with 1 (measured 17:24, load average 10).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Each test session gets its own tokenizer/token cache, never the user's `.cache`."""
    monkeypatch.setenv("NANOCHAT_CACHE", str(tmp_path_factory.getbasetemp() / "nanochat-cache"))


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """~120 KB of real Python source (a few stdlib modules) as a directory of .py files."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "string.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py",
                 "heapq.py", "colorsys.py", "keyword.py", "queue.py", "sched.py", "calendar.py"):
        src = stdlib / name
        if src.exists():
            (root / name).write_text(src.read_text(encoding="utf-8"), encoding="utf-8")
    return root


def tiny_train_kwargs(corpus: Path, run_dir: Path, **over) -> dict:
    """A d2 model on the small corpus: a few seconds per run on 2 CPU cores. Eager (compile=False):
    these runs test the loop's logic; tests named *compile* run the compiled default."""
    kw = dict(model_name="d2", compile=False, dataset_path=str(corpus), run_dir=str(run_dir), vocab_size=320,
              seq_len=32, batch_size=8, num_iterations=30, warmup_steps=3, lr=1e-2, eval_every=0,
              eval_tokens=2048, save_every=0, num_samples=1, sample_tokens=8, device="cpu")
    kw.update(over)
    return kw
