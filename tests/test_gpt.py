"""Tests of nanochat.model.gpt: the model's contract with the trainer, the optimizer and FP8 conversion.

Checked against references:
- the loss returned with targets against `F.cross_entropy` of the returned logits (fp32, 1e-6);
- causality: logits before position t against the same logits with token t changed (exactly
  equal up to 1e-6, fp32);
- GQA (n_kv_head < n_head) against the same weights run as full multi-head attention with each
  k/v head repeated (1e-5);
- learning: a tiny model's loss on a repeated 16-token sequence after 30 AdamW steps against its
  initial loss (must fall below 5% of it; measured 0.2%);
- init: the initial loss against ln(vocab_size) (the near-zero lm_head makes the logits ~uniform);
- structure: every projection is an nn.Linear under the names FP8 conversion and checkpoints
  use; param_groups cover every parameter exactly once; presets and config errors.
"""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat.model.gpt import GPT, PRESETS, GPTConfig, preset_config


def tiny_config(**overrides) -> GPTConfig:
    kw = dict(vocab_size=64, seq_len=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
    kw.update(overrides)
    return GPTConfig(**kw)


def tiny_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    model = GPT(tiny_config(**overrides))
    model.init_weights()
    return model


def test_output_shapes_and_loss_shapes():
    model = tiny_model()
    idx = torch.randint(0, 64, (3, 17))
    logits = model(idx)
    assert logits.shape == (3, 17, 64) and logits.dtype == torch.float32
    assert model(idx, idx).shape == ()
    assert model(idx, idx, reduction="none").shape == (3, 17)


def test_initial_loss_is_log_vocab():
    model = tiny_model()
    idx = torch.randint(0, 64, (4, 32))
    assert abs(model(idx, idx).item() - math.log(64)) < 0.05


def test_loss_matches_cross_entropy_of_logits():
    model = tiny_model()
    for p in model.parameters():  # a non-trivial model: zero-initialized branches would hide bugs
        p.data.normal_(0, 0.2)
    idx = torch.randint(0, 64, (2, 16))
    targets = torch.randint(0, 64, (2, 16))
    targets[0, :5] = -1
    logits = model(idx)
    ref = F.cross_entropy(logits.view(-1, 64), targets.view(-1), ignore_index=-1)
    torch.testing.assert_close(model(idx, targets), ref, rtol=1e-6, atol=1e-6)
    ref_none = F.cross_entropy(logits.view(-1, 64), targets.view(-1), ignore_index=-1, reduction="none")
    torch.testing.assert_close(model(idx, targets, reduction="none").view(-1), ref_none, rtol=1e-6, atol=1e-6)


def test_softcap_bounds_logits_and_zero_disables_it():
    model = tiny_model(softcap=2.0)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 10.0)
    idx = torch.randint(0, 64, (1, 8))
    assert model(idx).abs().max() <= 2.0
    uncapped = tiny_model(softcap=0.0)
    uncapped.load_state_dict(model.state_dict())
    assert uncapped(idx).abs().max() > 2.0


def test_causality():
    model = tiny_model()
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    idx = torch.randint(0, 64, (1, 20))
    changed = idx.clone()
    changed[0, 12] = (idx[0, 12] + 1) % 64
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=1e-6)
    assert (a[:, 12:] - b[:, 12:]).abs().max() > 1e-3


def test_gqa_equals_repeated_kv_multihead():
    gqa = tiny_model(n_head=4, n_kv_head=2)
    for p in gqa.parameters():
        p.data.normal_(0, 0.2)
    mha = tiny_model(n_head=4, n_kv_head=4)
    sd = gqa.state_dict()
    hd = 16
    for k in list(sd):
        if k.endswith(("attn.c_k.weight", "attn.c_v.weight")):
            w = sd[k].view(2, hd, 64)                       # (n_kv_head, head_dim, n_embd)
            sd[k] = w.repeat_interleave(2, dim=0).reshape(4 * hd, 64)  # kv head j serves q heads 2j, 2j+1
    mha.load_state_dict(sd)
    idx = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(gqa(idx), mha(idx), rtol=1e-5, atol=1e-5)


def test_loss_falls_on_repeated_sequence():
    model = tiny_model(seed=1)
    torch.manual_seed(1)
    pattern = torch.randint(0, 64, (16,))
    data = pattern.repeat(3)[None, :33]  # (1, 33): inputs and next-token targets of length 32
    x, y = data[:, :-1], data[:, 1:]
    opt = torch.optim.AdamW(model.param_groups(weight_decay=0.0), lr=1e-2, betas=(0.9, 0.95))
    first = model(x, y).item()
    for _ in range(30):
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    last = model(x, y).item()
    assert last < 0.05 * first, (first, last)


def test_projections_are_named_linears():
    model = tiny_model()
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    expected = {"lm_head"}
    for i in range(2):
        expected |= {f"transformer.h.{i}.attn.{p}" for p in ("c_q", "c_k", "c_v", "c_proj")}
        expected |= {f"transformer.h.{i}.mlp.{p}" for p in ("c_fc", "c_proj")}
    assert linears == expected
    assert isinstance(model.transformer.wte, nn.Embedding)
    assert all(model.get_submodule(n).bias is None for n in linears)
    # state_dict holds parameters only (rotary tables are non-persistent buffers)
    assert set(model.state_dict()) == {n for n, _ in model.named_parameters()}


def test_swiglu_learned_norm_bias_tied_variant_structure():
    model = tiny_model(mlp="swiglu", intermediate_size=96, norm_weight=True, qkv_bias=True,
                       tie_embeddings=True, qk_norm=False, embed_norm=False, softcap=0.0)
    assert isinstance(model.transformer.h[0].mlp.c_gate, nn.Linear)
    assert model.transformer.h[0].mlp.c_fc.out_features == 96
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.transformer.h[0].attn.c_q.bias is not None
    assert model.transformer.h[0].ln_1.weight is not None
    assert model(torch.randint(0, 64, (1, 8))).shape == (1, 8, 64)


@pytest.mark.parametrize("overrides", [{}, dict(mlp="swiglu", norm_weight=True, qkv_bias=True, tie_embeddings=True)])
def test_param_groups_partition_parameters(overrides):
    model = tiny_model(**overrides)
    groups = model.param_groups(weight_decay=0.1)
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    decay = {id(p) for p in groups[0]["params"]}
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    for name, p in model.named_parameters():
        should_decay = p.ndim >= 2 and "wte" not in name
        assert (id(p) in decay) == should_decay, name
    if not overrides:
        assert id(model.lm_head.weight) in decay


def test_init_is_deterministic():
    a, b = tiny_model(seed=3), tiny_model(seed=3)
    for (n, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), n


def test_presets():
    assert {"d2", "d4", "d6", "d8", "d12", "d20", "d24", "d26"} <= set(PRESETS)
    cfg = preset_config("d12", vocab_size=1000, seq_len=128)
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.head_dim) == (12, 768, 6, 128)
    assert preset_config("d2", vocab_size=300, seq_len=16).n_head == 1
    with pytest.raises(ValueError, match="d2, d4, d6, d8, d12, d20, d24, d26"):
        preset_config("d5", vocab_size=300, seq_len=16)


@pytest.mark.parametrize("overrides,match", [
    (dict(n_embd=60, n_head=7), "divisible by n_head"),
    (dict(n_head=4, n_kv_head=3), "multiple of n_kv_head"),
    (dict(n_embd=12, n_head=4, n_kv_head=4), "head_dim .* must be even"),
])
def test_config_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**overrides)


def test_num_params_and_flops():
    model = tiny_model()
    cfg = model.config
    assert model.num_params() == sum(p.numel() for p in model.parameters())
    matmul = model.num_params() - cfg.vocab_size * cfg.n_embd
    assert model.flops_per_token() == 6 * matmul + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * cfg.seq_len
    assert model.flops_per_token(8) == 6 * matmul + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * 8


@pytest.mark.parametrize("tied", [False, True])
def test_meta_build_then_materialize_matches(tied):
    ref = tiny_model(seed=5, tie_embeddings=tied)
    with torch.device("meta"):
        model = GPT(ref.config)
    model.materialize("cpu")
    assert (model.lm_head.weight is model.transformer.wte.weight) == tied
    model.load_state_dict(ref.state_dict())
    idx = torch.randint(0, 64, (1, 12))
    torch.testing.assert_close(model(idx), ref(idx), rtol=0, atol=0)


def test_bf16_autocast_forward_runs_and_loss_is_fp32():
    model = tiny_model()
    idx = torch.randint(0, 64, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(idx, idx)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert abs(loss.item() - model(idx, idx).item()) < 0.05
