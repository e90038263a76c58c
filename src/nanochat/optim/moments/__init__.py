"""How optimizer moments are stored: fp32 (format.MomentFormat) or FP8 blocks (fp8.py).

A moment format is what a step reads a moment through and writes it back with; an optimizer's
step (adam.py, sgd.py, muon.py) is written once over it. codec.py holds the FP8 byte codec and the
blockwise quantizer, e4m3.h the same codec in C, which a native kernel includes; fp8.py the FP8
storage built on them (FP8Tensor: e4m3 codes with an fp32 scale per block) and the E4M3Blocks
format.
"""

from .codec import C_CODEC
from .format import MomentFormat
from .fp8 import DEFAULT_BLOCK_SIZE, MIN_NUMEL, E4M3Blocks, FP8Tensor, fp8_size_problem, quantize_sqrt_v

__all__ = ["C_CODEC", "DEFAULT_BLOCK_SIZE", "E4M3Blocks", "FP8Tensor", "MIN_NUMEL", "MomentFormat", "fp8_size_problem",
           "quantize_sqrt_v"]
