"""FP8Optim's native CPU kernel (optim_kernel.c): its build, its binding and one call per step.

The same math as FP8Optim's compiled step, as plain C loops over one 256-element block at a time
(the block stays in L1), auto-vectorized by the C compiler: several times faster than inductor's
code on CPU (BENCHMARKS.md §3(b); why: docs/design.md). `load()` builds it on first use with the
system C compiler into ~/.cache/nanochat and loads it with ctypes (no torch headers, so the build
is quick). It is built with -march=native, so the cache key holds the source, the flags, the
compiler's identity and this CPU's model and feature flags: a home directory shared by different
machines never loads another CPU's build. `adam()` steps every tensor of a step in one call: its
threads (torch's OpenMP pool, torch.get_num_threads() of them; ctypes releases the GIL) take chunks
of blocks from a shared counter. NANOCHAT_NATIVE_OPTIM=0 turns it off (FP8Optim then steps
compiled; a recorded fallback).

Memory safety: the kernel writes through raw pointers, so nothing it is given may be smaller than
it believes. Each buffer goes with the bytes its allocation holds from that pointer on, and the C
side checks every one against the tensor's block count before stepping anything (optim_kernel.c:
check); FP8Optim checks loaded state against its parameter before it can reach the kernel. The
library reports the layout it was built for, checked on load (KERNEL_ABI): a mismatch makes it
unavailable like a failed build, and FP8Optim falls back to the compiled step (same update).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
from typing import Any, NamedTuple

import torch

from nanochat.fs import publish_file

KERNEL_SOURCE = pathlib.Path(__file__).with_name("optim_kernel.c")
KERNEL_FLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fno-math-errno", "-shared", "-fPIC")
# Threads: OpenMP when torch's intra-op threads are OpenMP (the kernel then runs on torch's own
# thread pool, see adam_parallel); without it, or if that build fails, -fopenmp-simd and a
# Python thread pool.
_THREADING = (("-fopenmp",), ("-fopenmp-simd",)) if "OpenMP" in torch.__config__.parallel_info() \
    else (("-fopenmp-simd",),)
_loaded: dict[str, Any] = {}  # "lib": the library, or "error": why it is unavailable (tried once)
_pool: list = []  # the Python thread pool, when the library has no OpenMP entry point

MASTER_MODES = {"fp32": 0, "bf16": 1, "bf16_sr": 2, "bf16_split": 3}  # optim_kernel.c: M_*


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [l.strip() for l in f if l.startswith(("model name", "flags", "Features", "CPU part"))]
        return "\n".join(dict.fromkeys(lines))  # the same lines repeat per core
    except OSError:
        return f"{platform.processor()} {platform.machine()} {torch.backends.cpu.get_cpu_capability()}"


class KernelRow(NamedTuple):
    """One tensor's buffers in the order of its row in the kernel's table (optim_kernel.c: the
    enum P..SALT); unused ones None. FP8 codes as uint8 [n_blocks, B] views, scales [n_blocks] fp32."""
    p: torch.Tensor
    g: torch.Tensor
    m_codes: torch.Tensor
    m_scale: torch.Tensor
    v: torch.Tensor | None  # fp32 second moment (level 1) ...
    v_codes: torch.Tensor | None  # ... or sqrt(v) in FP8 (level 2)
    v_scale: torch.Tensor | None
    lo: torch.Tensor | None = None  # bf16_split's int16 low halves
    ok: torch.Tensor | None = None  # guard: a one-byte CPU tensor, False leaves the tensor as it was
    h: torch.Tensor | None = None  # its row of adam_table
    salt: torch.Tensor | None = None  # its bf16_sr salt, a 0-dim uint32


TABLE_COLUMNS = ("lr", "beta1", "beta2", "eps", "weight_decay", "step_size", "bias_correction2_sqrt",
                 "1 - beta1", "1 - beta2", "1 - lr * weight_decay", "step")
"""The kernel's hyperparameters of a tensor, in its order (optim_kernel.c: h, NH)."""
KERNEL_ABI = (len(KernelRow._fields), len(TABLE_COLUMNS), 2)
"""(buffers per tensor, hyperparameters per tensor, version) this module calls the kernel with;
the compiled library must report the same (optim_kernel.c: nanochat_optim_abi)."""


def bind(lib: ctypes.CDLL, path: pathlib.Path) -> ctypes.CDLL:
    """`lib` with its entry points' argument types declared, after checking that it was built
    for KERNEL_ABI; RuntimeError naming the file otherwise (a stale or foreign build)."""
    got = (ctypes.c_int(), ctypes.c_int(), ctypes.c_int())  # stays (0, 0, 0) without the function
    if hasattr(lib, "nanochat_optim_abi"):
        lib.nanochat_optim_abi(*(ctypes.byref(x) for x in got))
    nargs, width, version = (x.value for x in got)
    if (nargs, width, version) != KERNEL_ABI:
        raise RuntimeError(
            f"the compiled FP8Optim kernel {path} was built for ABI v{version} with {nargs} buffers and {width} "
            f"hyperparameters per tensor; this nanochat expects v{KERNEL_ABI[2]} with {KERNEL_ABI[0]} and "
            f"{KERNEL_ABI[1]}; delete {path} to rebuild it")
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    table = [i64, ctypes.POINTER(ptr), ctypes.POINTER(i64), ctypes.POINTER(i64), i64, i64]  # n .. chunk
    lib.adam_dynamic.argtypes = [*table, ctypes.POINTER(i64), i64, i32, i32, i32]
    lib.adam_dynamic.restype = i64
    if hasattr(lib, "adam_parallel"):
        lib.adam_parallel.argtypes = [*table, i64, i32, i32, i32, i32]
        lib.adam_parallel.restype = i64
    return lib


def load() -> ctypes.CDLL:
    """The compiled kernel, built on first use; RuntimeError with the reason it is unavailable."""
    if os.environ.get("NANOCHAT_NATIVE_OPTIM", "1") == "0":
        raise RuntimeError("turned off by NANOCHAT_NATIVE_OPTIM=0")
    if "lib" in _loaded:
        return _loaded["lib"]
    if "error" in _loaded:
        raise RuntimeError(_loaded["error"])
    try:
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            raise RuntimeError("no C compiler (cc/gcc) on PATH")
        lib = _build(cc)
    except Exception as e:  # noqa: BLE001 - any build/load failure means "not available"
        detail = e.stderr.strip().splitlines()[-1] if isinstance(e, subprocess.CalledProcessError) and e.stderr else e
        _loaded["error"] = f"{type(e).__name__}: {detail}"
        raise RuntimeError(_loaded["error"]) from None
    _loaded["lib"] = lib
    return lib


def _build(cc: str) -> ctypes.CDLL:
    """Compile (or find in the cache) and bind the library, with OpenMP if it builds and links."""
    source = KERNEL_SOURCE.read_text()
    compiler = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "nanochat"
    cache.mkdir(parents=True, exist_ok=True)
    for threading in _THREADING:
        flags = (*KERNEL_FLAGS, *threading)
        key = hashlib.sha256("\0".join([source, " ".join(flags), cc, compiler, _cpu_identity(),
                                        platform.machine()]).encode()).hexdigest()[:16]
        so = cache / f"fp8optim-{key}.so"
        try:
            if not so.exists():
                # Built under a temporary name and renamed: concurrent processes (torchrun ranks)
                # may dlopen it, and must see no half-written library.
                publish_file(so, lambda out: subprocess.run(
                    [cc, *flags, "-o", str(out), str(KERNEL_SOURCE), "-lm"], check=True, capture_output=True,
                    text=True, timeout=120))
            return bind(ctypes.CDLL(str(so)), so)
        except (subprocess.CalledProcessError, OSError):
            if threading is _THREADING[-1]:
                raise  # else e.g. no libgomp to link: the build without OpenMP
    raise AssertionError("unreachable: the last threading choice re-raises")


def _extent(x: torch.Tensor | None) -> int:
    """Bytes from x's first element to the end of its allocation: all the kernel may touch
    through x's pointer (0 for None)."""
    if x is None:
        return 0
    return x.untyped_storage().nbytes() - x.storage_offset() * x.element_size()


def adam(tensors: list[tuple], h: torch.Tensor, block_size: int, decoupled: bool, v_fp8: bool, *,
         master: str = "fp32", salts: list[int] | None = None,
         oks: list[torch.Tensor | None] | None = None, lib: ctypes.CDLL | None = None) -> None:
    """Step every tensor in one kernel call per thread. tensors[t]: KernelRow's first fields
    (p, g, m codes, m scales, v fp32, v codes, v scales[, lo]) of tensor t, contiguous, the
    unused ones None; h is adam_table's [n_tensors, len(TABLE_COLUMNS)] fp32.

    master (nanochat.optim.master): "fp32" wants p and g fp32; the others bf16 p and g, the fp32
    update written back rounded to nearest even ("bf16"), stochastically with master's sr_bits of
    salts[t] (a uint32 per tensor) and the step in h ("bf16_sr"), or split into p and the int16
    remainder lo ("bf16_split", p joined with lo being the fp32 master it reads).
    oks[t]: None, or a 0-dim bool CPU tensor read by the kernel (no host sync): False leaves
    tensor t entirely unchanged (p, lo and the moments), e.g. after a non-finite gradient.
    lib: the loaded library (default: load()).

    RuntimeError when the kernel cannot do this block size (a caller may fall back); ValueError,
    with nothing stepped, when a buffer does not hold its tensor's blocks."""
    lib = lib or load()
    ptrs, sizes, nb, salt = _table(tensors, h, block_size, master, salts, oks)
    bad = _call(lib, ptrs, sizes, nb, block_size, decoupled, v_fp8, MASTER_MODES[master])
    del salt  # its memory is read by the kernel: alive until the call returned
    width = len(KernelRow._fields)
    if bad == 1:
        raise RuntimeError(f"FP8Optim native kernel refused block size {block_size} (a multiple of 8, at most 1024)")
    if bad:  # optim_kernel.c: 2 + NP t + k for buffer k of tensor t
        t, k = divmod(bad - 2, width)
        raise ValueError(f"FP8Optim native kernel: the {KernelRow._fields[k]} buffer of tensor {t} holds "
                         f"{sizes[width * t + k]} bytes, too few for its {nb[t]} blocks of {block_size}; "
                         "nothing was stepped")


def _table(tensors: list[tuple], h: torch.Tensor, block_size: int, master: str, salts: list[int] | None,
           oks: list[torch.Tensor | None] | None) -> tuple[ctypes.Array, ctypes.Array, ctypes.Array, Any]:
    """The kernel's arguments for `tensors` (see `adam`): every buffer's pointer and extent, row
    by row, and each tensor's block count, after checking what the C side cannot (dtypes, layout);
    and the salts' tensor, which the caller keeps alive while the kernel runs."""
    mode = MASTER_MODES[master]
    dtype = torch.float32 if mode == 0 else torch.bfloat16
    n, width = len(tensors), len(KernelRow._fields)
    if h.dtype != torch.float32 or tuple(h.shape) != (n, len(TABLE_COLUMNS)) or not h.is_contiguous():
        raise ValueError(f"the hyperparameter table must be contiguous float32 [{n}, {len(TABLE_COLUMNS)}], "
                         f"got {h.dtype} {tuple(h.shape)}")
    salt = None
    if mode == 2:
        if salts is None or len(salts) != n:
            raise ValueError("bf16_sr needs one salt per tensor")
        salt = torch.tensor([s & 0xFFFFFFFF for s in salts], dtype=torch.uint32)
    ptrs, sizes, nb = (ctypes.c_void_p * (width * n))(), (ctypes.c_int64 * (width * n))(), (ctypes.c_int64 * n)()
    for t, ts in enumerate(tensors):
        row = KernelRow(*ts)._replace(ok=None if oks is None else oks[t], h=h[t], salt=None if salt is None else salt[t])
        # the sizes are checked in C; a wrong dtype or layout would step the wrong values
        if row.p.dtype != dtype or row.g.dtype != dtype:
            raise TypeError(f"master={master!r} steps {dtype} parameters and gradients, "
                            f"got {row.p.dtype} and {row.g.dtype}")
        if (mode == 3) != (row.lo is not None) or (row.lo is not None and row.lo.dtype != torch.int16):
            raise TypeError("bf16_split (and only it) needs the int16 remainder lo of each tensor")
        if row.ok is not None and (row.ok.device.type != "cpu" or row.ok.element_size() != 1):
            raise TypeError(f"the guard flag must be a one-byte CPU tensor, got {row.ok.dtype} on {row.ok.device}")
        if not all(x is None or x.is_contiguous() for x in row):
            raise ValueError(f"tensor {t}: the native kernel reads contiguous buffers only")
        ptrs[width * t:width * (t + 1)] = [None if x is None else x.data_ptr() for x in row]
        sizes[width * t:width * (t + 1)] = [_extent(x) for x in row]
        nb[t] = row.p.numel() // block_size
    return ptrs, sizes, nb, salt


def _call(lib: ctypes.CDLL, ptrs, sizes, nb, block_size: int, decoupled: bool, v_fp8: bool, mode: int) -> int:
    """Run the kernel over the table on this many threads; its status (0: stepped)."""
    n, total = len(nb), sum(nb)
    threads = min(torch.get_num_threads(), max(1, total // 512))  # >= 128K elements per thread
    # 128 blocks (32K elements) a take: ~0.1 ms of work, so a late thread delays the step by
    # at most that much, and the shared counter is touched ~500 times for 16M parameters
    if hasattr(lib, "adam_parallel"):  # on torch's OpenMP threads
        return lib.adam_parallel(n, ptrs, sizes, nb, total, 128, block_size, int(decoupled), int(v_fp8), mode,
                                 threads)
    next_block = ctypes.c_int64(0)
    args = (n, ptrs, sizes, nb, total, 128, ctypes.byref(next_block), block_size, int(decoupled), int(v_fp8), mode)
    jobs = []
    if threads > 1:  # the calling thread works too
        if not _pool or _pool[0]._max_workers < threads - 1:
            from concurrent.futures import ThreadPoolExecutor
            _pool[:] = [ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="fp8optim")]
        jobs = [_pool[0].submit(lib.adam_dynamic, *args) for _ in range(threads - 1)]
    bad = lib.adam_dynamic(*args)
    return bad or max([job.result() for job in jobs], default=0)  # all end before the tensors may be freed


def adam_table(steps: list[torch.Tensor], groups: list[dict]) -> torch.Tensor:
    """The kernel's hyperparameters, [n_tensors, len(TABLE_COLUMNS)] fp32, computed on the host
    from the (CPU) step counts without reading them into Python; bias corrections and 1 - beta in
    float64, as torch computes them. The step count itself (exact in fp32 below 2^24 steps) keys
    bf16_sr's random bits."""
    s = torch.stack(steps).to(torch.float64)
    lr, b1, b2, eps, wd = (torch.tensor(col, dtype=torch.float64) for col in zip(*(
        (float(g["lr"]), float(g["betas"][0]), float(g["betas"][1]), float(g["eps"]), float(g["weight_decay"]))
        for g in groups)))
    cols = {"lr": lr, "beta1": b1, "beta2": b2, "eps": eps, "weight_decay": wd, "step_size": lr / (1 - b1**s),
            "bias_correction2_sqrt": (1 - b2**s).sqrt(), "1 - beta1": 1 - b1, "1 - beta2": 1 - b2,
            "1 - lr * weight_decay": 1 - lr * wd, "step": s}
    return torch.stack([cols[c] for c in TABLE_COLUMNS], dim=1).float().contiguous()


__all__ = ["KERNEL_ABI", "KERNEL_FLAGS", "KERNEL_SOURCE", "KernelRow", "TABLE_COLUMNS", "adam", "adam_table", "bind",
           "load"]
