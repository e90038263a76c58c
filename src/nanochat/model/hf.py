"""Hugging Face checkpoints in and out: find them, load them into our GPT, wrap their tokenizer,
export ours back.

The Llama family (Llama 2 and 3, Mistral, Qwen2) is one architecture with a few switches that
`nanochat.model.gpt.GPT` already has, so a checkpoint is loaded into our own model code (the same
`nn.Linear` modules for FP8 conversion, the trainer and generation as a nanochat preset):

    model.embed_tokens -> transformer.wte, model.layers.i.self_attn.{q,k,v,o}_proj ->
    transformer.h.i.attn.c_{q,k,v,proj}, model.layers.i.mlp.{gate,up,down}_proj ->
    transformer.h.i.mlp.c_{gate,fc,proj}, model.norm -> transformer.ln_f, lm_head -> lm_head

Anything we do not implement (another model_type, a rope type such as yarn, ...) is an error
naming it, never a model that silently computes something else. Weights are copied one tensor
at a time from memory-mapped safetensors into a model built on the meta device (peak memory:
the model plus one tensor). Resolution never touches the network: a hub id is looked up in the
local Hugging Face cache. `export_hf` writes the inverse, for architectures that map exactly,
in fp32 or, with `quantize`, in FP8 for vLLM / SGLang (nanochat.model.hf_fp8, which also dequantizes
an FP8 checkpoint on load). Details (config switches, sliding windows, the export's limits,
serving): docs/hf.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nanochat.common import UsageError, logger, publish_directory, read_json_object, warn_once, write_atomic
from nanochat.model.gpt import GPT, PRESETS, GPTConfig
from nanochat.model.hf_fp8 import SQNR_FLOOR_DB, Quantize, fp8_checkpoint, quantize_checkpoint, require_compressed_tensors
from nanochat.tokenizer import panics_as_errors, probe

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

# ----------------------------------------------------------------------------- resolution


@dataclass(frozen=True)
class ResolvedModel:
    """What `--model_name` names: a size preset, or a local Hugging Face model directory."""

    kind: Literal["preset", "hf"]
    name: str
    """The name as given."""
    path: Path | None = None
    """The model directory (the snapshot directory for a cached hub id); None for a preset."""


def hf_cache_dirs() -> list[Path]:
    """Hub cache directories to search: every place huggingface_hub may use, in its order of
    precedence (it uses only the first that is set; we search them all, so a cache copied to
    the default place is found even when HF_HOME points elsewhere)."""
    dirs = []
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            dirs.append(Path(os.environ[var]).expanduser())
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]).expanduser() / "hub")
    dirs.append(Path("~/.cache/huggingface/hub").expanduser())
    return list(dict.fromkeys(dirs))


def _find_in_cache(repo_id: str, cache: Path) -> Path | None:
    """The snapshot directory of `repo_id` in one cache: the revision refs/main points to if it
    is complete (has config.json), else the most recently modified snapshot that is.

    refs/main must hold a commit hash (40 hex digits, as huggingface_hub writes it), every
    snapshot must resolve inside the cache's snapshots/ directory and every file of the chosen
    one inside the model's cache folder (huggingface_hub links them to its blobs/): a ref or a
    symlink that leads elsewhere would load files from outside the cache, so it is an error
    naming the file."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / "main"
    chosen = None
    if ref.is_file():
        rev = ref.read_text(encoding="utf-8", errors="replace").strip()
        if not re.fullmatch(r"[0-9a-f]{40}", rev):
            raise UsageError(f"{ref} holds {rev[:60]!r}, not a commit hash (40 hex digits, what "
                             f"huggingface_hub writes); delete {ref} or download {repo_id} again")
        main = _inside(snapshots / rev, snapshots)
        if (main / "config.json").is_file():
            chosen = main
    if chosen is None:
        complete = [_inside(s, snapshots) for s in snapshots.iterdir() if (s / "config.json").is_file()]
        if not complete:
            return None
        chosen = max(complete, key=lambda s: s.stat().st_mtime)
    for entry in chosen.iterdir():
        _inside(entry, repo)
    return chosen


def _inside(path: Path, root: Path) -> Path:
    """`path`, refused unless it stays inside `root` once symlinks and `..` are resolved."""
    real, real_root = path.resolve(), root.resolve()
    if not real.is_relative_to(real_root):
        raise UsageError(f"Hugging Face cache entry {path} resolves to {real}, outside the cache folder "
                         f"{real_root}, and nanochat reads only files inside the cache; remove it and download "
                         "the model again")
    return path


def read_config_json(path: Path) -> dict:
    """A model directory's config.json as a dict; a clear error naming the file otherwise."""
    return read_json_object(Path(path) / "config.json", "restore it from the model's source")


def resolve_model(name: str) -> ResolvedModel:
    """Turn `--model_name` into a preset or a local HF directory, without network access.

    Order: a preset name (d4, ...); an existing directory (must hold config.json); a hub id
    `org/name` found in the local Hugging Face cache. Anything else is a FileNotFoundError that
    lists the presets, the places searched and how to get the weights onto this machine.
    """
    if name in PRESETS:
        return ResolvedModel("preset", name)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path} is a directory but not a Hugging Face model: config.json is missing (a model "
                "directory holds config.json, *.safetensors and tokenizer.json)"
            )
        return ResolvedModel("hf", name, path)
    searched = hf_cache_dirs()
    if re.fullmatch(r"[\w.\-]+/[\w.\-]+", name):
        for cache in searched:
            snapshot = _find_in_cache(name, cache)
            if snapshot is not None:
                return ResolvedModel("hf", name, snapshot)
    folder = "models--" + name.replace("/", "--")
    raise FileNotFoundError(
        f"model {name!r} not found. It is not a preset ({', '.join(PRESETS)}), not a local "
        f"directory, and not in the local Hugging Face cache; searched: "
        f"{', '.join(str(d / folder) for d in searched)}. Nothing is downloaded. To use a hub "
        f"model, on a machine with network run `huggingface-cli download {name}` (or "
        f"`hf download {name}`), then copy its cache folder {folder} into one of the "
        "directories above (or point HF_HUB_CACHE at where you put it); or pass the path of a "
        "directory holding config.json, *.safetensors and tokenizer.json."
    )


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
                  dtype: torch.dtype = torch.float32, *, seq_len: int | None = None) -> tuple[GPT, "HFTokenizer"]:
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
                         f"{[_rename(m, _OURS_TO_HF) for m in missing[:5]]}")
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


# ----------------------------------------------------------------------------- tokenizer

# A checkpoint's regexes (a Split pre-tokenizer, a Replace normalizer) are tried on the probe
# texts at load, as our own split pattern is (nanochat.tokenizer.probe).
_REGEX_OWNER = "tokenizer.json (a regex of its normalizer or pre-tokenizer)"
_RESTORE = "restore tokenizer.json from the model's source"

# Files of a Hugging Face tokenizer that are copied as they are when saving or exporting.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _byte_level_alphabet() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-character map used by byte-level BPE vocabularies: each byte
    is shown as a printable character; printable Latin-1 bytes stand for themselves, the other
    68 bytes are assigned the characters from U+0100 upwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    char_of = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in char_of:
            char_of[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in char_of.items()}


class HFTokenizer:
    """A checkpoint's `tokenizer.json` behind the interface of `nanochat.tokenizer.Tokenizer`
    (encode / encode_batch / decode / bos_id / vocab_size / token_bytes / fingerprint / save),
    plus the chat template of `tokenizer_config.json`.

    As with our tokenizer, `encode` treats special-token strings in the text as ordinary text
    (a document cannot inject a control token) and never adds tokens on its own (the
    checkpoint's post-processor, e.g. Llama 3's automatic <|begin_of_text|>, is not applied);
    `prepend_bos` is the only way a BOS gets in. Text rendered from the chat template is the
    exception: it is meant to contain special tokens, so `encode(..., allow_special=True)`.
    """

    def __init__(self, files: dict[str, bytes], *, origin: str | None = None):
        """`files`: name -> content; `origin`: the directory they came from, named in messages."""
        from tokenizers import Tokenizer as _Tokenizer  # a dependency of transformers

        if "tokenizer.json" not in files:
            raise FileNotFoundError("tokenizer.json is required")
        self._files = dict(files)
        try:
            self._tok = _Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
        except Exception as e:  # the tokenizers library raises its own Exception subclass
            raise UsageError(f"tokenizer.json is not a tokenizer the tokenizers library reads ({e}); "
                             "restore it from the model's source") from None
        probe(_REGEX_OWNER, lambda text: self._tok.encode(text, add_special_tokens=False).ids, _RESTORE)
        try:
            self._config = json.loads(files["tokenizer_config.json"]) if "tokenizer_config.json" in files else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UsageError(f"tokenizer_config.json is not valid JSON ({e}); restore it from the "
                             "model's source") from None
        if not isinstance(self._config, dict):
            raise UsageError(f"tokenizer_config.json holds a JSON {type(self._config).__name__}, "
                             "expected an object; restore it from the model's source")
        self.chat_template: str | None = self._find_chat_template()
        """Jinja source of the checkpoint's chat template, or None if it has none."""
        where = f"{origin}/" if origin else ""
        self.chat_template_origin = (f"{where}chat_template.jinja" if "chat_template.jinja" in files
                                     else f"{where}tokenizer_config.json (\"chat_template\")")
        """Where chat_template came from, for messages: a file, or the flag that chose it."""
        self._template = None  # compiled at the first render_chat
        h = hashlib.sha256()
        for name in sorted(files):
            h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
        self.fingerprint = h.hexdigest()[:16]
        """16 hex digits of sha256 over the tokenizer files: keys caches, checks resumes."""
        self.bos_token = self._special("bos_token")
        self.eos_token = self._special("eos_token")
        bos = self.bos_token or self.eos_token
        if bos is None or self._tok.token_to_id(bos) is None:
            raise ValueError("the tokenizer defines neither a bos_token nor an eos_token in "
                             "tokenizer_config.json; nanochat needs one to separate documents")
        if self.bos_token is None:
            logger.info("hf tokenizer: no bos_token, documents are separated by the eos_token %r", bos)
        self._bos_id = self._tok.token_to_id(bos)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "HFTokenizer":
        d = Path(directory)
        if not (d / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"{d} has no tokenizer.json (the fast-tokenizer file nanochat reads). If it has only a "
                "SentencePiece tokenizer.model, convert it where transformers is installed: "
                "AutoTokenizer.from_pretrained(dir).save_pretrained(dir)"
            )
        try:
            return cls({n: (d / n).read_bytes() for n in _TOKENIZER_FILES if (d / n).is_file()}, origin=str(d))
        except UsageError as e:
            raise UsageError(f"{d}/{e}") from None  # the message starts with the file's name

    def save(self, directory: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the tokenizer's files into `directory` (created), each replaced atomically. A
        directory already holding exactly these files is left as it is; one holding another
        tokenizer is refused unless `overwrite`, and always when it is a run's (check_tokenizer_dir)."""
        from nanochat.tokenizer import META_FILE, RANKS_FILE, check_tokenizer_dir

        d = Path(directory)
        if all((d / n).is_file() and (d / n).read_bytes() == data for n, data in self._files.items()):
            return d
        check_tokenizer_dir(d, overwrite=overwrite, names=(*self._files, META_FILE, RANKS_FILE))
        d.mkdir(parents=True, exist_ok=True)
        for name, data in self._files.items():
            write_atomic(d / name, data)
        return d

    def with_chat_template(self, source: str, origin: str = "with_chat_template") -> "HFTokenizer":
        """This tokenizer with `source` (Jinja) as its chat template, written as
        chat_template.jinja (and removed from tokenizer_config.json, so only one template exists):
        the run's saved tokenizer and an export carry the template the model was trained with,
        and the fingerprint, which keys the token caches, changes with it. `origin` names the
        source in messages (e.g. the --chat_template flag that chose it)."""
        files = dict(self._files)
        files["chat_template.jinja"] = source.encode("utf-8")
        if "chat_template" in self._config:
            config = {k: v for k, v in self._config.items() if k != "chat_template"}
            files["tokenizer_config.json"] = (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
        tokenizer = HFTokenizer(files)
        tokenizer.chat_template_origin = origin
        return tokenizer

    def has_token(self, token: str) -> bool:
        """Whether `token` is one token of the vocabulary (e.g. a template's <|im_start|>)."""
        return self._tok.token_to_id(token) is not None

    def _special(self, key: str) -> str | None:
        value = self._config.get(key)
        return value.get("content") if isinstance(value, dict) else value

    def _find_chat_template(self) -> str | None:
        if "chat_template.jinja" in self._files:  # transformers >= 4.50 saves it as its own file
            return self._files["chat_template.jinja"].decode("utf-8")
        template = self._config.get("chat_template")
        if isinstance(template, list):  # several named templates: the default one is "default"
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        return template

    # -- the nanochat Tokenizer interface

    def encode(self, text: str, *, prepend_bos: bool = False, allow_special: bool = False) -> list[int]:
        self._tok.encode_special_tokens = not allow_special
        with panics_as_errors(_REGEX_OWNER, _RESTORE):
            ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if prepend_bos else ids

    def encode_batch(self, texts: list[str], *, prepend_bos: bool = False,
                     num_threads: int | None = None) -> list[list[int]]:
        """`encode` over many texts (the tokenizers library parallelizes on its own; num_threads
        is accepted for interface compatibility and ignored)."""
        self._tok.encode_special_tokens = True
        with panics_as_errors(_REGEX_OWNER, _RESTORE):
            batch = [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]
        return [[self.bos_id, *ids] for ids in batch] if prepend_bos else batch

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    @property
    def bos_id(self) -> int:
        """The document separator: the BOS token, or the EOS token where there is none (Qwen2)."""
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        return self._tok.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def vocab_size(self) -> int:
        """Largest token id + 1. A checkpoint's embedding may have more rows (padding)."""
        return max(self._tok.get_vocab(with_added_tokens=True).values()) + 1

    def token_bytes(self) -> torch.Tensor:
        """[vocab_size] int64: UTF-8 bytes each id stands for; 0 for special tokens.

        Byte-level vocabularies (Llama 3, Qwen2) spell each byte as one character of GPT-2's
        alphabet; SentencePiece-style ones (Llama 2, Mistral) write a space as U+2581 and raw
        bytes as <0xNN> (byte fallback).
        """
        out = torch.zeros(self.vocab_size, dtype=torch.int64)
        byte_level = '"ByteLevel"' in json.dumps(json.loads(self._tok.to_str()).get("decoder"))
        alphabet = _byte_level_alphabet() if byte_level else None
        for token, i in self._tok.get_vocab(with_added_tokens=False).items():
            if alphabet is not None and all(c in alphabet for c in token):
                out[i] = len(token)  # one character per byte
            elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
                out[i] = 1
            else:
                out[i] = len(token.replace("\u2581", " ").encode("utf-8"))
        for i, added in self._tok.get_added_tokens_decoder().items():
            out[i] = 0 if added.special else len(added.content.encode("utf-8"))
        return out

    # -- chat

    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = False, **kwargs) -> str:
        """The checkpoint's chat template applied to `messages` ([{"role", "content"}, ...]),
        as text, rendered in a bounded sandbox (nanochat.tokenizer.chat_template); encode it with
        `encode(text, allow_special=True)`."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja)")
        if self._template is None:
            from nanochat.tokenizer.chat_template import ChatTemplate

            self._template = ChatTemplate(self.chat_template, self.chat_template_origin)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, fingerprint={self.fingerprint!r})"


# ----------------------------------------------------------------------------- export


def _unwrap(model: torch.nn.Module) -> GPT:
    """The GPT inside torch.compile (`_orig_mod`) and DDP (`module`) wrappers."""
    while not isinstance(model, GPT):
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if inner is None:
            raise TypeError(f"export_hf needs a nanochat GPT, got {type(model).__name__}")
        model = inner
    return model


def model_from_state_dict(model_name: str, state_dict: dict[str, torch.Tensor],
                          tokenizer_dir: str | os.PathLike | None = None) -> tuple[GPT, HFTokenizer]:
    """Rebuild a trained model from a training checkpoint's `model` state dict, for export.

    `model_name` is the run's --model_name: it must resolve to a Hugging Face directory, whose
    config.json gives the architecture (and whose tokenizer is used unless `tokenizer_dir`, the
    run's saved tokenizer, has a tokenizer.json). Prefixes added by torch.compile (`_orig_mod.`)
    and DDP (`module.`) are stripped; FP8 conversion adds none.
    """
    resolved = resolve_model(model_name)
    if resolved.kind == "preset":
        raise ValueError(
            f"{model_name!r} is a nanochat preset: its ReLU^2 MLP, parameter-free RMSNorm, QK-norm, "
            "embedding norm and logit softcap have no Hugging Face Llama counterpart, so it cannot be "
            "exported for transformers; its checkpoint-<step>.pt is the way to keep it"
        )
    config = gpt_config_from_hf(read_config_json(resolved.path))
    with torch.device("meta"):
        model = GPT(config)
    model.materialize("cpu")
    clean = {re.sub(r"^(_orig_mod\.|module\.)+", "", k): v for k, v in state_dict.items()}
    model.load_state_dict(clean)
    tok_dir = Path(tokenizer_dir) if tokenizer_dir and (Path(tokenizer_dir) / "tokenizer.json").is_file() else resolved.path
    return model, HFTokenizer.load(tok_dir)


def check_export_dir(out_dir: str | os.PathLike, *, overwrite: bool,
                     sources: Iterable[str | os.PathLike | None] = ()) -> None:
    """Raise a UsageError, before any work, when exporting to `out_dir` would lose something: it
    is not empty (without `overwrite`: a previous export's shards would be left next to the new
    files, and loaders prefer a sharded index), or `overwrite` would delete one of `sources`, the
    directories the export reads from (the run, its base model)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out_dir {out} is a file; give a directory (new or empty)")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not held:
        return
    if not overwrite:
        raise UsageError(f"--out_dir {out} is not empty ({', '.join(held[:4])}{', ...' if len(held) > 4 else ''}); "
                         "pass --overwrite to replace it whole, or choose a new --out_dir")
    real = os.path.realpath(out)
    for source in filter(None, sources):
        inside = os.path.realpath(source)
        if inside == real or inside.startswith(real.rstrip(os.sep) + os.sep):
            raise UsageError(f"--out_dir {out} {'is' if inside == real else 'contains'} {source}, which this export "
                             "reads from: --overwrite would delete it; choose another --out_dir")


def exportable_linears(model: torch.nn.Module) -> list[str]:
    """Our names of the Linears an FP8 export may quantize: every block's attention and MLP
    projection (not lm_head, which stays bf16 as in every FP8 serving recipe)."""
    return [n for n, m in _unwrap(model).named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]


@torch.no_grad()
def export_hf(model: torch.nn.Module, tokenizer: HFTokenizer | None, out_dir: str | os.PathLike, *,
              overwrite: bool = False, sources: Iterable[str | os.PathLike | None] = (),
              quantize: Quantize = "none", keep: Mapping[str, str] | None = None, quantize_all: bool = False,
              sqnr_floor_db: float = SQNR_FLOOR_DB) -> Path:
    """Write `model` (and its tokenizer) as a Hugging Face model directory that
    `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` loads: config.json,
    model.safetensors, tokenizer files. Errors for architectures that do not map.

    Weights are plain fp32 by default. `quantize="fp8"` (or "fp8_block") stores every block
    Linear in e4m3 with fp32 scales for vLLM, SGLang and transformers, and the rest in bf16
    (nanochat.model.hf_fp8): `keep` (our layer name -> why) names Linears to leave in bf16, e.g. those the
    run trained in high precision; layers under `sqnr_floor_db` stay bf16 too, unless
    `quantize_all`. The per-layer report is logged and saved as fp8_report.json.

    `out_dir` must be new or empty, or `overwrite` (see `check_export_dir`, which also protects
    `sources`): the export is written to a temporary sibling directory, and replaces `out_dir`
    whole only once it is complete, so no file of an earlier export survives next to it."""
    check_export_dir(out_dir, overwrite=overwrite, sources=sources)
    if quantize != "none":
        require_compressed_tensors(f"--quantize {quantize}")
    gpt = _unwrap(model)
    hf_config = hf_config_from_gpt(gpt.config)
    if tokenizer is not None and not isinstance(tokenizer, HFTokenizer):
        raise TypeError(f"export_hf writes Hugging Face tokenizer files, got {type(tokenizer).__name__}; "
                        "pass the HFTokenizer the model was loaded with (or None for weights only)")
    if tokenizer is not None:
        hf_config.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
    tensors = {}
    for name, p in gpt.named_parameters():  # deduplicated: a tied lm_head is written once, as wte
        hf_name = _rename(name, _OURS_TO_HF)
        assert hf_name is not None, f"no Hugging Face name for {name}"
        # fp32 master weights: FP8 lives only inside the training matmuls
        tensors[hf_name] = p.detach().to(device="cpu", dtype=torch.float32).contiguous()
    fp8 = None
    if quantize != "none":
        hf_module = lambda ours: _rename(f"{ours}.weight", _OURS_TO_HF).rpartition(".")[0]  # noqa: E731
        fp8 = quantize_checkpoint(tensors, [hf_module(n) for n in exportable_linears(gpt)], quantize=quantize,
                                  keep={hf_module(n): why for n, why in (keep or {}).items()},
                                  quantize_all=quantize_all, floor_db=sqnr_floor_db)
        tensors = fp8.tensors
        hf_config["torch_dtype"] = "bfloat16"  # what the unquantized tensors are stored in
        logger.info("fp8 export, per layer:\n%s\n%s", fp8.table(), fp8.summary())

    def fill(tmp: Path) -> None:
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        if fp8 is not None:
            fp8.write(tmp)
        if tokenizer is not None:
            tokenizer.save(tmp)
        else:
            logger.warning("export_hf: no tokenizer given, %s holds weights and config only", out_dir)

    return publish_directory(out_dir, fill)
