"""OptimWrapper: takes over the step of a constructed torch AdamW/Adam/SGD where torch's cannot do it.

    opt = OptimWrapper(torch.optim.AdamW(model.parameters(), lr=3e-4), master_weights="bf16_sr")
    opt = FP8Optim(torch.optim.AdamW(model.parameters(), lr=3e-4), opt_level=2)   # FP8 moments
    ...loss.backward(); opt.step(); opt.zero_grad()   # schedulers, state_dict: as usual

It *wraps* the optimizer: its `param_groups` and `state` are the wrapped optimizer's own objects,
so an LR scheduler drives both. It steps a parameter itself (adam.py, sgd.py) when the wrapped
optimizer cannot: bf16 master weights (master.py) or the step inside the backward
(in_backward.py), then every parameter; moments in another format (`moments=`, a MomentFormat;
FP8Optim's E4M3Blocks), then those the format stores, the others by the wrapped optimizer with
those gradients hidden from it. `wrap_optimizer` picks the wrapper a run's settings need.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from nanochat.common import format_bytes, logger

from . import saved_state
from .adam import AdamTensor, adam_hypers, adam_multi, native_ok, native_step
from .backends import Backends
from .in_backward import InBackward
from .master import MASTER_WEIGHTS, bytes_per_param, sr_salt
from .moments import DEFAULT_BLOCK_SIZE, MIN_NUMEL, E4M3Blocks, MomentFormat
from .muon import muon_calls, muon_multi, ns_dtype
from .muon_sharded import step_sharded
from .sgd import sgd_hypers, sgd_multi
from .shards import DTensor, like, local, local_grad
from .state_bytes import moment_count, optimizer_bytes, optimizer_state_bytes

SUPPORTED = "torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.Muon"


class OptimWrapper(torch.optim.Optimizer):
    """Steps a torch AdamW/Adam/SGD/Muon's parameters itself where torch cannot (module docstring).

    Args:
        optimizer: a constructed torch.optim.AdamW, Adam, SGD or Muon (its param_groups are shared).
        moments: how moments are stored (a moments.MomentFormat; default fp32).
        compile: False forces the eager step (same as backend="eager").
        backend: "auto", "native", "compile" or "eager" (backends.py).
        master_weights: "fp32" (the parameters are the masters), or "bf16", "bf16_sr",
            "bf16_split": bf16 parameters updated as master.py describes.
        seed: seeds bf16_sr's random bits (with each parameter's position and step).
        emulate: bf16 master numerics on fp32 parameters (holding bf16 values; gradients rounded
            to bf16 in the step): for models that must compute in fp32. No memory saved.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, moments: MomentFormat | None = None, compile: bool = True,
                 backend: str = "auto", master_weights: str = "fp32", seed: int = 0, emulate: bool = False) -> None:
        kind = type(optimizer)
        if kind not in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.Muon):
            raise TypeError(
                f"{type(self).__name__} wraps {SUPPORTED} (exactly these classes); got {kind.__module__}."
                f"{kind.__qualname__}. Construct one of those and pass it in."
            )
        # Optimizer.__init__ installs the hook dicts and step profiling; then share the objects
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.optimizer = optimizer
        self.moments = moments if moments is not None else MomentFormat()
        """How this wrapper stores moments (moments/)."""
        self.is_sgd = kind is torch.optim.SGD
        self.is_muon = kind is torch.optim.Muon
        self.muon_ns_dtype: torch.dtype | None = None
        """Muon's Newton-Schulz dtype; None: muon.ns_dtype (bf16 on CUDA, fp32 elsewhere)."""
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.backends = Backends(type(self).__name__, backend, compile=compile)
        self.fallbacks: list[str] = self.backends.fallbacks
        """Each fallback this optimizer took (native kernel unavailable, compile failed), with its
        reason; a run's results read them through `optimizer_fallbacks`."""
        if master_weights not in MASTER_WEIGHTS:
            raise ValueError(f"master_weights must be one of {', '.join(MASTER_WEIGHTS)}; got {master_weights!r}")
        if master_weights != "fp32" and self.is_sgd:
            raise ValueError(f"master_weights={master_weights!r} supports Adam, AdamW and Muon; with torch.optim."
                             f"{kind.__name__} keep fp32 master weights")
        self.master_weights = master_weights
        self.emulate = emulate and master_weights != "fp32"
        self.steps_every_parameter = master_weights != "fp32"
        """Every parameter is stepped here (bf16 masters, or stepped in the backward): the wrapped
        optimizer would round to nearest and keep bf16 moments, or step after the backward."""
        self._adamw = kind is torch.optim.AdamW
        self._seed = seed
        self._salts = self._make_salts()  # bf16_sr: from each parameter's position (stable across runs)
        self._summary_logged = False
        self._in_backward = InBackward(self, step=lambda p, group, ok: self._step_all([(p, group)], oks={p: ok}),
                                       begin=self._begin_step)
        self._check_groups()

    def _make_salts(self) -> dict:
        return {p: sr_salt(self._seed, i) for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    def stores(self, p: torch.Tensor, group: dict) -> int:
        """How many of p's moments the format stores (0: fp32, stepped as torch would)."""
        return self.moments.stores(p, self.moment_count(group))

    def moment_count(self, group: dict) -> int:
        """Moments the wrapped optimizer keeps per parameter of `group` (state_bytes.moment_count)."""
        return moment_count(self.optimizer, group)

    # ---- configuration checks ----------------------------------------------------------------

    def _check_groups(self) -> None:
        for i, group in enumerate(self.param_groups):
            bad = [k for k in ("amsgrad", "maximize", "capturable", "differentiable") if group.get(k, False)]
            if bad:
                raise ValueError(
                    f"{type(self).__name__} does not support {', '.join(f'{k}=True' for k in bad)} (param group "
                    f"{i}). Supported: {SUPPORTED} with lr/betas/eps/weight_decay (Adam, AdamW), "
                    "momentum/dampening/nesterov/weight_decay (SGD), momentum/nesterov/weight_decay/ns_* "
                    "(Muon), foreach/fused as you like. "
                    "Turn the option off or use the plain torch optimizer."
                )
            for p in group["params"]:
                if p.is_complex():
                    raise ValueError(f"{type(self).__name__} supports real parameters only; param group {i} has a "
                                     f"complex {tuple(p.shape)} tensor. Use the plain torch optimizer.")
                want = torch.float32 if self.emulate else torch.bfloat16
                if self.master_weights != "fp32" and p.dtype != want:
                    raise ValueError(f"master_weights={self.master_weights!r} keeps the parameters in {want}"
                                     f"{' (emulate=True)' if self.emulate else ''}, but param group {i} has a "
                                     f"{p.dtype} {tuple(p.shape)} tensor: convert the model first "
                                     f"(model.to({want})), then build the optimizer")
                if p.grad is not None and p.grad.is_sparse:
                    raise ValueError(f"{type(self).__name__} does not support sparse gradients (param group {i}, "
                                     f"shape {tuple(p.shape)}); use dense gradients.")

    # ---- the step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_groups()
        self._begin_step()
        if self.steps_every_parameter:
            self._step_all([(p, group) for group in self.param_groups for p in group["params"] if p.grad is not None])
            return loss
        mine = [(p, group) for group in self.param_groups for p in group["params"]
                if p.grad is not None and (self.stores(p, group) or self._muon_here(p, group))]
        if mine:
            self._step_muon(mine) if self.is_muon else self._step_sgd(mine) if self.is_sgd else self._step_adam(mine)
        # the fp32-state parameters: the wrapped optimizer steps them, with the format's hidden
        hidden = [(p, p.grad) for p, _ in mine]
        for p, _ in hidden:
            p.grad = None
        try:
            self.optimizer.step()
        finally:
            for p, g in hidden:
                p.grad = g
        return loss

    def _step_all(self, mine: list[tuple[torch.Tensor, dict]], oks: dict | None = None) -> None:
        """Step `mine` here, whatever the format stores (bf16 masters, in the backward)."""
        (self._step_muon if self.is_muon else self._step_adam)(mine, oks)

    def _begin_step(self) -> None:
        self.backends.reset()
        if not self._summary_logged:
            self._summary_logged = True
            logger.info("%s", self.summary())

    def step_backends(self) -> dict[str, tuple[int, int]]:
        """How the last step ran: backend ("native", "compile", "eager") -> (calls, tensors).
        The parameters stepped by the wrapped optimizer are not counted."""
        return dict(self.backends.counts)

    def step_in_backward(self) -> list:
        """Step each parameter inside the backward (in_backward.py): after this `loss.backward()`
        is the optimizer step; drop `step()` and `zero_grad()`. A parameter whose gradient holds
        inf or nan is left unchanged; `backward_stats()` says how many. Returns the hook handles."""
        if self.is_sgd:
            raise ValueError("step_in_backward supports Adam, AdamW and Muon (torch.optim.SGD: step after the "
                             "backward)")
        if any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"]):
            raise ValueError("step_in_backward does not work with FSDP/DTensor parameters: their gradients are "
                             "reduced after the per-parameter hooks would run; step after the backward instead")
        self.steps_every_parameter = True
        return self._in_backward.install()

    def backward_stats(self, per_param: bool = False) -> torch.Tensor | None:
        """After a backward under `step_in_backward`: [global norm of the finite gradients,
        parameters left unchanged] as one fp32 device tensor (InBackward.stats); None if no
        parameter stepped. Resets."""
        return self._in_backward.stats(per_param)

    @property
    def in_backward(self) -> bool:
        """`step_in_backward()` was called: the backward steps every parameter."""
        return bool(self._in_backward.handles)

    @property
    def max_live_grad_bytes(self) -> int:
        """step_in_backward: the largest gradient seen (the most gradient memory alive at once)."""
        return self._in_backward.max_live_grad_bytes

    def _adam_tensor(self, p: torch.Tensor, group: dict, ok: torch.Tensor | None) -> AdamTensor:
        """p as the step sees it (its state made on its first step)."""
        state = self.state[p]
        quantized = self.stores(p, group)
        if len(state) == 0:
            self._init_adam_state(p, state, quantized)
        pl, g = local(p), local_grad(p)  # from here on: this rank's shard
        if state["step"].device != pl.device:  # a loaded state: once, see _init_adam_state
            state["step"] = state["step"].to(pl.device, torch.float32)
        t = AdamTensor(p=pl, g=g.reshape(pl.shape), step=state["step"], group=group, salt=self._salts.get(p, 0),
                       decoupled=bool(group.get("decoupled_weight_decay", self._adamw)), ok=ok,
                       lo=local(state["master_lo"]) if self.master_weights == "bf16_split" else None)
        if not quantized:
            t.m, t.v = (local(state["exp_avg"]),), (local(state["exp_avg_sq"]),)
            return t
        fmt, B = self.moments, self.moments.block_size
        t.p, t.g, t.lo = pl.view(-1, B), g.reshape(-1, B), None if t.lo is None else t.lo.view(-1, B)
        t.m, t.m_format = fmt.view(local(state["exp_avg"])), type(fmt)
        if quantized >= 2:
            t.v, t.v_format = fmt.view(local(state["exp_avg_sq_sqrt"])), type(fmt)
        else:
            t.v = (local(state["exp_avg_sq"]).view(-1, B),)
        t.native = native_ok(t, fmt, master=self.master_weights, emulate=self.emulate) and g.is_contiguous()
        return t

    def _step_adam(self, mine: list[tuple[torch.Tensor, dict]], oks: dict | None = None) -> None:
        """The Adam(W) parameters `mine` (with their groups): those the format's native kernel
        takes in one call per kind (AdamTensor.bucket), the others, and any a kernel turned down,
        in one compiled adam_multi call per (device, dtypes, shape, formats).
        oks: parameter -> 0-dim bool guard (step_in_backward), else None."""
        native: dict[tuple, list[AdamTensor]] = defaultdict(list)
        steps: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        rest: list[AdamTensor] = []
        for p, group in mine:
            t = self._adam_tensor(p, group, None if oks is None else oks[p])
            if t.ok is None:
                steps[t.p.device].append(t.step)
            else:  # a skipped parameter keeps its step count too
                t.step.add_(t.ok.to(torch.float32))
            (native[t.bucket(native=True)] if self.backends.native and t.native else rest).append(t)
        for same_device in steps.values():  # torch's Adam counts steps first, then steps
            torch._foreach_add_(same_device, 1.0)
        for items in native.values():
            if not self.backends.run_native(
                    lambda: native_step(items, self.moments.block_size, master=self.master_weights), len(items)):
                rest += items
        compiled: dict[tuple, list[AdamTensor]] = defaultdict(list)
        for t in rest:
            compiled[t.bucket(native=False)].append(t)
        for same in compiled.values():
            first, hypers = same[0], {}
            for t in same:  # per param group, once
                if id(t.group) not in hypers:
                    hypers[id(t.group)] = adam_hypers(t.group)
            self.backends.run(
                "adam", adam_multi, [t.p for t in same], [t.g for t in same], [t.m for t in same],
                [t.v for t in same], [t.lo for t in same] if first.lo is not None else [], [t.step for t in same],
                [hypers[id(t.group)] for t in same],
                [torch.tensor(t.salt, dtype=torch.int64) for t in same] if self.master_weights == "bf16_sr" else [],
                [t.ok for t in same] if first.ok is not None else [],
                decoupled=first.decoupled, master=self.master_weights, emulate=self.emulate,
                m_format=first.m_format, v_format=first.v_format)

    def _step_sgd(self, mine: list[tuple[torch.Tensor, dict]]) -> None:
        """Every SGD parameter whose momentum the format stores, one compiled call per (device,
        dtypes, shape, kind)."""
        fmt, B = self.moments, self.moments.block_size
        calls: dict[tuple, list] = defaultdict(list)
        hypers: dict[int, tuple] = {}
        for p, group in mine:
            state = self.state[p]
            first = state.get("momentum_buffer") is None
            if first:
                state["momentum_buffer"] = like(fmt.zeros(local(p).shape, p.device), p)
            pl, g = local(p), local_grad(p)
            if id(group) not in hypers:
                hypers[id(group)] = sgd_hypers(group)
            key = (first, bool(group["nesterov"]), pl.device, pl.dtype, g.dtype, (pl.numel() // B, B))
            calls[key].append((pl.view(-1, B), g.reshape(-1, B), fmt.view(local(state["momentum_buffer"])),
                               hypers[id(group)]))
        for (first, nesterov, *_), items in calls.items():
            ps, gs, bufs, hyp = (list(x) for x in zip(*items))
            self.backends.run("sgd", sgd_multi, ps, gs, bufs, hyp, first=first, nesterov=nesterov,
                              m_format=type(fmt))

    def _muon_here(self, p: torch.Tensor, group: dict) -> bool:
        """A Muon parameter with fp32 momentum is stepped here, not by torch.optim.Muon, where its
        Newton-Schulz dtype is not torch's bf16 (fp32 on a CPU: muon.py says why), where it is an
        FSDP/TP shard (torch's would orthogonalize the shard: muon_sharded.py gathers it), where
        its group asks for NorMuon (which torch's step lacks), or where every parameter is (bf16
        masters, in the backward: torch's step would not honour them)."""
        return self.is_muon and (self.steps_every_parameter or isinstance(p, DTensor) or bool(group.get("normuon"))
                                 or (self.muon_ns_dtype or ns_dtype(p.device)) != torch.bfloat16)

    def _step_muon(self, mine: list[tuple[torch.Tensor, dict]], oks: dict | None = None) -> None:
        """Every Muon parameter stepped here, one compiled call per (device, dtypes, shape, format,
        group settings): muon.muon_calls. oks: parameter -> 0-dim bool guard (step_in_backward)."""
        mine = step_sharded(self, mine)  # FSDP/TP shards: each matrix gathered whole (muon_sharded.py)
        for args, flags in muon_calls(self, mine, oks, salts=self._salts):
            self.backends.run("muon", muon_multi, *args, **flags)

    def _init_adam_state(self, p: torch.Tensor, state: dict, quantized: int) -> None:
        # float32 on the parameter's device, as torch's fused Adam keeps it: on a GPU the bias
        # corrections are then computed there, inside the compiled step, never on the host
        pl = local(p)
        state["step"] = torch.zeros((), dtype=torch.float32, device=pl.device)
        shard = pl.shape  # FSDP: this rank's rows; the state is wrapped like p

        def fp32() -> torch.Tensor:
            return like(torch.zeros(shard, dtype=torch.float32, device=pl.device), p)

        state["exp_avg"] = like(self.moments.zeros(shard, p.device), p) if quantized else fp32()
        if quantized >= 2:
            state["exp_avg_sq_sqrt"] = like(self.moments.zeros(shard, p.device), p)
        else:
            state["exp_avg_sq"] = fp32()
        if self.master_weights == "bf16_split":  # the master is the bf16 weight exactly: low half 0
            state["master_lo"] = like(torch.zeros(shard, dtype=torch.int16, device=pl.device), p)

    # ---- loading --------------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this wrapper (any format or level) or of the plain wrapped optimizer.

        Every saved state is first checked against its parameter (shape, blocks and scales,
        dtypes), ValueError otherwise with this optimizer unchanged (saved_state.check_loaded). The
        wrapped optimizer then does the loading (param id mapping, group hyperparameters,
        device); each state is converted to what this wrapper stores (saved_state.convert).
        """
        saved_state.check_loaded(state_dict, self.param_groups, sgd=self.is_sgd or self.is_muon,
                                 kind=type(self.optimizer).__name__)
        self.optimizer.load_state_dict(state_dict)
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        if self.steps_every_parameter:
            # torch casts floating states to the parameter's dtype (bf16 here): our moments are
            # fp32 (or quantized codes that must not be touched), so take the saved values as they are
            saved = [i for g in state_dict["param_groups"] for i in g["params"]]
            params = [p for g in self.param_groups for p in g["params"]]
            for i, p in zip(saved, params):
                if i in state_dict["state"]:
                    self.state[p] = {k: v.to(p.device) if torch.is_tensor(v) and k != "step" else v
                                     for k, v in state_dict["state"][i].items()}
        # FSDP: convert each rank's shard of the states, then wrap them back like their parameter
        sharded = [p for g in self.param_groups for p in g["params"] if isinstance(p, DTensor) and self.state.get(p)]
        for p in sharded:
            self.state[p] = {k: local(v) if torch.is_tensor(v) and k != "step" else v for k, v in self.state[p].items()}
        saved_state.convert(self)
        for p in sharded:
            self.state[p] = {k: like(v, p) if torch.is_tensor(v) and k != "step" else v for k, v in self.state[p].items()}

    def add_param_group(self, param_group: dict) -> None:
        if not hasattr(self, "optimizer"):  # called by Optimizer.__init__ on the shared groups
            return super().add_param_group(param_group)
        self.optimizer.add_param_group(param_group)
        self._salts = self._make_salts()
        self._summary_logged = False

    # ---- reporting ----------------------------------------------------------------------------

    def planned_bytes(self, p: torch.Tensor, group: dict) -> int:
        """Bytes of state the first step will allocate for p (this wrapper's layout)."""
        n = local(p).numel()  # FSDP: this rank's shard
        quantized = self.stores(p, group)
        # the moments we allocate are fp32 (all of them when we step every parameter, or v beside
        # a quantized m), the wrapped optimizer's are in p's dtype
        return (optimizer_bytes(n, quantized=quantized, moments=self.moment_count(group),
                                block_size=self.moments.block_size,
                                moment_bytes=4 if quantized or self.steps_every_parameter else p.element_size())
                + n * bytes_per_param(self.master_weights)[2])  # bf16_split's remainder

    def fp32_states(self) -> dict[str, tuple[int, int]]:
        """Why parameters keep fp32 moments although the format stores moments: reason ->
        (tensors, params). Empty when it stores every parameter's, or is fp32 itself."""
        kept: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for group in self.param_groups:
            count = self.moment_count(group)
            for p in group["params"]:
                reason = self.moments.kept(p, count)
                if reason is not None:
                    kept[reason][0] += 1
                    kept[reason][1] += p.numel()
        return {reason: (n, numel) for reason, (n, numel) in kept.items()}

    def fp32_state_notes(self) -> list[str]:
        """fp32_states() as fallback lines for a run's results, in the format's words."""
        notes = (self.moments.fallback_note(n, numel, reason) for reason, (n, numel) in self.fp32_states().items())
        return [note for note in notes if note]

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: optimizer_state_bytes(self)."""
        return optimizer_state_bytes(self)

    def state_bytes_per_param(self) -> float:
        """state_bytes() / number of parameters."""
        n = sum(local(p).numel() for g in self.param_groups for p in g["params"])
        return self.state_bytes() / n if n else 0.0

    def summary(self, *, logged: bool = False) -> str:
        """One line of layout (and one per reason some moments stay fp32); the first step logs it unless `logged`."""
        self._summary_logged |= logged
        kind, fmt = type(self.optimizer).__name__, self.moments
        n_moments = 1 if self.is_sgd or self.is_muon else 2
        if type(fmt) is MomentFormat:
            n = sum(1 for g in self.param_groups for _ in g["params"])
            numel = sum(p.numel() for g in self.param_groups for p in g["params"])
            here = self.steps_every_parameter or any(self._muon_here(p, g) for g in self.param_groups for p in g["params"])
            who = "stepped here" if here else "stepped by the wrapped optimizer"
            return (f"{type(self).__name__}({kind}, master_weights={self.master_weights}): {n} tensors / {numel:,} "
                    f"params with fp32 moments, {who}; {format_bytes(self.state_bytes())} of state")
        stored = [(p.numel(), q) for g in self.param_groups for p in g["params"] if (q := self.stores(p, g))]
        numel = sum(n for n, _ in stored)
        moment_bytes = sum(optimizer_bytes(n, quantized=q, moments=n_moments, block_size=fmt.block_size)
                           for n, q in stored)
        per_param = moment_bytes / numel if numel else 4.0 * n_moments
        master = "" if self.master_weights == "fp32" else f", master_weights={self.master_weights}"
        lines = [f"{type(self).__name__}({kind}, {fmt.describe()}{master}): {len(stored)} tensors / {numel:,} params "
                 f"with {fmt.name} state ({per_param:.3f} bytes/param of moments); {self.state_bytes():,} bytes of state"]
        for reason, (n, kept) in self.fp32_states().items():
            lines.append(f"  fp32 state: {n} tensors / {kept:,} params "
                         f"({format_bytes(optimizer_bytes(kept, moments=n_moments))}): {reason}")
        return "\n".join(lines)


class FP8Optim(OptimWrapper):
    """OptimWrapper with Adam's moments (SGD's and Muon's momentum) in FP8: the E4M3Blocks format.

    Args:
        optimizer: a constructed torch.optim.AdamW, Adam, SGD or Muon (its param_groups are shared).
        opt_level: 0 fp32 moments; 1 first moment FP8; 2 both moments FP8 (~2.03 bytes/param
            instead of 8; SGD, Muon: 1 and 2 agree, ~1.02 bytes/param instead of 4).
        block_size: elements per scale (256: moments/fp8.py has the bytes/param arithmetic).
        min_numel: parameters with fewer elements keep fp32 state.
        compile, backend, master_weights, seed, emulate: OptimWrapper's. backend "auto" runs the
            native C kernel for Adam(W) on CPU, torch.compile otherwise (backends.py).
    """

    moments: E4M3Blocks

    def __init__(self, optimizer: torch.optim.Optimizer, opt_level: int = 2, *,
                 block_size: int = DEFAULT_BLOCK_SIZE, min_numel: int = MIN_NUMEL,
                 compile: bool = True, backend: str = "auto", master_weights: str = "fp32",
                 seed: int = 0, emulate: bool = False) -> None:
        super().__init__(optimizer, moments=E4M3Blocks(opt_level, block_size=block_size, min_numel=min_numel),
                         compile=compile, backend=backend, master_weights=master_weights, seed=seed, emulate=emulate)

    @property
    def opt_level(self) -> int:
        return self.moments.opt_level

    @property
    def block_size(self) -> int:
        return self.moments.block_size


__all__ = ["SUPPORTED", "FP8Optim", "OptimWrapper"]
