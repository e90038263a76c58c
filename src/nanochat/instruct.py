"""Instruction records -> chat messages -> one record's tokens with a loss mask.

Fine-tuning data comes in a few shapes. Each one is normalized to a list of chat messages
(`[{"role": "system"|"user"|"assistant", "content": str}, ...]`), and only those messages are
rendered, so every shape gets the same formatting and the same masking:

    {"text": str}                                   plain text: not a record, see nanochat.data
    {"prompt": str, "completion": str}              -> user: prompt, assistant: completion
    {"messages": [{"role", "content"}, ...]}        -> the messages as they are (a system message
                                                       only first; other keys of a message ignored)
    {"question", "choices", "answerKey"}            -> user: the question with lettered options,
                                                       assistant: the letter (multiple choice)

Multiple choice is the AI2 ARC shape as published on Hugging Face (`question`: str,
`choices`: {"text": [...], "label": [...]}, `answerKey`: a label) and as in the original ARC
jsonl (`question`: {"stem": str, "choices": [{"text", "label"}, ...]}); `choices` may also be a
plain list of option strings (labelled A, B, ... in order). The options are always shown with
the letters A, B, C... in the record's order, whatever labels the record uses (a few ARC
questions use 1-4), and the answer is the letter of the option whose label is `answerKey`:

    Which gas do plants absorb?

    A. oxygen
    B. carbon dioxide

    Answer with the letter of the correct option.

with the assistant answering `B`. Only the letter, not "B. carbon dioxide": a one-token answer
is what a multiple-choice evaluation compares, and the loss on it is a direct proxy of accuracy.

Rendering, and which tokens are scored (the loss mask: True = this token is a training target):

* Our own tokenizer (nanochat presets) has no chat template, only reserved special tokens:

      <|bos|><|user_start|>prompt<|end|><|assistant_start|>completion<|end|>
                                                          ^^^^^^^^^^^^^^^^^^^ scored

  The completion and its closing <|end|> are scored, so the model learns to stop; the
  <|assistant_start|> that opens the turn is not (at inference the prompt supplies it). There
  is no system marker: a system message is prepended to the first user message, separated by
  a blank line (karpathy/nanochat does the same). Each message is encoded on its own and the
  pieces meet at special tokens, so no BPE merge can cross a turn boundary.
* A Hugging Face tokenizer renders the record through its checkpoint's chat template (BOS,
  end-of-turn and EOS tokens are whatever the template writes). Templates do not say where an
  assistant turn starts, so it is measured: for the assistant message i, the conversation up to
  it rendered with the generation prompt (`messages[:i]`, add_generation_prompt=True) and the
  conversation including it (`messages[:i+1]`) are encoded, and the scored span is the tokens
  between the two lengths — the content plus whatever the template closes the turn with
  (<|im_end|>, <|eot_id|>, </s>). This is only right if both encodings are token prefixes of
  the whole conversation's encoding; that is checked for every turn and a template that is not
  prefix-stable (e.g. one that drops reasoning from past assistant turns, or a tokenizer that
  merges text across a turn boundary) is an error naming the turn, never a shifted mask.
  The rejected alternative, encoding each rendered piece separately and concatenating, cannot
  fail — but SentencePiece-style tokenizers (Llama 2, Mistral) put a word-start marker at the
  beginning of every encode call, so each piece would gain a space the model never sees at
  inference. HF's `{% generation %}` markers would avoid the measuring, but few templates have
  them.

Every problem is a ValueError saying what is wrong with the record; `nanochat.data` adds the
file and line.
"""

from __future__ import annotations

import string
from typing import Any

SHAPES_HELP = (
    '{"text": "..."} (plain text, every token scored); {"prompt": "...", "completion": "..."}; '
    '{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}; '
    '{"question": "..." or {"stem", "choices"}, "choices": {"text": [...], "label": [...]} or '
    '[...], "answerKey": "<label>"} (multiple choice, the ARC shape)'
)
"""The record shapes `nanochat.data.load_corpus` reads, for error messages."""

ROLES = ("system", "user", "assistant")
MC_INSTRUCTION = "Answer with the letter of the correct option."
LETTERS = string.ascii_uppercase

Message = dict[str, str]


# ------------------------------------------------------------------ shapes
def record_shape(obj: dict[str, Any]) -> str | None:
    """Which shape a record (a jsonl object / parquet row) has, by its fields; None if none.

    "text" wins whenever present (even null: an empty document), so a file of plain documents
    that also carry metadata fields reads exactly as before. Other fields count only when not
    null, because a parquet table has every column in every row.
    """
    present = {k for k, v in obj.items() if v is not None}
    if "text" in obj:
        return "text"
    if "messages" in present:
        return "messages"
    if {"prompt", "completion"} <= present:
        return "prompt/completion"
    if {"question", "answerKey"} <= present:
        return "multiple choice"
    return None


def to_messages(obj: dict[str, Any], shape: str) -> list[Message]:
    """The chat messages of a record of `shape` (see `record_shape`); ValueError if malformed."""
    if shape == "prompt/completion":
        return [{"role": "user", "content": _string(obj, "prompt")},
                {"role": "assistant", "content": _string(obj, "completion")}]
    if shape == "messages":
        return _checked_messages(obj["messages"])
    if shape == "multiple choice":
        prompt, answer = format_multiple_choice(obj)
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    raise ValueError(f"no messages for a record of shape {shape!r}")


def _string(obj: dict[str, Any], key: str) -> str:
    value = obj[key]
    if not isinstance(value, str):
        raise ValueError(f'"{key}" is a {type(value).__name__}, expected a string')
    return value


def _checked_messages(messages: Any) -> list[Message]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f'"messages" must be a non-empty list of {{"role", "content"}} objects, got '
                         f"{'an empty list' if messages == [] else 'a ' + type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            got = f"fields {sorted(m)}" if isinstance(m, dict) else f"a {type(m).__name__}"
            raise ValueError(f'messages[{i}] must have "role" and "content" (it has {got})')
        role, content = m["role"], m["content"]
        if role not in ROLES:
            raise ValueError(f"messages[{i}] has role {role!r}; supported roles: {', '.join(ROLES)} "
                             "(tool calls are not supported)")
        if role == "system" and i > 0:
            raise ValueError(f"messages[{i}] is a system message; a system message may only come first")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content is a {type(content).__name__}, expected a string "
                             "(multimodal content lists are not supported)")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError("the conversation has no assistant message, so nothing to learn "
                         f"(roles: {[m['role'] for m in out]})")
    return out


def format_multiple_choice(obj: dict[str, Any]) -> tuple[str, str]:
    """(prompt, answer letter) of a multiple-choice record; the format is in the module docstring."""
    question, choices = obj["question"], obj.get("choices")
    if isinstance(question, dict):  # original ARC jsonl: {"stem": ..., "choices": [...]}
        if "stem" not in question:
            raise ValueError(f'"question" is an object without "stem" (it has {sorted(question)})')
        choices = choices if choices is not None else question.get("choices")
        question = question["stem"]
    if not isinstance(question, str):
        raise ValueError(f'"question" is a {type(question).__name__}, expected a string or {{"stem", "choices"}}')
    if isinstance(choices, dict) and {"text", "label"} <= set(choices):  # Hugging Face ARC
        texts, labels = list(choices["text"]), list(choices["label"])
    elif isinstance(choices, list) and all(isinstance(c, dict) and {"text", "label"} <= set(c) for c in choices):
        texts, labels = [c["text"] for c in choices], [c["label"] for c in choices]
    elif isinstance(choices, list) and all(isinstance(c, str) for c in choices):
        texts, labels = list(choices), list(LETTERS[:len(choices)])
    else:
        raise ValueError('"choices" must be {"text": [...], "label": [...]}, a list of {"text", "label"} '
                         f"objects or a list of strings; got {_preview(choices)}")
    if len(texts) != len(labels):
        raise ValueError(f'"choices" has {len(texts)} texts but {len(labels)} labels')
    if not 2 <= len(texts) <= len(LETTERS):
        raise ValueError(f"a multiple-choice question needs 2 to {len(LETTERS)} options, this one has {len(texts)}")
    if not all(isinstance(t, str) for t in texts):
        raise ValueError(f"every option must be a string; got {_preview(texts)}")
    key = str(obj["answerKey"]).strip()
    labels = [str(label).strip() for label in labels]
    if key not in labels:
        raise ValueError(f'"answerKey" {key!r} is not one of the option labels {labels}')
    options = "\n".join(f"{LETTERS[i]}. {t}" for i, t in enumerate(texts))
    return f"{question}\n\n{options}\n\n{MC_INSTRUCTION}", LETTERS[labels.index(key)]


def _preview(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# --------------------------------------------------------------- rendering
def render(tokenizer: Any, messages: list[Message]) -> tuple[list[int], list[bool]]:
    """(token ids, loss mask) of one conversation: our special tokens for our `Tokenizer`, the
    chat template for a Hugging Face tokenizer (anything with `render_chat`)."""
    if hasattr(tokenizer, "render_chat"):
        return _render_template(tokenizer, messages)
    return _render_ours(tokenizer, messages)


def check_tokenizer(tokenizer: Any) -> None:
    """ValueError unless `tokenizer` can render records: a chat template (Hugging Face) or our
    special tokens."""
    if hasattr(tokenizer, "render_chat"):
        _require_template(tokenizer)
    else:
        _our_specials(tokenizer)


def generation_prompt(tokenizer: Any, messages: list[Message]) -> list[int]:
    """Token ids of the conversation before its last assistant message, ending with the
    generation prompt (`<|assistant_start|>` / the template's): what a model is given at
    inference to produce that answer, e.g. to sample from a fine-tuned model."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    if hasattr(tokenizer, "render_chat"):
        _require_template(tokenizer)
        return tokenizer.encode(tokenizer.render_chat(messages[:last], add_generation_prompt=True),
                                allow_special=True)
    ids, _ = _render_ours(tokenizer, messages[:last], require_answer=False)
    return ids + [_our_specials(tokenizer)["<|assistant_start|>"]]


def _our_specials(tokenizer: Any) -> dict[str, int]:
    specials = getattr(tokenizer, "special_tokens", {})
    missing = [s for s in ("<|user_start|>", "<|assistant_start|>", "<|end|>") if s not in specials]
    if missing:
        raise ValueError(f"the tokenizer has no {', '.join(missing)} special token(s) and no chat template; "
                         "instruction records need one or the other")
    return specials


def _render_ours(tokenizer: Any, messages: list[Message], *,
                 require_answer: bool = True) -> tuple[list[int], list[bool]]:
    sp = _our_specials(tokenizer)
    turns = list(messages)
    if turns and turns[0]["role"] == "system":  # no system marker: fold it into the first user turn
        system, turns = turns[0]["content"], turns[1:]
        if turns and turns[0]["role"] == "user":
            turns[0] = {"role": "user", "content": f"{system}\n\n{turns[0]['content']}"}
        else:
            turns.insert(0, {"role": "user", "content": system})
    ids, mask = [tokenizer.bos_id], [False]
    for m in turns:
        body = tokenizer.encode(m["content"]) + [sp["<|end|>"]]
        if m["role"] == "user":
            ids += [sp["<|user_start|>"], *body]
            mask += [False] * (len(body) + 1)
        else:  # assistant: the opening marker is prompt, the content and its <|end|> are scored
            ids += [sp["<|assistant_start|>"], *body]
            mask += [False] + [True] * len(body)
    if require_answer and not any(mask):
        raise ValueError("the conversation has no assistant message, so nothing to learn")
    return ids, mask


def _require_template(tokenizer: Any) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this Hugging Face tokenizer has no chat template, so instruction records cannot "
                         "be formatted for it; add one (a chat_template.jinja file, or \"chat_template\" in "
                         "tokenizer_config.json, in the model directory) or use a chat model's tokenizer")


def _render_template(tokenizer: Any, messages: list[Message]) -> tuple[list[int], list[bool]]:
    _require_template(tokenizer)
    full_text = tokenizer.render_chat(messages)
    ids = tokenizer.encode(full_text, allow_special=True)
    mask = [False] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = _prefix_length(tokenizer, messages[:i], True, full_text, ids, i)
        end = len(ids) if i == len(messages) - 1 else _prefix_length(
            tokenizer, messages[:i + 1], False, full_text, ids, i)
        if end <= start:
            raise ValueError(f"messages[{i}] (assistant) renders to no tokens through the chat template, "
                             "so it cannot be scored")
        mask[start:end] = [True] * (end - start)
    return ids, mask


def _prefix_length(tokenizer: Any, prefix: list[Message], generation: bool, full_text: str,
                   full_ids: list[int], turn: int) -> int:
    """len(encode(render(prefix))), after checking that it is a token prefix of full_ids."""
    text = tokenizer.render_chat(prefix, add_generation_prompt=generation)
    what = (f"messages[:{turn}] with the generation prompt" if generation
            else f"messages[:{turn + 1}] (through assistant message {turn})")
    if not full_text.startswith(text):
        at = next((k for k, (a, b) in enumerate(zip(text, full_text)) if a != b), min(len(text), len(full_text)))
        raise ValueError(
            f"the chat template is not prefix-stable: rendering {what} gives text that is not a prefix of "
            f"the whole conversation's rendering (they differ at character {at}: {text[at:at + 40]!r} vs "
            f"{full_text[at:at + 40]!r}), so the assistant turn cannot be located. Templates that rewrite "
            "earlier turns once later ones exist (e.g. drop past reasoning) cannot be masked; use records "
            "with a single assistant turn or another template")
    ids = tokenizer.encode(text, allow_special=True)
    if full_ids[:len(ids)] != ids:
        at = next((k for k, (a, b) in enumerate(zip(ids, full_ids)) if a != b), min(len(ids), len(full_ids)))
        raise ValueError(
            f"the tokenizer merges text across a turn boundary: {what} encodes to {len(ids)} tokens that are "
            f"not a prefix of the whole conversation's tokens (first difference at token {at}: "
            f"{tokenizer.decode(ids[at:at + 3])!r} vs {tokenizer.decode(full_ids[at:at + 3])!r}); the "
            "assistant turn would straddle a token. Check the record's content for leading whitespace")
    return len(ids)
