"""How a step runs: a native kernel, torch.compile, or eagerly; the fallbacks between them.

    native   a C kernel built on first use (`load_native`: the system compiler, -march=native,
             cached per source, compiler and CPU) and called once a step; adam.py's for e4m3
             moments on CPU
    compile  torch.compile(fullgraph=True, dynamic=False) of a multi-tensor step function: one
             compiled call per (shape, dtype, device, flags); hyperparameters as 0-dim CPU
             tensors (`host_scalar`), so a changing lr neither recompiles nor reads the device
    eager    the same Python functions run eagerly

`backend="auto"` tries them in that order, "native" / "compile" / "eager" start lower. A backend
that cannot run falls to the next for the rest of the optimizer's life (a step native once and
compiled the next would be slow for no reason a user could see), logged once with its reason and
kept in `fallbacks`, which a run's results copy; `counts` says how the last step ran.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
from typing import Any, Callable

import torch

from nanochat.common import warn_once
from nanochat.fs import publish_file

BACKENDS = ("auto", "native", "compile", "eager")


class Backends:
    """Which backends may still run, the compiled functions, and the last step's counts."""

    def __init__(self, owner: str, backend: str = "auto", *, compile: bool = True):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be {', '.join(BACKENDS[:-1])} or {BACKENDS[-1]}; got {backend!r}")
        self.owner = owner
        """The optimizer's class name, in the fallback messages."""
        self.native = compile and backend in ("auto", "native")
        """A native kernel may be tried (False after it failed once)."""
        self.compile = compile and backend != "eager"
        """torch.compile may be tried (False after it failed once)."""
        self.fallbacks: list[str] = []
        """Each fallback taken (native kernel unavailable, compile failed), with its reason."""
        self.counts: dict[str, tuple[int, int]] = {}
        """The current (or last) step: backend -> (calls, tensors)."""
        self._compiled: dict[str, Any] = {}

    def reset(self) -> None:
        """A new step begins: its counts start at zero."""
        self.counts = {}

    def count(self, backend: str, tensors: int) -> None:
        calls, n = self.counts.get(backend, (0, 0))
        self.counts[backend] = (calls + 1, n + tensors)

    def run(self, name: str, fn: Callable, *args, **flags) -> None:
        """fn(*args, **flags), compiled once per `name` and flags; dynamo then keeps one graph per
        list length and tensor shape (a model has few, so its limit of 8 is lifted). args[0] is
        the list of parameters."""
        key = name + repr(sorted(flags.items()))
        if self.compile:
            compiled = self._compiled.get(key)
            if compiled is None:
                compiled = self._compiled[key] = torch.compile(fn, fullgraph=True, dynamic=False)
            try:
                with torch._dynamo.utils.disable_cache_limit():
                    compiled(*args, **flags)
                self.count("compile", len(args[0]))
                return
            except Exception as e:  # no C++ compiler, unsupported backend, ...
                self.compile = False
                self._fallback("eager", f"{self.owner}: torch.compile of the step failed ({type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}); running the step eagerly "
                               "(correct, several times slower). Pass compile=False to skip the attempt.")
        fn(*args, **flags)
        self.count("eager", len(args[0]))

    def run_native(self, call: Callable[[], None], tensors: int) -> bool:
        """call() runs a native kernel over `tensors` tensors; False when the kernel is
        unavailable (it raised RuntimeError: no compiler, a stale build, a block size it cannot
        do): then it is never tried again and the caller steps these tensors compiled."""
        try:
            call()
        except RuntimeError as e:
            self.native = False
            self._fallback("native", f"{self.owner}: the native CPU kernel is unavailable ({e}); using "
                           "torch.compile for the step instead (several times slower on CPU).")
            return False
        self.count("native", tensors)
        return True

    def _fallback(self, kind: str, message: str) -> None:
        self.fallbacks.append(message)
        warn_once(f"optim-{kind}", message)


def host_scalar(x) -> torch.Tensor:
    """A hyperparameter as a 0-dim float64 tensor; one that already is a tensor stays where it is
    (reading it back to the host would wait for the device)."""
    if torch.is_tensor(x):
        return x.detach().to(torch.float64)
    return torch.tensor(float(x), dtype=torch.float64)


# ------------------------------------------------------------------------------ native kernels
NATIVE_FLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fno-math-errno", "-shared", "-fPIC")
# Threads: OpenMP when torch's intra-op threads are OpenMP (a kernel then runs on torch's own
# thread pool); without it, or if that build fails, -fopenmp-simd and the caller's threads.
_THREADING = (("-fopenmp",), ("-fopenmp-simd",)) if "OpenMP" in torch.__config__.parallel_info() \
    else (("-fopenmp-simd",),)
_native: dict[pathlib.Path, Any] = {}  # source -> its bound library, or why it is unavailable (tried once)


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [l.strip() for l in f if l.startswith(("model name", "flags", "Features", "CPU part"))]
        return "\n".join(dict.fromkeys(lines))  # the same lines repeat per core
    except OSError:
        return f"{platform.processor()} {platform.machine()} {torch.backends.cpu.get_cpu_capability()}"


def load_native(source: pathlib.Path, bind: Callable[[ctypes.CDLL, pathlib.Path], ctypes.CDLL], *,
                headers: tuple[pathlib.Path, ...] = ()) -> ctypes.CDLL:
    """The C kernel `source` (which includes `headers`), built on first use into
    ~/.cache/nanochat and passed through `bind` (its entry points declared, its ABI checked);
    RuntimeError with the reason it is unavailable, the same one every later call. Built with
    -march=native, so the cache key holds the sources, the flags, the compiler's identity and
    this CPU's model and feature flags: a home directory shared by different machines never
    loads another CPU's build. NANOCHAT_NATIVE_OPTIM=0 turns every native kernel off."""
    if os.environ.get("NANOCHAT_NATIVE_OPTIM", "1") == "0":
        raise RuntimeError("turned off by NANOCHAT_NATIVE_OPTIM=0")
    loaded = _native.get(source)
    if isinstance(loaded, str):
        raise RuntimeError(loaded)
    if loaded is not None:
        return loaded
    try:
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            raise RuntimeError("no C compiler (cc/gcc) on PATH")
        lib = _build(cc, source, headers, bind)
    except Exception as e:  # noqa: BLE001 - any build/load failure means "not available"
        detail = e.stderr.strip().splitlines()[-1] if isinstance(e, subprocess.CalledProcessError) and e.stderr else e
        _native[source] = f"{type(e).__name__}: {detail}"
        raise RuntimeError(_native[source]) from None
    _native[source] = lib
    return lib


def _build(cc: str, source: pathlib.Path, headers: tuple[pathlib.Path, ...],
           bind: Callable[[ctypes.CDLL, pathlib.Path], ctypes.CDLL]) -> ctypes.CDLL:
    """Compile (or find in the cache) and bind the library, with OpenMP if it builds and links."""
    texts = [f.read_text() for f in (source, *headers)]
    compiler = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "nanochat"
    cache.mkdir(parents=True, exist_ok=True)
    includes = [f"-I{d}" for d in dict.fromkeys(str(h.parent) for h in headers)]
    for threading in _THREADING:
        flags = (*NATIVE_FLAGS, *threading)
        key = hashlib.sha256("\0".join([*texts, " ".join(flags), cc, compiler, _cpu_identity(),
                                        platform.machine()]).encode()).hexdigest()[:16]
        so = cache / f"{source.stem}-{key}.so"
        try:
            if not so.exists():
                # Built under a temporary name and renamed: concurrent processes (torchrun ranks)
                # may dlopen it, and must see no half-written library.
                publish_file(so, lambda out: subprocess.run(
                    [cc, *flags, *includes, "-o", str(out), str(source), "-lm"], check=True, capture_output=True,
                    text=True, timeout=120))
            return bind(ctypes.CDLL(str(so)), so)
        except (subprocess.CalledProcessError, OSError):
            if threading is _THREADING[-1]:
                raise  # else e.g. no libgomp to link: the build without OpenMP
    raise AssertionError("unreachable: the last threading choice re-raises")


def extent(x: torch.Tensor | None) -> int:
    """Bytes from x's first element to the end of its allocation: all a native kernel may touch
    through x's pointer (0 for None)."""
    if x is None:
        return 0
    return x.untyped_storage().nbytes() - x.storage_offset() * x.element_size()


__all__ = ["BACKENDS", "NATIVE_FLAGS", "Backends", "extent", "host_scalar", "load_native"]
