"""How a wrapper's step runs: a native kernel, torch.compile, or eagerly; the fallbacks between them.

    native   a C kernel a moment format brings (nanochat.fp8: optim_kernel.c for FP8 moments on
             CPU, several times faster than the compiled step: BENCHMARKS.md §3(b)), one call a step
    compile  torch.compile(fullgraph=True, dynamic=False) of step.py's multi-tensor functions:
             one compiled call per (shape, dtype, device, flags), not per parameter (GPUs, SGD,
             bf16 parameters, fp32 moments)
    eager    the same Python functions run eagerly

`backend="auto"` tries them in that order where each applies; "native" / "compile" / "eager"
start lower in the chain. A backend that cannot run falls to the next one (native -> compile ->
eager) for the rest of the optimizer's life, logged once with its reason and kept in
`fallbacks` (the trainer copies them into TrainResult.fallbacks): an optimizer that stepped
natively once and compiled the next step would be slow for no reason a user could see.
`counts` says how the last step ran, for benchmarks and tests.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from nanochat.common import warn_once

BACKENDS = ("auto", "native", "compile", "eager")


class Backends:
    """Which backends may still run, the compiled functions, and the last step's counts."""

    def __init__(self, owner: str, backend: str = "auto", *, compile: bool = True):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be {', '.join(BACKENDS[:-1])} or {BACKENDS[-1]}; got {backend!r}")
        self.owner = owner
        """The optimizer's class name, in the fallback messages."""
        self.native = compile and backend in ("auto", "native")
        """A native kernel may be tried (False after it failed once)."""
        self.compile = compile and backend != "eager"
        """torch.compile may be tried (False after it failed once)."""
        self.fallbacks: list[str] = []
        """Each fallback taken (native kernel unavailable, compile failed), with its reason."""
        self.counts: dict[str, tuple[int, int]] = {}
        """The current (or last) step: backend -> (calls, tensors)."""
        self._compiled: dict[str, Any] = {}

    def reset(self) -> None:
        """A new step begins: its counts start at zero."""
        self.counts = {}

    def _count(self, backend: str, tensors: int) -> None:
        calls, n = self.counts.get(backend, (0, 0))
        self.counts[backend] = (calls + 1, n + tensors)

    def run(self, name: str, fn: Callable, *args, **flags) -> None:
        """fn(*args, **flags), compiled once per `name` and flags; dynamo then keeps one graph per
        list length and tensor shape (a model has few, so its limit of 8 is lifted). args[0] is
        the list of parameters."""
        key = name + repr(sorted(flags.items()))
        if self.compile:
            compiled = self._compiled.get(key)
            if compiled is None:
                compiled = self._compiled[key] = torch.compile(fn, fullgraph=True, dynamic=False)
            try:
                with torch._dynamo.utils.disable_cache_limit():
                    compiled(*args, **flags)
                self._count("compile", len(args[0]))
                return
            except Exception as e:  # no C++ compiler, unsupported backend, ...
                self.compile = False
                self._fallback("eager", f"{self.owner}: torch.compile of the step failed ({type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}); running the step eagerly "
                               "(correct, several times slower). Pass compile=False to skip the attempt.")
        fn(*args, **flags)
        self._count("eager", len(args[0]))

    def run_native(self, call: Callable[[], None], tensors: int) -> bool:
        """call() runs a native kernel over `tensors` tensors; False when the kernel is
        unavailable (it raised RuntimeError: no compiler, a stale build, a block size it cannot
        do): then it is never tried again and the caller steps these tensors compiled."""
        try:
            call()
        except RuntimeError as e:
            self.native = False
            self._fallback("native", f"{self.owner}: the native CPU kernel is unavailable ({e}); using "
                           "torch.compile for the step instead (several times slower on CPU).")
            return False
        self._count("native", tensors)
        return True

    def _fallback(self, kind: str, message: str) -> None:
        self.fallbacks.append(message)
        warn_once(f"optim-{kind}", message)


__all__ = ["BACKENDS", "Backends"]
