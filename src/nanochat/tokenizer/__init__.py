"""Tokenizers: the protocol every part of a run types against, and its two implementations.

BPETokenizer is our byte-level BPE (trained with rustbpe, encoded with tiktoken); HFTokenizer
wraps a Hugging Face checkpoint's tokenizer.json and chat template. Both probe the regexes they
read before use (a runaway regex is an error), and chat templates render in a bounded sandbox.

`Tokenizer` is what the data pipeline, the trainer, evaluation, checkpoints and export ask of a
tokenizer: text to ids and back, the document separator (`bos_id`), the vocabulary size the
embedding needs, the bytes each id stands for (bits per byte), a fingerprint that keys token
caches and checks a resume, and `save`. `ChatTokenizer` adds what instruction data needs from a
Hugging Face tokenizer: a chat template rendered to text that is then encoded with its special
tokens. Our BPE has no template; it renders conversations with its own special tokens
(nanochat.data.instruct). They are Protocols: a user's own tokenizer fits without inheriting
from ours (alternatives: docs/design.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from nanochat.common import UsageError
from nanochat.tokenizer.bpe import (
    BOS, META_FILE, RANKS_FILE, SPECIAL_TOKENS, SPLIT_PATTERN, BPETokenizer, check_tokenizer_dir, take_chars,
)
from nanochat.tokenizer.hf import HFTokenizer
from nanochat.tokenizer.patterns import panics_as_errors, probe

if TYPE_CHECKING:
    import torch


class Tokenizer(Protocol):
    """What a run needs of a tokenizer (BPETokenizer, HFTokenizer)."""

    fingerprint: str
    """16 hex digits identifying the vocabulary and its rules: keys token caches, checks resumes."""

    @property
    def bos_id(self) -> int:
        """The id that starts every document (the document separator)."""

    @property
    def vocab_size(self) -> int:
        """Embedding rows a model needs: every id this tokenizer produces is below it."""

    def encode(self, text: str, *, prepend_bos: bool = False) -> list[int]:
        """Ids of `text`; special-token strings in it are ordinary text. No token is added
        except `bos_id` with `prepend_bos`."""

    def encode_batch(self, texts: list[str], *, prepend_bos: bool = False,
                     num_threads: int | None = None) -> list[list[int]]:
        """`encode` over many texts."""

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`."""

    def token_bytes(self) -> torch.Tensor:
        """[vocab_size] int64: the UTF-8 bytes each id stands for, 0 for special tokens."""

    def save(self, directory: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the tokenizer's files into `directory`, refusing to replace another tokenizer
        unless `overwrite` (and a run's, always)."""


class ChatTokenizer(Tokenizer, Protocol):
    """A Tokenizer with a chat template (HFTokenizer): instruction records are rendered to text by
    the template, then encoded with the template's special tokens allowed."""

    chat_template: str | None
    """Jinja source of the template, or None (a base model's tokenizer)."""

    @property
    def eos_id(self) -> int | None:
        """The end-of-sequence id the plain template closes answers with; None if there is none."""

    def encode(self, text: str, *, prepend_bos: bool = False, allow_special: bool = False) -> list[int]:
        """As Tokenizer.encode; `allow_special` reads special-token strings (a rendered template's)
        as those tokens."""

    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = False, **kwargs) -> str:
        """`messages` ([{"role", "content"}, ...]) rendered by the chat template, as text."""

    def with_chat_template(self, source: str, origin: str = ...) -> ChatTokenizer:
        """This tokenizer with `source` (Jinja) as its template; `origin` names it in messages."""

    def has_token(self, token: str) -> bool:
        """Whether `token` is one token of the vocabulary (a template's <|im_start|>)."""



def run_tokenizer(run_dir: str | os.PathLike, fingerprint: str | None, flag: str) -> Tokenizer:
    """The tokenizer a run trained with, from `<run_dir>/tokenizer` (ours, or a Hugging Face
    model's tokenizer.json with the chat template its records were rendered with), checked against
    the `fingerprint` its checkpoint recorded: a checkpoint's weights mean something only with it.
    `flag` (--resume, --init_from, --run_dir) names the source in the errors."""
    directory = Path(run_dir) / "tokenizer"
    if not directory.is_dir():
        raise UsageError(f"{flag} {run_dir}: its tokenizer/ directory is missing, and the weights only mean "
                         "something with the tokenizer they were trained with; restore it from the run")
    tokenizer = (HFTokenizer.load(directory) if (directory / "tokenizer.json").is_file()
                 else BPETokenizer.load(directory))
    if fingerprint is not None and tokenizer.fingerprint != fingerprint:
        raise UsageError(f"{flag} {run_dir}: {directory} is not the tokenizer its checkpoint was trained with "
                         "(fingerprints differ: its token ids mean other text); restore the run's own tokenizer/")
    return tokenizer

__all__ = [
    "BOS", "META_FILE", "RANKS_FILE", "SPECIAL_TOKENS", "SPLIT_PATTERN", "BPETokenizer",
    "ChatTokenizer", "HFTokenizer", "Tokenizer", "check_tokenizer_dir", "run_tokenizer", "panics_as_errors", "probe",
    "take_chars",
]
