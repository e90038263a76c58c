"""Export a model as a Hugging Face directory (config.json, model.safetensors, tokenizer files).

    python scripts/export_hf.py --run_dir runs/sft --out_dir exported/      # a trained run
    python scripts/export_hf.py --model_name org/name --out_dir exported/   # a model as loaded

The result loads with `transformers.AutoModelForCausalLM.from_pretrained(out_dir)`. Weights are
always plain fp32, FP8 training or not. The tokenizer files are the run's, with the chat template
the records were rendered with (`chat_template.jinja`; the plain format for a base model), so
`AutoTokenizer.apply_chat_template` writes the text the model was fine-tuned on. Only
Llama-family models (loaded from a Hugging Face checkpoint, then trained) can be exported; see
nanochat/hf.py for why presets cannot. A non-empty --out_dir is refused unless --overwrite, which
replaces it whole once the export is complete (never the run or the model it reads from). A run
still in progress is exported at its newest checkpoint, with a warning saying so. Errors
are one `error:` line (exit 2: bad flags or input; 1: e.g. a corrupt checkpoint); `--debug` adds
the traceback.
"""

import sys

from nanochat import runlock
from nanochat.checkpoint import load_checkpoint
from nanochat.common import UsageError, logger, print0, run_main, setup_logging
from nanochat.config import ExportConfig, parse_cli
from nanochat.hf import check_export_dir, export_hf, load_hf_model, model_from_state_dict, resolve_model


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(ExportConfig, argv)
    return run_main(lambda: export(cfg), debug=cfg.debug)


def export(cfg: ExportConfig) -> int:
    setup_logging()
    if cfg.run_dir is not None:
        check_export_dir(cfg.out_dir, overwrite=cfg.overwrite, sources=[cfg.run_dir])  # before loading anything
        ckpt = load_checkpoint(cfg.run_dir, keys=("model", "config.model_name"), mmap=True)
        training = runlock.holder(cfg.run_dir)
        if training is not None:
            logger.warning("WARNING: the run in %s is still in progress (%s): exporting its newest checkpoint, "
                           "step %d; what it trains after that is not in this export", cfg.run_dir, training,
                           ckpt["step"])
        # export_hf protects the model the run fine-tuned too
        sources = [cfg.run_dir, resolve_model(ckpt["config"]["model_name"]).path]
        model, tokenizer = model_from_state_dict(ckpt["config"]["model_name"], ckpt["model"],
                                                 tokenizer_dir=f"{cfg.run_dir}/tokenizer")
    else:
        resolved = resolve_model(cfg.model_name)
        if resolved.kind != "hf":
            raise UsageError(f"--model_name {cfg.model_name!r} is a nanochat preset; only Hugging Face "
                             "models can be exported (see nanochat/hf.py)")
        sources = [resolved.path]
        check_export_dir(cfg.out_dir, overwrite=cfg.overwrite, sources=sources)
        model, tokenizer = load_hf_model(resolved.path)
    out = export_hf(model, tokenizer, cfg.out_dir, overwrite=cfg.overwrite, sources=sources)
    print0(f"exported {model.num_params() / 1e6:.1f}M parameters to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
