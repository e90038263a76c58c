"""RunData: everything a training run reads, from the corpus to the batches of each rank; its
part EvalData, what a model is measured on, is all scripts/eval.py reads.

Built once, before any model exists (eval.py: once its model has loaded), so that every data
error comes before a weight is allocated. It goes one way, each step in its own module:
  tokenizer       the one the model needs (`given_tokenizer`), or None: trained on the corpus
  token store     nanochat.data.prepare.prepare_data in nanochat's cache (common.cache_root):
                  sources listed, tokenizer trained if none was given, the corpus tokenized once
                  (memory-mapped by every run and rank)
  evaluation      EvalData: the validation stream, the multiple-choice items
                  (nanochat.data.instruct) and each token's bytes
  batches         RunData: nanochat.data.batches's training stream (records packed into
                  windows), the loader whose position checkpoints keep, one evaluation window checked
Which tokenizer: a Hugging Face model brings its own (its embeddings know its ids); a run
started with --init_from brings its source run's (given), and keeps it in its own run directory
when resumed; otherwise --tokenizer_dir's, or one trained on the corpus (cached). A base model
has no chat template: instruction records are rendered in the plain format then.

Plain text is scored on every token; instruction records on their answers only (the streams'
loss masks). A --resume reads the listing of the corpus its run started on (`sources.json` in
the run directory) and refuses a corpus that changed since, naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from itertools import islice
from pathlib import Path
from typing import Any, Callable

import torch

from nanochat.common import UsageError, cache_root, logger
from nanochat.config import TrainConfig
from nanochat.data import instruct
from nanochat.data.batches import Packing, TokenBatches, split_stream, val_batches
from nanochat.data.prepare import CHANGES_FILE, prepare_data, recorded_sources
from nanochat.data.sources import Sources
from nanochat.data.token_store import TokenStore
from nanochat.data.streams import TokenStream
from nanochat.model.hub import ResolvedModel
from nanochat.parallel.layout import Layout
from nanochat.tokenizer import BPETokenizer, HFTokenizer, Tokenizer


@dataclass(kw_only=True)
class EvalData:
    """What a model is measured on, on this rank: a run's evaluations and scripts/eval.py's."""

    sources: Sources
    """The corpus's files as this run found them (recorded in the run directory at a fresh start)."""
    store: TokenStore
    tokenizer: Tokenizer
    val: TokenStream
    """The validation stream (instruction records: packed into windows, with the loss mask)."""
    choice_items: list[instruct.ChoiceItem]
    """This rank's share of the multiple-choice validation items (accuracy at every evaluation)."""
    num_choice_items: int
    """All ranks' items together."""
    accuracy_scoring: str | None
    """How the items' options are scored (instruct.describe_scoring); None without items."""
    token_bytes: torch.Tensor
    """UTF-8 bytes of each token id, on the device: bits per byte."""

    @classmethod
    def load(cls, dataset_path: str | None, *, tokenizer: Tokenizer | None, seq_len: int, eval_tokens: int,
             device: torch.device, fallback: Callable[[str], None], vocab_size: int = 4096,
             chat_template: str | None = None, resume: bool = False, recorded: dict[str, Any] | None = None,
             changes_file: Path | None = None, rank: int = 0, world_size: int = 1,
             run_dir: str | None = None, packing: Packing = "stream") -> EvalData:
        """The corpus at `dataset_path` for `tokenizer` (None: one trained on it, `vocab_size`),
        read from its token store in the cache (nanochat.common.cache_root; built if missing),
        down to what evaluation scores. `resume`, `recorded`, `changes_file`, `run_dir`: prepare_data's;
        `packing`: how plain text is cut into windows (batches.split_stream)."""
        # tokenizer -> token store
        prepared = prepare_data(dataset_path, tokenizer=tokenizer, vocab_size=vocab_size, chat_template=chat_template,
                                cache_root=cache_root(), resume=resume, recorded=recorded, changes_file=changes_file,
                                run_dir=run_dir)
        store, tokenizer = prepared.store, prepared.tokenizer
        for message in prepared.fallbacks:
            fallback(message)
        logger.info("corpus: %s", store.describe())
        # -> the validation stream and what evaluation scores
        val = split_stream(store, "val", seq_len, tokenizer.bos_id, fallback, packing)
        items = instruct.choice_items(tokenizer, store.val_records(), eval_tokens) if store.kind == "instruct" else []
        return cls(sources=prepared.sources, store=store, tokenizer=tokenizer, val=val,
                   choice_items=items[rank::world_size], num_choice_items=len(items),
                   accuracy_scoring=instruct.describe_scoring(items) if items else None,
                   token_bytes=tokenizer.token_bytes().to(device))


@dataclass(kw_only=True)
class RunData(EvalData):
    """The data of one run, on this rank (see the module docstring): what evaluation reads, and
    the training batches."""

    train: TokenStream
    """The training stream (instruction records: packed into windows, with the loss mask)."""
    loader: TokenBatches
    """The training batches (its position is checkpointed)."""
    steps_per_epoch: int
    """Optimizer steps in one pass over the training tokens."""

    @classmethod
    def load(cls, cfg: TrainConfig, *, layout: Layout, device: torch.device, model: ResolvedModel,
             tokenizer: Tokenizer | None, fallback: Callable[[str], None], resume: bool) -> RunData:
        """The run's data. `tokenizer`: the --init_from source's (None otherwise); `fallback`
        records and logs a fallback (a vocabulary smaller than asked, the plain chat format, a
        record longer than a window); `resume`: the run continues from a checkpoint (--resume,
        or --auto_resume's decision)."""
        data = EvalData.load(cfg.dataset_path, tokenizer=tokenizer or given_tokenizer(cfg, model, resume=resume),
                             seq_len=cfg.seq_len, eval_tokens=cfg.eval_tokens, device=device, fallback=fallback,
                             vocab_size=cfg.vocab_size, chat_template=cfg.chat_template, resume=resume,
                             recorded=recorded_sources(cfg.run_dir) if resume else None,
                             changes_file=Path(cfg.run_dir) / CHANGES_FILE, rank=layout.dp_rank,
                             world_size=layout.dp_size, run_dir=cfg.run_dir, packing=cfg.packing)
        # -> batches
        train = split_stream(data.store, "train", cfg.seq_len, data.tokenizer.bos_id, fallback, cfg.packing)
        loader = TokenBatches(train, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed,
                              rank=layout.dp_rank, world_size=layout.dp_size,  # a TP group reads one share
                              packing=cfg.packing)
        steps_per_epoch = loader.steps_per_epoch // cfg.grad_accum_steps
        if steps_per_epoch < 1:
            raise UsageError(f"one optimizer step needs {cfg.grad_accum_steps} batches but an epoch has only "
                             f"{loader.steps_per_epoch}; lower --grad_accum_steps or --batch_size")
        # what would otherwise fail once training has started: one evaluation window (val_batches
        # names the fix), the prompts of the samples
        next(iter(val_batches(data.val, cfg.seq_len, cfg.batch_size, cfg.eval_tokens, rank=layout.dp_rank,
                              world_size=layout.dp_size)), None)
        records = data.store.kind == "instruct"
        for r in islice(data.store.val_records(), cfg.num_samples) if records else []:
            instruct.generation_prompt(data.tokenizer, r)
        return cls(**{f.name: getattr(data, f.name) for f in fields(EvalData)}, train=train, loader=loader,
                   steps_per_epoch=steps_per_epoch)


def given_tokenizer(cfg: TrainConfig, model: ResolvedModel, *, resume: bool) -> Tokenizer | None:
    """The tokenizer the run must use, loaded before the corpus; None: train one on it."""
    if cfg.init_from is not None and resume:  # the tokenizer this run started with (the source may be gone)
        return BPETokenizer.load(Path(cfg.run_dir) / "tokenizer")
    if model.kind == "hf":
        return HFTokenizer.load(model.path)
    if cfg.tokenizer_dir:
        return BPETokenizer.load(cfg.tokenizer_dir)
    return None


__all__ = ["EvalData", "RunData", "given_tokenizer"]
