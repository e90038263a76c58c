"""torch.compile's state for one training run: what a compiled step calls, whether the next step
compiles, and whether compiling failed.

A run compiles its training module whole (--compile_scope model: one graph, the fastest steps)
or each transformer block in place (blocks: one graph every block reuses, so compiling does not
grow with depth). Blocks that do not share a graph recompile once each, and dynamo's default
limit of 8 compiles per function would silently run the blocks after the eighth eagerly, so a
per-block compile may recompile once for every block, twice after `auto` fixes its formats.
FP8 statistics and auto's calibration run eagerly (their hooks would force recompiles); fixing
auto's formats changes what the graphs do not guard on, so the next compiled step compiles
again. A compile that fails (no C++ compiler for CPU code, an unsupported backend) falls back
to eager once, recorded, instead of ending the run; an error of the model or the data is raised
as eager would raise it.
"""

from __future__ import annotations

import contextlib

import torch


def _is_compile_failure(e: BaseException) -> bool:
    """An exception raised by torch.compile's machinery (dynamo, inductor, a C++ or Triton
    toolchain), as opposed to an error of the model or the data that eager would raise too."""
    from torch._dynamo.exc import BackendCompilerFailed, TorchDynamoException

    if isinstance(e, (BackendCompilerFailed, TorchDynamoException)):
        return True
    mod = type(e).__module__ or ""
    return mod.startswith(("torch._dynamo", "torch._inductor", "triton"))


class Compiled:
    """torch.compile's state for one run. `module` is what a compiled step calls: the training
    module compiled whole (--compile_scope model), or the module itself with each transformer
    block compiled in place (blocks: one graph every block reuses). Compiling happens in the first
    step that runs compiled code (`pending`); if it fails the run trains eagerly from then on
    (`failed`, a recorded fallback). Eager steps (FP8 statistics, calibration) and evaluation run
    blocks compiled in place under `eager()`."""

    def __init__(self, module: torch.nn.Module, blocks: torch.nn.ModuleList, *, enabled: bool, scope: str):
        self.eager_module = module
        self.in_place = enabled and scope == "blocks"
        self._limit = contextlib.nullcontext
        if self.in_place:
            for block in blocks:
                block.compile()
            # every block's graph, and again after auto fixes its formats, on top of the default's room
            limit = torch._dynamo.config.recompile_limit + 2 * len(blocks)
            self._limit = lambda: torch._dynamo.config.patch(recompile_limit=limit)
        self.module = torch.compile(module) if enabled and not self.in_place else module
        self.enabled = enabled
        self.pending = enabled
        """The next step that runs compiled code traces and compiles it."""
        self.failed = False

    def eager(self):
        """Context: compiled code runs eagerly (blocks compiled in place; the whole-model graph is
        simply not called)."""
        return torch.compiler.set_stance("force_eager") if self.in_place else contextlib.nullcontext()

    def recompile(self) -> None:
        """The model changed in a way its graphs do not guard on (auto's formats were fixed)."""
        self.pending = self.enabled and not self.failed

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, eager: bool, autocast, fallback) -> torch.Tensor:
        """The training forward, eager or compiled; the step that compiles falls back to eager if
        compiling fails (`fallback(message)` records why)."""
        if eager or self.failed:
            with autocast, self.eager():
                return self.eager_module(x, y)
        try:
            with autocast, self._limit():
                loss = self.module(x, y)
            self.pending = False  # compiled: the next step runs the graphs
            return loss
        except Exception as e:  # noqa: BLE001 -- any compiler failure; training goes on eagerly
            if not (self.pending and _is_compile_failure(e)):
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            fallback(f"compile: torch.compile failed ({type(e).__name__}: {first[:240]}); training eagerly. "
                     "Install a C++ compiler (CPU builds) or pass --no_compile to skip the attempt")
            self.module, self.pending, self.failed = self.eager_module, False, True
            with autocast, self.eager():
                return self.eager_module(x, y)


__all__ = ["Compiled"]
