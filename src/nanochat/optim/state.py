"""Optimizer state as it is saved, checked, converted and sharded.

A wrapper's state dict is torch's (`state`: parameter index -> {name: value}, `param_groups`), so
a checkpoint loads into the wrapped optimizer alone and a plain torch state loads into a wrapper.
The names per parameter:

    Adam   step, exp_avg, and exp_avg_sq (v) or exp_avg_sq_sqrt (sqrt(v), what a quantized
           format stores: nanochat.fp8 keeps it in e4m3 for its range); master_lo under
           bf16_split (master.py)
    SGD    momentum_buffer

A moment is a plain tensor or a quantized one: any tensor subclass with the `QuantizedState`
members (nanochat.fp8.FP8Tensor). This package never imports the format; it recognizes one by
what it can do, so the layers stay one way (fp8 above optim).

Loading checks every state against its parameter first (`check_loaded`): a moment of another
size would make a native kernel read and write past its buffers. Then `convert` brings each
state to what the wrapper stores now (quantized <-> fp32, v <-> sqrt(v)), so a run may change
how it stores moments, or start from a plain torch optimizer's state. Under FSDP2 a parameter is
a DTensor holding this rank's rows: states are made for the shard (`local`) and kept as DTensors
laid out like their parameter (`like`), which is what `get_optimizer_state_dict` and DCP need to
save each rank's part and to reshard it on load (nanochat.distributed).
"""

from __future__ import annotations

import functools
from typing import Any, Protocol, runtime_checkable

import torch

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # a torch built without distributed: no parameter is a DTensor
    DTensor, Shard = (), None  # isinstance(x, ()) is always False

ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq", "exp_avg_sq_sqrt", "master_lo")
SGD_KEYS = ("momentum_buffer",)


@runtime_checkable
class QuantizedState(Protocol):
    """A moment stored quantized: codes plus a `scale` per block of `block_size` elements, so it
    slices only on block boundaries and is read back through `dequantize`. Recognized by its
    methods (class attributes), since a tensor read from a file may lack instance attributes."""

    def dequantize(self, output_dtype: torch.dtype = torch.float32) -> torch.Tensor: ...

    def layout_problem(self) -> str | None:
        """Why its codes and scales do not make a consistent tensor, or None."""

    def nbytes_stored(self) -> int:
        """Bytes its codes and scales hold."""


def dense(x: torch.Tensor) -> torch.Tensor:
    """A state tensor's values as a plain tensor: a quantized moment dequantized to fp32."""
    return x.dequantize() if isinstance(x, QuantizedState) else x


def local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: the local shard of a DTensor (FSDP2 parameters, gradients,
    and the states made for them), with a wrapper subclass of one inner tensor (torchao's FP8
    all-gather weight, WeightWithDynamicFloat8CastTensor) unwrapped, so kernels see plain tensors;
    a quantized state stays whole."""
    if isinstance(t, DTensor):
        t = t.to_local()
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and not _quantized_type(type(t)) \
            and hasattr(t, "__tensor_flatten__"):
        inner, _ = t.__tensor_flatten__()
        if len(inner) == 1:
            t = getattr(t, inner[0])
    return t


@functools.cache
def _quantized_type(kind: type) -> bool:
    """QuantizedState's check on a class, once per class: `local` runs for every state at every step."""
    return all(callable(getattr(kind, name, None)) for name in ("dequantize", "layout_problem", "nbytes_stored"))


def local_grad(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of p's gradient, laid out as `local(p)`. A tensor-parallel embedding's
    gradient comes back replicated while its weight is split by rows (torch's sharding rule for
    the embedding backward); it is sliced to this rank's rows, which needs no communication."""
    g = p.grad
    if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
        g = g.redistribute(p.device_mesh, p.placements)
    return local(g)


def like(shard: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A state made for this rank's shard of `p`, as a DTensor laid out like `p` (what DCP saves
    and reshards); unchanged for a plain parameter."""
    if isinstance(p, DTensor):
        return DTensor.from_local(shard, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                  run_check=False)
    return shard


def shard_problem(p: torch.Tensor, block_size: int) -> str | None:
    """Why the shards of the DTensor `p` are not whole blocks on every rank, or None. Decided
    from the global shape, so all ranks agree. FSDP2 alone shards dim 0 like torch.chunk,
    ceil(rows / ranks) rows per rank (the last rank fewer, and whole blocks too when the full
    tensor and the others are). Tensor parallelism (and FSDP2 over it) splits rows or a matrix's
    columns over several mesh dims: every split must be even, and a shard's rows (row split) or
    each of its rows (column split) whole blocks, so its blocks are the full tensor's blocks. A
    replicated DTensor (norm weights under tensor parallelism) is whole everywhere."""
    splits: dict[int, int] = {}
    for mesh_dim, placement in enumerate(p.placements):
        if placement.is_shard():
            splits[placement.dim] = splits.get(placement.dim, 1) * p.device_mesh.size(mesh_dim)
    if not splits:
        return None
    row = p.numel() // p.shape[0]
    if tuple(p.placements) == (Shard(0),):
        chunk = -(-p.shape[0] // p.device_mesh.size())  # ceil
        if chunk * row % block_size:
            return (f"a shard of {chunk} rows x {row} is not whole {block_size}-element "
                    f"blocks at {p.device_mesh.size()} ranks")
        return None
    layout = f"sharded as {tuple(p.placements)}"
    if set(splits) - {0, 1} or (1 in splits and p.dim() != 2):
        return f"{layout}; a block format needs the rows or a matrix's columns split"
    uneven = [d for d, n in splits.items() if p.shape[d] % n]
    if uneven:
        return f"{layout}: dim {uneven[0]} ({p.shape[uneven[0]]}) does not split evenly over {splits[uneven[0]]} ranks"
    if 1 in splits and (p.shape[1] // splits[1]) % block_size:
        return f"{layout}: a shard's rows of {p.shape[1] // splits[1]} are not whole {block_size}-element blocks"
    if 1 not in splits and (p.shape[0] // splits[0]) * row % block_size:
        return f"{layout}: a shard of {p.shape[0] // splits[0]} rows x {row} is not whole {block_size}-element blocks"
    return None


# ------------------------------------------------------------------------------- conversion
def convert(opt: torch.optim.Optimizer) -> None:
    """Bring every parameter's loaded state to what the wrapper `opt` stores now: its moment
    format quantizes (`opt.moments`: quantize, quantize_sqrt, is_stored); a moment kept in high
    precision is fp32 when the wrapper steps it, else in the wrapped optimizer's convention."""
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p)
            if state:
                _convert_one(opt, p, state, opt.stores(p, group))


def _convert_one(opt: torch.optim.Optimizer, p: torch.Tensor, state: dict, quantized: int) -> None:
    if opt.is_sgd:
        buf = state.get("momentum_buffer")
        if buf is not None:
            state["momentum_buffer"] = opt.moments.quantize(buf.to(p.device)) if quantized else _high(opt, buf, p)
        return
    m = state["exp_avg"]
    state["exp_avg"] = opt.moments.quantize(m.to(p.device)) if quantized else _high(opt, m, p)
    r = state.get("exp_avg_sq_sqrt")
    if quantized >= 2 and r is not None and opt.moments.is_stored(r):
        state["exp_avg_sq_sqrt"] = r.to(p.device)  # already what the format stores: bit-exact
    else:
        if r is not None:  # stored sqrt(v): v = r^2
            r = dense(state.pop("exp_avg_sq_sqrt")).to(p.device).float()
            v = r * r
        else:
            v = dense(state.pop("exp_avg_sq")).to(p.device).float()
        if quantized >= 2:
            state["exp_avg_sq_sqrt"] = opt.moments.quantize_sqrt(v)
        elif quantized:  # only the first moment quantized: the wrapper keeps v in fp32 whatever p's dtype
            state["exp_avg_sq"] = v.to(device=p.device, dtype=torch.float32).contiguous()
        else:
            state["exp_avg_sq"] = _high(opt, v, p)
    if not torch.is_tensor(state.get("step")):
        state["step"] = torch.tensor(float(state.get("step", 0)), dtype=torch.float32)
    lo = state.pop("master_lo", None)
    if opt.master_weights == "bf16_split":  # from a run without it: the master is p
        state["master_lo"] = lo.to(p.device) if lo is not None else \
            torch.zeros(local(p).shape, dtype=torch.int16, device=p.device)


def _high(opt: torch.optim.Optimizer, x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A moment kept in high precision: fp32 when the wrapper steps it (bf16 masters,
    in-backward), else the wrapped optimizer's convention (the parameter's dtype)."""
    dtype = p.dtype if p.is_floating_point() and not opt.steps_every_parameter else torch.float32
    return dense(x).to(device=p.device, dtype=dtype)


# ------------------------------------------------------------------------------- loading checks
def check_loaded(state_dict: dict, param_groups: list[dict], *, sgd: bool, kind: str) -> None:
    """ValueError naming the first saved state that does not fit its parameter, before anything
    is loaded. Parameters are matched as torch matches them (in param_groups order); groups of
    other sizes are left to the wrapped optimizer (`kind`), which refuses them."""
    saved_groups, states = state_dict.get("param_groups"), state_dict.get("state")
    if not isinstance(saved_groups, list) or not isinstance(states, dict):
        raise ValueError("an optimizer state dict holds 'state' (a dict) and 'param_groups' (a list); got "
                         f"{type(states).__name__} and {type(saved_groups).__name__}")
    if [len(g.get("params", ())) if isinstance(g, dict) else -1 for g in saved_groups] != \
            [len(g["params"]) for g in param_groups]:
        return
    index = 0
    for gi, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        for i, p in zip(saved["params"], group["params"]):
            state = states.get(i)
            if isinstance(state, dict):
                problem = _keys_problem(state, sgd) or next(
                    (x for x in (_state_problem(k, v, local(p)) for k, v in state.items()) if x), None)
            else:
                problem = None if state is None else f"its state is a {type(state).__name__}, not a dict"
            if problem:
                raise ValueError(
                    f"optimizer state of parameter {index} (param group {gi}, shape {tuple(p.shape)}): {problem}; "
                    f"this {kind} state is not this model's (or the file was altered): nothing was loaded")
            index += 1


def _keys_problem(state: dict, sgd: bool) -> str | None:
    """What is wrong with the keys of one parameter's saved state, or None."""
    allowed = SGD_KEYS if sgd else ADAM_KEYS
    extra = [k for k in state if k not in allowed]
    if extra:
        return f"unexpected state {extra} (an {'SGD' if sgd else 'Adam'} state holds {', '.join(allowed)})"
    if not sgd and not ("step" in state and "exp_avg" in state
                        and ("exp_avg_sq" in state) != ("exp_avg_sq_sqrt" in state)):
        return f"state {list(state)}: an Adam state holds step, exp_avg and one of exp_avg_sq, exp_avg_sq_sqrt"
    return None


def _state_problem(key: str, value: Any, like_p: torch.Tensor) -> str | None:
    """Why `value` cannot be state `key` of a parameter whose tensor on this rank is `like_p`, or
    None: a number or 0-dim tensor for the step; a moment of the parameter's shape, either a
    consistent quantized tensor or a floating tensor laid out as the parameter; int16 for master_lo."""
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
    value = local(value)  # FSDP: this rank's shard, compared with the parameter's
    expected = f"the parameter's {tuple(like_p.shape)} ({like_p.numel()} elements)"
    if isinstance(value, QuantizedState):
        problem = value.layout_problem()
        if problem:
            return f"{key} is an inconsistent {type(value).__name__}: {problem}"
        if value.shape != like_p.shape:
            return (f"{key} is an {type(value).__name__} of shape {tuple(value.shape)} ({value.numel()} elements, "
                    f"{value.scale.numel()} scales), expected {expected}")
        return None
    want = "int16" if key == "master_lo" else "floating point"
    if (value.dtype != torch.int16) if key == "master_lo" else not value.is_floating_point():
        return f"{key} must be {want}, got {value.dtype}"
    if value.shape != like_p.shape:
        return f"{key} has shape {tuple(value.shape)} ({value.numel()} elements), expected {expected}"
    if not (value.is_contiguous() or value.stride() == like_p.stride()):
        return f"{key} has strides {value.stride()}: expected contiguous, or laid out as the parameter"
    return None


def _describe(value: Any) -> str:
    if torch.is_tensor(value):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


__all__ = ["ADAM_KEYS", "SGD_KEYS", "QuantizedState", "check_loaded", "convert", "dense", "like", "local",
           "shard_problem"]
