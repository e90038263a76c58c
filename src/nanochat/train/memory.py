"""Will it fit: the memory a training run needs, planned before any weight is allocated.

    plan = plan_training(gpt_config, batch_size=16, seq_len=256, opt_level=2, free_bytes=free_bytes(dev))
    print(plan.table()); plan.check()   # ValueError naming what would make it fit

Four parts, per device:
- weights: parameters x `weight_bytes`, set by `master_weights` (nanochat.optim.master): fp32
  masters 4 bytes, the bf16 choices 2. FP8 training keeps these weights (torchao casts to FP8
  only inside each matmul);
- gradients: parameters x `grad_bytes` (the parameters' dtype). With `optimizer_in_backward` each
  gradient is freed as soon as its parameter steps, so the part is the largest single gradient,
  plus a tied embedding's, alive from the lm_head's backward to the embedding's
  (docs/master_weights.md);
- optimizer: AdamW's two moments per tensor exactly as nanochat.optim.FP8Optim allocates them (Muon:
  one for each hidden matrix):
  level 0 both fp32 (8 bytes/param), level 1 the first in FP8 (1 byte + one fp32 scale per 256),
  level 2 both (~2.03); tensors FP8Optim keeps fp32 keep 8 at every level. bf16_split adds the
  16 low bits of every fp32 master (2 bytes/param) to the optimizer state;
- activations: an estimate (`activation_bytes`): what one block keeps for its backward, counted
  from nanochat.model.gpt.Block per token and layer, plus the fp32 logits, their log-softmax and
  their gradient; with activation checkpointing a block keeps only its input. FP8 layers of
  every recipe (MXFP8's too) keep what a plain Linear keeps (torchao casts again in the backward).
Under FSDP the first three are divided by the world size (each rank holds its shard).
`state_bytes_per_param` is the first three per parameter (independent of the sharding): the
training state a run carries whatever its batch, e.g. 16 for fp32 masters at level 0, ~10 at
level 2, ~6 with bf16 masters at level 2, ~4 when the optimizer also runs in the backward.

Not counted: allocator fragmentation, temporary buffers (FP8 casts, attention workspaces), the
CUDA context (already outside the free memory we compare against). So the plan is a lower bound
labelled as an estimate; the measured peak (`TrainResult.peak_memory_bytes`, CUDA) is the truth.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from nanochat.common import format_bytes, format_table
from nanochat.config import TrainConfig
from nanochat.optim import muon_param_groups, optimizer_bytes
from nanochat.optim.master import MASTER_WEIGHTS, bytes_per_param
from nanochat.optim.moments import DEFAULT_BLOCK_SIZE, fp8_size_problem
from nanochat.optim.shards import local
from nanochat.model.gpt import GPT, GPTConfig
from nanochat.parallel.layout import Layout


@functools.lru_cache(maxsize=16)
def param_numels(config: GPTConfig) -> tuple[int, ...]:
    """Element count of every parameter tensor (a tied embedding once), from a model built on the
    meta device: exact, and no memory allocated. Cached: a refusal's remedies replan one config
    thousands of times."""
    with torch.device("meta"):
        model = GPT(config)
    return tuple(p.numel() for p in model.parameters())


@functools.lru_cache(maxsize=16)
def muon_numels(config: GPTConfig) -> tuple[int, ...]:
    """Element count of every tensor --optimizer muon gives Muon (a hidden matrix: one moment,
    the rest AdamW's two), from the model on the meta device as nanochat.optim.muon_param_groups
    splits it."""
    with torch.device("meta"):
        model = GPT(config)
    return tuple(p.numel() for group in muon_param_groups(model).muon for p in group["params"])


def moment_bytes(config: GPTConfig, optimizer: str, opt_level: int) -> int:
    """Bytes of the optimizer's moments as FP8Optim lays them out at `opt_level` (fp32 on tensors
    FP8 blocks do not fit): AdamW two per tensor; under Muon one for each hidden matrix."""
    adamw = collections.Counter(param_numels(config))
    muon = collections.Counter(muon_numels(config) if optimizer == "muon" else ())
    adamw.subtract(muon)

    def moments(numel: int, count: int) -> int:
        q = 0 if fp8_size_problem(numel) else opt_level
        return optimizer_bytes(numel, quantized=min(q, count), moments=count, block_size=DEFAULT_BLOCK_SIZE)
    return (sum(n * moments(t, 2) for t, n in adamw.items() if n)
            + sum(n * moments(t, 1) for t, n in muon.items()))


def held(tensors: Iterable[torch.Tensor]) -> tuple[int, int]:
    """(elements, bytes) of `tensors` as this rank holds them: a DTensor (FSDP2) counts its local
    shard. Every count a run makes of its parameters, weights and gradients is this one."""
    numel = nbytes = 0
    for t in tensors:
        n = local(t).numel()
        numel, nbytes = numel + n, nbytes + n * t.element_size()
    return numel, nbytes

@dataclass
class HeldBytes:
    """What a run's training state holds on this rank, measured (TrainResult.state_bytes, against
    the plan's parts): weights and optimizer state at setup, gradients at the first update."""

    weights: int
    optimizer: int
    gradients: int | None = None

    def count_gradients(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        """At an update, the first time: the gradients present (with the step inside the
        backward, the largest one alive at once: the optimizer measured it)."""
        if self.gradients is None:
            in_backward = getattr(optimizer, "in_backward", False)
            self.gradients = optimizer.max_live_grad_bytes if in_backward else \
                held(p.grad for p in params if p.grad is not None)[1]

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + (self.gradients or 0)

    def as_dict(self) -> dict[str, int]:
        parts = {"weights": self.weights, "optimizer": self.optimizer}
        return parts if self.gradients is None else {**parts, "gradients": self.gradients}


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


def in_backward_grad_numel(config: GPTConfig, numels: tuple[int, ...]) -> int:
    """Gradient elements alive at once when the optimizer steps inside the backward: the largest
    tensor's, plus a tied embedding's, which stays alive between its two uses in the backward."""
    if not config.tie_embeddings:
        return max(numels)
    tied = config.vocab_size * config.n_embd
    others = list(numels)
    others.remove(tied)
    return tied + max(others, default=0)


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
    master_weights: str
    """`--master_weights`: fp32, bf16, bf16_sr or bf16_split (nanochat.optim.master)."""
    optimizer_in_backward: bool
    """The optimizer steps each parameter inside the backward and frees its gradient at once."""
    optimizer_kind: str
    """`--optimizer`: adamw (two moments per tensor) or muon (one per hidden matrix)."""
    weight_bytes: float
    """Bytes per weight, derived from master_weights."""
    grad_bytes: float
    """Bytes per gradient element, derived from master_weights."""
    grad_numel: int
    """Gradient elements alive at the peak: every parameter, or under optimizer_in_backward the
    largest tensor (see in_backward_grad_numel)."""
    weights: int
    gradients: int
    optimizer: int
    """AdamW moments plus, for bf16_split, the low halves of the fp32 masters."""
    remainder: int
    """The bf16_split part of `optimizer` (0 for the other choices)."""
    activations: int
    free_bytes: int | None
    """The device's free memory, None where it cannot be read."""

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations

    @property
    def fits(self) -> bool:
        return self.free_bytes is None or self.total <= self.free_bytes

    @property
    def state_bytes_per_param(self) -> float:
        """Weights + gradients + optimizer per parameter: the training state without the
        activations. Each device holds 1/shards of the parameters, so the per-device parts are
        scaled back by the shard count and the figure does not depend on the sharding."""
        return (self.weights + self.gradients + self.optimizer) * self.shards / self.num_params

    def table(self) -> str:
        gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
        if self.optimizer_in_backward:
            grads = (f"in backward: one tensor at a time, largest {self.grad_numel / 1e6:,.1f}M "
                     f"x {self.grad_bytes:g} B")
        else:
            grads = f"x {self.grad_bytes:g} B"
        opt = f"{'Muon + AdamW' if self.optimizer_kind == 'muon' else 'AdamW'}, fp8_opt_level {self.opt_level}"
        if self.remainder:
            opt += " + bf16_split remainder"
        rows = [["weights", gib(self.weights),
                 f"{self.num_params / 1e6:,.1f}M params x {self.weight_bytes:g} B ({self.master_weights} masters)"],
                ["gradients", gib(self.gradients), grads],
                ["optimizer", gib(self.optimizer), opt],
                ["activations", gib(self.activations),
                 f"estimate, batch {self.batch_size} x {self.seq_len}, "
                 f"{'bf16' if self.autocast else 'fp32'}{', checkpointed' if self.activation_checkpointing else ''}"],
                ["total", gib(self.total), f"per device{f', sharded over {self.shards}' if self.shards > 1 else ''}; "
                 f"state {self.state_bytes_per_param:.2f} B/param"],
                ["free", gib(self.free_bytes) if self.free_bytes is not None else "unknown",
                 ("fits" if self.fits else "DOES NOT FIT") if self.free_bytes is not None else ""]]
        return "memory plan (estimate)\n" + format_table(["", "bytes", ""], rows)

    def replan(self, **changes) -> "MemoryPlan":
        """This plan with other settings (batch_size, opt_level, activation_checkpointing, shards,
        master_weights, optimizer_in_backward, free_bytes)."""
        kw = dict(batch_size=self.batch_size, seq_len=self.seq_len, opt_level=self.opt_level,
                  activation_checkpointing=self.activation_checkpointing, autocast=self.autocast,
                  shards=self.shards, master_weights=self.master_weights,
                  optimizer_in_backward=self.optimizer_in_backward, optimizer_kind=self.optimizer_kind,
                  free_bytes=self.free_bytes)
        kw.update(changes)
        return plan_training(self.config, **kw)

    def remedies(self) -> list[str]:
        """What would make it fit, each with its planned total; empty when it fits.

        The single changes not already on, then (when there are two or more) all of them at once:
        the strongest the flags alone can do. Then a smaller batch and FSDP, each alone."""
        if self.fits:
            return []
        candidates: list[tuple[str, dict]] = []
        if self.opt_level < 2:  # FP8 moments need no FP8 layers (--fp8)
            candidates.append(("--fp8_opt_level 2", dict(opt_level=2)))
        if not self.activation_checkpointing:
            candidates.append(("--activation_checkpointing", dict(activation_checkpointing=True)))
        # bf16_split first: it keeps the fp32 master bit for bit (6 bytes of state instead of 8);
        # bf16_sr saves the remainder too (4) but rounds stochastically.
        if self.master_weights == "fp32":
            candidates.append(("--master_weights bf16_split", dict(master_weights="bf16_split")))
        if self.master_weights in ("fp32", "bf16_split"):
            candidates.append(("--master_weights bf16_sr", dict(master_weights="bf16_sr")))
        if not self.optimizer_in_backward:
            candidates.append(("--optimizer_in_backward (needs --grad_accum_steps 1 and --grad_clip 0)",
                               dict(optimizer_in_backward=True)))
        singles = len(candidates)
        if singles >= 2:
            # bf16_split and bf16_sr exclude each other; the strongest combination takes bf16_sr.
            combo = [(f, c) for f, c in candidates if c != dict(master_weights="bf16_split")]
            flags = " ".join(f.split(" (")[0] for f, _ in combo)
            change = {k: v for _, c in combo for k, v in c.items()}
            if len(combo) >= 2:
                note = " (needs --grad_accum_steps 1 and --grad_clip 0)" if "optimizer_in_backward" in change else ""
                candidates.append((flags + note, change))
        out = []
        for flags, change in candidates:
            p = self.replan(**change)
            out.append(f"{flags}: {format_bytes(p.total)}{'' if p.fits else ' (still too much)'}")
        batch = next((b for b in range(self.batch_size - 1, 0, -1) if self.replan(batch_size=b).fits), None)
        if batch is not None:
            out.append(f"--batch_size {batch} (with --grad_accum_steps to keep the tokens per step): "
                       f"{format_bytes(self.replan(batch_size=batch).total)}")
        else:
            out.append("a smaller --batch_size alone: not even --batch_size 1 fits")
        # FSDP shards Muon's momentum as AdamW's moments (each matrix is gathered whole only for
        # its own step, a transient the plan leaves out as it does other temporaries)
        gpus = next((n for n in range(self.shards + 1, 1025) if self.replan(shards=n).fits), None)
        if gpus is not None:
            out.append(f"FSDP over {gpus} GPUs (torchrun --nproc_per_node={gpus} ... --fsdp): "
                       f"{format_bytes(self.replan(shards=gpus).total)} per GPU")
        return out

    def check(self) -> None:
        """ValueError, before anything is allocated, when the plan exceeds the free memory."""
        if self.fits:
            return
        raise ValueError(
            f"this run does not fit: the memory plan needs {format_bytes(self.total)} per device "
            f"(weights {format_bytes(self.weights)}, gradients {format_bytes(self.gradients)}, optimizer "
            f"{format_bytes(self.optimizer)}, activations ~{format_bytes(self.activations)}) but "
            f"{format_bytes(self.free_bytes)} is free. What would make it fit (planned totals): "
            + "; ".join(self.remedies()))


def plan_training(config: GPTConfig, *, batch_size: int, seq_len: int, opt_level: int = 0,
                  activation_checkpointing: bool = False, autocast: bool = False, shards: int = 1,
                  master_weights: str = "fp32", optimizer_in_backward: bool = False, optimizer_kind: str = "adamw",
                  free_bytes: int | None = None) -> MemoryPlan:
    """The MemoryPlan of training `config` (see the module docstring for what each part counts)."""
    if master_weights not in MASTER_WEIGHTS:
        raise ValueError(f"master_weights {master_weights!r}: expected one of {', '.join(MASTER_WEIGHTS)}")
    weight_bytes, grad_bytes, extra_bytes = bytes_per_param(master_weights)
    numels = param_numels(config)
    n = sum(numels)
    grad_numel = in_backward_grad_numel(config, numels) if optimizer_in_backward else n
    remainder = math.ceil(n * extra_bytes / shards)
    moments = moment_bytes(config, optimizer_kind, opt_level)
    return MemoryPlan(
        config=config, num_params=n, batch_size=batch_size, seq_len=seq_len, opt_level=opt_level,
        activation_checkpointing=activation_checkpointing, autocast=autocast, shards=shards,
        master_weights=master_weights, optimizer_in_backward=optimizer_in_backward, optimizer_kind=optimizer_kind,
        weight_bytes=weight_bytes, grad_bytes=grad_bytes, grad_numel=grad_numel,
        weights=math.ceil(n * weight_bytes / shards), gradients=math.ceil(grad_numel * grad_bytes / shards),
        optimizer=math.ceil(moments / shards) + remainder, remainder=remainder,
        activations=activation_bytes(dataclasses.replace(config, seq_len=seq_len), batch_size * seq_len,
                                     autocast=autocast, checkpointing=activation_checkpointing),
        free_bytes=free_bytes)


def param_shards(layout: Layout) -> int:
    """Into how many parts a run's parameters, gradients and optimizer state are split per device
    under `layout`: FSDP's data-parallel ranks times the tensor-parallel degree. Under --tp the
    norm weights stay whole on every rank (and the embedding and head where the vocabulary does
    not divide), counted here as split: the plan is low by at most those tensors' bytes."""
    return (layout.dp_size if layout.fsdp else 1) * layout.tp


def plan_run(cfg: TrainConfig, config: GPTConfig, *, autocast: bool, shards: int, device: torch.device) -> MemoryPlan:
    """`plan_training` for a run's flags (`cfg`) on `device`, checked: a run that does not fit
    fails here, before a weight is allocated (ValueError naming what would make it fit)."""
    plan = plan_training(
        config, batch_size=cfg.batch_size, seq_len=cfg.seq_len, opt_level=cfg.fp8_opt_level,
        activation_checkpointing=cfg.activation_checkpointing,
        master_weights="fp32" if cfg.master_weights_emulate else cfg.master_weights,
        optimizer_in_backward=cfg.optimizer_in_backward, optimizer_kind=cfg.optimizer, autocast=autocast,
        shards=shards, free_bytes=free_bytes(device))
    plan.check()
    return plan


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
