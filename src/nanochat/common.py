"""Shared plumbing: errors and exit statuses, logging that prints once, the distributed
environment, number and table formatting.

Everything here is small, has no opinion about models or FP8, and imports no torch: the configs
(nanochat.config) sit on it, and a script's `--help` must not wait for torch to load. What needs
torch (the device and dtype choice, seeding, counting device-to-host reads) is nanochat.device,
at the same bottom layer; files written whole, manifests and the file lock are nanochat.fs,
just above. The rule for messages is the project's rule: a fallback or a surprising
choice is said once, with its reason, and the caller records it in the run's results
(`TrainResult.fallbacks`); nothing degrades silently.

Errors a user can act on are `NanoChatError`s (`UsageError` for a bad flag or input: exit 2;
the base class for a run that failed on its environment or its data on disk: exit 1). Every
entrypoint runs under `run_main`, which prints them, and ordinary OS errors, as one `error:`
line; `--debug` shows the traceback instead.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("nanochat")


class NanoChatError(RuntimeError):
    """A failure the user can act on, with a message that says what, where and how to fix it.
    The run itself failed (a corrupt checkpoint, a full disk, a diverged model): exit status 1."""

    exit_code = 1


class UsageError(NanoChatError, ValueError):
    """A bad flag, argument or input file, found before any work is lost: exit status 2. A
    ValueError too, so callers that catch ValueError for bad input keep working."""

    exit_code = 2


# OS errors whose cause is the path the user gave (exit 2: ENOENT, ENOTDIR, EISDIR, EEXIST, whose
# classes these are, and ENAMETOOLONG); every other OSError is the environment's (exit 1).
_USAGE_OSERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError)


def describe_error(e: BaseException) -> tuple[int, str] | None:
    """(exit status, one-line message) for an error a user can act on; None for a bug."""
    if isinstance(e, NanoChatError):
        return e.exit_code, str(e)
    if isinstance(e, OSError):
        usage = isinstance(e, _USAGE_OSERRORS) or e.errno == errno.ENAMETOOLONG
        if e.strerror is None:  # raised with a message of its own (a missing tokenizer or model)
            return (2 if usage else 1), str(e)
        where = f" {e.filename}" if e.filename else ""
        reason = e.strerror
        if e.errno == errno.ENOSPC:
            return 1, (f"no space left on the device of{where or ' a file being written'}; free space "
                       "there or point --run_dir (or the output path) at another disk")
        if e.errno == errno.EFBIG:
            return 1, (f"cannot write{where}: {reason}, over the file-size limit (ulimit -f, or the file system's "
                       "largest file); raise the limit (ulimit -f unlimited) or write to another file system "
                       "(NANOCHAT_CACHE for token stores, --run_dir for checkpoints)")
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return 1, f"cannot write or read{where}: {reason}; fix its permissions or choose another path"
        if usage:
            return 2, f"{e.filename or e}: {reason}; check the path given on the command line"
        return 1, f"{e.filename}: {reason}" if e.filename else str(e)
    if isinstance(e, ValueError):  # bad input from a library check (data, tokenizer, HF files)
        return 2, str(e)
    return None


def run_main(main: Callable[[], int | None], *, debug: bool = False) -> int:
    """Run an entrypoint's body: a user or environment error becomes one `error: ...` line on
    stderr and its exit status (2 usage, 1 runtime) instead of a traceback; `debug` re-raises
    so the traceback shows. Anything else is a bug and keeps its traceback."""
    try:
        return main() or 0
    except KeyboardInterrupt:  # Ctrl-C where no handler of ours runs (a run's loop has one: nanochat.train.stop)
        if debug:
            raise
        print_last_line("stopped by SIGINT")
        return 130
    except Exception as e:
        described = describe_error(e)
        if described is None:
            raise
        if debug:
            traceback.print_exc()
        code, message = described
        print_last_line(f"error: {' '.join(message.split())}")
        return code


def print_last_line(text: str) -> None:
    """`text` on stderr as the line a process ends with: a progress bar it interrupted is closed
    first, so the line starts one of its own."""
    bars = getattr(getattr(sys.modules.get("tqdm"), "tqdm", None), "_instances", ())
    for bar in list(bars):
        bar.close()
    print(text, file=sys.stderr, flush=True)


class _ImportNoise(logging.Filter):
    """Drops what torchao and torch log on importing torchao that is not news to our users: on a
    torch build without CUDA, that torchao's prebuilt CUDA kernels (`_C_mxfp8`, `_C_cutlass_90a`:
    `Failed to load .../torchao/_C...so`) and Triton are absent; on any build, torch's pytree
    deprecation of the Enums torchao registers. On a CUDA build a kernel that fails to load is
    shown (it may be why a recipe falls back); a failed import of torchao itself raises."""

    ALWAYS = (re.compile(r"is an Enum subclass and is now natively supported by torch\.compile"),)
    WITHOUT_CUDA = (re.compile(r"Failed to load \S*torchao\S*[/\\]_C\w*[.\w-]*\.so"),
                    re.compile(r"Detected no triton"))

    def filter(self, record: logging.LogRecord) -> bool:
        torch = sys.modules.get("torch")  # imported by now: torchao imports it first
        cuda_build = torch is not None and getattr(torch.version, "cuda", None) is not None
        message = record.getMessage()
        return not any(p.search(message) for p in self.ALWAYS + (() if cuda_build else self.WITHOUT_CUDA))


NOISY_LOGGERS = ("torchao", "torchao.kernel.intmm", "torch.utils._pytree")


def mute_import_noise() -> None:
    """Install `_ImportNoise` on the loggers that carry it, once a process: every entrypoint
    (setup_logging), nanochat.fp8 and nanochat.optim.moments (before their torchao imports) call it."""
    for name in NOISY_LOGGERS:
        target = logging.getLogger(name)
        if not any(isinstance(f, _ImportNoise) for f in target.filters):
            target.addFilter(_ImportNoise())


def setup_logging(level: int = logging.INFO) -> None:
    """Plain `message` lines on stderr, only on rank 0 (other ranks log warnings and errors);
    torchao's import noise muted (mute_import_noise)."""
    mute_import_noise()
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level if dist_env().rank == 0 else logging.WARNING)
    logger.propagate = False


def print0(*args, **kwargs) -> None:
    """`print` on rank 0 only, for tables and results meant for stdout."""
    if dist_env().rank == 0:
        print(*args, **kwargs, flush=True)


_warned: set[str] = set()


def warn_once(key: str, message: str) -> bool:
    """Log `message` as a warning the first time `key` is seen in this process; True if logged."""
    if key in _warned:
        return False
    _warned.add(key)
    logger.warning("WARNING: %s", message)
    return True


@dataclass(frozen=True)
class DistEnv:
    """What torchrun told this process (a single process gets rank 0 of 1). How a run spreads
    over these processes is its Layout (nanochat.parallel.layout), decided once from this."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1


def dist_env() -> DistEnv:
    return DistEnv(
        rank=int(os.environ.get("RANK", 0)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
    )


def cache_root() -> Path:
    """nanochat's cache directory, `$NANOCHAT_CACHE` (default `.cache` in the working directory):
    what can be rebuilt from the inputs, shared by every run and script (tokenizers trained on
    the fly, token stores, FP8 layer timings). Read here only, so that all of them agree. A path
    that cannot be a directory (it, or the nearest part of it that exists, is a file) is a
    UsageError naming the variable: the error of a file written under it would name only that file."""
    value = os.environ.get("NANOCHAT_CACHE")
    root = Path(value if value else ".cache")
    existing = next((p for p in (root, *root.parents) if os.path.lexists(p)), None)
    if existing is not None and not existing.is_dir():
        what = "it" if existing == root else f"{existing}, part of it,"
        name = "NANOCHAT_CACHE" if value else "the default cache directory (.cache; set NANOCHAT_CACHE)"
        raise UsageError(f"{name} {root}: {what} is not a directory; point NANOCHAT_CACHE at a directory "
                         "(created if missing)")
    return root


def read_json_object(path: Path, fix: str) -> dict:
    """The JSON object in `path`; a `UsageError` naming the file and `fix` if it is not one."""
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path} is not valid JSON ({e}); {fix}") from None
    if not isinstance(obj, dict):
        raise UsageError(f"{path} holds a JSON {type(obj).__name__}, expected an object; {fix}")
    return obj


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def format_table(headers: list[str], rows: list[list[object]]) -> str:
    """A plain fixed-width text table (no dependency), used for every report the run prints."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    line = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])
