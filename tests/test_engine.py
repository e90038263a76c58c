"""Tests of nanochat.engine.generate against references built from the model's own forward pass.

- greedy (temperature 0) against an explicit argmax rollout of the model (exact token equality);
- seeded sampling against itself (same seed -> identical tokens, different seed -> different);
- torch's global RNG state before and after a seeded generate (byte-identical);
- context cropping: prompts longer than seq_len work, and equal a run on the last seq_len tokens;
- stop_ids end generation right after the stop token; the model's train/eval mode is restored.
"""

import pytest
import torch

from nanochat.engine import generate
from nanochat.model.gpt import GPT, GPTConfig


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=50, seq_len=16, n_layer=2, n_head=2, n_kv_head=1, n_embd=32))
    m.init_weights()
    with torch.no_grad():  # random, non-degenerate weights so that sampling is not ~uniform
        for p in m.parameters():
            p.normal_(0, 0.5)
    return m


def test_greedy_equals_argmax_rollout(model):
    prompt = [1, 2, 3]
    out = generate(model, prompt, max_new_tokens=10, temperature=0.0)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(10):
            ids.append(int(model(torch.tensor([ids[-16:]]))[0, -1].argmax()))
    assert out == ids[3:]


def test_seeded_sampling_is_deterministic(model):
    a = generate(model, [5], max_new_tokens=20, temperature=1.0, top_k=0, seed=123)
    b = generate(model, [5], max_new_tokens=20, temperature=1.0, top_k=0, seed=123)
    c = generate(model, [5], max_new_tokens=20, temperature=1.0, top_k=0, seed=124)
    assert a == b and len(a) == 20
    assert a != c


def test_seeded_generate_leaves_global_rng_untouched(model):
    torch.manual_seed(7)
    state = torch.get_rng_state()
    generate(model, [5], max_new_tokens=5, temperature=1.0, seed=1)
    assert torch.equal(torch.get_rng_state(), state)


def test_top_k_one_is_greedy(model):
    greedy = generate(model, [4, 4], max_new_tokens=8, temperature=0.0)
    assert generate(model, [4, 4], max_new_tokens=8, temperature=1.5, top_k=1, seed=0) == greedy


def test_long_prompt_is_cropped_to_seq_len(model):
    prompt = list(range(40))  # longer than seq_len=16
    out = generate(model, prompt, max_new_tokens=5, temperature=0.0)
    assert out == generate(model, prompt[-16:], max_new_tokens=5, temperature=0.0)


def test_stop_ids_and_mode_restored(model):
    greedy = generate(model, [1], max_new_tokens=10, temperature=0.0)
    stop = greedy[3]
    first = greedy.index(stop)
    model.train()
    out = generate(model, [1], max_new_tokens=10, temperature=0.0, stop_ids={stop})
    assert out == greedy[: first + 1]
    assert model.training
    model.eval()
    generate(model, [1], max_new_tokens=1)
    assert not model.training


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        generate(model, [], max_new_tokens=1)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, [1], max_new_tokens=1, temperature=-1.0)
