"""The device side of the plumbing: which device and dtype a run computes on, seeding and RNG
states, and counting the times the host waits on a device.

Kept apart from nanochat.common because it imports torch, and common must not: the configs and
every script's `--help` sit on common, and loading torch costs seconds. Both are the bottom of the
import layers; this module uses common's errors and distributed environment, never the reverse.

`resolve_device` and `resolve_dtype` turn `--device` / `--dtype` into torch objects with a
`UsageError` naming the flag and the fix (a CUDA device on a machine without one, an index past
the last GPU). `DeviceReads` counts device-to-host reads through a dispatch mode rather than by
patching `.item()`: it sees every op that makes the host wait, on a CPU run too, which is how the
tests hold the training step to the reads it is allowed.
"""

from __future__ import annotations

import contextlib
import random
from typing import Any

import torch
import torch.utils._python_dispatch

from nanochat.common import UsageError, dist_env


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` -> cuda (this process's local rank) if available, else mps, else cpu."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", dist_env().local_rank)
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:  # torch: "Expected one of cpu, cuda, ... device type at start of ..."
        raise UsageError(f"--device {name!r} is not a device torch knows ({e}); use cpu, cuda, "
                         "cuda:N, mps or auto") from None
    if device.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"--device {name!r}: nanochat runs on cpu, cuda (cuda:N) or mps; use one of "
                         "those or auto")
    if device.type == "mps" and not (getattr(torch.backends, "mps", None) is not None
                                     and torch.backends.mps.is_available()):
        raise UsageError(f"--device {name!r} was requested but this machine has no MPS backend; "
                         "use --device cpu or auto")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            f"--device {name!r} was requested but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}). "
            "Use --device cpu, or install a CUDA build: make install TORCH=torch"
        )
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"--device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         f"numbered from 0; use --device cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
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
        raise UsageError(f"unknown --dtype {name!r}; expected one of auto, {', '.join(_DTYPES)}") from None


def autocast_context(device: torch.device, dtype: torch.dtype):
    """The context a forward runs in at compute dtype `dtype` (resolve_dtype): bf16 autocast
    over fp32 weights, or nothing for fp32. Training and evaluation use the same one."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def host_read(t: torch.Tensor) -> list:
    """A device tensor's values as Python numbers: one device-to-host read. An explicit copy
    (`_to_copy` to cpu), so a tool counting reads sees it on a CPU run as well as on CUDA."""
    return t.to("cpu", copy=True).tolist()


def host_read_all(*tensors: torch.Tensor) -> list[list]:
    """Several 1-D device tensors' values, each its own list, in one device-to-host read: a step
    whose parts each hold values the host must see (the step guard's loss and norm, the stop
    votes) reads once, and hands each part its own."""
    values = host_read(torch.cat([t.detach().float().reshape(-1).to(tensors[0].device) for t in tensors]))
    sizes = [t.numel() for t in tensors]
    return [values[sum(sizes[:i]):sum(sizes[:i + 1])] for i in range(len(tensors))]


class DeviceReads(torch.utils._python_dispatch.TorchDispatchMode):
    """`with DeviceReads() as r: ...` then `r.count`: the times the code made the host wait on a
    device's values: `.item()`/`float()`/`bool()`/`int()` of a tensor (aten._local_scalar_dense)
    and copies to the CPU (from a device, or an explicit `.to("cpu", copy=True)` such as
    `host_read`'s, so a CPU run counts the same reads a GPU run makes; a plain `.tolist()` or
    `.cpu()` of a CPU tensor dispatches nothing and is not seen). `also_to_device=True` counts
    copies onto a device too (an optimizer step should move nothing between devices). Ops that
    compiled code runs inside its graph are not dispatched here."""

    def __init__(self, *, also_to_device: bool = False):
        super().__init__()
        self.also_to_device = also_to_device
        self.reads: list[str] = []

    @property
    def count(self) -> int:
        return len(self.reads)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func is aten._local_scalar_dense.default:
            self.reads.append(str(func))
        elif func in (aten._to_copy.default, aten.copy_.default):
            copy_ = func is aten.copy_.default
            src = args[1] if copy_ else args[0]
            dst = args[0].device if copy_ else torch.device(kwargs.get("device") or src.device)
            # an explicit same-device copy that keeps the dtype (host_read's `.to("cpu", copy=True)`);
            # one that changes it is a cast that happens to name the device (rms_norm of bf16 does)
            explicit = not copy_ and "device" in kwargs and kwargs.get("dtype", src.dtype) == src.dtype
            if torch.is_tensor(src) and (src.device != dst or explicit) and (
                    dst.type == "cpu" or self.also_to_device):
                self.reads.append(f"{func} {src.device} -> {dst}")
        return func(*args, **kwargs)


def rng_state() -> dict[str, Any]:
    """RNG states as tensors (weights_only-safe)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
