"""nanochat.fp8.hardware: the native / emulated / fallback decision and the GEMM dtype rules.

There is no GPU here, so CUDA devices are faked by patching torch.cuda's queries (capability,
name, availability) and torch.version.hip; what is checked is the decision and its message
against the rules stated (with their torch sources) in hardware.py, and that `convert` refuses a
mode the native kernels cannot run instead of failing mid-step. MXFP8: native from sm_100 with
CUDA 12.8 and torchao's `_C_mxfp8` loaded (each faked), a recorded fallback naming the recipe and
what it needs on an Ada or Hopper GPU, where a loop then trains in high precision, warned once.
"""

import pytest
import torch
import torch.nn as nn

import nanochat.fp8.hardware as hardware
from nanochat.fp8 import convert, detect, native_gemm_problem
from tests.conftest import warnings_in

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.fixture
def fake_gpu(monkeypatch):
    """fake_gpu(capability, name, hip=None) makes torch report that CUDA device."""
    def make(capability, name="NVIDIA Fake", hip=None):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
        monkeypatch.setattr(torch.version, "hip", hip)
    return make


def test_cpu_falls_back_with_an_actionable_reason():
    b = detect("cpu", emulate=False)
    assert b.backend == "fallback" and b.capability is None
    assert b.device_name.startswith("cpu") and "no FP8 matmul hardware" in b.reason
    assert "`emulate`" in b.reason


def test_emulate_is_honoured_on_any_device(fake_gpu):
    assert detect("cpu", emulate=True).backend == "emulated"
    fake_gpu((7, 5), "Tesla T4")
    b = detect("cuda", emulate=True, recipe="rowwise")
    assert b.backend == "emulated" and "Tesla T4" in b.reason


@pytest.mark.parametrize("capability,name", [((8, 0), "NVIDIA A100"), ((8, 6), "NVIDIA RTX 3090")])
def test_pre_ada_gpus_fall_back(fake_gpu, capability, name):
    fake_gpu(capability, name)
    b = detect("cuda", emulate=False)
    assert b.backend == "fallback" and b.capability == capability
    assert name in b.reason and "8.9" in b.reason and "`emulate`" in b.reason


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0), (12, 0)])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_fp8_gpus_are_native_for_every_recipe(fake_gpu, capability, recipe):
    fake_gpu(capability, "NVIDIA FP8")
    assert detect("cuda:0", emulate=False, recipe=recipe).backend == "native"


def test_rowwise_needs_a_gpu_torch_has_a_rowwise_kernel_for(fake_gpu):
    fake_gpu((13, 0), "NVIDIA Future")  # newer than torch's rowwise dispatch table
    assert detect("cuda", emulate=False, recipe="tensorwise").backend == "native"
    b = detect("cuda", emulate=False, recipe="rowwise")
    assert b.backend == "fallback" and "rowwise" in b.reason and "tensorwise can" in b.reason


def test_rocm_is_not_native_yet(fake_gpu):
    fake_gpu((9, 4), "AMD Instinct MI300X", hip="6.2")
    b = detect("cuda", emulate=False)
    assert b.backend == "fallback"
    assert "ROCm" in b.reason and "fnuz" in b.reason and "`emulate`" in b.reason


def test_native_gemm_rules():
    e4 = dict(input=E4M3, weight=E4M3, grad_output=E4M3)
    e5 = dict(input=E5M2, weight=E5M2, grad_output=E5M2)
    hybrid = dict(input=E4M3, weight=E4M3, grad_output=E5M2)
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        assert native_gemm_problem(e4, recipe=recipe) is None
        assert native_gemm_problem(hybrid, recipe=recipe) is None
        assert "both in e5m2" in native_gemm_problem(e5, recipe=recipe)
    # grad_output and input both e5m2 meet only in the grad_weight GEMM...
    gw_only = dict(input=E5M2, weight=E4M3, grad_output=E5M2)
    assert "grad_weight" in native_gemm_problem(gw_only, recipe="tensorwise")
    # ...which rowwise_with_gw_hp keeps in high precision
    assert native_gemm_problem(gw_only, recipe="rowwise_with_gw_hp") is None
    # the CUTLASS rowwise kernel wants the weight in e4m3
    e5_weight = dict(input=E4M3, weight=E5M2, grad_output=E4M3)
    assert native_gemm_problem(e5_weight, recipe="tensorwise") is None
    assert "weight" in native_gemm_problem(e5_weight, recipe="rowwise")


def test_native_e5m2_runs_the_nearest_legal_formats_and_says_so(fake_gpu):
    """cuBLASLt has no e5m2 x e5m2 GEMM: natively, e5m2 mode keeps e5m2 for the gradients and
    takes e4m3 for input and weight -- a recorded fallback, not a refusal; emulation is exact."""
    fake_gpu((9, 0), "NVIDIA H100")
    report = convert(nn.Sequential(nn.Linear(128, 128)), mode="e5m2", layers="all", device="cuda")
    assert report.backend == "native" and report.converted == ["0"]
    assert "NVIDIA H100" in report.fallback and "`emulate`" in report.fallback
    assert "input e4m3, weight e4m3, grad_output e5m2" in report.layers[0].reason
    model = nn.Sequential(nn.Linear(128, 128))
    report = convert(model, mode="e5m2", emulate=True, layers="all", device="cuda")
    assert report.backend == "emulated" and report.converted == ["0"] and report.fallback is None
    assert "input e5m2, weight e5m2, grad_output e5m2" in report.layers[0].reason


# ------------------------------------------------------------------------------------- MXFP8
@pytest.fixture
def blackwell_ready(monkeypatch):
    """A torch built for CUDA 12.8 with torchao's MXFP8 cast kernel loaded (what an sm_100 needs)."""
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(hardware, "mx_kernels_loaded", lambda: True)


@pytest.mark.parametrize("capability,name", [((8, 9), "NVIDIA L40S"), ((9, 0), "NVIDIA H100 80GB HBM3")])
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_wgrad_hp"])
def test_mxfp8_falls_back_before_blackwell_naming_what_it_needs(fake_gpu, blackwell_ready, capability, name, recipe):
    fake_gpu(capability, name)
    b = detect("cuda", emulate=False, recipe=recipe)
    assert b.backend == "fallback" and name in b.reason and "no MXFP8 tensor cores" in b.reason
    assert "10.0+" in b.reason and f"`recipe` {recipe}" in b.reason and "`emulate`" in b.reason
    assert "tensorwise or rowwise runs natively here" in b.reason
    assert detect("cuda", emulate=False, recipe="rowwise").backend == "native"  # the others still run
    assert detect("cuda", emulate=True, recipe=recipe).backend == "emulated"


@pytest.mark.parametrize("capability", [(10, 0), (10, 3), (12, 0)])
def test_mxfp8_is_native_from_sm_100_with_cuda_12_8_and_torchaos_kernel(fake_gpu, blackwell_ready, capability,
                                                                        monkeypatch):
    """torchao's gate (is_sm_at_least_100, CUDA 12.8+), plus its `_C_mxfp8` cast kernel loaded."""
    fake_gpu(capability, "NVIDIA B200")
    b = detect("cuda", emulate=False, recipe="mxfp8")
    assert b.backend == "native" and "MXFP8 tensor cores" in b.reason
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    b = detect("cuda", emulate=False, recipe="mxfp8")
    assert b.backend == "fallback" and "CUDA 12.6" in b.reason and "12.8+" in b.reason
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(hardware, "mx_kernels_loaded", lambda: False)
    b = detect("cuda", emulate=False, recipe="mxfp8")
    assert b.backend == "fallback" and "_C_mxfp8" in b.reason and "did not load" in b.reason


def test_mx_kernel_probe_is_false_without_torchaos_cuda_kernel():
    """This CPU build registers no CUDA kernel for torchao's MXFP8 cast (the probe's other answer
    is a B200's, faked above)."""
    assert hardware.mx_kernels_loaded() is False


def test_mxfp8_on_hopper_warns_once_and_trains_without_mxfp8(fake_gpu, blackwell_ready, monkeypatch, nanochat_log):
    """The native path on an sm_90: FP8Training converts nothing, says so once (two conversions,
    one warning), records the fallback naming the recipe and what it needs, and the loop trains
    in high precision. The model stays on the CPU; only the device it reports is the H100."""
    from nanochat import common
    from nanochat.fp8 import FP8Config, FP8Training, conversion

    fake_gpu((9, 0), "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(conversion, "_model_device", lambda model: torch.device("cuda"))
    monkeypatch.setattr(common, "_warned", set())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    fp8 = FP8Training(model, FP8Config(recipe="mxfp8", layers="all"))
    FP8Training(nn.Sequential(nn.Linear(256, 256)), FP8Config(recipe="mxfp8", layers="all"))
    warnings = warnings_in(nanochat_log)
    assert fp8.report.backend == "fallback" and fp8.report.converted == [] and not fp8.has_fp8_layers
    assert len([w for w in warnings if "FP8 requested but not available" in w]) == 1, warnings
    (line,) = fp8.fallbacks
    assert "NVIDIA H100" in line and "no MXFP8 tensor cores" in line and "`recipe` mxfp8" in line
    optimizer = fp8.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    losses = []
    for step in range(5):
        with fp8.begin_step(step):
            loss = (model(x) - y).square().mean()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        fp8.end_step(step)
        losses.append(loss.item())
    assert all(type(m) in (nn.Linear, nn.ReLU) for m in model) and losses[-1] < losses[0]
