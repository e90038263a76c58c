"""Muon: the step over a moment format, which parameters it takes, and its AdamW companion.

Muon (Keller Jordan, kellerjordan.github.io/posts/muon; torch.optim.Muon) updates a weight
matrix by its momentum, orthogonalized: five Newton-Schulz iterations push the singular values
of the (Nesterov) momentum towards one, so every direction of the matrix moves at the same rate.
It is meant for the 2-D weights of hidden layers only; embeddings, the output head, norms and
biases stay with AdamW (`muon_param_groups` splits a model, `MuonAdamW` steps the two together).

A wrapper (wrapper.py) steps a Muon parameter here when its format stores the momentum buffer
(FP8Optim: e4m3 blocks of 256 of the flattened matrix, the quantizer of Adam's first moment);
the others are stepped by torch.optim.Muon itself. `muon_step` is torch's math: the buffer is
read into fp32 through the format, reshaped to the matrix for Newton-Schulz, and written back.
The e4m3 write rounds to nearest, and with momentum 0.95 a step adds 5% of (grad - buffer):
once the gradient changes slowly that is under half an e4m3 quantum (2^-4..2^-3 of the value)
and the buffer lags the fp32 one (measured on least squares: 8% after 40 noisy minibatch steps,
22% after 27 full-batch steps); stochastic rounding of the write is the known remedy.

Newton-Schulz runs in bf16 on CUDA, as torch's does (tensor cores; the iteration tolerates
bf16, its output is only approximately orthogonal anyway), and in fp32 elsewhere: bf16 matmuls
on a CPU are slower than fp32 ones (no bf16 units on AVX2: a 512x512 step took 5.0 s with
torch's bf16 iteration, 0.14 s in fp32, one thread) and round each of the 15 products to 8
bits. `ns_dtype` picks; given bf16 on CPU, the eager step is torch.optim.Muon's bit for bit
(tests/test_muon.py). At a level that keeps a parameter's momentum fp32, torch.optim.Muon steps
it, in bf16 on every device.

bf16 master weights (master.py) and the step inside the backward (in_backward.py) are the Adam
path's: the update is computed in fp32 from the master read back (`read_master`) and written
as `--master_weights` says; a wrapper then steps every Muon matrix here, its fp32 buffer in
fp32 whatever the parameter's dtype (torch.optim.Muon would round the update to nearest and
keep a bf16 buffer). In the backward a matrix steps in its own hook, its gradient being whole
there (one process: no reduction follows); a gradient with inf or nan leaves the matrix and its
buffer unchanged (`ok`).
"""

from __future__ import annotations

import math
from collections import ChainMap, defaultdict
from typing import NamedTuple

import torch
from torch import nn

from .backends import host_scalar
from .master import read_master, round_rne, sr_bits, write_master
from .moments import MomentFormat
from .shards import like, local, local_grad

FP32 = MomentFormat()
"""fp32 momentum as torch keeps it, for a matrix a wrapper steps whose buffer its format does not store."""

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic Newton-Schulz coefficients (a, b, c) of Keller Jordan's Muon and torch.optim.Muon:
the steepest slope at zero, so 5 steps suffice, at the price of singular values ending in about
[0.5, 1.5] rather than at one (which, per torch's docstring, does not hurt training)."""


NORMUON_BETA2 = 0.9
"""NorMuon's EMA of each neuron's mean squared update (arXiv 2510.05491; karpathy/nanochat's beta2)."""


def ns_dtype(device: torch.device) -> torch.dtype:
    """Newton-Schulz's working dtype on `device`: bf16 on CUDA (torch's), fp32 elsewhere (module
    docstring: bf16 matmuls on a CPU are slow and lossy)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def newton_schulz(x: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """The approximately orthogonal matrix of x (2-D), computed in `dtype`: torch.optim.Muon's
    _zeropower_via_newtonschulz with the working dtype a choice (bf16 there)."""
    a, b, c = coefficients
    o = x.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:  # iterate on the wide side: the Gram matrix o @ o.T is then the smaller one
        o = o.T
    o = o / o.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1: inside the basin
    for _ in range(steps):
        gram = o @ o.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2
        o = torch.addmm(o, poly, o, beta=a)  # a o + (b G + c G^2) o
    return o.T if tall else o


def lr_ratio(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's learning-rate factor for an (A, B) matrix: sqrt(max(1, A/B)) for None or
    "original" (Keller Jordan's), 0.2 sqrt(max(A, B)) for "match_rms_adamw" (Moonshot's: the
    update's RMS of AdamW's, so AdamW's lr and weight decay carry over)."""
    A, B = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, A / B))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(A, B))
    return 1.0


def normalize_neurons(o: torch.Tensor, v: torch.Tensor, beta2: float, ok=None) -> torch.Tensor:
    """NorMuon: o with each neuron's update scaled by 1/sqrt of an EMA (`v`, updated in place; kept
    where `ok` is False) of its mean square, then rescaled to o's Frobenius norm, so only the
    split between neurons changes. A neuron is a row of a tall or square matrix, a column of a
    wide one (the shorter side, as karpathy/nanochat's: v is the smaller vector)."""
    dim = -1 if o.size(-2) >= o.size(-1) else -2
    v_new = v.lerp(o.square().mean(dim=dim, keepdim=True), 1 - beta2)
    v.copy_(v_new if ok is None else torch.where(ok, v_new, v))
    scaled = o * v_new.clamp(min=1e-10).rsqrt()
    return scaled * (o.norm() / scaled.norm().clamp(min=1e-10))


def muon_step(p, g, buf, lr, momentum, wd, *, nesterov: bool, coefficients: tuple, ns_steps: int, eps: float,
              adjust_lr_fn: str | None, dtype: torch.dtype, m_format: type, lo=None, step=None, salt=None, ok=None,
              master: str = "fp32", emulate: bool = False, orthogonalize=None, shape: torch.Size | None = None,
              v=None, normuon: float = 0.0):
    """Muon on one 2-D parameter, its momentum buffer as `m_format` stores it (read into fp32 in
    the format's layout, e.g. [n_blocks, B] of the flattened matrix). Each line is torch's, and
    eager with dtype bf16 and fp32 masters it computes the same floats (lerp and addcmul as
    torch's lerp_ and add_(alpha=): the same rounding). bf16 masters as adam_step has them: p
    read as its fp32 master (with its low half `lo` under bf16_split), the result written as
    `master` says, bf16_sr's bits from `salt` and `step` (0-dim tensors); emulate: p is fp32
    holding bf16 values, the gradient rounded to bf16 first. ok (None or a 0-dim bool): False
    leaves p, lo and the buffer as they were. A matrix split across ranks (muon_sharded.py) is
    stepped as its shard p with `orthogonalize` (the shard's update -> its part of the whole
    matrix's Newton-Schulz) and `shape`, the whole matrix's, for the lr factor. normuon (beta2,
    0 off) with `v`: NorMuon's per-neuron normalization (normalize_neurons)."""
    b_old = m_format.read(buf)
    gf = round_rne(g.float()) if emulate else g.float()
    b = b_old.lerp(gf.reshape(b_old.shape), 1 - momentum)  # torch: buf.lerp_(grad, 1 - momentum)
    tie = m_format.write(buf, b, ok)
    b = b.reshape(p.shape)
    update = gf.lerp(b, momentum) if nesterov else b  # torch: grad.lerp(buf, momentum)
    o = orthogonalize(update) if orthogonalize else newton_schulz(update, coefficients, ns_steps, eps, dtype)
    if normuon:
        o = normalize_neurons(o.float(), v, normuon, ok)
    master_old = read_master(p, lo)
    pf = master_old * (1 - lr * wd)  # torch: param.mul_(1 - lr * weight_decay)
    new = torch.addcmul(pf, o, -(lr * lr_ratio(adjust_lr_fn, shape or p.shape)))  # torch: param.add_(o, alpha=-adjusted_lr)
    if torch.is_tensor(tie):  # a block format's zero tie, in its layout (E4M3Blocks.write)
        new = (new.reshape(b_old.shape) + tie).reshape(p.shape)
    if ok is not None:  # the old master is exactly representable: writing it back changes nothing
        new = torch.where(ok, new, master_old)
    write_master(p, new, master, lo=lo, bits16=sr_bits(salt, step, p.shape) if master == "bf16_sr" else None)


def muon_multi(ps, gs, bufs, hypers, los=None, steps=None, salts=None, oks=None, vs=None, *, nesterov: bool,
               coefficients: tuple, ns_steps: int, eps: float, adjust_lr_fn: str | None, dtype: torch.dtype,
               m_format: type, master: str = "fp32", emulate: bool = False, normuon: float = 0.0):
    """muon_step over lists of same-shape tensors; hypers[i] = (lr, momentum, weight_decay); los,
    steps, salts, oks, vs: None, or a list with tensor i's (muon_tensors), None where unused."""
    for i in range(len(ps)):
        extra = {k: x[i] for k, x in dict(lo=los, step=steps, salt=salts, ok=oks, v=vs).items() if x is not None}
        muon_step(ps[i], gs[i], bufs[i], *hypers[i], nesterov=nesterov, coefficients=coefficients,
                  ns_steps=ns_steps, eps=eps, adjust_lr_fn=adjust_lr_fn, dtype=dtype, m_format=m_format,
                  master=master, emulate=emulate, normuon=normuon, **extra)


def muon_tensors(state: dict, p: torch.Tensor, fmt: MomentFormat, *, master: str, fp32_buffer: bool, salt: int,
                 ok: torch.Tensor | None) -> tuple:
    """(buf, lo, step, salt) of p's Muon step, its state made at its first step (torch: a zero
    buffer): the buffer as the format's views, or an fp32 one (torch's own tensor, so the state
    dict is torch's) as the 1-tuple `(tensor,)`, in p's dtype unless `fp32_buffer` (the wrapper
    steps it: bf16 masters, in the backward); bf16_split's int16 low halves as p's matrix; under
    bf16_sr the 0-dim fp32 step count, counted here before the step as Adam's (a guarded step
    counts only where `ok`), and the salt as a 0-dim int64. Unused entries are None."""
    pl = local(p)
    if state.get("momentum_buffer") is None:
        state["momentum_buffer"] = like(fmt.zeros(pl.shape, p.device), p) if type(fmt) is not MomentFormat \
            else torch.zeros_like(p, dtype=torch.float32 if fp32_buffer else None, memory_format=torch.preserve_format)
    if master == "bf16_split" and state.get("master_lo") is None:  # the master is the bf16 weight: low half 0
        state["master_lo"] = like(torch.zeros(pl.shape, dtype=torch.int16, device=pl.device), p)
    step = None
    if master == "bf16_sr":
        step = state.get("step")
        if not torch.is_tensor(step) or step.device != pl.device:  # new, or loaded on another device
            step = state["step"] = torch.tensor(float(step or 0), dtype=torch.float32, device=pl.device)
        step.add_(1.0 if ok is None else ok.to(torch.float32))
    buf = local(state["momentum_buffer"])
    lo = local(state["master_lo"]).view(pl.shape) if master == "bf16_split" else None
    return ((buf,) if type(fmt) is MomentFormat else fmt.view(buf), lo, step,
            torch.tensor(salt, dtype=torch.int64) if master == "bf16_sr" else None)


def muon_calls(opt, mine: list[tuple[torch.Tensor, dict]], oks: dict | None = None, *,
               salts: dict) -> list[tuple[list, dict]]:
    """The muon_multi calls of a wrapper's step (opt: an OptimWrapper over torch.optim.Muon) over
    the (parameter, group) pairs `mine`, as (list arguments, flags): one per (device, dtypes,
    shape, format, group settings), so each compiles once; every state made (muon_tensors).
    p and g as matrices. oks: parameter -> 0-dim bool guard (step_in_backward), else None;
    salts: parameter -> its bf16_sr salt (master.sr_salt)."""
    calls: dict[tuple, list] = defaultdict(list)
    flags: dict[tuple, dict] = {}
    hypers: dict[int, tuple] = {}
    for p, group in mine:
        fmt = opt.moments if opt.stores(p, group) else FP32
        ok = None if oks is None else oks[p]
        buf, lo, step, salt = muon_tensors(opt.state[p], p, fmt, master=opt.master_weights, ok=ok,
                                           fp32_buffer=opt.steps_every_parameter, salt=salts.get(p, 0))
        pl, g = local(p), local_grad(p)
        group_flags = muon_flags(group, pl.device, opt.muon_ns_dtype)
        key = (repr(sorted(group_flags.items())), type(fmt), pl.device, pl.dtype, g.dtype, tuple(pl.shape))
        flags[key] = dict(group_flags, m_format=type(fmt), master=opt.master_weights, emulate=opt.emulate)
        if id(group) not in hypers:
            hypers[id(group)] = muon_hypers(group)
        calls[key].append((pl, g.reshape(pl.shape), buf, hypers[id(group)], lo, step, salt, ok,
                           neuron_variance(opt.state[p], pl) if group_flags["normuon"] else None))
    return [([list(x) for x in zip(*items)], flags[key]) for key, items in calls.items()]


def neuron_variance(state: dict, p: torch.Tensor) -> torch.Tensor:
    """NorMuon's fp32 EMA of each neuron's mean squared update (normalize_neurons), made zero at
    the first step: [rows, 1] for a tall or square matrix, [1, columns] for a wide one."""
    if state.get("neuron_variance") is None:
        rows, cols = p.shape
        state["neuron_variance"] = torch.zeros((rows, 1) if rows >= cols else (1, cols), dtype=torch.float32,
                                               device=p.device)
    return state["neuron_variance"]


def moments(group: dict) -> int:
    """Moments Muon keeps per parameter: the momentum buffer (torch makes it whatever the momentum)."""
    return 1


def muon_hypers(group: dict) -> tuple[torch.Tensor, ...]:
    """(lr, momentum, weight_decay) of a Muon param group, as host scalars."""
    return tuple(host_scalar(group[k]) for k in ("lr", "momentum", "weight_decay"))


def muon_flags(group: dict, device: torch.device, ns: torch.dtype | None = None) -> dict:
    """The constants of a group's compiled step (a graph per distinct set): Nesterov, the
    Newton-Schulz settings and its dtype (`ns`, default `ns_dtype(device)`), the lr rule, and
    NorMuon's beta2 (a group's "normuon", which torch.optim.Muon lacks; 0: off)."""
    return dict(nesterov=bool(group["nesterov"]), coefficients=tuple(group["ns_coefficients"]),
                ns_steps=int(group["ns_steps"]), eps=float(group["eps"]), adjust_lr_fn=group["adjust_lr_fn"],
                dtype=ns or ns_dtype(device), normuon=float(group.get("normuon", 0.0)))


# ------------------------------------------------------------------------------ a whole model
class Placement(NamedTuple):
    """Where `muon_param_groups` put one parameter, and why (a run's header prints these)."""
    name: str
    shape: tuple[int, ...]
    optimizer: str
    """"muon", "adamw", or "frozen" (requires_grad False: in neither)."""
    reason: str


class MuonSplit(NamedTuple):
    """A model's parameters as torch.optim.Muon and torch.optim.AdamW param groups."""
    muon: list[dict]
    """Hidden matrices, one group of role "matrix" (Muon's hyperparameters from its constructor)."""
    adamw: list[dict]
    """The output head and other matrices (AdamW's weight decay), the embeddings, then the vectors
    (weight_decay 0 for both: decaying them only pulls a table's rows, scales and offsets to zero);
    empty groups left out. Each group's "role" ("head", "embedding", "vector") is what a recipe
    gives its own rate (nanochat.optim.recipe)."""
    placements: list[Placement]

    def summary(self) -> str:
        """One line per optimizer: tensors, parameters and the reasons, for a run's header."""
        lines = []
        for kind in ("muon", "adamw", "frozen"):
            chosen = [pl for pl in self.placements if pl.optimizer == kind]
            if chosen:
                reasons = ", ".join(dict.fromkeys(pl.reason for pl in chosen))
                lines.append(f"{kind}: {len(chosen)} tensors / {sum(math.prod(pl.shape) for pl in chosen):,} "
                             f"params ({reasons})")
        return "\n".join(lines)


def muon_param_groups(model: nn.Module) -> MuonSplit:
    """Split `model`'s parameters (each once: a tied weight under its first name) for Muon and AdamW.

    Muon: the 2-D weight of every nn.Linear (Float8Linear is one) but the output head. AdamW:
    nn.Embedding weights, the output head (the module `lm_head`, else the last nn.Linear whose
    out_features is an embedding's vocabulary: its rows are per-token, like an embedding's), 1-D
    parameters (norm weights, biases), scalars, >2-D tensors, and 2-D parameters outside an
    nn.Linear (a table, not a map between hidden states).
    """
    embeddings = {id(m.weight): m for m in model.modules() if isinstance(m, nn.Embedding)}
    linears = {id(m.weight): m for m in model.modules() if isinstance(m, nn.Linear)}
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        vocab = {m.num_embeddings for m in embeddings.values()}
        head = next((m for m in reversed(list(model.modules()))
                     if isinstance(m, nn.Linear) and m.out_features in vocab), None)
    hidden, matrices, tables, vectors, placements = [], [], [], [], []
    for name, p in model.named_parameters():
        key = id(p)
        if not p.requires_grad:
            where, reason = None, "requires_grad=False"
        elif key in embeddings:
            where, reason = tables, "nn.Embedding" + (" (tied with the output head)" if head is not None
                                                       and head.weight is p else "")
        elif head is not None and p is head.weight:
            where, reason = matrices, "output head"
        elif p.ndim < 2:
            where, reason = vectors, "1-D (a norm weight or bias)" if p.ndim else "scalar"
        elif p.ndim > 2:
            where, reason = matrices, f"{p.ndim}-D (Muon orthogonalizes matrices)"
        elif key in linears:
            where, reason = hidden, "hidden nn.Linear weight"
        else:
            where, reason = vectors, "2-D, not an nn.Linear weight"
        if where is not None:
            where.append(p)
        kind = "frozen" if where is None else "muon" if where is hidden else "adamw"
        placements.append(Placement(name, tuple(p.shape), kind, reason))
    adamw = [g for g in (dict(params=matrices, role="head"), dict(params=tables, weight_decay=0.0, role="embedding"),
                         dict(params=vectors, weight_decay=0.0, role="vector")) if g["params"]]
    return MuonSplit([dict(params=hidden, role="matrix")] if hidden else [], adamw, placements)


def members(optimizer: torch.optim.Optimizer) -> tuple[torch.optim.Optimizer, ...]:
    """The optimizers `optimizer` steps: a container's (MuonAdamW's two), or itself alone."""
    return tuple(optimizer.optimizers) if isinstance(optimizer, MuonAdamW) else (optimizer,)


class MuonAdamW(torch.optim.Optimizer):
    """Two optimizers stepped as one: a Muon (torch.optim.Muon, or a wrapper of it) for the hidden
    matrices and an AdamW for the rest; torch has no such optimizer, torchtitan keeps an
    OptimizersContainer alike. `param_groups` are both optimizers' own dicts (Muon's first), read
    each time (a member's load_state_dict replaces its dicts, as torch's does), so an LR scheduler
    scales each group from its own base lr, after a resume too; `state` reads both; `state_dict`
    is {"muon": ..., "adamw": ...}.

        split = muon_param_groups(model)
        opt = MuonAdamW(FP8Optim(torch.optim.Muon(split.muon, lr=0.02), opt_level=1),
                        FP8Optim(torch.optim.AdamW(split.adamw, lr=3e-4), opt_level=2))
    """

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer, *,
                 placements: list[Placement] | None = None) -> None:
        self.optimizers = (muon, adamw)
        self.placements = list(placements or [])
        """Where each parameter went (MuonSplit.placements), for `summary`."""
        shared = {id(p) for g in muon.param_groups for p in g["params"]} & \
            {id(p) for g in adamw.param_groups for p in g["params"]}
        if shared:
            raise ValueError(f"{len(shared)} parameter(s) appear in both the Muon and the AdamW optimizer: give each "
                             "parameter to one (muon_param_groups splits a model so)")
        # Optimizer.__init__ installs the hook dicts; its groups and state are the members' (below)
        super().__init__([*muon.param_groups, *adamw.param_groups], {})

    @property
    def param_groups(self) -> list[dict]:
        return [*self.muon.param_groups, *self.adamw.param_groups]

    @param_groups.setter
    def param_groups(self, groups: list[dict]) -> None:
        pass  # Optimizer.__init__ assigns an empty list first: the groups stay the members'

    @property
    def state(self) -> ChainMap:
        return ChainMap(self.muon.state, self.adamw.state)

    @state.setter
    def state(self, state: dict) -> None:
        pass  # Optimizer.__init__ assigns an empty state: the states stay the members'

    @property
    def muon(self) -> torch.optim.Optimizer:
        return self.optimizers[0]

    @property
    def adamw(self) -> torch.optim.Optimizer:
        return self.optimizers[1]

    def summary(self, *, logged: bool = False) -> str:
        """Where the parameters went, then each optimizer's own summary where it has one (a
        wrapper's moment layout); `logged` as FP8Optim.summary's."""
        lines = [MuonSplit([], [], self.placements).summary()] if self.placements else []
        for opt in self.optimizers:
            own = getattr(opt, "summary", None)
            tensors = sum(len(g["params"]) for g in opt.param_groups)
            lines.append(own(logged=logged) if callable(own) else f"{type(opt).__name__}: {tensors} tensors, fp32 state")
        return "\n".join(lines)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    # ---- the step inside the backward: each member's hooks (OptimWrapper.step_in_backward) ----
    def step_in_backward(self) -> list:
        """Both members step inside the backward, each parameter in its own hook (a Muon matrix
        once its gradient is whole); the members must be wrappers. Returns every hook handle."""
        plain = [type(opt).__name__ for opt in self.optimizers if not hasattr(opt, "step_in_backward")]
        if plain:
            raise ValueError(f"step_in_backward needs both members wrapped (OptimWrapper, FP8Optim or "
                             f"nanochat.optim.wrap_optimizer); {', '.join(plain)} is not")
        return [h for opt in self.optimizers for h in opt.step_in_backward()]

    @property
    def in_backward(self) -> bool:
        return any(getattr(opt, "in_backward", False) for opt in self.optimizers)

    @property
    def max_live_grad_bytes(self) -> int:
        """The larger member's largest gradient: each frees one before the next is made."""
        return max(getattr(opt, "max_live_grad_bytes", 0) for opt in self.optimizers)

    def backward_stats(self, per_param: bool = False) -> torch.Tensor | None:
        """The members' stats (InBackward.stats) as one optimizer's: the norm over both members'
        finite gradients, the counts summed, per_param's flags in `param_groups` order (Muon's
        first, as the members hooked them); None if no parameter stepped."""
        parts = [opt.backward_stats(per_param=True) for opt in self.optimizers]
        given = [s for s in parts if s is not None]
        if not given:
            return None
        hooked = [sum(p.requires_grad for g in opt.param_groups for p in g["params"]) for opt in self.optimizers]
        parts = [torch.zeros(3 + n, device=given[0].device) if s is None else s for s, n in zip(parts, hooked)]
        norm = torch.stack([s[0] for s in parts]).square().sum().sqrt()
        head = torch.stack([norm, sum(s[1] for s in parts), sum(s[2] for s in parts)])
        return torch.cat([head, *(s[3:] for s in parts)]) if per_param else head[:2]

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if not isinstance(state_dict, dict) or set(state_dict) != {"muon", "adamw"}:
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"a MuonAdamW state dict holds 'muon' and 'adamw', got {got}: load a single "
                             "optimizer's state into that optimizer (MuonAdamW.muon or .adamw)")
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])

    def add_param_group(self, param_group: dict) -> None:
        if any(param_group is g for g in self.param_groups):  # Optimizer.__init__, on the members' groups
            return
        raise ValueError("MuonAdamW holds two optimizers: add the group to MuonAdamW.muon or .adamw, "
                         "then build a new MuonAdamW around them")


__all__ = ["NORMUON_BETA2", "NS_COEFFICIENTS", "MuonAdamW", "MuonSplit", "Placement", "lr_ratio", "members", "moments",
           "muon_flags", "muon_hypers", "muon_multi", "muon_param_groups", "muon_step", "newton_schulz",
           "neuron_variance", "normalize_neurons", "ns_dtype"]
