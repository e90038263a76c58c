"""Our BPE tokenizer (`BPETokenizer`): trained with rustbpe, encoded with tiktoken, stored as plain data.

Byte-level BPE in two stages: a regex (the *split pattern*) cuts text into chunks (words with
their leading space, digit runs, punctuation, whitespace) so that no merge crosses a chunk
boundary; each chunk's UTF-8 bytes then merge pairwise, in learned order, into longer tokens.
Every byte is a token, so any string encodes and decoding is byte-exact: no "unknown" token.

Two libraries, one job each (karpathy/nanochat's split): rustbpe trains (in parallel, in seconds
on the default corpus: docs/tokenizer.md), tiktoken encodes (a fast batch encoder from the
learned ranks, which cannot train).

The split pattern is GPT-4's with digits grouped in runs of at most two (`\\p{N}{1,2}`), so a
small vocabulary does not spend its merges on 1,110 digit groups in number-heavy text. A saved
tokenizer's pattern is data, so it is probed before use (nanochat.tokenizer.patterns): one whose
backtracking runs away, or that skips text, is an error at load; a panic on real text is caught
at encode and said in one line.

Special tokens follow the learned vocabulary: `<|bos|>` starts every document and three chat
markers are reserved (the smallest vocabulary is 256 + 4 = 260). Text that merely contains
"<|bos|>" is encoded as ordinary text: a document can never inject a control token.

On disk a tokenizer is data, never a pickle: `tokenizer.tiktoken` (one `base64(bytes) rank` line
per token) and `tokenizer_meta.json`, whose fingerprint is checked at load, so a truncated or
edited file is an error. The reasons and the measurements in full: docs/tokenizer.md.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import rustbpe
import tiktoken
import torch
from tqdm import tqdm

from nanochat.common import UsageError, read_json_object
from nanochat.fs import write_atomic
from nanochat.rundir import run_contents
from nanochat.tokenizer.patterns import panics_as_errors, preview, probe

# GPT-4's cl100k split pattern with \p{N}{1,3} -> \p{N}{1,2} (docs/tokenizer.md).
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|"""
    r"""\s*[\r\n]|\s+(?!\S)|\s+"""
)

BOS = "<|bos|>"
SPECIAL_TOKENS = (BOS, "<|user_start|>", "<|assistant_start|>", "<|end|>")
"""In id order after the learned vocabulary. <|end|> closes a user or assistant turn."""

META_FILE = "tokenizer_meta.json"
RANKS_FILE = "tokenizer.tiktoken"
FORMAT = "nanochat-tokenizer"
FORMAT_VERSION = 1
RETRAIN = "retrain the tokenizer with scripts/tok_train.py (it writes the default pattern)"


class BPETokenizer:
    """A trained byte-level BPE vocabulary plus the tiktoken encoder built from it.

    Build one with `BPETokenizer.train(texts, vocab_size)` or `BPETokenizer.load(dir)`; the
    constructor takes the raw pieces (used by both) and checks they form a valid vocabulary.
    """

    def __init__(self, mergeable_ranks: dict[bytes, int], pattern: str = SPLIT_PATTERN,
                 special_tokens: Iterable[str] = SPECIAL_TOKENS) -> None:
        n = len(mergeable_ranks)
        if sorted(mergeable_ranks.values()) != list(range(n)):
            raise ValueError("mergeable ranks must be exactly the ids 0..n-1, each once")
        if any(mergeable_ranks.get(bytes([b])) is None for b in range(256)):
            raise ValueError("mergeable ranks must contain all 256 single bytes (byte-level BPE)")
        self.pattern = pattern
        self.mergeable_ranks = dict(mergeable_ranks)
        self.special_tokens = {name: n + i for i, name in enumerate(special_tokens)}
        self._enc = tiktoken.Encoding(
            name="nanochat", pat_str=pattern, mergeable_ranks=self.mergeable_ranks,
            special_tokens=self.special_tokens,
        )
        self._pattern_name = f"the split pattern {preview(pattern)}"
        for text, ids in probe(self._pattern_name, self._enc.encode_ordinary):
            if self.decode(ids) != text:
                raise ValueError(f"{self._pattern_name} skips part of {preview(text, 20)} ({len(text)} characters), "
                                 "so encoding would silently drop text; a split pattern must match every character")
        self.fingerprint = self._compute_fingerprint()
        """16 hex digits of sha256 over pattern, ranks and specials: keys caches, checks resumes."""

    # ------------------------------------------------------------------ train
    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, *, progress: bool = True) -> "BPETokenizer":
        """Learn `vocab_size - len(SPECIAL_TOKENS) - 256` merges from `texts` with rustbpe.

        `vocab_size` counts everything: 256 byte tokens, the merges and the special tokens. A
        corpus too small to supply that many distinct merges gives a smaller vocabulary (BPE
        stops when every pair occurs once); `vocab_size` of the result is the real size.
        """
        n_base = 256 + len(SPECIAL_TOKENS)
        if vocab_size < n_base:
            raise ValueError(
                f"vocab_size={vocab_size} is too small: it must cover 256 byte tokens and "
                f"{len(SPECIAL_TOKENS)} special tokens, so at least {n_base}"
            )
        total = len(texts) if hasattr(texts, "__len__") else None  # type: ignore[arg-type]
        # disable=None: tqdm draws only on a terminal, so logs and CI output stay clean.
        it: Iterator[str] = iter(tqdm(texts, total=total, desc="tokenizer: reading", unit="doc",
                                      disable=None if progress else True, leave=False))
        bpe = rustbpe.Tokenizer()
        bpe.train_from_iterator(it, vocab_size - len(SPECIAL_TOKENS), pattern=SPLIT_PATTERN)
        return cls({bytes(tok): rank for tok, rank in bpe.get_mergeable_ranks()}, bpe.get_pattern())

    # ----------------------------------------------------------------- encode
    def encode(self, text: str, *, prepend_bos: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings inside it are ordinary text.

        Lone surrogates (e.g. "\\ud800" from a broken JSON escape) have no UTF-8 form; tiktoken
        encodes them as U+FFFD, so they are the one input that does not round-trip.
        """
        with panics_as_errors(self._pattern_name, RETRAIN):
            ids = self._enc.encode_ordinary(text)
        return [self.bos_id, *ids] if prepend_bos else ids

    def encode_batch(self, texts: list[str], *, prepend_bos: bool = False,
                     num_threads: int | None = None) -> list[list[int]]:
        """`encode` over many texts with tiktoken's thread pool (its Rust core drops the GIL)."""
        with panics_as_errors(self._pattern_name, RETRAIN):
            batch = self._enc.encode_ordinary_batch(list(texts), num_threads=num_threads or os.cpu_count() or 1)
        if prepend_bos:
            batch = [[self.bos_id, *ids] for ids in batch]
        return batch

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`. Byte-exact for the ids of a whole string; a sequence cut inside a
        multi-byte character decodes that fragment to U+FFFD. Special ids decode to their name."""
        return self._enc.decode(list(ids))

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return self._enc.decode_bytes(list(ids))

    @property
    def bos_id(self) -> int:
        return self.special_tokens[BOS]

    @property
    def vocab_size(self) -> int:
        """Embedding rows a model needs: learned tokens plus special tokens."""
        return len(self.mergeable_ranks) + len(self.special_tokens)

    def token_bytes(self) -> torch.Tensor:
        """[vocab_size] int64: UTF-8 bytes each id stands for; 0 for special tokens.

        Validation bits per byte = sum(loss in nats) / (ln 2 * sum(token_bytes[targets])): a loss
        that does not depend on the tokenizer, so runs with different vocabularies compare.
        """
        out = torch.zeros(self.vocab_size, dtype=torch.int64)
        for tok, rank in self.mergeable_ranks.items():
            out[rank] = len(tok)
        return out

    # ------------------------------------------------------------ persistence
    def save(self, directory: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the two files into `directory` (created); each is replaced atomically. A directory
        that already holds this tokenizer is left as it is; one holding another tokenizer is
        refused unless `overwrite`, and always when it is a run's (see `check_tokenizer_dir`)."""
        d = Path(directory)
        try:
            if BPETokenizer.load(d).fingerprint == self.fingerprint:  # load checks the files against it
                return d
        except (OSError, ValueError):  # none there, or a damaged one
            pass
        check_tokenizer_dir(d, overwrite=overwrite)
        d.mkdir(parents=True, exist_ok=True)
        by_rank = sorted(self.mergeable_ranks.items(), key=lambda kv: kv[1])
        ranks_text = "".join(f"{base64.b64encode(tok).decode('ascii')} {rank}\n" for tok, rank in by_rank)
        meta = {
            "format": FORMAT, "version": FORMAT_VERSION, "pattern": self.pattern,
            "special_tokens": self.special_tokens, "vocab_size": self.vocab_size,
            "fingerprint": self.fingerprint,
        }
        write_atomic(d / RANKS_FILE, ranks_text)
        write_atomic(d / META_FILE, json.dumps(meta, indent=2) + "\n")
        return d

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "BPETokenizer":
        d = Path(directory)
        make_one = f"make one with: python scripts/tok_train.py --tokenizer_dir {d}"
        if not d.is_dir():
            raise FileNotFoundError(f"tokenizer directory {d} does not exist; {make_one}")
        for name in (META_FILE, RANKS_FILE):
            if not (d / name).is_file():
                raise FileNotFoundError(
                    f"{d} is not a nanochat tokenizer: {name} is missing (a tokenizer directory "
                    f"holds {META_FILE} and {RANKS_FILE}); {make_one}"
                )
        meta_path = d / META_FILE
        meta = read_json_object(meta_path, make_one)
        if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
            raise UsageError(
                f"{meta_path}: format {meta.get('format')!r} version {meta.get('version')!r} "
                f"is not {FORMAT!r} version {FORMAT_VERSION}; retrain it: {make_one}"
            )
        kinds = {"pattern": str, "special_tokens": dict, "fingerprint": str}
        for key, kind in kinds.items():
            if not isinstance(meta.get(key), kind):
                got = "missing" if key not in meta else f"a JSON {type(meta[key]).__name__}"
                raise UsageError(f"{meta_path}: {key!r} is {got}, expected a JSON "
                                 f"{'string' if kind is str else 'object'}; the file was edited or "
                                 f"truncated: {make_one}")
        if not all(isinstance(v, int) for v in meta["special_tokens"].values()):
            raise UsageError(f"{meta_path}: 'special_tokens' must map names to integer ids; {make_one}")
        ranks: dict[bytes, int] = {}
        try:
            text = (d / RANKS_FILE).read_text(encoding="ascii")
        except UnicodeDecodeError as e:
            raise UsageError(f"{d / RANKS_FILE} is not the ASCII file tokenizer training writes ({e}); "
                             f"{make_one}") from None
        for lineno, line in enumerate(text.splitlines(), 1):
            try:
                tok, rank = line.split()
                ranks[base64.b64decode(tok, validate=True)] = int(rank)
            except ValueError as e:
                raise UsageError(f"{d / RANKS_FILE}:{lineno}: expected 'base64 rank', got {line!r} ({e})") from None
        specials = sorted(meta["special_tokens"].items(), key=lambda kv: kv[1])
        try:
            tok = cls(ranks, meta["pattern"], [name for name, _ in specials])
        except ValueError as e:  # the ranks are not a vocabulary, or the pattern does not compile
            raise UsageError(f"{d}: {e} (pattern and specials from {meta_path}, ranks from "
                             f"{d / RANKS_FILE}); {make_one}") from None
        if tok.special_tokens != meta["special_tokens"] or tok.fingerprint != meta["fingerprint"]:
            raise UsageError(
                f"{d}: the files do not match the fingerprint recorded at save time "
                f"({tok.fingerprint} != {meta['fingerprint']}); they were edited or truncated. {make_one}"
            )
        return tok

    def _compute_fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update(json.dumps([FORMAT_VERSION, self.pattern, self.special_tokens], sort_keys=True).encode())
        for tok, _ in sorted(self.mergeable_ranks.items(), key=lambda kv: kv[1]):
            h.update(len(tok).to_bytes(4, "little") + tok)
        return h.hexdigest()[:16]

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size}, fingerprint={self.fingerprint!r})"


def take_chars(texts: Iterable[str], max_chars: int) -> Iterator[str]:
    """Yield `texts` in order until `max_chars` characters have been yielded (the last one cut)."""
    left = max_chars
    for text in texts:
        if left <= 0:
            return
        yield text[:left]
        left -= len(text)


def _saved_fingerprint(directory: Path) -> str | None:
    """The fingerprint recorded in `directory`'s tokenizer_meta.json; None without a readable one."""
    try:
        return json.loads((directory / META_FILE).read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


def check_tokenizer_dir(directory: str | os.PathLike, *, overwrite: bool,
                        names: tuple[str, ...] = (META_FILE, RANKS_FILE)) -> None:
    """Raise a UsageError, before a tokenizer is trained or written, when writing one into
    `directory` would replace a tokenizer (one of the files `names` is there): one it holds, unless
    `overwrite`; a run's (`<run_dir>/tokenizer`, next to checkpoints or metrics), always: its
    checkpoints only mean something with that tokenizer."""
    d = Path(directory)
    if not any((d / name).exists() for name in names):
        return
    run = run_contents(d.parent) if d.name == "tokenizer" else []
    if run:
        raise UsageError(f"{d} is the tokenizer of the run in {d.parent} ({', '.join(run[:3])}), whose "
                         "checkpoints were trained with it; it is never replaced: choose another directory")
    if not overwrite:
        fingerprint = _saved_fingerprint(d)
        raise UsageError(f"{d} already holds a tokenizer" + (f" (fingerprint {fingerprint})" if fingerprint else "")
                         + "; pass --overwrite to replace it, or choose another directory")
