"""FP8 in your own training loop: a Hugging Face LlamaForCausalLM (not a nanochat model) trained
by hand with FP8 matmuls (formats chosen per layer by measurement), FP8 Adam moments and
torch.compile. FP8Training calls the shots at fixed points of each step, a StepGuard skips a step
whose loss or gradients are not finite and clips the others; the loop stays yours.

    python examples/custom_loop.py             # native FP8 on sm_89+ GPUs
    python examples/custom_loop.py --emulate   # anywhere: FP8 numerics simulated (slow)
"""

import argparse
from pathlib import Path

import torch

from nanochat.fp8 import FP8Config, FP8Training  # first: it imports torchao with its log noise muted
from nanochat.train.guard import StepGuard
from transformers import LlamaConfig, LlamaForCausalLM


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--emulate", action="store_true", help="simulate FP8 (any device)")
    parser.add_argument("--no_compile", action="store_true")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)).to(device)
    data = torch.tensor(list(Path(__file__).read_bytes()), device=device)  # bytes as tokens

    # layers="all": at width 128 FP8 is slower than bf16, so the default ("faster") would keep every
    # layer in bf16; this example shows FP8's numerics and calibration, not its speed
    fp8 = FP8Training(model, FP8Config(mode="auto", opt_level=2, emulate=args.emulate, auto_steps=3, stats_every=10,
                                       layers="all"), torch.optim.AdamW(model.parameters(), lr=3e-3))
    guard = StepGuard(model)  # not FP8's: it keeps its own counts (guard.summary_text, guard.state_dict)
    print(fp8.report.summary())
    optimizer, params = fp8.optimizer, [p for p in model.parameters() if p.requires_grad]
    compiled = None  # compiled once auto's formats are fixed (calibration runs eagerly)
    for step in range(args.steps):
        starts = torch.randint(len(data) - 33, (8,)).tolist()
        batch = torch.stack([data[i:i + 33] for i in starts])
        with fp8.begin_step(step) as fp8_step:  # calibration, statistics hooks
            module = model if fp8_step.eager or compiled is None else compiled
            loss = module(input_ids=batch, labels=batch).loss
            loss.backward()
        verdict = guard.check(step, loss.detach(), params, max_norm=1.0)  # non-finite: skipped; else clipped
        record = fp8_step.record() | verdict.flags
        if not verdict.skipped:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            fp8.end_step(step)  # True once auto's formats are fixed: the moment to compile
            if not fp8.calibrating and compiled is None and not args.no_compile:
                compiled = torch.compile(model)
        if step % 5 == 4 or step == args.steps - 1:
            print(f"step {step + 1}: loss {verdict.loss:.3f}" + (" (calibrating)" if "calibrating" in record else ""))
    print(guard.summary_text("end of training"))
    print(fp8.summary_text(fp8.summary(), "end of training"))
    with torch.no_grad(), fp8.high_precision():  # evaluation in high precision
        final = model(input_ids=data[:65][None], labels=data[:65][None]).loss.item()
    print(f"high-precision loss on the first 64 bytes: {final:.3f}")
    return final


if __name__ == "__main__":
    main()
