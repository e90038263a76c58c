"""Hugging Face checkpoints in and out, checked against `transformers`: nanochat.model.hub (resolution),
nanochat.model.hf (config map, weights in), nanochat.model.export (export_hf) and
nanochat.tokenizer.hf (HFTokenizer).

- Loading: tiny random Llama (plain, llama3 rope scaling, linear rope scaling, attention_bias),
  Mistral (GQA, explicit head_dim, an active sliding window), Qwen2 (q/k/v bias, tied
  embeddings) are written with `save_pretrained` and loaded by us; our logits must equal
  transformers' in fp32 within atol 1e-5, rtol 1e-5 (measured: bit-identical, 0.0 difference,
  on this CPU; the budget allows for a different reduction order elsewhere). A sharded
  checkpoint (index.json) loads to the same weights; bf16 loading keeps fp32 rotary tables.
- Export: our export of a loaded model, reloaded by transformers' AutoModelForCausalLM, gives
  the same logits (same tolerance); AutoTokenizer reads the exported tokenizer and encodes the
  same ids; exporting a nanochat preset is an error naming what does not map.
- Tokenizer: encode against transformers' tokenizer (identical ids, no special tokens added,
  special-token text not parsed unless allow_special), chat rendering against
  `apply_chat_template` (identical text), token_bytes against the UTF-8 length of the text.
- Resolution: presets, local dirs, hub ids in a fake cache (env var pointing at a tmp dir;
  refs/main preferred over a newer snapshot; huggingface_hub's layout of files linked to blobs/
  resolves, a file linked out of the cache is refused, by scripts/base_train.py too); a missing model is a FileNotFoundError that lists
  the searched paths and the download command, with HF_HUB_OFFLINE=1 and socket.connect
  patched to fail, so any network attempt would fail the test.
- Unsupported architectures and options are errors that name them.
- A tokenizer.json regex with catastrophic backtracking (a Rust panic inside tokenizers) is
  refused at load naming the file; one the load-time probe misses is a UsageError from encode.
- FP8 (nanochat.fp8.convert, emulated): a loaded model converts (the SwiGLU Linears, not
  lm_head), its FP8 forward stays close to transformers' (SQNR > 10 dB; measured 13.6 dB with
  the deliberately large test weights) and its export carries the untouched fp32 weights.
- scripts/export_hf.py on a run checkpoint (with torch.compile key prefixes) reloads in
  transformers with our logits (TOL); a non-empty --out_dir is refused (its bytes unchanged)
  unless --overwrite, which replaces it whole, and never the run's base model or run directory.
"""

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from nanochat.model.gpt import GPT, preset_config  # noqa: E402
from nanochat.model.export import export_hf  # noqa: E402
from nanochat.model.hf import gpt_config_from_hf, load_hf_model  # noqa: E402
from nanochat.model.hub import resolve_model  # noqa: E402
from nanochat.tokenizer.hf import HFTokenizer  # noqa: E402
from tests.conftest import load_script, run_records, warnings_in  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
# Our model against transformers' on the same weights: forward passes only, with no FP8 cast and no
# optimizer step to amplify a last bit, so the two differ by fp32 sums over widths <= 128 taken in
# another order (~sqrt(n) * 2^-24 relative, ~1e-6 on logits of magnitude <= 10): 1e-5 has 10x to spare.
TOL = dict(rtol=1e-5, atol=1e-5)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXTS = ["hello world, this is a tiny corpus for a tiny tokenizer.", "def f(x):\n    return x * 2\n",
         "naïve café 日本語 ünïcödé"] * 20


def _byte_level_tokenizer():
    """A GPT-2/Llama-3-style byte-level BPE, trained on a few lines (vocab <= VOCAB)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS, trainer)
    return tok


def _sentencepiece_style_tokenizer():
    """A Llama-2/Mistral-style BPE: U+2581 for spaces, <0xNN> byte-fallback tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=40, show_progress=False, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(TEXTS[:2], trainer)  # ASCII only: the rest must fall back to bytes
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.normalizer = normalizers.Sequence([])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tok


def _save_tokenizer(tok, directory, **special):
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **special)
    fast.chat_template = CHATML
    fast.save_pretrained(directory)


MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0, original_max_position_embeddings=16))),
    "llama_linear_rope_bias": ("LlamaConfig", "LlamaForCausalLM", dict(
        attention_bias=True, rope_scaling=dict(rope_type="linear", factor=2.0))),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, head_dim=24)),
    "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
}


def _save_model(kind: str, directory, **extra):
    config_cls, model_cls, kw = MODELS[kind]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**COMMON, **{**kw, **extra})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # larger than HF's init (std 0.02), so attention is far from uniform
        for p in model.parameters():
            p.normal_(0, 0.3 if p.ndim > 1 else 1.0)
    model.save_pretrained(directory)
    if kind.startswith("qwen2"):
        _save_tokenizer(_byte_level_tokenizer(), directory, eos_token="<|im_end|>")
    elif kind == "mistral":
        _save_tokenizer(_sentencepiece_style_tokenizer(), directory, bos_token="<s>", eos_token="</s>")
    else:
        _save_tokenizer(_byte_level_tokenizer(), directory, bos_token="<s>", eos_token="</s>")
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """kind -> (directory, the transformers model)."""
    out = {}
    for kind in MODELS:
        d = tmp_path_factory.mktemp(kind)
        out[kind] = (d, _save_model(kind, d))
    return out


def _ids(seed=0, n=40):
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", list(MODELS))
def test_loaded_logits_match_transformers(saved, kind):
    directory, ref = saved[kind]
    model, tok = load_hf_model(directory)
    assert isinstance(model, GPT) and isinstance(tok, HFTokenizer)
    idx = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(idx), ref(idx).logits, **TOL)
    if kind == "qwen2_tied":
        assert model.lm_head.weight is model.transformer.wte.weight
        assert model.transformer.h[0].attn.c_q.bias is not None and model.transformer.h[0].attn.c_proj.bias is None
    if kind == "llama3_rope":
        assert model.config.rope_scaling == "llama3"


def test_sharded_checkpoint_and_bf16(saved, tmp_path):
    directory, ref = saved["llama"]
    ref.save_pretrained(tmp_path, max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(directory / f, tmp_path / f)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model, _ = load_hf_model(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(model(_ids()), ref(_ids()).logits, **TOL)
    bf16, _ = load_hf_model(directory, dtype=torch.bfloat16, seq_len=32)
    assert bf16.transformer.wte.weight.dtype == torch.bfloat16 and bf16.cos.dtype == torch.float32
    assert bf16.config.seq_len == 32 and bf16.cos.shape[0] == 32


def test_active_sliding_window_caps_context(tmp_path):
    ref = _save_model("mistral", tmp_path, sliding_window=16)
    model, _ = load_hf_model(tmp_path)
    assert model.config.seq_len == 16  # the window, not max_position_embeddings=64
    idx = _ids(n=16)
    with torch.no_grad():
        torch.testing.assert_close(model(idx), ref(idx).logits, **TOL)
    with pytest.raises(ValueError, match="sliding_window 16"):
        load_hf_model(tmp_path, seq_len=32)


@pytest.mark.parametrize("kind", ["llama3_rope", "qwen2_tied", "llama_linear_rope_bias"])
def test_export_reloads_in_transformers(saved, tmp_path, kind):
    directory, ref = saved[kind]
    model, tok = load_hf_model(directory)
    with torch.no_grad():
        for p in model.parameters():  # a "fine-tuned" model: the export must carry our weights
            p.add_(0.01 * torch.randn_like(p))
    export_hf(model, tok, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(reloaded).__name__ == type(ref).__name__
    idx = _ids(1)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(idx).logits, model(idx), **TOL)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "hello café world"
    assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text)


def test_export_of_preset_names_what_does_not_map(tmp_path):
    torch.manual_seed(0)
    model = GPT(preset_config("d2", vocab_size=300, seq_len=16))
    with pytest.raises(ValueError, match=r"mlp='relu2'.*softcap.*qk_norm"):
        export_hf(model, None, tmp_path)


def test_fp8_converted_model_exports_plain_weights(saved, tmp_path):
    fp8 = pytest.importorskip("nanochat.fp8")
    directory, ref = saved["llama"]
    model, tok = load_hf_model(directory)
    report = fp8.convert(model, fp8.FP8Config(emulate=True, layers="all", min_dim=16))
    converted = [n for n, m in model.named_modules() if isinstance(m, fp8.FP8Linear)]
    assert "transformer.h.0.mlp.c_gate" in converted and "lm_head" not in converted, report
    with torch.no_grad():  # FP8 forward: close to transformers (SQNR measured 13.6 dB with these
        out, ref_out = model(_ids()), ref(_ids()).logits  # deliberately large random weights)
    sqnr_db = 10 * torch.log10(ref_out.pow(2).mean() / (out - ref_out).pow(2).mean())
    assert sqnr_db > 10, sqnr_db
    export_hf(model, tok, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():  # the weights are the untouched master weights: exact high-precision match
        torch.testing.assert_close(reloaded(_ids()).logits, ref(_ids()).logits, **TOL)


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_matches_transformers(saved):
    directory, _ = saved["qwen2_tied"]
    ours = HFTokenizer.load(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    text = "naïve café 日本語, hello world!\n  def f(x): return 2"
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == text
    assert ours.encode_batch([text, "hi"]) == [ids, ours.encode("hi")]
    assert ours.bos_id == ours.eos_id == theirs.convert_tokens_to_ids("<|im_end|>")  # Qwen2: no BOS
    assert ours.encode("x", prepend_bos=True)[0] == ours.bos_id
    im_start = theirs.convert_tokens_to_ids("<|im_start|>")
    assert im_start not in ours.encode("<|im_start|>")            # documents cannot inject specials
    assert ours.encode("<|im_start|>", allow_special=True) == [im_start]
    tb = ours.token_bytes()
    assert tb.shape == (ours.vocab_size,) and tb[im_start] == 0
    assert int(tb[ids].sum()) == len(text.encode("utf-8"))


def test_sentencepiece_style_token_bytes(saved):
    directory = saved["mistral"][0]
    ours = HFTokenizer.load(directory)
    raw = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    text = "hello world 日本"
    ids = ours.encode(text)
    assert sum(raw.id_to_token(i).startswith("<0x") for i in ids) == 6  # 日本: 6 UTF-8 bytes, no merges
    # the Metaspace pre-tokenizer adds one leading "\u2581" (a space) that the decoder strips
    assert int(ours.token_bytes()[ids].sum()) == len(text.encode("utf-8")) + 1
    assert ours.decode(ids) == text
    assert ours.bos_id == 1


def test_chat_template_matches_transformers(saved):
    directory, _ = saved["llama"]
    ours = HFTokenizer.load(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "bye"}]
    for gen in (False, True):
        text = ours.render_chat(messages, add_generation_prompt=gen)
        assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    text = ours.render_chat(messages, add_generation_prompt=True)
    assert ours.encode(text, allow_special=True) == theirs.encode(text, add_special_tokens=False)


def test_tokenizer_save_load_roundtrip(saved, tmp_path):
    ours = HFTokenizer.load(saved["llama"][0])
    again = HFTokenizer.load(ours.save(tmp_path))
    assert again.fingerprint == ours.fingerprint and again.chat_template == ours.chat_template


# ----------------------------------------------------------------------------- resolution


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def fake_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return cache


def test_resolve_preset_and_directory(saved):
    assert resolve_model("d4").kind == "preset" and resolve_model("d4").path is None
    directory = saved["llama"][0]
    r = resolve_model(str(directory))
    assert (r.kind, r.path) == ("hf", directory)


def test_resolve_hub_id_from_cache(saved, fake_cache, no_network):
    repo = fake_cache / "models--tiny-org--tiny-llama"
    main = repo / "snapshots" / ("1111aaaa" * 5)  # snapshot names are 40-hex commit hashes
    newer = repo / "snapshots" / ("2222bbbb" * 5)
    shutil.copytree(saved["llama"][0], main)
    shutil.copytree(saved["llama"][0], newer)
    os.utime(newer, (2e9, 2e9))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("1111aaaa" * 5)
    assert resolve_model("tiny-org/tiny-llama").path == main  # refs/main wins over a newer snapshot
    (repo / "refs" / "main").unlink()
    r = resolve_model("tiny-org/tiny-llama")
    assert r.path == newer and r.kind == "hf"  # no ref: the latest snapshot
    model, _ = load_hf_model(r.path)
    with torch.no_grad():
        torch.testing.assert_close(model(_ids()), saved["llama"][1](_ids()).logits, **TOL)


def test_cache_ref_must_be_a_hash_inside_the_cache(saved, fake_cache, tmp_path, no_network):
    """refs/main holding a path, or a snapshot symlinked out of the cache, is refused (reference:
    the directory outside the cache that would otherwise have been loaded)."""
    outside = tmp_path / "outside"
    shutil.copytree(saved["llama"][0], outside)
    repo = fake_cache / "models--tiny-org--tiny-llama"
    (repo / "snapshots").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("../../../outside")
    with pytest.raises(ValueError, match=r"refs/main holds '\.\./\.\./\.\./outside', not a commit hash"):
        resolve_model("tiny-org/tiny-llama")
    (repo / "refs" / "main").write_text("3" * 40)
    (repo / "snapshots" / ("3" * 40)).symlink_to(outside)
    with pytest.raises(ValueError, match="outside the cache"):
        resolve_model("tiny-org/tiny-llama")


def _hub_layout(cache: Path, repo_id: str, source: Path, revision: str = "4" * 40) -> Path:
    """`source`'s files in huggingface_hub's cache layout: each file a blob named by its sha256
    under models--org--name/blobs/, linked from snapshots/<revision>/ by a relative symlink."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in source.iterdir():
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def test_cache_file_linked_outside_the_cache_is_refused(saved, fake_cache, tmp_path, small_corpus, no_network):
    """A snapshot file that links out of the model's cache folder (reference: the same layout with
    every link into blobs/, which resolves and loads) is refused in one line, by the CLI too."""
    snapshot = _hub_layout(fake_cache, "tiny-org/tiny-llama", saved["llama"][0])
    assert resolve_model("tiny-org/tiny-llama").path == snapshot
    load_hf_model(snapshot)
    outside = tmp_path / "elsewhere" / "tokenizer.json"
    outside.parent.mkdir()
    shutil.copyfile(snapshot / "tokenizer.json", outside)  # a working file: only where it lives is wrong
    (snapshot / "tokenizer.json").unlink()
    (snapshot / "tokenizer.json").symlink_to(outside)
    with pytest.raises(ValueError, match=rf"cache entry {snapshot}/tokenizer\.json resolves to {outside}, outside "
                                         rf"the cache folder {fake_cache.resolve()}/models--tiny-org--tiny-llama"):
        resolve_model("tiny-org/tiny-llama")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "base_train.py"), "--model_name", "tiny-org/tiny-llama",
                        "--dataset_path", str(small_corpus), "--num_iterations", "1", "--device", "cpu",
                        "--run_dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr and f"resolves to {outside}" in errors[0]
    assert errors[0].endswith("remove it and download the model again")


def test_malformed_hf_files_name_the_file(saved, tmp_path):
    model_dir = tmp_path / "m"
    shutil.copytree(saved["llama"][0], model_dir)
    (model_dir / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"m/config\.json holds a JSON list"):
        load_hf_model(model_dir)
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"m/config\.json is not valid JSON"):
        load_hf_model(model_dir)
    shutil.copy(saved["llama"][0] / "config.json", model_dir / "config.json")
    (model_dir / "tokenizer.json").write_text('{"truncated": ')
    with pytest.raises(ValueError, match=r"m/tokenizer\.json is not a tokenizer"):
        load_hf_model(model_dir)


def _with_split_regex(directory: Path, pattern: str) -> Path:
    """A copy of the byte-level tokenizer whose pre-tokenizer first splits on `pattern` (a Split
    pre-tokenizer, as Llama 3's and Qwen2's tokenizer.json have), in `directory`."""
    from tokenizers import Regex, pre_tokenizers

    tok = _byte_level_tokenizer()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    directory.mkdir()
    (directory / "tokenizer.json").write_text(tok.to_str())
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return directory


def test_runaway_tokenizer_regex_is_refused_at_load(tmp_path):
    """(\\w+\\s?)+ before a lookahead: the tokenizers library's regex engine (Oniguruma) gives up on
    ~25 word characters with a Rust panic; the probe finds it at load."""
    d = _with_split_regex(tmp_path / "runaway", r"(?:\w+\s?)+(?!x)\d")
    with pytest.raises(ValueError, match=rf"^{d}/tokenizer\.json \(a regex of its normalizer or pre-tokenizer\) "
                                         r"exceeds the regex engine's backtracking limit on 'aaaa.*; restore "
                                         r"tokenizer\.json from the model's source$"):
        HFTokenizer.load(d)


def test_tokenizer_regex_panic_the_probe_missed_is_a_usage_error(tmp_path):
    """Q is in no probe text: the tokenizer loads, then a run of Q's is a UsageError from encode
    and encode_batch, never the PanicException (a BaseException the CLI's handler misses)."""
    from nanochat.common import UsageError

    tok = HFTokenizer.load(_with_split_regex(tmp_path / "late", r"(?:Q+\s?)+(?!x)\d"))
    assert tok.decode(tok.encode("QQ QQ 12")) == "QQ QQ 12"
    for encode in (tok.encode, lambda text: tok.encode_batch([text])):
        with pytest.raises(UsageError, match="tokenizer.json .* made the tokenizer library give up on a text "
                                             r"\(Onig: .*retry-limit-in-match over\): catastrophic backtracking"):
            encode("Q" * 64)


def test_missing_model_errors_without_network(fake_cache, no_network):
    with pytest.raises(FileNotFoundError) as e:
        resolve_model("meta-llama/Llama-3.2-1B")
    msg = str(e.value)
    assert str(fake_cache / "models--meta-llama--Llama-3.2-1B") in msg
    assert "huggingface-cli download meta-llama/Llama-3.2-1B" in msg and "d4" in msg


def test_directory_without_config_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        resolve_model(str(tmp_path))


# ----------------------------------------------------------------------------- unsupported


@pytest.mark.parametrize("change,match", [
    (dict(model_type="gpt2"), "model_type 'gpt2' is not supported"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "rope_type='yarn'"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(mlp_bias=True), "mlp_bias"),
])
def test_unsupported_options_are_named(change, match):
    hf = dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=64)
    hf.update(change)
    with pytest.raises(ValueError, match=match):
        gpt_config_from_hf(hf)


# ----------------------------------------------------------------------------- export script


def test_export_script_from_run_checkpoint(saved, tmp_path, monkeypatch, capsys, nanochat_log):
    """A run's checkpoint (compiled-model key prefixes included) -> scripts/export_hf.py ->
    transformers reproduces the checkpoint's weights (logits within TOL of our model). The run is
    still in progress (its lock held): the export warns that it took the newest checkpoint. Its
    nanochat_export.json and its last line name the checkpoint and step; released without a
    result.json the run did not finish (one warning), with one for that step it did (none)."""
    import runpy

    from nanochat import rundir
    from nanochat.checkpoint import save_checkpoint
    from nanochat.model.export import require_exportable

    directory, _ = saved["qwen2_tied"]
    model, tok = load_hf_model(directory)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.1)
    run_dir = tmp_path / "run"
    save_checkpoint(run_dir, {"model": {f"_orig_mod.{k}": v for k, v in model.state_dict().items()},
                              "config": {"model_name": str(directory)}, "step": 1})
    tok.save(run_dir / "tokenizer")
    monkeypatch.setattr("sys.argv", ["export_hf.py", "--run_dir", str(run_dir), "--out_dir", str(tmp_path / "out")])
    rundir.acquire(run_dir)  # a training run still in progress there: its lock is held
    try:
        with pytest.raises(SystemExit) as exit_status:
            runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "export_hf.py"), run_name="__main__")
    finally:
        rundir.release(run_dir)
    assert exit_status.value.code == 0
    warnings = warnings_in(nanochat_log)
    assert [w for w in warnings if "still in progress" in w and "exporting its newest checkpoint, step 1" in w]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(_ids()).logits, model(_ids()), **TOL)
    with pytest.raises(ValueError, match="'d4' is a nanochat preset"):
        require_exportable("d4")
    said = json.loads((tmp_path / "out" / "nanochat_export.json").read_text())
    assert said == {"run_dir": str(run_dir.resolve()), "checkpoint": str(run_dir / "checkpoint-000001.pt"),
                    "step": 1, "run": "in progress"}
    # no longer held, and no result.json: it did not finish; with one for its step, it did
    for result, run, warned in ((None, "unfinished", "did not finish"), ({"steps": 1}, "finished", None)):
        if result is not None:
            (run_dir / "result.json").write_text(json.dumps(result))
        monkeypatch.setattr("sys.argv", ["export_hf.py", "--run_dir", str(run_dir), "--out_dir", str(tmp_path / run)])
        nanochat_log.clear()
        with pytest.raises(SystemExit):
            runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "export_hf.py"), run_name="__main__")
        warnings = warnings_in(nanochat_log)
        assert json.loads((tmp_path / run / "nanochat_export.json").read_text())["run"] == run
        assert f"exported {run_dir / 'checkpoint-000001.pt'} (step 1, {run}): " in capsys.readouterr().out
        assert [w for w in warnings if "WARNING" in w] == ([] if warned is None else [
            w for w in warnings if warned in w and "exporting its newest checkpoint, step 1" in w])
        assert len(warnings) == (0 if warned is None else 1), warnings


def _contents(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_export_refuses_a_non_empty_out_dir_and_replaces_it_whole(saved, tmp_path, capsys):
    """A previous export's shards and index in --out_dir: refused without --overwrite (its bytes
    unchanged); with it, replaced whole (no shard or index left, which a loader would prefer),
    and transformers reloads the run's weights (logits within TOL). --overwrite of the run's own
    base model directory, or of a directory holding the run, is refused before any work."""
    from nanochat.checkpoint import save_checkpoint
    from nanochat.common import logger

    logger.handlers.clear()  # log to this test's stderr (capsys replaces it per test)
    script = load_script("export_hf")
    base = tmp_path / "base"  # a copy: a failing refusal must not damage the module's fixture
    shutil.copytree(saved["qwen2_tied"][0], base)
    model, tok = load_hf_model(base)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.1)
    run_dir = tmp_path / "work" / "run"
    save_checkpoint(run_dir, {"model": model.state_dict(), "config": {"model_name": str(base)}, "step": 1})
    tok.save(run_dir / "tokenizer")
    out = tmp_path / "out"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_bytes(b"an earlier export's shard")
    (out / "model.safetensors.index.json").write_text('{"weight_map": {}}')

    def export(out_dir, *extra) -> tuple[int, list[str]]:
        capsys.readouterr()
        code = script.main(["--run_dir", str(run_dir), "--out_dir", str(out_dir), *extra])
        err = capsys.readouterr().err
        assert "Traceback" not in err, err
        return code, [line for line in err.splitlines() if line.startswith("error:")]

    before = _contents(out)
    code, errors = export(out)
    assert code == 2 and len(errors) == 1 and "is not empty" in errors[0] and "--overwrite" in errors[0], errors
    assert _contents(out) == before
    for protected, what in ((base, "is"), (tmp_path / "work", "contains")):
        kept = _contents(protected)
        code, errors = export(protected, "--overwrite")
        named = protected if what == "is" else run_dir
        assert code == 2 and len(errors) == 1 and f"{what} {named}" in errors[0], errors
        assert _contents(protected) == kept
    code, errors = export(out, "--overwrite")
    assert code == 0, errors
    assert "model.safetensors" in _contents(out) and not any(n.startswith("model-0") or n.endswith("index.json")
                                                             for n in _contents(out))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(_ids()).logits, model(_ids()), **TOL)


def test_trainer_fine_tunes_a_local_hf_model_with_fp8(saved, small_corpus, tmp_path):
    """`--model_name <local HF dir> --fp8 --fp8_mode e5m2` trains through NanoChatTrainer: the
    checkpoint's tokenizer is used, the reported conversion names the converted layers, and
    the loss after a few steps is below the first step's (reference: the same run's step 1)."""
    from nanochat.train.trainer import NanoChatTrainer
    from tests.conftest import tiny_train_kwargs

    directory, _ = saved["llama"]
    kw = tiny_train_kwargs(small_corpus, tmp_path / "ft", model_name=str(directory), num_iterations=6,
                           lr=3e-3, fp8=True, fp8_emulate=True, fp8_layers="all", fp8_mode="e5m2", fp8_min_dim=16,
                           fp8_opt_level=2)
    result = NanoChatTrainer(**kw).train()
    assert result.fp8_backend == "emulated"
    assert "model.layers.0.mlp.down_proj" not in result.fp8_converted  # our names, not HF's
    assert "transformer.h.0.mlp.c_fc" in result.fp8_converted and "lm_head" in result.fp8_skipped
    # the 64-element RMSNorm weights cannot hold FP8 blocks: recorded, not silent
    assert any("keep fp32 moments (numel < 4096)" in f for f in result.fallbacks), result.fallbacks
    records = run_records(tmp_path / "ft")
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < losses[0]
    assert HFTokenizer.load(tmp_path / "ft" / "tokenizer").fingerprint == HFTokenizer.load(directory).fingerprint
