"""Train a GPT with nanochat: `python scripts/base_train.py --help`.

Thin entrypoint: parse flags into TrainConfig (tyro), hand it to NanoChatTrainer, print results.
A user or environment error is one `error:` line (exit 2: bad flags or input; 1: the run
failed); `--debug` adds the traceback.
"""

import json
import sys

from nanochat.common import print0, run_main
from nanochat.config import TrainConfig, parse_cli


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(TrainConfig, argv)
    return run_main(lambda: train(cfg), debug=cfg.debug)


def train(cfg: TrainConfig) -> int:
    from nanochat.train.trainer import NanoChatTrainer  # after parsing: --help stays fast

    result = NanoChatTrainer(cfg).train()
    # under torchrun every rank returns a result; rank 0 reports it
    if result.samples:  # --num_samples 0: no heading over nothing
        print0("\nsamples:")
    for s in result.samples:
        print0("  " + json.dumps(s)[:400])
    print0(f"\nval bpb {result.val_bpb:.4f} | val loss {result.val_loss:.4f} | train loss "
           f"{result.train_loss:.4f} | {result.tokens_per_sec:,.0f} tokens/s | {result.steps} steps "
           f"({result.epochs:.3f} epochs) in {result.wall_time_s:.0f} s"
           + (f" | compile time {result.compile_time_s:.1f} s" if result.compile_time_s else "")
           + (f" | fp8 layer timing {result.fp8_measure_time_s:.1f} s" if result.fp8_measure_time_s else ""))
    if result.mfu is not None:
        print0(f"MFU {result.mfu:.1%} of the dense bf16 peak ({result.peak_tflops:g} TFLOP/s per GPU)"
               + (f", {result.mfu_fp8:.1%} of the dense FP8 peak" if result.mfu_fp8 is not None else ""))
    if result.val_accuracy is not None:
        print0(f"val accuracy {result.val_accuracy:.4f} (multiple choice, {result.accuracy_scoring})")
    if result.peak_memory_bytes is not None:
        print0(f"peak memory {result.peak_memory_bytes / 2**30:.2f} GiB measured "
               f"(planned {result.planned_memory_bytes / 2**30:.2f} GiB)")
    for f in result.fallbacks:
        print0(f"fallback: {f}")
    print0(f"results: {result.run_dir}/result.json, metrics: {result.run_dir}/metrics.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
