"""A Hugging Face tokenizer (`tokenizer.json`) behind nanochat's tokenizer protocol, with its chat template.

`HFTokenizer` wraps the `tokenizers` library's Tokenizer (a dependency of transformers, the fast
tokenizer every Llama-family checkpoint ships) and keeps the checkpoint's files as bytes, so that
the run's saved tokenizer and an export are the files the model came with, byte for byte, and the
fingerprint (which keys token caches and checks resumes) is a hash of those files. The tokenizers
library alone gives transformers' ids (tests/test_hf.py compares them), and transformers is an
optional extra (docs/design.md).

The checkpoint's regexes are probed at load as our own split pattern is
(nanochat.tokenizer.patterns). Chat templates (tokenizer_config.json's or chat_template.jinja)
render in a bounded sandbox (nanochat.tokenizer.chat_template). `token_bytes` reads each token's
UTF-8 length off the vocabulary, for bits per byte on any vocabulary style.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch

from nanochat.common import UsageError, logger
from nanochat.fs import write_atomic
from nanochat.tokenizer.bpe import META_FILE, RANKS_FILE, check_tokenizer_dir
from nanochat.tokenizer.chat_template import ChatTemplate
from nanochat.tokenizer.patterns import panics_as_errors, probe

# A checkpoint's regexes (a Split pre-tokenizer, a Replace normalizer) are tried on the probe
# texts at load, as our own split pattern is (nanochat.tokenizer.patterns.probe).
_REGEX_OWNER = "tokenizer.json (a regex of its normalizer or pre-tokenizer)"
_RESTORE = "restore tokenizer.json from the model's source"

# Files of a Hugging Face tokenizer that are copied as they are when saving or exporting.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _byte_level_alphabet() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-character map used by byte-level BPE vocabularies: each byte
    is shown as a printable character; printable Latin-1 bytes stand for themselves, the other
    68 bytes are assigned the characters from U+0100 upwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    char_of = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in char_of:
            char_of[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in char_of.items()}


class HFTokenizer:
    """A checkpoint's `tokenizer.json` as a `nanochat.tokenizer.ChatTokenizer`: the Tokenizer
    protocol (encode / encode_batch / decode / bos_id / vocab_size / token_bytes / fingerprint /
    save) plus the chat template of `tokenizer_config.json` (render_chat, with_chat_template).

    As with our tokenizer, `encode` treats special-token strings in the text as ordinary text
    (a document cannot inject a control token) and never adds tokens on its own (the
    checkpoint's post-processor, e.g. Llama 3's automatic <|begin_of_text|>, is not applied);
    `prepend_bos` is the only way a BOS gets in. Text rendered from the chat template is the
    exception: it is meant to contain special tokens, so `encode(..., allow_special=True)`.
    """

    def __init__(self, files: dict[str, bytes], *, origin: str | None = None):
        """`files`: name -> content; `origin`: the directory they came from, named in messages."""
        from tokenizers import Tokenizer as _Tokenizer  # a dependency of transformers

        if "tokenizer.json" not in files:
            raise FileNotFoundError("tokenizer.json is required")
        self._files = dict(files)
        try:
            self._tok = _Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
        except Exception as e:  # the tokenizers library raises its own Exception subclass
            raise UsageError(f"tokenizer.json is not a tokenizer the tokenizers library reads ({e}); "
                             "restore it from the model's source") from None
        probe(_REGEX_OWNER, lambda text: self._tok.encode(text, add_special_tokens=False).ids, _RESTORE)
        try:
            self._config = json.loads(files["tokenizer_config.json"]) if "tokenizer_config.json" in files else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UsageError(f"tokenizer_config.json is not valid JSON ({e}); restore it from the "
                             "model's source") from None
        if not isinstance(self._config, dict):
            raise UsageError(f"tokenizer_config.json holds a JSON {type(self._config).__name__}, "
                             "expected an object; restore it from the model's source")
        self.chat_template: str | None = self._find_chat_template()
        """Jinja source of the checkpoint's chat template, or None if it has none."""
        where = f"{origin}/" if origin else ""
        self.chat_template_origin = (f"{where}chat_template.jinja" if "chat_template.jinja" in files
                                     else f"{where}tokenizer_config.json (\"chat_template\")")
        """Where chat_template came from, for messages: a file, or the flag that chose it."""
        self._template = None  # compiled at the first render_chat
        h = hashlib.sha256()
        for name in sorted(files):
            h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
        self.fingerprint = h.hexdigest()[:16]
        """16 hex digits of sha256 over the tokenizer files: keys caches, checks resumes."""
        self.bos_token = self._special("bos_token")
        self.eos_token = self._special("eos_token")
        bos = self.bos_token or self.eos_token
        if bos is None or self._tok.token_to_id(bos) is None:
            raise ValueError("the tokenizer defines neither a bos_token nor an eos_token in "
                             "tokenizer_config.json; nanochat needs one to separate documents")
        if self.bos_token is None:
            logger.info("hf tokenizer: no bos_token, documents are separated by the eos_token %r", bos)
        self._bos_id = self._tok.token_to_id(bos)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "HFTokenizer":
        d = Path(directory)
        if not (d / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"{d} has no tokenizer.json (the fast-tokenizer file nanochat reads). If it has only a "
                "SentencePiece tokenizer.model, convert it where transformers is installed: "
                "AutoTokenizer.from_pretrained(dir).save_pretrained(dir)"
            )
        try:
            return cls({n: (d / n).read_bytes() for n in _TOKENIZER_FILES if (d / n).is_file()}, origin=str(d))
        except UsageError as e:
            raise UsageError(f"{d}/{e}") from None  # the message starts with the file's name

    def save(self, directory: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the tokenizer's files into `directory` (created), each replaced atomically. A
        directory already holding exactly these files is left as it is; one holding another
        tokenizer is refused unless `overwrite`, and always when it is a run's (check_tokenizer_dir)."""
        d = Path(directory)
        if all((d / n).is_file() and (d / n).read_bytes() == data for n, data in self._files.items()):
            return d
        check_tokenizer_dir(d, overwrite=overwrite, names=(*self._files, META_FILE, RANKS_FILE))
        d.mkdir(parents=True, exist_ok=True)
        for name, data in self._files.items():
            write_atomic(d / name, data)
        return d

    def with_chat_template(self, source: str, origin: str = "with_chat_template") -> "HFTokenizer":
        """This tokenizer with `source` (Jinja) as its chat template, written as
        chat_template.jinja (and removed from tokenizer_config.json, so only one template exists):
        the run's saved tokenizer and an export carry the template the model was trained with,
        and the fingerprint, which keys the token caches, changes with it. `origin` names the
        source in messages (e.g. the --chat_template flag that chose it)."""
        files = dict(self._files)
        files["chat_template.jinja"] = source.encode("utf-8")
        if "chat_template" in self._config:
            config = {k: v for k, v in self._config.items() if k != "chat_template"}
            files["tokenizer_config.json"] = (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
        tokenizer = HFTokenizer(files)
        tokenizer.chat_template_origin = origin
        return tokenizer

    def has_token(self, token: str) -> bool:
        """Whether `token` is one token of the vocabulary (e.g. a template's <|im_start|>)."""
        return self._tok.token_to_id(token) is not None

    def _special(self, key: str) -> str | None:
        value = self._config.get(key)
        return value.get("content") if isinstance(value, dict) else value

    def _find_chat_template(self) -> str | None:
        if "chat_template.jinja" in self._files:  # transformers >= 4.50 saves it as its own file
            return self._files["chat_template.jinja"].decode("utf-8")
        template = self._config.get("chat_template")
        if isinstance(template, list):  # several named templates: the default one is "default"
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        return template

    # -- the Tokenizer protocol

    def encode(self, text: str, *, prepend_bos: bool = False, allow_special: bool = False) -> list[int]:
        self._tok.encode_special_tokens = not allow_special
        with panics_as_errors(_REGEX_OWNER, _RESTORE):
            ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if prepend_bos else ids

    def encode_batch(self, texts: list[str], *, prepend_bos: bool = False,
                     num_threads: int | None = None) -> list[list[int]]:
        """`encode` over many texts (the tokenizers library parallelizes on its own; num_threads
        is accepted for interface compatibility and ignored)."""
        self._tok.encode_special_tokens = True
        with panics_as_errors(_REGEX_OWNER, _RESTORE):
            batch = [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]
        return [[self.bos_id, *ids] for ids in batch] if prepend_bos else batch

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    @property
    def bos_id(self) -> int:
        """The document separator: the BOS token, or the EOS token where there is none (Qwen2)."""
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        return self._tok.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def vocab_size(self) -> int:
        """Largest token id + 1. A checkpoint's embedding may have more rows (padding)."""
        return max(self._tok.get_vocab(with_added_tokens=True).values()) + 1

    def token_bytes(self) -> torch.Tensor:
        """[vocab_size] int64: UTF-8 bytes each id stands for; 0 for special tokens.

        Byte-level vocabularies (Llama 3, Qwen2) spell each byte as one character of GPT-2's
        alphabet; SentencePiece-style ones (Llama 2, Mistral) write a space as U+2581 and raw
        bytes as <0xNN> (byte fallback).
        """
        out = torch.zeros(self.vocab_size, dtype=torch.int64)
        byte_level = '"ByteLevel"' in json.dumps(json.loads(self._tok.to_str()).get("decoder"))
        alphabet = _byte_level_alphabet() if byte_level else None
        for token, i in self._tok.get_vocab(with_added_tokens=False).items():
            if alphabet is not None and all(c in alphabet for c in token):
                out[i] = len(token)  # one character per byte
            elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
                out[i] = 1
            else:
                out[i] = len(token.replace("\u2581", " ").encode("utf-8"))
        for i, added in self._tok.get_added_tokens_decoder().items():
            out[i] = 0 if added.special else len(added.content.encode("utf-8"))
        return out

    # -- chat

    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = False, **kwargs) -> str:
        """The checkpoint's chat template applied to `messages` ([{"role", "content"}, ...]),
        as text, rendered in a bounded sandbox (nanochat.tokenizer.chat_template); encode it with
        `encode(text, allow_special=True)`."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja)")
        if self._template is None:
            self._template = ChatTemplate(self.chat_template, self.chat_template_origin)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, fingerprint={self.fingerprint!r})"
