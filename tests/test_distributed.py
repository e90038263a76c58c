"""Distributed training on CPU (gloo, 2 processes under torchrun) against a single process.

What is checked against what:
- DDP (2 ranks x 2 micro-batches of 4) and FSDP2 (2 ranks x 8) runs log the same losses, step
  by step, as one process with batch 16 (the same global batches), and the same validation
  loss. Tolerances are measured (see each constant); the only difference is the order of
  floating-point reductions, except with FP8, where each rank also computes its activation and
  gradient scales over its own half batch (tensorwise scaling is per GEMM, i.e. per rank), so
  the rounding differs slightly.
- FSDP2 with --fp8 --fp8_emulate --fp8_opt_level 2: weights all-gathered in FP8 (reported in
  result.json), Adam moments stored as FP8Tensor *per shard* (DTensor around FP8Tensor, half the
  rows on each rank).
- FSDP2 with --fp8_recipe mxfp8 (emulated): weights all-gathered in high precision (reported),
  and the losses of one process within MX_LOSS_TOL (argued there); step 1 within LOSS_TOL.
- A DCP checkpoint written by 2 FSDP ranks (FP8 moments included) loads into 1 process bit for
  bit (every tensor is the ranks' shards stacked, FP8 codes and scales included), and resumes
  there (batch 16) with the losses of the uninterrupted 2-rank run; with `-m slow`, also in 4.
- With `-m slow`: a checkpoint saved by 3 ranks, whose shards cut FP8 blocks (so those moments
  are fp32 there), resumes at 2 ranks with the uninterrupted run's losses.
- --optimizer muon --fp8_opt_level 1 under DDP and FSDP2 against one process (MUON_LOSS_TOL):
  under FSDP2 each rank keeps its rows of every momentum (FP8 blocks of its shard) and gathers
  each update matrix whole for Newton-Schulz; each run's step-4 DCP checkpoint resumes in one
  process with the uninterrupted 2-rank run's later losses.
- DDP and FSDP2 with --fp8_mode auto --fp8_auto_recheck_every 2: every rank ends with the same formats and the
  same sampled statistics, counted over the global batch (each rank's counts are all-reduced,
  so the decisions cannot differ between ranks).
- DCP checkpoints are verified: every step directory has a manifest hashing all its files, the
  newest --keep_checkpoints steps are kept; at 2 ranks a flipped byte in a shard is refused at
  resume on every rank (naming the file and the previous step), and the temporary directory of
  a killed save is removed and the run resumes from the previous step with the uninterrupted
  run's losses.
- Without processes (nanochat.checkpoint.dcp): DCP save/load round trip in one process is
  bitwise; an interrupted save leaves the previous checkpoint loadable, its temporary directory
  is removed while a step directory nanochat did not commit is kept (and --overwrite's removal
  keeps it too); a flipped byte is refused; a NaN weight is named, and passed over by the last
  good finite step; --fsdp in one process is a recorded fallback; a restarted worker group on the
  previous group's rendezvous store (torchrun's shared store) is refused, naming the fix.

The fast multi-process runs share one torchrun launch (`_worker` below, this file run as
a script): on 2 shared cores each launch costs ~10 s of startup.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import pytest
import torch

from nanochat.checkpoint import PT, committed
from tests.conftest import perturbed_init, run_launch, run_launches, run_records, tiny_train_kwargs

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).parent / "torchrun"
STEPS = 8

# 2 ranks against 1 process, 8 steps of d2 at lr 1e-2. Every comparison is of losses: the weights
# of two computations drift apart where Adam amplifies a last-bit difference (near-zero gradients),
# and those weights are exactly the ones that barely move the loss.
LOSS_TOL = 1e-5
"""fp32 (absolute, at losses ~4.6): the two sides differ only in the order of the gradient
reduction (two halves all-reduced vs one batch), ~1e-7 relative in the gradients (see
tests/test_trainer.py's accumulation test); the loss, a mean over 512 tokens, moves by that and
by the first-order effect of the drifted weights (gradient x drift, both small). Measured at most
9.5e-7 in train loss (two fp32 ulps at 4.6) and 6.4e-7 in validation loss, the same under the
perturbation pass: 1e-5 leaves 10x."""
FP8_LOSS_TOL = 1e-2
"""FP8 emulated (absolute): here the sides do not round the same values. Tensorwise scaling takes
each GEMM's amax, and each rank's amax is over its own half batch, so every activation and gradient
element lands on another FP8 grid (e4m3: 2^-4 relative steps): two equally valid draws of FP8's
rounding noise. That noise, not fp32's summation order (2^-24), sets the difference, so it does
not depend on the CPU: measured 2.0-3.2e-3 in train loss and 4.2e-3 in validation loss, with and
without the perturbation pass; between a resumed and the uninterrupted run, at most 1.2e-3
(2 ranks -> 1 and -> 4) and 1e-4 (3 -> 2). 1e-2 leaves 2.4x over the largest, and a real fault
(a lost shard, a wrong scale) moves these losses by far more."""
MUON = dict(optimizer="muon", muon_lr=0.02, fp8_opt_level=1)
MUON_LOSS_TOL = 1e-4
"""--optimizer muon with FP8 momentum (absolute). The ranks' gradients differ from one process's
by fp32's reduction order (~1e-7 relative, as under LOSS_TOL), but the momentum is written in
e4m3: an element within 1e-7 of a rounding boundary (of 2^-4 relative steps) lands on the other
side, so a few elements of the buffer differ by a whole e4m3 step, and Newton-Schulz spreads
that over the matrix's update. The weights then differ by ~lr x 2^-4 x (share of such elements),
far below FP8 layers' own noise (FP8_LOSS_TOL) but above fp32's. FSDP2 adds nothing of another
kind: its gradients are reduce-scattered (another fp32 order), the gathered update matrix holds
the same floats as one process's whole one, and each rank's momentum blocks are the whole
matrix's blocks (tests/test_muon_sharded.py: the sharded step is the whole-matrix step bit for
bit). Measured at most 1.9e-6 (DDP) and 2.4e-6 (FSDP2) in train loss, 1.2e-5 (both) in
validation loss and 4.8e-7 for the runs resumed in one process; 1e-4 leaves 8x."""
MX_LOSS_TOL = FP8_LOSS_TOL
"""MXFP8 emulated under FSDP2 (absolute). Unlike tensorwise, the two sides cast the same values the
same way at first: every MX block lies within one rank's tokens (blocks of 32 along K for the
forward and grad-input casts, per token; along the tokens for the weight-gradient casts, and
seq_len 32 makes each such block one sequence, which one rank reads whole), and the weights are
all-gathered in fp32 and cast whole. So step 1's loss differs only by fp32's reduction order
(LOSS_TOL, checked; measured equal). From step 2 the weights differ by that order (~1e-7
relative), which Adam amplifies where gradients are near zero (LOSS_TOL's note), and every value
such a difference carries across an e4m3 rounding boundary lands a whole quantum (2^-4 relative)
away: the same kind of FP8 rounding noise as FP8_LOSS_TOL's, so its bound applies. Measured
1.2e-3 in train and validation loss (tensorwise here: 1.7e-3 / 4.6e-3)."""


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run_records(run_dir) if "loss" in r}


def _val_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in run_records(run_dir) if "val_loss" in r}


def _kwargs(corpus: Path, run_dir: Path, **over) -> dict:

    return tiny_train_kwargs(corpus, run_dir, **{"num_iterations": STEPS, "eval_every": 4, **over})


def _launch_env(cache: Path) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return dict(os.environ, OMP_NUM_THREADS="1", NANOCHAT_CACHE=str(cache), PYTHONPATH=path)


def _torchrun(nproc: int, runs: list[dict], cache: Path, timeout: int = 600) -> None:
    """Run `runs` (see _worker) in one torchrun launch of `nproc` CPU processes."""
    # --standalone: a local rendezvous on a port torchrun picks itself (free, no race)
    cmd = [str(TORCHRUN), "--standalone", f"--nproc_per_node={nproc}", str(Path(__file__)), json.dumps(runs)]
    r = run_launch(cmd, env=_launch_env(cache), cwd=ROOT, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]


def _argv(kw: dict) -> list[str]:
    """`kw` (eager, see tiny_train_kwargs) as base_train's flags."""
    return ["--no_compile"] + [a for k, v in kw.items() if k != "compile" for a in (f"--{k}", str(v))]


def _node_agent(port: int, argv: list[str], *rdzv_conf: str) -> list[str]:
    """One node's torchrun agent of a 2-node job, one process each, meeting at a c10d rendezvous
    on 127.0.0.1:`port` (its id unique to the port: a leftover agent of another job cannot join)."""
    return [str(TORCHRUN), "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=nanochat-test-{port}",
            *(["--rdzv_conf", ",".join(rdzv_conf)] if rdzv_conf else []), str(ROOT / "scripts" / "base_train.py"), *argv]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "nanochat-cache"  # conftest's _isolated_cache


@pytest.fixture(scope="module")
def single(small_corpus, tmp_path_factory, cache) -> dict[str, Path]:
    """One process, batch 16: the reference runs (plain fp32 and FP8 level 2)."""
    from nanochat.train.trainer import NanoChatTrainer

    out = tmp_path_factory.mktemp("single")
    runs = {"fp32": {}, "fp8": dict(fp8=True, fp8_emulate=True, fp8_layers="all", fp8_opt_level=2),
            "mxfp8": dict(fp8=True, fp8_emulate=True, fp8_layers="all", fp8_recipe="mxfp8"),
            "split": dict(fp8=True, fp8_emulate=True, fp8_layers="all", fp8_opt_level=2,
                          master_weights="bf16_split"),
            "muon": MUON}
    with pytest.MonkeyPatch.context() as mp, perturbed_init():  # the side the perturbation pass moves
        mp.setenv("NANOCHAT_CACHE", str(cache))
        for name, extra in runs.items():
            NanoChatTrainer(**_kwargs(small_corpus, out / name, batch_size=16, **extra)).train()
    return {name: out / name for name in runs}


@pytest.fixture(scope="module")
def two_ranks(small_corpus, tmp_path_factory, cache, single) -> dict[str, Path]:
    """2 ranks, 8 sequences per step each: DDP (through the CLI, 2 micro-batches of 4), FSDP,
    FSDP + FP8, Muon under DDP and FSDP, and runs interrupted right after their step-4 checkpoint."""
    out = tmp_path_factory.mktemp("ws2")
    fp8 = dict(fp8=True, fp8_emulate=True, fp8_layers="all", fp8_opt_level=2)
    runs = [
        # 2 ranks x 4 sequences x 2 micro-batches: also checks DDP's no_sync accumulation
        dict(name="ddp", cli=True,
             kwargs=_kwargs(small_corpus, out / "ddp", batch_size=4, grad_accum_steps=2)),
        dict(name="fsdp", kwargs=_kwargs(small_corpus, out / "fsdp", fsdp=True)),
        dict(name="fsdp_fp8", kwargs=_kwargs(small_corpus, out / "fsdp_fp8", fsdp=True, **fp8)),
        dict(name="fsdp_mxfp8", kwargs=_kwargs(small_corpus, out / "fsdp_mxfp8", fsdp=True, fp8=True, fp8_emulate=True,
                                               fp8_layers="all", fp8_recipe="mxfp8")),
        dict(name="ddp_fp8", kwargs=_kwargs(small_corpus, out / "ddp_fp8", **fp8)),
        dict(name="fsdp_split", kwargs=_kwargs(small_corpus, out / "fsdp_split", fsdp=True,
                                               master_weights="bf16_split", **fp8)),
        dict(name="ddp_in_backward", expect_error=True,
             kwargs=_kwargs(small_corpus, out / "ddp_in_backward", optimizer_in_backward=True, grad_clip=0.0)),
        dict(name="ddp_auto", record_fp8=True,
             kwargs=_kwargs(small_corpus, out / "ddp_auto", fp8=True, fp8_emulate=True, fp8_layers="all",
                            fp8_mode="auto", fp8_auto_steps=2, fp8_stats_every=2, fp8_auto_recheck_every=2)),
        dict(name="fsdp_auto", record_fp8=True,
             kwargs=_kwargs(small_corpus, out / "fsdp_auto", fsdp=True, fp8=True, fp8_emulate=True, fp8_layers="all",
                            fp8_mode="auto", fp8_auto_steps=2, fp8_stats_every=2, fp8_auto_recheck_every=2)),
        dict(name="cut", crash_after_first_save=True,
             kwargs=_kwargs(small_corpus, out / "cut", fsdp=True, save_every=4, **fp8)),
        dict(name="ddp_muon", kwargs=_kwargs(small_corpus, out / "ddp_muon", **MUON)),
        dict(name="ddp_muon_cut", crash_after_first_save=True,
             kwargs=_kwargs(small_corpus, out / "ddp_muon_cut", save_every=4, **MUON)),
        dict(name="fsdp_muon", kwargs=_kwargs(small_corpus, out / "fsdp_muon", fsdp=True, **MUON)),
        dict(name="fsdp_muon_cut", crash_after_first_save=True,
             kwargs=_kwargs(small_corpus, out / "fsdp_muon_cut", fsdp=True, save_every=4, **MUON)),
        # "fsdp" saving every 2 steps: steps 2, 4, 6, 8 saved, the newest 2 kept
        dict(name="kept", kwargs=_kwargs(small_corpus, out / "kept", fsdp=True, save_every=2,
                                         keep_checkpoints=2)),
    ]
    _torchrun(2, runs, cache)
    shutil.copytree(out / "cut", out / "cut_for_4")  # the 1-process resume rewrites "cut"
    return {r["name"]: Path(r["kwargs"]["run_dir"]) for r in runs} | {"cut_for_4": out / "cut_for_4"}


# ---------------------------------------------------------------------------------- tests
def _assert_close(got: dict[int, float], want: dict[int, float], tol: float, what: str) -> float:
    assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
    worst = max(abs(got[s] - want[s]) for s in want)
    print(f"{what}: worst {worst:.2e} (bound {tol:.0e})")  # shown with -s
    assert worst <= tol, (what, worst, {s: (got[s], want[s]) for s in want})
    return worst


@pytest.mark.two_computations
@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_two_ranks_match_one_process(two_ranks, single, name):
    _assert_close(_losses(two_ranks[name]), _losses(single["fp32"]), LOSS_TOL, f"{name} train loss")
    _assert_close(_val_losses(two_ranks[name]), _val_losses(single["fp32"]), LOSS_TOL, f"{name} val loss")
    result = json.loads((two_ranks[name] / "result.json").read_text())
    assert result["parallel"].startswith(f"{name} x2 (gloo)"), result["parallel"]
    assert (two_ranks[name] / "checkpoint_dcp" / "LATEST").is_file()
    assert not committed(two_ranks[name], (PT,))


@pytest.mark.two_computations
def test_ddp_fp8_matches_one_process(two_ranks, single):
    """DDP with --fp8 --fp8_emulate --fp8_opt_level 2: every rank holds whole FP8 states; the
    losses match one process with the same global batch within FP8_LOSS_TOL (each rank scales
    its tensorwise FP8 casts over its own half of the batch, hence the wider tolerance)."""
    run = two_ranks["ddp_fp8"]
    worst_train = _assert_close(_losses(run), _losses(single["fp8"]), FP8_LOSS_TOL, "ddp fp8 train loss")
    worst_val = _assert_close(_val_losses(run), _val_losses(single["fp8"]), FP8_LOSS_TOL, "ddp fp8 val loss")
    print(f"ddp fp8 vs one process: train {worst_train:.1e}, val {worst_val:.1e}")  # shown with -s
    assert json.loads((run / "result.json").read_text())["parallel"].startswith("ddp x2 (gloo)")


@pytest.mark.two_computations
@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_muon_matches_one_process_and_resumes_in_one(two_ranks, single, cache, name):
    """--optimizer muon --fp8_opt_level 1 under DDP (every rank holds whole matrices and steps
    them alike) and FSDP2 (each rank holds its rows of every matrix and of its FP8 momentum, and
    gathers the update matrix whole for Newton-Schulz): the losses match one process with the
    same global batch within MUON_LOSS_TOL. The run cut after its step-4 DCP checkpoint resumes
    in one process (batch 16: the FSDP momentum's shards stacked) and ends as the 2-rank run does."""
    from nanochat.train.trainer import NanoChatTrainer

    run = two_ranks[f"{name}_muon"]
    worst = _assert_close(_losses(run), _losses(single["muon"]), MUON_LOSS_TOL, f"{name} muon train loss")
    worst_val = _assert_close(_val_losses(run), _val_losses(single["muon"]), MUON_LOSS_TOL, f"{name} muon val loss")
    print(f"{name} muon vs one process: train {worst:.1e}, val {worst_val:.1e}")  # shown with -s
    states = json.loads((run / "states-rank0.json").read_text())
    muon = [s for n, s in states.items() if "transformer.h." in n]
    kind, rows = ("DTensor(FP8Tensor)", 2) if name == "fsdp" else ("FP8Tensor", 1)
    assert len(muon) == 12 and all(s["momentum_buffer"] == kind and s["local_rows"] * rows == s["global_rows"]
                                   for s in muon), states
    cut = two_ranks[f"{name}_muon_cut"]
    cfg = json.loads((cut / "config.json").read_text())
    cfg.update(batch_size=16, resume=True)  # same global batch: 1 x 16 = 2 x 8
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_CACHE", str(cache))
        NanoChatTrainer(**cfg).train()
    resumed = _losses(cut)
    _assert_close({s: resumed[s] for s in range(5, STEPS + 1)}, {s: _losses(run)[s] for s in range(5, STEPS + 1)},
                  MUON_LOSS_TOL, f"{name} muon resumed in one process")


@pytest.mark.two_computations
def test_fsdp_fp8_matches_one_process_with_sharded_fp8_states(two_ranks, single):
    run = two_ranks["fsdp_fp8"]
    _assert_close(_losses(run), _losses(single["fp8"]), FP8_LOSS_TOL, "fsdp fp8 train loss")
    _assert_close(_val_losses(run), _val_losses(single["fp8"]), FP8_LOSS_TOL, "fsdp fp8 val loss")
    result = json.loads((run / "result.json").read_text())
    assert "fp8 all-gather on" in result["parallel"], result["parallel"]
    # the worker recorded, on each rank, what the optimizer holds for every parameter
    for rank in (0, 1):
        states = json.loads((run / f"states-rank{rank}.json").read_text())
        assert states, "no optimizer state recorded"
        for name, s in states.items():
            assert s["exp_avg"] == s["exp_avg_sq_sqrt"] == "DTensor(FP8Tensor)", (name, s)
            assert s["local_rows"] * 2 == s["global_rows"], (name, s)  # this rank's half


@pytest.mark.two_computations
def test_fsdp_mxfp8_gathers_weights_in_high_precision_and_matches_one_process(two_ranks, single):
    run = two_ranks["fsdp_mxfp8"]
    got, want = _losses(run), _losses(single["mxfp8"])
    _assert_close({1: got[1]}, {1: want[1]}, LOSS_TOL, "fsdp mxfp8 step-1 loss")  # the same casts
    _assert_close(got, want, MX_LOSS_TOL, "fsdp mxfp8 train loss")
    _assert_close(_val_losses(run), _val_losses(single["mxfp8"]), MX_LOSS_TOL, "fsdp mxfp8 val loss")
    result = json.loads((run / "result.json").read_text())
    assert len(result["fp8_converted"]) == 12 and result["fp8_backend"] == "emulated"
    assert ("fp8 all-gather off: needs the tensorwise recipe (one scale per weight); mxfp8 all-gathers the "
            "weights in high precision") in result["parallel"], result["parallel"]
    for rank in (0, 1):
        states = json.loads((run / f"states-rank{rank}.json").read_text())
        assert all(s["local_rows"] * 2 == s["global_rows"] for s in states.values())  # sharded


@pytest.mark.two_computations
def test_fsdp_bf16_split_matches_one_process_with_sharded_remainders(two_ranks, single):
    """bf16 parameters sharded by FSDP2, their 16-bit remainders sharded like them: the losses
    match one process within FP8_LOSS_TOL (the ranks' bf16 gradients are summed in bf16)."""
    run = two_ranks["fsdp_split"]
    worst = _assert_close(_losses(run), _losses(single["split"]), FP8_LOSS_TOL, "fsdp bf16_split train loss")
    print(f"fsdp bf16_split vs one process: train {worst:.1e}")  # shown with -s
    for rank in (0, 1):
        states = json.loads((run / f"states-rank{rank}.json").read_text())
        for name, s in states.items():
            assert s["master_lo"] == "DTensor(Tensor)", (name, s)
            assert s["local_rows"] * 2 == s["global_rows"], (name, s)


# What a rank runs for the exit test: base_train itself, with the process group's destruction
# watched. The hang it guards against is a race (a gloo thread that needs the GIL to free its last
# collective's tensors, joined by a main thread that holds it), so one run that exits proves
# little; what decides it is deterministic: whether a DDP Reducer still owns the group when the
# group is destroyed (then the Reducer is its last owner, and lets go with the GIL held).
_EXIT_DRIVER = """
import gc, json, runpy, sys
from pathlib import Path
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

out, script, argv = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
real_destroy = dist.destroy_process_group

def watched_destroy(group=None):
    gc.collect()
    held = sum(1 for o in gc.get_objects() if isinstance(o, DDP) and "reducer" in vars(o))
    (out / f"destroy-rank{dist.get_rank()}.json").write_text(json.dumps({"ddp_reducers_alive": held}))
    real_destroy(group)

dist.destroy_process_group = watched_destroy
sys.argv = [script, *argv]
runpy.run_path(script, run_name="__main__")
"""


def test_a_two_rank_run_destroys_its_process_group_after_ddp_lets_go(small_corpus, tmp_path, cache):
    """base_train under torchrun (2 gloo ranks, DDP, the process group its own) exits with rc 0
    after printing its results, and when it destroys the process group no DDP Reducer holds the
    group any more on either rank, so gloo's threads are joined without the GIL held."""
    driver = tmp_path / "driver.py"
    driver.write_text(_EXIT_DRIVER)
    argv = _argv(_kwargs(small_corpus, tmp_path / "run", num_iterations=3, num_samples=0))
    r = run_launch([str(TORCHRUN), "--standalone", "--nproc_per_node=2", str(driver), str(tmp_path),
                    str(ROOT / "scripts" / "base_train.py"), *argv], env=_launch_env(cache), cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "results:" in r.stdout, r.stdout[-3000:]
    for rank in (0, 1):
        record = json.loads((tmp_path / f"destroy-rank{rank}.json").read_text())
        assert record == {"ddp_reducers_alive": 0}, (rank, record)


@pytest.mark.two_computations
def test_two_nodes_train_as_one_and_their_checkpoint_resumes_in_one_process(two_ranks, small_corpus, tmp_path, cache):
    """Two torchrun agents (--nnodes=2 --nproc_per_node=1, a c10d rendezvous on 127.0.0.1) train
    the "ddp" job of one agent with 2 processes, through base_train, into one run directory: the
    same losses and validation losses bit for bit. Bit for bit because nothing differs but the
    launch: each rank reads its share of the batch by RANK, whichever node holds it, and with
    2 ranks every reduced element is one sum a + b, which IEEE rounds the same in either order.
    Both ranks' DCP shards are in the shared directory; the checkpoint the two nodes wrote at step
    4 resumes in one process (batch 8 x 2 micro-batches = 2 ranks x 4 x 2) with the 2-node run's
    losses within LOSS_TOL (one batch instead of two halves reduced: see LOSS_TOL)."""
    from nanochat.train.trainer import NanoChatTrainer

    run_dir = tmp_path / "nodes"
    kw = _kwargs(small_corpus, run_dir, batch_size=4, grad_accum_steps=2, save_every=4)
    agent = _node_agent(_free_port(), _argv(kw))
    for r in run_launches([agent, agent], env=_launch_env(cache), cwd=ROOT, timeout=300):
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print(f"2 nodes: val losses {_val_losses(run_dir)}; 1 node: {_val_losses(two_ranks['ddp'])}")  # shown with -s
    assert _losses(run_dir) == _losses(two_ranks["ddp"]) and _val_losses(run_dir) == _val_losses(two_ranks["ddp"])
    assert json.loads((run_dir / "result.json").read_text())["parallel"] == "ddp x2 (gloo)"
    step4 = run_dir / "checkpoint_dcp" / "step-000004"
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(json.loads((step4 / "manifest.json").read_text())["files"])

    cut = tmp_path / "cut"  # the 2-node run as it was after step 4
    shutil.copytree(run_dir, cut)
    shutil.rmtree(cut / "checkpoint_dcp" / "step-000008")
    with perturbed_init():  # the side the perturbation pass moves (its gradients)
        NanoChatTrainer(**{**kw, "run_dir": str(cut), "batch_size": 8, "resume": True}).train()
    resumed, nodes = _losses(cut), _losses(run_dir)
    _assert_close({s: resumed[s] for s in range(5, STEPS + 1)}, {s: nodes[s] for s in range(5, STEPS + 1)},
                  LOSS_TOL, "2 nodes' checkpoint resumed in 1 process")


def test_a_node_that_never_arrives_fails_the_rendezvous_in_time_writing_nothing(small_corpus, tmp_path, cache):
    """One agent of a 2-node job alone: torchrun's rendezvous times out (join_timeout, 3 s here)
    before it starts any process, so nanochat's code never runs. The agent exits 1 soon after
    join_timeout, its stderr ending in torchrun's own line after its traceback, and the run
    directory was never created."""
    run_dir = tmp_path / "lone"
    t0 = time.monotonic()
    r = run_launch(_node_agent(_free_port(), _argv(_kwargs(small_corpus, run_dir)), "join_timeout=3"),
                   env=_launch_env(cache), cwd=ROOT, timeout=120)
    elapsed = time.monotonic() - t0
    assert r.returncode == 1 and 3 <= elapsed < 3 + 30, (r.returncode, elapsed)
    assert r.stderr.strip().splitlines()[-1] == "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError"
    assert not run_dir.exists()


def test_optimizer_in_backward_is_refused_under_torchrun(two_ranks):
    for rank in (0, 1):
        msg = (two_ranks["ddp_in_backward"] / f"error-rank{rank}.txt").read_text()
        assert "--optimizer_in_backward under torchrun" in msg and "ddp x2" in msg, msg
    assert not (two_ranks["ddp_in_backward"] / "metrics.jsonl").exists()  # refused before any step


@pytest.mark.parametrize("name", ["ddp_auto", "fsdp_auto"])
def test_auto_decides_the_same_on_every_rank_from_global_counts(two_ranks, name):
    run = two_ranks[name]
    r0, r1 = (json.loads((run / f"fp8-rank{rank}.json").read_text()) for rank in (0, 1))
    assert r0["choices"] and r0["choices"] == r1["choices"]
    assert r0["stats"] and r0["stats"] == r1["stats"]  # every figure, bit for bit
    # counted over both ranks' batches: 2 ranks x 8 sequences x 32 tokens, 128 features, and
    # tensorwise casts the input twice (forward GEMM, grad_weight GEMM)
    c_fc = r0["stats"]["transformer.h.0.mlp.c_fc"]
    assert c_fc["input"]["numel"] == 2 * (2 * 8 * 32) * 128
    # the whole weight, also under FSDP (measured while its block is unsharded), on each rank
    assert c_fc["weight"]["numel"] == 2 * 2 * (512 * 128)
    result = json.loads((run / "result.json").read_text())
    assert result["fp8_choices"] == r0["choices"]


@pytest.mark.two_computations
def test_checkpoint_from_two_ranks_resumes_in_one_process(two_ranks):
    from nanochat import checkpoint
    from nanochat.train.trainer import NanoChatTrainer

    cut = two_ranks["cut"]
    assert json.loads((cut / "checkpoint_dcp" / "LATEST").read_text())["step"] == 4
    # Resharding is exact: loaded into one process, every parameter and every FP8 moment (codes
    # and block scales) is the two ranks' shards stacked, bit for bit, without requantization.
    model, opt = _tiny_model_and_optimizer(1, seq_len=32)  # the same names as the FP8 model's
    checkpoint.load_dcp(checkpoint.newest(cut).path, model, opt)
    shards = [torch.load(cut / f"shards-rank{r}.pt") for r in (0, 1)]
    loaded = _flat_state(model, opt)
    assert sorted(shards[0]) == sorted(k for k in loaded if "/step" not in k)
    assert any("/codes" in k for k in loaded)
    for k, rank0 in shards[0].items():
        assert torch.equal(loaded[k], torch.cat([rank0, shards[1][k]])), k

    cfg = json.loads((cut / "config.json").read_text())
    cfg.update(batch_size=16, resume=True)  # same global batch: 1 x 16 = 2 x 8
    NanoChatTrainer(**cfg).train()
    resumed, full = _losses(cut), _losses(two_ranks["fsdp_fp8"])  # steps 1-4: the 2-rank run's
    _assert_close({s: resumed[s] for s in range(5, STEPS + 1)},
                  {s: full[s] for s in range(5, STEPS + 1)}, FP8_LOSS_TOL, "resumed at ws 1")
    assert committed(cut, (PT,)) and not (cut / "checkpoint_dcp").exists()


@pytest.mark.two_computations
def test_dcp_keeps_the_newest_steps_each_with_a_manifest(two_ranks, single):
    run = two_ranks["kept"]
    _assert_close(_losses(run), _losses(single["fp32"]), LOSS_TOL, "saving every 2 steps")
    root = run / "checkpoint_dcp"
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "step-000006", "step-000008"]
    assert json.loads((root / "LATEST").read_text())["dir"] == "step-000008"
    for step_dir in root.glob("step-*"):  # both ranks' shards, the index and trainer.json, hashed
        files = json.loads((step_dir / "manifest.json").read_text())["files"]
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "trainer.json"} <= set(files), files


def test_damaged_or_interrupted_dcp_step_at_resume(two_ranks, single, tmp_path, cache):
    """At 2 ranks, from copies of the "kept" run (steps 6 and 8): a flipped byte in rank 1's shard
    of step 8 is refused on every rank, naming the file and step 6; step 8's temporary directory
    without its manifest (a save killed after the shards: LATEST still names step 6) is removed at
    the start, and the run resumes from step 6 with the uninterrupted run's losses."""
    from nanochat.checkpoint.dcp import MANIFEST_NAME

    cfg = json.loads((two_ranks["kept"] / "config.json").read_text())
    runs = {}
    for name in ("flipped", "interrupted"):
        shutil.copytree(two_ranks["kept"], tmp_path / name)
        runs[name] = {**cfg, "run_dir": str(tmp_path / name), "resume": True}
    runs["flipped"]["num_iterations"] = STEPS + 2  # the run finished at step 8: extended, it reads step 8
    shard = tmp_path / "flipped" / "checkpoint_dcp" / "step-000008" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    cut = tmp_path / "interrupted" / "checkpoint_dcp"
    (cut / "step-000008" / MANIFEST_NAME).unlink()
    (cut / "step-000008" / "stale").write_text("")
    (cut / "step-000008").rename(cut / ".tmp-step-000008-4242-0badc0de")  # the save's own directory
    (cut / "LATEST").write_text(json.dumps({"dir": "step-000006", "step": 6}))
    _torchrun(2, [dict(name="flipped", expect_error=True, kwargs=runs["flipped"]),
                  dict(name="interrupted", kwargs=runs["interrupted"])], cache)
    for rank in (0, 1):
        msg = (tmp_path / "flipped" / f"error-rank{rank}.txt").read_text()
        assert str(shard) in msg and "corrupted" in msg, msg
        assert "step-000006 (step 6) verifies" in msg and "run again with --resume" in msg, msg
    assert sorted(p.name for p in cut.iterdir()) == ["LATEST", "step-000006", "step-000008"]
    assert not (cut / "step-000008" / "stale").exists()  # written anew by the resumed run
    resumed, want = _losses(tmp_path / "interrupted"), _losses(single["fp32"])
    _assert_close({s: resumed[s] for s in (7, 8)}, {s: want[s] for s in (7, 8)}, LOSS_TOL, "resumed at 6")


@pytest.mark.slow
def test_checkpoint_from_two_ranks_resumes_in_four(two_ranks, cache):
    """4 processes on 2 cores: ~1 min more, hence slow; the 1-process resume is the fast twin."""
    run_dir = two_ranks["cut_for_4"]
    cfg = json.loads((run_dir / "config.json").read_text())
    cfg.update(batch_size=4, resume=True, run_dir=str(run_dir))  # 4 x 4 = 2 x 8
    _torchrun(4, [dict(name="resume4", kwargs=cfg)], cache)
    resumed, full = _losses(run_dir), _losses(two_ranks["fsdp_fp8"])
    _assert_close({s: resumed[s] for s in range(5, STEPS + 1)},
                  {s: full[s] for s in range(5, STEPS + 1)}, FP8_LOSS_TOL, "resumed at ws 4")
    assert json.loads((run_dir / "checkpoint_dcp" / "LATEST").read_text())["step"] == STEPS
    for rank in range(4):  # a quarter of the rows each, moments still FP8
        states = json.loads((run_dir / f"states-rank{rank}.json").read_text())
        assert all(s["exp_avg"] == "DTensor(FP8Tensor)" and s["local_rows"] * 4 == s["global_rows"]
                   for s in states.values()), states


@pytest.mark.slow
def test_checkpoint_resumes_where_shards_cut_fp8_blocks(small_corpus, tmp_path, cache, single):
    """d2 at 3 ranks: 128-row weights split 43/43/42 rows of 128, not whole 256-element blocks, so
    those tensors keep fp32 moments there (FP8Optim's summary says why). Saved at 3 ranks, resumed
    at 2 (where they are FP8 again): the moments are requantized, the losses continue."""
    fp8 = dict(fp8=True, fp8_emulate=True, fp8_layers="all", fp8_opt_level=2, fsdp=True, num_iterations=4,
               eval_every=0, num_samples=0)
    full = _kwargs(small_corpus, tmp_path / "full", batch_size=4, **fp8)
    cut = _kwargs(small_corpus, tmp_path / "cut", batch_size=4, save_every=2, **fp8)
    _torchrun(3, [dict(name="full", kwargs=full), dict(name="cut", crash_after_first_save=True, kwargs=cut)],
              cache)
    _torchrun(2, [dict(name="resume", kwargs={**cut, "batch_size": 6, "resume": True})], cache)
    resumed, want = _losses(tmp_path / "cut"), _losses(tmp_path / "full")
    _assert_close({s: resumed[s] for s in (3, 4)}, {s: want[s] for s in (3, 4)}, FP8_LOSS_TOL,
                  "saved at 3 ranks, resumed at 2")


# ------------------------------------------------------------- one process, no process group
def _tiny_model_and_optimizer(seed: int, seq_len: int = 16):
    from nanochat.fp8 import FP8Optim
    from nanochat.model.gpt import GPT, preset_config

    torch.manual_seed(seed)
    model = GPT(preset_config("d2", vocab_size=320, seq_len=seq_len))
    model.init_weights()
    adamw = torch.optim.AdamW(model.param_groups(0.1), lr=1e-2)
    return model, FP8Optim(adamw, opt_level=2, compile=False)


def _train_steps(model, optimizer, n: int) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        x = torch.randint(0, 320, (2, 17), generator=g)
        model(x[:, :-1], x[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _flat_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and every optimizer state tensor (FP8 codes as uint8, scales), by name."""
    from nanochat.optim import FP8Tensor

    out = {f"param/{n}": p.detach().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        for k, v in state.items():
            if isinstance(v, FP8Tensor):
                out[f"{names[id(p)]}/{k}/codes"] = v.codes.view(torch.uint8).clone()
                out[f"{names[id(p)]}/{k}/scale"] = v.scale.clone()
            else:
                out[f"{names[id(p)]}/{k}"] = v.clone()
    return out


def test_dcp_round_trip_in_one_process_is_bitwise(tmp_path):
    from nanochat import checkpoint

    model, opt = _tiny_model_and_optimizer(0)
    _train_steps(model, opt, 2)
    rng = torch.get_rng_state()
    checkpoint.save_dcp(tmp_path, model, opt, step=2, meta={"note": "x"}, tensors={"rng_cpu": rng})
    fresh, fresh_opt = _tiny_model_and_optimizer(1)  # different weights, no optimizer state yet
    tensors = {"rng_cpu": torch.zeros_like(torch.get_rng_state())}
    meta = checkpoint.load_dcp(checkpoint.newest(tmp_path).path, fresh, fresh_opt, tensors=tensors)
    assert meta == {"note": "x", "step": 2}
    assert torch.equal(tensors["rng_cpu"], rng)
    want, got = _flat_state(model, opt), _flat_state(fresh, fresh_opt)
    assert sorted(got) == sorted(want) and any("/codes" in k for k in want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_interrupted_dcp_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from nanochat import checkpoint

    model, opt = _tiny_model_and_optimizer(0)
    _train_steps(model, opt, 1)
    checkpoint.save_dcp(tmp_path, model, opt, step=1, meta={})
    saved = _flat_state(model, opt)
    _train_steps(model, opt, 1)
    real_save = dcp.save

    def save_then_die(state, *, checkpoint_id, **kw):
        real_save(state, checkpoint_id=checkpoint_id, **kw)  # the shards are written...
        raise KeyboardInterrupt  # ...and the process dies before the checkpoint is published

    monkeypatch.setattr(dcp, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_dcp(tmp_path, model, opt, step=2, meta={})
    monkeypatch.setattr(dcp, "save", real_save)
    latest = checkpoint.newest(tmp_path).path
    assert latest.name == "step-000001"
    fresh, fresh_opt = _tiny_model_and_optimizer(1)
    assert checkpoint.load_dcp(latest, fresh, fresh_opt)["step"] == 1
    got = _flat_state(fresh, fresh_opt)
    assert all(torch.equal(got[k], saved[k]) for k in saved)
    root = tmp_path / "checkpoint_dcp"
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "step-000001"]  # its own temporary removed
    # what a kill -9 at that instant leaves: the temporary directory of the save, shards written
    killed = root / ".tmp-step-000002-4242-0badc0de"
    shutil.copytree(latest, killed)
    (killed / "manifest.json").unlink()
    foreign = root / "step-000005"  # a step directory nanochat did not commit (no manifest)
    shutil.copytree(killed, foreign)
    notes = checkpoint.clean_interrupted(tmp_path)
    assert not killed.exists() and foreign.is_dir() and len(notes) == 2, notes
    assert "removed" in notes[0] and "step-000005 alone" in notes[1], notes
    assert [f.split(" ")[0] for f in checkpoint.foreign(tmp_path)] == ["checkpoint_dcp/step-000005"]
    checkpoint.save_dcp(tmp_path, model, opt, step=2, meta={})
    checkpoint.save_dcp(tmp_path, model, opt, step=3, meta={}, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "step-000002", "step-000003", "step-000005"]
    checkpoint.remove(tmp_path)  # --overwrite: the committed steps go, the foreign one stays
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "step-000005"]


def test_dcp_flipped_byte_is_refused_naming_the_file_and_the_previous_step(tmp_path):
    from nanochat import checkpoint
    from nanochat.common import NanoChatError

    model, opt = _tiny_model_and_optimizer(0)
    for step in (1, 2):
        _train_steps(model, opt, 1)
        checkpoint.save_dcp(tmp_path, model, opt, step=step, meta={})
    latest = checkpoint.newest(tmp_path).path
    shard = next(latest.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    fresh, fresh_opt = _tiny_model_and_optimizer(1)
    with pytest.raises(NanoChatError) as e:
        checkpoint.load_dcp(latest, fresh, fresh_opt)
    msg = str(e.value)
    assert str(shard) in msg and "corrupted" in msg and "step-000001 (step 1) verifies" in msg, msg
    shutil.rmtree(latest)  # the fix the message gives: the previous step is the latest again
    assert checkpoint.newest(tmp_path).path.name == "step-000001"
    assert checkpoint.load_dcp(checkpoint.newest(tmp_path).path, fresh, fresh_opt)["step"] == 1


def test_dcp_nonfinite_names_the_tensor_and_the_good_step_skips_it(tmp_path):
    """A NaN weight saved at step 2 (FP8 moments in both steps): checkpoint.dcp.nonfinite names it, read one
    tensor at a time, and the last good step that is also finite is step 1."""
    from nanochat import checkpoint

    model, opt = _tiny_model_and_optimizer(0)
    for step in (1, 2):
        _train_steps(model, opt, 1)
        if step == 2:
            with torch.no_grad():
                model.lm_head.weight[0, 0] = float("nan")
        checkpoint.save_dcp(tmp_path, model, opt, step=step, meta={})
    latest = checkpoint.newest(tmp_path).path
    assert checkpoint.dcp.nonfinite(latest) == ["model.lm_head.weight"]
    assert checkpoint.newest_verified(tmp_path).path == latest
    assert checkpoint.newest_verified(tmp_path, finite=True).path.name == "step-000001"


def test_fsdp_without_torchrun_is_a_recorded_fallback(small_corpus, tmp_path):
    from nanochat.train.trainer import NanoChatTrainer

    result = NanoChatTrainer(**_kwargs(small_corpus, tmp_path / "r", fsdp=True, num_iterations=1,
                                       num_samples=0)).train()
    assert result.parallel == "none"
    assert any("--fsdp ignored" in f for f in result.fallbacks), result.fallbacks
    assert committed(tmp_path / "r")[-1].step == 1


# ----------------------------------------------------------------------- worker (torchrun)
def _worker(runs: list[dict]) -> None:
    """Run each spec in this process group: {"name", "kwargs", "cli"?, "crash_after_first_save"?,
    "expect_error"? (the NanoChatError each rank raised is written to error-rank<r>.txt)}."""
    import torch.distributed as dist

    from nanochat.common import NanoChatError
    from nanochat.parallel.process_group import barrier
    from nanochat.train.trainer import NanoChatTrainer

    dist.init_process_group("gloo")  # ours: the trainers reuse it and leave it to us
    rank = dist.get_rank()
    for spec in runs:
        kwargs = spec["kwargs"]
        run_dir = Path(kwargs["run_dir"])
        if rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.json").write_text(json.dumps(kwargs))
        if spec.get("cli"):
            sys.path.insert(0, str(ROOT / "scripts"))
            import base_train

            assert base_train.main(_argv(kwargs)) == 0
            continue
        trainer = NanoChatTrainer(**kwargs)
        if spec.get("crash_after_first_save"):
            real_save = trainer._save

            def crash(step, real_save=real_save):
                real_save(step)
                raise KeyboardInterrupt  # every rank stops right after the checkpoint

            trainer._save = crash
            try:
                trainer.train()
            except KeyboardInterrupt:
                pass
            torch.save(_local_shards(trainer), run_dir / f"shards-rank{rank}.pt")
            continue
        if spec.get("expect_error"):
            with pytest.raises(NanoChatError) as e:
                trainer.train()
            run_dir.mkdir(parents=True, exist_ok=True)  # a rank refused early may be ahead of rank 0's mkdir
            (run_dir / f"error-rank{rank}.txt").write_text(str(e.value))
            continue
        trainer.train()
        (run_dir / f"states-rank{rank}.json").write_text(json.dumps(_describe_states(trainer)))
        if spec.get("record_fp8"):
            (run_dir / f"fp8-rank{rank}.json").write_text(json.dumps(
                {"choices": trainer.fp8.choices, "stats": trainer.fp8.last_stats}))
    barrier()
    dist.destroy_process_group()


def _local_shards(trainer) -> dict[str, torch.Tensor]:
    """This rank's rows of every parameter and of every FP8 moment (codes as uint8, scales)."""
    from torch.distributed.tensor import DTensor

    from nanochat.optim import FP8Tensor

    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    out = {}
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    for n, p in trainer.model.named_parameters():
        t = local(p.detach())
        out[f"param/{n}"] = getattr(t, "_tensor", t).clone()  # unwrap torchao's FP8 all-gather weight
    for p, state in trainer.optimizer.state.items():
        for k, v in state.items():
            v = local(v)
            if isinstance(v, FP8Tensor):
                out[f"{names[id(p)]}/{k}/codes"] = v.codes.view(torch.uint8).clone()
                out[f"{names[id(p)]}/{k}/scale"] = v.scale.clone()
    return out


def _describe_states(trainer) -> dict:
    from torch.distributed.tensor import DTensor

    def kind(t):
        if isinstance(t, DTensor):
            return f"DTensor({type(t.to_local()).__name__})"
        return type(t).__name__

    out = {}
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    for p, state in trainer.optimizer.state.items():
        if not {"exp_avg_sq_sqrt", "exp_avg", "momentum_buffer"} & set(state):
            continue
        local = p.to_local() if isinstance(p, DTensor) else p
        out[names[id(p)]] = {k: kind(v) for k, v in state.items() if k != "step"} | {
            "global_rows": p.shape[0], "local_rows": local.shape[0]}
    return out


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
