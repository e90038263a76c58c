"""nanochat.train.memory (the plan printed before weights are loaded) and activation checkpointing.

- The plan's figures for one small Llama-shaped config equal a hand computation written out
  below (exact bytes): parameters tensor by tensor, fp32 weights and gradients, AdamW moments
  at opt levels 0/1/2 (which tensors get FP8 blocks), activations from the documented formula.
- The optimizer figure equals what nanochat.fp8.FP8Optim actually reports for that model
  (`state_bytes()`, exact) at every level; in a one-step training run it also equals the
  trainer's header figure, its measurement after the step and FP8Optim's summary, exactly.
- Master weights, by hand on the same config: fp32 4 + 4 bytes/param, bf16 and bf16_sr 2 + 2,
  bf16_split 2 + 2 and 2 more in the optimizer part; with the optimizer in the backward the
  gradients are the largest tensor's only (a tied embedding's on top); state bytes per param
  ~6.03 for bf16 at level 2 and ~4.03 plus the largest tensor's share in the backward, the same
  under FSDP.
- A plan that does not fit is a ValueError naming the remedies (opt level 2,
  --activation_checkpointing, --master_weights bf16_split / bf16_sr, --optimizer_in_backward,
  all of them together, a smaller --batch_size, FSDP over N GPUs), each re-planned; the trainer
  raises it before any model is built (model constructors patched to fail).
- Activation checkpointing: gradients of every parameter equal the plain model's on our GPT
  preset, on an FP8-converted (emulated) one and on a Llama loaded from a transformers
  checkpoint, within rtol 1e-5 / atol 1e-7 (the recomputed forward runs the same fp32 ops;
  measured identical on this CPU); the loss is the same and eval/no_grad paths are untouched.
"""

import dataclasses

import pytest
import torch

from nanochat.train import memory
from nanochat.model.gpt import GPT, GPTConfig, preset_config

LLAMA_TINY = GPTConfig(vocab_size=1000, seq_len=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                       intermediate_size=128, mlp="swiglu", norm_weight=True, norm_eps=1e-5,
                       embed_norm=False, qk_norm=False, softcap=0.0)
LLAMA3_8B_HF = {  # Meta-Llama-3-8B's config.json, the fields the planner reads
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu",
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": False}
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
    sharded = memory.plan_training(LLAMA_TINY, batch_size=batch, seq_len=seq, opt_level=2, shards=4)
    assert (sharded.weights, sharded.optimizer, sharded.activations) == (n, -(-opt[2] // 4), act_fp32)


def _tiny_tensors(tie=False):
    h, kv, inter, vocab = 64, 2 * 16, 128, 1000
    per_layer = [h, h * h, h * kv, h * kv, h * h, h, h * inter, h * inter, inter * h]
    return tuple([vocab * h] + per_layer * 2 + [h] + ([] if tie else [h * vocab]))


def test_master_weights_and_optimizer_in_backward_by_hand():
    tensors = _tiny_tensors()
    assert memory.param_numels(LLAMA_TINY) == tensors
    n = sum(tensors)
    opt2 = sum(2 * (t + t // 256 * 4) if t >= 4096 and t % 256 == 0 else 8 * t for t in tensors)
    assert opt2 == 2 * 193_536 * (256 + 4) // 256 + 8 * 8_512 == 461_216  # FP8 + a scale per 256; fp32
    kw = dict(batch_size=4, seq_len=32, opt_level=2)
    act = memory.plan_training(LLAMA_TINY, **kw).activations
    expected = {  # (weights, gradients, optimizer) bytes
        "fp32": (4 * n, 4 * n, opt2),
        "bf16": (2 * n, 2 * n, opt2),
        "bf16_sr": (2 * n, 2 * n, opt2),
        "bf16_split": (2 * n, 2 * n, opt2 + 2 * n),  # the low halves of every fp32 master
    }
    for choice, (w, g, o) in expected.items():
        plan = memory.plan_training(LLAMA_TINY, master_weights=choice, **kw)
        assert (plan.weights, plan.gradients, plan.optimizer, plan.activations) == (w, g, o, act), choice
        assert (plan.weight_bytes, plan.grad_bytes) == (w // n, g // n)
        assert plan.remainder == (2 * n if choice == "bf16_split" else 0)
        assert plan.state_bytes_per_param == (w + g + o) / n
        table = plan.table()
        assert f"({choice} masters)" in table
        assert ("fp8_opt_level 2 + bf16_split remainder" in table) == (choice == "bf16_split")
    # in the backward only one gradient exists at a time: the largest tensor's (wte = lm_head, 64000)
    for choice, gb in (("fp32", 4), ("bf16", 2)):
        plan = memory.plan_training(LLAMA_TINY, master_weights=choice, optimizer_in_backward=True, **kw)
        assert plan.gradients == max(tensors) * gb == 64_000 * gb
        assert plan.weights == gb * n and plan.optimizer == opt2
        assert "in backward: one tensor at a time, largest 0.1M x" in plan.table()
    # a tied embedding's gradient collects from lm_head and wte: alive next to the largest other one
    tied_cfg = dataclasses.replace(LLAMA_TINY, tie_embeddings=True)
    assert memory.param_numels(tied_cfg) == _tiny_tensors(tie=True)
    tied = memory.plan_training(tied_cfg, master_weights="bf16", optimizer_in_backward=True, **kw)
    assert tied.gradients == (64_000 + 8192) * 2
    # under FSDP each part is a shard, the bytes per parameter stay the same
    plan = memory.plan_training(LLAMA_TINY, master_weights="bf16_split", optimizer_in_backward=True, **kw)
    sharded = plan.replan(shards=4)
    assert (sharded.weights, sharded.gradients, sharded.optimizer) == (
        2 * n // 4, 64_000 * 2 // 4, -(-opt2 // 4) + 2 * n // 4)
    assert sharded.state_bytes_per_param == pytest.approx(plan.state_bytes_per_param, rel=1e-5)
    with pytest.raises(ValueError, match="master_weights 'fp16'"):
        memory.plan_training(LLAMA_TINY, master_weights="fp16", **kw)


def test_state_bytes_per_param_llama3_8b():
    from nanochat.model.hf import gpt_config_from_hf

    config = gpt_config_from_hf(LLAMA3_8B_HF, seq_len=256)
    kw = dict(batch_size=1, seq_len=256, opt_level=2)
    fp32 = memory.plan_training(config, **kw)
    n = fp32.num_params
    assert n == 8_030_261_248
    assert fp32.state_bytes_per_param == pytest.approx(10.031, abs=1e-3)  # 4 + 4 + ~2.03
    bf16 = fp32.replan(master_weights="bf16")
    assert bf16.state_bytes_per_param == pytest.approx(6.031, abs=1e-3)
    assert bf16.replan(master_weights="bf16_split").state_bytes_per_param == pytest.approx(8.031, abs=1e-3)
    # in the backward: weights + moments, plus the largest tensor's gradient (lm_head, 128256 x 4096)
    inb = bf16.replan(optimizer_in_backward=True)
    assert inb.gradients == 128256 * 4096 * 2
    assert inb.state_bytes_per_param == pytest.approx(4.031 + 2 * 128256 * 4096 / n, abs=1e-3)


@pytest.mark.parametrize("level", [0, 1, 2])
def test_optimizer_figure_equals_fp8optim(level):
    from nanochat.fp8 import FP8Optim

    model = GPT(LLAMA_TINY)
    opt = FP8Optim(torch.optim.AdamW(model.param_groups(0.1), lr=1e-3), opt_level=level)
    plan = memory.plan_training(LLAMA_TINY, batch_size=1, seq_len=8, opt_level=level)
    assert plan.optimizer == opt.state_bytes()


# Level 1 runs the trainer code of level 2 (FP8Optim, its summary line) with another moment
# format, whose bytes test_optimizer_figure_equals_fp8optim and tests/test_optim.py's planned =
# held check: with -m slow only.
@pytest.mark.parametrize("level", [0, pytest.param(1, marks=pytest.mark.slow), 2])
def test_optimizer_bytes_agree_in_plan_summary_header_and_measurement(small_corpus, tmp_path, level):
    """One training step of the d2 model (level 0: plain AdamW, FP8 off; levels 1-2: FP8Optim on
    emulated FP8): the plan's optimizer bytes, the trainer's header figure (planned before the
    first step), its measurement of the tensors held after it, and FP8Optim's summary line are
    the same number, exactly."""
    from nanochat.train.trainer import NanoChatTrainer
    from tests.conftest import tiny_train_kwargs

    extra = dict(fp8=True, fp8_emulate=True, fp8_opt_level=level) if level else {}
    t = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "run", num_iterations=1, num_samples=0,
                                            **extra))
    r = t.train()
    assert r.optimizer_state_bytes == r.state_bytes["optimizer"] == t.memory_plan.optimizer
    if level:
        assert f"; {t.memory_plan.optimizer:,} bytes of state" in t.optimizer.summary()


def test_plan_that_does_not_fit_names_the_remedies():
    plan = memory.plan_training(LLAMA_TINY, batch_size=64, seq_len=64, opt_level=0)
    tight = plan.replan(free_bytes=plan.total - 1)
    assert plan.replan(free_bytes=plan.total).fits and not tight.fits
    with pytest.raises(ValueError, match="does not fit") as e:
        tight.check()
    msg = str(e.value)
    for remedy in ("--fp8_opt_level 2:", "--activation_checkpointing:", "--batch_size 63", "FSDP over 2 GPUs"):
        assert remedy in msg, msg
    # FP8 optimizer states need no FP8 layers: --fp8_opt_level alone, never with --fp8
    assert "--fp8 " not in "; ".join(tight.remedies())


def test_remedies_name_master_weights_and_optimizer_in_backward():
    # level 2 and checkpointing already on: only the new flags are left to suggest
    base = memory.plan_training(LLAMA_TINY, batch_size=1, seq_len=8, opt_level=2, activation_checkpointing=True)
    split, sr, inb = (base.replan(master_weights="bf16_split"), base.replan(master_weights="bf16_sr"),
                      base.replan(optimizer_in_backward=True))
    both = base.replan(master_weights="bf16_sr", optimizer_in_backward=True)
    assert both.total < sr.total < split.total < base.total and both.total < inb.total < base.total
    tight = base.replan(free_bytes=split.total)  # bf16_split alone would fit
    msg = "; ".join(tight.remedies())
    assert "--master_weights bf16_split: " in msg and "--master_weights bf16_sr: " in msg, msg
    assert "--optimizer_in_backward (needs --grad_accum_steps 1 and --grad_clip 0): " in msg, msg
    assert "--fp8_opt_level" not in msg and "--activation_checkpointing" not in msg, msg
    # only all of them together fits: the singles say so, the combination does not
    tight = base.replan(free_bytes=both.total)
    lines = tight.remedies()
    combo = [x for x in lines if x.startswith("--master_weights bf16_sr --optimizer_in_backward")]
    assert len(combo) == 1 and "still too much" not in combo[0], lines
    assert all("still too much" in x for x in lines if x.startswith("--") and x not in combo), lines
    # from fp32 level 0 without checkpointing: every single flag, then all together with bf16_sr
    plain = memory.plan_training(LLAMA_TINY, batch_size=64, seq_len=64, opt_level=0)
    lines = plain.replan(free_bytes=1).remedies()
    assert lines[5].startswith("--fp8_opt_level 2 --activation_checkpointing --master_weights bf16_sr "
                               "--optimizer_in_backward (needs"), lines
    # what is already on is not suggested again
    on = base.replan(master_weights="bf16", optimizer_in_backward=True, free_bytes=1)
    msg = "; ".join(on.remedies())
    assert "--master_weights" not in msg and "--optimizer_in_backward" not in msg, msg
    assert "--master_weights bf16_sr:" in "; ".join(base.replan(master_weights="bf16_split",
                                                                 free_bytes=1).remedies())


def test_trainer_refuses_before_building_the_model(small_corpus, tmp_path, monkeypatch):
    import nanochat.train.trainer as trainer
    from tests.conftest import tiny_train_kwargs

    monkeypatch.setattr(memory, "free_bytes", lambda device: 1024)

    def no_model(*a, **k):
        raise AssertionError("a model was built although the plan does not fit")

    monkeypatch.setattr(trainer, "load_model", no_model)  # the trainer's one way to build a model
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
    report = convert(model, FP8Config(emulate=True, layers="all"))
    assert report.converted
    _assert_same_grads(model, 300)


def test_activation_checkpointing_gradients_match_hf_loaded(tmp_path):
    pytest.importorskip("transformers")
    from tests.test_eval import write_base_llama

    from nanochat.model.hf import load_hf_model

    directory = write_base_llama(tmp_path / "llama")
    model, tok = load_hf_model(directory)
    with torch.no_grad():  # transformers' init is tiny; larger weights make the gradients non-trivial
        for p in model.parameters():
            p.normal_(0, 0.3 if p.ndim > 1 else 1.0)
    _assert_same_grads(model, tok.vocab_size)
