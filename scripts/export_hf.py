"""Export a model as a Hugging Face directory (config.json, model.safetensors, tokenizer files).

    python scripts/export_hf.py --run_dir runs/sft --out_dir exported/                  # a trained run
    python scripts/export_hf.py --model_name org/name --out_dir exported/               # a model as loaded
    python scripts/export_hf.py --run_dir runs/sft --out_dir served/ --quantize fp8     # FP8, for vLLM / SGLang

The result loads with `transformers.AutoModelForCausalLM.from_pretrained(out_dir)`. Weights are
plain fp32, FP8 training or not, unless --quantize: fp8 stores every block Linear in e4m3 with a
scale per output channel (fp8_block: per 128x128 block) in compressed-tensors' format, which
`vllm serve out_dir` runs as FP8 on an sm_89+ GPU (mxfp8: an e8m0 scale per 32 values, MXFP8 for
Blackwell); the layers the run trained in high precision, lm_head, embeddings and norms stay
bf16; a table gives each layer's weight SQNR (docs/hf.md). The tokenizer files are the run's,
with the chat template the records were rendered with (`chat_template.jinja`; the plain format
for a base model), so `AutoTokenizer.apply_chat_template` writes the text the model was fine-tuned on. Only Llama-family models (loaded from a Hugging Face
checkpoint, then trained) can be exported; see nanochat/model/export.py for why presets cannot. A non-empty
--out_dir is refused unless --overwrite, which replaces it whole once the export is complete
(never the run or the model it reads from). The export names what it read (the checkpoint and
its step, in its last line and in `nanochat_export.json`); a run still in progress or one that
did not finish is exported at its newest checkpoint, with a one-line warning saying so. Errors are one `error:` line (exit 2: bad flags or input;
1: e.g. a corrupt checkpoint); `--debug` adds the traceback.
"""

import json
import sys
import time
from pathlib import Path

from nanochat.common import UsageError, format_bytes, logger, print0, run_main, setup_logging
from nanochat.config import ExportConfig, parse_cli


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(ExportConfig, argv)
    return run_main(lambda: export(cfg), debug=cfg.debug)


def run_kept_layers(run_dir: str, meta: dict, model) -> dict[str, str]:
    """The Linears a --fp8 run trained in high precision (not in its checkpoint's `fp8_converted`),
    with the reason its result.json gives; none for a run without --fp8 (every layer was trained the
    same way, in high precision) or a checkpoint without the list."""
    from nanochat.model.export import exportable_linears

    converted = meta.get("fp8_converted")
    if not meta["config"].get("fp8") or converted is None:
        return {}
    try:
        why = json.loads((Path(run_dir) / "result.json").read_text()).get("fp8_skipped") or {}
    except (OSError, ValueError):
        why = {}
    return {n: f"trained in high precision: {why.get(n, 'not FP8-converted by the run')}"
            for n in exportable_linears(model) if n not in converted}


def run_provenance(run_dir: str, saved, holder: str | None) -> dict:
    """Which checkpoint an export of `run_dir` reads, and whether the run had finished there: the
    export's nanochat_export.json and its printed line. A run still in progress (`holder`: who
    holds its lock) or one that stopped before its last step gets a one-line warning."""
    try:
        result = json.loads((Path(run_dir) / "result.json").read_text())
    except (OSError, ValueError):
        result = None
    finished = isinstance(result, dict) and result.get("steps") == saved.step and holder is None
    if holder is not None:
        run = "in progress"
        logger.warning("WARNING: the run in %s is still in progress (%s): exporting its newest checkpoint, step %d; "
                       "what it trains after that is not in this export", run_dir, holder, saved.step)
    elif not finished:
        run = "unfinished"
        logger.warning("WARNING: the run in %s did not finish (no result.json for step %d: it was stopped or died); "
                       "exporting its newest checkpoint, step %d; resume it to train the rest", run_dir, saved.step,
                       saved.step)
    else:
        run = "finished"
    return {"run_dir": str(Path(run_dir).resolve()), "checkpoint": str(saved.path), "step": saved.step, "run": run}


def export(cfg: ExportConfig) -> int:
    from nanochat import rundir  # after parsing: --help stays fast
    from nanochat.checkpoint import load_model, read_run
    from nanochat.model.export import check_export_dir, export_hf, require_exportable
    from nanochat.model.hf_fp8 import require_compressed_tensors
    from nanochat.model.hub import resolve_model

    setup_logging()
    if cfg.quantize != "none":
        require_compressed_tensors(f"--quantize {cfg.quantize}")  # before loading anything
    keep = {}
    if cfg.run_dir is not None:
        check_export_dir(cfg.out_dir, overwrite=cfg.overwrite, sources=[cfg.run_dir])  # before loading anything
        saved = read_run(cfg.run_dir)  # the newest checkpoint, its weights memory-mapped
        provenance = run_provenance(cfg.run_dir, saved, rundir.holder(cfg.run_dir))
        # export_hf protects the model the run fine-tuned too
        sources = [cfg.run_dir, require_exportable(saved.meta["config"]["model_name"]).path]
        model, tokenizer = load_model(saved)
        keep = run_kept_layers(cfg.run_dir, saved.meta, model)
    else:
        provenance = {"model_name": cfg.model_name}
        resolved = resolve_model(cfg.model_name)
        if resolved.kind != "hf":
            raise UsageError(f"--model_name {cfg.model_name!r} is a nanochat preset; only Hugging Face "
                             "models can be exported (see nanochat/model/export.py)")
        sources = [resolved.path]
        check_export_dir(cfg.out_dir, overwrite=cfg.overwrite, sources=sources)
        model, tokenizer = load_model(resolved)
    start = time.perf_counter()
    out = export_hf(model, tokenizer, cfg.out_dir, overwrite=cfg.overwrite, sources=sources, quantize=cfg.quantize,
                    keep=keep, quantize_all=cfg.quantize_all, sqnr_floor_db=cfg.sqnr_floor_db, provenance=provenance)
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    weights = _weights_label(cfg.quantize, out)
    what = (f"{provenance['checkpoint']} (step {provenance['step']}, {provenance['run']})" if cfg.run_dir is not None
            else cfg.model_name)
    print0(f"exported {what}: {model.num_params() / 1e6:.1f}M parameters to {out} ({weights}, "
           f"{format_bytes(size)} of safetensors, {time.perf_counter() - start:.1f} s)")
    return 0


def _weights_label(quantize: str, out) -> str:
    """What the export's weights are stored as, from its fp8 report: a --quantize that quantized
    no layer is labelled bf16, not by the scheme asked for."""
    if quantize == "none":
        return "fp32 weights"
    from nanochat.model.hf_fp8 import REPORT_FILE

    layers = json.loads((out / REPORT_FILE).read_text())["layers"]
    done = sum(la["stored_as"] != "bf16" for la in layers)
    return (f"{quantize} weights in {done} of {len(layers)} Linear layers" if done
            else f"bf16 weights: --quantize {quantize} quantized none of its {len(layers)} Linear layers")


if __name__ == "__main__":
    sys.exit(main())
