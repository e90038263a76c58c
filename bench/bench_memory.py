"""Planned vs measured training memory on CUDA: nanochat.train.memory's plan against the peak of
torch.cuda.max_memory_allocated over a few AdamW steps of a randomly initialized model.

    python bench/bench_memory.py                       # Llama-3-8B shape, batch 16 x 256, checkpointed
    python bench/bench_memory.py --preset llama3-1b    # smaller: with and without checkpointing
    python bench/bench_memory.py --plan_only           # no GPU: README's table of which flags fit
    python bench/bench_memory.py --plan_only --optimizer muon   # the same for Muon + AdamW

Plain torch only (bf16 autocast, fp32 master weights, fused AdamW = fp8_opt_level 0): the
weights, gradients and optimizer figures are exact, so the gap is the activation estimate plus
what the plan leaves out (temporaries, fragmentation). BENCHMARKS.md records the figures.
`--plan_only` measures nothing: it prints the plan for combinations of --master_weights,
--fp8_opt_level, --optimizer_in_backward and --activation_checkpointing as a markdown table,
against one 80 GB and one 141 GB GPU (planner estimates, not measurements).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import harness
from nanochat.common import UsageError

if TYPE_CHECKING:
    from nanochat.model.gpt import GPTConfig

LLAMA = dict(mlp="swiglu", norm_weight=True, norm_eps=1e-5, embed_norm=False, qk_norm=False, softcap=0.0,
             rope_theta=500000.0)
SHAPES = {
    "llama3-8b": dict(vocab_size=128256, seq_len=8192, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096,
                      intermediate_size=14336, **LLAMA),
    "llama3-1b": dict(vocab_size=128256, seq_len=8192, n_layer=16, n_head=32, n_kv_head=8, n_embd=2048,
                      intermediate_size=8192, tie_embeddings=True, **LLAMA),
}
"""GPTConfig fields of each --preset (torch and the model are imported after parsing: --help stays fast)."""


def measure(config: GPTConfig, batch: int, seq: int, checkpointing: bool, steps: int = 3) -> tuple[int, float]:
    import torch

    from nanochat.model.gpt import GPT

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with torch.device("meta"):
        model = GPT(config)
    model.materialize("cuda")
    model.init_weights()
    model.activation_checkpointing = checkpointing
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    x = torch.randint(0, config.vocab_size, (batch, seq), device="cuda")

    def train_steps() -> None:
        for _ in range(steps):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    dt = harness.timed(train_steps, cuda=True) / steps
    peak = torch.cuda.max_memory_allocated()
    del model, opt, x
    return peak, dt


# Whole device memory as nvidia-smi reports it (81559 and 143771 MiB); the CUDA context takes a
# little of it, so a plan within a few hundred MiB of these is at the edge.
DEVICES = {"80 GB (79.6 GiB)": int(79.6 * 2**30), "141 GB H200 (140.4 GiB)": int(140.4 * 2**30)}
# fp32 masters at levels 0, 1 and 2, the 16-bit choices at level 2 (their reason to exist is a model
# that fp32 state does not leave room for) and bf16 at level 1 too (Muon's FP8 momentum with the
# AdamW group's second moment in fp32); bf16 stands for bf16_sr too (same bytes).
COMBOS = [(mw, level, inb, ckpt) for mw, levels in (("fp32", (0, 1, 2)), ("bf16_split", (2,)), ("bf16", (1, 2)))
          for level in levels for inb in (False, True) for ckpt in (False, True)]


def plan_table(config: GPTConfig, batch: int, seq: int, optimizer: str = "adamw") -> str:
    """The markdown table of README's "Will it fit" (GiB per device, bf16 autocast), for
    `optimizer` (--optimizer: adamw, or muon's one moment per hidden matrix)."""
    from nanochat.train.memory import plan_training

    gib = lambda n: f"{n / 2**30:.1f}"  # noqa: E731
    head = ["`--master_weights`", "`--fp8_opt_level`", "`--optimizer_in_backward`", "`--activation_checkpointing`",
            "state B/param", "weights", "grads", "optimizer", "activations", "total"] + list(DEVICES)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mw, level, inb, ckpt in COMBOS:
        p = plan_training(config, batch_size=batch, seq_len=seq, opt_level=level, activation_checkpointing=ckpt,
                          autocast=True, master_weights=mw, optimizer_in_backward=inb, optimizer_kind=optimizer)
        # Under 1 GiB to spare is within what the plan leaves out (temporaries, fragmentation).
        fits = ["does not fit" if p.total > free else "at the edge" if free - p.total < 2**30 else "fits"
                for free in DEVICES.values()]
        cells = ["bf16 / bf16_sr" if mw == "bf16" else mw, level, "on" if inb else "off", "on" if ckpt else "off",
                 f"{p.state_bytes_per_param:.2f}", gib(p.weights), gib(p.gradients), gib(p.optimizer),
                 gib(p.activations), gib(p.total)] + fits
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


@dataclass(frozen=True, kw_only=True)
class BenchMemoryConfig:
    """Planned vs measured training memory on CUDA (or, with --plan_only, the plan table)."""

    preset: Literal["llama3-8b", "llama3-1b", "d26"] = "llama3-8b"
    """Model shape: Llama 3 8B or Llama 3.2 1B (SHAPES), or nanochat's d26 preset with a 65,536-token
    vocabulary and 2048-token context (karpathy/nanochat's speedrun size)."""
    batch_size: int = 16
    """Sequences per step."""
    seq_len: int = 256
    """Tokens per sequence."""
    checkpointing: Literal["on", "off", "both"] = "on"
    """Activation checkpointing of the measured runs: on, off, or one run each."""
    plan_only: bool = False
    """Print the plan table (no GPU, nothing measured)."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """The plan table's --optimizer (muon: Muon for the hidden matrices); measured runs are AdamW."""

    def __post_init__(self) -> None:
        if self.optimizer != "adamw" and not self.plan_only:
            raise ValueError(f"--optimizer {self.optimizer} applies to the plan table: add --plan_only (the "
                             "measured runs are plain AdamW)")
        for name in ("batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")


def bench(args: BenchMemoryConfig) -> None:
    import torch

    from nanochat.model.gpt import GPTConfig, preset_config
    from nanochat.train.memory import plan_training

    config = preset_config("d26", vocab_size=65536, seq_len=2048) if args.preset == "d26" \
        else GPTConfig(**SHAPES[args.preset])
    if args.plan_only:
        print(f"{args.preset}, batch {args.batch_size} x {args.seq_len}, bf16 autocast, --optimizer {args.optimizer}: "
              "planner estimate, not measured (GiB per device)\n")
        print(plan_table(config, args.batch_size, args.seq_len, args.optimizer))
        return
    if not torch.cuda.is_available():
        raise UsageError("no CUDA device: the measurement needs one; --plan_only prints the plan without it")
    free = torch.cuda.mem_get_info()[0]
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.checkpointing]
    for ckpt in modes:
        plan = plan_training(config, batch_size=args.batch_size, seq_len=args.seq_len, opt_level=0,
                             activation_checkpointing=ckpt, autocast=True, free_bytes=free)
        print(plan.table(), flush=True)
        if not plan.fits:
            print(f"{args.preset} checkpointing={ckpt}: planned not to fit, skipped")
            continue
        peak, dt = measure(config, args.batch_size, args.seq_len, ckpt)
        fixed = plan.weights + plan.gradients + plan.optimizer
        print(f"{args.preset} batch {args.batch_size}x{args.seq_len} checkpointing={ckpt}: planned "
              f"{plan.total / 2**30:.2f} GiB, measured peak {peak / 2**30:.2f} GiB (ratio "
              f"{peak / plan.total:.3f}); activations planned {plan.activations / 2**30:.2f} GiB, measured "
              f"peak minus weights/grads/moments {(peak - fixed) / 2**30:.2f} GiB; {dt:.2f} s/step", flush=True)


def main(argv: list[str] | None = None) -> int:
    return harness.main(BenchMemoryConfig, bench, argv)


if __name__ == "__main__":
    sys.exit(main())
