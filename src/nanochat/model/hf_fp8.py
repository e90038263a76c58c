"""FP8 weights in Hugging Face checkpoints: quantize a trained model for serving, read one back.

`export_hf(..., quantize="fp8")` writes compressed-tensors' float-quantized format (llm-compressor's
FP8_DYNAMIC), which vLLM, SGLang and transformers load: a Linear's `weight` as float8_e4m3fn
codes with an fp32 `weight_scale` per output channel ([N, 1]; `fp8_block`: per 128x128 block),
activations quantized per token by the engine. `mxfp8` writes e4m3 codes with a uint8 e8m0
exponent per 32 values along K. The cast and config.json are compressed-tensors' own (its
compressor and ModelCompressor), so no part of the format is written by hand; it is imported only
when used, so plain checkpoints load without it. Why this format and not vLLM's: docs/design.md.

Scales are amax / 448 (e4m3's largest value) per channel or block, so nothing saturates; MXFP8's
are that rounded up to a power of two, the scale torchao's MXFP8 training gives the weight, so an
MXFP8 run serves the codes its last forward pass multiplied. Each layer's weight SQNR is
reported. Embeddings, lm_head, norms and biases stay bf16; so does a Linear the run trained in
high precision or whose SQNR is under SQNR_FLOOR_DB (unless `quantize_all`), and one fused with a
bf16 Linear (vLLM and SGLang run q/k/v and gate/up as one matmul, in one format); all are named in
`ignore`.
`FP8Checkpoint` reads such a checkpoint back as dequantized weights. The serving side and the
SQNR floor's derivation: docs/hf.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import torch

from nanochat.common import UsageError, format_table, warn_once
from nanochat.config.export import SQNR_FLOOR_DB, Quantize

E4M3_MAX = 448.0
"""float8_e4m3fn's largest finite value: a channel's (block's) amax maps to it."""
BLOCK = 128
"""fp8_block's block edge: DeepSeek-V3's 128x128 weight blocks, activation groups of 128."""
REPORT_FILE = "fp8_report.json"
"""Written next to the weights: the scheme, the floor and each Linear's SQNR or why it stayed bf16."""
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling Linears vLLM and SGLang load as one matmul (qkv_proj, gate_up_proj): all or none in FP8."""
MX_BLOCK = 32
"""mxfp8's group: 32 consecutive values along K share one e8m0 scale (the OCP MX spec's block)."""
_PRESET = {"fp8": "FP8_DYNAMIC", "fp8_block": "FP8_BLOCK", "mxfp8": "MXFP8"}  # compressed-tensors' scheme names
_FORMAT = {"fp8": "float-quantized", "fp8_block": "float-quantized", "mxfp8": "mxfp8-quantized"}
_INSTALL = "pip install compressed-tensors (or nanochat's `export` extra: pip install -e '.[export]')"


def require_compressed_tensors(what: str) -> None:
    """A UsageError naming `what` needs it, before any work, when compressed-tensors is missing."""
    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        raise UsageError(f"{what} uses the compressed-tensors format and needs its library: {_INSTALL}") from None


def _scheme(quantize: str):
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme(_PRESET[quantize], ["Linear"])


def _compressor(scheme):
    """compressed-tensors' compressor for `scheme`: MX (e8m0 scales as uint8 exponents) or float."""
    from compressed_tensors.compressors.mxfp8.base import MXFP8QuantizationCompressor
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization.utils import should_generate_mx_scales

    return MXFP8QuantizationCompressor if should_generate_mx_scales(scheme.weights) else FloatQuantizationCompressor


def amax_scales(weight: torch.Tensor, quantize: str) -> torch.Tensor:
    """fp32 scales from the weight's amax: [N, 1] per output channel, [N/128, K/128] per block,
    [N, K/32] powers of two for mxfp8. An all-zero channel gets the smallest normal fp32 (its codes
    are 0 whatever the scale); an all-zero MX block e8m0's smallest, 2^-127."""
    w = weight.detach().float().abs()
    if quantize == "mxfp8":
        n, k = w.shape  # [N, K] -> [N, K/32, 32]: a block's values share dim 2
        exponent = torch.ceil(torch.log2(w.view(n, k // MX_BLOCK, MX_BLOCK).amax(dim=2) / E4M3_MAX))
        return torch.exp2(exponent.clamp(-127, 127))  # e8m0's range (log2(0) = -inf clamps to -127)
    if quantize == "fp8_block":
        n, k = w.shape  # [N, K] -> [N/128, 128, K/128, 128]: a block's values share dims 1 and 3
        amax = w.view(n // BLOCK, BLOCK, k // BLOCK, BLOCK).amax(dim=(1, 3))
    else:
        amax = w.amax(dim=1, keepdim=True)
    return (amax / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)


def quantize_weight(weight: torch.Tensor, quantize: str, scheme=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes, fp32 scales) of a [N, K] weight, cast by compressed-tensors' compressor;
    `scheme`: the compressed-tensors scheme of `quantize`, when the caller holds it already."""
    scale = amax_scales(weight, quantize)
    scheme = scheme if scheme is not None else _scheme(quantize)
    out = _compressor(scheme).compress({"weight": weight.detach().float(), "weight_scale": scale}, scheme)
    return out["weight"], out["weight_scale"]


def dequantize_weight(codes: torch.Tensor, scale: torch.Tensor, scheme) -> torch.Tensor:
    """fp32 weights from codes and scales (fp32, or MX's uint8 exponents), by compressed-tensors'
    decompressor (what the engines compute)."""
    scale = scale if scale.dtype == torch.uint8 else scale.float()
    return _compressor(scheme).decompress({"weight": codes, "weight_scale": scale}, scheme)["weight"].float()


CHUNK_ELEMENTS = 1 << 18
"""Rows of a weight are quantized and measured in slices of about this many values (1 MiB of
fp32, whole 128-row blocks): the temporaries stay in cache instead of faulting in fresh pages,
much faster than quantizing a weight whole (BENCHMARKS.md §8(b))."""


def quantize_layer(weight: torch.Tensor, quantize: str, scheme) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(e4m3 codes, fp32 scales, weight SQNR in dB) of a [N, K] weight, a slice of rows at a time."""
    n, k = weight.shape
    rows = max(BLOCK, CHUNK_ELEMENTS // k // BLOCK * BLOCK)
    codes = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scales, signal, noise = [], 0.0, 0.0
    for r in range(0, n, rows):
        part = weight[r:r + rows].detach().float()
        codes[r:r + rows], scale = quantize_weight(part, quantize, scheme)
        scales.append(scale)
        noise += float((part - dequantize_weight(codes[r:r + rows], scale, scheme)).square().sum(dtype=torch.float64))
        signal += float(part.square().sum(dtype=torch.float64))
    return codes, torch.cat(scales), math.inf if noise == 0 else 10 * math.log10(signal / noise)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """10 log10(sum ref^2 / sum (ref - approx)^2), summed in float64; inf when exact. The
    difference of two fp32 tensors is exact to fp32 rounding, 2^-24 of the weight: far below any
    FP8 noise, so no float64 copy of an 8B model's layers is needed."""
    ref = reference.float()
    noise = float((ref - approx.float()).square().sum(dtype=torch.float64))
    return math.inf if noise == 0 else 10 * math.log10(float(ref.square().sum(dtype=torch.float64)) / noise)


@dataclass(frozen=True)
class LayerResult:
    """One candidate Linear: FP8 or bf16, its weight SQNR, and why it stayed bf16."""

    name: str
    """Hugging Face module name, e.g. model.layers.0.mlp.down_proj."""
    shape: tuple[int, int]
    sqnr_db: float | None
    """The FP8 copy's weight SQNR against the master weight; None when it was kept before measuring."""
    reason: str = ""
    """Why it stays bf16; empty when it is FP8."""

    @property
    def quantized(self) -> bool:
        return not self.reason


@dataclass
class FP8Export:
    """What `quantize_checkpoint` made: the tensors to save, the config, and the per-layer report."""

    tensors: dict[str, torch.Tensor]
    quantization_config: object
    """A compressed_tensors QuantizationConfig."""
    layers: list[LayerResult]
    quantize: str
    floor_db: float
    quantize_all: bool = False
    ignore: list[str] = field(default_factory=list)

    @property
    def quantized(self) -> list[LayerResult]:
        return [la for la in self.layers if la.quantized]

    @property
    def kept(self) -> list[LayerResult]:
        return [la for la in self.layers if not la.quantized]

    def table(self) -> str:
        kind = "mxfp8 e4m3" if self.quantize == "mxfp8" else "fp8 e4m3"
        rows = [[la.name, "x".join(map(str, la.shape)), "-" if la.sqnr_db is None else f"{la.sqnr_db:.1f}",
                 kind if la.quantized else "bf16", la.reason] for la in self.layers]
        return format_table(["layer", "N x K", "weight SQNR dB", "stored as", "why bf16"], rows)

    def summary(self) -> str:
        measured = [la.sqnr_db for la in self.quantized if la.sqnr_db is not None]
        low = f", weight SQNR min {min(measured):.1f} dB / median {sorted(measured)[len(measured) // 2]:.1f} dB" \
            if measured else ""
        where = {"fp8": "fp32 scales per output channel", "fp8_block": "fp32 scales per 128x128 block",
                 "mxfp8": f"e8m0 scales per {MX_BLOCK} values along K"}[self.quantize]
        return (f"{self.quantize}: {len(self.quantized)} of {len(self.layers)} Linear layers in e4m3 with "
                f"{where}{low}; {len(self.kept)} kept in bf16 (floor {self.floor_db:g} dB"
                f"{', --quantize_all' if self.quantize_all else ''})")

    def to_json(self) -> dict:
        return {"quantize": self.quantize, "scheme": _PRESET[self.quantize], "sqnr_floor_db": self.floor_db,
                "quantize_all": self.quantize_all,
                "layers": [{"name": la.name, "shape": list(la.shape),
                            "stored_as": "fp8_e4m3" if la.quantized else "bf16",
                            "weight_sqnr_db": None if la.sqnr_db is None or math.isinf(la.sqnr_db) else la.sqnr_db,
                            **({"why_bf16": la.reason} if la.reason else {})} for la in self.layers]}

    def write(self, directory: str | Path) -> None:
        """Add `quantization_config` to directory/config.json (compressed-tensors' ModelCompressor
        writes it) and write REPORT_FILE."""
        from compressed_tensors.compressors import ModelCompressor

        ModelCompressor(quantization_config=self.quantization_config).update_config(str(directory))
        (Path(directory) / REPORT_FILE).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def _fused_partners(name: str, names: set[str]) -> list[str]:
    parent, _, leaf = name.rpartition(".")
    for group in FUSED:
        if leaf in group:
            return [f"{parent}.{g}" for g in group if g != leaf and f"{parent}.{g}" in names]
    return []


@torch.no_grad()
def quantize_checkpoint(tensors: Mapping[str, torch.Tensor], linears: Sequence[str], *, quantize: str,
                        keep: Mapping[str, str] | None = None, quantize_all: bool = False,
                        floor_db: float = SQNR_FLOOR_DB, output_embedding: str = "lm_head") -> FP8Export:
    """An FP8 checkpoint from a Hugging Face-named state dict.

    `linears`: the module names of the Linears that may become FP8 (`<name>.weight` is [N, K]);
    `keep`: name -> why it stays bf16 (layers the run trained in high precision); `quantize_all`
    quantizes those and the layers under `floor_db` too. fp8_block needs N and K to be multiples of
    128 (whole blocks and activation groups), whatever `quantize_all` says. Every other floating
    tensor is stored in bf16; mxfp8 needs K to be a multiple of 32. `output_embedding` is named in
    `ignore` even when tied (absent from `tensors`): the engines build it as a Linear, which the
    config's "Linear" target would match.
    """
    if quantize not in _PRESET:
        raise ValueError(f"quantize must be one of {', '.join(_PRESET)}, got {quantize!r}")
    require_compressed_tensors(f"--quantize {quantize}")
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    keep = dict(keep or {})
    unknown = sorted(set(keep) - set(linears))
    if unknown:
        raise ValueError(f"keep names layers that are not among the candidate Linears: {unknown[:3]}")
    reasons: dict[str, str] = {}
    quantized: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    sqnrs: dict[str, float] = {}
    shapes: dict[str, tuple[int, int]] = {}
    scheme = _scheme(quantize)
    for name in linears:
        w = tensors[f"{name}.weight"]
        shapes[name] = tuple(w.shape)
        if quantize == "fp8_block" and (w.shape[0] % BLOCK or w.shape[1] % BLOCK):
            reasons[name] = (f"{w.shape[0]}x{w.shape[1]} is not whole 128x128 blocks (FP8_BLOCK's activation "
                             "groups and vLLM's block kernels need them)")
            continue
        if quantize == "mxfp8" and w.shape[1] % MX_BLOCK:
            reasons[name] = (f"K = {w.shape[1]} is not a multiple of {MX_BLOCK} (MXFP8's blocks of {MX_BLOCK} along "
                             "K, for the weight and the activations)")
            continue
        if name in keep and not quantize_all:
            reasons[name] = keep[name]
            continue
        codes, scale, sqnrs[name] = quantize_layer(w, quantize, scheme)
        if not torch.isfinite(scale).all():  # amax propagates inf and nan
            raise ValueError(f"{name}.weight holds inf/nan: no FP8 scale can represent it; export a checkpoint "
                             "whose weights are finite")
        if sqnrs[name] < floor_db and not quantize_all:
            reasons[name] = f"weight SQNR {sqnrs[name]:.1f} dB < floor {floor_db:g} dB (--quantize_all to override)"
            continue
        quantized[name] = codes, scale
    names, held_back = set(linears), set(reasons)
    for name in list(quantized):  # a fused group is one matmul in the engines: one format for all
        held = [p for p in _fused_partners(name, names) if p in held_back]
        if held:
            reasons[name] = f"fused with {held[0].rpartition('.')[2]} in vLLM/SGLang, which stays bf16"
            del quantized[name]
    layers = [LayerResult(n, shapes[n], sqnrs.get(n), reasons.get(n, "")) for n in linears]
    if linears and not quantized:
        warn_once(f"fp8-export-nothing:{quantize}", f"--quantize {quantize}: none of the {len(linears)} Linear layers "
                  f"was quantized (the first, {linears[0]}: {reasons[linears[0]]}); the export holds bf16 weights")

    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        module, _, leaf = key.rpartition(".")
        if module in quantized and leaf == "weight":
            out[key], out[f"{module}.weight_scale"] = quantized[module]
        else:
            out[key] = t.detach().to(torch.bfloat16).contiguous() if t.is_floating_point() else t
    ignore = list(dict.fromkeys([*(key.rpartition(".")[0] for key in tensors
                                   if key.rpartition(".")[0] not in quantized), output_embedding]))
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=_FORMAT[quantize],
                                quantization_status=QuantizationStatus.COMPRESSED, ignore=ignore)
    return FP8Export(out, config, layers, quantize, floor_db, quantize_all, ignore)


# ----------------------------------------------------------------------------- reading

_QPARAMS = ("weight_scale", "input_scale", "weight_zero_point", "input_zero_point")
"""Tensors a compressed-tensors checkpoint stores next to a quantized weight."""


class FP8Checkpoint:
    """The `quantization_config` of a compressed-tensors FP8 checkpoint, to dequantize its
    weights: ours, or llm-compressor's FP8_DYNAMIC / FP8_BLOCK / FP8 (static activation scales,
    which high-precision activations do not need) / MXFP8."""

    def __init__(self, qconfig: dict, origin: str):
        require_compressed_tensors(f"{origin} (an FP8 checkpoint)")
        from compressed_tensors.quantization import QuantizationConfig

        try:
            self.config = QuantizationConfig.model_validate({k: v for k, v in qconfig.items()
                                                             if k in QuantizationConfig.model_fields})
        except ValueError as e:
            raise UsageError(f"{origin}: quantization_config is not a compressed-tensors config nanochat reads "
                             f"({str(e).splitlines()[0]}); restore config.json from the model's source") from None
        self.origin = origin
        problems = []
        if self.config.format not in ("float-quantized", "naive-quantized", "mxfp8-quantized"):
            problems.append(f"format {self.config.format!r}")
        for group, scheme in self.config.config_groups.items():
            w = scheme.weights
            if w is None or w.type != "float" or w.num_bits != 8 or not w.symmetric:
                problems.append(f"{group}'s weights ({w.type if w else None}, {w.num_bits if w else None} bits"
                                f"{'' if w is None or w.symmetric else ', asymmetric'})")
        if problems:
            raise UsageError(f"{origin}: nanochat reads FP8 (float-quantized, 8-bit float, symmetric) compressed-"
                             f"tensors checkpoints; this one has {'; '.join(problems)}. Load it with the tool "
                             "that wrote it and save it unquantized")
        self.strategies = sorted({s.weights.strategy for s in self.config.config_groups.values()})

    @staticmethod
    def is_qparam(key: str) -> bool:
        """A scale or zero point, read with its weight rather than on its own."""
        return key.rpartition(".")[2] in _QPARAMS

    def dequantize(self, key: str, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """fp32 weights of the Linear whose weight is `key` (its config group's scheme)."""
        from compressed_tensors.utils.match import is_match

        module = key.rpartition(".")[0]
        linear = torch.nn.Linear(1, 1, device="meta")  # a quantized tensor is a Linear's weight
        for scheme in self.config.config_groups.values():
            if is_match(module, linear, scheme.targets):
                return dequantize_weight(codes, scale, scheme)
        raise UsageError(f"{self.origin}: {key} is FP8 but no config group of quantization_config targets "
                         f"{module}; restore config.json from the model's source")


def fp8_checkpoint(hf_config: dict, origin: str) -> FP8Checkpoint | None:
    """The FP8 reader for a config.json dict that has a compressed-tensors quantization_config;
    None for a plain checkpoint; a UsageError for another quantization method."""
    qconfig = hf_config.get("quantization_config")
    if qconfig is None:
        return None
    method = qconfig.get("quant_method") if isinstance(qconfig, dict) else None
    if method != "compressed-tensors":
        raise UsageError(f"{origin}: quantization_config has quant_method {method!r}; nanochat reads plain "
                         "checkpoints and compressed-tensors FP8 ones (what export_hf --quantize and "
                         "llm-compressor write). Dequantize it with the tool that wrote it first")
    return FP8Checkpoint(qconfig, origin)


__all__ = ["BLOCK", "E4M3_MAX", "FUSED", "MX_BLOCK", "REPORT_FILE", "SQNR_FLOOR_DB", "FP8Checkpoint", "FP8Export",
           "LayerResult", "Quantize", "amax_scales", "dequantize_weight", "fp8_checkpoint", "quantize_checkpoint",
           "quantize_layer", "quantize_weight", "require_compressed_tensors", "sqnr_db"]
