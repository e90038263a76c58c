"""Generation: sample a continuation of a prompt from a GPT, one token at a time.

Each step runs the model on the whole (cropped) context and samples the next token from the
last position's logits:

    logits / temperature -> keep the top_k largest -> softmax -> sample     (temperature 0: argmax)

There is no KV cache: every step recomputes attention over the context. For the short samples
the trainer prints (tens of tokens, contexts of a few hundred) that costs little, and it keeps
this file independent of the model's internals. It is the first thing to add if generation
becomes a workload of its own.

Randomness: with `seed`, sampling draws from a private `torch.Generator`, so the global RNG is
untouched. The trainer relies on that: it samples mid-run and a resumed run must still be
bit-exact with an uninterrupted one.

Precision: this file runs whatever module it is given. Running an FP8-trained model in high
precision (`nanochat.fp8.fp8_disabled`) is the caller's job; the engine never imports FP8 code.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def generate(model: torch.nn.Module, prompt_ids: list[int], *, max_new_tokens: int,
             temperature: float = 0.8, top_k: int = 50, seed: int | None = None,
             stop_ids: set[int] | None = None) -> list[int]:
    """Sample up to `max_new_tokens` tokens after `prompt_ids` and return only the new ones.

    temperature 0 is greedy decoding; top_k 0 (or >= vocab) samples from the full distribution.
    Generation ends early after a token in `stop_ids`, which is included as the last element so
    the caller can tell a stop from running out of tokens. The context fed to the model is the
    last `model.config.seq_len` tokens. The model is put in eval mode and its previous mode is
    restored afterwards.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids is empty; give at least one token (e.g. the tokenizer's bos_id)")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 keeps all tokens), got {top_k}")
    device = next(model.parameters()).device
    seq_len = model.config.seq_len
    generator = None
    if seed is not None and temperature > 0:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)

    was_training = model.training
    model.eval()
    try:
        ids = list(prompt_ids)
        new: list[int] = []
        for _ in range(max_new_tokens):
            context = torch.tensor([ids[-seq_len:]], dtype=torch.long, device=device)  # (1, T)
            logits = model(context)[0, -1].float()                                     # (V,)
            if temperature == 0:
                next_id = int(torch.argmax(logits))
            else:
                logits = logits / temperature
                if 0 < top_k < logits.numel():
                    kth = torch.topk(logits, top_k).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                next_id = int(torch.multinomial(probs, 1, generator=generator))
            ids.append(next_id)
            new.append(next_id)
            if stop_ids and next_id in stop_ids:
                break
        return new
    finally:
        model.train(was_training)
