"""Evaluation: validation loss and bits per byte, multiple-choice accuracy, samples; and a saved
model evaluated on a dataset without training.

`loss_and_bpb` is the one validation loss: the run (`Evaluator`, at every evaluation) and
`scripts/eval.py` (`evaluate_saved`) both call it, on the same windows (`val_batches`:
--eval_tokens in windows spread evenly over the validation stream, records packed as training
packs them), so eval.py on a finished run reproduces its result.json. Bits per byte divide the
nats by the UTF-8 bytes the scored tokens stand for: comparable across tokenizers. A run measures
in high precision on the uncompiled model (the figure is the model's quality, not FP8's inference
noise); under torchrun every rank scores its share and the sums are all-reduced.

Multiple choice: each option is scored by the log-likelihood of its answer tokens after the shared
prompt (`instruct.choice_items`) and the best option is the prediction (lm-evaluation-harness's
convention); a letter may take more than one token, so the letters' logits at one position are
not enough in general. Every option's first token is read at the prompt's end, where the softmax
normalizer is the same for all and is left out: with one token per option this is the letters'
logits compared (karpathy/nanochat's categorical evaluation) bit for bit. A row is the prompt
plus an option's tokens but its last (shared by options equal but for their last token),
right-padded (the model is causal); a row longer than the context keeps its last `seq_len`
tokens. Deterministic. The long form: docs/instruct.md.
"""

from __future__ import annotations

import contextlib
import math
import os
from itertools import islice
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from nanochat import engine
from nanochat.checkpoint import Saved, load_model, read_run
from nanochat.common import UsageError, logger
from nanochat.device import autocast_context, resolve_device, resolve_dtype
from nanochat.data import instruct
from nanochat.data.batches import val_batches
from nanochat.data.sources import list_sources
from nanochat.data.streams import TokenStream
from nanochat.model.gpt import GPT
from nanochat.model.hub import resolve_model
from nanochat.parallel.layout import Layout
from nanochat.parallel.process_group import all_reduce_sum
from nanochat.parallel.wrap import full_copy
from nanochat.tokenizer import Tokenizer
from nanochat.train.run_data import EvalData

if TYPE_CHECKING:
    from nanochat.config import EvalConfig, TrainConfig
    from nanochat.fp8 import FP8Training
    from nanochat.train.run_data import RunData


@torch.no_grad()
def loss_and_bpb(model: torch.nn.Module, val: TokenStream, token_bytes: torch.Tensor, *, seq_len: int,
                 batch_size: int, eval_tokens: int, device: torch.device, autocast: Any = None,
                 layout: Layout = Layout()) -> tuple[float, float, int]:
    """Validation loss (nats per scored token), bits per byte and the tokens scored, over
    `eval_tokens` of `val` in windows of `seq_len` spread over it (`val_batches`); the caller sets eval
    mode and precision (`autocast`). Under a distributed `layout` each data-parallel rank scores
    its batches and the sums are all-reduced. `token_bytes`: each token id's UTF-8 bytes, on
    `device`."""
    rank, world_size = layout.dp_rank, layout.dp_size
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # [nats, scored tokens, bytes]
    with autocast if autocast is not None else contextlib.nullcontext():
        for x, y in val_batches(val, seq_len, batch_size, eval_tokens, rank=rank, world_size=world_size):
            x, y = x.to(device), y.to(device)
            loss = model(x, y, reduction="none").view(-1).double()
            y = y.view(-1)
            scored = y >= 0  # -1: a position the loss mask excludes (instruction prompts)
            nbytes = token_bytes[y.clamp(min=0)] * scored
            # text: special tokens (BOS) carry no bytes and are not scored; records: every scored
            # target counts, the closing <|end|>/eos included (stopping is part of the answer)
            counted = scored if val.has_mask else nbytes > 0
            totals[0] += torch.where(counted, loss, 0.0).sum()
            totals[1] += counted.sum()
            totals[2] += nbytes.sum()
    total_nats, total_tokens, total_bytes = all_reduce_sum(totals).tolist()
    if total_tokens == 0:
        raise ValueError("validation split has no scorable tokens; use a larger --dataset_path")
    return total_nats / total_tokens, total_nats / (math.log(2) * total_bytes), int(total_tokens)


class Evaluator:
    """A training run's measurements of `model` on `data` (see the module docstring). `eager`
    is the context that runs compiled code eagerly (blocks compiled in place)."""

    def __init__(self, model: torch.nn.Module, data: RunData, cfg: TrainConfig, *, layout: Layout,
                 device: torch.device, autocast: Any, fp8: FP8Training, eager: Callable[[], Any]):
        self.model, self.data, self.cfg = model, data, cfg
        self.layout, self.device, self.autocast = layout, device, autocast
        self.fp8, self.eager = fp8, eager

    def all(self) -> tuple[float, float, float | None]:
        """Validation loss, bits per byte and multiple-choice accuracy (None without items)."""
        val_loss, val_bpb = self.loss()
        return val_loss, val_bpb, self.accuracy()

    def loss(self) -> tuple[float, float]:
        """Validation loss (nats/token) and bits per byte over --eval_tokens (`loss_and_bpb`)."""
        cfg = self.cfg
        with self._model() as model:
            val_loss, val_bpb, _ = loss_and_bpb(model, self.data.val, self.data.token_bytes, seq_len=cfg.seq_len,
                                                batch_size=cfg.batch_size, eval_tokens=cfg.eval_tokens,
                                                device=self.device, autocast=self.autocast, layout=self.layout)
        return val_loss, val_bpb

    @torch.no_grad()
    def accuracy(self) -> float | None:
        """Multiple-choice accuracy on the validation records; None without multiple-choice items."""
        if not self.data.num_choice_items:
            return None
        with self._model() as model:
            correct, total = choice_counts(model, self.data.choice_items, batch_size=self.cfg.batch_size,
                                           seq_len=self.cfg.seq_len, device=self.device, autocast=self.autocast)
        counts = all_reduce_sum(torch.tensor([correct, total], dtype=torch.float64, device=self.device))
        correct, total = counts.tolist()
        return correct / total

    def samples(self, num_samples: int) -> list[str]:
        """Continue the first tokens of a few validation documents (or the conversations up to
        their last answer); on rank 0 only (the other ranks return [])."""
        cfg, store, tok = self.cfg, self.data.store, self.data.tokenizer
        if store.kind == "instruct":
            prompts = [instruct.generation_prompt(tok, r) for r in islice(store.val_records(), num_samples)]
        else:  # the first 16 tokens of the first validation documents (BOS included)
            prompts = store.val.doc_prefixes(num_samples, 16)
        out = []
        with self._model() as model, self.autocast:
            for i, ids in enumerate(prompts if self.layout.rank == 0 else []):
                gen = engine.generate(model, ids, max_new_tokens=cfg.sample_tokens, temperature=cfg.temperature,
                                      top_k=cfg.top_k, seed=cfg.seed + i)
                # generate() returns only the new tokens; show the prompt with its continuation
                out.append(tok.decode([t for t in ids + gen if t != tok.bos_id]))
        return out

    @contextlib.contextmanager
    def _model(self):
        """The model in eval mode and high precision. One process and DDP: the model itself
        (unwrapped, so no collectives) with its FP8 layers in high precision. FSDP and TP: a plain,
        unsharded copy gathered from the shards (collective: every rank enters; `full_copy`)."""
        if self.layout.sharded:
            with torch.device("meta"):
                plain = GPT(self.model.config)
            plain = full_copy(self.model, plain.materialize(self.device))
            yield plain.eval()
            return
        was_training = self.model.training
        self.model.eval()
        try:
            with self.fp8.high_precision(), self.eager():
                yield self.model
        finally:
            self.model.train(was_training)


@torch.no_grad()
def choice_counts(model: torch.nn.Module, items: list[instruct.ChoiceItem], *, batch_size: int, seq_len: int,
                  device: torch.device | str, autocast: Any = None) -> tuple[int, int]:
    """(correct, total) over `items` (see the module docstring); `batch_size` rows per forward,
    one device read per batch; the caller sets eval mode and precision. Counts rather than a
    ratio, so ranks can sum theirs."""
    correct = 0
    for batch in _row_batches(items, batch_size):
        rows: list[list[int]] = []
        reads: list[tuple[int, int, int, int, int]] = []  # (row, position, token, option slot, token index)
        n_opts = max(len(it.options) for it in batch)
        for i, it in enumerate(batch):
            row_of: dict[tuple[int, ...], int] = {}
            for k, option in enumerate(it.options):
                if len(option) >= seq_len:
                    raise ValueError(f"an option of {len(option)} tokens does not fit a context of seq_len "
                                     f"{seq_len} with its prompt; raise --seq_len")
                lead = tuple(option[:-1])
                if lead not in row_of:
                    row_of[lead] = len(rows)
                    rows.append((it.prompt + list(lead))[-seq_len:])
                r = row_of[lead]
                first = len(rows[r]) - len(option)  # the position whose logits predict option[0]
                reads += [(r, first + j, tok, i * n_opts + k, j) for j, tok in enumerate(option)]
        lengths = [len(row) for row in rows]
        x = torch.zeros(len(rows), max(lengths), dtype=torch.int64)
        for r, row in enumerate(rows):
            x[r, :len(row)] = torch.tensor(row)
        with autocast if autocast is not None else contextlib.nullcontext():
            logits = model(x.to(device))                                      # (rows, T, V)
        row, pos, tok, slot, j = (torch.tensor(c, device=logits.device) for c in zip(*reads))
        picked = logits[row, pos].float()                                     # (reads, V)
        terms = picked.gather(1, tok[:, None]).squeeze(1)                     # the tokens' logits
        terms = torch.where(j == 0, terms, terms - picked.logsumexp(dim=1))   # later tokens: log-probs
        # (option slot, token index) table summed along its rows: the same sum in the same order on
        # every device (no atomic adds); zeros pad short options, -inf the slots no option fills
        longest = max(len(option) for it in batch for option in it.options)
        table = torch.zeros(len(batch) * n_opts, longest, device=logits.device)
        table[slot, j] = terms
        filled = torch.zeros(len(batch) * n_opts, dtype=torch.bool, device=logits.device)
        filled[slot] = True
        scores = table.sum(dim=1).masked_fill(~filled, -math.inf)
        answers = torch.tensor([it.answer for it in batch], device=logits.device)
        correct += int((scores.view(len(batch), n_opts).argmax(dim=1) == answers).sum())
    return correct, len(items)


def _row_batches(items: list[instruct.ChoiceItem], batch_size: int):
    """`items` in consecutive groups of at most `batch_size` rows (at least one question each)."""
    batch, rows = [], 0
    for it in items:
        n = len({tuple(option[:-1]) for option in it.options})
        if batch and rows + n > batch_size:
            yield batch
            batch, rows = [], 0
        batch.append(it)
        rows += n
    if batch:
        yield batch


# ------------------------------------------------------------------ a saved model: scripts/eval.py
@dataclass
class EvalResult:
    """What `scripts/eval.py` reports."""

    val_loss: float
    """Validation loss, nats per scored token (answer tokens only for instruction records):
    `loss_and_bpb`, as the run computes it."""
    val_bpb: float
    """Validation bits per byte (the run's `val_bpb`)."""
    val_accuracy: float | None
    """Multiple-choice accuracy; None when the validation split has no multiple-choice records."""
    tokens: int = 0
    """Validation tokens scored."""
    questions: int = 0
    """Multiple-choice questions scored."""
    accuracy_scoring: str | None = None
    """How the options were scored (`instruct.describe_scoring`); None without multiple-choice records."""
    fallbacks: list[str] = field(default_factory=list)
    source: str = ""
    """What was evaluated: a run's checkpoint file and its step, or a model directory."""
    step: int | None = None
    """The step of the run's checkpoint that was evaluated; None for a model as loaded."""


def load_saved(cfg: EvalConfig, device: torch.device,
               saved: Saved | None = None) -> tuple[GPT, Tokenizer, Saved | None]:
    """(model, tokenizer, checkpoint) of --run_dir's newest checkpoint (`saved` when already
    read), with the tokenizer it trained with (checked: `read_run`); or of --model_name's Hugging
    Face directory as loaded (no checkpoint). nanochat.checkpoint.load_model builds both."""
    if cfg.run_dir is None:
        resolved = resolve_model(cfg.model_name)
        if resolved.kind != "hf":
            raise UsageError(f"--model_name {cfg.model_name!r} is a nanochat preset, untrained; evaluate a "
                             "run of it instead (--run_dir)")
        model, tok = load_model(resolved, device=device, seq_len=cfg.seq_len)
        return model, tok, None
    saved = saved if saved is not None else read_run(cfg.run_dir)
    model, tok = load_model(saved, device=device)
    return model, tok, saved


@torch.no_grad()
def evaluate_saved(cfg: EvalConfig) -> EvalResult:
    """`scripts/eval.py` with an `EvalConfig`: the validation split's loss, bits per byte and
    accuracy as a run measures them, read from the corpus's token store for the model's
    tokenizer (built first if missing: EvalData, the run's own data assembly); the corpus is
    --dataset_path, or the run's own."""
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    # a path that cannot be a corpus: one error before the checkpoint is read and the model loads
    dataset_path = cfg.dataset_path
    if dataset_path is not None:
        list_sources(dataset_path)
    saved = read_run(cfg.run_dir) if cfg.run_dir is not None else None
    if dataset_path is None:  # the run's own corpus
        dataset_path = saved.meta["config"].get("dataset_path")
        if dataset_path is not None and not os.path.exists(dataset_path):
            raise UsageError(f"the run trained on --dataset_path {dataset_path}, which is not there from "
                             f"{os.getcwd()}; give --dataset_path")
        list_sources(dataset_path)
    model, tok, saved = load_saved(cfg, device, saved)
    source = f"{saved.path} (step {saved.step})" if saved is not None else str(cfg.model_name)
    logger.info("evaluating %s", source)  # once the model loaded: an error is the only line
    seq_len = min(cfg.seq_len, model.config.seq_len)
    trained = saved.meta["config"] if saved is not None else {}
    asked = {"seq_len": seq_len, "eval_tokens": cfg.eval_tokens, "packing": cfg.packing}
    differ = [f"--{k} {trained[k]}" for k in asked if k in trained and trained[k] != asked[k]]
    if differ:
        logger.info("the run evaluated with %s: pass the same to reproduce its val_loss and val_bpb", " ".join(differ))
    fallbacks: list[str] = []

    def fallback(message: str) -> None:
        fallbacks.append(message)
        logger.warning("WARNING: %s", message)

    data = EvalData.load(dataset_path, tokenizer=tok, seq_len=seq_len, eval_tokens=cfg.eval_tokens, device=device,
                         fallback=fallback, chat_template=cfg.chat_template, packing=cfg.packing)
    model.eval()
    context = autocast_context(device, dtype)
    val_loss, val_bpb, tokens = loss_and_bpb(model, data.val, data.token_bytes, seq_len=seq_len,
                                             batch_size=cfg.batch_size, eval_tokens=cfg.eval_tokens,
                                             device=device, autocast=context)
    accuracy = None
    if data.choice_items:
        correct, total = choice_counts(model, data.choice_items, batch_size=cfg.batch_size, seq_len=seq_len,
                                       device=device, autocast=context)
        accuracy = correct / total
    return EvalResult(val_loss=val_loss, val_bpb=val_bpb, val_accuracy=accuracy, tokens=tokens,
                      questions=data.num_choice_items, accuracy_scoring=data.accuracy_scoring, fallbacks=fallbacks,
                      source=source, step=saved.step if saved is not None else None)


__all__ = ["EvalResult", "Evaluator", "choice_counts", "evaluate_saved", "load_saved", "loss_and_bpb"]
