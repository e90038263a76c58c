"""Shared fixtures and helpers: a small real-text corpus, an isolated cache for tokenizers and
tokens, the nanochat logger's records (caplog), a tiny training run, a script loaded as a
module, a run's metrics.jsonl, a small MLP, process launching with a kill on timeout, and the
last-bit perturbation pass."""

import contextlib
import importlib.util
import json
import logging
import math
import os
import secrets
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import types
from pathlib import Path

# One intra-op thread for the whole suite, subprocesses included: the tests use tiny shapes that
# gain nothing from a second thread, and on 2 busy cores (load average 10) OpenMP's spin-waiting
# made a d2 emulated-FP8 step 20x slower with 2 threads than with 1.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# A shell starts a background job (`make test &`, a CI step's `&`) with SIGINT ignored, and every
# process it starts inherits that. The stop tests send SIGINT to runs they start and check what
# Python's own handler does, so the suite and its children get the handler back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

ROOT = Path(__file__).resolve().parents[1]
"""The repository: scripts/, bench/, examples/, src/."""


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Each test session gets its own tokenizer/token cache, never the user's `.cache`."""
    monkeypatch.setenv("NANOCHAT_CACHE", str(tmp_path_factory.getbasetemp() / "nanochat-cache"))


@pytest.fixture
def nanochat_log(caplog, monkeypatch):
    """pytest's caplog holding the `nanochat` logger's records from INFO up, once each. caplog
    listens on the root, and on the loggers that did not propagate when the test began (pytest
    >= 9.2); a script's setup_logging run during the test stops the nanochat logger propagating,
    and then the logger hands its records to caplog itself."""
    from nanochat.common import logger

    class ToCaplog(logging.Handler):
        def emit(self, record):
            if not logger.propagate and caplog.handler not in logger.handlers:
                caplog.handler.handle(record)  # the handler of the phase running now

    monkeypatch.setattr(logger, "propagate", True)
    caplog.set_level(logging.INFO, logger="nanochat")
    handler = ToCaplog()
    logger.addHandler(handler)
    yield caplog
    logger.removeHandler(handler)


def warnings_in(caplog) -> list[str]:
    """The messages of the WARNING-and-above records caplog holds."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


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
    these runs test the loop's logic; tests named *compile* run the compiled default. AdamW, not
    the preset's default Muon: these tests check AdamW's state (its two moments, their FP8 form,
    their bytes) and its fused step; Muon runs pass optimizer="muon" (tests/test_muon_training.py
    and the distributed tests' MUON)."""
    kw = dict(model_name="d2", optimizer="adamw", compile=False, dataset_path=str(corpus), run_dir=str(run_dir), vocab_size=320,
              seq_len=32, batch_size=8, num_iterations=30, warmup_steps=3, lr=1e-2, eval_every=0,
              eval_tokens=2048, save_every=0, num_samples=1, sample_tokens=8, device="cpu")
    kw.update(over)
    return kw


def load_script(name: str, folder: str = "scripts") -> types.ModuleType:
    """`<folder>/<name>.py` of the repository imported as a module, its main not run; registered
    in sys.modules (as `<folder>_<name>`) so that dataclasses defined in it resolve their types.
    Its folder is first on sys.path while it loads, as when Python runs it (a benchmark imports
    bench/harness.py so)."""
    spec = importlib.util.spec_from_file_location(f"{folder}_{name}", ROOT / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    sys.path.insert(0, str(ROOT / folder))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / folder))
    return module


def run_records(run: Path | str) -> list[dict]:
    """The records of a run's metrics.jsonl (`run`: its run directory or the file), one per line,
    read as strict JSON: a NaN or Infinity, which only Python's parser reads, fails the test."""
    path = Path(run)
    path = path / "metrics.jsonl" if path.is_dir() else path
    return [json.loads(line, parse_constant=_not_json) for line in path.read_text().splitlines()]


def _not_json(constant: str):
    raise AssertionError(f"metrics.jsonl holds {constant}, which is not JSON (a non-finite value must be null)")


def mlp(*widths: int, act: type[torch.nn.Module] = torch.nn.ReLU, bias: bool = True,
        seed: int = 0) -> torch.nn.Sequential:
    """Linear layers of `widths` (128, 256, 128: two) with `act` between them, initialized from `seed`."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers += [act()] if i else []
        layers.append(torch.nn.Linear(a, b, bias=bias))
    return torch.nn.Sequential(*layers)


def train_until_first_save(kwargs: dict, monkeypatch) -> None:
    """NanoChatTrainer(**kwargs) as a process that dies (KeyboardInterrupt) right after writing
    its first checkpoint: what a --resume continues."""
    from nanochat.train.trainer import NanoChatTrainer

    real_save = NanoChatTrainer._save

    def crash_after_first_save(self, step, *args, **kw):
        real_save(self, step, *args, **kw)
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(NanoChatTrainer, "_save", crash_after_first_save)
        with pytest.raises(KeyboardInterrupt):
            NanoChatTrainer(**kwargs).train()


def run_launch(cmd: list[str], *, env: dict[str, str], cwd: Path | str, timeout: float) -> subprocess.CompletedProcess:
    """Run `cmd` (torchrun, or any command that starts processes) to its end and return its
    output (`run_launches` of one command)."""
    return run_launches([cmd], env=env, cwd=cwd, timeout=timeout)[0]


def run_launches(cmds: list[list[str]], *, env: dict[str, str], cwd: Path | str,
                 timeout: float) -> list[subprocess.CompletedProcess]:
    """Run `cmds` side by side (the torchrun agents of one job) to their ends and return their
    outputs, each written to a file of its own (a full pipe would stall one agent while the test
    waits on another). On timeout every process they started is killed, found by a marker in its
    environment, and the test fails: torchrun starts each rank in a session of its own, so
    killing the launchers' process groups alone would leave a hung rank running past the suite."""
    marker = secrets.token_hex(8)
    with contextlib.ExitStack() as files:
        logs = [(files.enter_context(tempfile.TemporaryFile("w+")), files.enter_context(tempfile.TemporaryFile("w+")))
                for _ in cmds]
        procs = [subprocess.Popen(cmd, env={**env, "NANOCHAT_TEST_LAUNCH": marker}, cwd=cwd, text=True, stdout=out,
                                  stderr=err, start_new_session=True) for cmd, (out, err) in zip(cmds, logs)]
        deadline = time.monotonic() + timeout
        try:
            for proc in procs:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            killed = kill_marked(marker)
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            text = "\n".join(_text(f)[-3000:] for pair in logs for f in pair)
            raise AssertionError(f"{' '.join(cmds[0][:3])} ... did not end within {timeout:.0f} s; killed pids "
                                 f"{killed}\n{text}") from None
        return [subprocess.CompletedProcess(cmd, proc.returncode, _text(out), _text(err))
                for cmd, proc, (out, err) in zip(cmds, procs, logs)]


def _text(f) -> str:
    f.seek(0)
    return f.read()


def kill_marked(marker: str) -> list[int]:
    """SIGKILL every process whose environment holds NANOCHAT_TEST_LAUNCH=`marker`; their pids."""
    needle = f"NANOCHAT_TEST_LAUNCH={marker}".encode()
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
        except (OSError, ProcessLookupError):  # gone meanwhile, or not ours to read
            continue
    return killed


# ---------------------------------------------------------------- the perturbation pass
# A test that compares two different computations (a batch split, a kernel, compiled vs eager,
# another process layout) is marked `two_computations`. Its tolerance must hold for any order of
# fp32 summation, not only for this CPU's: `make test-numerics` re-runs those tests with
# NANOCHAT_PERTURB=1, where `last_bits` moves one side's inputs, gradients or initial weights by
# about one unit in the last place (relative 2^-23). A bound that only held because both sides
# happened to round alike fails there, on any machine.
PERTURB = os.environ.get("NANOCHAT_PERTURB") == "1"


def last_bits(t: torch.Tensor, seed: int = 1234) -> torch.Tensor:
    """`t` itself; under the perturbation pass, `t * (1 + 2^-23 * u)` with u uniform in [-1, 1)
    from a fixed generator (so a failure reproduces): ~half the elements move by one ulp."""
    if not PERTURB or not t.is_floating_point():
        return t
    g = torch.Generator(device="cpu").manual_seed(seed)
    u = torch.rand(t.shape, generator=g, dtype=torch.float64).mul_(2).sub_(1).to(t.device)
    return (t.double() * (1 + 2.0**-23 * u)).to(t.dtype)


@contextlib.contextmanager
def run_dir_held_elsewhere(run_dir: Path):
    """Another process holding `run_dir`'s lock as a training run holds it (nanochat.rundir); yields
    that process, killed (SIGKILL: the kernel releases its lock) when the block ends."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom nanochat import rundir\n"
                               "rundir.acquire(sys.argv[1])\nprint('locked', flush=True)\ntime.sleep(600)",
                               str(run_dir)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield holder
    finally:
        holder.kill()
        holder.wait()


@contextlib.contextmanager
def perturbed_init():
    """Every GPT built inside the block starts from `last_bits` of its initial weights, and its
    gradients pass through `last_bits` at every backward (identity outside the perturbation pass):
    use it around the one side of a comparison that trains."""
    if not PERTURB:
        yield
        return
    from nanochat.model.gpt import GPT

    real = GPT.init_weights

    def init_weights(self, *args, **kwargs):
        real(self, *args, **kwargs)
        with torch.no_grad():
            for i, p in enumerate(self.parameters()):
                p.copy_(last_bits(p, seed=i))
                p.register_hook(lambda g, i=i: last_bits(g, seed=10_000 + i))

    GPT.init_weights = init_weights
    try:
        yield
    finally:
        GPT.init_weights = real


def sqnr_db(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `actual` against `expected`, in dB (torchao's
    compute_error): inf when equal."""
    noise = (actual.detach().double() - expected.detach().double()).pow(2).mean()
    return float(10 * torch.log10(expected.detach().double().pow(2).mean() / noise)) if noise > 0 else math.inf


def assert_close_but_few(actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float = 0.0,
                         bound: float, fraction: float, msg: str = "") -> None:
    """Two computations through FP8 casts or Adam steps: at most `fraction` of the elements beyond
    fp32 rounding (`atol + rtol * |expected|`), and none beyond `bound`. A last-bit difference that
    lands an FP8 code one step away (a value on a rounding boundary), or flips the sign of a
    near-zero gradient under Adam, moves that element by a whole quantum; it happens to few
    elements, and each caller argues its `bound` and `fraction`."""
    diff = (actual.double() - expected.double()).abs()
    beyond = diff > atol + rtol * expected.double().abs()
    assert diff.max() <= bound, f"{msg} max |diff| {diff.max().item():.3g} > bound {bound:.3g}"
    assert beyond.double().mean() <= fraction, (
        f"{msg} {int(beyond.sum())} of {diff.numel()} elements beyond rounding (max {diff.max().item():.3g}), "
        f"more than the fraction {fraction:g}")


FP8_SAME_CASTS_DB = 45.0
"""SQNR floor between two computations that cast the same tensors to the same FP8 formats with
the same scales (compiled vs eager, one kernel vs another). They differ by fp32 rounding, plus
the values a last-bit difference moves across an FP8 rounding boundary, each by one quantum
(<= 2^-3 relative in e4m3): a fraction f so moved costs about 10 log10(2^6 / f) dB, 48 dB at
f = 0.1%, while a last-bit difference moves ~2^-19 of the values (~70 dB). A different scale or
format re-draws every element's rounding: ~28 dB for e4m3 (6 dB per mantissa bit), less for e5m2,
so the floor separates the two cases with ~17 dB to spare on each side."""
