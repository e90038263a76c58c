"""MFU (nanochat.train.mfu and the trainer's `mfu`): FLOPs per token against hand counts, the peak
table, the arithmetic, and what a run reports.

- FLOPs per token of d12 and of Meta-Llama-3-8B against a count by hand of their Linear shapes
  (6 x in x out each, the head included, the embedding not) plus the convention's attention
  term 12 x layers x heads x head_dim x seq_len; the Llama count also matches Meta's published
  total of 8.03B parameters once the embedding is added back.
- The peak lookup: CUDA device names as torch reports them -> their datasheet figures, variants
  (H100 PCIe, GH200, H200 NVL) not taken for the family; an unknown name and the CPU -> None.
- `utilization` on a fake peak: exact, the inputs are chosen so that every step is exact in fp64.
- A CPU run: TrainResult.mfu is None and no metrics record carries an `mfu` key (no listed
  peak); with a fake peak patched in, each record's `mfu` is its tokens_per_sec x
  flops_per_token / peak and TrainResult.mfu likewise (relative 1e-12: the same fp64 operations).
"""


import pytest
import torch

from nanochat.train import mfu
from nanochat.model.gpt import GPT, GPTConfig, preset_config
from nanochat.train.trainer import NanoChatTrainer
from tests.conftest import run_records, tiny_train_kwargs


def _meta_model(config: GPTConfig) -> GPT:
    with torch.device("meta"):  # shapes only, no memory
        return GPT(config)


def test_flops_per_token_of_d12_is_the_hand_count():
    model = _meta_model(preset_config("d12", vocab_size=8192, seq_len=2048))
    width = 768  # 6 heads of 128
    per_layer = 4 * width * width + 2 * width * 4 * width  # c_q, c_k, c_v, c_proj; c_fc, c_proj
    matmul = 12 * per_layer + width * 8192  # + lm_head
    attention = 12 * 12 * 6 * 128 * 2048
    assert model.flops_per_token(2048) == 6 * matmul + attention == 773_849_088


def test_flops_per_token_of_llama3_8b_is_the_hand_count():
    config = GPTConfig(vocab_size=128256, seq_len=8192, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096,
                       intermediate_size=14336, mlp="swiglu", norm_weight=True, embed_norm=False, qk_norm=False)
    model = _meta_model(config)
    per_layer = (2 * 4096 * 4096        # q_proj, o_proj
                 + 2 * 4096 * 1024      # k_proj, v_proj: 8 kv heads of 128
                 + 3 * 4096 * 14336     # gate_proj, up_proj, down_proj
                 + 2 * 4096)            # the two RMSNorm weights
    matmul = 32 * per_layer + 4096 + 4096 * 128256  # + final norm, lm_head
    assert round((matmul + 128256 * 4096) / 1e9, 2) == 8.03  # Meta's published size
    assert model.flops_per_token(8192) == 6 * matmul + 12 * 32 * 32 * 128 * 8192


@pytest.mark.parametrize("name,part,bf16,fp8", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989, 1979),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756, 1513),
    ("NVIDIA H100 NVL", "H100 NVL", 835, 1671),
    ("NVIDIA H200", "H200 SXM", 989, 1979),
    ("NVIDIA H200 NVL", "H200 NVL", 835, 1671),
    ("NVIDIA GH200 480GB", "GH200", 989, 1979),
    ("NVIDIA B200", "B200 (HGX)", 2250, 4500),
    ("NVIDIA L40S", "L40S", 362, 733),
    ("NVIDIA GeForce RTX 4090", "GeForce RTX 4090", 165.2, 330.3),
    ("NVIDIA A100-SXM4-80GB", "A100", 312, None),
])
def test_peak_of_a_listed_gpu(name, part, bf16, fp8):
    peak = mfu.peak_for_name(name)
    assert (peak.part, peak.bf16_tflops, peak.fp8_tflops) == (part, bf16, fp8)


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 4090 D", "NVIDIA L40", "NVIDIA H20", "Tesla T4"])
def test_unlisted_gpu_has_no_peak(name):
    assert mfu.peak_for_name(name) is None


def test_cpu_has_no_peak():
    assert mfu.device_peak(torch.device("cpu")) is None


def test_utilization_arithmetic():
    # 1000 tokens/s x 6e9 FLOPs = 6e12 FLOP/s over 2 GPUs of 10 TFLOP/s
    assert mfu.utilization(1000.0, 6e9, 10.0, devices=2) == 0.3
    assert mfu.utilization(1000.0, 6e9, 10.0) == 0.6


def _records(run_dir):
    return [r for r in run_records(run_dir) if "tokens_per_sec" in r]


def test_cpu_run_reports_no_mfu(small_corpus, tmp_path):
    result = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "run", num_iterations=4,
                                                 num_samples=0)).train()
    assert result.mfu is None and result.mfu_fp8 is None and result.peak_tflops is None
    assert result.flops_per_token > 0
    records = _records(tmp_path / "run")
    assert len(records) == 4 and not any("mfu" in r for r in records)


def test_mfu_against_a_fake_peak(small_corpus, tmp_path, monkeypatch):
    fake = mfu.Peak("fake", bf16_tflops=1e-6, fp8_tflops=2e-6, source="test")
    monkeypatch.setattr(mfu, "device_peak", lambda device: fake)
    result = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "run", num_iterations=4,
                                                 num_samples=0)).train()
    assert result.peak_tflops == 1e-6
    assert result.mfu == pytest.approx(result.tokens_per_sec * result.flops_per_token / 1e6, rel=1e-12)
    assert result.mfu_fp8 is None  # no FP8 layers in this run
    for r in _records(tmp_path / "run"):
        assert r["mfu"] == pytest.approx(r["tokens_per_sec"] * result.flops_per_token / 1e6, rel=1e-12)
