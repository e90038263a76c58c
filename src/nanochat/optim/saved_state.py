"""Optimizer state as it is saved, checked on load and converted to what a wrapper stores now.

A wrapper's state dict is torch's (`state`: parameter index -> {name: value}, `param_groups`), so
a checkpoint loads into the wrapped optimizer alone and a plain torch state loads into a wrapper:

    Adam   step, exp_avg, and exp_avg_sq (v) or exp_avg_sq_sqrt (sqrt(v), what a quantized format
           stores); master_lo under bf16_split (master.py)
    SGD    momentum_buffer
    Muon   momentum_buffer; master_lo under bf16_split, step under bf16_sr (its bits' counter),
           neuron_variance under NorMuon (muon.neuron_variance: one fp32 value per neuron)

A moment is a plain tensor or a quantized one, recognized by the `QuantizedState` members
(moments.FP8Tensor has them), so this code serves any format and imports none. Loading checks
every state against its parameter first (`check_loaded`: a moment of another size would make a
native kernel read and write past its buffers), then `convert` brings each one to what the
wrapper stores now (quantized <-> fp32, v <-> sqrt(v)), shard by shard (shards.py).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from .shards import local

ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq", "exp_avg_sq_sqrt", "master_lo")
SGD_KEYS = ("momentum_buffer",)
MUON_KEYS = ("momentum_buffer", "step", "master_lo", "neuron_variance")


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
    if opt.is_sgd or opt.is_muon:
        buf = state.get("momentum_buffer")
        if buf is not None:
            state["momentum_buffer"] = opt.moments.quantize(buf.to(p.device)) if quantized else _high(opt, buf, p)
        if opt.is_muon:
            if state.get("neuron_variance") is not None:
                state["neuron_variance"] = state["neuron_variance"].to(device=p.device, dtype=torch.float32)
            _convert_master(opt, p, state)
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
    _convert_master(opt, p, state)


def _convert_master(opt: torch.optim.Optimizer, p: torch.Tensor, state: dict) -> None:
    """The step count as a 0-dim fp32 tensor (Adam's always, Muon's where saved: bf16_sr's
    counter) and bf16_split's low halves: kept under bf16_split, else dropped."""
    if "step" in state or not opt.is_muon:
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
    is loaded; `sgd`: a momentum buffer is the whole state (SGD; Muon, `kind` "Muon", adds its
    bf16 masters' step and master_lo: MUON_KEYS). Parameters are matched as torch matches them
    (in param_groups order); groups of other sizes are left to the wrapped optimizer (`kind`),
    which refuses them."""
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
                problem = _keys_problem(state, sgd, kind) or next(
                    (x for x in (_state_problem(k, v, local(p)) for k, v in state.items()) if x), None)
            else:
                problem = None if state is None else f"its state is a {type(state).__name__}, not a dict"
            if problem:
                raise ValueError(
                    f"optimizer state of parameter {index} (param group {gi}, shape {tuple(p.shape)}): {problem}; "
                    f"this {kind} state is not this model's (or the file was altered): nothing was loaded")
            index += 1


def _keys_problem(state: dict, sgd: bool, kind: str) -> str | None:
    """What is wrong with the keys of one parameter's saved state, or None."""
    allowed = MUON_KEYS if kind == "Muon" else SGD_KEYS if sgd else ADAM_KEYS
    extra = [k for k in state if k not in allowed]
    if extra:
        return f"unexpected state {extra} ({kind}'s state holds {', '.join(allowed)})"
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
    if key == "neuron_variance":
        rows, cols = like_p.shape
        want_shape = (rows, 1) if rows >= cols else (1, cols)
        if not (torch.is_tensor(value) and value.dtype == torch.float32 and tuple(value.shape) == want_shape):
            return f"neuron_variance must be an fp32 tensor of shape {want_shape}, got {_describe(value)}"
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


__all__ = ["ADAM_KEYS", "MUON_KEYS", "SGD_KEYS", "QuantizedState", "check_loaded", "convert", "dense"]
