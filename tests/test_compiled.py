"""nanochat.train.compiled at --compile_scope blocks, against the same blocks compiled by hand.

Blocks that each need a graph of their own (here: a constant per block that dynamo guards on, as
it did on FP8 blocks on an H200) must all run compiled. Under a recompile limit of 1 (dynamo's
default is 8, which a 12-block model exceeded), blocks compiled one by one with `block.compile()`
hit the limit and run eagerly after the first: one graph and dynamo's warning. Compiled's blocks
make one graph each, no warning, and the loss equals the eager model's within 1e-6 relative: the
same fp32 ops on 32 values (three 8x8 linears, a squared difference, a mean), which inductor may
fuse and sum in another order, each reordering worth about one ulp (2^-23 = 1.2e-7) of the
result; a block left out or run on other weights moves the loss by far more.
"""

import contextlib
import logging

import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from nanochat.train.compiled import Compiled


class Tagged(nn.Module):
    def __init__(self, tag: int):
        super().__init__()
        self.tag = tag  # a Python int read in forward: each block's graph guards on its value
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) + self.tag


class Stack(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Tagged(i) for i in range(n))

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return ((x - y) ** 2).mean()


def _run(use_compiled: bool) -> tuple[int, list[str], torch.Tensor, torch.Tensor]:
    """(graphs compiled, dynamo's limit warnings, loss, the eager model's loss) of a 3-block stack."""
    torch._dynamo.reset()
    counters.clear()
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    dynamo_log = logging.getLogger("torch._dynamo")
    dynamo_log.addHandler(handler)
    model = Stack(3)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    want = model(x, y)
    try:
        with torch._dynamo.config.patch(recompile_limit=1):
            if use_compiled:
                compiled = Compiled(model, model.blocks, enabled=True, scope="blocks")
                got = compiled.forward(x, y, eager=False, autocast=contextlib.nullcontext(), fallback=warnings.append)
            else:
                for block in model.blocks:
                    block.compile()
                got = model(x, y)
    finally:
        dynamo_log.removeHandler(handler)
    hits = [w for w in warnings if w.startswith("torch._dynamo hit config.")]
    return int(counters["stats"]["unique_graphs"]), hits, got, want


def test_every_block_runs_compiled_though_each_needs_its_own_graph():
    graphs, hits, got, want = _run(use_compiled=False)  # the reference: blocks compiled by hand
    assert graphs == 1 and hits, (graphs, hits)
    graphs, hits, got, want = _run(use_compiled=True)
    assert graphs == 3 and not hits, (graphs, hits)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
