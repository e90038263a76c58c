"""A training run with --optimizer muon: nanochat.train.parts.build_optimizer, the trainer's
per-group schedule, checkpoints and the memory plan, each against a reference.

- d2, 30 steps, Muon's momentum in FP8 (--fp8_opt_level 1): the loss falls as the AdamW run of
  test_trainer.py does (the last five steps' mean under 0.75 of the first step's); the 12 block
  matrices are Muon's, the tied embedding and the norms AdamW's, as the header says; every
  Muon tensor's momentum is an FP8Tensor; the state the run holds after its steps is the memory
  plan's optimizer part and the sum optimizer_bytes gives per tensor (1 + 4/256 bytes a Muon
  parameter).
- Each param group follows its own peak through the schedule: Muon's --muon_lr, AdamW's
  --embedding_lr / --head_lr, times lr_multiplier at the last step (both to fp64 rounding of one
  product); with --muon_momentum_warmup, Muon's momentum follows its ramp from 0.85. Rates not
  given are nanochat.optim.recipe's for the model's width and the tokens a step (grad
  accumulation counted), and the result records each group's; the header says the optimizer's
  layout once (the first step does not repeat it).
- A resumed run is the uninterrupted one: every step's loss equal (the same computation, so
  compared exactly, as test_trainer.py's AdamW resume is). Resumed where a derived rate differs
  from the checkpoint's, one warning names the group, both rates and the rule, and the group
  trains at the new one. A resume with another --weight_decay trains at it (the checkpoint's
  groups take this run's decay), said once per decayed group.
- A run that repeats its data (two epochs) decays its matrices and head by the recipe's
  1 / (Muon's rate x steps an epoch), to fp64 rounding of one product, the embedding by none,
  and the result records it; an AdamW run records its --weight_decay default, 0.1.
- FP8 momentum against fp32 momentum (level 0; both with Newton-Schulz in fp32, the CPU's): the
  two runs' losses over the last five steps within 1% (FP8 rounds the buffer by up to 2^-4
  relative each write, noise the orthogonalization mostly absorbs: measured 0.04%); a run whose
  Muon steps do nothing ends over 10% higher (measured 12.5%), so the bound tells them apart.
- bf16 master weights (bf16_sr, FP8 momentum), after the backward and inside it: the loss falls
  by the same bound; every Muon matrix is bf16 with FP8 momentum and a step count; the weights,
  optimizer state and gradients held are the plan's, byte for byte (in the backward: the largest
  gradient, a Muon matrix's, is the plan's gradient part); a resumed run is the uninterrupted one,
  every loss and the final weights equal.
- --optimizer auto: Muon for a preset, AdamW for a Hugging Face model, recorded as it ran.
- Bad input, before any work: Muon's flags without --optimizer muon (or auto's muon), a --muon_lr,
  --head_lr or --muon_momentum out of range; and under torchrun with --fsdp or --tp, bf16 master weights
  (the layout check; fp32 masters pass it there); NorMuon with --fsdp or --tp is refused. A --lr
  other than its default for a model with no norm weight or bias (it trains nothing): one warning.

Modules: nanochat.train.parts, nanochat.config.train, nanochat.train.memory (moment_bytes),
nanochat.train.preflight (check_layout), nanochat.checkpoint.nonfinite (a container's state).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from nanochat import common
from nanochat.common import DistEnv, UsageError
from nanochat.config import TrainConfig
from nanochat.optim import FP8Tensor, MuonAdamW, optimizer_bytes, optimizer_state_bytes
from nanochat.train import memory, parts, preflight
from nanochat.optim.recipe import recipe_rates
from nanochat.optim.schedule import muon_momentum
from nanochat.train.trainer import NanoChatTrainer, lr_multiplier
from tests.conftest import run_records, tiny_train_kwargs, train_until_first_save, warnings_in

MUON = dict(optimizer="muon", muon_lr=0.02, embedding_lr=1e-2, head_lr=1e-2, lr=1e-2)


def _losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run_records(run_dir) if "loss" in r}


def _tail(losses: dict[int, float]) -> float:
    return sum(losses[s] for s in range(26, 31)) / 5


@pytest.fixture(scope="module")
def fp8_run(small_corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("muon") / "run"
    trainer = NanoChatTrainer(**tiny_train_kwargs(small_corpus, run_dir, fp8_opt_level=1, **MUON))
    result = trainer.train()
    return trainer, result, _losses(run_dir)


def test_a_muon_run_trains_with_fp8_momentum_and_holds_the_planned_bytes(fp8_run):
    trainer, result, losses = fp8_run
    assert _tail(losses) < 0.75 * losses[1], (losses[1], _tail(losses))
    opt = trainer.optimizer
    assert isinstance(opt, MuonAdamW) and result.fallbacks == []
    muon = [p for g in opt.muon.param_groups for p in g["params"]]
    blocks = [p for name, p in trainer.model.named_parameters() if name.startswith("transformer.h.") and p.ndim == 2]
    assert len(muon) == 12 and {id(p) for p in muon} == {id(p) for p in blocks}
    assert all(isinstance(opt.muon.state[p]["momentum_buffer"], FP8Tensor) for p in muon)
    summary = trainer.facts.optimizer_summary
    assert summary.startswith("muon: 12 tensors / 393,216 params (hidden nn.Linear weight)\nadamw: 2 tensors / 81,920 "
                              "params (nn.Embedding, output head)"), summary
    held = optimizer_state_bytes(opt)
    assert held == trainer.memory_plan.optimizer
    n_muon = sum(p.numel() for p in muon)
    adamw = [p for g in opt.adamw.param_groups for p in g["params"]]
    by_hand = optimizer_bytes(n_muon, quantized=1, moments=1, block_size=256) + sum(
        optimizer_bytes(p.numel(), quantized=0 if p.numel() < 4096 or p.numel() % 256 else 1, block_size=256)
        for p in adamw)
    assert held == by_hand and held < 4 * n_muon + 8 * sum(p.numel() for p in adamw)


def test_each_group_follows_its_own_peak(fp8_run):
    trainer, _, _ = fp8_run
    cfg = trainer.config
    last = lr_multiplier(cfg.num_iterations - 1, trainer.total_steps, cfg.warmup_steps, cfg.final_lr_frac)
    for g in trainer.optimizer.muon.param_groups:
        assert g["lr"] == pytest.approx(0.02 * last, rel=1e-12)
    for g in trainer.optimizer.adamw.param_groups:
        assert g["lr"] == pytest.approx(1e-2 * last, rel=1e-12)
    assert trainer.facts.rates.rules["embedding"] == "--embedding_lr, as given"
    records = [r for r in run_records(trainer.run_dir) if "lrm" in r]
    assert records[-1]["lrm"] == pytest.approx(last, rel=1e-12) and len(records) == cfg.num_iterations


def test_rates_not_given_are_the_recipe_s_for_this_width_and_batch(small_corpus, tmp_path, nanochat_log, capsys,
                                                                   monkeypatch):
    """No --muon_lr / --embedding_lr / --head_lr: each group's peak is recipe_rates' for the
    model's width and the tokens a step (batch x seq_len x grad_accum); the result records them.
    The optimizer's layout is said once, in the header (not again at the first step). The run's
    --lr (1e-2) trains nothing in d2, which has no norm weight or bias: one warning says so and
    names the flags that do; at --lr's default the same optimizer is built without it."""
    monkeypatch.setattr(common, "_warned", set())  # warned once per process: maybe by an earlier test
    kwargs = tiny_train_kwargs(small_corpus, tmp_path / "run", num_iterations=2, num_samples=0, optimizer="muon",
                               grad_accum_steps=2)
    trainer = NanoChatTrainer(**kwargs)
    result = trainer.train()
    said = capsys.readouterr().out + "".join(r.getMessage() for r in nanochat_log.records)  # the header is printed
    assert said.count("OptimWrapper(Muon") == 1 and "peak learning rates" in said
    assert "vector: 0.01 (--lr; unused: d2 has no norm weight or bias)" in said
    cfg = trainer.config
    want = recipe_rates(width=trainer.model.config.n_embd, tokens_per_step=cfg.batch_size * cfg.seq_len * 2, lr=cfg.lr)
    peaks = {g["role"]: g["initial_lr"] for g in trainer.optimizer.param_groups}
    assert peaks == {"matrix": want.matrix, "head": want.head, "embedding": want.embedding}  # d2: no vectors
    assert result.learning_rates == want.as_dict() and want.embedding != cfg.lr
    unused = [w for w in warnings_in(nanochat_log) if w.startswith("WARNING: --lr ")]
    assert unused == ["WARNING: --lr 0.01 trains no parameter of d2 under --optimizer muon: it sets the norms' and "
                      "biases' rate, and this model has none; the matrices, the embedding and the head train at the "
                      "recipe's rates: give --muon_lr, --embedding_lr or --head_lr, or --optimizer adamw"]
    monkeypatch.setattr(common, "_warned", set())
    parts.build_optimizer(dataclasses.replace(cfg, lr=parts.LR_DEFAULT), trainer.model, trainer.fp8, trainer.device,
                          trainer.tokens_per_step)
    assert [w for w in warnings_in(nanochat_log) if w.startswith("WARNING: --lr ")] == unused


def test_a_run_that_repeats_its_data_decays_its_matrices_within_an_epoch(small_corpus, tmp_path):
    trainer = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "run", num_iterations=-1, num_epochs=2,
                                                  batch_size=32, seq_len=64, num_samples=0, optimizer="muon"))
    result = trainer.train()
    rates, epoch = trainer.facts.rates, trainer.data.steps_per_epoch
    assert trainer.total_steps == 2 * epoch and rates.derived("weight_decay")
    assert rates.weight_decay == pytest.approx(1 / (rates.matrix * epoch), rel=1e-12) and rates.weight_decay > 0.1
    decays = {g["role"]: g["weight_decay"] for g in trainer.optimizer.param_groups}
    assert decays == {"matrix": rates.weight_decay, "head": rates.weight_decay, "embedding": 0.0}
    assert result.weight_decay == rates.weight_decay and "the run repeats its data" in rates.describe()


def test_an_adamw_run_records_the_default_weight_decay(small_corpus, tmp_path):
    trainer = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "run", num_iterations=1, num_samples=0))
    assert trainer.train().weight_decay == 0.1
    assert sorted(g["weight_decay"] for g in trainer.optimizer.param_groups) == [0.0, 0.1]


def test_momentum_warms_up_from_085_to_its_target():
    assert [muon_momentum(s, 4, 0.95) for s in range(6)] == pytest.approx([0.85, 0.875, 0.9, 0.925, 0.95, 0.95])
    assert muon_momentum(0, 0, 0.9) == 0.9


def test_the_trainer_sets_muon_s_momentum_each_step(small_corpus, tmp_path):
    """3 steps with a 10-step warmup: the last step ran at 0.85 + 0.1 x 2/10; AdamW's betas unchanged."""
    trainer = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "run", num_iterations=3, num_samples=0,
                                                  muon_momentum_warmup=10, **MUON))
    trainer.train()
    assert [g["momentum"] for g in trainer.optimizer.muon.param_groups] == pytest.approx([0.87])
    assert all(g["betas"] == (0.9, 0.95) for g in trainer.optimizer.adamw.param_groups)


def test_a_resumed_muon_run_is_the_uninterrupted_one(small_corpus, tmp_path, monkeypatch):
    kw = dict(num_iterations=8, save_every=4, eval_every=4, num_samples=0, fp8_opt_level=1, **MUON)
    NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "full", **kw)).train()
    reference = _losses(tmp_path / "full")
    train_until_first_save(tiny_train_kwargs(small_corpus, tmp_path / "cut", **kw), monkeypatch)  # dies at step 4
    NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "cut", resume=True, **kw)).train()
    resumed = _losses(tmp_path / "cut")
    assert [resumed[s] for s in range(1, 9)] == [reference[s] for s in range(1, 9)]


@pytest.mark.two_computations
def test_fp8_momentum_trains_as_fp32_momentum(fp8_run, small_corpus, tmp_path):
    _, _, fp8 = fp8_run
    NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "fp32", num_samples=0, **MUON)).train()
    fp32 = _losses(tmp_path / "fp32")
    assert abs(_tail(fp8) - _tail(fp32)) <= 0.01 * _tail(fp32), (_tail(fp8), _tail(fp32))


def test_a_frozen_muon_group_ends_far_higher(fp8_run, small_corpus, tmp_path, monkeypatch):
    """The bound above can fail: with Muon's steps made no-ops the run ends over 10% higher."""
    _, _, fp8 = fp8_run
    monkeypatch.setattr("nanochat.optim.wrapper.muon_multi", lambda *args, **flags: None)
    NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "frozen", num_samples=0, **MUON)).train()
    assert _tail(_losses(tmp_path / "frozen")) > 1.10 * _tail(fp8)


BF16_MUON = [dict(master_weights="bf16_sr", fp8_opt_level=1),
             dict(master_weights="bf16_sr", fp8_opt_level=1, optimizer_in_backward=True, grad_clip=0.0)]


@pytest.mark.parametrize("extra", BF16_MUON, ids=["sr", "sr-in-backward"])
def test_a_bf16_master_muon_run_trains_and_holds_the_planned_bytes(small_corpus, tmp_path, extra):
    trainer = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "run", num_samples=0, **MUON, **extra))
    result = trainer.train()
    losses = _losses(tmp_path / "run")
    assert _tail(losses) < 0.75 * losses[1], (losses[1], _tail(losses))
    opt, plan = trainer.optimizer, trainer.memory_plan
    assert opt.in_backward == extra.get("optimizer_in_backward", False) and result.fallbacks == []
    muon = [p for g in opt.muon.param_groups for p in g["params"]]
    assert all(p.dtype == torch.bfloat16 and isinstance(opt.muon.state[p]["momentum_buffer"], FP8Tensor)
               and opt.muon.state[p]["step"].item() == 30 for p in muon)
    assert result.state_bytes == {"weights": plan.weights, "optimizer": plan.optimizer, "gradients": plan.gradients}
    assert plan.weights == 2 * plan.num_params


@pytest.mark.parametrize("extra", BF16_MUON, ids=["sr", "sr-in-backward"])
def test_a_resumed_bf16_master_muon_run_is_the_uninterrupted_one(small_corpus, tmp_path, monkeypatch, extra):
    kw = dict(num_iterations=8, save_every=4, eval_every=4, num_samples=0, **MUON, **extra)
    NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "full", **kw)).train()
    train_until_first_save(tiny_train_kwargs(small_corpus, tmp_path / "cut", **kw), monkeypatch)  # dies at step 4
    NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "cut", resume=True, **kw)).train()
    assert _losses(tmp_path / "cut") == _losses(tmp_path / "full")
    full = torch.load(tmp_path / "full" / "checkpoint-000008.pt", weights_only=True)["model"]
    cut = torch.load(tmp_path / "cut" / "checkpoint-000008.pt", weights_only=True)["model"]
    assert all(torch.equal(full[k], cut[k]) for k in full)


@pytest.mark.parametrize("over, fragment", [
    (dict(optimizer="adamw", muon_lr=0.01), "--muon_lr set Muon's hyperparameters, but --optimizer is adamw"),
    (dict(optimizer="adamw", muon_momentum=0.9), "pass --optimizer muon, or drop --muon_momentum"),
    (dict(model_name="some-org/some-llama", muon_lr=0.01), "but --optimizer is adamw"),  # auto: adamw for HF
    (dict(optimizer="muon", muon_lr=1.5), "--muon_lr must be in (0, 1)"),
    (dict(optimizer="muon", muon_momentum=1.0), "--muon_momentum must be in [0, 1)"),
    (dict(optimizer="muon", muon_lr=math.nan), "--muon_lr must be in (0, 1)"),
    (dict(optimizer="adamw", embedding_lr=0.01), "pass --optimizer muon, or drop --embedding_lr"),
    (dict(optimizer="muon", head_lr=0.0), "--head_lr must be in (0, 1)"),
])
def test_bad_muon_settings_are_one_line_errors(over, fragment):
    with pytest.raises(ValueError) as e:
        TrainConfig(**over)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_auto_picks_muon_for_a_preset_and_adamw_for_a_hugging_face_model():
    assert TrainConfig().optimizer == "muon" and TrainConfig(model_name="d2").optimizer == "muon"
    assert TrainConfig(model_name="meta-llama/Meta-Llama-3-8B").optimizer == "adamw"
    assert TrainConfig(model_name="d2", optimizer="adamw").optimizer == "adamw"
    assert TrainConfig(**TrainConfig().to_dict()).optimizer == "muon"  # config.json reads back as it ran


@pytest.mark.parametrize("over, layout", [(dict(fsdp=True), "fsdp x2"), (dict(tp=2), "tp 2")])
def test_muon_under_torchrun_takes_every_layout_and_master_setting(over, layout):
    env = DistEnv(rank=0, local_rank=0, world_size=2)
    for master in ("fp32", "bf16", "bf16_sr", "bf16_split"):  # split matrices are gathered for Newton-Schulz
        cfg = TrainConfig(optimizer="muon", master_weights=master, **over)
        assert preflight.check_layout(cfg, env).name.startswith(layout)
    with pytest.raises(UsageError, match="--optimizer_in_backward"):  # as for AdamW: hooks run before reduction
        preflight.check_layout(TrainConfig(optimizer="muon", optimizer_in_backward=True, grad_clip=0, **over), env)
    with pytest.raises(UsageError, match="--muon_normuon with --(fsdp|tp 2): NorMuon normalizes each neuron") as e:
        preflight.check_layout(TrainConfig(optimizer="muon", muon_normuon=True, **over), env)
    assert "\n" not in str(e.value)
    preflight.check_layout(TrainConfig(optimizer="muon", muon_normuon=True), env)  # DDP: whole matrices


def test_the_plan_counts_one_moment_per_muon_matrix():
    from nanochat.model.gpt import GPTConfig
    config = GPTConfig(n_layer=2, n_head=2, n_kv_head=2, n_embd=128, vocab_size=320, seq_len=32)
    adamw = memory.plan_training(config, batch_size=8, seq_len=32)
    muon = memory.plan_training(config, batch_size=8, seq_len=32, optimizer_kind="muon")
    n_muon = sum(memory.muon_numels(config))
    assert n_muon > 0 and adamw.optimizer - muon.optimizer == 4 * n_muon  # one fp32 moment fewer each
    remedies = muon.replan(free_bytes=1).remedies()  # Muon takes bf16 masters and the in-backward step
    for flag in ("--master_weights bf16_split:", "--master_weights bf16_sr:", "--optimizer_in_backward (needs"):
        assert any(r.startswith(flag) for r in remedies), (flag, remedies)
    assert not any(r.startswith("FSDP") for r in remedies), remedies
    # FSDP shards Muon's momentum as AdamW's moments: over 2 GPUs, the plan of 2 shards
    sharded = muon.replan(free_bytes=muon.replan(shards=2).total).remedies()
    assert any(r.startswith("FSDP over 2 GPUs") for r in sharded), sharded


def _muon_model(seed: int):
    from nanochat.model.gpt import GPT, preset_config
    from nanochat.optim import FP8Optim, muon_param_groups

    torch.manual_seed(seed)
    model = GPT(preset_config("d2", vocab_size=320, seq_len=16))
    model.init_weights()
    split = muon_param_groups(model)
    opt = MuonAdamW(FP8Optim(torch.optim.Muon(split.muon, lr=0.02), opt_level=1, compile=False),
                    FP8Optim(torch.optim.AdamW(split.adamw, lr=1e-2), opt_level=2, compile=False),
                    placements=split.placements)
    return model, opt


def _steps(model, opt, n: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, 320, (2, 17), generator=g)
        model(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_a_muon_checkpoint_round_trips_through_dcp(tmp_path):
    """What a DDP run saves (torch.distributed.checkpoint, here in one process): both optimizers'
    states by parameter name, the FP8 momentum as its codes and scales; a fresh model and
    optimizer loaded from it take the next step exactly as the saved ones do."""
    from nanochat import checkpoint
    from nanochat.checkpoint.nonfinite import nonfinite_state

    model, opt = _muon_model(0)
    _steps(model, opt, 2)
    checkpoint.save_dcp(tmp_path, model, opt, step=2, meta={})
    fresh, fresh_opt = _muon_model(1)  # other weights, no optimizer state yet
    checkpoint.load_dcp(checkpoint.newest(tmp_path).path, fresh, fresh_opt)
    assert nonfinite_state(fresh, fresh_opt) == ""
    for p, q in zip(opt.muon.param_groups[0]["params"], fresh_opt.muon.param_groups[0]["params"]):
        a, b = opt.muon.state[p]["momentum_buffer"], fresh_opt.muon.state[q]["momentum_buffer"]
        assert isinstance(b, FP8Tensor) and torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8))
        assert torch.equal(a.scale, b.scale)
    _steps(model, opt, 1, seed=1)
    _steps(fresh, fresh_opt, 1, seed=1)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name


def test_a_resume_whose_derived_rate_differs_says_which_group_and_trains_at_the_new_one(small_corpus, tmp_path,
                                                                                        monkeypatch, nanochat_log):
    """The checkpoint's embedding trained at 1e-2 (given); resumed without --embedding_lr its rate
    is the recipe's: one warning names the group, both rates and the rule; the others are quiet."""
    kw = dict(num_iterations=6, save_every=3, num_samples=0, **MUON)
    train_until_first_save(tiny_train_kwargs(small_corpus, tmp_path / "run", **kw), monkeypatch)  # dies at step 3
    del kw["embedding_lr"]
    trainer = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "run", resume=True, **kw))
    trainer.train()
    rates = trainer.facts.rates
    said = [w for w in warnings_in(nanochat_log) if "peak learning rate changed" in w]
    assert said == [f"resumed with the embedding group's peak learning rate changed from the checkpoint's 0.01 to "
                    f"{rates.embedding:.4g} ({rates.rules['embedding']})"]
    groups = {g["role"]: g for g in trainer.optimizer.param_groups}  # the checkpoint's groups, roles kept
    last = lr_multiplier(5, 6, trainer.config.warmup_steps, trainer.config.final_lr_frac)
    assert groups["embedding"]["initial_lr"] == rates.embedding != 1e-2
    assert groups["embedding"]["lr"] == pytest.approx(rates.embedding * last, rel=1e-12)
    assert groups["head"]["lr"] == pytest.approx(1e-2 * last, rel=1e-12)


def test_a_resume_with_another_weight_decay_trains_at_it(small_corpus, tmp_path, monkeypatch, nanochat_log):
    kw = dict(num_iterations=6, save_every=3, num_samples=0, weight_decay=0.3, **MUON)
    train_until_first_save(tiny_train_kwargs(small_corpus, tmp_path / "run", **kw), monkeypatch)  # dies at step 3
    kw["weight_decay"] = 0.05
    trainer = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "run", resume=True, **kw))
    trainer.train()
    said = [w for w in warnings_in(nanochat_log) if "weight_decay" in w]
    assert said == ["resumed with --weight_decay changed from the checkpoint's 0.3 to 0.05"]
    decays = {g["role"]: g["weight_decay"] for g in trainer.optimizer.param_groups}
    assert decays == {"matrix": 0.05, "head": 0.05, "embedding": 0.0}
