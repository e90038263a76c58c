"""FP8 exports (nanochat.model.hf_fp8 through export_hf, scripts/export_hf.py and FP8Trainer.save_fp8),
checked by a real consumer: transformers with compressed-tensors, on CPU.

- What is stored: each quantized Linear's codes are the master weight divided by its channel's
  (block's) amax / 448 and rounded to e4m3, its scales amax / 448 in fp32 (both computed here by
  hand: one IEEE division and one round-to-nearest cast, so equal bit for bit on any CPU);
  transformers reads back exactly these codes and scales; on disk they take 1 byte a parameter
  plus 4 bytes a scale (the safetensors header's dtypes and byte ranges); everything else is
  bf16 and named in the config's `ignore`.
- Logits: transformers on the FP8 export (weights and per-token activations in e4m3, as vLLM
  computes) against transformers on the plain export: SQNR >= LOGIT_FLOOR_DB (argued there);
  nanochat's loader (dequantized weights) against transformers' dequantize=True route on the same
  export: within TOL (the same weights in two implementations, as in tests/test_hf.py).
- The floor: a layer whose values sit where e4m3 rounds worst (24.6 dB, the format's bound,
  asserted) stays bf16 and is reported, and so do its fusion partners (q/k/v); --quantize_all
  stores it in FP8. A --fp8 run's high-precision layers stay bf16, with the run's reason.
- nanochat fine-tunes from an FP8 export: the run's starting weights are codes x scales, said once.
- FP8Trainer.save_fp8 is checked in tests/test_hf_trainer.py, --quantize_all without --quantize in
  tests/test_cli_errors.py.
- Refusals: a non-empty --out_dir (bytes unchanged), an FP8 tensor without a quantization_config,
  another quant_method, compressed-tensors missing (a plain checkpoint still loads).
- mxfp8 (compressed-tensors' MXFP8, "mxfp8-quantized"): the codes and uint8 e8m0 exponents
  transformers reads back are torchao's own MXFP8 cast of the master weight (MXTensor.to_mx,
  RCEIL: what MXFP8 training's forward multiplies), 1 byte a parameter plus 1 a block of 32 on
  disk; transformers runs it on CPU in bf16, the config's dtype (compressed-tensors 0.20.1
  decompresses MX weights to bf16, so fp32 without `dequantize=True` fails in the first matmul:
  asserted, as docs/hf.md says) with logits >= LOGIT_FLOOR_DB from the plain export; nanochat's
  loader matches transformers' dequantize=True route within TOL; a Linear whose K is not a
  multiple of 32 stays bf16 with that reason.
"""

import json
import math
import struct
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from nanochat.common import UsageError  # noqa: E402
from nanochat.model.export import export_hf  # noqa: E402
from nanochat.model.hf import load_hf_model  # noqa: E402
from nanochat.model.hf_fp8 import SQNR_FLOOR_DB, sqnr_db  # noqa: E402
from tests.conftest import load_script, run_records  # noqa: E402
from tests.test_hf import TOL, _byte_level_tokenizer, _save_tokenizer  # noqa: E402

VOCAB = 320
E4M3_WORST_DB = 20 * math.log10(17)  # 24.6: a value 1 + 1/16 (x 2^e) rounds to 1, off by 1/17 of itself
N_MATMULS = 14  # 2 layers x (q, k, v, o, gate, up, down)
# Logits of the FP8 export against the plain one. Each quantized matmul adds two roundings (its
# weight per channel, its input per token), each with noise at most 2^-8 of what it rounds
# (E4M3_WORST_DB); a pre-norm residual block passes a matmul's relative noise to the residual
# stream with gain <= 1 (its output is added to a larger stream; RMSNorm rescales signal and noise
# alike), and independent noises add: SQNR >= 24.6 - 10 log10(2 x 14) = 10.1 dB. Measured 25.2 dB
# (HF's initialization), so a wrong scale layout or a transposed scale (~0 dB) fails.
LOGIT_FLOOR_DB = E4M3_WORST_DB - 10 * math.log10(2 * N_MATMULS)


def _ids(seed=0, n=40):
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Llama with transformers' own initialization; K = 128 and 256, so fp8_block has whole
    blocks, except k/v_proj (N = 64: two KV heads of 32)."""
    d = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(d)
    _save_tokenizer(_byte_level_tokenizer(), d, bos_token="<s>", eos_token="</s>")
    return d


@pytest.fixture(scope="module")
def exports(base, tmp_path_factory):
    """kind -> export directory of the base model: plain, fp8, fp8_block."""
    model, tok = load_hf_model(base)
    root = tmp_path_factory.mktemp("exports")
    return {kind: export_hf(model, tok, root / kind, quantize=kind) for kind in ("none", "fp8", "fp8_block", "mxfp8")}


def _header(path: Path) -> dict:
    """The safetensors header: name -> {dtype, shape, data_offsets}."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def _by_hand(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of a master weight, written out here: amax / 448 per row or 128x128 block."""
    w = w.float()
    if kind == "fp8_block":
        n, k = w.shape
        amax = w.abs().view(n // 128, 128, k // 128, 128).amax(dim=(1, 3))
        scale = amax / 448
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    else:
        scale = full = w.abs().amax(dim=1, keepdim=True) / 448
    return (w / full).clamp(-448, 448).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("kind", ["fp8", "fp8_block"])
def test_transformers_reads_back_our_codes_and_scales(base, exports, kind):
    ours = transformers.LlamaForCausalLM.from_pretrained(base).state_dict()  # the master weights
    report = json.loads((exports[kind] / "fp8_report.json").read_text())
    quantized = [la["name"] for la in report["layers"] if la["stored_as"] == "fp8_e4m3"]
    if kind == "fp8":
        assert len(quantized) == N_MATMULS
    else:  # k/v_proj (64 x 128) are not whole blocks; q_proj is fused with them in vLLM
        assert sorted(la["name"].rpartition(".")[2] for la in report["layers"] if la["stored_as"] == "bf16") == \
            ["k_proj", "k_proj", "q_proj", "q_proj", "v_proj", "v_proj"]
        assert all("fused with k_proj" in la["why_bf16"] for la in report["layers"] if la["name"].endswith("q_proj"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(exports[kind], dtype=torch.float32).eval()
    modules = dict(hf.named_modules())
    for name in quantized:  # read before any forward: the compressed parameters as loaded
        codes, scale = _by_hand(ours[f"{name}.weight"], kind)
        loaded = modules[name]
        assert loaded.weight.dtype == torch.float8_e4m3fn
        assert torch.equal(loaded.weight.view(torch.uint8), codes.view(torch.uint8)), name
        assert torch.equal(loaded.weight_scale, scale), name
    config = json.loads((exports[kind] / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    weights, acts = qc["config_groups"]["group_0"]["weights"], qc["config_groups"]["group_0"]["input_activations"]
    assert (weights["type"], weights["num_bits"], acts["dynamic"]) == ("float", 8, True)
    expected = ("block", "group") if kind == "fp8_block" else ("channel", "token")
    assert (weights["strategy"], acts["strategy"]) == expected
    kept = {la["name"] for la in report["layers"] if la["stored_as"] == "bf16"}
    assert set(qc["ignore"]) == kept | {"model.embed_tokens", "model.norm", "lm_head"} | {
        f"model.layers.{i}.{n}" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")}
    for name in kept:
        assert modules[name].weight.dtype == torch.float32 and not hasattr(modules[name], "weight_scale")


def test_linear_weights_take_one_byte_per_parameter(exports):
    plain, fp8, block = (_header(exports[k] / "model.safetensors") for k in ("none", "fp8", "fp8_block"))
    nbytes = lambda e: e["data_offsets"][1] - e["data_offsets"][0]  # noqa: E731
    linears = [k for k in plain if k.endswith("_proj.weight")]
    assert len(linears) == N_MATMULS
    for key in linears:
        n, k = plain[key]["shape"]
        assert plain[key]["dtype"] == "F32" and nbytes(plain[key]) == 4 * n * k
        assert fp8[key]["dtype"] == "F8_E4M3" and nbytes(fp8[key]) == n * k
        scale = fp8[key.replace("weight", "weight_scale")]
        assert scale["dtype"] == "F32" and scale["shape"] == [n, 1] and nbytes(scale) == 4 * n
        if block[key]["dtype"] == "F8_E4M3":
            scale = block[key.replace("weight", "weight_scale")]
            assert scale["shape"] == [n // 128, k // 128] and nbytes(scale) == 4 * (n // 128) * (k // 128)
        else:
            assert block[key]["dtype"] == "BF16" and key.replace("weight", "weight_scale") not in block
    for key in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert fp8[key]["dtype"] == "BF16"
    size = {k: (exports[k] / "model.safetensors").stat().st_size for k in exports}
    params = sum(math.prod(e["shape"]) for e in plain.values())
    linear_params = sum(math.prod(plain[k]["shape"]) for k in linears)
    scales = sum(nbytes(e) for k, e in fp8.items() if k.endswith("weight_scale"))
    expected = linear_params + scales + 2 * (params - linear_params)
    assert expected <= size["fp8"] <= expected + 16 * 1024  # + the JSON header


@pytest.mark.two_computations
def test_fp8_logits_within_fp8_error_of_plain_export(exports):
    ids = _ids()
    plain = transformers.AutoModelForCausalLM.from_pretrained(exports["none"], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = plain(ids).logits
    for kind in ("fp8", "fp8_block"):
        served = transformers.AutoModelForCausalLM.from_pretrained(exports[kind], dtype=torch.float32).eval()
        with torch.no_grad():
            got = served(ids).logits
        assert sqnr_db(ref, got) >= LOGIT_FLOOR_DB, (kind, sqnr_db(ref, got))
        # nanochat's loader and transformers' dequantizing route read the same weights
        ours, _ = load_hf_model(exports[kind])
        dense = transformers.AutoModelForCausalLM.from_pretrained(
            exports[kind], dtype=torch.float32,
            quantization_config=transformers.CompressedTensorsConfig(dequantize=True)).eval()
        with torch.no_grad():
            torch.testing.assert_close(ours(ids), dense(ids).logits, **TOL)


def _worst_case_rows(w: torch.Tensor) -> torch.Tensor:
    """Rows whose values all sit where e4m3 rounds worst: amax 448 * 2^-10 in column 0, the rest
    +-(1 + 1/16) * 2^e * 2^-10 (halfway between two e4m3 values, after the scale amax / 448 = 2^-10)."""
    g = torch.Generator().manual_seed(1)
    e = torch.randint(3, 9, w.shape, generator=g).float()  # up to 272 x 2^-10: the amax adds little signal
    sign = torch.randint(0, 2, w.shape, generator=g).float() * 2 - 1
    out = sign * 1.0625 * 2.0 ** e * 2.0 ** -10
    out[:, 0] = 448 * 2.0 ** -10
    return out


def test_layers_under_the_floor_stay_bf16_unless_quantize_all(base, tmp_path):
    model, tok = load_hf_model(base)
    with torch.no_grad():
        for name in ("transformer.h.1.mlp.c_proj", "transformer.h.0.attn.c_k"):
            w = model.get_submodule(name).weight
            w.copy_(_worst_case_rows(w))
    export_hf(model, tok, tmp_path / "floor", quantize="fp8")
    layers = {la["name"]: la for la in json.loads((tmp_path / "floor" / "fp8_report.json").read_text())["layers"]}
    down, k = layers["model.layers.1.mlp.down_proj"], layers["model.layers.0.self_attn.k_proj"]
    for la in (down, k):
        assert la["stored_as"] == "bf16" and E4M3_WORST_DB <= la["weight_sqnr_db"] < E4M3_WORST_DB + 0.5, la
        assert f"weight SQNR {la['weight_sqnr_db']:.1f} dB < floor {SQNR_FLOOR_DB:g} dB" in la["why_bf16"]
    for partner in ("q_proj", "v_proj"):  # one matmul with k_proj in vLLM and SGLang
        la = layers[f"model.layers.0.self_attn.{partner}"]
        assert la["stored_as"] == "bf16" and "fused with k_proj" in la["why_bf16"], la
    assert sum(la["stored_as"] == "fp8_e4m3" for la in layers.values()) == N_MATMULS - 4
    ignore = json.loads((tmp_path / "floor" / "config.json").read_text())["quantization_config"]["ignore"]
    assert {"model.layers.1.mlp.down_proj", "model.layers.0.self_attn.q_proj"} <= set(ignore)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "floor", dtype=torch.float32)
    assert hf.model.layers[1].mlp.down_proj.weight.dtype == torch.float32  # kept: exact bf16 values
    torch.testing.assert_close(hf.model.layers[1].mlp.down_proj.weight,
                               model.transformer.h[1].mlp.c_proj.weight.bfloat16().float(), rtol=0, atol=0)

    export_hf(model, tok, tmp_path / "all", quantize="fp8", quantize_all=True)
    report = json.loads((tmp_path / "all" / "fp8_report.json").read_text())
    assert all(la["stored_as"] == "fp8_e4m3" for la in report["layers"]) and report["quantize_all"]
    # the format's bound holds on the worst rows there are, and typical weights sit ~7 dB above it
    assert min(la["weight_sqnr_db"] for la in report["layers"]) >= E4M3_WORST_DB
    assert sorted(la["weight_sqnr_db"] for la in report["layers"])[2] > 30


def test_export_script_keeps_the_runs_high_precision_layers(base, tmp_path, capsys):
    """A --fp8 run's checkpoint whose conversion skipped layer 1's MLP: those Linears stay bf16,
    with the run's reason from result.json; a run without --fp8 quantizes every Linear. A
    non-empty --out_dir is refused before any work, its bytes unchanged."""
    from nanochat.checkpoint import save_checkpoint

    script = load_script("export_hf")
    model, tok = load_hf_model(base)
    skipped = [f"transformer.h.1.mlp.{n}" for n in ("c_gate", "c_fc", "c_proj")]
    converted = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"
                 and n not in skipped]
    for run, fp8 in (("fp8_run", True), ("plain_run", False)):
        save_checkpoint(tmp_path / run, {"model": model.state_dict(), "step": 1, "fp8_converted": converted,
                                         "config": {"model_name": str(base), "fp8": fp8}})
        tok.save(tmp_path / run / "tokenizer")
    (tmp_path / "fp8_run" / "result.json").write_text(json.dumps(
        {"fp8_skipped": {n: "slower in FP8 at this shape (--fp8_layers faster)" for n in skipped}}))
    assert script.main(["--run_dir", str(tmp_path / "fp8_run"), "--out_dir", str(tmp_path / "out"),
                        "--quantize", "fp8"]) == 0
    assert "fp8 weights" in capsys.readouterr().out
    layers = {la["name"]: la for la in json.loads((tmp_path / "out" / "fp8_report.json").read_text())["layers"]}
    for n in ("gate_proj", "up_proj", "down_proj"):
        la = layers[f"model.layers.1.mlp.{n}"]
        assert la["stored_as"] == "bf16" and la["why_bf16"] == ("trained in high precision: slower in FP8 at this "
                                                                 "shape (--fp8_layers faster)"), la
    assert sum(la["stored_as"] == "fp8_e4m3" for la in layers.values()) == N_MATMULS - 3
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    assert script.main(["--run_dir", str(tmp_path / "plain_run"), "--out_dir", str(tmp_path / "out"),
                        "--quantize", "fp8"]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert script.main(["--run_dir", str(tmp_path / "plain_run"), "--out_dir", str(tmp_path / "out"),
                        "--quantize", "fp8", "--overwrite"]) == 0
    report = json.loads((tmp_path / "out" / "fp8_report.json").read_text())
    assert all(la["stored_as"] == "fp8_e4m3" for la in report["layers"])


def test_mxfp8_export_holds_torchaos_mx_codes_and_e8m0_scales(base, exports):
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    ours = transformers.LlamaForCausalLM.from_pretrained(base).state_dict()
    report = json.loads((exports["mxfp8"] / "fp8_report.json").read_text())
    assert report["scheme"] == "MXFP8" and sum(la["stored_as"] == "fp8_e4m3" for la in report["layers"]) == N_MATMULS
    assert all(E4M3_WORST_DB <= la["weight_sqnr_db"] for la in report["layers"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(exports["mxfp8"]).eval()
    assert hf.dtype == torch.bfloat16  # config.json's torch_dtype
    modules = dict(hf.named_modules())
    for la in report["layers"]:  # read before any forward: the compressed parameters as loaded
        mx = MXTensor.to_mx(ours[f"{la['name']}.weight"].float().contiguous(), torch.float8_e4m3fn, 32,
                            ScaleCalculationMode.RCEIL)
        loaded = modules[la["name"]]
        assert torch.equal(loaded.weight.view(torch.uint8), mx.qdata.view(torch.uint8)), la["name"]
        assert loaded.weight_scale.dtype == torch.uint8 and torch.equal(loaded.weight_scale, mx.scale.view(torch.uint8))
    qc = json.loads((exports["mxfp8"] / "config.json").read_text())["quantization_config"]
    weights = qc["config_groups"]["group_0"]["weights"]
    assert qc["format"] == "mxfp8-quantized" and (weights["group_size"], weights["scale_dtype"]) == (32, "torch.uint8")
    header, plain = _header(exports["mxfp8"] / "model.safetensors"), _header(exports["none"] / "model.safetensors")
    for key in (k for k in plain if k.endswith("_proj.weight")):
        n, k = plain[key]["shape"]
        assert header[key]["dtype"] == "F8_E4M3" and header[key]["shape"] == [n, k]
        scale = header[key.replace("weight", "weight_scale")]
        assert scale["dtype"] == "U8" and scale["shape"] == [n, k // 32]


@pytest.mark.two_computations
def test_mxfp8_export_runs_in_transformers_on_cpu_and_in_nanochat(exports):
    ids = _ids()
    plain = transformers.AutoModelForCausalLM.from_pretrained(exports["none"], dtype=torch.float32).eval()
    served = transformers.AutoModelForCausalLM.from_pretrained(exports["mxfp8"]).eval()  # bf16
    dense = transformers.AutoModelForCausalLM.from_pretrained(
        exports["mxfp8"], dtype=torch.float32,
        quantization_config=transformers.CompressedTensorsConfig(dequantize=True)).eval()
    ours, _ = load_hf_model(exports["mxfp8"])
    with torch.no_grad():
        ref, got = plain(ids).logits, served(ids).logits.float()
        assert sqnr_db(ref, got) >= LOGIT_FLOOR_DB, sqnr_db(ref, got)
        torch.testing.assert_close(ours(ids), dense(ids).logits, **TOL)
        fp32 = transformers.AutoModelForCausalLM.from_pretrained(exports["mxfp8"], dtype=torch.float32).eval()
        with pytest.raises(RuntimeError, match="same dtype"):  # bf16 weights from compressed-tensors' MX decompression
            fp32(ids)


def test_mxfp8_keeps_a_linear_whose_k_is_not_whole_blocks():
    from nanochat.model.hf_fp8 import quantize_checkpoint

    tensors = {"a.weight": torch.randn(64, 48), "b.weight": torch.randn(64, 64)}
    export = quantize_checkpoint(tensors, ["a", "b"], quantize="mxfp8")
    assert [la.name for la in export.quantized] == ["b"]
    assert export.kept[0].reason.startswith("K = 48 is not a multiple of 32")
    assert export.tensors["b.weight_scale"].dtype == torch.uint8 and export.tensors["a.weight"].dtype == torch.bfloat16
    assert "e8m0 scales per 32 values along K" in export.summary() and "mxfp8 e4m3" in export.table()


def test_fp8_checkpoints_nanochat_cannot_read_are_refused(exports, tmp_path, monkeypatch):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(exports["fp8"], d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "quantization_config"}))
    with pytest.raises(ValueError, match=r"_proj\.weight is stored in FP8 but config\.json has no quantization_config"):
        load_hf_model(d)
    (d / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8",
                                                                                 "weight_block_size": [128, 128]}}))
    with pytest.raises(UsageError, match="quant_method 'fp8'; nanochat reads plain checkpoints and compressed-tensors"):
        load_hf_model(d)
    monkeypatch.setitem(sys.modules, "compressed_tensors", None)  # as if not installed
    model, tok = load_hf_model(exports["none"])  # plain checkpoints do not need it
    with pytest.raises(UsageError, match=r"--quantize fp8 uses the compressed-tensors format .* pip install"):
        export_hf(model, tok, tmp_path / "x", quantize="fp8")
    assert not (tmp_path / "x").exists()


def test_fine_tune_starts_from_the_dequantized_fp8_export(exports, small_corpus, tmp_path, nanochat_log, monkeypatch):
    """NanoChatTrainer(model_name=<FP8 export>): the weights it starts from are the export's codes x
    scales (nanochat's own dequantization against the codes and scales in the file, exact: one fp32
    product each), said in one log line; the loss falls."""
    from safetensors.torch import load_file

    from nanochat.train.trainer import NanoChatTrainer
    from tests.conftest import tiny_train_kwargs

    stored = load_file(exports["fp8"] / "model.safetensors")
    kw = tiny_train_kwargs(small_corpus, tmp_path / "ft", model_name=str(exports["fp8"]), num_iterations=4,
                           lr=3e-3, num_samples=0)
    import nanochat.train.trainer

    start = {}

    real = nanochat.train.trainer.load_model

    def load(*args, **kwargs):  # the trainer's own loader, its result seen before the first step
        model, tok = real(*args, **kwargs)
        start["w"] = model.transformer.h[0].mlp.c_proj.weight.detach().clone()
        return model, tok

    monkeypatch.setattr(nanochat.train.trainer, "load_model", load)
    result = NanoChatTrainer(**kw).train()
    said = [r.getMessage() for r in nanochat_log.records if "holds FP8 weights" in r.getMessage()]
    assert len(said) == 1 and "14 Linear layers dequantized to float32" in said[0], said
    codes, scale = stored["model.layers.0.mlp.down_proj.weight"], stored["model.layers.0.mlp.down_proj.weight_scale"]
    assert torch.equal(start["w"], codes.float() * scale)
    losses = [r["loss"] for r in run_records(tmp_path / "ft") if "loss" in r]
    assert result.steps == 4 and losses[-1] < losses[0]
