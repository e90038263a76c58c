"""MomentFormat: how an optimizer wrapper stores its optimizer's moments, the one extension point.

Inside a step (adam.py, sgd.py) a moment is read into fp32 and written back by four static
functions; the compiled step takes the format's class as a constant of its graph, so a format
adds no guard and no branch to the update:

    read(m) -> fp32 m            write(m, new, ok) -> tie
    read_sq(v) -> fp32 v         write_sq(v, v_new, sqrt(v_new), ok) -> tie

Around the step (the wrapper, saved_state.py), an instance says how many of a parameter's
moments it stores and why not, makes a zero moment, views a stored one and converts a loaded
one. It never asks which optimizer it serves: an optimizer says how many moments it keeps.
`MomentFormat` itself is fp32, what torch keeps; fp8.py's E4M3Blocks is the FP8 one.
"""

from __future__ import annotations

from typing import Any

import torch


class MomentFormat:
    """fp32 moments (torch's own representation); the base every moment format overrides."""

    name = "fp32"
    """What the summary calls the stored moments."""
    block_size: int | None = None
    """Elements per scale of the stored moments; None: fp32, sliced anywhere."""

    # ---- inside the step: static, the compiled graph's constants ------------------------------
    @staticmethod
    def read(m: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return m[0]

    @staticmethod
    def write(m: tuple[torch.Tensor, ...], new: torch.Tensor, ok: torch.Tensor | None) -> Any:
        """Store `new` (ok: None, or a 0-dim bool; False keeps the old value). Returns the tie: 0.0,
        or a zero tensor computed from what was stored (the step adds it to the weight's write)."""
        m[0].copy_(new if ok is None else torch.where(ok, new, m[0]))
        return 0.0

    @staticmethod
    def read_sq(v: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return v[0]

    @staticmethod
    def write_sq(v: tuple[torch.Tensor, ...], new: torch.Tensor, sqrt_new: torch.Tensor,
                 ok: torch.Tensor | None) -> Any:
        return MomentFormat.write(v, new, ok)

    # ---- around the step ----------------------------------------------------------------------
    def stores(self, p: torch.Tensor, moments: int) -> int:
        """How many of p's `moments` (its optimizer's: first, then second) this format stores;
        0 keeps them fp32."""
        return 0

    def kept(self, p: torch.Tensor, moments: int) -> str | None:
        """Why p's moments stay fp32 although this format stores moments (its summary and the
        run's fallbacks), or None."""
        return None

    def zeros(self, shape: torch.Size, device: torch.device) -> torch.Tensor:
        """A zero moment in this format, for a shard of `shape`."""
        raise NotImplementedError(f"{type(self).__name__} stores no moments of its own")

    def view(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A stored moment as the static functions take it ([n_blocks, B] views)."""
        raise NotImplementedError(f"{type(self).__name__} stores no moments of its own")

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """A loaded moment (any representation) as this format stores it."""
        raise NotImplementedError(f"{type(self).__name__} stores no moments of its own")

    def quantize_sqrt(self, v: torch.Tensor) -> torch.Tensor:
        """The fp32 second moment v as this format stores sqrt(v) (exp_avg_sq_sqrt)."""
        raise NotImplementedError(f"{type(self).__name__} stores no moments of its own")

    def is_stored(self, x: torch.Tensor) -> bool:
        """A loaded exp_avg_sq_sqrt already in this format (kept bit for bit)."""
        return False

    def fallback_note(self, tensors: int, numel: int, reason: str) -> str | None:
        """The run's fallback line for `tensors` tensors of `numel` parameters kept fp32 for
        `reason` (`kept`), naming the setting that asked for this format; None: not a fallback."""
        return None

    def describe(self) -> str:
        """The format's settings as the wrapper's summary names them."""
        return self.name


__all__ = ["MomentFormat"]
