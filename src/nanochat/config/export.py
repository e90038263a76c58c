"""ExportConfig: `scripts/export_hf.py`'s flags, and the constants of an FP8 export they default to.

`Quantize` and `SQNR_FLOOR_DB` are defined here, below the code that uses them
(nanochat.model.hf_fp8, FP8Trainer.save_fp8), because the config layer imports nothing above
it: `--help` loads no torch, and a flag's default is the library's default by construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from nanochat.config.fields import ScriptFields, SourceFields

Quantize = Literal["none", "fp8", "fp8_block", "mxfp8"]
"""How an export stores its Linear weights: fp32 (none), float8 e4m3 with a scale per output
channel (fp8: compressed-tensors FP8_DYNAMIC), per 128x128 block (fp8_block: FP8_BLOCK), or a
power-of-two (e8m0) scale per 32 values along K (mxfp8: MXFP8, for Blackwell's MX tensor cores)."""

SQNR_FLOOR_DB = 28.0
"""A layer whose FP8 weight SQNR is below this stays bf16. e4m3 rounding gives 24.6 dB at worst
(each value off by at most 1/17 of itself) and realistic weights 31.5-33 dB, so 28 dB, between
the two, flags a layer with over twice the typical rounding noise. A 20 dB floor could never
trigger."""


@dataclass(frozen=True, kw_only=True)
class ExportConfig(ScriptFields, SourceFields):
    """Export a run's checkpoint, or a model as loaded, to a Hugging Face model directory."""

    out_dir: str
    """Directory to write config.json, model.safetensors and the tokenizer files to. It must be
    new or empty, unless --overwrite."""

    overwrite: bool = False
    """Replace a non-empty --out_dir whole, once the export is complete (never the model or run
    the export reads from)."""

    quantize: Quantize = "none"
    """none: fp32 weights. fp8: every block Linear's weight in float8 e4m3 with an fp32 scale per
    output channel, activations quantized per token at run time (compressed-tensors FP8_DYNAMIC,
    which vLLM, SGLang and transformers load); fp8_block: one scale per 128x128 block (FP8_BLOCK);
    mxfp8: one e8m0 scale per 32 values along K, activations in groups of 32 (MXFP8; transformers
    on CPU runs it in bf16). Embeddings, lm_head, norms and the Linears the run trained in high
    precision stay bf16."""

    quantize_all: bool = False
    """With --quantize: also quantize the Linears the run trained in high precision and those
    under --sqnr_floor_db (lm_head, embeddings and norms stay bf16)."""

    sqnr_floor_db: float = SQNR_FLOOR_DB
    """With --quantize: a Linear whose FP8 weight SQNR is below this stays bf16 (e4m3 gives 24.6 dB
    at worst, typical weights several dB more: docs/hf.md)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.quantize == "none" and (self.quantize_all or self.sqnr_floor_db != SQNR_FLOOR_DB):
            raise ValueError("--quantize_all and --sqnr_floor_db choose what --quantize stores in FP8; add "
                             "--quantize fp8 (or fp8_block)")
        if not math.isfinite(self.sqnr_floor_db):
            raise ValueError(f"--sqnr_floor_db must be a finite number of dB, got {self.sqnr_floor_db}")
