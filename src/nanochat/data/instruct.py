"""Instruction records -> chat messages -> one record's tokens with a loss mask.

Every record shape is normalized to chat messages, then rendered, so each gets the same
formatting and masking:

    {"prompt": str, "completion": str}              -> user: prompt, assistant: completion
    {"messages": [{"role", "content"}, ...]}        -> the messages as they are
    {"question", "choices", "answerKey"}            -> user: the question with lettered options,
                                                       assistant: the letter (multiple choice)

Rendering: our tokenizer uses its reserved special tokens (`<|user_start|>`, ...); a Hugging
Face tokenizer uses its checkpoint's chat template, and the scored span of each assistant turn
is measured by encoding the conversation with and without it (a template that is not
prefix-stable is an error naming the turn); a base model without a template gets the plain
format (`PLAIN_TEMPLATE`, recorded as a fallback). Only the assistant's tokens, and the token
that closes its turn, are scored.

Every problem is a ValueError saying what is wrong with the record; `nanochat.data.read` adds the
file and line. The formats in full, with the rejected alternatives: docs/instruct.md.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from nanochat.tokenizer import ChatTokenizer, Tokenizer

SHAPES_HELP = (
    '{"text": "..."} (plain text, every token scored); {"prompt": "...", "completion": "..."}; '
    '{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}; '
    '{"question": "..." or {"stem", "choices"}, "choices": {"text": [...], "label": [...]} or '
    '[...], "answerKey": "<label>"} (multiple choice, the ARC shape)'
)
"""The record shapes a corpus may hold (nanochat.data.read reads them), for error messages."""

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
        return [{"role": "user", "content": _string(obj, "prompt"), "shape": shape},
                {"role": "assistant", "content": _string(obj, "completion")}]
    if shape == "messages":
        return _checked_messages(obj["messages"])
    if shape == "multiple choice":
        prompt, answer, letters = format_multiple_choice(obj)
        return [{"role": "user", "content": prompt, "shape": shape, "choices": letters},
                {"role": "assistant", "content": answer}]
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


def format_multiple_choice(obj: dict[str, Any]) -> tuple[str, str, str]:
    """(prompt, answer letter, the option letters e.g. "ABCD") of a multiple-choice record; the
    format is in the module docstring."""
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
    return (f"{question}\n\n{options}\n\n{MC_INSTRUCTION}", LETTERS[labels.index(key)],
            LETTERS[:len(texts)])


def _preview(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# --------------------------------------------------------------- rendering
def render(tokenizer: Tokenizer, messages: list[Message]) -> tuple[list[int], list[bool]]:
    """(token ids, loss mask) of one conversation: our special tokens for our BPETokenizer, the
    chat template for a Hugging Face tokenizer (a ChatTokenizer: anything with `render_chat`)."""
    if hasattr(tokenizer, "render_chat"):
        return _render_template(tokenizer, messages)
    return _render_ours(tokenizer, messages)


def check_tokenizer(tokenizer: Tokenizer) -> None:
    """ValueError unless `tokenizer` can render records: a chat template (Hugging Face) or our
    special tokens."""
    if hasattr(tokenizer, "render_chat"):
        _require_template(tokenizer)
    else:
        _our_specials(tokenizer)


def generation_prompt(tokenizer: Tokenizer, messages: list[Message]) -> list[int]:
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


def _our_specials(tokenizer: Tokenizer) -> dict[str, int]:
    specials = getattr(tokenizer, "special_tokens", {})
    missing = [s for s in ("<|user_start|>", "<|assistant_start|>", "<|end|>") if s not in specials]
    if missing:
        raise ValueError(f"the tokenizer has no {', '.join(missing)} special token(s) and no chat template; "
                         "instruction records need one or the other")
    return specials


def _render_ours(tokenizer: Tokenizer, messages: list[Message], *,
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


def _require_template(tokenizer: ChatTokenizer) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this Hugging Face tokenizer has no chat template, so instruction records cannot "
                         "be formatted for it; pass --chat_template plain|chatml|llama3|<file.jinja>, or add "
                         "one (chat_template.jinja, or \"chat_template\" in tokenizer_config.json)")


def _render_template(tokenizer: ChatTokenizer, messages: list[Message]) -> tuple[list[int], list[bool]]:
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


def _prefix_length(tokenizer: ChatTokenizer, prefix: list[Message], generation: bool, full_text: str,
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


# ------------------------------------------------------------ chat templates
# Built-in templates, by name (--chat_template plain|chatml|llama3). Each is ordinary Jinja, so an
# exported model's tokenizer renders the same text through transformers' apply_chat_template.
PLAIN_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages and messages[0].shape is defined -%}"
    "{%- set p = messages[0].content -%}"
    "{%- if messages[0].choices is defined -%}{%- set p = p | replace('\\n\\n@MC@', '\\nAnswer:') -%}{%- endif -%}"
    "{{- p -}}"
    "{%- for m in messages[1:] -%}"
    "{{- '' if (p[-1:] in ' \\n\\t' or m.content[:1] in ' \\n\\t') else ' ' -}}{{- m.content ~ eos_token -}}"
    "{%- endfor -%}"
    "{%- else -%}"
    "{%- for m in messages -%}"
    "{{- '' if loop.first else '\\n\\n' -}}{{- m.role | capitalize ~ ': ' ~ m.content -}}"
    "{{- eos_token if m.role == 'assistant' else '' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '\\n\\nAssistant:' if messages else 'Assistant:' -}}{%- endif -%}"
    "{%- endif -%}"
).replace("@MC@", MC_INSTRUCTION)
"""Base models' format. A single prompt and answer (prompt/completion, multiple choice): the
prompt, then the answer, separated by a space unless either side already has whitespace there,
then EOS. Multiple choice ends its prompt with `Answer:` instead of the chat instruction:
`Which is a mammal?\\n\\nA. shark\\nB. whale\\nAnswer: B</s>`. Chat messages: role-prefixed turns
(`System: ...`, `User: ...`, `Assistant: ...</s>`) separated by blank lines."""

CHATML_TEMPLATE = (
    "{%- for m in messages -%}{{- '<|im_start|>' ~ m.role ~ '\\n' ~ m.content ~ '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
LLAMA3_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{{- '<|start_header_id|>' ~ m.role ~ '<|end_header_id|>\\n\\n' ~ (m.content | trim) ~ '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)
BUILTIN_TEMPLATES = {"plain": PLAIN_TEMPLATE, "chatml": CHATML_TEMPLATE, "llama3": LLAMA3_TEMPLATE}
_TEMPLATE_TOKENS = {"chatml": ("<|im_start|>", "<|im_end|>"),
                    "llama3": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")}
PLAIN_FALLBACK = (
    "chat template: the tokenizer has none (a base model), so instruction records are rendered in "
    "the plain format (prompt and answer joined, multiple choice ending in 'Answer: <letter>', chat "
    "turns prefixed by their role; EOS after each answer); --chat_template chatml|llama3|<file.jinja> "
    "chooses another")
"""The fallback line: logged once and recorded in TrainResult.fallbacks."""


def choose_chat_template(tokenizer: Tokenizer, chat_template: str | None, *,
                         records: bool) -> tuple[Tokenizer, str | None]:
    """(the tokenizer to render with, the fallback taken or None), for --chat_template.

    `chat_template`: a built-in name (plain, chatml, llama3), a Jinja file, or None: the
    tokenizer's own template, or the plain format when it has none and the corpus has records
    (`records`). The returned tokenizer carries the chosen template (it is saved with the run and
    exported with the model). nanochat's own tokenizer has special tokens instead of a template.
    """
    if not hasattr(tokenizer, "render_chat"):
        if chat_template is not None:
            raise ValueError(own_tokenizer_template_problem(chat_template))
        return tokenizer, None
    if chat_template is None:
        if not records or tokenizer.chat_template is not None:
            return tokenizer, None
        return _with_template(tokenizer, "plain"), PLAIN_FALLBACK
    return _with_template(tokenizer, chat_template), None


def own_tokenizer_template_problem(chat_template: str) -> str:
    """Why --chat_template does not apply to nanochat's own tokenizer (a preset model's)."""
    return (f"--chat_template {chat_template}: nanochat's own tokenizer renders records with its special "
            "tokens (<|user_start|>...), not a template; --chat_template applies to Hugging Face models. "
            "Drop the flag")


def _with_template(tokenizer: ChatTokenizer, chat_template: str) -> ChatTokenizer:
    if chat_template in BUILTIN_TEMPLATES:
        source = BUILTIN_TEMPLATES[chat_template]
        missing = [t for t in _TEMPLATE_TOKENS.get(chat_template, ()) if not tokenizer.has_token(t)]
        if missing:
            raise ValueError(f"--chat_template {chat_template} writes {', '.join(missing)}, which this "
                             "tokenizer does not have as tokens; use --chat_template plain (any tokenizer), "
                             "the model's own template (omit the flag) or a .jinja file")
        if chat_template == "plain" and tokenizer.eos_id is None:
            raise ValueError("the plain format ends every answer with the EOS token, and tokenizer_config.json "
                             "names no eos_token; add one, or pass a --chat_template .jinja file")
        origin = f"{chat_template!r} (built in)"
    else:
        from pathlib import Path

        path = Path(chat_template)
        if not path.is_file():
            raise ValueError(f"--chat_template {chat_template!r} is neither a built-in template "
                             f"({', '.join(BUILTIN_TEMPLATES)}) nor an existing Jinja file")
        source, origin = path.read_text(encoding="utf-8"), str(path)
    return tokenizer.with_chat_template(source, origin)


# ------------------------------------------------------------ multiple choice
class ChoiceItem(NamedTuple):
    """One multiple-choice question as the model sees it."""

    prompt: list[int]
    """Token ids up to the answer, shared by every option."""
    options: list[list[int]]
    """Each option's answer tokens after the prompt (A, B, ... in order): one token per letter in
    most vocabularies, more where a letter is split (` D` as ` `, `D`)."""
    answer: int
    """Index of the correct option."""


def choice_items(tokenizer: Tokenizer, records: Sequence[list[Message]],
                 max_tokens: int | None = None) -> list[ChoiceItem]:
    """The multiple-choice records among `records` (others are skipped), each rendered once per
    option letter as the answer, in the records' order. Rendering through `render` keeps the
    letter's tokens exactly as training scores them (`B` after a chat header, ` B` after `Answer:`
    in the plain format). The prompt is the tokens all renderings share; each option is what
    follows, up to the tokens that close the answer in every rendering (EOS, <|end|>), which are
    the same for all options and left out. `max_tokens`: stop before the prompts would total more
    (at least one question), so an evaluation costs about what --eval_tokens says however large
    the split is; the records are then taken in `spread_order`, so a budget that covers part of
    a split stored in an order (questions by subject, by difficulty) still samples all of it."""
    order = range(len(records)) if max_tokens is None else spread_order(len(records))
    picked, total = [], 0
    for index in order:
        item = _choice_item(tokenizer, records[index])
        if item is None:
            continue
        total += len(item.prompt)
        if picked and max_tokens is not None and total > max_tokens:
            break
        picked.append((index, item))
    return [item for _, item in sorted(picked, key=lambda pair: pair[0])]


def spread_order(n: int) -> list[int]:
    """0..n-1 ordered by their bit-reversed value (0, n/2, n/4, 3n/4, ... when n is a power of
    two): every prefix of the order lies spread over the whole range, not at its start."""
    bits = max(1, (n - 1).bit_length())
    return sorted(range(n), key=lambda i: int(format(i, f"0{bits}b")[::-1], 2))


def _choice_item(tokenizer: Tokenizer, messages: list[Message]) -> ChoiceItem | None:
    """One multiple-choice record as a ChoiceItem (`choice_items`); None when it asks no question."""
    asked = next((i for i, m in enumerate(messages) if "choices" in m), None)
    if asked is None or asked + 1 >= len(messages):
        return None
    letters, key = messages[asked]["choices"], messages[asked + 1]["content"]
    rendered = []
    for letter in letters:
        ids, mask = render(tokenizer, [*messages[:asked + 1], {"role": "assistant", "content": letter}])
        rendered.append(ids[:len(mask) - mask[::-1].index(True)])  # through the last scored token
    at = _shared_length(rendered)
    if len({tuple(r) for r in rendered}) != len(letters) or any(len(r) == at for r in rendered):
        raise ValueError(f"the option letters {letters} do not render to distinct tokens after a shared "
                         "prompt, so the options cannot be told apart (check the chat template)")
    # the closing tokens every rendering ends with, keeping at least one token per option
    tail = min(_shared_length([r[::-1] for r in rendered]), min(len(r) for r in rendered) - at - 1)
    return ChoiceItem(rendered[0][:at], [r[at:len(r) - tail] for r in rendered], letters.index(key))


def describe_scoring(items: list[ChoiceItem]) -> str:
    """How evaluation scores `items` (nanochat.train.evaluation.choice_counts), for a run's results
    and summary: "option log-likelihood (1-2 tokens per option)"; with one token per option that
    is the letters' logits compared."""
    sizes = sorted({len(option) for it in items for option in it.options})
    spread = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
    return f"option log-likelihood ({spread} token{'s' * (sizes[-1] > 1)} per option)"

def _shared_length(seqs: list[list[int]]) -> int:
    """Length of the longest prefix all of `seqs` have."""
    return next((k for k, column in enumerate(zip(*seqs)) if len(set(column)) > 1), min(len(s) for s in seqs))
