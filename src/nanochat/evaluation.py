"""Multiple-choice accuracy, and evaluating a saved model on a dataset without training.

Accuracy is measured the way karpathy/nanochat's categorical evaluation does it: the question is
rendered up to the answer (`nanochat.instruct.choice_items`), one forward pass gives the logits
at the answer position, and the prediction is the option whose letter has the largest logit
among the options' letters only (not over the whole vocabulary: a model that would rather say
"The" than a letter still has a preference between A and D, and that preference is what is
measured). No sampling, no parsing of generated text: deterministic, one forward per question.

Prompts of a batch are right-padded to the longest one; the model is causal, so the padding,
which comes after the answer position, cannot change the logits there. A prompt longer than the
model's context keeps its last `seq_len` tokens (the options and `Answer:` are at the end).

`evaluate_saved` is `scripts/eval.py`: a run's checkpoint (or a Hugging Face directory as
loaded), a dataset's validation split, its loss and its accuracy.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nanochat import instruct
from nanochat.common import UsageError, logger


@torch.no_grad()
def choice_counts(model: torch.nn.Module, items: list[instruct.ChoiceItem], *, batch_size: int, seq_len: int,
                  device: torch.device | str, autocast: Any = None) -> tuple[int, int]:
    """(correct, total) over `items` (see the module docstring); the caller sets eval mode and
    precision. Counts rather than a ratio, so ranks can sum theirs."""
    correct = 0
    for start in range(0, len(items), batch_size):
        batch = items[start:start + batch_size]
        prompts = [it.prompt[-seq_len:] for it in batch]
        lengths = torch.tensor([len(p) for p in prompts])
        x = torch.zeros(len(batch), int(lengths.max()), dtype=torch.int64)
        for i, p in enumerate(prompts):
            x[i, :len(p)] = torch.tensor(p)
        n_opts = max(len(it.candidates) for it in batch)
        cand = torch.tensor([it.candidates + [it.candidates[0]] * (n_opts - len(it.candidates)) for it in batch])
        valid = torch.tensor([[k < len(it.candidates) for k in range(n_opts)] for it in batch])
        with autocast if autocast is not None else contextlib.nullcontext():
            logits = model(x.to(device))                                   # (B, T, V)
        last = logits[torch.arange(len(batch)), (lengths - 1).to(logits.device)].float()  # (B, V)
        scores = last.gather(1, cand.to(last.device)).masked_fill(~valid.to(last.device), -math.inf)
        answers = torch.tensor([it.answer for it in batch], device=last.device)
        correct += int((scores.argmax(dim=1) == answers).sum())
    return correct, len(items)


@dataclass
class EvalResult:
    """What `scripts/eval.py` reports."""

    val_loss: float
    """Validation loss, nats per scored token (answer tokens only for instruction records)."""
    val_accuracy: float | None
    """Multiple-choice accuracy; None when the validation split has no multiple-choice records."""
    questions: int = 0
    """Multiple-choice questions scored."""
    fallbacks: list[str] = field(default_factory=list)


def load_saved(run_dir: str | None, model_name: str | None, device: torch.device, seq_len: int):
    """(model, tokenizer) of a run directory's checkpoint, or of a Hugging Face directory."""
    from nanochat.gpt import GPT, preset_config
    from nanochat.hf import load_hf_model, model_from_state_dict, resolve_model
    from nanochat.tokenizer import Tokenizer

    if run_dir is None:
        resolved = resolve_model(model_name)
        if resolved.kind != "hf":
            raise UsageError(f"--model_name {model_name!r} is a nanochat preset, untrained; evaluate a "
                             "run of it instead (--run_dir)")
        model, tok = load_hf_model(resolved.path, device, torch.float32, seq_len=seq_len)
        return model, tok
    from nanochat.checkpoint import load_checkpoint

    try:
        import nanochat.fp8.tensor  # noqa: F401  registers FP8 optimizer-state tensors for weights_only loading
    except ImportError:
        pass
    ckpt = load_checkpoint(run_dir)
    name, tok_dir = ckpt["config"]["model_name"], Path(run_dir) / "tokenizer"
    if not tok_dir.is_dir():
        raise UsageError(f"--run_dir {run_dir}: its tokenizer/ is missing, and the weights mean something only "
                         "with the tokenizer they were trained with; restore it from the run")
    model = None
    if resolve_model(name).kind == "hf":
        model, tok = model_from_state_dict(name, ckpt["model"], tokenizer_dir=tok_dir)
    else:
        tok = Tokenizer.load(tok_dir)
    if tok.fingerprint != ckpt.get("tokenizer_fingerprint", tok.fingerprint):
        raise UsageError(f"--run_dir {run_dir}: {tok_dir} is not the tokenizer its checkpoint was trained with "
                         "(fingerprints differ: its token ids mean other text); restore the run's own tokenizer/")
    if model is None:
        with torch.device("meta"):
            model = GPT(preset_config(name, vocab_size=tok.vocab_size, seq_len=ckpt["config"]["seq_len"]))
        model.materialize("cpu")
        model.load_state_dict({re.sub(r"^(_orig_mod\.|module\.)+", "", k): v for k, v in ckpt["model"].items()})
    return model.to(device), tok  # a run's tokenizer/ holds the chat template it trained with


@torch.no_grad()
def evaluate_saved(cfg) -> EvalResult:
    """`scripts/eval.py` with an `EvalConfig`: the validation split's loss and accuracy."""
    from nanochat.common import resolve_device, resolve_dtype
    from nanochat.data import load_corpus, pack_records, tokenize_docs, tokenize_records, val_batches

    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    corpus = load_corpus(cfg.dataset_path)
    model, tok = load_saved(cfg.run_dir, cfg.model_name, device, cfg.seq_len)
    logger.info("corpus: %s", corpus.describe())  # once the model loaded: an error is the only line
    tok, fallback = instruct.choose_chat_template(tok, cfg.chat_template, records=corpus.kind == "instruct")
    fallbacks = [fallback] if fallback else []
    if fallback:
        logger.warning("WARNING: %s", fallback)
    model.eval()
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    seq_len = min(cfg.seq_len, model.config.seq_len)
    if corpus.kind == "instruct":
        tokens, mask, starts = tokenize_records(tok, corpus.val_records, ids=corpus.val_ids, with_starts=True)
        tokens, mask, _ = pack_records(tokens, mask, starts, seq_len, tok.bos_id)
    else:
        tokens, mask = tokenize_docs(tok, corpus.val_docs), None
    nats, count = 0.0, 0
    for x, y in val_batches(tokens, seq_len, cfg.batch_size, cfg.eval_tokens, loss_mask=mask):
        with autocast:
            loss = model(x.to(device), y.to(device), reduction="none")
        scored = y.to(device) >= 0
        nats += float(loss[scored].double().sum())
        count += int(scored.sum())
    items = instruct.choice_items(tok, corpus.val_records, cfg.eval_tokens)
    accuracy = None
    if items:
        correct, total = choice_counts(model, items, batch_size=cfg.batch_size, seq_len=seq_len,
                                       device=device, autocast=autocast)
        accuracy = correct / total
    return EvalResult(val_loss=nats / max(count, 1), val_accuracy=accuracy, questions=len(items),
                      fallbacks=fallbacks)
