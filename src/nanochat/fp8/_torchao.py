"""Import torchao with its import-time log lines muted (imported first by the files that use torchao).

torchao 0.18 logs, on every import, that its prebuilt CUDA extensions for MX formats and Hopper
CUTLASS kernels (`_C_mxfp8`, `_C_cutlass_90a`) do not load for this torch build and that Triton
is absent on CPU, and torch's pytree logs a deprecation for two torchao Enums. None of those
extensions is used by `torchao.float8` or by us, so the lines are noise for our users; real
problems (torchao failing to import at all) still raise.
"""

import logging

_names = ("torchao", "torchao.kernel.intmm", "torch.utils._pytree")
_loggers = [logging.getLogger(n) for n in _names]
_levels = [lg.level for lg in _loggers]
for _lg in _loggers:
    _lg.setLevel(logging.ERROR)
try:
    import torchao.float8  # noqa: F401
finally:
    for _lg, _level in zip(_loggers, _levels):
        _lg.setLevel(_level)
