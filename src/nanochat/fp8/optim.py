"""FP8Optim: Adam/AdamW/SGD-momentum with the optimizer state stored in FP8.

    opt = FP8Optim(torch.optim.AdamW(model.param_groups(0.1), lr=3e-4, fused=False), opt_level=2)
    ...loss.backward(); opt.step(); opt.zero_grad()   # schedulers, state_dict: as usual

It *wraps* a constructed torch optimizer instead of re-implementing one. FP8Optim is a
`torch.optim.Optimizer` whose `param_groups` and `state` are the wrapped optimizer's own objects,
so an LR scheduler (or the trainer writing `param_groups[i]["lr"]`) drives both, and hyper-
parameters are read from the groups at every step. Levels:

    0  both moments fp32: the wrapped optimizer steps everything itself (it is the reference)
    1  first moment (Adam exp_avg, SGD momentum_buffer) in FP8 e4m3, second moment fp32
    2  both moments in FP8 (~2.03 bytes/param instead of 8)

Which tensors stay fp32: a parameter goes FP8 only if it has >= `min_numel` (4096, the rule of
bitsandbytes and torchao: below that the state is negligible and the per-call cost dominates)
elements, a multiple of `block_size` (256, see tensor.py) of them, and is contiguous. Those that
stay fp32 are stepped by the wrapped optimizer (their grads are hidden from it while we step the
FP8 ones), so they follow torch's math exactly; a one-time summary says how many and why.

The second moment. Plain absmax-scaled e4m3 storage of v = EMA(g^2) flushes every v below
absmax(block) * 2^-17.8 (448 / smallest subnormal 2^-9) to zero; since v is the *square*, that
is only ~9 binary orders of |g| inside a 256-element block, and an element whose v flushed while
its m survives gets m / (0 + eps), the low-bit optimizer "zero-point problem". We store
r = sqrt(v) instead, in e4m3 with block scales, and never round a positive r to zero (its code is
floored at the smallest subnormal):
- sqrt halves the exponent range: e4m3 covers ~17.8 binary orders of |g| per block;
- precision: 2^-4 relative on sqrt(v) (the quantity the update divides by), the same as v in
  e5m2 (2^-3 on v is 2^-4 on sqrt(v)) with more range than e5m2's (15.9 orders of |g|);
- the floor turns "flushed to zero" into "overestimated": such an element gets a smaller update
  than Adam's instead of m / eps. Measured on 16K elements whose blocks span |g| 1e-8..1e2, 300
  steps: worst update 3.2 * lr (fp32 Adam: 1.4), against 1e4 without the floor, 1e5 for v in
  e5m2 and 7e6 for v in e4m3; median error 0.036 * lr, also the lowest of the four;
- the step needs sqrt(v) anyway for the denominator, so storing it costs no extra math.
The study (`scripts/bench_optim.py --study`, figures in BENCHMARKS.md) runs the four options on
the same gradient streams, two gradient distributions and two beta2.

The step: decode the codes -> fp32 math -> write p, the new codes and scales in place, with no
full-size temporaries, for all FP8-state parameters at once. Three implementations:
- native (default for fp32 Adam/AdamW parameters on CPU): the C kernel in optim_kernel.c, built on
  first use (kernel.py), once per step for every tensor (blocks split across threads). ~5x faster
  on CPU than the compiled version (BENCHMARKS.md 3(b)).
- compile: `torch.compile(fullgraph=True, dynamic=False)` of `_adam_multi`/`_sgd_multi` over the
  list of same-shape tensors: one compiled call per (shape, dtype, device), not per parameter
  (used on GPU, for SGD, for bf16 parameters, or if the C build fails).
- eager: the same Python functions run eagerly (`compile=False`, or when compilation fails).
Nothing in the step reads a device value into Python or copies to or from the device:
hyperparameters are 0-dim CPU tensors (a changing lr does not recompile), step counts 0-dim
tensors on the parameter's device. Every
fallback is logged once with its reason and kept in `fallbacks`.

bf16 master weights (`master_weights`, master.py): bf16 parameters and gradients, the update
computed in fp32 and written back rounded to nearest, stochastically, or split with a 16-bit
remainder kept in the state ("master_lo"). FP8Optim then steps every parameter itself (those
too small for FP8 with fp32 moments), in the same three implementations; so it does after
`step_in_backward()`, which runs each parameter's step from its post-accumulate-grad hook and
frees the gradient (a parameter whose gradient is not finite is left as it was, decided on the
device).

Under FSDP2 (nanochat/distributed.py) a parameter is a DTensor holding this rank's rows. The
step works on the local shard (`_local`: p, its gradient and its states), so the kernels and
their compiled graphs are the single-process ones; states are created for the shard and kept as
DTensors laid out like their parameter (`_like`), which is what `get_optimizer_state_dict` and
DCP need to save each rank's part and to reshard it on load. Which parameters get FP8 state is
decided on the *global* shape (`p.numel()` of a DTensor is the full tensor's), so precision does
not depend on the world size. A shard must also be a whole number of blocks: always true when a
row is (a row of 64*d elements for the presets d4, d8, d12, d20: any world size), else when
rows-per-shard x row length is (d2, d6, d26 split evenly in 2 or 4); otherwise that tensor keeps
fp32 state (on every rank: the rule reads the global shape) and the summary says why.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from nanochat.common import format_bytes, logger, warn_once

from . import kernel
from .kernel import KernelRow
from .master import MASTER_WEIGHTS, bytes_per_param, read_master, round_rne, sr_bits, sr_salt, write_master
from .tensor import DEFAULT_BLOCK_SIZE, FP8Tensor, decode, encode, fp8_max

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed: no parameter is a DTensor
    DTensor = ()  # isinstance(x, ()) is always False

E4M3 = torch.float8_e4m3fn
MIN_NUMEL = 4096  # bitsandbytes/torchao rule: smaller tensors keep fp32 state
SUPPORTED = "torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD"
_INV_E4M3_MAX = 1.0 / fp8_max(E4M3)


# ---------------------------------------------------------------------------------------------
# Fused steps. All tensors are 2-D [n_blocks, B] views (codes as uint8), scales [n_blocks].
# Hyperparameters are 0-dim float64 CPU tensors, as in torchao's optimizers: a changing lr does
# not recompile, and on a GPU the compiled kernels take them as scalar arguments read on the
# host, so nothing is copied to the device or read back from it. Step counts are 0-dim float32
# tensors on the parameter's device (the bias corrections are computed where they are used).
# ---------------------------------------------------------------------------------------------


def _requantize(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, *, floor: bool,
                ok: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, B] fp32 -> codes (uint8 e4m3) and scale, in place; returns the new scale.
    floor: a positive x never becomes code 0 (the smallest subnormal instead).
    ok: a 0-dim bool; False keeps the old codes and scale (a guarded step that is skipped)."""
    amax = x.abs().amax(dim=-1)  # [n]
    new_scale = torch.where(amax > 0, amax * _INV_E4M3_MAX, 1.0)
    inv = torch.where(amax > 0, fp8_max(E4M3) / amax, 1.0)
    q = encode(x * inv[:, None], E4M3)
    if floor:
        q = torch.where((x > 0) & (q == 0), 1, q).to(torch.uint8)
    if ok is not None:
        q = torch.where(ok, q, codes)
        new_scale = torch.where(ok, new_scale, scale)
    codes.copy_(q)
    scale.copy_(new_scale)
    return new_scale


def _adam_step(p, g, m_codes, m_scale, m32, v32, v_codes, v_scale, lo, step, lr, beta1, beta2, eps, wd,
               salt, ok, *, decoupled: bool, m_fp8: bool, v_fp8: bool, master: str, emulate: bool = False):
    """Adam(W) on one parameter. Moments: m in FP8 (m_codes, m_scale) or fp32 (m32); v in FP8 as
    sqrt(v) (v_codes, v_scale) or fp32 (v32). FP8 moments come as [n_blocks, B] views, fp32 ones in
    any shape equal to p's. The update is computed in fp32 from the fp32 master (p, or p and its
    low half `lo` under bf16_split) and written back as `master` says (master.py); `salt` (a
    0-dim int64) seeds bf16_sr's bits. ok: None, or a 0-dim bool that, when False, leaves p and
    every state as it was (the optimizer-in-backward guard against a non-finite gradient).
    emulate: p is an fp32 tensor holding bf16 values; the gradient is rounded to bf16 first."""
    # as torch's Adam: bias corrections in float64 (0-dim tensors)
    step_size = lr / (1 - beta1**step)
    bc2_sqrt = (1 - beta2**step).sqrt()
    pf = read_master(p, lo)
    gf = round_rne(g.float()) if emulate else g.float()
    if not decoupled:  # Adam's L2 penalty goes into the gradient (torch: grad.add(param, alpha=wd))
        gf = gf + wd * pf
    m = decode(m_codes, E4M3) * m_scale[:, None] if m_fp8 else m32
    m = m + (1 - beta1) * (gf - m)  # torch: exp_avg.lerp_(grad, 1 - beta1), its weight < 0.5 branch
    if v_fp8:
        r_old = decode(v_codes, E4M3) * v_scale[:, None]  # stored sqrt(v)
        vv = r_old * r_old * beta2 + (1 - beta2) * gf * gf
    else:
        vv = v32 * beta2 + (1 - beta2) * gf * gf
    r = vv.sqrt()
    tie = 0.0
    if m_fp8:
        # `+ 0 * scale`: makes the parameter write depend on the per-block absmax, so inductor
        # fuses it into the same loop as the code writes (one pass) instead of a third pass over
        # p through a full-size temporary (16M params on 2 loaded CPU cores: 768 -> 576 ms a step,
        # BENCHMARKS.md section 3)
        tie = 0.0 * _requantize(m, m_codes, m_scale, floor=False, ok=ok)[:, None]
    else:
        m32.copy_(m if ok is None else torch.where(ok, m, m32))
    if v_fp8:
        tie = tie + 0.0 * _requantize(r, v_codes, v_scale, floor=True, ok=ok)[:, None]
    else:
        v32.copy_(vv if ok is None else torch.where(ok, vv, v32))
    if decoupled:  # torch: param.mul_(1 - lr * wd)
        pf_new = pf * (1 - lr * wd)
    else:
        pf_new = pf
    upd = step_size * m / (r / bc2_sqrt + eps)  # torch: addcdiv_(exp_avg, denom, -step_size)
    new = pf_new - upd + tie
    if ok is not None:  # the old master is exactly representable: writing it back changes nothing
        new = torch.where(ok, new, pf)
    bits = sr_bits(salt, step, p.shape) if master == "bf16_sr" else None
    write_master(p, new, master, lo=lo, bits16=bits)


def _adam_multi(ps, gs, m_codes, m_scales, m32s, v32s, v_codes, v_scales, los, steps, hypers, salts, oks,
                decoupled: bool, m_fp8: bool, v_fp8: bool, master: str, emulate: bool = False):
    """_adam_step over lists of same-shape tensors: one compiled graph, one call for all of them.
    hypers[i] = (lr, beta1, beta2, eps, weight_decay) of tensor i's param group; a representation
    a call does not use comes as an empty list."""
    def at(xs, i):
        return xs[i] if xs else None

    for i in range(len(ps)):
        _adam_step(ps[i], gs[i], at(m_codes, i), at(m_scales, i), at(m32s, i), at(v32s, i), at(v_codes, i),
                   at(v_scales, i), at(los, i), steps[i], *hypers[i], at(salts, i), at(oks, i),
                   decoupled=decoupled, m_fp8=m_fp8, v_fp8=v_fp8, master=master, emulate=emulate)


def _sgd_step(p, g, b_codes, b_scale, lr, momentum, dampening, wd, first: bool, nesterov: bool):
    """SGD with momentum on one parameter, buffer in FP8; `first`: the buffer's first step."""
    pf = p.float()
    d_p = g.float() + wd * pf
    if first:  # torch: buf = clone(d_p)
        buf = d_p
    else:  # torch: buf.mul_(momentum).add_(d_p, alpha=1 - dampening)
        buf = decode(b_codes, E4M3) * b_scale[:, None] * momentum + (1 - dampening) * d_p
    new_scale = _requantize(buf, b_codes, b_scale, floor=False)
    d = d_p + momentum * buf if nesterov else buf
    p.copy_(pf - lr * d + 0.0 * new_scale[:, None])  # `+ 0 * scale`: see _adam_step


def _sgd_multi(ps, gs, b_codes, b_scales, hypers, first: bool, nesterov: bool):
    """_sgd_step over lists of same-shape tensors; hypers[i] = (lr, momentum, dampening, wd)."""
    for i in range(len(ps)):
        _sgd_step(ps[i], gs[i], b_codes[i], b_scales[i], *hypers[i], first=first, nesterov=nesterov)


def _host_scalar(x) -> torch.Tensor:
    """A hyperparameter as a 0-dim float64 tensor; one that already is a tensor stays where it is
    (reading it back to the host would wait for the device)."""
    if torch.is_tensor(x):
        return x.detach().to(torch.float64)
    return torch.tensor(float(x), dtype=torch.float64)


def _local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: the local shard of a DTensor (FSDP2 parameters, gradients,
    and the states made for them), with torchao's FP8 all-gather weight wrapper
    (WeightWithDynamicFloat8CastTensor, one inner tensor) unwrapped, so kernels see plain tensors."""
    if isinstance(t, DTensor):
        t = t.to_local()
    if type(t) not in (torch.Tensor, torch.nn.Parameter, FP8Tensor) and hasattr(t, "__tensor_flatten__"):
        inner, _ = t.__tensor_flatten__()
        if len(inner) == 1:
            t = getattr(t, inner[0])
    return t


def _shard_problem(p: DTensor, block_size: int) -> str | None:
    """Why the shards of `p` are not whole blocks on every rank, or None. Decided from the global
    shape, so all ranks agree: FSDP2 shards dim 0 like torch.chunk, ceil(rows / ranks) rows per
    rank (the last rank fewer, and whole blocks too when the full tensor and the others are)."""
    from torch.distributed.tensor import Shard

    if tuple(p.placements) != (Shard(0),):
        return f"sharded as {tuple(p.placements)}; FP8 state needs rows split across one mesh dim"
    rows = p.shape[0]
    chunk = -(-rows // p.device_mesh.size())  # ceil
    if chunk * (p.numel() // rows) % block_size:
        return (f"a shard of {chunk} rows x {p.numel() // rows} is not whole {block_size}-element "
                f"blocks at {p.device_mesh.size()} ranks")
    return None


def _like(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A state made for this rank's shard of `p`, as a DTensor laid out like `p` (what DCP saves
    and reshards); unchanged for a plain parameter."""
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                  run_check=False)
    return local


def quantize_sqrt_v(v: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE) -> FP8Tensor:
    """fp32 second moment v -> FP8Tensor of sqrt(v), positive values never flushed to zero: the
    step's own requantizer, so a converted state is stored as a stepped one would be."""
    out = FP8Tensor.zeros(v.shape, dtype=E4M3, block_size=block_size, device=v.device)
    r = v.detach().float().clamp(min=0).sqrt().reshape(-1, block_size)
    _requantize(r, out.codes.view(torch.uint8).view(-1, block_size), out.scale, floor=True)
    return out


def optimizer_bytes(numel: int, *, fp8_moments: int, moments: int = 2, block_size: int = DEFAULT_BLOCK_SIZE,
                    moment_bytes: int = 4) -> int:
    """Bytes of the moments of one tensor of `numel` elements (Adam 2, SGD with momentum 1): the
    first `fp8_moments` in FP8 (a byte per element and an fp32 scale per block), the others
    `moment_bytes` per element. The one formula behind the memory plan, FP8Optim's planned
    bytes and its summary."""
    return fp8_moments * (numel + numel // block_size * 4) + (moments - fp8_moments) * numel * moment_bytes


def fp8_size_problem(numel: int, block_size: int = DEFAULT_BLOCK_SIZE, min_numel: int = MIN_NUMEL) -> str | None:
    """Why a tensor of `numel` elements keeps fp32 moments whatever its layout, or None."""
    if numel < min_numel:
        return f"numel < {min_numel}"
    if numel % block_size:
        return f"numel % {block_size} != 0"
    return None


@dataclass(kw_only=True)
class _AdamTensor:
    """One parameter's Adam step as the kernels see it: this rank's shard; with FP8 moments, p, g,
    lo and a fp32 v as [n_blocks, B] views and the codes as uint8 views of the same shape,
    else every tensor in p's shape. A representation the parameter does not use is None."""

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
    """step_in_backward's guard: a 0-dim bool, False leaves p and its state as they were."""
    native: bool
    """The native kernel can step it (FP8 moments, CPU, the kernel's dtypes)."""
    m_codes: torch.Tensor | None = None
    m_scale: torch.Tensor | None = None
    m32: torch.Tensor | None = None
    v32: torch.Tensor | None = None
    v_codes: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    lo: torch.Tensor | None = None
    """bf16_split's int16 low halves of the fp32 master."""

    MULTI_ARGS = ("p", "g", "m_codes", "m_scale", "m32", "v32", "v_codes", "v_scale", "lo")
    """_adam_multi's first arguments (lists of these fields)."""

    @property
    def m_fp8(self) -> bool:
        return self.m_codes is not None

    @property
    def v_fp8(self) -> bool:
        return self.v_codes is not None

    def kernel_row(self) -> KernelRow:
        return KernelRow(self.p, self.g, self.m_codes, self.m_scale, self.v32, self.v_codes, self.v_scale, self.lo)


def _bucket(t: _AdamTensor, *, native: bool) -> tuple:
    """Which call steps `t`: tensors with equal keys are stepped by one call. The native kernel
    takes every shape in one call per weight-decay kind (its guard is per tensor); a compiled
    call is one graph, so its key holds every flag of the graph, the guard's presence included,
    and the device, dtypes and shape."""
    if native:
        return ("native", t.decoupled, t.v_fp8)
    return ("compiled", t.decoupled, t.m_fp8, t.v_fp8, t.ok is not None, t.p.device, t.p.dtype, t.g.dtype,
            tuple(t.p.shape))


class FP8Optim(torch.optim.Optimizer):
    """Takes over the step of a torch AdamW/Adam/SGD and keeps its moments in FP8.

    Args:
        optimizer: a constructed torch.optim.AdamW, Adam or SGD (its param_groups are shared).
        opt_level: 0 fp32 moments; 1 first moment FP8; 2 both moments FP8 (SGD: 1 and 2 agree).
        block_size: elements per scale (256: see tensor.py for the bytes/param arithmetic).
        min_numel: parameters with fewer elements keep fp32 state.
        compile: False forces the eager step (same as backend="eager").
        master_weights: "fp32" (the parameters are the masters), or "bf16", "bf16_sr",
            "bf16_split": bf16 parameters updated as master.py describes; FP8Optim then steps
            every parameter itself (fp32 moments where FP8 ones do not apply).
        seed: seeds bf16_sr's random bits (with each parameter's position and step).
        emulate: bf16 master numerics on fp32 parameters (holding bf16 values; gradients rounded
            to bf16 in the step): for models that must compute in fp32. No memory saved.
        backend: how the FP8 step runs. "auto": the native C kernel for fp32 Adam(W) parameters
            on CPU, torch.compile otherwise; "native" / "compile" / "eager" force one (a
            backend that cannot run falls back to the next, native -> compile -> eager, logged once).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, opt_level: int = 2, *,
                 block_size: int = DEFAULT_BLOCK_SIZE, min_numel: int = MIN_NUMEL,
                 compile: bool = True, backend: str = "auto", master_weights: str = "fp32",
                 seed: int = 0, emulate: bool = False) -> None:
        kind = type(optimizer)
        if kind not in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
            raise TypeError(
                f"FP8Optim wraps {SUPPORTED} (exactly these classes); got {kind.__module__}."
                f"{kind.__qualname__}. Construct one of those and pass it in."
            )
        if opt_level not in (0, 1, 2):
            raise ValueError(f"opt_level must be 0 (fp32 moments), 1 (first moment FP8) or 2 "
                             f"(both moments FP8); got {opt_level!r}")
        if block_size <= 0 or block_size % 8:
            raise ValueError(f"block_size must be a positive multiple of 8, got {block_size}")
        # Optimizer.__init__ installs the hook dicts and step profiling; then share the objects
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.optimizer = optimizer
        self.opt_level = opt_level
        self.block_size = block_size
        self.min_numel = max(min_numel, block_size)
        self.is_sgd = kind is torch.optim.SGD
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        if backend not in ("auto", "native", "compile", "eager"):
            raise ValueError(f"backend must be auto, native, compile or eager; got {backend!r}")
        self._native = compile and backend in ("auto", "native")
        self._adamw = kind is torch.optim.AdamW
        self._compile = compile and backend != "eager"
        self._compiled: dict[str, Any] = {}
        self._backends: dict[str, tuple[int, int]] = {}  # the last step's, see step_backends
        self._summary_logged = False
        self.fallbacks: list[str] = []
        """Each fallback this optimizer took (native kernel unavailable, compile failed), with its
        reason; the trainer copies them into TrainResult.fallbacks."""
        if master_weights not in MASTER_WEIGHTS:
            raise ValueError(f"master_weights must be one of {', '.join(MASTER_WEIGHTS)}; got {master_weights!r}")
        if master_weights != "fp32" and self.is_sgd:
            raise ValueError(f"master_weights={master_weights!r} supports Adam and AdamW; with torch.optim.SGD "
                             "keep fp32 master weights")
        self.master_weights = master_weights
        self.emulate = emulate and master_weights != "fp32"
        # bf16 masters: every parameter is stepped here (the wrapped optimizer would round to
        # nearest and keep bf16 moments); so is every one stepped inside the backward
        self._own = master_weights != "fp32"
        # bf16_sr: each parameter's salt from its position in the groups (stable across runs)
        self._seed = seed
        self._salts = self._make_salts()
        self._bwd: torch.Tensor | None = None  # step_in_backward's per-backward sums
        self._bwd_params = 0  # parameters with a step_in_backward hook
        self.max_live_grad_bytes = 0
        """step_in_backward: the largest gradient seen (the most gradient memory alive at once)."""
        self._check_groups()

    def _make_salts(self) -> dict:
        return {p: sr_salt(self._seed, i) for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    # ---- configuration checks ----------------------------------------------------------------

    def _check_groups(self) -> None:
        for i, group in enumerate(self.param_groups):
            bad = [k for k in ("amsgrad", "maximize", "capturable", "differentiable")
                   if group.get(k, False)]
            if bad:
                raise ValueError(
                    f"FP8Optim does not support {', '.join(f'{k}=True' for k in bad)} (param group "
                    f"{i}). Supported: {SUPPORTED} with lr/betas/eps/weight_decay (Adam, AdamW), "
                    "momentum/dampening/nesterov/weight_decay (SGD), foreach/fused as you like. "
                    "Turn the option off or use the plain torch optimizer."
                )
            for p in group["params"]:
                if p.is_complex():
                    raise ValueError(f"FP8Optim supports real parameters only; param group {i} has a "
                                     f"complex {tuple(p.shape)} tensor. Use the plain torch optimizer.")
                want = torch.float32 if self.emulate else torch.bfloat16
                if self.master_weights != "fp32" and p.dtype != want:
                    raise ValueError(f"master_weights={self.master_weights!r} keeps the parameters in {want}"
                                     f"{' (emulate=True)' if self.emulate else ''}, but param group {i} has a "
                                     f"{p.dtype} {tuple(p.shape)} tensor: convert the model first "
                                     f"(model.to({want})), then build the optimizer")
                if p.grad is not None and p.grad.is_sparse:
                    raise ValueError(f"FP8Optim does not support sparse gradients (param group {i}, "
                                     f"shape {tuple(p.shape)}); use dense gradients.")

    def _fp8_reason(self, p: torch.Tensor) -> str | None:
        """None if p's state goes FP8 at this level, else why it stays fp32."""
        if self.opt_level == 0:
            return "opt_level 0"
        size = fp8_size_problem(p.numel(), self.block_size, self.min_numel)
        if size:
            return size
        if isinstance(p, DTensor):  # FSDP: every rank's rows must be whole blocks too
            problem = _shard_problem(p, self.block_size)
            if problem:
                return problem
        if not p.is_contiguous():
            return "not contiguous"
        if not p.is_floating_point():
            return "not floating point"
        return None

    def _uses_fp8(self, p: torch.Tensor, group: dict) -> bool:
        if self.is_sgd and group["momentum"] == 0:
            return False  # plain SGD has no state to store
        return self._fp8_reason(p) is None

    # ---- the step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_groups()
        self._log_summary()
        self._backends = {}
        if self._own:  # every Adam parameter is ours (bf16 masters, or stepped in the backward)
            self._step_adam([(p, group) for group in self.param_groups for p in group["params"]
                             if p.grad is not None])
            return loss
        mine: list[tuple[torch.Tensor, dict]] = []  # FP8-state parameters with a gradient
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and self._uses_fp8(p, group):
                    mine.append((p, group))
        if mine:
            self._step_sgd(mine) if self.is_sgd else self._step_adam(mine)
        # the fp32-state parameters: the wrapped optimizer steps them, with the FP8 ones hidden
        hidden = [(p, p.grad) for p, _ in mine]
        for p, _ in hidden:
            p.grad = None
        try:
            self.optimizer.step()
        finally:
            for p, g in hidden:
                p.grad = g
        return loss

    def _log_summary(self) -> None:
        if not self._summary_logged:
            self._summary_logged = True
            logger.info("%s", self.summary())

    # ---- the optimizer step inside the backward -------------------------------------------------

    def step_in_backward(self) -> list:
        """Step each parameter inside the backward, as soon as its gradient is accumulated, and
        free that gradient at once (torch's post-accumulate-grad hooks), so at most one
        gradient exists at a time: the gradients' memory (4 or 2 bytes a parameter) is gone.

        After this, `loss.backward()` *is* the optimizer step; do not call `step()` (it would find
        no gradients) and drop `zero_grad()`. What this excludes: gradient accumulation over
        micro-batches (each backward would step), clipping by the global gradient norm (the norm
        exists only after the last parameter has stepped), and DDP/FSDP (their reductions run
        after these hooks). A parameter whose gradient holds inf or nan is left unchanged, states
        and step count included (decided on the device, no host read); `backward_stats()` says
        how many were and gives the global gradient norm for logging. Returns the hook handles
        (`handle.remove()` for each undoes this).
        """
        if self.is_sgd:
            raise ValueError("step_in_backward supports Adam and AdamW (torch.optim.SGD: step after the backward)")
        if any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"]):
            raise ValueError("step_in_backward does not work with FSDP/DTensor parameters: their gradients are "
                             "reduced after the per-parameter hooks would run; step after the backward instead")
        self._own = True
        # the group by index, looked up when the hook runs: load_state_dict replaces the dicts
        handles = []
        for i, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.requires_grad:
                    index = len(handles)
                    handles.append(p.register_post_accumulate_grad_hook(
                        lambda param, i=i, index=index: self._step_in_backward(param, self.param_groups[i], index)))
        self._bwd_params = len(handles)
        return handles

    @torch.no_grad()
    def _step_in_backward(self, p: torch.Tensor, group: dict, index: int) -> None:
        g = p.grad
        if self._bwd is None:
            self._backends = {}
            self._log_summary()
            # [sum of squared norms of the finite gradients, parameters left unchanged, parameters
            # that had a gradient, then per hooked parameter: 1 if it was left unchanged]
            self._bwd = torch.zeros(3 + self._bwd_params, dtype=torch.float32, device=g.device)
        self.max_live_grad_bytes = max(self.max_live_grad_bytes, _local(g).numel() * g.element_size())
        ok = torch.isfinite(g).all()
        norm = torch.linalg.vector_norm(g, dtype=torch.float32)
        self._bwd[:3] += torch.stack([torch.where(ok, norm * norm, 0.0), (~ok).float(), torch.ones_like(norm)])
        self._bwd[3 + index] = (~ok).float()
        self._step_adam([(p, group)], oks={p: ok})
        p.grad = None

    def backward_stats(self, per_param: bool = False) -> torch.Tensor | None:
        """After a backward under `step_in_backward`: an fp32 device tensor, [global norm of the
        finite gradients, parameters left unchanged because their gradient was not finite] (read
        it when you log: one read); None if no parameter stepped. Resets. per_param: followed by
        the number of parameters that had a gradient, then one flag per parameter with a hook
        (param_groups order, those that require grad): 1 if it was left unchanged, else 0."""
        out, self._bwd = self._bwd, None
        if out is None:
            return None
        head = torch.stack([out[0].sqrt(), out[1]])
        return torch.cat([head, out[2:]]) if per_param else head

    def _count(self, backend: str, tensors: int) -> None:
        calls, n = self._backends.get(backend, (0, 0))
        self._backends[backend] = (calls + 1, n + tensors)

    def step_backends(self) -> dict[str, tuple[int, int]]:
        """How the last step ran: backend ("native", "compile", "eager") -> (calls, tensors).
        The parameters with fp32 state, stepped by the wrapped optimizer, are not counted."""
        return dict(self._backends)

    def _run(self, name: str, fn, *args, **flags) -> None:
        """fn(*args, **flags), compiled once per `name` and flags; dynamo then keeps one graph per
        list length and tensor shape (a model has few, so its limit of 8 is lifted). args[0] is
        the list of parameters."""
        key = name + repr(sorted(flags.items()))
        if self._compile:
            compiled = self._compiled.get(key)
            if compiled is None:
                compiled = self._compiled[key] = torch.compile(fn, fullgraph=True, dynamic=False)
            try:
                with torch._dynamo.utils.disable_cache_limit():
                    compiled(*args, **flags)
                self._count("compile", len(args[0]))
                return
            except Exception as e:  # no C++ compiler, unsupported backend, ...
                self._compile = False
                msg = (f"FP8Optim: torch.compile of the step failed ({type(e).__name__}: "
                       f"{str(e).splitlines()[0] if str(e) else ''}); running the step eagerly "
                       "(correct, several times slower). Pass compile=False to skip the attempt.")
                self.fallbacks.append(msg)
                warn_once("fp8optim-eager", msg)
        fn(*args, **flags)
        self._count("eager", len(args[0]))

    def _adam_tensor(self, p: torch.Tensor, group: dict, ok: torch.Tensor | None) -> _AdamTensor:
        """p as the Adam kernels see it (its state made on its first step)."""
        B = self.block_size
        state = self.state[p]
        m_fp8 = self._uses_fp8(p, group)
        if len(state) == 0:
            self._init_adam_state(p, state, m_fp8)
        pl, g = _local(p), _local(p.grad)  # from here on: this rank's shard
        if state["step"].device != pl.device:  # a loaded state: once, see _init_adam_state
            state["step"] = state["step"].to(pl.device, torch.float32)
        kernel_dtype = torch.float32 if self.master_weights == "fp32" else torch.bfloat16
        lo = _local(state["master_lo"]) if self.master_weights == "bf16_split" else None
        t = _AdamTensor(p=pl, g=g.reshape(pl.shape), step=state["step"], group=group, salt=self._salts.get(p, 0),
                        decoupled=bool(group.get("decoupled_weight_decay", self._adamw)), ok=ok,
                        native=(m_fp8 and not self.emulate and pl.device.type == "cpu" and pl.dtype == kernel_dtype
                                and g.dtype == kernel_dtype and g.is_contiguous() and B <= 1024))
        if not m_fp8:
            t.m32, t.v32, t.lo = _local(state["exp_avg"]), _local(state["exp_avg_sq"]), lo
            return t
        # [n_blocks, B] views, codes as uint8
        m = _local(state["exp_avg"])
        t.p, t.g, t.lo = pl.view(-1, B), g.reshape(-1, B), None if lo is None else lo.view(-1, B)
        t.m_codes, t.m_scale = m.codes.view(torch.uint8).view(-1, B), m.scale
        if self.opt_level >= 2:
            r = _local(state["exp_avg_sq_sqrt"])
            t.v_codes, t.v_scale = r.codes.view(torch.uint8).view(-1, B), r.scale
        else:
            t.v32 = _local(state["exp_avg_sq"]).view(-1, B)
        return t

    def _step_adam(self, mine: list[tuple[torch.Tensor, dict]], oks: dict | None = None) -> None:
        """The Adam(W) parameters `mine` (with their groups): the FP8-state fp32 ones on CPU in one
        native kernel call, the others in one compiled call per (device, dtypes, shape, kinds).
        oks: parameter -> 0-dim bool guard (step_in_backward), else None."""
        calls: dict[tuple, list[_AdamTensor]] = defaultdict(list)
        steps: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for p, group in mine:
            t = self._adam_tensor(p, group, None if oks is None else oks[p])
            if t.ok is None:
                steps[t.p.device].append(t.step)
            else:  # a skipped parameter keeps its step count too
                t.step.add_(t.ok.to(torch.float32))
            calls[_bucket(t, native=self._native and t.native)].append(t)
        for same_device in steps.values():  # torch's Adam counts steps first, then steps
            torch._foreach_add_(same_device, 1.0)
        for key, items in calls.items():
            (self._adam_native if key[0] == "native" else self._adam_compiled)(items)

    def _adam_native(self, items: list[_AdamTensor]) -> None:
        """One native kernel call for `items`; if the kernel is unavailable, the compiled step
        (recorded fallback), each tensor re-keyed as it would have been without the kernel."""
        try:
            kernel.adam([t.kernel_row() for t in items], kernel.adam_table([t.step for t in items],
                                                                           [t.group for t in items]),
                        self.block_size, items[0].decoupled, items[0].v_fp8, master=self.master_weights,
                        salts=[t.salt for t in items], oks=[t.ok for t in items])
            self._count("native", len(items))
            return
        except RuntimeError as e:
            self._native = False
            msg = (f"FP8Optim: the native CPU kernel is unavailable ({e}); "
                   "using torch.compile for the step instead (~5x slower on CPU).")
            self.fallbacks.append(msg)
            warn_once("fp8optim-native", msg)
        calls: dict[tuple, list[_AdamTensor]] = defaultdict(list)
        for t in items:
            calls[_bucket(t, native=False)].append(t)
        for same in calls.values():
            self._adam_compiled(same)

    def _adam_compiled(self, items: list[_AdamTensor]) -> None:
        """One compiled (or eager) _adam_multi call for tensors of one bucket (_bucket)."""
        first = items[0]
        hypers: dict[int, tuple] = {}  # per param group
        for t in items:
            if id(t.group) not in hypers:
                g = t.group
                hypers[id(g)] = tuple(_host_scalar(x) for x in (g["lr"], g["betas"][0], g["betas"][1], g["eps"],
                                                                  g["weight_decay"]))
        # one list per _adam_multi argument; a representation this bucket does not use: []
        cols = [[getattr(t, name) for t in items] if getattr(first, name) is not None else []
                for name in _AdamTensor.MULTI_ARGS]
        salts = [torch.tensor(t.salt, dtype=torch.int64) for t in items] if self.master_weights == "bf16_sr" else []
        self._run("adam", _adam_multi, *cols, [t.step for t in items], [hypers[id(t.group)] for t in items],
                  salts, [t.ok for t in items] if first.ok is not None else [],
                  decoupled=first.decoupled, m_fp8=first.m_fp8, v_fp8=first.v_fp8, master=self.master_weights,
                  emulate=self.emulate)

    def _step_sgd(self, mine: list[tuple[torch.Tensor, dict]]) -> None:
        """Every FP8-state SGD parameter, one compiled call per (device, dtypes, shape, kind)."""
        B = self.block_size
        calls: dict[tuple, list] = defaultdict(list)
        hypers: dict[int, tuple] = {}
        for p, group in mine:
            state = self.state[p]
            first = state.get("momentum_buffer") is None
            if first:
                state["momentum_buffer"] = _like(FP8Tensor.zeros(_local(p).shape, dtype=E4M3,
                                                                 block_size=B, device=p.device), p)
            buf = _local(state["momentum_buffer"])
            pl, g = _local(p), _local(p.grad)
            if id(group) not in hypers:
                hypers[id(group)] = tuple(_host_scalar(group[k]) for k in ("lr", "momentum", "dampening",
                                                                           "weight_decay"))
            key = (first, bool(group["nesterov"]), pl.device, pl.dtype, g.dtype, (pl.numel() // B, B))
            calls[key].append((pl.view(-1, B), g.reshape(-1, B), buf.codes.view(torch.uint8).view(-1, B),
                               buf.scale, hypers[id(group)]))
        for (first, nesterov, *_), items in calls.items():
            ps, gs, codes, scales, hyp = (list(x) for x in zip(*items))
            self._run("sgd", _sgd_multi, ps, gs, codes, scales, hyp, first=first, nesterov=nesterov)

    def _init_adam_state(self, p: torch.Tensor, state: dict, m_fp8: bool = True) -> None:
        # float32 on the parameter's device, as torch's fused Adam keeps it: on a GPU the bias
        # corrections are then computed there, inside the compiled step, never on the host
        pl = _local(p)
        state["step"] = torch.zeros((), dtype=torch.float32, device=pl.device)
        shard = pl.shape  # FSDP: this rank's rows; the state is wrapped like p
        if not m_fp8:  # a parameter we step with fp32 moments (bf16 masters, in-backward)
            state["exp_avg"] = _like(torch.zeros(shard, dtype=torch.float32, device=pl.device), p)
            state["exp_avg_sq"] = _like(torch.zeros(shard, dtype=torch.float32, device=pl.device), p)
        else:
            state["exp_avg"] = _like(FP8Tensor.zeros(shard, dtype=E4M3, block_size=self.block_size,
                                                     device=p.device), p)
            if self.opt_level >= 2:
                state["exp_avg_sq_sqrt"] = _like(FP8Tensor.zeros(shard, dtype=E4M3, block_size=self.block_size,
                                                                 device=p.device), p)
            else:
                state["exp_avg_sq"] = _like(torch.zeros(shard, dtype=torch.float32, device=pl.device), p)
        if self.master_weights == "bf16_split":  # the master is the bf16 weight exactly: low half 0
            state["master_lo"] = _like(torch.zeros(shard, dtype=torch.int16, device=pl.device), p)

    # ---- state conversion (loading across levels, from plain torch state) ---------------------

    def _as_fp8(self, x: torch.Tensor) -> FP8Tensor:
        if isinstance(x, FP8Tensor) and x.block_size == self.block_size and x.fp8_dtype == E4M3:
            return x
        x = x.dequantize() if isinstance(x, FP8Tensor) else x
        return FP8Tensor.from_float(x.float(), dtype=E4M3, block_size=self.block_size)

    def _as_fp32(self, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A moment kept in high precision: fp32 when we step it (bf16 masters, in-backward),
        else the wrapped optimizer's convention (the parameter's dtype)."""
        x = x.dequantize() if isinstance(x, FP8Tensor) else x
        dtype = like.dtype if like.is_floating_point() and not self._own else torch.float32
        return x.to(device=like.device, dtype=dtype)

    def _convert_state(self) -> None:
        """Bring every parameter's state to the representation this level uses."""
        for group in self.param_groups:
            fp8 = [self._uses_fp8(p, group) for p in group["params"]]
            for p, want_fp8 in zip(group["params"], fp8):
                state = self.state.get(p)
                if not state:
                    continue
                if self.is_sgd:
                    buf = state.get("momentum_buffer")
                    if buf is not None:
                        state["momentum_buffer"] = self._as_fp8(buf.to(p.device)) if want_fp8 else self._as_fp32(buf, p)
                    continue
                state["exp_avg"] = self._as_fp8(state["exp_avg"].to(p.device)) if want_fp8 \
                    else self._as_fp32(state["exp_avg"], p)
                want_sqrt = want_fp8 and self.opt_level >= 2
                r = state.get("exp_avg_sq_sqrt")
                if (want_sqrt and isinstance(r, FP8Tensor) and r.block_size == self.block_size
                        and r.fp8_dtype == E4M3):
                    state["exp_avg_sq_sqrt"] = r.to(p.device)  # already what we store: bit-exact
                else:
                    if r is not None:  # stored sqrt(v): v = r^2
                        r = state.pop("exp_avg_sq_sqrt")
                        r = (r.dequantize() if isinstance(r, FP8Tensor) else r).to(p.device).float()
                        v = r * r
                    else:
                        v = state.pop("exp_avg_sq")
                        v = (v.dequantize() if isinstance(v, FP8Tensor) else v).to(p.device).float()
                    if want_sqrt:
                        state["exp_avg_sq_sqrt"] = quantize_sqrt_v(v, self.block_size)
                    elif want_fp8:  # level 1: our kernel keeps v in fp32 whatever p's dtype
                        state["exp_avg_sq"] = v.to(device=p.device, dtype=torch.float32).contiguous()
                    else:  # stepped by the wrapped optimizer: its own convention (p's dtype)
                        state["exp_avg_sq"] = self._as_fp32(v, p)
                if not torch.is_tensor(state.get("step")):
                    state["step"] = torch.tensor(float(state.get("step", 0)), dtype=torch.float32)
                lo = state.pop("master_lo", None)
                if self.master_weights == "bf16_split":  # from a run without it: the master is p
                    state["master_lo"] = lo.to(p.device) if lo is not None else \
                        torch.zeros(_local(p).shape, dtype=torch.int16, device=p.device)

    def _check_loaded(self, state_dict: dict) -> None:
        """ValueError naming the first saved state that does not fit its parameter, before
        anything is loaded. Parameters are matched as torch matches them (in param_groups
        order); groups of other sizes are left to the wrapped optimizer, which refuses them."""
        saved_groups, states = state_dict.get("param_groups"), state_dict.get("state")
        if not isinstance(saved_groups, list) or not isinstance(states, dict):
            raise ValueError("an optimizer state dict holds 'state' (a dict) and 'param_groups' (a list); got "
                             f"{type(states).__name__} and {type(saved_groups).__name__}")
        if [len(g.get("params", ())) if isinstance(g, dict) else -1 for g in saved_groups] != \
                [len(g["params"]) for g in self.param_groups]:
            return
        kind = type(self.optimizer).__name__
        index = 0
        for gi, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            for i, p in zip(saved["params"], group["params"]):
                state = states.get(i)
                if isinstance(state, dict):
                    problem = _keys_problem(state, self.is_sgd) or next(
                        (x for x in (_state_problem(k, v, _local(p)) for k, v in state.items()) if x), None)
                else:
                    problem = None if state is None else f"its state is a {type(state).__name__}, not a dict"
                if problem:
                    raise ValueError(
                        f"optimizer state of parameter {index} (param group {gi}, shape {tuple(p.shape)}): {problem}; "
                        f"this {kind} state is not this model's (or the file was altered): nothing was loaded")
                index += 1

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of FP8Optim (any level) or of the plain wrapped optimizer.

        Every saved state is first checked against its parameter (shape, FP8 blocks and scales,
        dtypes), ValueError otherwise with this optimizer unchanged: a moment of another size
        would make the native kernel read and write past its buffers. The wrapped optimizer then
        does the loading (param id mapping, group hyperparameters, device); each state is
        converted to what this level stores (FP8 <-> fp32, v <-> sqrt(v)).
        """
        self._check_loaded(state_dict)
        self.optimizer.load_state_dict(state_dict)
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        if self._own:
            # torch casts floating states to the parameter's dtype (bf16 here): our moments are
            # fp32 (or FP8 codes that must not be touched), so take the saved values as they are
            saved = [i for g in state_dict["param_groups"] for i in g["params"]]
            params = [p for g in self.param_groups for p in g["params"]]
            for i, p in zip(saved, params):
                if i in state_dict["state"]:
                    self.state[p] = {k: v.to(p.device) if torch.is_tensor(v) and k != "step" else v
                                     for k, v in state_dict["state"][i].items()}
        # FSDP: convert each rank's shard of the states, then wrap them back like their parameter
        sharded = [p for g in self.param_groups for p in g["params"]
                   if isinstance(p, DTensor) and self.state.get(p)]
        for p in sharded:
            self.state[p] = {k: _local(v) if torch.is_tensor(v) and k != "step" else v
                             for k, v in self.state[p].items()}
        self._convert_state()
        for p in sharded:
            self.state[p] = {k: _like(v, p) if torch.is_tensor(v) and k != "step" else v
                             for k, v in self.state[p].items()}

    def add_param_group(self, param_group: dict) -> None:
        if not hasattr(self, "optimizer"):  # called by Optimizer.__init__ on the shared groups
            return super().add_param_group(param_group)
        self.optimizer.add_param_group(param_group)
        self._salts = self._make_salts()
        self._summary_logged = False

    # ---- reporting ----------------------------------------------------------------------------

    def _planned_bytes(self, p: torch.Tensor, group: dict) -> int:
        """Bytes of state the first step will allocate for p (this level's layout)."""
        moments = _moments(self.optimizer, group)
        n = _local(p).numel()  # FSDP: this rank's shard
        fp8 = self._uses_fp8(p, group)
        # the moments we allocate are fp32 (level 1's v; all of them when we step every
        # parameter), the wrapped optimizer's are in p's dtype
        return (optimizer_bytes(n, fp8_moments=min(self.opt_level, moments) if fp8 else 0, moments=moments,
                                block_size=self.block_size,
                                moment_bytes=4 if fp8 or self._own else p.element_size())
                + n * bytes_per_param(self.master_weights)[2])  # bf16_split's remainder

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: optimizer_state_bytes(self)."""
        return optimizer_state_bytes(self)

    def state_bytes_per_param(self) -> float:
        """state_bytes() / number of parameters."""
        n = sum(_local(p).numel() for g in self.param_groups for p in g["params"])
        return self.state_bytes() / n if n else 0.0

    def fp32_states(self) -> dict[str, tuple[int, int]]:
        """Why parameters keep fp32 state: reason -> (tensors, params). Empty when all are FP8."""
        kept: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for group in self.param_groups:
            for p in group["params"]:
                if not self._uses_fp8(p, group):
                    reason = "SGD without momentum (no state)" if self.is_sgd and group["momentum"] == 0 \
                        else self._fp8_reason(p)
                    kept[reason][0] += 1
                    kept[reason][1] += p.numel()
        return {reason: (n, numel) for reason, (n, numel) in kept.items()}

    def fp32_state_notes(self) -> list[str]:
        """fp32_states() as fallback lines for a run's results (none at opt_level 0)."""
        if not self.opt_level:
            return []
        return [f"`opt_level` {self.opt_level}: {n} tensors / {numel:,} params keep fp32 moments ({reason})"
                for reason, (n, numel) in self.fp32_states().items()]

    def summary(self) -> str:
        kind = type(self.optimizer).__name__
        n_fp8 = b_fp8 = 0
        for group in self.param_groups:
            for p in group["params"]:
                if self._uses_fp8(p, group):
                    n_fp8 += 1
                    b_fp8 += p.numel()
        kept = self.fp32_states()
        moments = 1 if self.is_sgd else 2
        fp8_moments = min(self.opt_level, moments)
        B = self.block_size
        per_param = optimizer_bytes(B, fp8_moments=fp8_moments, moments=moments, block_size=B) / B
        master = "" if self.master_weights == "fp32" else f", master_weights={self.master_weights}"
        lines = [f"FP8Optim({kind}, opt_level={self.opt_level}, block_size={B}{master}): "
                 f"{n_fp8} tensors / {b_fp8:,} params with FP8 state "
                 f"({per_param:.3f} bytes/param of moments); {self.state_bytes():,} bytes of state"]
        for reason, (n, numel) in kept.items():
            lines.append(f"  fp32 state: {n} tensors / {numel:,} params "
                         f"({format_bytes(optimizer_bytes(numel, fp8_moments=0, moments=moments))}): {reason}")
        return "\n".join(lines)


def _moments(optimizer: torch.optim.Optimizer, group: dict) -> int:
    """Moments a torch optimizer keeps per parameter of `group`: Adam(W) 2, SGD with momentum 1."""
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if group["momentum"] else 0
    return 2


def wrap_optimizer(optimizer: torch.optim.Optimizer, *, opt_level: int = 0, master_weights: str = "fp32",
                   seed: int = 0, emulate: bool = False, in_backward: bool = False) -> torch.optim.Optimizer:
    """`optimizer` as it is when nothing asks for more (fp32 moments and masters, stepped after
    the backward), else FP8Optim around it: `opt_level` FP8 moments, bf16 `master_weights`
    (`emulate`: bf16 numerics on fp32 tensors; `seed` seeds bf16_sr), or `in_backward`, the step
    inside the backward that only FP8Optim runs (the caller then calls step_in_backward())."""
    if opt_level == 0 and master_weights == "fp32" and not in_backward:
        return optimizer
    return FP8Optim(optimizer, opt_level=opt_level, master_weights=master_weights, seed=seed, emulate=emulate)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state on this rank (moments, FP8 codes and scales, bf16_split's
    remainders; step counts excluded) of an FP8Optim or a plain torch Adam/AdamW/SGD: the
    tensors held, plus what the first step will allocate for parameters without state yet, so
    the figure means the same right after construction and after a step."""
    total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state:
                for key, value in state.items():
                    if key != "step" and torch.is_tensor(value):
                        value = _local(value)  # FSDP: this rank's shard
                        total += value.nbytes_stored() if isinstance(value, FP8Tensor) else value.nbytes
            elif isinstance(optimizer, FP8Optim):
                total += optimizer._planned_bytes(p, group)
            else:  # torch makes its moments at the first step, in the parameter's dtype
                total += optimizer_bytes(_local(p).numel(), fp8_moments=0, moments=_moments(optimizer, group),
                                         moment_bytes=p.element_size())
    return total


_ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq", "exp_avg_sq_sqrt", "master_lo")


def _keys_problem(state: dict, sgd: bool) -> str | None:
    """What is wrong with the keys of one parameter's saved state, or None."""
    allowed = ("momentum_buffer",) if sgd else _ADAM_KEYS
    extra = [k for k in state if k not in allowed]
    if extra:
        return f"unexpected state {extra} (an {'SGD' if sgd else 'Adam'} state holds {', '.join(allowed)})"
    if not sgd and not ("step" in state and "exp_avg" in state
                        and ("exp_avg_sq" in state) != ("exp_avg_sq_sqrt" in state)):
        return f"state {list(state)}: an Adam state holds step, exp_avg and one of exp_avg_sq, exp_avg_sq_sqrt"
    return None


def _state_problem(key: str, value: Any, like: torch.Tensor) -> str | None:
    """Why `value` cannot be state `key` of a parameter whose tensor on this rank is `like`, or
    None: a number or 0-dim tensor for the step; a moment of the parameter's shape, either a
    consistent FP8Tensor or a floating tensor laid out as the parameter; int16 for master_lo."""
    if key == "step":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return None
        if torch.is_tensor(value) and value.dim() == 0 and (value.is_floating_point() or value.dtype in (
                torch.int32, torch.int64)):
            return None
        return f"step must be a number or a 0-dim tensor, got {_describe(value)}"
    if key == "momentum_buffer" and value is None:  # SGD before its first step
        return None
    if not torch.is_tensor(value):
        return f"{key} must be a tensor, got {_describe(value)}"
    value = _local(value)  # FSDP: this rank's shard, compared with the parameter's
    expected = f"the parameter's {tuple(like.shape)} ({like.numel()} elements)"
    if isinstance(value, FP8Tensor):
        problem = value.layout_problem()
        if problem:
            return f"{key} is an inconsistent FP8Tensor: {problem}"
        if value.shape != like.shape:
            return (f"{key} is an FP8Tensor of shape {tuple(value.shape)} ({value.numel()} elements, "
                    f"{value.scale.numel()} scales), expected {expected}")
        return None
    want = "int16" if key == "master_lo" else "floating point"
    if (value.dtype != torch.int16) if key == "master_lo" else not value.is_floating_point():
        return f"{key} must be {want}, got {value.dtype}"
    if value.shape != like.shape:
        return f"{key} has shape {tuple(value.shape)} ({value.numel()} elements), expected {expected}"
    if not (value.is_contiguous() or value.stride() == like.stride()):
        return f"{key} has strides {value.stride()}: expected contiguous, or laid out as the parameter"
    return None


def _describe(value: Any) -> str:
    if torch.is_tensor(value):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__
