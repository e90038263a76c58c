"""Planned vs measured training memory on CUDA: nanochat.memory's plan against the peak of
torch.cuda.max_memory_allocated over a few AdamW steps of a randomly initialized model.

    python scripts/bench_memory.py                       # Llama-3-8B shape, batch 16 x 256, checkpointed
    python scripts/bench_memory.py --preset llama3-1b    # smaller: with and without checkpointing

Plain torch only (bf16 autocast, fp32 master weights, fused AdamW = fp8_opt_level 0): the
weights, gradients and optimizer figures are exact, so the gap is the activation estimate plus
what the plan leaves out (temporaries, fragmentation). BENCHMARKS.md records the figures.
"""

import argparse
import time

import torch

from nanochat.gpt import GPT, GPTConfig
from nanochat.memory import plan_training

LLAMA = dict(mlp="swiglu", norm_weight=True, norm_eps=1e-5, embed_norm=False, qk_norm=False, softcap=0.0,
             rope_theta=500000.0)
SHAPES = {
    "llama3-8b": GPTConfig(vocab_size=128256, seq_len=8192, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096,
                           intermediate_size=14336, **LLAMA),
    "llama3-1b": GPTConfig(vocab_size=128256, seq_len=8192, n_layer=16, n_head=32, n_kv_head=8, n_embd=2048,
                           intermediate_size=8192, tie_embeddings=True, **LLAMA),
}


def measure(config: GPTConfig, batch: int, seq: int, checkpointing: bool, steps: int = 3) -> tuple[int, float]:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with torch.device("meta"):
        model = GPT(config)
    model.materialize("cuda")
    model.init_weights()
    model.activation_checkpointing = checkpointing
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    x = torch.randint(0, config.vocab_size, (batch, seq), device="cuda")
    t0 = time.perf_counter()
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    peak = torch.cuda.max_memory_allocated()
    del model, opt, x, loss
    return peak, dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=list(SHAPES), default="llama3-8b")
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--checkpointing", choices=["on", "off", "both"], default="on")
    args = ap.parse_args()
    config = SHAPES[args.preset]
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


if __name__ == "__main__":
    main()
