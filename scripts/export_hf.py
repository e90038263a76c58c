"""Export a model as a Hugging Face directory (config.json, model.safetensors, tokenizer files).

    python scripts/export_hf.py --run_dir runs/sft --out_dir exported/      # a trained run
    python scripts/export_hf.py --model_name org/name --out_dir exported/   # a model as loaded

The result loads with `transformers.AutoModelForCausalLM.from_pretrained(out_dir)`. Weights are
always plain fp32, FP8 training or not. Only Llama-family models (loaded from a Hugging Face
checkpoint, then trained) can be exported; see nanochat/hf.py for why presets cannot.
"""

from dataclasses import dataclass

from nanochat.checkpoint import load_checkpoint
from nanochat.common import print0, setup_logging
from nanochat.config import parse_cli
from nanochat.hf import export_hf, load_hf_model, model_from_state_dict, resolve_model


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    """Export a run's checkpoint, or a model as loaded, to a Hugging Face model directory."""

    out_dir: str
    """Directory to write config.json, model.safetensors and the tokenizer files to."""

    run_dir: str | None = None
    """A training run directory (its checkpoint.pt and tokenizer/) to export."""

    model_name: str | None = None
    """Instead of --run_dir: a local Hugging Face directory or a cached hub id, exported as loaded."""

    def __post_init__(self) -> None:
        if (self.run_dir is None) == (self.model_name is None):
            raise ValueError("give exactly one of --run_dir (a trained run) or --model_name (a model as loaded)")


def main() -> None:
    cfg = parse_cli(ExportConfig)
    setup_logging()
    if cfg.run_dir is not None:
        try:
            import nanochat.fp8  # noqa: F401  registers FP8 optimizer-state tensors for weights_only loading
        except ImportError:
            pass
        ckpt = load_checkpoint(cfg.run_dir)
        model, tokenizer = model_from_state_dict(ckpt["config"]["model_name"], ckpt["model"],
                                                 tokenizer_dir=f"{cfg.run_dir}/tokenizer")
    else:
        resolved = resolve_model(cfg.model_name)
        if resolved.kind != "hf":
            raise SystemExit(f"error: {cfg.model_name!r} is a nanochat preset; only Hugging Face "
                             "models can be exported (see nanochat/hf.py)")
        model, tokenizer = load_hf_model(resolved.path)
    out = export_hf(model, tokenizer, cfg.out_dir)
    print0(f"exported {model.num_params() / 1e6:.1f}M parameters to {out}")


if __name__ == "__main__":
    main()
