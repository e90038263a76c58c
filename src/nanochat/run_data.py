"""RunData: everything a training run reads, from the corpus to the batches of each rank.

Built once, before any model exists, so that every data error comes before a weight is allocated:
the corpus (nanochat.data), the tokenizer that goes with the model, the token streams of both
splits, the multiple-choice items evaluation scores, and the loader whose position checkpoints
keep. Which tokenizer: a Hugging Face model brings its own (its embeddings know its ids); a run
started with --init_from brings its source run's (`tokenizer`, given), and keeps it in its own
run directory when resumed; otherwise --tokenizer_dir's, or one trained on the corpus (cached).
A base model has no chat template: instruction records are rendered in the plain format then.

Plain text is scored on every token; instruction records on their answers only (`*_mask`), each
record laid out whole inside the seq_len+1 windows (data.pack_records).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from nanochat import instruct
from nanochat.common import DistEnv, UsageError, logger
from nanochat.config import TrainConfig
from nanochat.data import (
    Corpus, TokenBatches, get_or_train_tokenizer, load_corpus, pack_records, tokenize_docs, tokenize_records,
    val_batches,
)
from nanochat.evaluation import describe_scoring
from nanochat.hf import HFTokenizer, ResolvedModel
from nanochat.tokenizer import Tokenizer


@dataclass
class RunData:
    """The data of one run, on this rank (see the module docstring)."""

    corpus: Corpus
    tokenizer: Tokenizer | HFTokenizer
    train_tokens: torch.Tensor
    val_tokens: torch.Tensor
    train_mask: torch.Tensor | None
    """Instruction data: True where a target token is scored; None for plain text."""
    val_mask: torch.Tensor | None
    choice_items: list[instruct.ChoiceItem]
    """This rank's share of the multiple-choice validation items (accuracy at every evaluation)."""
    num_choice_items: int
    """All ranks' items together."""
    accuracy_scoring: str | None
    """How the items' options are scored (evaluation.describe_scoring); None without items."""
    token_bytes: torch.Tensor
    """UTF-8 bytes of each token id, on the device: bits per byte."""
    loader: TokenBatches
    """The training batches (its position is checkpointed)."""
    steps_per_epoch: int
    """Optimizer steps in one pass over the training tokens."""

    @classmethod
    def load(cls, cfg: TrainConfig, *, dist: DistEnv, device: torch.device, model: ResolvedModel,
             tokenizer: Tokenizer | None, cache_root: Path, fallback: Callable[[str], None]) -> "RunData":
        """The run's data. `tokenizer`: the --init_from source's (None otherwise); `fallback`
        records and logs a fallback (a vocabulary smaller than asked, the plain chat format, a
        record longer than a window)."""
        tokenizer = tokenizer or _given_tokenizer(cfg, model)
        corpus = load_corpus(cfg.dataset_path)
        logger.info("corpus: %s", corpus.describe())
        if tokenizer is None:
            tokenizer = get_or_train_tokenizer(corpus, cfg.vocab_size, cache_root=cache_root / "tokenizers")
            if tokenizer.vocab_size < cfg.vocab_size:
                fallback(f"tokenizer: the corpus ran out of BPE merges at {tokenizer.vocab_size} tokens "
                         f"(--vocab_size {cfg.vocab_size} asked); training with the smaller vocabulary")
        instructions = corpus.kind == "instruct"
        tokenizer, template_fallback = instruct.choose_chat_template(tokenizer, cfg.chat_template, records=instructions)
        if template_fallback:
            fallback(template_fallback)
        cache = cache_root / "tokens"
        if instructions:  # loss on the assistant tokens only
            train_tokens, train_mask = _pack(tokenizer, "train", corpus.train_records, corpus.train_ids, cfg.seq_len,
                                             cache, fallback)
            val_tokens, val_mask = _pack(tokenizer, "val", corpus.val_records, corpus.val_ids, cfg.seq_len, cache,
                                         fallback)
        else:
            train_tokens = tokenize_docs(tokenizer, corpus.train_docs, cache_dir=cache)
            val_tokens = tokenize_docs(tokenizer, corpus.val_docs, cache_dir=cache)
            train_mask = val_mask = None
        items = instruct.choice_items(tokenizer, corpus.val_records, cfg.eval_tokens) if instructions else []
        loader = TokenBatches(train_tokens, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed,
                              rank=dist.rank, world_size=dist.world_size, loss_mask=train_mask)
        steps_per_epoch = loader.steps_per_epoch // cfg.grad_accum_steps
        if steps_per_epoch < 1:
            raise UsageError(f"one optimizer step needs {cfg.grad_accum_steps} batches but an epoch has only "
                             f"{loader.steps_per_epoch}; lower --grad_accum_steps or --batch_size")
        # what would otherwise fail once training has started: one evaluation window (val_batches
        # names the fix), the prompts of the samples
        next(iter(val_batches(val_tokens, cfg.seq_len, cfg.batch_size, cfg.eval_tokens, rank=dist.rank,
                              world_size=dist.world_size, loss_mask=val_mask)), None)
        for r in corpus.val_records[:cfg.num_samples] if instructions else []:
            instruct.generation_prompt(tokenizer, r)
        return cls(corpus=corpus, tokenizer=tokenizer, train_tokens=train_tokens, val_tokens=val_tokens,
                   train_mask=train_mask, val_mask=val_mask, choice_items=items[dist.rank::dist.world_size],
                   num_choice_items=len(items), accuracy_scoring=describe_scoring(items) if items else None,
                   token_bytes=tokenizer.token_bytes().to(device), loader=loader, steps_per_epoch=steps_per_epoch)


def _given_tokenizer(cfg: TrainConfig, model: ResolvedModel) -> Tokenizer | HFTokenizer | None:
    """The tokenizer the run must use, loaded before the corpus; None: train one on it."""
    if cfg.init_from is not None and cfg.resume:  # the tokenizer this run started with (the source may be gone)
        return Tokenizer.load(Path(cfg.run_dir) / "tokenizer")
    if model.kind == "hf":
        return HFTokenizer.load(model.path)
    if cfg.tokenizer_dir:
        return Tokenizer.load(cfg.tokenizer_dir)
    return None


def _pack(tokenizer: Any, split: str, records: list, ids: list, seq_len: int, cache: str | os.PathLike,
          fallback: Callable[[str], None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Instruction records laid out whole inside the seq_len+1 windows: tokens and loss mask."""
    tokens, mask, starts = tokenize_records(tokenizer, records, cache_dir=cache, ids=ids, with_starts=True)
    tokens, mask, packing = pack_records(tokens, mask, starts, seq_len, tokenizer.bos_id)
    logger.info("%s records: %d packed into windows of %d tokens, %.1f%% padding", split,
                packing.records, seq_len + 1, packing.pad_pct)
    if packing.long_records:
        fallback(f"instruction data: {packing.long_records} of {packing.records} {split} records are "
                 f"longer than a window (--seq_len {seq_len} + 1 tokens); their tokens past the first window "
                 "are trained without the record's beginning. Raise --seq_len to keep them whole")
    return tokens, mask


__all__ = ["RunData"]
