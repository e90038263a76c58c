"""Regexes a tokenizer reads from a file, made safe to run: probed before use, panics as errors.

A byte-level BPE cuts text with a regex (our split pattern, a Hugging Face tokenizer.json's Split
pre-tokenizer or Replace normalizer) before merging. A saved tokenizer's regex is data, so it may
backtrack without end on some input: the Rust engines behind tiktoken (fancy_regex) and tokenizers
(Oniguruma) then hit their backtracking limit and panic, which pyo3 raises as a PanicException,
a BaseException that `except Exception` and the CLI's error handler miss, mid-corpus, after their
own message on stderr.

So a regex is tried on PROBE_TEXTS when the tokenizer is loaded (`probe`): long runs of the
character classes split patterns tell apart, the inputs on which nested repetition explodes. One
that gives up there is a UsageError at load naming the regex and the fix. One that passes but
panics on real text later is caught at encode (`panics_as_errors`) and said in one line. The
probe runs the engine that will run the regex: another engine would pass patterns this one
panics on (docs/tokenizer.md).
"""

from __future__ import annotations

import contextlib
import os
import sys

from nanochat.common import UsageError

# Runs of 256 of one character and of two alternating, over the classes split patterns tell
# apart (letters of three scripts, digits, spaces, newlines, tabs, punctuation, the apostrophe of
# contractions): the shapes on which a pattern with nested repetition, e.g. (\w+\s?)+, backtracks
# without end (a long word, a line of dashes, indentation). 256 is long enough that a cubic one
# goes over the engines' limits as well as an exponential one: 256^3 = 16.8M steps, above
# fancy_regex's 1M backtracking steps (tiktoken) and Oniguruma's 10M retries (tokenizers).
_PROBE_CHARS = "aé日1 \n\t.'"
PROBE_TEXTS = tuple(c * 256 for c in _PROBE_CHARS) + tuple(
    (a + b) * 128 for a in _PROBE_CHARS for b in _PROBE_CHARS if a != b)
_RUNAWAY = "catastrophic backtracking, a repetition of something that itself repeats, such as (\\w+\\s?)+"


def _is_rust_panic(e: BaseException) -> bool:
    """A panic inside a Rust extension (tiktoken, tokenizers), raised by pyo3 as its
    PanicException: a BaseException, so `except Exception` and the CLI's error handler miss it.
    Each extension has its own class of that name."""
    return type(e).__name__ == "PanicException"


@contextlib.contextmanager
def panics_as_errors(what: str, fix: str):
    """A Rust panic inside the block (a regex over its backtracking limit) becomes a UsageError
    naming `what` (whose regex) and `fix`. The library has printed the panic's own message on
    stderr by then; `probe` is what keeps that from happening on real text."""
    try:
        yield
    except BaseException as e:
        if not _is_rust_panic(e):
            raise
        raise UsageError(f"{what} made the tokenizer library give up on a text ({' '.join(str(e).split())}): "
                         f"{_RUNAWAY}; {fix}") from None


def probe(what: str, encode, fix: str | None = None) -> list[tuple[str, list[int]]]:
    """(text, encode(text)) for each of PROBE_TEXTS; a UsageError naming `what` (whose regex),
    the text and `fix` if the tokenizer library panics on one. stderr is silenced meanwhile (file
    descriptor 2, where the Rust panic handler writes its message and backtrace before Python
    sees the exception)."""
    text, out = "", []
    try:
        with _silenced_stderr():
            for text in PROBE_TEXTS:
                out.append((text, encode(text)))
    except BaseException as e:
        if not _is_rust_panic(e):
            raise
        raise UsageError(f"{what} exceeds the regex engine's backtracking limit on {preview(text, 20)} "
                         f"({len(text)} characters): {_RUNAWAY}" + (f"; {fix}" if fix else "")) from None
    return out


@contextlib.contextmanager
def _silenced_stderr():
    if sys.stderr is not None:
        sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2 at all: nothing to silence
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def preview(text: str, limit: int = 80) -> str:
    shown = repr(text)
    return shown if len(shown) <= limit else shown[:limit] + "..."
