"""FP8 in the Hugging Face Trainer: a small LlamaForCausalLM (built here, nothing downloaded)
trained by FP8Trainer on the bytes of this file, with FP8 matmuls in formats chosen per layer by
measurement, Adam moments in FP8 and FP8 health in the Trainer's logs.

    python examples/hf_trainer.py --compile      # native FP8 on sm_89+ GPUs
    python examples/hf_trainer.py --emulate      # anywhere: FP8 numerics simulated (slow)
"""

import argparse
import tempfile
from pathlib import Path

import torch

from nanochat.fp8 import FP8Config  # first: it imports torchao with its log noise muted
from nanochat.hf_trainer import FP8Trainer
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

SEQ_LEN = 32


def tiny_llama() -> LlamaForCausalLM:
    """2 layers of width 128 over the 256 byte values, seeded: the same weights on every call."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64))


def byte_windows(data: bytes, n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """`n` windows of SEQ_LEN bytes at seeded random offsets, as causal-LM examples (the model
    shifts the labels itself)."""
    tokens = torch.tensor(list(data))
    starts = torch.randint(len(tokens) - SEQ_LEN, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return [{"input_ids": tokens[i:i + SEQ_LEN], "labels": tokens[i:i + SEQ_LEN]} for i in starts]


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--emulate", action="store_true", help="simulate FP8 (any device)")
    parser.add_argument("--compile", action="store_true", help="TrainingArguments(torch_compile=True)")
    parser.add_argument("--master_weights", default="fp32", choices=["fp32", "bf16", "bf16_sr", "bf16_split"])
    parser.add_argument("--output_dir", help="where the Trainer writes (default: a temporary directory)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    data = Path(__file__).read_bytes()
    split = len(data) * 9 // 10  # the last tenth is held out for evaluation
    with tempfile.TemporaryDirectory() as scratch:
        trainer = FP8Trainer(
            model=tiny_llama(),
            args=TrainingArguments(
                output_dir=args.output_dir or scratch, max_steps=args.steps, per_device_train_batch_size=8,
                learning_rate=3e-3, warmup_steps=3, logging_steps=5, save_strategy="no", report_to=[],
                disable_tqdm=True, use_cpu=not cuda, bf16=cuda and args.master_weights == "fp32",
                torch_compile=args.compile, seed=0),
            train_dataset=byte_windows(data[:split], 512), eval_dataset=byte_windows(data[split:], 32),
            # layers="all": at width 128 FP8 is slower than bf16, so the default ("faster") would keep
            # every layer in bf16; this example shows FP8's numerics and calibration, not its speed
            fp8_config=FP8Config(mode="auto", opt_level=2, emulate=args.emulate, layers="all", auto_steps=3,
                                 stats_every=10),
            master_weights=args.master_weights, log_layers_every=0)
        print(trainer.fp8.report.table())
        result = trainer.train()
        print(trainer.fp8.summary_text(trainer.fp8.summary(), "end of training"))
        metrics = trainer.evaluate()  # in high precision
    print(f"train loss {result.training_loss:.3f}, high-precision eval loss {metrics['eval_loss']:.3f}; "
          f"fallbacks: {result.metrics['fp8_fallbacks'] or 'none'}")
    return {"train_loss": result.training_loss, "eval_loss": metrics["eval_loss"]}


if __name__ == "__main__":
    main()
