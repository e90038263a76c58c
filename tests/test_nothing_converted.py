"""Work asked for that does nothing is said, not reported as done. Checked against the layers
themselves: an FP8 conversion in which no Linear layer is eligible (an MXFP8 model of width 72:
K is not a multiple of 32) converts nothing and warns once with the first layer's reason,
recording the line as the run's fallback; with `layers` all it is a one-line error. An FP8 export
that quantizes no layer (fp8_block on dims that are not whole 128x128 blocks) warns with the
reason and is labelled bf16 by export_hf. --vocab_size with a Hugging Face model says it does
not apply."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn as nn

import nanochat.common as common
from nanochat.fp8 import FP8Config, FP8Training, convert, fp8_layers
from tests.conftest import load_script, tiny_train_kwargs


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(common, "_warned", set())  # warn_once's memory: each test sees its own first time


def _width_72() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(72, 144, bias=False), nn.ReLU(), nn.Linear(144, 72, bias=False))


def _warnings(caplog, text: str) -> list[str]:
    return list(dict.fromkeys(r.getMessage() for r in caplog.records
                              if r.levelno == logging.WARNING and text in r.getMessage()))


def test_fp8_layers_all_with_no_eligible_layer_is_an_error():
    model = _width_72()
    with pytest.raises(ValueError) as e:
        convert(model, FP8Config(recipe="mxfp8", emulate=True, layers="all"))
    msg = str(e.value)
    assert "\n" not in msg and "none of the model's 2 Linear layers converts" in msg and "72" in msg, msg
    assert "`layers` all" in msg and fp8_layers(model) == {}


def test_a_conversion_that_converts_nothing_warns_once_and_is_a_recorded_fallback(nanochat_log):
    model = _width_72()
    config = FP8Config(recipe="mxfp8", emulate=True, layers="faster")
    fp8 = FP8Training(model, config)
    assert fp8.report.converted == [] and fp8_layers(model) == {}
    lines = _warnings(nanochat_log, "none of the model's")
    assert len(lines) == 1 and "fp8 e4m3/mxfp8: none of the model's 2 Linear layers converts (the first, 0: " in \
        lines[0] and "training in high precision" in lines[0], lines
    assert any("none of the model's 2 Linear layers converts" in f for f in fp8.fallbacks), fp8.fallbacks
    convert(model, config)  # the same model again: not said twice
    assert len(_warnings(nanochat_log, "none of the model's")) == 1


def test_an_fp8_block_export_of_unblocked_dims_warns_and_is_labelled_bf16(nanochat_log, tmp_path):
    from nanochat.model.hf_fp8 import REPORT_FILE, quantize_checkpoint

    names = [f"model.layers.{i}.mlp.{p}" for i in range(7) for p in ("up_proj", "down_proj")]  # 14 Linears
    tensors = {f"{n}.weight": torch.randn(96, 64) for n in names}
    fp8 = quantize_checkpoint(tensors, names, quantize="fp8_block")
    assert fp8.quantized == [] and all(t.dtype == torch.bfloat16 for t in fp8.tensors.values())
    lines = _warnings(nanochat_log, "--quantize fp8_block")
    assert len(lines) == 1 and "none of the 14 Linear layers was quantized" in lines[0], lines
    assert "96x64 is not whole 128x128 blocks" in lines[0] and "bf16 weights" in lines[0], lines
    (tmp_path / REPORT_FILE).write_text(json.dumps(fp8.to_json()))  # what export_hf writes
    label = load_script("export_hf")._weights_label
    assert label("fp8_block", tmp_path) == "bf16 weights: --quantize fp8_block quantized none of its 14 Linear layers"
    blocked = quantize_checkpoint({f"{n}.weight": torch.randn(128, 128) for n in names}, names,
                                  quantize="fp8_block", quantize_all=True)
    (tmp_path / REPORT_FILE).write_text(json.dumps(blocked.to_json()))
    assert label("fp8_block", tmp_path) == "fp8_block weights in 14 of 14 Linear layers"


def test_vocab_size_with_a_hugging_face_model_says_it_does_not_apply(nanochat_log, small_corpus, tmp_path):
    from nanochat.common import dist_env
    from nanochat.config import TrainConfig
    from nanochat.train.preflight import check_environment, check_layout
    from tests.test_hf import _save_model

    _save_model("llama", tmp_path / "hf")
    for vocab, said in ((320, True), (None, False)):
        over = {} if vocab is None else {"vocab_size": vocab}
        kw = {k: v for k, v in tiny_train_kwargs(small_corpus, tmp_path / "run", model_name=str(tmp_path / "hf"),
                                                 **over).items() if vocab is not None or k != "vocab_size"}
        cfg = TrainConfig(**kw)
        nanochat_log.clear()
        check_environment(cfg, check_layout(cfg, dist_env()), torch.device("cpu"), torch.float32, resume=False)
        lines = _warnings(nanochat_log, "--vocab_size")
        hf = str(tmp_path / "hf")
        assert lines == ([f"WARNING: --vocab_size 320 does not apply to the Hugging Face model {hf!r} "
                          "and is ignored: its own tokenizer (in the checkpoint directory) sets the vocabulary; drop "
                          "--vocab_size"] if said else []), lines
