"""Preparing a corpus: its sources listed, a tokenizer for it, and its token store, once.

    prepared = prepare_data(path, tokenizer=None, vocab_size=4096, cache_root=".cache")
    prepared.store.train, prepared.store.val          # token streams, memory-mapped
    nanochat.data.batches.split_stream(...)           # what a run's batches read from them

A run's data goes one way: sources -> tokenizer -> token store -> batches.
1. The sources are listed (a stat per file, nanochat.data.sources) and, at a fresh start,
   recorded in the run directory (`write_sources`): a --resume must read the corpus it started on.
2. The tokenizer is given (a model's, a run's) or trained on the corpus's first training
   characters, cached by that listing (`get_or_train_tokenizer`: a start reads no document).
3. The corpus is tokenized once into a token store (nanochat.data.token_store) that every later run
   and every rank memory-maps; one process builds (nanochat.data.build) while the others wait
   on a file lock. A source that changed rebuilds the store for a new run and stops a --resume,
   naming the file.
4. Batches: nanochat.data.batches.

The same documents and tokens in memory, without a store, are the reference the store is tested
against (tests/reference_data.py). Every data problem is a `DataError` raised before any model
is built, naming the fix. Why each choice was made, with the figures: docs/data.md.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanochat.common import UsageError, logger, warn_once
from nanochat.data import instruct
from nanochat.data.build import build_store, load_plan, locked, report
from nanochat.data.plan import Plan
from nanochat.data.sources import DataError, Sources, list_sources, named_changes
from nanochat.data.split import split_texts
from nanochat.data.token_store import TokenStore, dataset_dir, open_store, store_changes, store_dir
from nanochat.fs import temp_path, write_atomic
from nanochat.tokenizer import META_FILE, BPETokenizer, Tokenizer

DEFAULT_MAX_CHARS = 20_000_000
"""Characters a tokenizer is trained on when trained on the fly (TokTrainConfig's default)."""
SOURCES_FILE = "sources.json"
CHANGES_FILE = "corpus_changes.txt"
"""In a run directory: every change a --resume refused, when there were more than RESUME_NAMED."""
RESUME_NAMED = 20
"""Changes a --resume refusal names in its one line (then a count and CHANGES_FILE)."""
"""In a run directory: the listing of the corpus the run started on (what --resume checks)."""


@dataclass
class PreparedData:
    """What `prepare_data` found or made."""

    sources: Sources
    store: TokenStore
    tokenizer: Tokenizer
    """The tokenizer the store was built with (with the chat template chosen, for records)."""
    fallbacks: list[str]
    """What was not as asked (a smaller vocabulary, the plain chat format), each with its reason."""


def prepare_data(dataset_path: str | os.PathLike | None, *, tokenizer: Tokenizer | None = None, vocab_size: int = 4096,
                 chat_template: str | None = None, cache_root: str | os.PathLike, resume: bool = False,
                 recorded: dict[str, Any] | None = None, workers: int = 0, progress: bool = True,
                 piece_bytes: int | None = None, max_chars: int = DEFAULT_MAX_CHARS, build: bool = True,
                 changes_file: Path | None = None, run_dir: str | os.PathLike | None = None) -> PreparedData:
    """The token store of the corpus at `dataset_path` (None: the standard library) for
    `tokenizer` (None: one trained on the corpus, `vocab_size`, cached), built if missing or if
    its sources changed (and said why). With `resume`, sources that changed since `recorded`
    (the listing the run started on) or since the store was built are refused, naming the file:
    resuming on other data must never be silent: the refusal names RESUME_NAMED changes and
    writes all of them to `changes_file` when there are more. `chat_template`: --chat_template
    (records). `build=False`: only find them (a DataError says what is missing). `run_dir`: the
    run's directory, refused where a link in the corpus leads to it (list_sources)."""
    cache_root = Path(cache_root)
    sources = list_sources(dataset_path, exclude=[cache_root], run_dir=run_dir)
    if resume and recorded is not None:
        _refuse_changed(sources.changes(recorded), "since this run started", changes_file)
    directory = dataset_dir(cache_root, sources)
    fallbacks = []
    with locked(directory, f"the token store of {sources.name}"):
        plan = load_plan(sources, directory, workers=workers)
        if tokenizer is None:
            tokenizer = get_or_train_tokenizer(plan, vocab_size, cache_root / "tokenizers", max_chars,
                                               progress=progress, train=build)
            if tokenizer.vocab_size < vocab_size:
                fallbacks.append(f"tokenizer: the corpus ran out of BPE merges at {tokenizer.vocab_size} tokens "
                                 f"(--vocab_size {vocab_size} asked); training with the smaller vocabulary")
        tokenizer, template_fallback = instruct.choose_chat_template(tokenizer, chat_template,
                                                                     records=plan.kind == "instruct")
        if template_fallback:
            fallbacks.append(template_fallback)
        if plan.kind == "instruct":
            try:
                instruct.check_tokenizer(tokenizer)
            except ValueError as e:
                raise DataError(str(e)) from None
        path = store_dir(directory, tokenizer)
        store, why = open_store(path, sources)
        if store is None:
            if resume and recorded is None and why.startswith("its sources changed"):
                _refuse_changed(store_changes(path, sources), "since its token store was built", changes_file)
            if not build:
                raise DataError(f"no token store of {sources.source} for tokenizer {tokenizer.fingerprint} at "
                                f"{path} ({why}); build it with scripts/tokenize_corpus.py without --verify")
            report("token store %s: %s; building it", path, why)
            store = build_store(plan, tokenizer, path, workers=workers, progress=progress, piece_bytes=piece_bytes)
    return PreparedData(sources, store, tokenizer, fallbacks)


def _refuse_changed(changes: list[str], when: str, changes_file: Path | None) -> None:
    if changes:
        named = named_changes(changes, RESUME_NAMED)
        if len(changes) > RESUME_NAMED and changes_file is not None:
            write_atomic(changes_file, "\n".join(changes) + "\n")
            named += f" (all {len(changes)} in {changes_file})"
        raise UsageError(f"--resume: the corpus changed {when}: {named}; a resumed run must read the "
                         "data it started on. Restore it, or train on the new data in a new run (a new --run_dir; "
                         "--init_from <this run_dir> starts from its weights)")


def write_sources(sources: Sources, run_dir: str | os.PathLike) -> None:
    """Record in `run_dir` the listing of the corpus a fresh run starts on (what --resume checks)."""
    write_atomic(Path(run_dir) / SOURCES_FILE, json.dumps({"fingerprint": sources.fingerprint,
                                                           **sources.listing()}) + "\n")


def recorded_sources(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The listing `write_sources` recorded in `run_dir`; None for a run that has none."""
    try:
        recorded = json.loads((Path(run_dir) / SOURCES_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return recorded if isinstance(recorded, dict) and isinstance(recorded.get("files"), list) else None


# ---------------------------------------------------------------- tokenizer
def get_or_train_tokenizer(plan: Plan, vocab_size: int, cache_root: str | os.PathLike,
                           max_chars: int = DEFAULT_MAX_CHARS, *, progress: bool = True, train: bool = True) -> BPETokenizer:
    """The tokenizer trained on the first `max_chars` characters of the corpus's training
    documents (`nanochat.data.split.split_texts`), from `cache_root/tokenizer-<listing>-<vocab>-<chars>/`
    when already trained there (keyed by the sources' listing: a start reads no document).

    The directory appears atomically (written to a temp dir, then renamed), so an interrupted run
    leaves no half-written tokenizer and concurrent processes agree: a loser of the rename race
    loads the winner's, identical, tokenizer.
    """
    cache_root = Path(cache_root)
    target = cache_root / f"tokenizer-{plan.sources.fingerprint}-{vocab_size}-{max_chars}chars"
    if (target / META_FILE).is_file():
        try:
            tok = BPETokenizer.load(target)
        except (OSError, ValueError) as e:
            raise DataError(f"cached tokenizer {target} is unreadable ({e}); delete that directory "
                            "to retrain it") from None
        logger.info("tokenizer: %s from cache %s", tok, target)
        return tok
    if not train:
        raise DataError(f"no tokenizer trained on {plan.sources.source} with --vocab_size {vocab_size} in "
                        f"{cache_root}; pass the --tokenizer_dir the store was built with")
    texts = split_texts(plan, max_chars)
    logger.info("tokenizer: training a %d-token BPE on %s characters of %s", vocab_size,
                f"{sum(len(t) for t in texts):,}", plan.sources.name)
    t0 = time.perf_counter()
    tok = BPETokenizer.train(texts, vocab_size, progress=progress)
    logger.info("tokenizer: trained %s in %.1fs", tok, time.perf_counter() - t0)
    if tok.vocab_size < vocab_size:
        warn_once(f"small-vocab:{target}", f"the corpus supports only {tok.vocab_size} tokens, not "
                  f"--vocab_size {vocab_size}: BPE ran out of pairs to merge (a small corpus)")
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(target)
    tmp.mkdir()  # permissions as mkdir gives them (mkdtemp's are 0700; caches are shared)
    tok.save(tmp)
    try:
        os.rename(tmp, target)
    except OSError:  # another process renamed its copy first: same corpus, same merges
        shutil.rmtree(tmp, ignore_errors=True)
        return BPETokenizer.load(target)
    return tok


__all__ = ["DEFAULT_MAX_CHARS", "DataError", "PreparedData", "SOURCES_FILE", "get_or_train_tokenizer",
           "prepare_data", "recorded_sources", "write_sources"]
