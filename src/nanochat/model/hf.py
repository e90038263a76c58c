"""Hugging Face checkpoints into our GPT: the config map (both ways) and the weights.

The Llama family (Llama 2 and 3, Mistral, Qwen2) is one architecture with a few switches that
`nanochat.model.gpt.GPT` already has, so a checkpoint is loaded into our own model code (the same
`nn.Linear` modules for FP8 conversion, the trainer and generation as a nanochat preset):

    model.embed_tokens -> transformer.wte, model.layers.i.self_attn.{q,k,v,o}_proj ->
    transformer.h.i.attn.c_{q,k,v,proj}, model.layers.i.mlp.{gate,up,down}_proj ->
    transformer.h.i.mlp.c_{gate,fc,proj}, model.norm -> transformer.ln_f, lm_head -> lm_head

Anything we do not implement (another model_type, a rope type such as yarn, ...) is an error
naming it, never a model that silently computes something else. Weights are copied one tensor
at a time from memory-mapped safetensors into a model built on the meta device (peak memory:
the model plus one tensor); an FP8 checkpoint is dequantized on the way (nanochat.model.hf_fp8).
Finding a checkpoint is nanochat.model.hub's job, writing one nanochat.model.export's, its
tokenizer nanochat.tokenizer.hf's. Details (config switches, sliding windows, serving): docs/hf.md.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open

from nanochat.common import UsageError, logger, warn_once
from nanochat.model.gpt import GPT, GPTConfig
from nanochat.model.hf_fp8 import fp8_checkpoint
from nanochat.model.hub import read_config_json
from nanochat.tokenizer.hf import HFTokenizer

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


# ----------------------------------------------------------------------------- config


def _rope_params(hf: dict) -> dict:
    """Rope settings from either config layout: transformers >= 5 writes `rope_parameters`
    (theta inside), earlier versions and most hub checkpoints `rope_theta` + `rope_scaling`."""
    params = hf.get("rope_parameters")
    if params is None:
        params = dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def _sliding_window(hf: dict) -> int | None:
    """The attention window if any layer uses one, else None."""
    window = hf.get("sliding_window")
    if window is None:
        return None
    if hf["model_type"] == "mistral":
        return window
    if "layer_types" in hf:  # transformers >= 5 spells the per-layer choice out
        return window if "sliding_attention" in hf["layer_types"] else None
    if hf.get("use_sliding_window") and hf.get("max_window_layers", 0) < hf["num_hidden_layers"]:
        return window
    return None


def gpt_config_from_hf(hf: dict, *, seq_len: int | None = None) -> GPTConfig:
    """Our GPTConfig for a Hugging Face `config.json` dict; unsupported options are errors.

    seq_len defaults to max_position_embeddings (capped at an active sliding window).
    """
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; nanochat loads the Llama family: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    unsupported = []
    if hf.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={hf['hidden_act']!r} (only silu, i.e. SwiGLU)")
    if hf.get("mlp_bias"):
        unsupported.append("mlp_bias=true")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        unsupported.append(f"partial_rotary_factor={hf['partial_rotary_factor']}")
    if hf.get("pretraining_tp", 1) != 1:
        # Sliced matmuls in some Llama 2 configs; transformers computes the same result either way.
        logger.info("hf: ignoring pretraining_tp=%s (a matmul slicing detail, same result)", hf["pretraining_tp"])
    rope = _rope_params(hf)
    rope_kw = _rope_kwargs(rope, unsupported)
    if unsupported:
        raise ValueError(f"{model_type} checkpoint uses options nanochat does not implement: "
                         f"{'; '.join(unsupported)}")

    max_pos = hf["max_position_embeddings"]
    window = _sliding_window(hf)
    if window is not None and window < (seq_len or max_pos):
        if seq_len is not None:
            raise ValueError(
                f"seq_len {seq_len} exceeds the checkpoint's sliding_window {window}: nanochat "
                f"implements full causal attention only, which equals sliding-window attention "
                f"only for contexts up to the window. Use seq_len <= {window}."
            )
        warn_once(f"hf-window-{window}", f"{model_type}: context capped at the sliding_window of {window} "
                  f"tokens (max_position_embeddings is {max_pos}); within it, full causal attention is exact")
        max_pos = window
    if model_type == "qwen2":  # Qwen2 hard-codes biases on q, k, v (not o)
        qkv_bias, out_bias = True, False
    else:
        qkv_bias = out_bias = bool(hf.get("attention_bias", False))
    n_head = hf["num_attention_heads"]
    return GPTConfig(
        vocab_size=hf["vocab_size"], seq_len=seq_len or max_pos, n_layer=hf["num_hidden_layers"],
        n_head=n_head, n_kv_head=hf.get("num_key_value_heads") or n_head, n_embd=hf["hidden_size"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_head,
        softcap=0.0, rope_theta=float(rope["rope_theta"]), **rope_kw,
        mlp="swiglu", intermediate_size=hf["intermediate_size"],
        norm_weight=True, norm_eps=float(hf.get("rms_norm_eps", 1e-6)), embed_norm=False, qk_norm=False,
        qkv_bias=qkv_bias, attn_out_bias=out_bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def _rope_kwargs(rope: dict, unsupported: list[str]) -> dict:
    """GPTConfig's rope_* fields for a checkpoint's RoPE parameters (_rope_params); an unsupported
    rope_type is appended to `unsupported`."""
    if rope["rope_type"] == "linear":
        return dict(rope_scaling="linear", rope_factor=float(rope["factor"]))
    if rope["rope_type"] == "llama3":
        return dict(rope_scaling="llama3", rope_factor=float(rope["factor"]),
                    rope_low_freq_factor=float(rope["low_freq_factor"]),
                    rope_high_freq_factor=float(rope["high_freq_factor"]),
                    rope_original_max_pos=int(rope["original_max_position_embeddings"]))
    if rope["rope_type"] != "default":
        unsupported.append(f"rope_type={rope['rope_type']!r} (supported: default, linear, llama3)")
    return {}


def hf_config_from_gpt(cfg: GPTConfig) -> dict:
    """The `config.json` dict of an exportable GPTConfig (see the module docstring)."""
    wrong = []
    if cfg.mlp != "swiglu":
        wrong.append(f"mlp={cfg.mlp!r} (Llama has SwiGLU)")
    if not cfg.norm_weight:
        wrong.append("norm_weight=False (Llama's RMSNorm has a learned weight)")
    if cfg.norm_eps is None:
        wrong.append("norm_eps=None (Llama needs an explicit rms_norm_eps)")
    if cfg.softcap:
        wrong.append(f"softcap={cfg.softcap} (Llama has no logit softcap)")
    if cfg.qk_norm:
        wrong.append("qk_norm=True (Llama has no QK-norm)")
    if cfg.embed_norm:
        wrong.append("embed_norm=True (Llama does not normalize the embeddings)")
    if cfg.attn_out_bias and not cfg.qkv_bias:
        wrong.append("attn_out_bias without qkv_bias (neither Llama nor Qwen2)")
    if wrong:
        raise ValueError(
            "this model's architecture does not map onto a Hugging Face Llama/Qwen2 model, so it "
            f"cannot be exported for transformers: {'; '.join(wrong)}. Export supports models "
            "loaded from Llama-family checkpoints (and fine-tuned); nanochat presets (d4, ...) "
            "are saved with nanochat's own checkpoints."
        )
    qwen2 = cfg.qkv_bias and not cfg.attn_out_bias
    rope_scaling = None
    if cfg.rope_scaling == "linear":
        rope_scaling = dict(rope_type="linear", factor=cfg.rope_factor)
    elif cfg.rope_scaling == "llama3":
        rope_scaling = dict(rope_type="llama3", factor=cfg.rope_factor,
                            low_freq_factor=cfg.rope_low_freq_factor,
                            high_freq_factor=cfg.rope_high_freq_factor,
                            original_max_position_embeddings=cfg.rope_original_max_pos)
    out = dict(
        architectures=["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
        model_type="qwen2" if qwen2 else "llama",
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.seq_len, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
        rope_theta=cfg.rope_theta, rope_scaling=rope_scaling,
        tie_word_embeddings=cfg.tie_embeddings, torch_dtype="float32",
    )
    if not qwen2:
        out.update(attention_bias=cfg.qkv_bias, mlp_bias=False)
    return out


# ----------------------------------------------------------------------------- weights

# (HF name pattern, our name pattern); {i} is the layer index. One table serves both directions.
_NAME_MAP = [
    ("model.embed_tokens.weight", "transformer.wte.weight"),
    ("model.norm.weight", "transformer.ln_f.weight"),
    ("lm_head.weight", "lm_head.weight"),
    ("model.layers.{i}.input_layernorm.weight", "transformer.h.{i}.ln_1.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "transformer.h.{i}.ln_2.weight"),
    *[(f"model.layers.{{i}}.self_attn.{hf}_proj.{p}", f"transformer.h.{{i}}.attn.c_{ours}.{p}")
      for hf, ours in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "proj")) for p in ("weight", "bias")],
    ("model.layers.{i}.mlp.gate_proj.weight", "transformer.h.{i}.mlp.c_gate.weight"),
    ("model.layers.{i}.mlp.up_proj.weight", "transformer.h.{i}.mlp.c_fc.weight"),
    ("model.layers.{i}.mlp.down_proj.weight", "transformer.h.{i}.mlp.c_proj.weight"),
]


def _compile_map(direction: int) -> list[tuple[re.Pattern, str]]:
    table = []
    for pair in _NAME_MAP:
        src, dst = pair[direction], pair[1 - direction]
        table.append((re.compile(re.escape(src).replace(r"\{i\}", r"(?P<i>\d+)") + "$"), dst))
    return table


_HF_TO_OURS, _OURS_TO_HF = _compile_map(0), _compile_map(1)

# Buffers some older checkpoints saved as tensors; recomputed from the config, so skipped.
_IGNORED_HF_KEYS = re.compile(r".*rotary_emb\.inv_freq$")


def _rename(name: str, table: list[tuple[re.Pattern, str]]) -> str | None:
    for pattern, dst in table:
        m = pattern.match(name)
        if m:
            return dst.replace("{i}", m.group("i")) if "i" in pattern.groupindex else dst
    return None


def hf_name(ours: str) -> str | None:
    """The Hugging Face name of our parameter `ours` (transformer.h.0.attn.c_q.weight ->
    model.layers.0.self_attn.q_proj.weight); None for a name the map does not know."""
    return _rename(ours, _OURS_TO_HF)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        has_bin = any(path.glob("*.bin"))
        raise FileNotFoundError(
            f"{path} has no *.safetensors weights" + (
                " (only PyTorch .bin files, which nanochat does not unpickle; convert them with "
                "transformers: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir))" if has_bin else "")
        )
    return files


@torch.no_grad()
def load_hf_model(path: str | os.PathLike, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32, *, seq_len: int | None = None) -> tuple[GPT, HFTokenizer]:
    """Load a local Llama-family checkpoint directory into our GPT, plus its tokenizer.

    The parameters get `dtype` (fp32 master weights for training, whatever the file stores);
    the rotary tables are fp32. seq_len defaults to the checkpoint's context length.
    """
    path = Path(path)
    hf_config = read_config_json(path)
    try:
        config = gpt_config_from_hf(hf_config, seq_len=seq_len)
    except (KeyError, TypeError) as e:  # a field missing or of the wrong type
        raise UsageError(f"{path / 'config.json'}: {type(e).__name__} {e} while reading the model's "
                         "settings; the file is incomplete or not a Llama-family config") from None
    tokenizer = HFTokenizer.load(path)

    with torch.device("meta"):
        model = GPT(config)
    model.to(dtype)                   # free on meta: decides the dtype that to_empty allocates
    model.materialize(device)         # one allocation, uninitialized; rotary tables fp32

    params = dict(model.named_parameters())  # a tied lm_head appears once, as transformer.wte
    loaded: set[str] = set()
    fp8 = fp8_checkpoint(hf_config, str(path / "config.json"))  # None: a plain checkpoint
    files = _weight_files(path)
    home = {}  # key -> its file: a scale may sit in another shard than its weight
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            home.update(dict.fromkeys(f.keys(), file))
    dequantized = 0
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():
                if _IGNORED_HF_KEYS.match(key) or (fp8 is not None and fp8.is_qparam(key)):
                    continue  # a scale is read with its weight
                ours = _rename(key, _HF_TO_OURS)
                if ours == "lm_head.weight" and config.tie_embeddings:
                    continue  # some tied checkpoints store the shared matrix twice
                if ours is None or ours not in params:
                    raise ValueError(f"{file.name}: tensor {key!r} has no place in nanochat's model of this "
                                     f"{hf_config['model_type']} config (an option we do not implement?)")
                tensor = f.get_tensor(key)  # one tensor at a time, read from the mmapped file
                if tensor.dtype == torch.float8_e4m3fn:
                    tensor = _dequantize(fp8, path, key, tensor, home)
                    dequantized += 1
                if tensor.shape != params[ours].shape:
                    raise ValueError(f"{file.name}: {key} has shape {tuple(tensor.shape)}, config.json "
                                     f"implies {tuple(params[ours].shape)} for {ours}")
                params[ours].copy_(tensor)  # casts to dtype and moves to device
                loaded.add(ours)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks {len(missing)} tensors the config needs, e.g. "
                         f"{[hf_name(m) for m in missing[:5]]}")
    logger.info("hf: loaded %s (%s, %d layers, %.1fM params) from %s", hf_config["model_type"],
                config.mlp, config.n_layer, model.num_params() / 1e6, path)
    if dequantized:
        logger.info("hf: %s holds FP8 weights (compressed-tensors, %s scales): %d Linear layers dequantized to "
                    "%s; the FP8 rounding is part of these weights now", path, "/".join(fp8.strategies),
                    dequantized, str(dtype).removeprefix("torch."))
    return model, tokenizer


def _dequantize(fp8, path: Path, key: str, codes: torch.Tensor, home: dict[str, Path]) -> torch.Tensor:
    """fp32 weights of the FP8 tensor `key`, with its `weight_scale` from whichever file holds it."""
    scale_key = key.removesuffix("weight") + "weight_scale"
    if fp8 is None or scale_key not in home:
        raise ValueError(f"{path}: {key} is stored in FP8 but " + (
            "config.json has no quantization_config to say how to read it" if fp8 is None else
            f"the checkpoint has no {scale_key}") + "; restore the model from its source")
    with safe_open(home[scale_key], framework="pt", device="cpu") as f:
        return fp8.dequantize(key, codes, f.get_tensor(scale_key))
