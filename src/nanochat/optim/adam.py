"""Adam(W): the one step, written once over moment formats, and its native CPU kernel.

A wrapper (wrapper.py) steps a parameter here when the wrapped torch optimizer cannot: its
moments are stored in another format (moments/), its weights are bf16 masters (master.py), or
it steps inside the backward with a guard (in_backward.py). `adam_step` is torch's math in fp32;
a format only says how a moment is read and written back (its four static functions), as
torchao's optim/adam.py keeps one `single_param_adam`. `adam_multi` steps a list of same-shape
tensors in one compiled call. On CPU, e4m3 moments of fp32 or bf16 parameters are stepped by
adam_kernel.c instead (one call for every tensor of a step; why C: docs/design.md), with the
same formulas. `ok` (None or a 0-dim bool) leaves a parameter and its state as they were.
"""

from __future__ import annotations

import ctypes
import pathlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .backends import extent, host_scalar, load_native
from .master import read_master, round_rne, sr_bits, write_master
from .moments import C_CODEC, E4M3Blocks, MomentFormat

MOMENTS = 2
"""Moments Adam keeps per parameter (exp_avg, then the second): what a format is asked to store."""



def adam_step(p, g, m, v, lo, step, lr, beta1, beta2, eps, wd, salt, ok, *, decoupled: bool, master: str,
              emulate: bool = False, m_format: type = MomentFormat, v_format: type = MomentFormat):
    """Adam(W) on one parameter: m and v as their formats store them. The update is computed in
    fp32 from the fp32 master (p, or p and its low half `lo` under bf16_split) and written back as
    `master` says (master.py); `salt` (a 0-dim int64) seeds bf16_sr's bits. emulate: p is an fp32
    tensor holding bf16 values; the gradient is rounded to bf16 first."""
    # as torch's Adam: bias corrections in float64 (0-dim tensors)
    step_size = lr / (1 - beta1**step)
    bc2_sqrt = (1 - beta2**step).sqrt()
    pf = read_master(p, lo)
    gf = round_rne(g.float()) if emulate else g.float()
    if not decoupled:  # Adam's L2 penalty goes into the gradient (torch: grad.add(param, alpha=wd))
        gf = gf + wd * pf
    m_old = m_format.read(m)
    m_new = m_old + (1 - beta1) * (gf - m_old)  # torch: exp_avg.lerp_(grad, 1 - beta1), its weight < 0.5 branch
    v_new = v_format.read_sq(v) * beta2 + (1 - beta2) * gf * gf
    r = v_new.sqrt()
    tie = m_format.write(m, m_new, ok) + v_format.write_sq(v, v_new, r, ok)
    pf_new = pf * (1 - lr * wd) if decoupled else pf  # torch: param.mul_(1 - lr * wd)
    upd = step_size * m_new / (r / bc2_sqrt + eps)  # torch: addcdiv_(exp_avg, denom, -step_size)
    new = pf_new - upd + tie
    if ok is not None:  # the old master is exactly representable: writing it back changes nothing
        new = torch.where(ok, new, pf)
    bits = sr_bits(salt, step, p.shape) if master == "bf16_sr" else None
    write_master(p, new, master, lo=lo, bits16=bits)


def adam_multi(ps, gs, ms, vs, los, steps, hypers, salts, oks, *, decoupled: bool, master: str,
               emulate: bool = False, m_format: type = MomentFormat, v_format: type = MomentFormat):
    """adam_step over lists of same-shape tensors: one compiled graph, one call for all of them.
    hypers[i] = (lr, beta1, beta2, eps, weight_decay) of tensor i's param group; los, salts and
    oks are empty lists when the call does not use them."""
    for i in range(len(ps)):
        adam_step(ps[i], gs[i], ms[i], vs[i], los[i] if los else None, steps[i], *hypers[i],
                  salts[i] if salts else None, oks[i] if oks else None, decoupled=decoupled, master=master,
                  emulate=emulate, m_format=m_format, v_format=v_format)


def adam_hypers(group: dict) -> tuple[torch.Tensor, ...]:
    """(lr, beta1, beta2, eps, weight_decay) of an Adam param group, as host scalars."""
    return tuple(host_scalar(x) for x in (group["lr"], group["betas"][0], group["betas"][1], group["eps"],
                                          group["weight_decay"]))


@dataclass(kw_only=True)
class AdamTensor:
    """One parameter's Adam step as a backend sees it: this rank's shard; with a block format, p,
    g and lo as [n_blocks, B] views, else every tensor in p's shape."""

    p: torch.Tensor
    g: torch.Tensor
    step: torch.Tensor
    """The state's 0-dim float32 step count, on p's device."""
    group: dict
    salt: int
    """bf16_sr's salt of the parameter (master.py: sr_salt)."""
    decoupled: bool
    """AdamW's weight decay (else Adam's L2 penalty)."""
    ok: torch.Tensor | None
    """The in-backward guard: a 0-dim bool, False leaves p and its state as they were."""
    m: tuple[torch.Tensor, ...] = ()
    v: tuple[torch.Tensor, ...] = ()
    m_format: type = MomentFormat
    v_format: type = MomentFormat
    lo: torch.Tensor | None = None
    """bf16_split's int16 low halves of the fp32 master."""
    native: bool = False
    """The native kernel can step it (`native_ok`: e4m3 moments, this device and these dtypes)."""

    def bucket(self, *, native: bool) -> tuple:
        """Which call steps this tensor: tensors with equal keys are stepped by one call. A native
        kernel takes every shape in one call per weight-decay kind and v format (its guard is per
        tensor); a compiled call is one graph, so its key holds every flag of the graph, the
        guard's presence included, and the device, dtypes and shape."""
        if native:
            return ("native", self.decoupled, self.v_format)
        return ("compiled", self.decoupled, self.m_format, self.v_format, self.ok is not None, self.p.device,
                self.p.dtype, self.g.dtype, tuple(self.p.shape))


# ------------------------------------------------------------------------------ the native kernel
# The kernel writes through raw pointers, so nothing it is given may be smaller than it believes:
# each buffer goes with the bytes its allocation holds from that pointer on, checked in C against
# the tensor's block count before anything is stepped (adam_kernel.c: check); loaded state was
# checked against its parameter before (saved_state.check_loaded); and the library reports the
# layout it was built for, checked on load (KERNEL_ABI, `bind`): a mismatch makes it unavailable.
KERNEL_SOURCE = pathlib.Path(__file__).with_name("adam_kernel.c")
MASTER_MODES = {"fp32": 0, "bf16": 1, "bf16_sr": 2, "bf16_split": 3}  # adam_kernel.c: M_*
_pool: list = []  # a Python thread pool, for a library built without OpenMP (no adam_parallel)


class KernelRow(NamedTuple):
    """One tensor's buffers in the order of its row in the kernel's table (adam_kernel.c: the
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
"""The kernel's hyperparameters of a tensor, in its order (adam_kernel.c: h, NH)."""
KERNEL_ABI = (len(KernelRow._fields), len(TABLE_COLUMNS), 2)
"""(buffers per tensor, hyperparameters per tensor, version) this module calls the kernel with;
the compiled library must report the same (adam_kernel.c: nanochat_optim_abi)."""


def bind(lib: ctypes.CDLL, path: pathlib.Path) -> ctypes.CDLL:
    """`lib` with its entry points' argument types declared, after checking that it was built
    for KERNEL_ABI; RuntimeError naming the file otherwise (a stale or foreign build)."""
    got = (ctypes.c_int(), ctypes.c_int(), ctypes.c_int())  # stays (0, 0, 0) without the function
    if hasattr(lib, "nanochat_optim_abi"):
        lib.nanochat_optim_abi(*(ctypes.byref(x) for x in got))
    nargs, width, version = (x.value for x in got)
    if (nargs, width, version) != KERNEL_ABI:
        raise RuntimeError(
            f"the compiled Adam kernel {path} was built for ABI v{version} with {nargs} buffers and {width} "
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


def native_ok(t: AdamTensor, fmt: MomentFormat, *, master: str, emulate: bool) -> bool:
    """The native kernel can step `t`: e4m3 moments (fmt) of fp32 parameters (bf16 ones with a
    bf16 master mode) on CPU, a block size it takes, no emulated bf16."""
    dtype = torch.float32 if master == "fp32" else torch.bfloat16
    return (isinstance(fmt, E4M3Blocks) and not emulate and t.p.device.type == "cpu" and t.p.dtype == dtype
            and t.g.dtype == dtype and fmt.block_size <= 1024)


def native_step(items: list[AdamTensor], block_size: int, *, master: str) -> None:
    """One kernel call for the AdamTensors `items` (one `bucket(native=True)`); RuntimeError when
    the kernel is unavailable."""
    table = adam_table([t.step for t in items], [t.group for t in items])
    adam([_kernel_row(t) for t in items], table, block_size, items[0].decoupled,
         items[0].v_format is E4M3Blocks, master=master, salts=[t.salt for t in items], oks=[t.ok for t in items])


def _kernel_row(t: AdamTensor) -> KernelRow:
    """An e4m3-moment tensor's buffers in the kernel's order."""
    v32, v_codes, v_scale = (None, *t.v) if t.v_format is E4M3Blocks else (t.v[0], None, None)
    return KernelRow(t.p, t.g, *t.m, v32, v_codes, v_scale, t.lo)


def load_kernel() -> ctypes.CDLL:
    """adam_kernel.c, built on first use (backends.load_native); RuntimeError: unavailable."""
    return load_native(KERNEL_SOURCE, bind, headers=(C_CODEC,))


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
    lib: the loaded library (default: load_kernel()).

    RuntimeError when the kernel cannot do this block size (a caller may fall back); ValueError,
    with nothing stepped, when a buffer does not hold its tensor's blocks."""
    lib = lib or load_kernel()
    ptrs, sizes, nb, salt = _table(tensors, h, block_size, master, salts, oks)
    bad = _call(lib, ptrs, sizes, nb, block_size, decoupled, v_fp8, MASTER_MODES[master])
    del salt  # its memory is read by the kernel: alive until the call returned
    width = len(KernelRow._fields)
    if bad == 1:
        raise RuntimeError(f"the native Adam kernel refused block size {block_size} (a multiple of 8, at most 1024)")
    if bad:  # adam_kernel.c: 2 + NP t + k for buffer k of tensor t
        t, k = divmod(bad - 2, width)
        raise ValueError(f"the native Adam kernel: the {KernelRow._fields[k]} buffer of tensor {t} holds "
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
        sizes[width * t:width * (t + 1)] = [extent(x) for x in row]
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
            _pool[:] = [ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="adam-kernel")]
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


__all__ = ["KERNEL_ABI", "KERNEL_SOURCE", "MOMENTS", "TABLE_COLUMNS", "AdamTensor", "KernelRow", "adam", "adam_hypers", "adam_multi",
           "adam_step", "adam_table", "bind", "load_kernel", "native_ok", "native_step"]
