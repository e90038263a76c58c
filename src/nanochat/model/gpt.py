"""The model: a decoder-only transformer in the style of karpathy/nanochat, and its size presets.

One forward pass, top to bottom:

    idx (B, T) -> wte -> [norm] -> n_layer x Block -> norm -> lm_head -> [softcap] -> logits (B, T, V)
    Block:  x = x + attn(norm(x));  x = x + mlp(norm(x))          (pre-norm residual stream)

nanochat's choices, the defaults of `GPTConfig`: RMSNorm without a learned weight; RoPE, then
QK-norm on queries and keys (bounded attention logits, so a small model trains at a high learning
rate); grouped-query attention when `n_kv_head < n_head`; a ReLU^2 MLP; an untied `lm_head` with
a logit softcap; no biases. The extra `GPTConfig` fields run Llama-family checkpoints with the
same code (`hf.py`): one model class, so FP8 conversion, the trainer and generation treat both
alike.

Every projection is a plain `nn.Linear` called as a module: `nanochat.fp8` finds them from
outside and swaps them for torchao's `Float8Linear`; this file never imports `nanochat.fp8`.
Parameters are fp32 master weights (the trainer adds bf16 autocast on CUDA) and the loss is always
computed in fp32. `model.activation_checkpointing = True` recomputes each block in the backward.

Each choice with its reason, the Llama switches, checkpointing and dtypes in full: docs/model.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from nanochat.config.fields import PRESET_DEPTHS


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape and architecture of a GPT. Defaults are nanochat's architecture."""

    vocab_size: int
    """Number of token ids (rows of the embedding, columns of the logits)."""

    seq_len: int
    """Longest context the model is built for (length of the precomputed rotary tables)."""

    n_layer: int
    """Number of transformer blocks."""

    n_head: int
    """Number of query heads."""

    n_kv_head: int
    """Number of key/value heads; fewer than n_head means grouped-query attention."""

    n_embd: int
    """Width of the residual stream."""

    head_dim: int | None = None
    """Width of one attention head; None means n_embd // n_head (some checkpoints differ)."""

    softcap: float = 15.0
    """Logit softcap: logits = softcap * tanh(logits / softcap); 0 disables it."""

    rope_theta: float = 10000.0
    """RoPE base: rotation frequencies are rope_theta ** (-2i / head_dim)."""

    rope_scaling: Literal["none", "linear", "llama3"] = "none"
    """RoPE frequency scaling: none; linear (all frequencies / rope_factor); llama3 (low
    frequencies / rope_factor, high ones kept, a smooth blend between; Llama 3.1 and later)."""

    rope_factor: float = 1.0
    """Scaling factor of rope_scaling linear / llama3."""

    rope_low_freq_factor: float = 1.0
    """llama3 rope scaling: wavelengths above original_max_pos / this are fully scaled."""

    rope_high_freq_factor: float = 4.0
    """llama3 rope scaling: wavelengths below original_max_pos / this are kept."""

    rope_original_max_pos: int = 8192
    """llama3 rope scaling: the context length the checkpoint was pretrained with."""

    mlp: Literal["relu2", "swiglu"] = "relu2"
    """MLP kind: relu2 is c_proj(relu(c_fc(x))**2) (nanochat); swiglu is
    c_proj(silu(c_gate(x)) * c_fc(x)) (Llama: gate_proj, up_proj, down_proj)."""

    intermediate_size: int | None = None
    """Hidden width of the MLP; None means 4 * n_embd."""

    norm_weight: bool = False
    """RMSNorm with a learned per-channel weight (Llama) instead of none (nanochat)."""

    norm_eps: float | None = None
    """RMSNorm epsilon; None means torch's default (the activation dtype's machine epsilon)."""

    embed_norm: bool = True
    """Normalize the token embeddings before the first block (nanochat; Llama does not)."""

    qk_norm: bool = True
    """Parameter-free RMSNorm on queries and keys after rotary (nanochat; Llama does not)."""

    qkv_bias: bool = False
    """Biases on c_q, c_k, c_v (Qwen2, Llama with attention_bias)."""

    attn_out_bias: bool = False
    """Bias on the attention output projection c_proj (Llama with attention_bias)."""

    tie_embeddings: bool = False
    """lm_head shares its weight with the token embedding (small Llama 3.2 / Qwen2 models)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_kv_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.head_dim is None:
            if self.n_embd % self.n_head != 0:
                raise ValueError(
                    f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); choose "
                    f"n_head among the divisors of n_embd, e.g. {self.n_embd // 128 or 1} for head_dim 128"
                )
            object.__setattr__(self, "head_dim", self.n_embd // self.n_head)
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(
                f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head}) for "
                "grouped-query attention; set n_kv_head to a divisor of n_head (n_head for plain attention)"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"head_dim ({self.head_dim}) must be even: rotary embeddings rotate pairs of "
                "channels; change n_embd or n_head"
            )
        if self.intermediate_size is None:
            object.__setattr__(self, "intermediate_size", 4 * self.n_embd)
        if self.softcap < 0:
            raise ValueError(f"softcap must be >= 0 (0 disables it), got {self.softcap}")
        if self.rope_scaling not in ("none", "linear", "llama3"):
            raise ValueError(f"rope_scaling must be none, linear or llama3, got {self.rope_scaling!r}")
        if self.mlp not in ("relu2", "swiglu"):
            raise ValueError(f"mlp must be relu2 or swiglu, got {self.mlp!r}")


# Depth presets, nanochat's rule: width = 64 * depth, head_dim 128 (fewer, wider heads than GPT-2's
# 64; at these widths it trains as well and the matmuls are larger, which FP8 likes).
PRESETS: dict[str, dict[str, int]] = {
    f"d{depth}": dict(n_layer=depth, n_embd=64 * depth, n_head=max(1, 64 * depth // 128),
                      n_kv_head=max(1, 64 * depth // 128))
    for depth in PRESET_DEPTHS
}


def preset_config(name: str, *, vocab_size: int, seq_len: int) -> GPTConfig:
    """The GPTConfig of a size preset (`d4`: 4 layers, width 256, 2 heads of 128)."""
    if name not in PRESETS:
        raise ValueError(
            f"unknown model preset {name!r}; presets are: {', '.join(PRESETS)} "
            "(depth d, width 64*d). Hugging Face checkpoints are resolved by nanochat.model.hub.resolve_model."
        )
    return GPTConfig(vocab_size=vocab_size, seq_len=seq_len, **PRESETS[name])


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) [* weight]. Without a weight it has no parameters at all."""

    def __init__(self, dim: int, *, weight: bool, eps: float | None):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.dim,), self.weight, self.eps)


def rotary_inv_freq(config: GPTConfig) -> torch.Tensor:
    """Rotation frequency of each channel pair, (head_dim/2,) fp32, with any rope scaling applied."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if config.rope_scaling == "linear":
        inv_freq = inv_freq / config.rope_factor
    elif config.rope_scaling == "llama3":
        # Llama 3.1's published rule, by wavelength (tokens per full turn) of each pair:
        # long wavelengths (> old_len / low) are slowed by `factor` (they now must span the
        # longer context), short ones (< old_len / high) are kept (they encode local order),
        # and those between blend linearly in old_len / wavelength.
        old_len = config.rope_original_max_pos
        low, high, factor = config.rope_low_freq_factor, config.rope_high_freq_factor, config.rope_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        blend = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - blend) * scaled / factor + blend * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel i with channel i + head_dim/2 (the "rotate half", non-interleaved layout
    that Hugging Face Llama uses). x: (B, H, T, D); cos, sin: (T, D), each half repeated.

    karpathy/nanochat rotates the opposite way (sin negated). Either direction encodes relative
    position equally well; this one lets Llama-family checkpoints load without permuting q/k."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.c_q = nn.Linear(config.n_embd, config.n_head * config.head_dim, bias=config.qkv_bias)
        self.c_k = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=config.qkv_bias)
        self.c_v = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=config.qkv_bias)
        self.c_proj = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=config.attn_out_bias)
        self.qk_norm = RMSNorm(config.head_dim, weight=False, eps=config.norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism this rank's projections hold n_head / tp of them
        q = self.c_q(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.c_k(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.c_v(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        # The tables are fp32; rotate in the activations' dtype (bf16 under autocast), as HF does.
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.qk_norm is not None:
            q, k = self.qk_norm(q), self.qk_norm(k)
        # enable_gqa lets each group of n_head / n_kv_head query heads read one k/v head without
        # materializing repeated k/v tensors. Scale is the default 1/sqrt(head_dim).
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.kind = config.mlp
        hidden = config.intermediate_size
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=False)  # Llama's up_proj
        self.c_gate = nn.Linear(config.n_embd, hidden, bias=False) if self.kind == "swiglu" else None
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=False)  # Llama's down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return self.c_proj(F.silu(self.c_gate(x)) * self.c_fc(x))
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = RMSNorm(config.n_embd, weight=config.norm_weight, eps=config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = RMSNorm(config.n_embd, weight=config.norm_weight, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cos, sin)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The whole model; `GPT(config)` builds it, `init_weights()` (or `nanochat.model.hf`) fills it."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=RMSNorm(config.n_embd, weight=config.norm_weight, eps=config.norm_eps),
        ))
        self.embed_norm = (RMSNorm(config.n_embd, weight=False, eps=config.norm_eps)
                           if config.embed_norm else None)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        # True: recompute each block in the backward instead of keeping its activations (training)
        self.activation_checkpointing = False
        self.init_rotary()

    def materialize(self, device: torch.device | str) -> "GPT":
        """Allocate a model built on the meta device on `device` (uninitialized: follow with
        init_weights() or a weight load). `to_empty` alone is not enough: it gives the tied
        lm_head its own tensor and leaves the rotary tables uninitialized."""
        self.to_empty(device=device)
        if self.config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.init_rotary()
        return self

    @torch.no_grad()
    def init_rotary(self) -> None:
        """(Re)build the cos/sin tables, in fp32 on the parameters' device: at construction, and
        after `to_empty` from the meta device (which leaves buffers uninitialized).

        They are derived from the config, not learned: non-persistent buffers, so the state_dict
        holds only parameters and a checkpoint does not fix the context length. Kept in fp32
        even in a bf16 model, because angles at large positions need the precision.
        """
        device = self.transformer.wte.weight.device
        inv_freq = rotary_inv_freq(self.config).to(device)
        t = torch.arange(self.config.seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)              # (T, D/2): angle of pair i at position t
        emb = torch.cat((freqs, freqs), dim=-1)       # (T, D): both halves of a pair share it
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Fresh weights, deterministic under torch.manual_seed.

        - Input-side matrices (c_q, c_k, c_v, c_fc, c_gate): uniform with std 1/sqrt(fan_in), so
          each keeps unit-variance activations (uniform(-a, a) has std a/sqrt(3)).
        - Output projections of every residual branch (attn.c_proj, mlp.c_proj): zero. Each block
          starts as the identity, so a deep stack starts as a shallow one and the optimizer grows
          the branches it needs; at small scale this is what makes the first steps fast (nanochat).
        - lm_head: normal(std=0.001). Near zero, so the initial loss is ln(vocab_size), a free
          sanity check; not exactly zero, so gradients reach the blocks on the very first step
          (with a zero head nothing but the head would learn in step 1).
        - Token embedding: normal(std=1), the scale the following RMSNorm produces anyway.
        - Norm weights one, biases zero.
        """
        cfg = self.config
        nn.init.normal_(self.transformer.wte.weight, mean=0.0, std=1.0)
        if not cfg.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, mean=0.0, std=0.001)
        for block in self.transformer.h:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc, block.mlp.c_gate):
                if lin is not None:
                    bound = math.sqrt(3.0) / math.sqrt(lin.in_features)
                    nn.init.uniform_(lin.weight, -bound, bound)
            nn.init.zeros_(block.attn.c_proj.weight)
            nn.init.zeros_(block.mlp.c_proj.weight)
        for module in self.modules():
            if isinstance(module, RMSNorm) and module.weight is not None:
                nn.init.ones_(module.weight)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        self.init_rotary()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                ignore_index: int = -1, reduction: Literal["mean", "sum", "none"] = "mean") -> torch.Tensor:
        """idx (B, T) int64 -> logits (B, T, V) in fp32, or, given targets (B, T), the
        cross-entropy loss in fp32 (a scalar; (B, T) with reduction="none"). Target positions
        equal to ignore_index are skipped."""
        B, T = idx.shape
        if T > self.config.seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's seq_len {self.config.seq_len}; "
                             "crop the input or build the model with a larger seq_len")
        x = self.transformer.wte(idx)                          # (B, T, C)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        cos, sin = self.cos[:T], self.sin[:T]
        checkpointing = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.transformer.h:
            if checkpointing:
                # keeps only x for the backward, which runs block's forward again (use_reentrant=False:
                # the variant torch recommends, correct with inputs that need no grad and torch.compile)
                x = torch.utils.checkpoint.checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x).float()                       # (B, T, V), fp32 for softmax/loss
        if self.config.softcap > 0:
            logits = self.config.softcap * torch.tanh(logits / self.config.softcap)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T),
                               ignore_index=ignore_index, reduction=reduction)
        return loss.view(B, T) if reduction == "none" else loss

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups: the weight matrices of the blocks and lm_head decay; the embedding,
        norm weights and biases do not (decaying them only pulls scales and offsets to zero).
        Every parameter appears exactly once (a tied lm_head is the embedding, so no decay)."""
        embedding = self.transformer.wte.weight
        decay, no_decay = [], []
        for p in self.parameters():  # deduplicated: a tied weight is yielded once
            (decay if p.ndim >= 2 and p is not embedding else no_decay).append(p)
        return [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0)]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token, the convention of karpathy/nanochat's `estimate_flops` and
        torchtitan's `get_num_flop_per_token` (nanochat.train.mfu): 6 per matmul weight (forward 2,
        backward 4) plus attention's QK^T and AV, 12 * n_layer * n_head * head_dim * seq_len. The
        embedding lookup is not a matmul and is left out (unless tied: then it is the lm_head).
        seq_len is the training sequence length (default: config.seq_len, which for a loaded
        checkpoint is its whole context, far longer than what is trained on)."""
        cfg = self.config
        n = self.num_params()
        if not cfg.tie_embeddings:
            n -= self.transformer.wte.weight.numel()
        return 6 * n + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * (seq_len or cfg.seq_len)
