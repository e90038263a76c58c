"""Tensor parallelism (--tp) on CPU: 2 gloo ranks under torchrun against one process.

What is checked against what (d4: 2 heads, so --tp 2 holds one head per rank; vocabulary 320,
so the embedding and the head split too):
- --tp 2 on 2 ranks, fp32: the same losses, step by step, and the same validation loss as one
  process with the same batches, within LOSS_TOL (tests/test_distributed.py argues it: only the
  order of fp32 reductions differs, here the row-parallel all-reduces' partial sums).
- --tp 2 with FP8 emulated, tensorwise (torchao's FP8 styles) and rowwise (plain styles on
  torchao's Float8Linear), --fp8_opt_level 2: within FP8_LOSS_TOL of one process with the same
  FP8 flags (argued below); FP8 moments as FP8Tensor shards, of the row-split weights too where a
  shard's rows are whole blocks, fp32 elsewhere, recorded as a fallback.
- --tp 2 with --optimizer muon --fp8_opt_level 1: within TP_MUON_LOSS_TOL of one process (argued
  below); each rank keeps its shard of every momentum (FP8 where the shard's rows are whole
  blocks), the update matrices gathered whole for Newton-Schulz.
- --resume across layouts: a checkpoint written by --tp 2 (DCP), FP8 moments or Muon's FP8
  momentum, resumes in one process and as DDP on 2 ranks, with the uninterrupted --tp 2 run's
  later losses (FP8_LOSS_TOL, TP_MUON_LOSS_TOL), and with --tp 2 again bit for bit.
- With `-m slow`: --fsdp --tp 2 on 4 ranks (a 2 x 2 mesh) against one process, fp32 within
  LOSS_TOL and FP8 within FSDP_TP_FP8_LOSS_TOL, its FP8 moments on 2-D shards, and its checkpoint
  resumed in one process; the 2-rank cases run the same tensor-parallel code.
- Without processes: the one-line refusals of the layout (one process, a world that is not
  whole groups, several groups without --fsdp) and of the model (heads or MLP width not
  divisible), MXFP8's; the model's plan and its vocabulary fallback; the memory plan's shards.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from nanochat.common import DistEnv
from tests.conftest import perturbed_init, run_records
from tests.test_distributed import FP8_LOSS_TOL, LOSS_TOL, MUON, _assert_close, _kwargs, _torchrun

FP8 = dict(fp8=True, fp8_emulate=True, fp8_layers="all", fp8_opt_level=2)
HF_LOSS_TOL = 5e-5
"""The tiny Hugging Face models (tests/test_hf.py), fp32 (absolute, losses 4.7-9.5). As LOSS_TOL
argues, only the order of the row-split layers' partial sums differs; but their weights are
drawn with std 0.3, 15 times d4's, so logits and gradients are that much larger and the same
relative difference (~1e-7) moves the loss about 10 times as much. Measured 1.4e-6 (Llama) and
7.2e-6 (Qwen2, whose tied embedding takes gradients from both ends): 5e-5 leaves 7x."""
TP_FP8_LOSS_TOL = FP8_LOSS_TOL
"""FP8 emulated under --tp 2 (absolute, losses ~4.4-5.8). Both ranks read the same tokens, but a
column-split layer's output gradient reaches each rank as that rank's half of the features, and
torchao casts it to FP8 with the scale of that half (one process: of the whole), and the
row-split weights whose shard rows are not whole blocks keep fp32 moments (one process: FP8).
So elements land on other e4m3 grids (2^-4 relative steps): the same kind of rounding noise as
tests/test_distributed.py's FP8 bound, which applies. Measured 1.5e-3 (tensorwise, rowwise) in
train loss and 2.3e-3 / 2.2e-3 in validation loss, against 8.3e-3 / 2.7e-2 between the same
one-process run in FP8 and fp32: 1e-2 leaves 4x over the largest, and a lost shard or a wrong
scale moves these by far more."""
TP_MUON_LOSS_TOL = 2e-3
"""--optimizer muon --fp8_opt_level 1 under --tp 2 (absolute, losses ~4-5.8). The sharded step is
the whole-matrix step (tests/test_muon_sharded.py, bit for bit), and with fp32 momentum the two
sides differ only by fp32's reduction order (measured 4.8e-7 train, 2.1e-7 validation at
--fp8_opt_level 0: LOSS_TOL's kind). At level 1 the attention output projections' shards hold
rows of 128, not whole 256-element blocks, so those 4 of the 24 matrices keep fp32 momentum under
--tp 2 (recorded) and FP8 momentum in one process: the gap is FP8's rounding of those buffers,
bounded by the gap when all 24 change format, one process at level 1 against level 0 (measured
1.0e-3 train, 5.4e-4 validation). 2e-3 leaves 2x over that; measured 2.0e-4 train and 2.2e-4
validation, and a shard orthogonalized alone or a shard's lr factor moves the losses far more."""
FSDP_TP_FP8_LOSS_TOL = 5e-2
"""FP8 emulated under --fsdp --tp 2 on 4 ranks (absolute). On top of the above, each data-parallel
pair reads half of every batch, so the activation scales too are per half batch. The two runs
are then two independent draws of FP8's rounding, each about as far from the exact (fp32) run
as FP8 is, so the gap between them is bounded by about twice one process's FP8-vs-fp32 gap
(measured 8.3e-3 train, 2.7e-2 validation at step 8): 5e-2. Measured 8.9e-3 train and 2.1e-2
validation between the 4-rank and the one-process run."""


def _losses(run_dir: Path, key: str = "loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in run_records(run_dir) if key in r}


def _d4(corpus: Path, run_dir: Path, **over) -> dict:
    return _kwargs(corpus, run_dir, model_name="d4", **over)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "nanochat-cache"  # conftest's _isolated_cache


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    """Two tiny Hugging Face models (4 heads, 2 kv heads, SwiGLU, norm weights): Llama, whose
    vocabulary splits, and Qwen2 with tied embeddings and q/k/v biases, whose embedding stays whole."""
    from tests.test_hf import _save_model

    out = {}
    for kind in ("llama", "qwen2_tied"):
        out[kind] = tmp_path_factory.mktemp(kind)
        _save_model(kind, out[kind])
    return out


def _runs(corpus: Path, out: Path, hf_models: dict[str, Path], **over) -> dict[str, dict]:
    """name -> the kwargs of each run compared across layouts."""
    runs = {"fp32": _d4(corpus, out / "fp32", **over), "fp8": _d4(corpus, out / "fp8", **FP8, **over),
            "rowwise": _d4(corpus, out / "rowwise", **FP8, fp8_recipe="rowwise", **over),
            "muon": _d4(corpus, out / "muon", **MUON, **over)}
    for kind, directory in hf_models.items():
        runs[kind] = _kwargs(corpus, out / kind, model_name=str(directory), **over)
    return runs


@pytest.fixture(scope="module")
def single(small_corpus, tmp_path_factory, cache, hf_models) -> dict[str, Path]:
    """One process, batch 8: d4 in fp32, FP8 tensorwise and rowwise (each --fp8_opt_level 2), Muon
    with FP8 momentum, and the two Hugging Face models in fp32."""
    from nanochat.train.trainer import NanoChatTrainer

    out = tmp_path_factory.mktemp("single_d4")
    runs = _runs(small_corpus, out, hf_models)
    with pytest.MonkeyPatch.context() as mp, perturbed_init():  # the side the perturbation pass moves
        mp.setenv("NANOCHAT_CACHE", str(cache))
        for kwargs in runs.values():
            NanoChatTrainer(**kwargs).train()
    return {name: Path(kw["run_dir"]) for name, kw in runs.items()}


@pytest.fixture(scope="module")
def tp2(small_corpus, tmp_path_factory, cache, single, hf_models) -> dict[str, Path]:
    """--tp 2 on 2 ranks, batch 8 on both (one replica): the same runs, and `cut` and `muon_cut`:
    the FP8 and the Muon run stopped right after their step-4 checkpoints."""
    out = tmp_path_factory.mktemp("tp2")
    runs = [dict(name=name, kwargs=kw) for name, kw in _runs(small_corpus, out, hf_models, tp=2).items()]
    runs.append(dict(name="cut", crash_after_first_save=True,
                     kwargs=_d4(small_corpus, out / "cut", tp=2, save_every=4, **FP8)))
    runs.append(dict(name="muon_cut", crash_after_first_save=True,
                     kwargs=_d4(small_corpus, out / "muon_cut", tp=2, save_every=4, **MUON)))
    _torchrun(2, runs, cache)
    return {r["name"]: out / r["name"] for r in runs}


# --------------------------------------------------------------------------- 2 ranks
@pytest.mark.two_computations
@pytest.mark.parametrize("name", ["llama", "qwen2_tied"])
def test_tp2_splits_hugging_face_models_with_norm_weights_and_biases(tp2, single, name):
    """Norm weights stay whole on every rank, beside DTensor shards (the gradient norm and the
    clipping take both); Qwen2's tied embedding and head stay whole, a recorded fallback."""
    worst = _assert_close(_losses(tp2[name]), _losses(single[name]), HF_LOSS_TOL, f"tp 2 {name} train loss")
    print(f"tp 2 vs one process, {name}: train {worst:.1e}")
    fallbacks = json.loads((tp2[name] / "result.json").read_text())["fallbacks"]
    assert any("tied embedding" in f for f in fallbacks) == (name == "qwen2_tied"), fallbacks


@pytest.mark.two_computations
def test_tp2_matches_one_process(tp2, single):
    worst = _assert_close(_losses(tp2["fp32"]), _losses(single["fp32"]), LOSS_TOL, "tp 2 train loss")
    worst_val = _assert_close(_losses(tp2["fp32"], "val_loss"), _losses(single["fp32"], "val_loss"), LOSS_TOL,
                              "tp 2 val loss")
    print(f"tp 2 vs one process, fp32: train {worst:.1e}, val {worst_val:.1e}")  # shown with -s
    result = json.loads((tp2["fp32"] / "result.json").read_text())
    assert result["parallel"] == "tp 2 (gloo)", result["parallel"]
    assert not result["fallbacks"], result["fallbacks"]


@pytest.mark.two_computations
@pytest.mark.parametrize("name", ["fp8", "rowwise"])
def test_tp2_fp8_matches_one_process_with_fp8_moments_of_the_shards(tp2, single, name):
    got, want = tp2[name], single[name]
    worst = _assert_close(_losses(got), _losses(want), TP_FP8_LOSS_TOL, f"tp 2 {name} train loss")
    worst_val = _assert_close(_losses(got, "val_loss"), _losses(want, "val_loss"), TP_FP8_LOSS_TOL,
                              f"tp 2 {name} val loss")
    print(f"tp 2 vs one process, {name}: train {worst:.1e}, val {worst_val:.1e}")
    states = json.loads((got / "states-rank0.json").read_text())
    # column-split: this rank's rows; row-split: its columns, 512 of mlp.c_proj's 1024 a row (two
    # whole blocks of 256); both FP8Tensor shards. attn.c_proj's 128 columns a row are half a
    # block: fp32 moments, recorded.
    q = states["transformer.h.0.attn.c_q.weight"]
    assert q["local_rows"] * 2 == q["global_rows"] and q["exp_avg"] == "DTensor(FP8Tensor)", q
    assert states["transformer.h.0.mlp.c_proj.weight"]["exp_avg"] == "DTensor(FP8Tensor)", states
    assert states["transformer.h.0.attn.c_proj.weight"]["exp_avg"] == "DTensor(Tensor)", states
    result = json.loads((got / "result.json").read_text())
    assert any("4 tensors" in f and "a shard's rows of 128 are not whole 256-element blocks" in f
               for f in result["fallbacks"]), result["fallbacks"]


@pytest.mark.two_computations
def test_tp2_muon_matches_one_process_with_its_shards_of_the_momentum(tp2, single):
    got, want = tp2["muon"], single["muon"]
    worst = _assert_close(_losses(got), _losses(want), TP_MUON_LOSS_TOL, "tp 2 muon train loss")
    worst_val = _assert_close(_losses(got, "val_loss"), _losses(want, "val_loss"), TP_MUON_LOSS_TOL,
                              "tp 2 muon val loss")
    print(f"tp 2 vs one process, muon: train {worst:.1e}, val {worst_val:.1e}")
    states = json.loads((got / "states-rank0.json").read_text())
    q = states["transformer.h.0.attn.c_q.weight"]  # column-split: this rank's rows, FP8
    assert q["local_rows"] * 2 == q["global_rows"] and q["momentum_buffer"] == "DTensor(FP8Tensor)", q
    assert states["transformer.h.0.mlp.c_proj.weight"]["momentum_buffer"] == "DTensor(FP8Tensor)", states
    assert states["transformer.h.0.attn.c_proj.weight"]["momentum_buffer"] == "DTensor(Tensor)", states
    result = json.loads((got / "result.json").read_text())
    assert any("4 tensors" in f and "a shard's rows of 128 are not whole 256-element blocks" in f
               for f in result["fallbacks"]), result["fallbacks"]


def test_tp2_checkpoint_resumes_exactly_and_in_one_process_and_as_ddp(tp2, cache):
    """The FP8 (AdamW, FP8 moments) and the Muon (FP8 momentum) cuts, each resumed in one process,
    as DDP x2 and as --tp 2 again; the Muon bound is TP_MUON_LOSS_TOL's: the resumed run in
    another layout differs from the --tp 2 run as those layouts do from the start."""
    from nanochat.train.trainer import NanoChatTrainer

    later = lambda losses: {s: losses[s] for s in range(5, 9)}  # noqa: E731
    cases = {"cut": (tp2["fp8"], TP_FP8_LOSS_TOL), "muon_cut": (tp2["muon"], TP_MUON_LOSS_TOL)}
    resumed = []
    for name, (full, tol) in cases.items():
        cut = tp2[name]
        cfg = json.loads((cut / "config.json").read_text())
        one, ddp, same = (Path(f"{cut}_{layout}") for layout in ("one", "ddp", "same"))
        for target in (one, ddp, same):
            shutil.copytree(cut, target)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("NANOCHAT_CACHE", str(cache))
            NanoChatTrainer(**{**cfg, "tp": 1, "run_dir": str(one), "resume": True}).train()
        _assert_close(later(_losses(one)), later(_losses(full)), tol, f"{name}: tp 2 -> one process")
        # DDP on 2 ranks: batch 4 each, the same global batch of 8; and --tp 2 again, which reads
        # every shard (FP8 codes and scales included) as it was written: the same steps, bit for bit
        resumed += [dict(name=f"{name}_ddp", kwargs={**cfg, "tp": 1, "batch_size": 4, "run_dir": str(ddp),
                                                      "resume": True}),
                    dict(name=f"{name}_same", kwargs={**cfg, "run_dir": str(same), "resume": True})]
    _torchrun(2, resumed, cache)
    for name, (full, tol) in cases.items():
        ddp, same = Path(f"{tp2[name]}_ddp"), Path(f"{tp2[name]}_same")
        _assert_close(later(_losses(ddp)), later(_losses(full)), tol, f"{name}: tp 2 -> ddp x2")
        assert later(_losses(same)) == later(_losses(full)), name
        starts = [r for r in run_records(ddp) if r.get("event") == "start"]
        assert starts[-1]["from_step"] == 4 and starts[-1]["world_size"] == 2, starts


def test_a_tp2_run_exports_to_transformers_from_its_shards(tp2, tmp_path):
    """scripts/export_hf.py on the --tp 2 Llama run: its newest checkpoint is a DCP step written
    in shards; transformers' model from the export gives our model's logits (tests/test_hf.py's
    TOL: the same weights, forward passes only)."""
    import torch
    import transformers

    from nanochat.checkpoint import load_model, read_run
    from tests.conftest import load_script
    from tests.test_hf import TOL

    run = tp2["llama"]
    assert (run / "checkpoint_dcp").is_dir() and not list(run.glob("checkpoint-*.pt"))
    assert load_script("export_hf").main(["--run_dir", str(run), "--out_dir", str(tmp_path / "out")]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ours, _ = load_model(read_run(run))
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, ours.eval()(ids), **TOL)


# --------------------------------------------------------------------------- 4 ranks
@pytest.mark.slow
@pytest.mark.two_computations
def test_fsdp_x_tp_on_four_ranks_matches_one_process(small_corpus, tmp_path, cache, single):
    """fp32 and FP8 against one process; the FP8 run's step-4 checkpoint (FP8 moments of 2-D
    shards) resumes in one process with the 4-rank run's later losses."""
    from nanochat.train.trainer import NanoChatTrainer

    four = dict(tp=2, fsdp=True, batch_size=4)
    runs = [dict(name="fp32", kwargs=_d4(small_corpus, tmp_path / "fp32", **four)),
            dict(name="fp8", kwargs=_d4(small_corpus, tmp_path / "fp8", **four, **FP8)),
            dict(name="cut", crash_after_first_save=True, kwargs=_d4(small_corpus, tmp_path / "cut", save_every=4,
                                                                     **four, **FP8))]
    _torchrun(4, runs, cache)
    states = json.loads((tmp_path / "fp8" / "states-rank0.json").read_text())
    assert states["transformer.h.0.attn.c_q.weight"]["exp_avg"] == "DTensor(FP8Tensor)", states
    assert states["transformer.h.0.mlp.c_proj.weight"]["exp_avg"] == "DTensor(FP8Tensor)", states
    _assert_close(_losses(tmp_path / "fp32"), _losses(single["fp32"]), LOSS_TOL, "fsdp x tp train loss")
    _assert_close(_losses(tmp_path / "fp32", "val_loss"), _losses(single["fp32"], "val_loss"), LOSS_TOL,
                  "fsdp x tp val loss")
    _assert_close(_losses(tmp_path / "fp8"), _losses(single["fp8"]), FSDP_TP_FP8_LOSS_TOL, "fsdp x tp fp8 train")
    _assert_close(_losses(tmp_path / "fp8", "val_loss"), _losses(single["fp8"], "val_loss"), FSDP_TP_FP8_LOSS_TOL,
                  "fsdp x tp fp8 val")
    result = json.loads((tmp_path / "fp8" / "result.json").read_text())
    assert result["parallel"].startswith("fsdp 2 x tp 2 (gloo), fp8 all-gather off: under --tp 2"), result["parallel"]
    cfg = json.loads((tmp_path / "cut" / "config.json").read_text())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_CACHE", str(cache))
        NanoChatTrainer(**{**cfg, "tp": 1, "fsdp": False, "batch_size": 8, "resume": True}).train()
    later = lambda losses: {s: losses[s] for s in range(5, 9)}  # noqa: E731
    _assert_close(later(_losses(tmp_path / "cut")), later(_losses(tmp_path / "fp8")), TP_FP8_LOSS_TOL,
                  "fsdp x tp -> one process")


# ------------------------------------------------------------------------ no processes
def _config(**over):
    from nanochat.model.gpt import GPTConfig

    return GPTConfig(**{**dict(vocab_size=320, seq_len=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=128), **over})


@pytest.mark.parametrize("tp, world, fsdp, config, says", [
    (2, 1, False, {}, "and this is one; launch with torchrun --nproc_per_node=2"),
    (2, 3, True, {}, "must be a multiple of --tp"),
    (2, 4, False, {}, "need --fsdp"),
    (4, 4, False, {}, "n_kv_head 2 do not divide by 4"),
    (2, 2, False, dict(n_head=3, n_kv_head=3, n_embd=192), "n_head 3, n_kv_head 3 do not divide by 2"),
    (2, 2, False, dict(intermediate_size=301), "intermediate_size 301"),
])
def test_layouts_that_cannot_split_are_refused_in_one_line(tp, world, fsdp, config, says):
    """The world's refusals (no Layout of it can be built) and the model's (its heads and MLP)."""
    import re

    from nanochat.common import UsageError
    from nanochat.model.parallelize import tp_problem
    from nanochat.parallel.layout import Layout, layout_problem

    world_problem = layout_problem(world_size=world, tp=tp, fsdp=fsdp)
    problem = world_problem or tp_problem(_config(**config), tp)
    assert problem is not None and says in problem and "\n" not in problem, problem
    if world_problem is not None:
        with pytest.raises(UsageError, match=re.escape(world_problem)):
            Layout(world_size=world, tp=tp, fsdp=fsdp)
    assert layout_problem(world_size=4, tp=2, fsdp=True) is None and tp_problem(_config(), 2) is None


def test_vocabulary_that_does_not_divide_stays_whole_and_is_recorded():
    """The run records the layout's fallbacks and the model plan's (nanochat.train.trainer)."""
    import torch

    from nanochat.model.gpt import GPT
    from nanochat.model.parallelize import tp_plan
    from nanochat.parallel.layout import plan_layout

    def plan(**over):
        with torch.device("meta"):
            return tp_plan(GPT(_config(**over)), 2)

    env = DistEnv(rank=0, world_size=2)
    split = plan()
    assert plan_layout(env, fsdp=False, tp=2).fallbacks == () and split.fallbacks == ()
    assert split.splits["transformer.wte"] == "embedding" and split.splits["lm_head"] == "head"
    assert split.splits["transformer.h.1.attn.c_k"] == "colwise"
    assert split.splits["transformer.h.1.mlp.c_proj"] == "rowwise"
    whole = plan(vocab_size=321)
    notes = plan_layout(env, fsdp=True, tp=2).fallbacks + whole.fallbacks
    assert any("--fsdp ignored" in n for n in notes) and any("vocabulary (321)" in n for n in notes), notes
    assert "transformer.wte" not in whole.splits and "lm_head" not in whole.splits
    tied = plan(tie_embeddings=True).fallbacks
    assert any("tied embedding" in n for n in tied), tied


def test_tp_refusals_before_any_work(small_corpus, tmp_path):
    from nanochat.common import UsageError
    from nanochat.train.trainer import NanoChatTrainer

    with pytest.raises(ValueError, match="--tp 2 with --fp8_recipe mxfp8"):
        NanoChatTrainer(**_d4(small_corpus, tmp_path / "mx", tp=2, fp8=True, fp8_recipe="mxfp8")).train()
    with pytest.raises(UsageError, match="--tp 2 splits each layer over 2 processes, and this is one"):
        NanoChatTrainer(**_d4(small_corpus, tmp_path / "one", tp=2)).train()
    assert not (tmp_path / "one").exists() and not (tmp_path / "mx").exists()


def test_memory_plan_counts_tensor_parallel_shards():
    from nanochat.parallel.layout import plan_layout
    from nanochat.train.memory import param_shards

    def shards(world: int, tp: int = 1, fsdp: bool = False) -> int:
        return param_shards(plan_layout(DistEnv(world_size=world), fsdp=fsdp, tp=tp))

    assert shards(2, tp=2) == 2
    assert shards(8, tp=2, fsdp=True) == 8
    assert shards(4, fsdp=True) == 4
    assert shards(4) == 1
