"""The one Adam(W) step and the one SGD-momentum step, written once over moment formats.

A wrapper (wrapper.py) steps a parameter here when the wrapped torch optimizer cannot: its moments
are stored in another format (format.py; nanochat.fp8: FP8 codes and block scales), its weights
are bf16 masters (master.py), or it steps inside the backward with a guard (in_backward.py). The
math is torch's, in fp32, written once; a format only says how a moment is read and written
back (MomentFormat's four static functions), as torchao's optim/adam.py keeps one
`single_param_adam` and lets each state subclass decide the same thing.

A moment is a tuple of tensors (fp32: the tensor itself, in the parameter's shape; a block
format: [n_blocks, B] views). `ok` is None or a 0-dim bool: False leaves every state as it was
(the step inside the backward skips a parameter whose gradient is not finite, decided on the
device). The format's `tie`, added to the weight's write, keeps one fused loop per parameter
under inductor (FP8: see its write).

Hyperparameters are 0-dim float64 CPU tensors (`host_scalar`), as in torchao's optimizers: a
changing lr does not recompile, and on a GPU the compiled kernels take them as scalar arguments,
so nothing is copied to the device or read back. Step counts are 0-dim float32 tensors on the
parameter's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .format import MomentFormat
from .master import read_master, round_rne, sr_bits, write_master


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


def sgd_step(p, g, buf, lr, momentum, dampening, wd, *, first: bool, nesterov: bool, m_format: type):
    """SGD with momentum on one parameter, its buffer as `m_format` stores it; `first`: the
    buffer's first step."""
    pf = p.float()
    d_p = g.float() + wd * pf
    if first:  # torch: buf = clone(d_p)
        b = d_p
    else:  # torch: buf.mul_(momentum).add_(d_p, alpha=1 - dampening)
        b = m_format.read(buf) * momentum + (1 - dampening) * d_p
    tie = m_format.write(buf, b, None)
    d = d_p + momentum * b if nesterov else b
    p.copy_(pf - lr * d + tie)


def sgd_multi(ps, gs, bufs, hypers, *, first: bool, nesterov: bool, m_format: type):
    """sgd_step over lists of same-shape tensors; hypers[i] = (lr, momentum, dampening, wd)."""
    for i in range(len(ps)):
        sgd_step(ps[i], gs[i], bufs[i], *hypers[i], first=first, nesterov=nesterov, m_format=m_format)


def host_scalar(x) -> torch.Tensor:
    """A hyperparameter as a 0-dim float64 tensor; one that already is a tensor stays where it is
    (reading it back to the host would wait for the device)."""
    if torch.is_tensor(x):
        return x.detach().to(torch.float64)
    return torch.tensor(float(x), dtype=torch.float64)


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
    """A native kernel can step it (its format has one, and this device and these dtypes)."""

    def bucket(self, *, native: bool) -> tuple:
        """Which call steps this tensor: tensors with equal keys are stepped by one call. A native
        kernel takes every shape in one call per weight-decay kind and v format (its guard is per
        tensor); a compiled call is one graph, so its key holds every flag of the graph, the
        guard's presence included, and the device, dtypes and shape."""
        if native:
            return ("native", self.decoupled, self.v_format)
        return ("compiled", self.decoupled, self.m_format, self.v_format, self.ok is not None, self.p.device,
                self.p.dtype, self.g.dtype, tuple(self.p.shape))


__all__ = ["AdamTensor", "adam_hypers", "adam_multi", "adam_step", "host_scalar", "sgd_multi", "sgd_step"]
