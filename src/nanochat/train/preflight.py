"""Before a run does any work: its process layout, the machine and the files it needs, checked.

The config classes (nanochat.config) check values on their own: a batch size is positive, an FP8
mode exists, --resume and --overwrite exclude each other. What they cannot know is the world the
run lands in: how many processes torchrun started, which device this is and what it can do,
which paths exist, what a model name names, which trackers (--log) and plotting (--plot) import,
how much disk is free. `check_layout` decides the process layout first, once: every part built
after it reads the value. `check_environment` asks the rest before the corpus is read or a
tokenizer trained (the run directory is claimed in between, nanochat.checkpoint), so each
mistake is one `error:` line and the only output (a NanoChatError; UsageError, exit 2, for what
the command line can fix).
`check_disk` runs once the run directory exists (with --overwrite, emptied) and a checkpoint's
size is known, before the first step. What only the data or a checkpoint can tell (a corpus too
small for one step, a checkpoint of another model) is refused where it is read, also before it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import torch

from nanochat.common import DistEnv, NanoChatError, UsageError, format_bytes, warn_once
from nanochat.config import TrainConfig
from nanochat.checkpoint import gpt_config
from nanochat.model.hub import ResolvedModel, resolve_model
from nanochat.model.parallelize import tp_problem
from nanochat.parallel.layout import Layout, plan_layout
from nanochat.data.instruct import own_tokenizer_template_problem
from nanochat.report.plot import check_can_draw
from nanochat.report.trackers import check_trackers


def check_layout(cfg: TrainConfig, env: DistEnv) -> Layout:
    """The run's process layout: --fsdp and --tp on the ranks torchrun started (`env`), decided
    here once (nanochat.parallel.layout); a world that cannot form it, --optimizer_in_backward
    under torchrun, or NorMuon on shards is refused."""
    layout = plan_layout(env, fsdp=cfg.fsdp, tp=cfg.tp)
    torchrun = layout.name if layout.distributed else None
    problem = cfg.in_backward_problem(torchrun=torchrun)
    if problem is not None:
        raise UsageError(problem)
    if cfg.optimizer == "muon" and cfg.muon_normuon and (cfg.fsdp or cfg.tp > 1):
        raise UsageError(f"--muon_normuon with {'--fsdp' if cfg.fsdp else f'--tp {cfg.tp}'}: NorMuon normalizes each "
                         "neuron over its whole row or column, which a shard does not hold; drop --muon_normuon, "
                         "or train in one process or under DDP")
    return layout


def check_environment(cfg: TrainConfig, layout: Layout, device: torch.device, dtype: torch.dtype, *,
                      resume: bool) -> ResolvedModel:
    """Every check of the device, the model under the process `layout` and the input paths
    (`resume`: the run continues from a checkpoint, so --init_from's source is no longer read);
    returns what --model_name names (a preset or a Hugging Face directory)."""
    if cfg.fp8 and dtype != torch.float32 and device.type != "cuda":
        raise UsageError(
            f"--fp8 with --dtype {cfg.dtype} on {device.type}: torchao's FP8 layers only support bf16 "
            "autocast on CUDA (elsewhere they would round outputs to the wrong dtype). Use --dtype float32 "
            "(the default off CUDA) with --fp8; --fp8_opt_level alone works with any dtype.")
    resolved = resolve_model(cfg.model_name)
    if layout.tp > 1:  # the heads do not depend on the vocabulary, which the corpus decides later
        model = gpt_config(resolved, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len)
        if (problem := tp_problem(model, layout.tp)) is not None:
            raise UsageError(problem)
    if resolved.kind == "hf" and cfg.tokenizer_dir:
        raise UsageError(f"--tokenizer_dir cannot be combined with the Hugging Face model {cfg.model_name!r}: "
                         "its own tokenizer (in the checkpoint directory) is the one its embeddings know")
    default_vocab = next(f.default for f in dataclasses.fields(cfg) if f.name == "vocab_size")
    if resolved.kind == "hf" and cfg.vocab_size != default_vocab:
        warn_once(f"vocab-size-hf:{cfg.model_name}:{cfg.vocab_size}",
                  f"--vocab_size {cfg.vocab_size} does not apply to the Hugging Face model {cfg.model_name!r} and "
                  "is ignored: its own tokenizer (in the checkpoint directory) sets the vocabulary; drop --vocab_size")
    if resolved.kind == "preset" and cfg.chat_template is not None:  # nanochat's tokenizer, never a template
        raise UsageError(own_tokenizer_template_problem(cfg.chat_template))
    if cfg.dataset_path is not None and _inside(cfg.run_dir, cfg.dataset_path):
        raise UsageError(f"--run_dir {cfg.run_dir} is inside --dataset_path {cfg.dataset_path}: the run's own files "
                         "(metrics.jsonl, checkpoints, tokenizer) would become training data, and a --resume would "
                         "read a corpus that changed; choose a --run_dir outside the corpus")
    if cfg.tokenizer_dir and not Path(cfg.tokenizer_dir).is_dir():
        raise UsageError(f"--tokenizer_dir {cfg.tokenizer_dir}: no such directory; make one with: python "
                         f"scripts/tok_train.py --tokenizer_dir {cfg.tokenizer_dir}")
    if cfg.init_from is not None and not resume and not Path(cfg.init_from).is_dir():
        raise UsageError(f"--init_from {cfg.init_from}: no such directory; give the --run_dir of a finished run")
    check_trackers(cfg.log, cfg.run_dir)
    if cfg.plot:  # matplotlib, and no foreign run.png in the way: known now, not after training
        check_can_draw(Path(cfg.run_dir), flag="--plot")
    return resolved


def _inside(path: str | os.PathLike, directory: str | os.PathLike) -> bool:
    """Whether `path` (existing or not) is `directory` or lies under it, links resolved."""
    inner, outer = Path(os.path.realpath(path)), Path(os.path.realpath(directory))
    return inner == outer or outer in inner.parents


def check_disk(run_dir: str | os.PathLike, need: int) -> None:
    """Room on --run_dir's disk for one more checkpoint of `need` bytes (the new one is complete
    before older ones are deleted)."""
    free = shutil.disk_usage(run_dir).free
    if free < need:
        raise NanoChatError(f"--run_dir {run_dir}: {format_bytes(free)} free on its disk, one checkpoint needs about "
                            f"{format_bytes(need)}; free space or choose a --run_dir on another disk")


__all__ = ["check_disk", "check_environment", "check_layout"]
