"""Shared plumbing: device and dtype choice, logging that prints once, seeding, distributed env.

Everything here is small and has no opinion about models or FP8. The rule for messages is the
project's rule: a fallback or a surprising choice is said once, with its reason, and the caller
records it in the run's results (`TrainResult.fallbacks`); nothing degrades silently.
"""

from __future__ import annotations

import logging
import os
import random
import sys
from dataclasses import dataclass

import torch

logger = logging.getLogger("nanochat")


def setup_logging(level: int = logging.INFO) -> None:
    """Plain `message` lines on stderr, only on rank 0 (other ranks log warnings and errors)."""
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
    """What torchrun told this process (a single process gets rank 0 of 1)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def dist_env() -> DistEnv:
    return DistEnv(
        rank=int(os.environ.get("RANK", 0)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
    )


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` -> cuda (this process's local rank) if available, else mps, else cpu."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", dist_env().local_rank)
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={name!r} was requested but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}). "
            "Use --device cpu, or install a CUDA build: make install TORCH=torch"
        )
    return device


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """Compute dtype: `auto` is bf16 on CUDA (tensor cores) and fp32 elsewhere.

    On CPU bf16 matmuls are slower than fp32 on most cores and numerically worse, so fp32 is
    the default there; `--dtype bfloat16` overrides it.
    """
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of auto, {', '.join(_DTYPES)}") from None


def host_read(t: torch.Tensor) -> list:
    """A device tensor's values as Python numbers: one device-to-host read. An explicit copy
    (`_to_copy` to cpu), so a tool counting reads sees it on a CPU run as well as on CUDA."""
    return t.to("cpu", copy=True).tolist()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


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
