"""`layers` (`--fp8_layers`): which Linears convert, checked against an injected timer and torchao.

No FP8 GPU here, so the measured path runs with an injected timer (`convert(..., measure=...)`,
a function of the shape returning chosen FP8 and bf16 seconds) and a fake clock; what is checked:
* decisions follow the timings: a layer converts when bf16's time / FP8's time >= 1.03 (the
  boundary exactly, and just under it), each distinct shape is timed once, at M = the run's
  tokens per micro-batch, with the layer's torchao config;
* the disk cache: a second conversion times nothing; another recipe, M, GPU name, torch or
  torchao version times again; a corrupt, non-UTF-8 or foreign file is ignored with one log line
  and left byte for byte as it was; a FIFO in its place neither blocks nor is replaced;
* where nothing is timed (emulated), each recipe's decisions equal torchao's
  `_auto_filter_for_recipe` itself (rowwise_with_gw_hp: rowwise's; the MXFP8 recipes, which torchao
  has no rule for: tensorwise's, on dims that are multiples of 32), and the reason names the rule;
  timed, an MXFP8 layer is timed with torchao's MXFP8 config;
  a timer that fails or a missing `micro_batch_tokens` falls back to that rule, recorded;
* the report and TrainResult give each layer's decision and the measuring time (fake clock);
* d12 emulated with the default converts exactly its 12 `mlp.c_fc`, `all` converts 72;
* a caller's module_filter_fn replaces the size rules; LayerPolicy works as torchao's filter;
* under torch.distributed (2 gloo processes) every rank converts what rank 0 measured;
* a resumed run converts the layers its checkpoint converted, though its own timer (and no
  timing cache) would decide otherwise: nothing is timed, and the losses equal the
  uninterrupted run's bit for bit (the same code on the same layers, eager).
The timing path itself runs on a GPU only (`-m gpu`): its figures are positive and its decision
follows them (no figure is asserted: timings are the machine's).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torchao
from torchao.float8 import convert_to_float8_training
from torchao.float8.float8_linear_utils import _auto_filter_for_recipe
from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
from torchao.quantization.quantize_.common import KernelPreference

import nanochat.common as common
import nanochat.fp8.conversion as conversion
import nanochat.fp8.policy as policy
import nanochat.fp8.speed as speed
from nanochat.config import TrainConfig, parse_cli
from nanochat.fp8 import FP8Config, FP8Training, convert, detect
from nanochat.fp8.hardware import FP8Backend
from nanochat.fp8.layers import mx_training_config
from nanochat.fp8.policy import MARGIN, LayerPolicy
from nanochat.fp8.speed import CACHE_FORMAT, LinearShape, Timing, default_cache_path
from nanochat.model.gpt import GPT, preset_config
from nanochat.train.trainer import NanoChatTrainer
from tests.conftest import run_records, tiny_train_kwargs, train_until_first_save, warnings_in

M = 4096
ROOT = Path(__file__).resolve().parents[1]


class FakeTimer:
    """Returns speedups[(K, N)] as (FP8 1 s, bf16 `speedup` s) and advances a fake clock by
    `seconds` per call; records every call."""

    def __init__(self, speedups: dict[tuple[int, int], float], seconds: float = 2.5):
        self.speedups, self.seconds, self.calls, self.now = speedups, seconds, [], 100.0

    def __call__(self, shape: LinearShape, lin_config, device) -> Timing:
        self.calls.append((shape, lin_config, torch.device(device)))
        self.now += self.seconds
        return Timing(fp8_s=1.0, bf16_s=self.speedups[(shape.k, shape.n)])

    def clock(self) -> float:
        return self.now


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """This test's own cache directory (the session's is shared by every test)."""
    monkeypatch.setenv("NANOCHAT_CACHE", str(tmp_path / "cache"))
    return default_cache_path()


def _timed(monkeypatch, speedups, **kw) -> FakeTimer:
    timer = FakeTimer(speedups, **kw)
    monkeypatch.setattr(policy, "time", types.SimpleNamespace(perf_counter=timer.clock))
    return timer


def _model() -> nn.Module:
    """Two layers of one shape, two others, and a head skipped by name."""
    return nn.ModuleDict(dict(a=nn.Linear(256, 256), b=nn.Linear(256, 256), up=nn.Linear(256, 512),
                              down=nn.Linear(512, 256), lm_head=nn.Linear(256, 1024)))


def _logged(log, fn):
    """fn()'s result and the warnings the nanochat logger gave meanwhile (`log`: nanochat_log)."""
    log.clear()
    result = fn()
    return result, warnings_in(log)


# ------------------------------------------------------------------------- measured decisions
def test_measured_decisions_follow_the_timings_and_the_margin(cache, monkeypatch):
    assert MARGIN == 1.03  # the policy: FP8 at least 3% faster
    timer = _timed(monkeypatch, {(256, 256): 0.84, (256, 512): 1.03, (512, 256): 1.0299})
    report = convert(_model(), emulate=True, micro_batch_tokens=M, measure=timer)
    assert report.converted == ["up"]
    assert sorted(report.skipped) == ["a", "b", "down", "lm_head"]
    assert report.decisions["a"] == f"fwd+bwd 0.84x bf16 at M={M} (measured): kept in bf16 (FP8 must be >= 1.03x)"
    assert report.decisions["up"] == f"fwd+bwd 1.03x bf16 at M={M} (measured): converted"
    assert report.decisions["down"].startswith("fwd+bwd 1.03x") and "kept in bf16" in report.decisions["down"]
    assert "lm_head" not in report.decisions  # skipped by name before `layers` decides
    # one call per distinct shape, at the run's M, with the layers' own torchao config
    assert [c[0] for c in timer.calls] == [LinearShape(M, 256, 256), LinearShape(M, 256, 512),
                                           LinearShape(M, 512, 256)]
    assert all(c[1].emulate and c[2] == torch.device("cpu") for c in timer.calls)
    assert report.shapes_measured == 3 and report.shapes_cached == 0
    assert report.measure_time_s == pytest.approx(3 * 2.5)
    assert report.summary().startswith("FP8 e4m3/tensorwise: 1 of 5 linear layers converted, 3 kept in bf16 by "
                                       "`layers` faster (`layers` all converts them)")
    assert "`layers` faster timed 3 layer shape(s) in 7.5 s, 0 from the cache" in report.summary()
    assert "fwd+bwd 1.03x bf16 at M=4096 (measured): converted" in report.table()
    assert report.layers_fallback is None


def test_second_run_times_nothing_and_the_key_holds_gpu_versions_recipe_and_shape(cache, monkeypatch):
    speedups = {(256, 256): 0.9, (256, 512): 1.5, (512, 256): 0.9}
    first = _timed(monkeypatch, speedups)
    convert(_model(), emulate=True, micro_batch_tokens=M, measure=first)
    assert len(first.calls) == 3
    keys = list(json.loads(cache.read_text())["timings"])
    key = next(k for k in keys if k.endswith("M=4096 K=256 N=512"))
    assert key == (f"{detect('cpu', emulate=True).device_name} | torch {torch.__version__} | "
                   f"torchao {torchao.__version__} | tensorwise | M=4096 K=256 N=512")

    again = _timed(monkeypatch, speedups)
    report = convert(_model(), emulate=True, micro_batch_tokens=M, measure=again)
    assert again.calls == [] and report.converted == ["up"]
    assert report.shapes_cached == 3 and report.shapes_measured == 0 and report.measure_time_s == 0
    assert report.decisions["up"] == f"fwd+bwd 1.50x bf16 at M={M} (cached): converted"

    def calls(**over) -> int:
        timer = _timed(monkeypatch, speedups)
        convert(_model(), **{"emulate": True, "micro_batch_tokens": M, "measure": timer, **over})
        return len(timer.calls)

    assert calls(recipe="rowwise") == 3
    assert calls(micro_batch_tokens=2 * M) == 3
    with monkeypatch.context() as m:
        m.setattr(torch, "__version__", "0.0.0-other")
        assert calls() == 3
    with monkeypatch.context() as m:
        m.setattr(torchao, "__version__", "0.0.0-other")
        assert calls() == 3
    timer = _timed(monkeypatch, speedups)
    hw = FP8Backend("emulated", "a GPU by another name", "NVIDIA Other")
    other = LayerPolicy(FP8Config(emulate=True, micro_batch_tokens=M), hw, conversion.float8_linear_config(
        "tensorwise", FP8Config().role_dtypes(), emulate=True), device="cpu", measure=timer)
    assert other.decide("a", nn.Linear(256, 256)).convert is False and len(timer.calls) == 1
    assert calls() == 0  # every variant above was cached next to the first


@pytest.mark.parametrize("content", [b"{not json", b'{"timings": {}}', b"[1, 2]", b'{"format": "\xff\xfe"}',
                                     json.dumps({"format": CACHE_FORMAT, "timings": {"k": {"fp8_s": -1,
                                                                                           "bf16_s": 1}}}).encode()])
def test_corrupt_or_foreign_cache_is_ignored_logged_once_and_left_as_it_is(cache, monkeypatch, content, nanochat_log):
    cache.parent.mkdir(parents=True)
    cache.write_bytes(content)
    timer = _timed(monkeypatch, {(256, 256): 0.9, (256, 512): 1.5, (512, 256): 0.9})
    report, warnings = _logged(nanochat_log,
                               lambda: convert(_model(), emulate=True, micro_batch_tokens=M, measure=timer))
    assert report.converted == ["up"] and len(timer.calls) == 3  # measured as without a cache
    assert len(warnings) == 1 and str(cache) in warnings[0] and "left as it is" in warnings[0]
    assert cache.read_bytes() == content


def test_a_fifo_as_the_cache_neither_blocks_nor_is_replaced(cache, monkeypatch, nanochat_log):
    """Opening a FIFO for reading waits for a writer: the cache must not (it is ignored, logged
    once, and the timings go uncached rather than replace it)."""
    cache.parent.mkdir(parents=True)
    os.mkfifo(cache)
    timer = _timed(monkeypatch, {(256, 256): 0.9, (256, 512): 1.5, (512, 256): 0.9})
    done: list = []
    worker = threading.Thread(target=lambda: done.append(_logged(nanochat_log, lambda: convert(
        _model(), emulate=True, micro_batch_tokens=M, measure=timer))), daemon=True)
    worker.start()
    worker.join(timeout=60)
    if worker.is_alive():  # blocked in open(): a writer releases it, then the test fails
        with open(cache, "w"):
            pass
        pytest.fail("reading the FIFO blocked")
    report, warnings = done[0]
    assert report.converted == ["up"] and len(timer.calls) == 3
    assert len(warnings) == 1 and "it is not a regular file" in warnings[0] and str(cache) in warnings[0]
    assert stat.S_ISFIFO(os.stat(cache).st_mode)  # still the FIFO: never replaced


# -------------------------------------------------------------------- torchao's rule, fallbacks
SHAPES = [(768, 768), (768, 3072), (3072, 768), (1024, 1024), (4096, 1024), (4112, 1024), (1024, 2064),
          (2048, 4096), (2064, 4096), (1024, 8192), (1040, 4112), (8192, 2048), (4096, 4096)]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_unmeasured_decisions_are_torchaos_rule_for_the_recipe(recipe):
    """Reference: torchao's own filter (rowwise_with_gw_hp, which it has no rule for: rowwise's)."""
    with torch.device("meta"):
        model = nn.ModuleDict({f"l{k}x{n}": nn.Linear(k, n) for k, n in SHAPES})
    reference = _auto_filter_for_recipe("rowwise" if recipe == "rowwise_with_gw_hp" else recipe, filter_fqns=[])
    expected = [name for name, m in model.items() if reference(m, name)]
    report = convert(model, emulate=True, recipe=recipe, device="cpu")
    assert report.converted == expected and 0 < len(expected) < len(SHAPES)  # the shapes span the rule
    assert report.shapes_measured == report.shapes_cached == 0
    rule = "rowwise" if recipe == "rowwise_with_gw_hp" else recipe
    assert report.decisions["l768x768"] == (
        f"torchao's {rule} rule{f' (it has none for {recipe})' if rule != recipe else ''} from H100 tables, "
        "not timed (FP8 is emulated here): K=768, N=768: kept in bf16")


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_wgrad_hp"])
def test_unmeasured_mxfp8_decisions_are_torchaos_tensorwise_rule_on_dims_of_32(recipe):
    """torchao has no rule for MXFP8 (policy.MX_RULE: tensorwise's stands in); a layer whose dims
    are multiples of 16 but not of 32 is refused earlier, by what MXFP8's blocks need."""
    assert policy.MX_RULE == "tensorwise"
    with torch.device("meta"):
        model = nn.ModuleDict({f"l{k}x{n}": nn.Linear(k, n) for k, n in SHAPES})
    reference = _auto_filter_for_recipe("tensorwise", filter_fqns=[])
    expected = [name for name, m in model.items() if reference(m, name) and m.in_features % 32 == 0
                and m.out_features % 32 == 0]
    report = convert(model, emulate=True, recipe=recipe, device="cpu")
    assert report.converted == expected and 0 < len(expected) < len(SHAPES)
    assert report.decisions["l768x768"] == (f"torchao's tensorwise rule (it has none for {recipe}) from H100 tables, "
                                            "not timed (FP8 is emulated here): K=768, N=768: kept in bf16")
    assert "MXFP8 needs both dims divisible by 32" in report.skipped["l4112x1024"]


def test_measured_mxfp8_decisions_time_each_shape_with_the_mx_layer_config(cache, monkeypatch):
    """On an sm_100 each shape is timed as for the other recipes, with torchao's MXFP8 config of the
    layers (the injected timer stands in for the GPU's), and cached under the recipe's name."""
    timer = _timed(monkeypatch, {(256, 256): 0.9, (256, 512): 1.2, (512, 256): 1.1})
    report = convert(_model(), emulate=True, recipe="mxfp8", micro_batch_tokens=M, measure=timer)
    assert report.converted == ["up", "down"] and report.shapes_measured == 3
    assert report.decisions["a"] == f"fwd+bwd 0.90x bf16 at M={M} (measured): kept in bf16 (FP8 must be >= 1.03x)"
    for _, lin_config, _ in timer.calls:
        assert isinstance(lin_config, MXFP8TrainingOpConfig) and not lin_config.wgrad_with_hp
        assert lin_config.kernel_preference is KernelPreference.EMULATED
    assert all("| mxfp8 |" in key for key in json.loads(cache.read_text())["timings"])


def test_failed_timing_falls_back_to_the_rule_and_fp8_training_records_it(cache, monkeypatch, nanochat_log):
    def broken(shape, lin_config, device):
        raise RuntimeError("inductor could not compile\nmore lines")

    class BrokenTimer(LayerPolicy):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "measure": broken})

    monkeypatch.setattr(conversion, "LayerPolicy", BrokenTimer)
    common._warned.difference_update({k for k in common._warned if k.startswith("fp8-layers:")})
    model = nn.Sequential(nn.Linear(768, 3072), nn.Linear(3072, 768))
    fp8, warnings = _logged(nanochat_log, lambda: FP8Training(model, FP8Config(emulate=True, micro_batch_tokens=M)))
    report = fp8.report
    assert report.converted == ["0"]  # torchao's tensorwise rule: N=3072 > 1024 converts, N=768 does not
    assert "timing failed" in report.decisions["1"] and "torchao's tensorwise rule" in report.decisions["1"]
    assert "RuntimeError: inductor could not compile" in report.layers_fallback
    assert "torchao's rule for the recipe" in report.layers_fallback and len(warnings) == 1
    assert fp8.fallbacks == [report.layers_fallback]
    assert not cache.exists()  # a failure is not cached


def test_missing_micro_batch_tokens_falls_back_to_the_rule_and_says_so(cache):
    timer = FakeTimer({})
    report = convert(nn.Sequential(nn.Linear(768, 3072), nn.Linear(768, 768)), emulate=True, measure=timer)
    assert timer.calls == [] and report.converted == ["0"]
    assert "`micro_batch_tokens`" in report.layers_fallback
    assert "not timed (`micro_batch_tokens` not set)" in report.decisions["1"]


# ------------------------------------------------------------------------------ whole models
def test_d12_emulated_default_converts_exactly_the_mlp_c_fc_layers_and_all_converts_72():
    def d12() -> nn.Module:
        with torch.device("meta"):  # shapes only: nothing allocated
            return GPT(preset_config("d12", vocab_size=8192, seq_len=2048))

    report = convert(d12(), emulate=True, device="cpu")
    assert report.converted == [f"transformer.h.{i}.mlp.c_fc" for i in range(12)]
    assert len(report.layers) == 73 and len(report.decisions) == 72  # all but lm_head decided by the rule
    everything = convert(d12(), emulate=True, device="cpu", layers="all")
    assert len(everything.converted) == 72 and list(everything.skipped) == ["lm_head"]
    assert set(everything.decisions.values()) == {"`layers` all"}


def test_module_filter_fn_replaces_the_size_rules_and_the_policy_is_torchaos_filter():
    model = nn.ModuleDict(dict(small=nn.Linear(64, 64), odd=nn.Linear(100, 256), big=nn.Linear(768, 3072),
                               lm_head=nn.Linear(64, 512)))
    report = convert(model, emulate=True, module_filter_fn=lambda m, fqn: fqn != "big")
    assert report.converted == ["small", "lm_head"]  # min_dim and skip_fqns are the default filter's
    assert "divisible by 16" in report.skipped["odd"]  # the kernels' rule stays
    assert report.decisions["big"] == "module_filter_fn returned False"
    assert "kept in bf16" not in report.summary()  # the caller's filter decided, not `layers`

    ours = nn.Sequential(nn.Linear(768, 768), nn.Linear(768, 3072), nn.Linear(64, 64))
    theirs = nn.Sequential(nn.Linear(768, 768), nn.Linear(768, 3072), nn.Linear(64, 64))
    config = FP8Config(emulate=True)
    hw = detect("cpu", emulate=True)
    filter_fn = LayerPolicy(config, hw, conversion.float8_linear_config("tensorwise", config.role_dtypes(), emulate=True),
                            device="cpu")
    convert_to_float8_training(theirs, module_filter_fn=filter_fn)
    assert convert(ours, config).converted == ["1"] == [n for n, m in theirs.named_children()
                                                       if type(m) is not nn.Linear]


def test_trainer_reports_decisions_and_measuring_time(small_corpus, tmp_path, cache, monkeypatch):
    """A d2 run whose layers are timed by the fake timer (M = 8 x 32): the MLP's c_fc converts,
    the rest stays bf16, FP8 moments still apply; TrainResult holds decisions and time."""
    timer = _timed(monkeypatch, {(128, 128): 0.7, (128, 512): 1.2, (512, 128): 0.95}, seconds=4.0)

    class TimedPolicy(LayerPolicy):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "measure": timer})

    monkeypatch.setattr(conversion, "LayerPolicy", TimedPolicy)
    result = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "run", num_iterations=3, fp8=True,
                                                 fp8_emulate=True, fp8_opt_level=2, num_samples=0)).train()
    assert result.fp8_converted == ["transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_fc"]
    assert {c[0].m for c in timer.calls} == {8 * 32} and len(timer.calls) == 3
    assert result.fp8_measure_time_s == pytest.approx(12.0)
    assert result.fp8_decisions["transformer.h.0.attn.c_q"] == (
        "fwd+bwd 0.70x bf16 at M=256 (measured): kept in bf16 (FP8 must be >= 1.03x)")
    assert len(result.fp8_decisions) == 12 and result.fallbacks == []
    assert result.optimizer_state_bytes < 4 * result.num_params  # FP8 moments, whatever the matmuls do


def test_trainer_default_emulated_d2_converts_nothing_and_fp8_moments_still_work(small_corpus, tmp_path):
    result = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "run", num_iterations=3, fp8=True,
                                                 fp8_emulate=True, fp8_opt_level=2, num_samples=0)).train()
    assert result.fp8_backend == "emulated" and result.fp8_converted == [] and result.fp8_measure_time_s == 0
    assert all("torchao's tensorwise rule" in why and why.endswith("kept in bf16")
               for why in result.fp8_decisions.values()) and len(result.fp8_decisions) == 12
    assert result.optimizer_state_bytes < 4 * result.num_params


# --------------------------------------------------------------------------------- the flag
def test_flag_config_and_help():
    assert parse_cli(TrainConfig, ["--fp8", "--fp8_layers", "all"]).fp8_config().layers == "all"
    assert TrainConfig(fp8=True).fp8_config().layers == "faster"
    with pytest.raises(ValueError, match="`layers` must be one of faster, all"):
        FP8Config(layers="fastest")
    with pytest.raises(ValueError, match="`micro_batch_tokens` must be >= 1"):
        FP8Config(micro_batch_tokens=0)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "base_train.py"), "--help"],
                         capture_output=True, text=True, check=True,
                         env={"COLUMNS": "200", "PATH": "", "PYTHONPATH": str(ROOT / "src")}).stdout
    assert "--fp8_layers {faster,all}" in out and "activation-memory saving" in " ".join(out.split())


def test_a_resume_converts_the_layers_its_checkpoint_converted(small_corpus, tmp_path, cache, monkeypatch):
    def timed_by(speedups: dict) -> FakeTimer:
        timer = _timed(monkeypatch, speedups)

        class TimedPolicy(LayerPolicy):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **{**kwargs, "measure": timer})

        monkeypatch.setattr(conversion, "LayerPolicy", TimedPolicy)
        return timer

    def losses(run: Path) -> list[float]:
        return [r["loss"] for r in run_records(run) if "loss" in r]

    kw = dict(num_iterations=6, save_every=3, num_samples=0, fp8=True, fp8_emulate=True)
    timed_by({(128, 128): 0.7, (128, 512): 1.2, (512, 128): 0.95})  # the MLPs' c_fc: 1.2x, converted
    full = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "full", **kw)).train()
    c_fc = ["transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_fc"]
    assert full.fp8_converted == c_fc
    train_until_first_save(tiny_train_kwargs(small_corpus, tmp_path / "cut", **kw), monkeypatch)
    cache.unlink()  # another GPU, or a cleared cache: the timings are taken again ...
    timer = timed_by({(128, 128): 1.5, (128, 512): 0.5, (512, 128): 0.5})  # ... and would pick the others
    resumed = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "cut", resume=True, **kw)).train()
    assert resumed.fp8_converted == c_fc and timer.calls == [] and resumed.fp8_measure_time_s == 0
    assert resumed.fp8_decisions["transformer.h.0.mlp.c_fc"] == "`converted_layers` (the run this one continues): converted"
    assert losses(tmp_path / "cut") == losses(tmp_path / "full")


# ------------------------------------------------------------------------------ distributed
def _rank_worker(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        # each rank's timer says the opposite; only rank 0's may be asked
        speed = {(256, 256): 1.5, (256, 512): 0.5} if rank == 0 else {(256, 256): 0.5, (256, 512): 1.5}
        timer = FakeTimer({**speed, (512, 256): 1.0})
        model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 512), nn.Linear(512, 256))
        report = convert(model, emulate=True, micro_batch_tokens=M, measure=timer)
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"converted": report.converted, "calls": len(timer.calls)}, f)
    finally:
        dist.destroy_process_group()


def test_every_rank_converts_what_rank_0_measured(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "rank"
    torch.multiprocessing.spawn(_rank_worker, args=(str(tmp_path / "store"), str(out)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank.{r}").read_text()) for r in (0, 1)]
    assert ranks[0] == {"converted": ["0"], "calls": 3}
    assert ranks[1] == {"converted": ["0"], "calls": 0}


# ------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                    reason="needs a CUDA GPU with FP8 tensor cores; the injected-timer tests cover the rest")
def test_gpu_timing_path_measures_and_decides(cache):
    """d26's three shapes at M=32768 (16 x 2048), timed for real: positive figures, the decision
    follows them, the random streams are untouched, and the cache then answers (the figures and
    the time are printed, not asserted)."""
    with torch.device("meta"):
        model = GPT(preset_config("d26", vocab_size=8192, seq_len=2048))
    rng = torch.get_rng_state(), torch.cuda.get_rng_state()
    report = convert(model, device="cuda", micro_batch_tokens=16 * 2048)
    assert all(torch.equal(a, b) for a, b in zip(rng, (torch.get_rng_state(), torch.cuda.get_rng_state())))
    assert report.backend == "native" and report.shapes_measured == 3 and report.layers_fallback is None
    print(report.summary())
    print("\n".join(sorted(set(report.decisions.values()))))
    timings = json.loads(cache.read_text())["timings"]
    assert len(timings) == 3 and all(t["fp8_s"] > 0 and t["bf16_s"] > 0 for t in timings.values())
    for name, why in report.decisions.items():
        assert (name in report.converted) == why.endswith(": converted")
    with torch.device("meta"):
        again = convert(GPT(preset_config("d26", vocab_size=8192, seq_len=2048)), device="cuda",
                        micro_batch_tokens=16 * 2048)
    assert again.shapes_cached == 3 and again.converted == report.converted


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8"])
def test_the_timing_code_runs_on_cpu_with_another_clock(recipe):
    """speed.time_fwd_bwd, the GPU timer, on CPU (emulated FP8, inductor's CPU backend: MXLinear
    compiles too) with a clock that runs each window and reports 1 s for odd-numbered windows, 2 s
    for even ones: FP8's and bf16's windows alternate (FP8 first), each figure is the median per
    call, and the random streams are left as they were."""
    windows = []

    def clock(run) -> float:
        run()
        windows.append(run)
        return 1.0 if len(windows) % 2 else 2.0

    rng = torch.get_rng_state()
    lin_config = (mx_training_config(recipe, emulate=True) if recipe == "mxfp8" else
                  conversion.float8_linear_config(recipe, FP8Config().role_dtypes(), emulate=True))
    timing = speed.time_fwd_bwd(LinearShape(32, 64, 64), lin_config, torch.device("cpu"), seconds=clock)
    assert torch.equal(rng, torch.get_rng_state())
    assert len(windows) == 2 * speed.WINDOWS
    assert timing == Timing(fp8_s=1.0 / speed.CALLS, bf16_s=2.0 / speed.CALLS)
