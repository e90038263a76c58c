"""Our GPT out to a Hugging Face model directory that transformers, vLLM and SGLang load.

`export_hf` writes config.json (the inverse of the config map, for architectures that map
exactly: models loaded from Llama-family checkpoints and fine-tuned), model.safetensors and the
tokenizer's own files; in fp32, or with `quantize` in FP8 for serving (nanochat.model.hf_fp8).
A nanochat preset (ReLU^2 MLP, QK-norm, logit softcap) has no Llama counterpart and is refused.
The directory is written whole, as a temporary sibling that takes its place once complete
(nanochat.fs.publish_directory), after `check_export_dir` has made sure that nothing is lost:
a non-empty directory is replaced only with `overwrite`, and never when it holds what the
export reads from. A trained run's model comes from nanochat.checkpoint.load_model, once
`require_exportable` has refused a preset. docs/hf.md has the serving side.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from nanochat.common import UsageError, logger
from nanochat.config.export import SQNR_FLOOR_DB, Quantize
from nanochat.fs import publish_directory
from nanochat.model.gpt import GPT
from nanochat.model.hf import hf_config_from_gpt, hf_name
from nanochat.model.hf_fp8 import quantize_checkpoint, require_compressed_tensors
from nanochat.model.hub import ResolvedModel, resolve_model
from nanochat.tokenizer.hf import HFTokenizer

PROVENANCE_NAME = "nanochat_export.json"
"""In an export: what its weights were read from (a run's checkpoint, its step, whether the run had finished)."""


def _unwrap(model: torch.nn.Module) -> GPT:
    """The GPT inside torch.compile (`_orig_mod`) and DDP (`module`) wrappers."""
    while not isinstance(model, GPT):
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if inner is None:
            raise TypeError(f"export_hf needs a nanochat GPT, got {type(model).__name__}")
        model = inner
    return model


def require_exportable(model_name: str) -> ResolvedModel:
    """What `model_name` (the --model_name a run trained) names, refused when it is a nanochat
    preset: checked before the run's weights are read, since only a Llama-family architecture
    has a Hugging Face config to write."""
    resolved = resolve_model(model_name)
    if resolved.kind == "preset":
        raise ValueError(
            f"{model_name!r} is a nanochat preset: its ReLU^2 MLP, parameter-free RMSNorm, QK-norm, "
            "embedding norm and logit softcap have no Hugging Face Llama counterpart, so it cannot be "
            "exported for transformers; its checkpoint-<step>.pt is the way to keep it"
        )
    return resolved


def check_export_dir(out_dir: str | os.PathLike, *, overwrite: bool,
                     sources: Iterable[str | os.PathLike | None] = ()) -> None:
    """Raise a UsageError, before any work, when exporting to `out_dir` would lose something: it
    is not empty (without `overwrite`: a previous export's shards would be left next to the new
    files, and loaders prefer a sharded index), or `overwrite` would delete one of `sources`, the
    directories the export reads from (the run, its base model). A link to a directory is
    followed: the export replaces the directory it points to (fs.publish_directory)."""
    out = Path(out_dir)
    if os.path.islink(out) and not out.exists():
        raise UsageError(f"--out_dir {out} is a symbolic link to {os.readlink(out)}, which does not exist; create "
                         "that directory, repair the link, or give another --out_dir")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out_dir {out} is a file; give a directory (new or empty)")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not held:
        return
    if not overwrite:
        raise UsageError(f"--out_dir {out} is not empty ({', '.join(held[:4])}{', ...' if len(held) > 4 else ''}); "
                         "pass --overwrite to replace it whole, or choose a new --out_dir")
    real = os.path.realpath(out)
    for source in filter(None, sources):
        inside = os.path.realpath(source)
        if inside == real or inside.startswith(real.rstrip(os.sep) + os.sep):
            raise UsageError(f"--out_dir {out} {'is' if inside == real else 'contains'} {source}, which this export "
                             "reads from: --overwrite would delete it; choose another --out_dir")


def exportable_linears(model: torch.nn.Module) -> list[str]:
    """Our names of the Linears an FP8 export may quantize: every block's attention and MLP
    projection (not lm_head, which stays bf16 as in every FP8 serving recipe)."""
    return [n for n, m in _unwrap(model).named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]


@torch.no_grad()
def export_hf(model: torch.nn.Module, tokenizer: HFTokenizer | None, out_dir: str | os.PathLike, *,
              overwrite: bool = False, sources: Iterable[str | os.PathLike | None] = (),
              quantize: Quantize = "none", keep: Mapping[str, str] | None = None, quantize_all: bool = False,
              sqnr_floor_db: float = SQNR_FLOOR_DB, provenance: Mapping[str, Any] | None = None) -> Path:
    """Write `model` (and its tokenizer) as a Hugging Face model directory that
    `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` loads: config.json,
    model.safetensors, tokenizer files. Errors for architectures that do not map.

    Weights are plain fp32 by default. `quantize="fp8"` (or "fp8_block", "mxfp8") stores every block
    Linear in e4m3 with its scales for vLLM, SGLang and transformers, and the rest in bf16
    (nanochat.model.hf_fp8): `keep` (our layer name -> why) names Linears to leave in bf16, e.g. those the
    run trained in high precision; layers under `sqnr_floor_db` stay bf16 too, unless
    `quantize_all`. The per-layer report is logged and saved as fp8_report.json. `provenance`
    (what the weights were read from: a run's checkpoint and step) is saved as
    nanochat_export.json.

    `out_dir` must be new or empty, or `overwrite` (see `check_export_dir`, which also protects
    `sources`): the export is written to a temporary sibling directory, and replaces `out_dir`
    whole only once it is complete, so no file of an earlier export survives next to it."""
    check_export_dir(out_dir, overwrite=overwrite, sources=sources)
    if quantize != "none":
        require_compressed_tensors(f"--quantize {quantize}")
    gpt = _unwrap(model)
    hf_config = hf_config_from_gpt(gpt.config)
    if tokenizer is not None and not isinstance(tokenizer, HFTokenizer):
        raise TypeError(f"export_hf writes Hugging Face tokenizer files, got {type(tokenizer).__name__}; "
                        "pass the HFTokenizer the model was loaded with (or None for weights only)")
    if tokenizer is not None:
        hf_config.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
    tensors = {}
    for name, p in gpt.named_parameters():  # deduplicated: a tied lm_head is written once, as wte
        theirs = hf_name(name)
        assert theirs is not None, f"no Hugging Face name for {name}"
        # fp32 master weights: FP8 lives only inside the training matmuls
        tensors[theirs] = p.detach().to(device="cpu", dtype=torch.float32).contiguous()
    fp8 = None
    if quantize != "none":
        hf_module = lambda ours: hf_name(f"{ours}.weight").rpartition(".")[0]  # noqa: E731
        fp8 = quantize_checkpoint(tensors, [hf_module(n) for n in exportable_linears(gpt)], quantize=quantize,
                                  keep={hf_module(n): why for n, why in (keep or {}).items()},
                                  quantize_all=quantize_all, floor_db=sqnr_floor_db)
        tensors = fp8.tensors
        hf_config["torch_dtype"] = "bfloat16"  # what the unquantized tensors are stored in
        logger.info("fp8 export, per layer:\n%s\n%s", fp8.table(), fp8.summary())

    def fill(tmp: Path) -> None:
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        if provenance is not None:
            (tmp / PROVENANCE_NAME).write_text(json.dumps(dict(provenance), indent=2) + "\n")
        if fp8 is not None:
            fp8.write(tmp)
        if tokenizer is not None:
            tokenizer.save(tmp)
        else:
            logger.warning("export_hf: no tokenizer given, %s holds weights and config only", out_dir)

    return publish_directory(out_dir, fill)
