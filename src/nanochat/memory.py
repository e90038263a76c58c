"""Will it fit: the memory a training run needs, planned before any weight is allocated.

    plan = plan_training(gpt_config, batch_size=16, seq_len=256, opt_level=2, free_bytes=free_bytes(dev))
    print(plan.table()); plan.check(fp8=True)   # ValueError naming what would make it fit

Four parts, per device:
- weights: parameters x `weight_bytes` (fp32 master weights: 4; FP8 training keeps them, torchao
  casts to FP8 only inside each matmul);
- gradients: parameters x `grad_bytes` (4: gradients take the parameters' dtype);
- optimizer: AdamW's two moments, per tensor exactly as `nanochat.fp8.FP8Optim` allocates them:
  level 0 both fp32 (8 bytes/param); level 1 the first in FP8 (1 byte + one fp32 scale per 256);
  level 2 both (~2.03 bytes/param). Tensors under 4096 elements or not whole 256-element blocks
  keep fp32 moments at every level;
- activations: an estimate (`activation_bytes`): the tensors one block keeps for its backward,
  counted from `nanochat.gpt.Block`, per token and layer, plus the fp32 logits, their
  log-softmax and their gradient. With activation checkpointing a block keeps only its input,
  and one block's activations exist at a time during the backward.
Under FSDP the first three are divided by the world size (each rank holds its shard).

Not counted: allocator fragmentation, temporary buffers (FP8 casts, attention workspaces), the
CUDA context (already outside the free memory we compare against). So the plan is a lower bound
labelled as an estimate; the measured peak (`TrainResult.peak_memory_bytes`, CUDA) is the truth.
`weight_bytes` and `grad_bytes` are parameters so lower-precision master weights can be planned.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch

from nanochat.common import format_bytes, format_table
from nanochat.gpt import GPT, GPTConfig

FP8_BLOCK = 256
"""Elements per FP8 optimizer-state block, each with one fp32 scale (nanochat.fp8.tensor)."""
FP8_MIN_NUMEL = 4096
"""Smaller tensors keep fp32 moments (FP8Optim's rule, from bitsandbytes and torchao)."""


def param_numels(config: GPTConfig) -> list[int]:
    """Element count of every parameter tensor (a tied embedding once), from a model built on the
    meta device: exact, and no memory allocated."""
    with torch.device("meta"):
        model = GPT(config)
    return [p.numel() for p in model.parameters()]


def optimizer_bytes(numels: list[int], opt_level: int) -> int:
    """AdamW moment bytes for tensors of these sizes at an FP8 opt level (0, 1, 2)."""
    total = 0
    for n in numels:
        fp8 = opt_level if n >= FP8_MIN_NUMEL and n % FP8_BLOCK == 0 else 0
        total += fp8 * (n + n // FP8_BLOCK * 4) + (2 - fp8) * n * 4
    return total


def activation_bytes(config: GPTConfig, tokens: int, *, autocast: bool, checkpointing: bool) -> int:
    """Estimated activation memory of one forward+backward over `tokens` tokens (batch x seq).

    Per token and block, the tensors kept for the backward (h = width, kv = n_kv_head x head_dim,
    I = MLP width; q width n_head x head_dim taken as h):
      fp32: both norms' inputs and outputs (4h), rotated q, k and v (h + 2kv), the attention
            output and its contiguous copy for c_proj (2h), the SwiGLU gate, up, silu and product
            (4I; relu2: 2I): (7h + 2kv + 4I) x 4 bytes;
      bf16 autocast: the norms' fp32 inputs (2h x 4 bytes); in bf16 the casts of the norm outputs
            that each Linear keeps (5h), q (h), the attention output and its copy (2h), k, v (2kv)
            and the MLP (4I): (8h + 2kv + 4I) x 2 bytes.
    Logits: tokens x vocab x (lm_head output + its fp32 copy, log-softmax, gradient: 2 or 4 + 12).
    Checkpointing: each block keeps its fp32 input (4h bytes); one block is recomputed at a time.
    """
    h, kv, inter = config.n_embd, config.n_kv_head * config.head_dim, config.intermediate_size
    mlp = 4 * inter if config.mlp == "swiglu" else 2 * inter
    per_block = (2 * h * 4 + (8 * h + 2 * kv + mlp) * 2) if autocast else (7 * h + 2 * kv + mlp) * 4
    logits = config.vocab_size * ((2 if autocast else 4) + 12)
    if checkpointing:
        blocks = config.n_layer * 4 * h + per_block
    else:
        blocks = config.n_layer * per_block
    return tokens * (blocks + logits)


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """Planned bytes per device for one training configuration (see the module docstring)."""

    config: GPTConfig
    num_params: int
    batch_size: int
    seq_len: int
    opt_level: int
    activation_checkpointing: bool
    autocast: bool
    shards: int
    """Devices the weights, gradients and optimizer states are sharded over (FSDP); 1 otherwise."""
    weight_bytes: float
    grad_bytes: float
    weights: int
    gradients: int
    optimizer: int
    activations: int
    free_bytes: int | None
    """The device's free memory, None where it cannot be read."""

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations

    @property
    def fits(self) -> bool:
        return self.free_bytes is None or self.total <= self.free_bytes

    def table(self) -> str:
        gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
        rows = [["weights", gib(self.weights), f"{self.num_params / 1e6:,.1f}M params x {self.weight_bytes:g} B"],
                ["gradients", gib(self.gradients), f"x {self.grad_bytes:g} B"],
                ["optimizer", gib(self.optimizer), f"AdamW, fp8_opt_level {self.opt_level}"],
                ["activations", gib(self.activations),
                 f"estimate, batch {self.batch_size} x {self.seq_len}, "
                 f"{'bf16' if self.autocast else 'fp32'}{', checkpointed' if self.activation_checkpointing else ''}"],
                ["total", gib(self.total), f"per device{f', sharded over {self.shards}' if self.shards > 1 else ''}"],
                ["free", gib(self.free_bytes) if self.free_bytes is not None else "unknown",
                 ("fits" if self.fits else "DOES NOT FIT") if self.free_bytes is not None else ""]]
        return "memory plan (estimate)\n" + format_table(["", "bytes", ""], rows)

    def replan(self, **changes) -> "MemoryPlan":
        """This plan with other settings (batch_size, opt_level, activation_checkpointing, shards)."""
        kw = dict(batch_size=self.batch_size, seq_len=self.seq_len, opt_level=self.opt_level,
                  activation_checkpointing=self.activation_checkpointing, autocast=self.autocast,
                  shards=self.shards, weight_bytes=self.weight_bytes, grad_bytes=self.grad_bytes,
                  free_bytes=self.free_bytes)
        kw.update(changes)
        return plan_training(self.config, **kw)

    def remedies(self, *, fp8: bool) -> list[str]:
        """What would make it fit, each with its planned total; empty when it fits."""
        if self.fits:
            return []
        out = []
        level2 = "--fp8_opt_level 2" if fp8 else "--fp8 --fp8_opt_level 2"
        candidates = []
        if self.opt_level < 2:
            candidates.append((level2, dict(opt_level=2)))
        if not self.activation_checkpointing:
            candidates.append(("--activation_checkpointing", dict(activation_checkpointing=True)))
        if len(candidates) == 2:
            candidates.append((f"{level2} --activation_checkpointing",
                               dict(opt_level=2, activation_checkpointing=True)))
        for flags, change in candidates:
            p = self.replan(**change)
            out.append(f"{flags}: {format_bytes(p.total)}{'' if p.fits else ' (still too much)'}")
        batch = next((b for b in range(self.batch_size - 1, 0, -1) if self.replan(batch_size=b).fits), None)
        if batch is not None:
            out.append(f"--batch_size {batch} (with --grad_accum_steps to keep the tokens per step): "
                       f"{format_bytes(self.replan(batch_size=batch).total)}")
        else:
            out.append("a smaller --batch_size alone: not even --batch_size 1 fits")
        gpus = next((n for n in range(self.shards + 1, 1025) if self.replan(shards=n).fits), None)
        if gpus is not None:
            out.append(f"FSDP over {gpus} GPUs (torchrun --nproc_per_node={gpus} ... --fsdp): "
                       f"{format_bytes(self.replan(shards=gpus).total)} per GPU")
        return out

    def check(self, *, fp8: bool) -> None:
        """ValueError, before anything is allocated, when the plan exceeds the free memory."""
        if self.fits:
            return
        raise ValueError(
            f"this run does not fit: the memory plan needs {format_bytes(self.total)} per device "
            f"(weights {format_bytes(self.weights)}, gradients {format_bytes(self.gradients)}, optimizer "
            f"{format_bytes(self.optimizer)}, activations ~{format_bytes(self.activations)}) but "
            f"{format_bytes(self.free_bytes)} is free. What would make it fit (planned totals): "
            + "; ".join(self.remedies(fp8=fp8)))


def plan_training(config: GPTConfig, *, batch_size: int, seq_len: int, opt_level: int = 0,
                  activation_checkpointing: bool = False, autocast: bool = False, shards: int = 1,
                  weight_bytes: float = 4, grad_bytes: float = 4, free_bytes: int | None = None) -> MemoryPlan:
    """The MemoryPlan of training `config` (see the module docstring for what each part counts)."""
    numels = param_numels(config)
    n = sum(numels)
    return MemoryPlan(
        config=config, num_params=n, batch_size=batch_size, seq_len=seq_len, opt_level=opt_level,
        activation_checkpointing=activation_checkpointing, autocast=autocast, shards=shards,
        weight_bytes=weight_bytes, grad_bytes=grad_bytes,
        weights=math.ceil(n * weight_bytes / shards), gradients=math.ceil(n * grad_bytes / shards),
        optimizer=math.ceil(optimizer_bytes(numels, opt_level) / shards),
        activations=activation_bytes(dataclasses.replace(config, seq_len=seq_len), batch_size * seq_len,
                                     autocast=autocast, checkpointing=activation_checkpointing),
        free_bytes=free_bytes)


def free_bytes(device: torch.device) -> int | None:
    """Free memory of `device`: CUDA's free memory; on CPU the kernel's MemAvailable; None
    elsewhere (MPS shares memory with the system and reports no free figure)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return None
