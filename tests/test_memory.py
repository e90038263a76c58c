"""nanochat.memory (the plan printed before weights are loaded) and activation checkpointing.

- The plan's figures for one small Llama-shaped config equal a hand computation written out
  below (exact bytes): parameters tensor by tensor, fp32 weights and gradients, AdamW moments
  at opt levels 0/1/2 (which tensors get FP8 blocks), activations from the documented formula.
- The optimizer figure equals what nanochat.fp8.FP8Optim actually reports for that model
  (`state_bytes()`, exact) at every level; weight_bytes / grad_bytes are parameters.
- A plan that does not fit is a ValueError naming the remedies (opt level 2,
  --activation_checkpointing, a smaller --batch_size, FSDP over N GPUs), each re-planned; the
  trainer raises it before any model is built (model constructors patched to fail).
- Activation checkpointing: gradients of every parameter equal the plain model's on our GPT
  preset, on an FP8-converted (emulated) one and on a Llama loaded from a transformers
  checkpoint, within rtol 1e-5 / atol 1e-7 (the recomputed forward runs the same fp32 ops;
  measured identical on this CPU); the loss is the same and eval/no_grad paths are untouched.
"""

import pytest
import torch

from nanochat import memory
from nanochat.gpt import GPT, GPTConfig, preset_config

LLAMA_TINY = GPTConfig(vocab_size=1000, seq_len=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                       intermediate_size=128, mlp="swiglu", norm_weight=True, norm_eps=1e-5,
                       embed_norm=False, qk_norm=False, softcap=0.0)
GRAD_TOL = dict(rtol=1e-5, atol=1e-7)


def test_plan_equals_hand_computation():
    h, kv, inter, vocab, layers = 64, 2 * 16, 128, 1000, 2
    per_layer = [h, h * h, h * kv, h * kv, h * h, h, h * inter, h * inter, inter * h]  # ln_1 q k v o ln_2 gate up down
    tensors = [vocab * h] + per_layer * layers + [h, h * vocab]                       # wte, blocks, ln_f, lm_head
    n = sum(tensors)
    assert n == 64000 + 2 * (64 + 4096 + 2048 + 2048 + 4096 + 64 + 8192 + 8192 + 8192) + 64 + 64000 == 202_048
    # FP8 moments only for tensors >= 4096 elements in whole 256-blocks: wte, q, o, gate, up, down, lm_head
    fp8 = [t for t in tensors if t >= 4096 and t % 256 == 0]
    assert sorted(set(fp8)) == [4096, 8192, 64000]
    fp32 = n - sum(fp8)
    opt = {0: 8 * n,
           1: sum(t + t // 256 * 4 + 4 * t for t in fp8) + 8 * fp32,
           2: sum(2 * (t + t // 256 * 4) for t in fp8) + 8 * fp32}
    batch, seq = 4, 32
    tokens = batch * seq
    act_fp32 = tokens * (layers * (7 * h + 2 * kv + 4 * inter) * 4 + vocab * 16)
    act_bf16 = tokens * (layers * (2 * h * 4 + (8 * h + 2 * kv + 4 * inter) * 2) + vocab * 14)
    act_ckpt = tokens * (layers * 4 * h + (7 * h + 2 * kv + 4 * inter) * 4 + vocab * 16)
    for level in (0, 1, 2):
        plan = memory.plan_training(LLAMA_TINY, batch_size=batch, seq_len=seq, opt_level=level)
        assert (plan.num_params, plan.weights, plan.gradients, plan.optimizer, plan.activations) == (
            n, 4 * n, 4 * n, opt[level], act_fp32)
        assert plan.total == 8 * n + opt[level] + act_fp32
    assert memory.plan_training(LLAMA_TINY, batch_size=batch, seq_len=seq, autocast=True).activations == act_bf16
    assert memory.plan_training(LLAMA_TINY, batch_size=batch, seq_len=seq,
                                activation_checkpointing=True).activations == act_ckpt
    half = memory.plan_training(LLAMA_TINY, batch_size=batch, seq_len=seq, weight_bytes=2, grad_bytes=2)
    assert (half.weights, half.gradients) == (2 * n, 2 * n)
    sharded = memory.plan_training(LLAMA_TINY, batch_size=batch, seq_len=seq, opt_level=2, shards=4)
    assert (sharded.weights, sharded.optimizer, sharded.activations) == (n, -(-opt[2] // 4), act_fp32)


@pytest.mark.parametrize("level", [0, 1, 2])
def test_optimizer_figure_equals_fp8optim(level):
    from nanochat.fp8 import FP8Optim

    model = GPT(LLAMA_TINY)
    opt = FP8Optim(torch.optim.AdamW(model.param_groups(0.1), lr=1e-3), opt_level=level)
    plan = memory.plan_training(LLAMA_TINY, batch_size=1, seq_len=8, opt_level=level)
    assert plan.optimizer == opt.state_bytes()


def test_plan_that_does_not_fit_names_the_remedies():
    plan = memory.plan_training(LLAMA_TINY, batch_size=64, seq_len=64, opt_level=0)
    tight = plan.replan(free_bytes=plan.total - 1)
    assert plan.replan(free_bytes=plan.total).fits and not tight.fits
    with pytest.raises(ValueError, match="does not fit") as e:
        tight.check(fp8=True)
    msg = str(e.value)
    for remedy in ("--fp8_opt_level 2:", "--activation_checkpointing:", "--batch_size 63", "FSDP over 2 GPUs"):
        assert remedy in msg, msg
    # without --fp8 the FP8 optimizer states come with --fp8
    assert "--fp8 --fp8_opt_level 2" in "; ".join(tight.remedies(fp8=False))


def test_trainer_refuses_before_building_the_model(small_corpus, tmp_path, monkeypatch):
    import nanochat.trainer as trainer
    from tests.conftest import tiny_train_kwargs

    monkeypatch.setattr(memory, "free_bytes", lambda device: 1024)

    def no_model(*a, **k):
        raise AssertionError("a model was built although the plan does not fit")

    monkeypatch.setattr(trainer, "GPT", no_model)
    monkeypatch.setattr(trainer, "load_hf_model", no_model)
    with pytest.raises(ValueError, match=r"does not fit.*1\.0 KiB is free.*--activation_checkpointing"):
        trainer.NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "run")).train()


def _grads(model, x, y, checkpointing):
    model.zero_grad(set_to_none=True)
    model.activation_checkpointing = checkpointing
    model.train()
    loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same_grads(model, vocab):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (2, 24), generator=g)
    y = torch.randint(0, vocab, (2, 24), generator=g)
    loss_plain, plain = _grads(model, x, y, False)
    loss_ckpt, ckpt = _grads(model, x, y, True)
    torch.testing.assert_close(loss_ckpt, loss_plain, **GRAD_TOL)
    assert plain.keys() == ckpt.keys()
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], **GRAD_TOL, msg=name)
    with torch.no_grad():  # inference never checkpoints
        torch.testing.assert_close(model.eval()(x), model(x))


def test_activation_checkpointing_gradients_match_preset():
    torch.manual_seed(0)
    model = GPT(preset_config("d2", vocab_size=300, seq_len=32))
    model.init_weights()
    _assert_same_grads(model, 300)


def test_activation_checkpointing_gradients_match_fp8_emulated():
    from nanochat.fp8 import FP8Config, convert

    torch.manual_seed(0)
    model = GPT(preset_config("d2", vocab_size=300, seq_len=32))
    model.init_weights()
    report = convert(model, FP8Config(emulate=True))
    assert report.converted
    _assert_same_grads(model, 300)


def test_activation_checkpointing_gradients_match_hf_loaded(tmp_path):
    pytest.importorskip("transformers")
    from tests.test_eval import write_base_llama

    from nanochat.hf import load_hf_model

    directory = write_base_llama(tmp_path / "llama")
    model, tok = load_hf_model(directory)
    with torch.no_grad():  # transformers' init is tiny; larger weights make the gradients non-trivial
        for p in model.parameters():
            p.normal_(0, 0.3 if p.ndim > 1 else 1.0)
    _assert_same_grads(model, tok.vocab_size)
