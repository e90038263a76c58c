"""nanochat.tokenizer: our BPETokenizer (bpe.py) checked against the input itself, the UTF-8 codec
and a saved copy; the split-pattern probe (patterns.py); the Tokenizer / ChatTokenizer protocols
that BPETokenizer and HFTokenizer both satisfy (HFTokenizer itself: tests/test_hf.py).

- round trip: decode(encode(s)) == s exactly (reference: s) for emoji, CJK, combining marks,
  U+FFFD, NUL, control characters, special-token strings, \\r\\n runs, long digit runs, and
  random strings over all Unicode planes; characters never seen in training included;
- special tokens: never produced from plain text, even when the text spells "<|bos|>";
  prepend_bos adds exactly one bos_id;
- token_bytes: sum(token_bytes[ids]) == len(s.encode("utf-8")) (reference: Python's codec);
  0 for specials;
- save/load: identical ids, vocabulary and fingerprint; files are text and JSON (no pickle);
  a directory that is not a tokenizer fails naming the missing file and the command to make one;
  an edited file fails the fingerprint check;
- training: deterministic (same corpus -> same fingerprint), vocab_size counts bytes + merges +
  specials, too-small vocab_size is a ValueError (not a panic inside rustbpe);
- the on-the-fly cache: keyed by the sources' listing; trained on the in-memory corpus's training
  documents (the same fingerprint); a second get_or_train_tokenizer call loads instead of training;
- split patterns from a saved tokenizer: one with catastrophic backtracking (a Rust panic inside
  tiktoken on today's text) is refused at load by the probe: scripts/base_train.py exits 2 with
  one `error:` line naming the directory, the pattern and the fix, no traceback and no panic
  message; one that skips text is refused too; one that passes the probe but panics on other
  text is a UsageError from encode and encode_batch, never the PanicException (a BaseException);
- the protocols: every member of Tokenizer (and of ChatTokenizer for HFTokenizer) is on both
  classes with a signature that accepts the protocol's calls (each parameter present, of the same
  kind, extra ones defaulted), and code written against the protocol alone gets the same answers
  from both (decode(encode(s)) == s, one bos_id prepended, token_bytes summing to the UTF-8 length,
  the fingerprint surviving save and load).
All comparisons are exact (tolerance 0): a tokenizer is integer bookkeeping.

Modules: nanochat.tokenizer, nanochat.tokenizer.bpe, nanochat.tokenizer.patterns.
"""

import base64
import inspect
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanochat.data.prepare import get_or_train_tokenizer
from nanochat.data.plan import plan_sources
from nanochat.data.sources import list_sources
import nanochat.tokenizer.patterns
from nanochat.common import UsageError
from nanochat.tokenizer import SPECIAL_TOKENS, BPETokenizer, ChatTokenizer, HFTokenizer, Tokenizer, take_chars
from tests.reference_data import load_corpus

ROOT = Path(__file__).resolve().parents[1]
# (\w+\s?)+ before a lookahead: exponential backtracking on ~25 word characters, which tiktoken's
# regex engine (fancy_regex) gives up on with a panic. The alternative [\s\S] makes it match
# every character, so nothing but the backtracking is wrong with it.
RUNAWAY = r"(?:\w+\s?)+(?!x)\d|[\s\S]"

TRICKY = [
    "",
    "hello world",
    "emoji 👋🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "CJK 漢字とひらがなとカタカナ、한국어",
    "combining: e\u0301 a\u0300\u0316 Z\u0351\u0357\u0306 and precomposed é",
    "replacement char \ufffd and BOM \ufeff and nbsp\u00a0and zwsp\u200b",
    "NUL\x00inside and controls \x01\x07\x1b[31m\x7f\x80\x9f",
    "<|bos|> looks special <|end|><|user_start|> but is text",
    "windows\r\nnewlines\r\n\r\n\ttabs \t \n   trailing   ",
    "digits 3.14159265358979 1234567890 ١٢٣ ½",
    "Привет, мир! Γειά σου Κόσμε! שלום עולם مرحبا",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 astral 𐍈 \U0010fffd",
    "x" * 5000,
]


@pytest.fixture(scope="module")
def tok(small_corpus) -> BPETokenizer:
    texts = [p.read_text(encoding="utf-8") for p in sorted(small_corpus.glob("*.py"))]
    return BPETokenizer.train(texts, 512, progress=False)


def _random_strings(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        chars = []
        for _ in range(rng.randint(1, 40)):
            cp = rng.choice([rng.randint(0, 0x7F), rng.randint(0x80, 0x7FF),
                             rng.randint(0x800, 0xFFFF), rng.randint(0x10000, 0x10FFFF)])
            if 0xD800 <= cp <= 0xDFFF:  # surrogates are not Unicode scalar values: no UTF-8 form
                cp = 0xFFFD
            chars.append(chr(cp))
        out.append("".join(chars))
    return out


def test_round_trip_is_exact(tok):
    for s in TRICKY + _random_strings(300):
        ids = tok.encode(s)
        assert tok.decode(ids) == s, repr(s)
        assert tok.decode_bytes(ids) == s.encode("utf-8")


def test_lone_surrogate_becomes_replacement_char(tok):
    # Documented limit: "\ud800" has no UTF-8 encoding; tiktoken substitutes U+FFFD.
    assert tok.decode(tok.encode("a\ud800b")) == "a\ufffdb"


def test_special_tokens_never_come_from_text(tok):
    first_special = tok.vocab_size - len(SPECIAL_TOKENS)
    assert tok.bos_id == first_special and tok.special_tokens["<|bos|>"] == tok.bos_id
    for s in TRICKY:
        assert all(i < first_special for i in tok.encode(s)), repr(s)
    ids = tok.encode("<|bos|>")
    assert tok.bos_id not in ids and len(ids) > 1


def test_prepend_bos_and_batch(tok):
    texts = TRICKY[:6]
    assert tok.encode(texts[1], prepend_bos=True) == [tok.bos_id] + tok.encode(texts[1])
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    assert tok.encode_batch(texts, prepend_bos=True, num_threads=2) == [
        [tok.bos_id] + tok.encode(t) for t in texts]
    assert tok.decode([tok.bos_id]) == "<|bos|>"


def test_token_bytes_count_utf8_bytes(tok):
    tb = tok.token_bytes()
    assert tb.dtype == torch.int64 and tb.shape == (tok.vocab_size,)
    assert tb[-len(SPECIAL_TOKENS):].tolist() == [0] * len(SPECIAL_TOKENS)
    assert tb[:256].tolist() == [1] * 256
    for s in TRICKY + _random_strings(50, seed=1):
        ids = tok.encode(s, prepend_bos=True)
        assert int(tb[torch.tensor(ids, dtype=torch.long)].sum()) == len(s.encode("utf-8"))


def test_save_load_identical(tok, tmp_path):
    tok.save(tmp_path / "t")
    meta = json.loads((tmp_path / "t" / "tokenizer_meta.json").read_text())
    assert meta["vocab_size"] == tok.vocab_size and meta["special_tokens"] == tok.special_tokens
    lines = (tmp_path / "t" / "tokenizer.tiktoken").read_text(encoding="ascii").splitlines()
    assert len(lines) == tok.vocab_size - len(SPECIAL_TOKENS)
    assert base64.b64decode(lines[65].split()[0]) == b"A" and lines[65].split()[1] == "65"
    loaded = BPETokenizer.load(tmp_path / "t")
    assert loaded.fingerprint == tok.fingerprint and loaded.vocab_size == tok.vocab_size
    assert loaded.mergeable_ranks == tok.mergeable_ranks
    for s in TRICKY + _random_strings(50, seed=2):
        assert loaded.encode(s) == tok.encode(s)
    assert torch.equal(loaded.token_bytes(), tok.token_bytes())


def test_load_errors_name_the_missing_file_and_the_fix(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer_meta\.json is missing.*scripts/tok_train\.py --tokenizer_dir"):
        BPETokenizer.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist.*scripts/tok_train.py"):
        BPETokenizer.load(tmp_path / "nope")
    d = tok.save(tmp_path / "t")
    (d / "tokenizer.tiktoken").unlink()
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.tiktoken is missing"):
        BPETokenizer.load(d)
    d = tok.save(tmp_path / "edited")
    lines = (d / "tokenizer.tiktoken").read_text().splitlines()
    lines[300], lines[301] = lines[301].split()[0] + " 300", lines[300].split()[0] + " 301"  # swap two merges
    (d / "tokenizer.tiktoken").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="fingerprint"):
        BPETokenizer.load(d)


def test_training_is_deterministic_and_sized(small_corpus, tok):
    texts = [p.read_text(encoding="utf-8") for p in sorted(small_corpus.glob("*.py"))]
    again = BPETokenizer.train(texts, 512, progress=False)
    assert again.fingerprint == tok.fingerprint
    assert tok.vocab_size == 512
    assert BPETokenizer.train(["abc abc"], 260, progress=False).vocab_size == 260  # bytes + specials only
    # A corpus with only a handful of distinct pairs cannot fill the vocabulary: smaller, not an error.
    assert 260 < BPETokenizer.train(["ab ab ab"], 1000, progress=False).vocab_size < 1000
    with pytest.raises(ValueError, match="at least 260"):
        BPETokenizer.train(texts, 259, progress=False)


def test_take_chars():
    assert list(take_chars(["abc", "defg", "hi"], 5)) == ["abc", "de"]
    assert list(take_chars(["abc"], 10)) == ["abc"]


def test_get_or_train_tokenizer_caches(small_corpus, tmp_path, monkeypatch):
    plan = plan_sources(list_sources(small_corpus))
    first = get_or_train_tokenizer(plan, 400, tmp_path, progress=False)
    cached = list(tmp_path.iterdir())
    key = plan.sources.fingerprint  # the listing: a start reads no document to find the cache
    assert [p.name for p in cached] == [f"tokenizer-{key}-400-20000000chars"]  # no temp dirs left
    # trained on exactly the training documents of the in-memory corpus, in order
    assert first.fingerprint == BPETokenizer.train(load_corpus(small_corpus).train_docs, 400, progress=False).fingerprint

    def no_training(*a, **k):
        raise AssertionError("retrained instead of loading the cache")

    monkeypatch.setattr(BPETokenizer, "train", no_training)
    second = get_or_train_tokenizer(plan, 400, tmp_path, progress=False)
    assert second.fingerprint == first.fingerprint
    monkeypatch.undo()
    # max_chars is part of the key: a different tokenizer, its own directory.
    small = get_or_train_tokenizer(plan, 400, tmp_path, max_chars=10_000, progress=False)
    assert small.fingerprint != first.fingerprint
    assert (tmp_path / f"tokenizer-{key}-400-10000chars").is_dir()


def _saved_with_pattern(tok: BPETokenizer, pattern: str, directory: Path, monkeypatch) -> Path:
    """`tok`'s vocabulary saved with `pattern`, as a hand-edited or older tokenizer could be: the
    probe is switched off for the save only."""
    with monkeypatch.context() as m:
        m.setattr(nanochat.tokenizer.patterns, "PROBE_TEXTS", ())
        BPETokenizer(tok.mergeable_ranks, pattern).save(directory)
    return directory


def test_runaway_pattern_is_refused_at_load_in_one_line(tok, small_corpus, tmp_path, monkeypatch):
    saved = _saved_with_pattern(tok, RUNAWAY, tmp_path / "tok", monkeypatch)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "base_train.py"), "--model_name", "d2",
                        "--tokenizer_dir", str(saved), "--dataset_path", str(small_corpus), "--num_iterations", "1",
                        "--batch_size", "2", "--seq_len", "32", "--device", "cpu", "--run_dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "RUST_BACKTRACE": "1"})
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "panicked" not in r.stderr, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {saved}: the split pattern ")
    assert "exceeds the regex engine's backtracking limit on 'aaaa" in errors[0]
    assert errors[0].endswith(f"make one with: python scripts/tok_train.py --tokenizer_dir {saved}")


def test_pattern_that_skips_text_is_refused(tok, tmp_path, monkeypatch):
    saved = _saved_with_pattern(tok, r"\w+", tmp_path / "tok", monkeypatch)
    with pytest.raises(UsageError, match=r"the split pattern '\\\\w\+' skips part of '     .*so encoding would "
                                         "silently drop text"):
        BPETokenizer.load(saved)


def test_panic_on_text_the_probe_missed_is_a_usage_error(tok):
    """Q is in no probe text: the pattern passes, then gives up on a run of Q's."""
    late = BPETokenizer(tok.mergeable_ranks, r"(?:Q+\s?)+(?!x)\d|[\s\S]")
    assert late.decode(late.encode("QQ QQ 123")) == "QQ QQ 123"
    for encode in (late.encode, lambda text: late.encode_batch([text])):
        with pytest.raises(UsageError, match="made the tokenizer library give up on a text .*BacktrackLimitExceeded"
                                             ".*catastrophic backtracking.*; retrain the tokenizer"):
            encode("Q" * 64)


def _hf_tokenizer(texts: list[str]) -> HFTokenizer:
    """A byte-level BPE in tokenizer.json form (the tokenizers library), as a checkpoint ships it."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, show_progress=False, special_tokens=["<s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    config = {"bos_token": "<s>", "eos_token": "<s>", "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}
    return HFTokenizer({"tokenizer.json": raw.to_str().encode(), "tokenizer_config.json": json.dumps(config).encode()})


def _members(protocol: type) -> dict[str, object]:
    """The protocol's own members (attributes, properties, methods), its bases' included."""
    out = {}
    for cls in reversed(protocol.__mro__):
        if cls in (ChatTokenizer, Tokenizer):
            out.update({n: v for n, v in vars(cls).items() if not n.startswith("_")})
            out.update({n: None for n in vars(cls).get("__annotations__", {})})
    return out


def _accepts(impl, spec) -> list[str]:
    """What keeps `impl`'s signature from taking every call `spec`'s allows (empty: nothing)."""
    have, want = inspect.signature(impl).parameters, inspect.signature(spec).parameters
    problems = [f"{n} missing or of another kind" for n, p in want.items()
                if n not in have or have[n].kind != p.kind]
    problems += [f"{n} has no default" for n, p in have.items()
                 if n not in want and p.default is inspect.Parameter.empty
                 and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return problems


def test_both_tokenizers_satisfy_the_protocols(tok):
    hf = _hf_tokenizer([p for p in TRICKY if p] * 3)
    for impl, protocol in ((tok, Tokenizer), (hf, ChatTokenizer)):
        for name, spec in _members(protocol).items():
            assert hasattr(impl, name), (type(impl).__name__, name)
            if isinstance(spec, property):
                assert isinstance(getattr(type(impl), name), property), (type(impl).__name__, name)
            elif callable(spec):
                problems = _accepts(getattr(impl, name), spec.__get__(impl))  # both bound: no self
                assert not problems, (type(impl).__name__, name, problems)
    assert isinstance(tok.fingerprint, str) and isinstance(hf.fingerprint, str) and hf.chat_template is not None


def test_code_written_against_the_protocol_gets_the_same_answers(tok, tmp_path):
    def check(t: Tokenizer, directory: Path) -> None:
        for text in TRICKY[:10]:
            ids = t.encode(text, prepend_bos=True)
            assert ids[0] == t.bos_id and t.bos_id not in ids[1:] and max(ids) < t.vocab_size
            assert t.decode(ids[1:]) == text
            assert int(t.token_bytes()[ids[1:]].sum()) == len(text.encode("utf-8"))
        assert t.encode_batch(TRICKY[:3]) == [t.encode(x) for x in TRICKY[:3]]
        saved = t.save(directory)
        assert type(t).load(saved).fingerprint == t.fingerprint

    check(tok, tmp_path / "bpe")
    check(_hf_tokenizer([p for p in TRICKY if p] * 3), tmp_path / "hf")
