"""Instruction records (nanochat.data.instruct, the instruct path of the in-memory reference in
tests/reference_data.py, nanochat.data.batches), checked against the formats written out by hand here:

- shapes: prompt/completion, chat messages and ARC multiple choice, each in a tiny .jsonl and
  .parquet file, with our tokenizer and with a Hugging Face tokenizer and a ChatML template:
  the whole stream decodes to the expected text (`<|bos|><|user_start|>p<|end|><|assistant_start|>
  c<|end|>` / ChatML), and the scored tokens decode, run by run, to exactly the assistant answers
  plus their closing token (`B<|end|>`, `c<|im_end|>\\n`): no prompt token is scored;
- the ARC prompt text (lettered options, numeric labels relettered) equals the documented one;
- base models: a tokenizer without a chat template falls back to the plain format (said once by
  the caller, returned as the fallback line); each shape's text and scored runs equal the
  documented format written out here; --chat_template plain / chatml / llama3 / a .jinja file
  render as the equivalent hand-written templates; unknown names and our own tokenizer with
  --chat_template are errors;
- multiple-choice items (stopping at a prompt-token budget, at least one): the prompt, each
  option and the turn's closing tokens are the rendering with that letter as its answer, the
  option decoding to the letter (one token, or two where the vocabulary has ` A` but not ` D`);
  with our tokenizer the prompt is `generation_prompt`'s;
- a Llama-3-like template with BOS and headers scores content + <|eot_id|>; a template that is
  not prefix-stable and a tokenizer that merges across a turn boundary are errors naming the
  record and the turn; a Hugging Face tokenizer without a template is an error;
- errors: an unknown shape names file:line, the fields and the supported shapes; a file mixing
  shapes names the line (jsonl) / row (parquet); text and records mixed in one corpus, bad
  roles, missing answers and bad answer keys are errors with file:line; a plain "text" file
  still reads as kind "text";
- batches: y from TokenBatches / val_batches is -1 exactly at unscored targets (checked on an
  arange stream, where every value names its position); windows without a scored target are
  never drawn, the others once per epoch; a state_dict resume equals an uninterrupted run;
- pack_records: every record that fits in a window (seq_len+1 tokens) lies inside one, whole and
  in order, with padding masked (checked position by position on hand-sized records and on ARC
  records through TokenBatches: each scored target's record starts inside the same window); a
  longer record starts at a window and is counted; the trainer records those as a fallback;
- one fine-tuning step of a d2 GPT on ARC records: the model's loss equals F.cross_entropy over
  the answer positions only (rtol 1e-6: the same fp32 ops in another order), differs from the
  unmasked loss, and one AdamW step lowers the masked loss on that batch.
Token bookkeeping is exact (tolerance 0).
"""

import itertools
from collections import Counter
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from nanochat.data import instruct
from nanochat.data.batches import TokenBatches, val_batches
from nanochat.data.sources import DataError
from nanochat.tokenizer import BPETokenizer
from tests.reference_data import load_corpus, pack_records, tokenize_records

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from nanochat.tokenizer import HFTokenizer  # noqa: E402

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3ISH = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
             "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
             "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
HF_SPECIALS = ["<s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

PROMPT_COMPLETION = [
    {"prompt": "Say hello.", "completion": "Hello there!"},
    {"prompt": "What is 2+2?", "completion": " 4"},
    {"prompt": "Name a colour.", "completion": "Blue, like the sea."},
]
MESSAGES = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"},
                  {"role": "assistant", "content": "6, of course."}]},
    {"messages": [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello, how can I help?"}]},
    {"messages": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris"}]},
]
ARC = [  # the Hugging Face ARC fields (id, question, choices{text,label}, answerKey)
    {"id": "Mercury_1", "question": "Which gas do plants absorb from the air?",
     "choices": {"text": ["oxygen", "carbon dioxide", "helium", "neon"], "label": ["A", "B", "C", "D"]},
     "answerKey": "B"},
    {"id": "Mercury_2", "question": "Which is a mammal?",
     "choices": {"text": ["shark", "trout", "whale"], "label": ["1", "2", "3"]}, "answerKey": "3"},
    {"id": "Mercury_3", "question": "What melts ice fastest?",
     "choices": {"text": ["salt", "sand", "sawdust", "paper"], "label": ["A", "B", "C", "D"]},
     "answerKey": "A"},
]
ROWS = {"prompt/completion": PROMPT_COMPLETION, "messages": MESSAGES, "multiple choice": ARC}
ANSWERS = {  # the assistant turns of each record, in order
    "prompt/completion": [[r["completion"]] for r in PROMPT_COMPLETION],
    "messages": [[m["content"] for m in r["messages"] if m["role"] == "assistant"] for r in MESSAGES],
    "multiple choice": [["B"], ["C"], ["A"]],
}


def _write(directory, name, rows, fmt):
    path = directory / f"{name}.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _runs(ids, mask):
    """The scored tokens as contiguous runs: [[id, ...], ...]."""
    return [[i for i, _ in group] for scored, group in itertools.groupby(zip(ids, mask), key=lambda t: t[1]) if scored]


@pytest.fixture(scope="module")
def tok(small_corpus) -> BPETokenizer:
    return BPETokenizer.train([p.read_text() for p in sorted(small_corpus.glob("*.py"))], 400, progress=False)


def _hf_tokenizer(template: str | None, extra_texts: list[str] = (), **special) -> HFTokenizer:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False, special_tokens=HF_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [json.dumps(r) for rows in ROWS.values() for r in rows] * 5 + list(extra_texts)
    raw.train_from_iterator(texts, trainer)
    config = {"eos_token": "<|im_end|>", **special}
    if template is not None:
        config["chat_template"] = template
    return HFTokenizer({"tokenizer.json": raw.to_str().encode(), "tokenizer_config.json": json.dumps(config).encode()})


@pytest.fixture(scope="module")
def chatml() -> HFTokenizer:
    return _hf_tokenizer(CHATML)


def _expected_text(kind: str, messages: list[dict]) -> tuple[str, list[str]]:
    """The whole record as text, and each scored run as text, written from the formats' specs."""
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    if kind == "ours":
        turns = list(messages)
        if turns[0]["role"] == "system":  # folded into the first user turn
            turns = [{"role": "user", "content": turns[0]["content"] + "\n\n" + turns[1]["content"]}, *turns[2:]]
        marker = {"user": "<|user_start|>", "assistant": "<|assistant_start|>"}
        text = "<|bos|>" + "".join(f"{marker[m['role']]}{m['content']}<|end|>" for m in turns)
        return text, [a + "<|end|>" for a in answers]
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text, [a + "<|im_end|>\n" for a in answers]


# ------------------------------------------------------------------ shapes
@pytest.mark.parametrize("kind", ["ours", "chatml"])
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize("shape", list(ROWS))
def test_only_assistant_tokens_are_scored(tmp_path, tok, chatml, kind, fmt, shape):
    _write(tmp_path, "data", ROWS[shape], fmt)
    corpus = load_corpus(tmp_path)
    assert corpus.kind == "instruct" and corpus.shapes == {shape: 3}
    assert len(corpus.train_records) == len(corpus.train_ids) and corpus.val_records
    tokenizer = tok if kind == "ours" else chatml
    by_id = dict(zip(corpus.train_ids + corpus.val_ids, corpus.train_records + corpus.val_records))
    for i, answers in enumerate(ANSWERS[shape]):
        record_id = f"data.{fmt}#{i + 1 if fmt == 'jsonl' else i}"
        messages = by_id[record_id]
        assert [m["content"] for m in messages if m["role"] == "assistant"] == answers
        tokens, mask = tokenize_records(tokenizer, [messages])
        assert tokens.dtype == torch.int32 and mask.dtype == torch.bool and tokens.shape == mask.shape
        text, scored = _expected_text(kind, messages)
        assert tokenizer.decode(tokens.tolist()) == text
        assert [tokenizer.decode(run) for run in _runs(tokens.tolist(), mask.tolist())] == scored
    # the corpus as one stream: records one after the other, runs in record order
    records = corpus.train_records + corpus.val_records
    tokens, mask = tokenize_records(tokenizer, records, ids=corpus.train_ids + corpus.val_ids)
    assert [tokenizer.decode(r) for r in _runs(tokens.tolist(), mask.tolist())] == [
        s for m in records for s in _expected_text(kind, m)[1]]


def test_arc_prompt_format(tmp_path):
    original = {"id": "x", "question": {"stem": "Which is a mammal?", "choices": [
        {"text": "shark", "label": "1"}, {"text": "trout", "label": "2"}, {"text": "whale", "label": "3"}]},
        "answerKey": "3"}
    _write(tmp_path, "arc", [ARC[1], original, {"question": "Which is a mammal?",
                                                "choices": ["shark", "trout", "whale"], "answerKey": "C"}], "jsonl")
    corpus = load_corpus(tmp_path)
    expected = [{"role": "user", "content": "Which is a mammal?\n\nA. shark\nB. trout\nC. whale\n\n"
                                            "Answer with the letter of the correct option.",
                 "shape": "multiple choice", "choices": "ABC"},
                {"role": "assistant", "content": "C"}]
    assert corpus.train_records + corpus.val_records == [expected] * 3


def test_llama3_like_template_scores_content_and_eot(tok):
    hf = _hf_tokenizer(LLAMA3ISH, bos_token="<s>", eos_token="<|eot_id|>")
    messages = MESSAGES[0]["messages"]
    tokens, mask = tokenize_records(hf, [messages])
    assert tokens[0].item() == hf.bos_id  # the template writes the BOS
    assert [hf.decode(r) for r in _runs(tokens.tolist(), mask.tolist())] == ["4<|eot_id|>", "6, of course.<|eot_id|>"]
    prompt = instruct.generation_prompt(hf, messages[:3])  # up to the first answer
    assert prompt == tokens.tolist()[:len(prompt)] and mask.tolist().index(True) == len(prompt)
    ours_prompt = instruct.generation_prompt(tok, messages[:3])
    ours_tokens, ours_mask = tokenize_records(tok, [messages[:3]])
    assert ours_tokens.tolist()[:len(ours_prompt)] == ours_prompt and ours_mask.tolist().index(True) == len(ours_prompt)


def test_template_that_is_not_prefix_stable_is_an_error(tmp_path):
    # Drops every assistant turn but the last one, as reasoning templates drop past thoughts.
    forgetful = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<|im_start|>{{ m['role'] }}\n"
                 "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    _write(tmp_path, "chat", MESSAGES, "jsonl")
    corpus = load_corpus(tmp_path)
    records = corpus.train_records + corpus.val_records
    ids = corpus.train_ids + corpus.val_ids
    # The generation prompt of assistant turn 2 follows the first answer, which the full rendering lacks.
    with pytest.raises(DataError, match=r"chat\.jsonl#1: the chat template is not prefix-stable: rendering "
                                        r"messages\[:2\] with the generation prompt .*differ at character 83"):
        tokenize_records(_hf_tokenizer(forgetful), records, ids=ids)
    with pytest.raises(DataError, match=r"no chat template.*chat_template\.jinja"):
        tokenize_records(_hf_tokenizer(None), records)


class _MergingTokenizer:
    """Duck-typed HF tokenizer whose encoding merges "\\n\\n" into one token (id 0), one id per
    other character: a turn boundary between "\\n" and "\\n" cannot be cut at a token."""

    chat_template = "(python)"
    bos_id = 1

    def render_chat(self, messages, add_generation_prompt=False):
        text = "".join(f"[{m['role']}]\n{m['content']}[end]" for m in messages)
        return text + ("[assistant]\n" if add_generation_prompt else "")

    def encode(self, text, *, allow_special=False):
        return [0 if piece == "\n\n" else ord(piece) for piece in _pieces(text)]

    def decode(self, ids):
        return "".join("\n\n" if i == 0 else chr(i) for i in ids)


def _pieces(text):
    i = 0
    while i < len(text):
        n = 2 if text[i:i + 2] == "\n\n" else 1
        yield text[i:i + n]
        i += n


def test_merge_across_turn_boundary_is_an_error():
    fake = _MergingTokenizer()
    ok = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    ids, mask = instruct.render(fake, ok)
    assert fake.decode(i for i, m in zip(ids, mask) if m) == "a[end]"
    bad = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\nleading newline"}]
    with pytest.raises(DataError, match=r"record 0: the tokenizer merges text across a turn boundary: messages\[:1\] "
                                        r"with the generation prompt"):
        tokenize_records(fake, [bad])


# ------------------------------------------------------------------- errors
def test_unknown_shape_names_fields_and_supported_shapes(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"prompt": "p", "completion": "c"}\n{"input": "i", "output": "o"}\n')
    with pytest.raises(DataError) as e:
        load_corpus(tmp_path)
    msg = str(e.value)
    assert "x.jsonl:2:" in msg and "['input', 'output']" in msg
    assert all(f in msg for f in ('"prompt"', '"completion"', '"messages"', '"answerKey"', '"text"'))
    (tmp_path / "x.jsonl").unlink()
    pq.write_table(pa.table({"input": ["i"], "output": ["o"]}), tmp_path / "y.parquet")
    with pytest.raises(DataError, match=r"y\.parquet: no \"text\" column \(columns: \['input', 'output'\]\).*"
                                        r"\"messages\".*\"answerKey\""):
        load_corpus(tmp_path)


def test_mixed_shapes_in_one_file_name_the_line(tmp_path):
    rows = [PROMPT_COMPLETION[0], {"text": "plain"}, MESSAGES[1]]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [rows[0], rows[2], rows[1]]))
    with pytest.raises(DataError, match=r"m\.jsonl:2: a messages record, but the file's first line "
                                        r"\(.*m\.jsonl:1\) is a prompt/completion record"):
        load_corpus(tmp_path)
    (tmp_path / "m.jsonl").unlink()
    pq.write_table(pa.Table.from_pylist([{**PROMPT_COMPLETION[0], "messages": None},
                                         {"prompt": None, "completion": None, **MESSAGES[1]}]), tmp_path / "m.parquet")
    with pytest.raises(DataError, match=r"m\.parquet row 1: a messages record.*row 0\) is a prompt/completion"):
        load_corpus(tmp_path)


def test_text_and_records_in_one_corpus_is_an_error(tmp_path):
    (tmp_path / "notes.txt").write_text("plain text")
    _write(tmp_path, "sft", PROMPT_COMPLETION, "jsonl")
    with pytest.raises(DataError, match=r"mixes plain text \(notes\.txt\) and instruction records \(sft\.jsonl#1\)"):
        load_corpus(tmp_path)
    (tmp_path / "notes.txt").unlink()
    (tmp_path / "sft.jsonl").write_text('{"text": "a"}\n{"text": "b", "meta": 1}\n')
    text = load_corpus(tmp_path)  # plain "text" records: today's behaviour
    assert text.kind == "text" and text.train_records == text.val_records == [] and len(text.train_docs) == 1


@pytest.mark.parametrize("row,match", [
    ({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "x"}]},
     r"b\.jsonl:1: messages record: messages\[1\] has role 'tool'; supported roles: system, user, assistant"),
    ({"messages": [{"role": "user", "content": "q"}]}, r"b\.jsonl:1: .*no assistant message"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"},
                   {"role": "assistant", "content": "a"}]}, r"messages\[1\] is a system message"),
    ({"messages": [{"role": "user", "text": "q"}]}, r"messages\[0\] must have \"role\" and \"content\""),
    ({"prompt": "p", "completion": 3}, r"b\.jsonl:1: prompt/completion record: \"completion\" is a int"),
    ({**ARC[0], "answerKey": "E"}, r"b\.jsonl:1: multiple choice record: \"answerKey\" 'E' is not one of the "
                                   r"option labels \['A', 'B', 'C', 'D'\]"),
    ({"question": "q", "choices": {"text": ["a"]}, "answerKey": "A"}, r"\"choices\" must be"),
])
def test_malformed_records_name_file_line_and_problem(tmp_path, row, match):
    (tmp_path / "b.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=match):
        load_corpus(tmp_path)


def test_single_record_cannot_be_split(tmp_path):
    _write(tmp_path, "one", PROMPT_COMPLETION[:1], "jsonl")
    with pytest.raises(DataError, match=r"single instruction record \(one\.jsonl#1\).*at least 2 records"):
        load_corpus(tmp_path)


# ------------------------------------------------------------------ batches
def _stream(n=997, seed=0):
    """arange tokens (value = position) and a mask with scored runs and long unscored gaps."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(n, dtype=torch.bool)
    for start in torch.randint(0, n - 4, (12,), generator=g).tolist():
        mask[start:start + 4] = True
    return torch.arange(n, dtype=torch.int32), mask


@pytest.mark.parametrize("batch_size", [1, 2])  # 1: y and x once shared memory (masking y hit x)
def test_y_is_minus_one_exactly_where_unscored(batch_size):
    tokens, mask = _stream()
    seq_len = 10
    loader = TokenBatches(tokens, seq_len=seq_len, batch_size=batch_size, seed=0, loss_mask=mask)
    scored_windows = {k for k in range((len(tokens) - 1) // seq_len) if mask[k * seq_len + 1:(k + 1) * seq_len + 1].any()}
    assert loader.num_windows == len(scored_windows) < (len(tokens) - 1) // seq_len  # some windows dropped
    seen = []
    for _ in range(loader.steps_per_epoch):
        x, y = loader.next_batch()
        for row_x, row_y in zip(x.tolist(), y.tolist()):
            k = row_x[0] // seq_len
            seen.append(k)
            positions = range(k * seq_len + 1, (k + 1) * seq_len + 1)
            assert row_y == [p if mask[p] else -1 for p in positions]
            assert row_x == list(range(k * seq_len, (k + 1) * seq_len))  # inputs never masked
    assert len(seen) == len(set(seen)) and set(seen) <= scored_windows  # each at most once per epoch
    assert len(seen) == loader.steps_per_epoch * batch_size >= len(scored_windows) - batch_size + 1


def test_masked_resume_equals_uninterrupted(tmp_path):
    tokens, mask = _stream(3000, seed=1)
    make = lambda: TokenBatches(tokens, seq_len=8, batch_size=2, seed=5, loss_mask=mask)  # noqa: E731
    reference = make()
    full = [reference.next_batch() for _ in range(40)]  # crosses at least one epoch
    assert reference.steps_per_epoch < 40
    first = make()
    for _ in range(25):
        first.next_batch()
    torch.save(first.state_dict(), tmp_path / "data.pt")
    resumed = make()
    resumed.load_state_dict(torch.load(tmp_path / "data.pt", weights_only=True))
    for x, y in full[25:]:
        rx, ry = resumed.next_batch()
        assert torch.equal(x, rx) and torch.equal(y, ry)
    unmasked = TokenBatches(tokens, seq_len=8, batch_size=2, seed=5)
    with pytest.raises(DataError, match="num_windows"):  # a different stream: refused, not resumed
        unmasked.load_state_dict(first.state_dict())


@pytest.mark.parametrize("batch_size", [1, 3])
def test_val_batches_mask_and_errors(batch_size):
    tokens, mask = _stream()
    seq_len = 10
    batches = list(val_batches(tokens, seq_len, batch_size, max_tokens=10**9, loss_mask=mask))
    starts = [row[0] for x, _ in batches for row in x.tolist()]
    expected = [k * seq_len for k in range((len(tokens) - 1) // seq_len) if mask[k * seq_len + 1:(k + 1) * seq_len + 1].any()]
    assert starts == expected
    for x, y in batches:
        assert torch.equal(x, x[:, :1] + torch.arange(seq_len))  # inputs never masked
        assert torch.equal(y, torch.where(mask[x + 1], x + 1, -1))
    assert len(list(val_batches(tokens, seq_len, 3, max_tokens=30, loss_mask=mask))) == 1  # 3 windows
    with pytest.raises(DataError, match="no scored"):
        list(val_batches(tokens, seq_len, 3, 100, loss_mask=torch.zeros_like(mask)))
    with pytest.raises(ValueError, match="loss_mask must be a bool tensor"):
        TokenBatches(tokens, seq_len=seq_len, batch_size=2, loss_mask=mask.to(torch.uint8))


# ------------------------------------------------------------- packing
def test_pack_records_keeps_every_record_that_fits_inside_one_window():
    seq_len, pad = 4, 99  # windows [0, 4], [4, 8], [8, 12], ...: 5 tokens, one shared
    lengths = [3, 3, 5, 2, 9, 1]
    starts = torch.tensor([0, 3, 6, 11, 13, 22])
    tokens = torch.arange(23, dtype=torch.int32)  # each value names its source position
    mask = torch.ones(23, dtype=torch.bool)
    packed, pmask, info = pack_records(tokens, mask, starts, seq_len, pad)
    # record 0 at 0..2; record 1 (3 tokens) would end at 5 > 4: starts window 1 at 4 (pad 3);
    # record 2 (5 tokens) would end at 11 > 8: fills window 2 exactly, 8..12 (pad 7); record 3
    # at 13..14; record 4 (9 tokens, longer than a window) starts window 4 at 16 (pad 15) and
    # runs to 24; record 5 at 25; then padding to a whole last window (24..28: 26, 27, 28)
    want_starts = [0, 4, 8, 13, 16, 25]
    for (src, n, dst) in zip(starts.tolist(), lengths, want_starts):
        assert packed[dst:dst + n].tolist() == list(range(src, src + n))
        assert pmask[dst:dst + n].all()
        if n <= seq_len + 1:  # fits: inside one window
            k = dst // seq_len
            assert dst + n - 1 <= k * seq_len + seq_len
    pad_positions = [3, 7, 15, 26, 27, 28]
    assert [i for i, t in enumerate(packed.tolist()) if t == pad] == pad_positions
    assert not pmask[pad_positions].any()
    assert info.records == 6 and info.long_records == 1 and info.pad_tokens == 6 and info.tokens == 29
    with pytest.raises(ValueError, match="increasing record offsets"):
        pack_records(tokens, mask, torch.tensor([1, 5]), seq_len, pad)


def test_packed_arc_windows_see_the_whole_prompt_of_every_scored_answer(tmp_path, tok):
    rows = [{"question": f"Question {i}: " + "which one is right? " * (i % 5),
             "choices": {"text": [f"option {j}" for j in range(4)], "label": list("ABCD")},
             "answerKey": "ABCD"[i % 4]} for i in range(40)]
    _write(tmp_path, "arc", rows, "jsonl")
    corpus = load_corpus(tmp_path)
    tokens, mask, starts = tokenize_records(tok, corpus.train_records, with_starts=True)
    seq_len = 128
    ends = torch.cat([starts[1:], torch.tensor([len(tokens)])])  # one past each record's last token
    assert (ends - starts).max() <= seq_len + 1  # every record fits in a window (74-123 tokens)
    cut = sum(1 for a, b in zip(starts.tolist(), ends.tolist()) if b - 1 > a // seq_len * seq_len + seq_len)
    assert cut > 10  # unpacked, most records straddle a window boundary
    packed, pmask, info = pack_records(tokens, mask, starts, seq_len, tok.bos_id)
    assert info.long_records == 0 and 0 < info.pad_tokens and pmask.sum() == mask.sum()
    loader = TokenBatches(packed, seq_len=seq_len, batch_size=1, seed=0, loss_mask=pmask)
    bos_opens = 0
    for _ in range(loader.steps_per_epoch):
        x, y = loader.next_batch()
        for pos in (y[0] != -1).nonzero().squeeze(1).tolist():
            # the scored answer's record starts (<|bos|>) at or before it, in this window
            assert (x[0, : pos + 1] == tok.bos_id).any()
            bos_opens += 1
    assert bos_opens == int(mask.sum())  # each scored token once per epoch


def test_trainer_packs_records_and_records_the_ones_too_long(tmp_path, monkeypatch):
    from nanochat.train.trainer import NanoChatTrainer

    monkeypatch.setenv("NANOCHAT_CACHE", str(tmp_path / "cache"))
    rows = [{"prompt": f"Question {i}?", "completion": f"Answer {i}."} for i in range(60)]
    rows[7]["prompt"] = "A very long question. " * 40  # far longer than a 32-token window
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    _write(data_dir, "pc", rows, "jsonl")
    result = NanoChatTrainer(model_name="d2", dataset_path=str(data_dir), run_dir=str(tmp_path / "run"),
                             vocab_size=300, seq_len=32, batch_size=2, num_iterations=2, eval_every=0,
                             eval_tokens=256, num_samples=0, device="cpu", compile=False).train()
    long = [f for f in result.fallbacks if "longer than a window" in f]
    assert len(long) == 1 and "1 of" in long[0] and "--seq_len" in long[0], result.fallbacks


# ------------------------------------------------------------- fine-tuning
def test_one_finetuning_step_on_arc_masks_the_prompt(tmp_path, tok):
    from nanochat.model.gpt import GPT, preset_config

    rows = [{"id": f"q{i}", "question": f"Question number {i}: which option is right?",
             "choices": {"text": [f"option {j} of {i}" for j in range(4)], "label": list("ABCD")},
             "answerKey": "ABCD"[i % 4]} for i in range(24)]
    _write(tmp_path, "arc", rows, "parquet")
    corpus = load_corpus(tmp_path)
    tokens, mask = tokenize_records(tok, corpus.train_records, ids=corpus.train_ids)
    loader = TokenBatches(tokens, seq_len=64, batch_size=4, seed=0, loss_mask=mask)
    x, y = loader.next_batch()
    scored = y != -1
    assert 0 < scored.sum() < scored.numel() // 10  # an answer letter + <|end|> per ~100-token record
    assert set(tok.decode([t]) for t in y[scored].tolist()) <= {"A", "B", "C", "D", "<|end|>"}

    torch.manual_seed(0)
    model = GPT(preset_config("d2", vocab_size=tok.vocab_size, seq_len=64))
    model.init_weights()
    with torch.no_grad():  # init's lm_head (std 0.001) gives near-uniform logits: every token would cost
        model.lm_head.weight.normal_(0, 0.5)  # ~ln(vocab) and masking could not change the loss
    every_target = torch.cat([x[:, 1:], y[:, -1:]], dim=1)  # the stream's next tokens (last: y's)
    assert torch.equal(every_target[scored], y[scored])
    loss = model(x, y)
    with torch.no_grad():
        reference = F.cross_entropy(model(x)[scored], y[scored])
        unmasked = model(x, every_target)  # prompt tokens scored too
    torch.testing.assert_close(loss.detach(), reference, rtol=1e-6, atol=0)
    assert abs(unmasked.item() - loss.item()) > 0.1  # the mask changes what is optimized

    optimizer = torch.optim.AdamW(model.param_groups(0.0), lr=1e-2)
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after = model(x, y)
    assert torch.isfinite(after) and after.item() < loss.item()


# ------------------------------------------------------------- base models, --chat_template
PLAIN_EXPECTED = {  # (whole text, scored runs) of the first two records of each shape, plain format
    "prompt/completion": [("<s>Say hello. Hello there!<|im_end|>", [" Hello there!<|im_end|>"]),
                          ("<s>What is 2+2? 4<|im_end|>", [" 4<|im_end|>"])],
    "messages": [("<s>System: Be brief.\n\nUser: 2+2?\n\nAssistant: 4<|im_end|>\n\nUser: And 3+3?\n\n"
                  "Assistant: 6, of course.<|im_end|>", [" 4<|im_end|>", " 6, of course.<|im_end|>"]),
                 ("<s>User: Hi!\n\nAssistant: Hello, how can I help?<|im_end|>", [" Hello, how can I help?<|im_end|>"])],
    "multiple choice": [("<s>Which gas do plants absorb from the air?\n\nA. oxygen\nB. carbon dioxide\nC. helium"
                         "\nD. neon\nAnswer: B<|im_end|>", [" B<|im_end|>"]),
                        ("<s>Which is a mammal?\n\nA. shark\nB. trout\nC. whale\nAnswer: C<|im_end|>", [" C<|im_end|>"])],
}


@pytest.mark.parametrize("shape", list(ROWS))
def test_base_model_falls_back_to_the_plain_format(shape):
    base = _hf_tokenizer(None, bos_token="<s>")
    tokenizer, fallback = instruct.choose_chat_template(base, None, records=True)
    assert fallback == instruct.PLAIN_FALLBACK
    assert instruct.choose_chat_template(base, None, records=False) == (base, None)  # plain text needs none
    assert tokenizer.chat_template == instruct.PLAIN_TEMPLATE and tokenizer.fingerprint != base.fingerprint
    for row, (text, scored) in zip(ROWS[shape], PLAIN_EXPECTED[shape]):
        tokens, mask = tokenize_records(tokenizer, [instruct.to_messages(row, shape)])
        assert tokenizer.decode(tokens.tolist()) == text
        assert [tokenizer.decode(r) for r in _runs(tokens.tolist(), mask.tolist())] == scored


def test_chat_template_flag_builtins_files_and_errors(tmp_path, tok):
    base = _hf_tokenizer(None, bos_token="<s>")
    messages = MESSAGES[0]["messages"]
    (tmp_path / "t.jinja").write_text(CHATML)
    for flag, reference in (("chatml", CHATML), ("llama3", LLAMA3ISH), (str(tmp_path / "t.jinja"), CHATML)):
        chosen, fallback = instruct.choose_chat_template(base, flag, records=True)
        assert fallback is None
        assert chosen.render_chat(messages) == base.with_chat_template(reference).render_chat(messages)
    # an explicit choice overrides the checkpoint's own template, without a fallback
    chosen, fallback = instruct.choose_chat_template(_hf_tokenizer(CHATML, bos_token="<s>"), "plain", records=True)
    assert fallback is None and chosen.chat_template == instruct.PLAIN_TEMPLATE
    with pytest.raises(ValueError, match="neither a built-in template"):
        instruct.choose_chat_template(base, "vicuna", records=True)
    with pytest.raises(ValueError, match="nanochat's own tokenizer"):
        instruct.choose_chat_template(tok, "plain", records=True)
    assert instruct.choose_chat_template(tok, None, records=True) == (tok, None)


def test_choice_items_point_at_the_answer_letter(tok):
    records = [instruct.to_messages(r, "multiple choice") for r in ARC]
    plain, _ = instruct.choose_chat_template(_hf_tokenizer(None, bos_token="<s>"), None, records=True)
    # ` A` one token, ` D` two: a vocabulary that saw "Answer: A" often and never " D"
    split, _ = instruct.choose_chat_template(_hf_tokenizer(None, ["Answer: A"] * 50, bos_token="<s>"), None,
                                             records=True)
    closing = {id(plain): "<|im_end|>", id(split): "<|im_end|>", id(tok): "<|end|>"}
    for tokenizer in (plain, split, _hf_tokenizer(CHATML), tok):
        items = instruct.choice_items(tokenizer, records)
        assert [it.answer for it in items] == [1, 2, 0]
        for messages, item in zip(records, items):
            for letter, option in zip(messages[0]["choices"], item.options):
                full, mask = instruct.render(tokenizer, [messages[0], {"role": "assistant", "content": letter}])
                # the prompt, the option and the turn's closing tokens are the rendering with that
                # letter, and the option is the letter's tokens, scored in training
                end = len(full) - mask[::-1].index(True)
                assert full[:len(item.prompt) + len(option)] == item.prompt + option
                assert all(mask[len(item.prompt):len(item.prompt) + len(option)])
                assert tokenizer.decode(option).strip() == letter
                assert tokenizer.decode(full[len(item.prompt) + len(option):end]) == closing.get(
                    id(tokenizer), "<|im_end|>\n")
        if tokenizer is split:
            assert [len(o) for o in items[0].options] == [1, 2, 2, 2]
            assert tokenizer.decode(items[0].prompt).endswith("Answer:")
        else:
            assert all(len(o) == 1 for it in items for o in it.options)
        if tokenizer is tok:
            assert items[0].prompt == instruct.generation_prompt(tok, records[0])
    # records without choices are not questions
    assert instruct.choice_items(tok, [instruct.to_messages(PROMPT_COMPLETION[0], "prompt/completion")]) == []


def test_choice_items_stop_at_the_token_budget(tok):
    """Within a budget the questions are taken spread over the split (records 0, 2, 1 of three),
    returned in the split's order; at least one question whatever the budget."""
    records = [instruct.to_messages(r, "multiple choice") for r in ARC]
    every = instruct.choice_items(tok, records)
    lengths = [len(it.prompt) for it in every]
    assert instruct.choice_items(tok, records, sum(lengths)) == every
    assert instruct.choice_items(tok, records, lengths[0] + lengths[2]) == [every[0], every[2]]
    assert instruct.choice_items(tok, records, lengths[0] + lengths[2] - 1) == every[:1]
    assert instruct.choice_items(tok, records, 1) == every[:1]  # at least one question


def test_choice_items_within_a_budget_sample_a_split_stored_by_subject(tok):
    """A split stored in blocks (here: 4 subjects of 16 questions, one after the other) and a
    budget for a quarter of it: the questions scored come from every subject, 4 from each, where
    the first quarter would be one subject alone."""
    rows = [dict(ARC[0], id=f"{subject}_{i}", question=f"{subject} question {i}?")
            for subject in ("algebra", "anatomy", "biology", "chemistry") for i in range(16)]
    records = [instruct.to_messages(r, "multiple choice") for r in rows]
    every = instruct.choice_items(tok, records)
    budget = sum(len(it.prompt) for it in every) // 4
    picked = instruct.choice_items(tok, records, budget)
    subjects = Counter(next(w for w in ("algebra", "anatomy", "biology", "chemistry") if w in tok.decode(it.prompt))
                       for it in picked)
    assert len(picked) >= 14 and set(subjects) == {"algebra", "anatomy", "biology", "chemistry"}
    assert max(subjects.values()) - min(subjects.values()) <= 1
    assert all(it in every for it in picked)
    assert sorted(instruct.spread_order(8)) == list(range(8)) and instruct.spread_order(8)[:4] == [0, 4, 2, 6]


def test_validation_records_are_read_by_index_from_disk(tmp_path):
    """A store's validation records (JsonLines): by index in any order and by iteration, each the
    record its line holds, non-ASCII text included; one read from disk at a time."""
    from nanochat.data.token_store import JsonLines

    rows = [{"i": i, "text": "é" * (i % 7), "choices": ["A", "B"]} for i in range(50)]
    path = tmp_path / "val.records.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    lines = JsonLines(path)
    assert len(lines) == 50 and list(lines) == rows
    assert [lines[i] for i in (49, 0, 17, -1)] == [rows[49], rows[0], rows[17], rows[-1]]
    assert lines[3:6] == rows[3:6]
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert len(JsonLines(tmp_path / "empty.jsonl")) == 0 and list(JsonLines(tmp_path / "empty.jsonl")) == []
