"""Building a token store: the corpus tokenized in parallel, resumably, by one process at a time.

`build_store` cuts the corpus's units (nanochat.data.plan) into pieces (at most 32 MiB) and
tokenizes them in a process pool (stdlib), each worker streaming documents into its own piece
files; a piece is recorded once complete, so a killed build keeps what it finished and continues.
Then the split is decided from the per-document tables and the pieces are concatenated
(nanochat.data.assemble), reading and writing in chunks: memory is bounded by the largest
document, not the corpus. Every file is a nanochat.fs.AtomicFile (a temporary name, hashed as it
is written, made durable and renamed); the manifest (nanochat.data.token_store) is committed last.

`locked` makes one process build while the others (ranks, nodes on a shared file system) wait,
then map the result; `load_plan` keeps the corpus's plan beside its stores, so a start whose
sources did not change reads no file of the corpus. The libraries chosen, and the ones not:
docs/data.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import time
from array import array
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from nanochat.common import NanoChatError, format_bytes, logger, warn_once
from nanochat.data import instruct
from nanochat.data.assemble import ROLE_CODE, finalize
from nanochat.data.plan import Plan, Unit, plan_sources
from nanochat.data.read import read_unit
from nanochat.data.sources import DataError, Sources
from nanochat.data.split import val_hash
from nanochat.data.token_store import FORMAT, MANIFEST, VERSION, TokenStore, map_store, token_dtype
from nanochat.fs import AtomicFile, FileLock, LockUnsupported, commit_manifest, write_atomic

if TYPE_CHECKING:
    from nanochat.tokenizer import Tokenizer

PLAN = "plan.json"
LOCK = ".lock"
PIECE_BYTES = 32 << 20
"""Most text per piece: a few seconds of one worker at the build's rate per core (BENCHMARKS.md §9),
so the progress bar moves and a killed build loses little; a 40 GB corpus makes ~1,300 pieces."""
MIN_PIECES = 64
"""A smaller corpus is cut into about this many pieces (of at least 1 MiB) so that every core
has work: the standard library's 11.6 MiB make 12."""


def report(message: str, *args: Any) -> None:
    """A line about a build, shown by whichever process builds: the lock decides which rank that
    is, and ranks other than 0 log only warnings (common.setup_logging)."""
    logger.log(max(logging.INFO, logger.getEffectiveLevel()), message, *args)


# ------------------------------------------------------------------ locking
@contextlib.contextmanager
def locked(directory: Path, what: str) -> Iterator[None]:
    """Hold `directory`'s build lock (a nanochat.fs.FileLock on `.lock`): one process builds, the
    others wait here, then find the result. Where there are no file locks (or the directory is
    read-only) the block runs unlocked, once said: every file is still written under a temporary
    name and renamed, so concurrent builders only repeat work."""
    lock = FileLock(directory / LOCK)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        holder = lock.try_acquire()
        if holder is not None:
            logger.info("%s: waiting for %s, which is preparing it", what, holder)
            lock.wait()
    except LockUnsupported as e:
        warn_once(f"store-lock:{directory}", f"{what}: {e}; proceeding without one")
    except OSError as e:
        warn_once(f"store-lock:{directory}", f"{what}: cannot create {directory / LOCK} ({e.strerror or e}); "
                  "proceeding without a lock")
    try:
        yield
    finally:
        lock.release()


# ------------------------------------------------------------------ the plan, cached
def load_plan(sources: Sources, directory: Path, *, workers: int = 0) -> Plan:
    """The corpus's plan (nanochat.data.plan.plan_sources), cached in `directory` for the listing it
    was made from: a start whose sources did not change reads no file of the corpus."""
    path = directory / PLAN
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        cached = Plan.from_json(json.loads(path.read_text(encoding="utf-8")))
        if cached.sources.listing() == sources.listing() and cached.sources.skipped == sources.skipped:
            return cached
    with _pool(workers) as pool:
        plan = plan_sources(sources, map_fn=pool.map if pool is not None else map)
    write_atomic(path, json.dumps(plan.to_json()))
    return plan


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@contextlib.contextmanager
def _pool(workers: int, tokenizer: Tokenizer | None = None, tasks: int | None = None) -> Iterator[ProcessPoolExecutor | None]:
    """A process pool of `workers` (0: one per core), None when one process is enough. Workers
    are forked on Linux (the tokenizer is inherited, nothing is re-imported: PyTorch's DataLoader
    does the same), spawned elsewhere; they ignore SIGINT, so Ctrl-C stops the build once."""
    n = workers or _cpus()
    if tasks is not None:
        n = min(n, tasks)
    if n <= 1:
        yield None
        return
    ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    pool = ProcessPoolExecutor(max_workers=n, mp_context=ctx, initializer=_init_worker, initargs=(tokenizer,))
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker_tokenizer = tokenizer


# ------------------------------------------------------------------ building
@dataclass(frozen=True)
class _Job:
    index: int
    units: tuple[Unit, ...]
    root: str
    stem: str
    """The piece's files are stem + .tokens / .mask / .docs.npz / .records.jsonl, and its record
    stem + .json, written last."""
    kind: str
    dtype: str
    key: str

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self.units)


def build_store(plan: Plan, tokenizer: Tokenizer, path: Path, *, workers: int = 0, progress: bool = True,
                piece_bytes: int | None = None) -> TokenStore:
    """Tokenize the corpus of `plan` into a store at `path` (see the module docstring); complete
    pieces of an earlier, interrupted build of the same corpus and tokenizer are kept. The
    caller holds `locked`. `piece_bytes`: by default from the corpus's size (never from the
    number of workers, so that a build continued with other workers finds its pieces)."""
    t0 = time.perf_counter()
    path.mkdir(parents=True, exist_ok=True)
    (path / MANIFEST).unlink(missing_ok=True)  # from here until the new one, the store is incomplete
    pieces_dir = path / "pieces"
    pieces_dir.mkdir(exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    if piece_bytes is None:
        piece_bytes = min(PIECE_BYTES, max(1 << 20, plan.nbytes // MIN_PIECES))
    jobs = _jobs(plan, tokenizer.fingerprint, dtype, pieces_dir, piece_bytes)
    records = {job.index: rec for job in jobs if (rec := _finished_piece(job)) is not None}
    todo = [j for j in jobs if j.index not in records]
    total = sum(j.nbytes for j in jobs)
    reused = sum(j.nbytes for j in jobs if j.index in records)
    if records:
        report("token store %s: continuing an interrupted build, %d of %d pieces (%s) already done",
               path, len(records), len(jobs), format_bytes(reused))
    report("token store %s: tokenizing %s of %s in %d pieces", path, format_bytes(total - reused),
           plan.sources.name, len(todo))
    meter = _Progress(total, reused, progress)
    try:
        used_workers = _tokenize_pieces(todo, tokenizer, workers, records, meter, path)
    finally:
        meter.close()
    tokenize_s = time.perf_counter() - t0
    manifest = finalize(plan, tokenizer, path, [(Path(j.stem), records[j.index]) for j in jobs], dtype)
    seconds = time.perf_counter() - t0
    manifest["build"] = {"seconds": round(seconds, 3), "tokenize_seconds": round(tokenize_s, 3),
                         "text_bytes": manifest["split"]["train"]["bytes"] + manifest["split"]["val"]["bytes"],
                         "workers": used_workers, "pieces": len(jobs), "pieces_reused": len(jobs) - len(todo)}
    commit_manifest(path / MANIFEST, manifest)
    shutil.rmtree(pieces_dir, ignore_errors=True)  # the builder's own scratch, named by it
    b = manifest["build"]
    report("token store %s: %s of text -> %s tokens in %.1f s (%.1f MB/s, %d workers)", path,
           format_bytes(b["text_bytes"]), f"{manifest['split']['train']['tokens'] + manifest['split']['val']['tokens']:,}",
           seconds, b["text_bytes"] / max(seconds, 1e-9) / 1e6, used_workers)
    return map_store(path, manifest)


def _jobs(plan: Plan, fingerprint: str, dtype: np.dtype, pieces_dir: Path, piece_bytes: int) -> list[_Job]:
    """The corpus's pieces, each keyed by what its tokens depend on (the store's format, the
    tokenizer, its units and their files' sizes and times): a piece left by an interrupted build
    is reused only when its key is this one."""
    files = {f.path: f for f in plan.sources.files}
    jobs = []
    for i, units in enumerate(plan.pieces(piece_bytes)):
        spec = [FORMAT, VERSION, fingerprint, dtype.name, plan.kind, [list(u) for u in units],
                sorted({(files[u.path].size, files[u.path].mtime_ns, u.path) for u in units})]
        key = hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16]
        jobs.append(_Job(i, units, plan.sources.root, str(pieces_dir / f"{i:06d}-{key}"), plan.kind, dtype.name, key))
    return jobs


def _tokenize_pieces(todo: list[_Job], tokenizer: Tokenizer, workers: int, records: dict[int, dict[str, Any]],
                     meter: _Progress, path: Path) -> int:
    """Tokenize the pieces of `todo` into `records` (in this process, or in a pool); the number
    of workers used. A failed piece stops the build with its error once the running ones end."""
    try:
        with _pool(workers, tokenizer, tasks=len(todo)) as pool:
            if pool is None:
                for job in todo:
                    records[job.index] = _tokenize_piece(job, tokenizer)
                    meter.update(job.nbytes)
                return 1
            running = {pool.submit(_tokenize_piece, job): job for job in todo}
            failed: dict[int, BaseException] = {}
            while running:
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in done:
                    job = running.pop(fut)
                    try:
                        records[job.index] = fut.result()
                        meter.update(job.nbytes)
                    except Exception as e:  # noqa: BLE001 -- raised below, the first in corpus order
                        failed[job.index] = e
                if failed:  # the pieces not started are dropped, the running ones finish
                    running = {f: j for f, j in running.items() if not f.cancel()}
            if failed:  # pieces start in order: the error a one-process build would have met first
                raise failed[min(failed)]
            return min(workers or _cpus(), len(todo))
    except BrokenProcessPool:
        raise NanoChatError(f"token store {path}: a tokenizing worker died (out of memory? each holds one "
                            "document and its tokens at a time); the pieces done are kept: run again to "
                            "continue, with fewer workers if memory is short") from None


def _finished_piece(job: _Job) -> dict[str, Any] | None:
    """The record of a piece an earlier build completed, if its files are all there."""
    try:
        rec = json.loads(Path(job.stem + ".json").read_text(encoding="utf-8"))
        if rec.get("key") != job.key:
            return None
        for suffix, size in rec["files"].items():
            if Path(job.stem + suffix).stat().st_size != size:
                return None
        return rec
    except (OSError, ValueError, KeyError, AttributeError):
        return None


def _tokenize_piece(job: _Job, tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """A worker's task: the piece's documents tokenized into its files, then its record."""
    tokenizer = tokenizer if tokenizer is not None else _worker_tokenizer
    dtype = np.dtype(job.dtype)
    records = job.kind == "instruct"
    out = {".tokens": AtomicFile(job.stem + ".tokens")}
    if records:
        out[".mask"] = AtomicFile(job.stem + ".mask")
        out[".records.jsonl"] = AtomicFile(job.stem + ".records.jsonl")
    starts, nbytes, hashes, roles = array("q"), array("q"), array("d"), array("b")
    skipped: Counter = Counter()
    shapes: Counter = Counter()
    pos = 0
    try:
        for unit in job.units:
            for doc in read_unit(job.root, unit, skipped):
                if records:
                    try:
                        ids, mask = instruct.render(tokenizer, doc.messages)
                    except ValueError as e:  # e.g. a chat template that is not prefix-stable, or raises
                        raise DataError(f"{doc.id}: {e}") from None
                    out[".mask"].write(np.asarray(mask, dtype=np.uint8).tobytes())
                    out[".records.jsonl"].write((json.dumps(doc.messages, ensure_ascii=False) + "\n").encode())
                    shapes[doc.shape] += 1
                else:
                    ids = tokenizer.encode(doc.text, prepend_bos=True)
                out[".tokens"].write(np.asarray(ids, dtype=dtype).tobytes())
                starts.append(pos)
                pos += len(ids)
                nbytes.append(len(doc.text.encode("utf-8")))
                hashes.append(val_hash(doc.id))
                roles.append(ROLE_CODE[unit.role])
    except BaseException:
        for w in out.values():
            w.discard()
        raise
    files = {suffix: w.commit()["bytes"] for suffix, w in out.items()}
    table = io.BytesIO()  # one entry per document: a few MB for the smallest documents
    np.savez(table, starts=np.frombuffer(starts, np.int64), nbytes=np.frombuffer(nbytes, np.int64),
             hash=np.frombuffer(hashes, np.float64), role=np.frombuffer(roles, np.int8))
    docs = AtomicFile(job.stem + ".docs.npz")
    docs.write(table.getbuffer())
    files[".docs.npz"] = docs.commit()["bytes"]
    rec = {"key": job.key, "index": job.index, "tokens": pos, "docs": len(starts), "files": files,
           "skipped": dict(skipped), "shapes": dict(shapes)}
    write_atomic(job.stem + ".json", json.dumps(rec))
    return rec


class _Progress:
    """The build's progress in MB/s of text with an ETA: a tqdm bar on a terminal, otherwise a
    log line every 30 s (a batch job's log)."""

    def __init__(self, total: int, done: int, enabled: bool) -> None:
        self.total, self.done, self.start_done = total, done, done
        self.t0 = self.last = time.perf_counter()
        self.bar = None
        self.log = enabled and not sys.stderr.isatty()
        if enabled and sys.stderr.isatty():
            self.bar = tqdm(total=total, initial=done, unit="B", unit_scale=True, desc="token store",
                            dynamic_ncols=True, leave=False)

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        now = time.perf_counter()
        if self.log and (now - self.last >= 30 or self.done == self.total):
            self.last = now
            rate = (self.done - self.start_done) / max(now - self.t0, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            report("token store: %s of %s (%.0f%%), %.1f MB/s, %s left", format_bytes(self.done),
                        format_bytes(self.total), 100 * self.done / max(self.total, 1), rate / 1e6,
                        f"{eta / 60:.1f} min" if eta != float("inf") else "?")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


__all__ = ["build_store", "load_plan", "locked", "report"]
