"""load_model: a GPT built from where its weights live, the one loader of the trainer,
scripts/eval.py and scripts/export_hf.py.

    load_model(resolve_model("d4"), vocab_size=4096, seq_len=256)   # a preset, freshly initialized
    load_model(resolve_model("org/name"), device="cuda")            # a Hugging Face directory's weights
    load_model(read_run("runs/sft"))                                # a run's newest checkpoint
    load_model(read_run("runs/base", step=200))                     # the one saved at step 200
    load_model(checkpointer.read_init_source(), ...)                # --init_from's checkpoint (.pt or DCP)

A source is what --model_name names (nanochat.model.hub.resolve_model: a preset, or a Hugging
Face directory, loaded by nanochat.model.hf) or a checkpoint already found and verified (`Saved`),
whose run's --model_name gives the architecture: the preset at the run's --seq_len with its
tokenizer's vocabulary, or the Hugging Face config the run fine-tuned. A checkpoint's weights
replace every parameter, so its model is allocated on the meta device first and never
initialized; a fresh preset is (GPT.init_weights, under the run's seed). `gpt_config` is the
configuration alone, before any weight exists: the trainer plans its memory with it. Weights
that do not fit the architecture, or hold inf/nan, are an error naming the flag they came from.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from nanochat.checkpoint import dcp, store
from nanochat.checkpoint.checkpointer import Saved
from nanochat.checkpoint.pt import PT, checkpoint_name
from nanochat.checkpoint.storage import Checkpoint
from nanochat.common import NanoChatError, UsageError
from nanochat.model.gpt import GPT, GPTConfig, preset_config
from nanochat.model.hf import gpt_config_from_hf, load_hf_model
from nanochat.model.hub import ResolvedModel, read_config_json, resolve_model
from nanochat.tokenizer import Tokenizer, run_tokenizer

Source = ResolvedModel | Saved

RUN_KEYS = ("config.model_name", "step", "model")
"""What a run's checkpoint must hold to be loaded as a model (`read_run`)."""


def read_run(run_dir: str | os.PathLike, flag: str = "--run_dir", *, step: int | None = None) -> Saved:
    """The newest checkpoint of `run_dir` (`step`: the one written at that step) with the tokenizer
    the run trained with (checked against the checkpoint: run_tokenizer), verified, errors naming
    `flag`: a .pt (store.load_checkpoint), its weights memory-mapped until `load_model` reads them,
    or a distributed run's DCP step (any layout: DDP, FSDP, TP), whose weights `load_model` reads
    whole from its shards."""
    if step is None:
        c = store.newest(run_dir, flag) if Path(run_dir).is_dir() else None
    else:
        c = _at_step(run_dir, step, flag)
    if c is not None and c.kind == "dcp":
        meta = store.read(c, flag, RUN_KEYS[:-1])
        tokenizer = run_tokenizer(run_dir, meta.get("tokenizer_fingerprint"), flag)
        return Saved(c, meta, tokenizer=tokenizer, weights=None, origin=f"{flag} {run_dir}")
    payload = store.load_checkpoint(run_dir if step is None else c.path, keys=RUN_KEYS, mmap=True, flag=flag)
    tokenizer = run_tokenizer(run_dir, payload.get("tokenizer_fingerprint"), flag)
    weights = payload.pop("model")
    return Saved(PT.at(Path(run_dir) / checkpoint_name(payload["step"])), payload, tokenizer=tokenizer,
                 weights=weights, origin=f"{flag} {run_dir}")


def _at_step(run_dir: str | os.PathLike, step: int, flag: str) -> Checkpoint:
    every = store.committed(run_dir) if Path(run_dir).is_dir() else []
    at = [c for c in every if c.step == step]
    if at:
        return at[-1]  # a step saved again after a resume: its newest save
    have = ", ".join(str(c.step) for c in every) or "none"
    raise UsageError(f"{flag} {run_dir} has no checkpoint of step {step} (steps saved: {have}); pick one of "
                     "those, or train with a --save_every that divides the step")


def gpt_config(source: Source, *, vocab_size: int | None = None, seq_len: int | None = None) -> GPTConfig:
    """The GPTConfig `load_model` builds for `source`. `seq_len` None: the source's own (a Hugging
    Face config's context length, a run's --seq_len); `vocab_size`: a fresh preset's (a
    checkpoint's is its tokenizer's)."""
    resolved = source if isinstance(source, ResolvedModel) else resolve_model(source.meta["config"]["model_name"])
    if resolved.kind == "hf":
        return gpt_config_from_hf(read_config_json(resolved.path), seq_len=seq_len)
    if isinstance(source, Saved):
        vocab_size = vocab_size or source.tokenizer.vocab_size
        seq_len = seq_len or source.meta["config"].get("seq_len")
        if seq_len is None:
            raise NanoChatError(f"{source.origin}: checkpoint {source.path} does not record the --seq_len its "
                                f"{resolved.name} model was trained with (config.seq_len); it was not written by "
                                "nanochat's trainer")
    return preset_config(resolved.name, vocab_size=vocab_size, seq_len=seq_len)


@torch.no_grad()
def load_model(source: Source, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               vocab_size: int | None = None, seq_len: int | None = None) -> tuple[GPT, Tokenizer | None]:
    """`source`'s GPT on `device`, its parameters in `dtype` (the rotary tables stay fp32), and the
    tokenizer its weights go with: a Hugging Face directory's, the run's; None for a fresh
    preset (it takes the corpus's). `vocab_size`, `seq_len`: as for `gpt_config`."""
    if isinstance(source, ResolvedModel) and source.kind == "hf":
        return load_hf_model(source.path, device, dtype, seq_len=seq_len)  # meta, then memory-mapped safetensors
    config = gpt_config(source, vocab_size=vocab_size, seq_len=seq_len)
    if isinstance(source, ResolvedModel):  # a fresh preset
        model = GPT(config).to(device)
        model.init_weights()
        return _cast(model, dtype), None
    with torch.device("meta"):
        model = GPT(config)
    model.materialize(device)
    _load_weights(source, model)
    return _cast(model, dtype), source.tokenizer


def _cast(model: GPT, dtype: torch.dtype) -> GPT:
    for p in model.parameters():  # parameters only: the rotary tables stay fp32
        p.data = p.data.to(dtype)
    return model


def _load_weights(saved: Saved, model: GPT) -> None:
    """`saved`'s weights into every parameter of `model`, checked finite; a .pt's memory map is
    released once they are copied."""
    try:
        if saved.checkpoint.kind == "dcp":
            dcp.load_weights(saved.path, model)
        else:  # a model saved inside torch.compile (`_orig_mod.`) or DDP (`module.`) has prefixed keys
            model.load_state_dict({re.sub(r"^(_orig_mod\.|module\.)+", "", k): v for k, v in saved.weights.items()})
    except NanoChatError:  # a checkpoint refused as it is read (a DCP index that is not one): said as it is
        raise
    except (RuntimeError, KeyError) as e:
        raise UsageError(f"{saved.origin}: its weights do not fit this {saved.meta['config']['model_name']} model "
                         f"({str(e).splitlines()[0]}); it was saved by another version of the model") from None
    saved.weights = None  # the memory-mapped checkpoint is closed with its last reference
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise NanoChatError(f"{saved.origin}: its checkpoint {saved.path} holds inf/nan in "
                            f"{', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}; start from one of its earlier "
                            "checkpoints (move this one away)")


__all__ = ["RUN_KEYS", "Source", "gpt_config", "load_model", "read_run"]
