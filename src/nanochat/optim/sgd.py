"""SGD with momentum: the one step, its momentum buffer in any moment format.

A wrapper (wrapper.py) steps an SGD parameter here when its format stores the buffer (FP8Optim:
e4m3 blocks); the others are stepped by torch.optim.SGD itself. torch's math in fp32; the format
reads and writes the buffer (moments/format.py), so the compiled step is one graph per format.
"""

from __future__ import annotations

import torch

from .backends import host_scalar


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


def moments(group: dict) -> int:
    """Moments SGD keeps per parameter of `group`: the momentum buffer, only with momentum."""
    return 1 if group["momentum"] else 0


def sgd_hypers(group: dict) -> tuple[torch.Tensor, ...]:
    """(lr, momentum, dampening, weight_decay) of an SGD param group, as host scalars."""
    return tuple(host_scalar(group[k]) for k in ("lr", "momentum", "dampening", "weight_decay"))


__all__ = ["moments", "sgd_hypers", "sgd_multi", "sgd_step"]
