"""Corpus sources: the files --dataset_path names, listed with their roles; DataError.

`list_sources(path)` finds every regular file under the path with a supported extension and
records its relative path, size and modification time: one stat per file, which is all a start-up
reads of a corpus whose token store (nanochat.data.token_store) exists. Files are sorted by relative
path, so the corpus is the same on every machine; links to files and folders are followed, a
folder reached twice read once. Anything else is counted in `skipped`: other extensions, hidden
entries, and special files (a FIFO would block the first read forever).
Without a path the corpus is this Python's standard library, its test suites left out.

A directory laid out in split files, as the hub's datasets are (`train-*`, `validation-*`,
`test-*`), gives each file its role: train files train, validation files evaluate, test files are
never read. Otherwise every role is "" and each document is split by its id's hash
(nanochat.data.split).

The listing is the corpus's identity: `Sources.fingerprint` keys the tokenizer cache and
`Sources.changes` names the file that changed since a store or a run recorded it: a stat says a
file changed, so start-up does not grow with the corpus (alternatives: docs/design.md). Every
problem is a `DataError` naming the file and the fix.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import sys
import sysconfig
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

TEXT_EXTENSIONS = (".txt", ".md", ".py")
SUPPORTED_EXTENSIONS = (*TEXT_EXTENSIONS, ".jsonl", ".parquet")
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})

# Why a file or document is left out: the keys of `skipped`, the listing's and the readers'
# (nanochat.data.read).
BINARY = "binary (NUL bytes or not UTF-8)"
EMPTY = "empty"
SPECIAL = "not a regular file (FIFO, socket, device or broken link)"
TEST_SPLIT = "test split (never trained on)"
NOT_SPLIT = "not a split file (train*, validation*, test*)"
REACHED_TWICE = "folder reached twice through links (read once)"

Role = Literal["train", "validation", ""]
"""A file's split: a train or validation split file, or "" (each document split by its id's hash)."""


class DataError(ValueError):
    """The corpus cannot be used as given; the message names the problem and the fix."""


@dataclass(frozen=True)
class SourceFile:
    path: str
    """Relative to Sources.root, with forward slashes: the id of its documents."""
    size: int
    mtime_ns: int
    role: Role


@dataclass(frozen=True)
class Sources:
    """The files of a corpus, as one stat each found them."""

    name: str
    source: str
    """What was given (a path, or the standard library with its filter), for messages."""
    root: str
    """The directory the file paths are relative to (absolute)."""
    files: tuple[SourceFile, ...]
    skipped: dict[str, int] = field(default_factory=dict)
    """Reason -> count of files left out by the listing (extension, split layout, special files)."""
    split_layout: bool = False
    """The directory is laid out in train / validation split files."""
    target: str = ""
    """The real path of what was given (the corpus's identity: its token stores are kept by it)."""

    def listing(self) -> dict[str, Any]:
        """The listing as JSON: what a token store and a run record of the data they read."""
        return {"source": self.source, "root": self.root,
                "files": [[f.path, f.size, f.mtime_ns, f.role] for f in self.files]}

    @property
    def fingerprint(self) -> str:
        """16 hex digits of sha256 over the listing: changes when any file is added, removed,
        resized or modified (not when only the name of the corpus changes)."""
        files = self.listing()["files"]
        return hashlib.sha256(json.dumps([self.root, files]).encode()).hexdigest()[:16]

    def changes(self, listing: dict[str, Any]) -> list[str]:
        """How these files differ from a recorded `listing`: "x added", "y removed", "z changed
        (size a -> b bytes)" / "(modified <time> -> <time>)"; empty when they are the same."""
        old = {p: (size, mtime, role) for p, size, mtime, role in listing.get("files", [])}
        new = {f.path: (f.size, f.mtime_ns, f.role) for f in self.files}
        out = []
        for path in sorted(old.keys() | new.keys()):
            a, b = old.get(path), new.get(path)
            if a == b:
                continue
            if a is None:
                out.append(f"{path} was added")
            elif b is None:
                out.append(f"{path} was removed")
            elif a[0] != b[0]:
                out.append(f"{path} changed (size {a[0]:,} -> {b[0]:,} bytes)")
            elif a[1] != b[1]:
                out.append(f"{path} changed (modified {_time(a[1])} -> {_time(b[1])})")
            else:
                out.append(f"{path} changed split ({a[2] or 'hash'} -> {b[2] or 'hash'})")
        if not out and listing.get("root") != self.root:
            out.append(f"the corpus moved ({listing.get('root')} -> {self.root})")
        return out


def named_changes(changes: list[str], limit: int) -> str:
    """`changes` joined for a message: the first `limit` named, then a count of the rest."""
    more = f"; and {len(changes) - limit} more" if len(changes) > limit else ""
    return "; ".join(changes[:limit]) + more


def _time(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


def list_sources(dataset_path: str | os.PathLike | None = None, *,
                 exclude: Iterable[str | os.PathLike] = (), run_dir: str | os.PathLike | None = None) -> Sources:
    """The files of the built-in stdlib corpus (None) or of `dataset_path`; `exclude`: directories
    never read as data (nanochat's own cache when it lies inside the corpus); `run_dir`: the run's
    directory, refused where a link inside the corpus leads to it (its metrics and checkpoints
    would become training data)."""
    skipped: Counter[str] = Counter()
    excluded = {os.path.realpath(p) for p in exclude}
    if dataset_path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        name = f"python{sys.version_info.major}.{sys.version_info.minor}-stdlib"
        found = [(p, st) for p, st in _walk(root, skipped, STDLIB_EXCLUDED_DIRS, excluded) if p.suffix == ".py"]
        if not found:
            raise DataError(f"this Python's standard library at {root} has no .py sources (a zipped "
                            "or stripped install?); pass --dataset_path with your own text")
        return Sources(name, f"{root}, *.py without tests", str(root.resolve()),
                       tuple(_source_file(root, p, st, "") for p, st in found), {}, target=str(root.resolve()))
    path = Path(dataset_path)
    name, source = path.name or str(path), str(path)
    if not path.exists():
        raise DataError(f"--dataset_path {path} does not exist; pass a text file or a directory "
                        f"of {', '.join(SUPPORTED_EXTENSIONS)} files, or omit it to use the "
                        "built-in Python standard-library corpus")
    if not path.is_dir():
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):  # first: renaming a device to .txt would not help
            raise DataError(f"--dataset_path {path} is not a regular file (a FIFO, socket or device, which "
                            "cannot be read as a corpus); pass a file or a directory of files")
        if path.suffix.lower() not in SUPPORTED_EXTENSIONS:
            raise DataError(f"--dataset_path {path}: extension {path.suffix or '(none)'!r} is not "
                            f"supported; supported: {', '.join(SUPPORTED_EXTENSIONS)} (rename a "
                            "plain-text file to .txt)")
        return Sources(name, source, str(path.parent.resolve()), (_source_file(path.parent, path, st, ""),), {},
                       target=os.path.realpath(path))
    found = _walk(path, skipped, (), excluded, run_dir)
    files = [(p, st) for p, st in found if p.suffix.lower() in SUPPORTED_EXTENSIONS]
    if not files:
        exts = Counter(p.suffix.lower() or "(no extension)" for p, _ in found)
        listing = ", ".join(f"{e} ({n})" for e, n in sorted(exts.items())) or "no files at all"
        raise DataError(f"--dataset_path {path} has no readable text files: found {listing}; "
                        f"supported: {', '.join(SUPPORTED_EXTENSIONS)}")
    for p, _ in found:
        if p.suffix.lower() not in SUPPORTED_EXTENSIONS:
            skipped[f"other extension ({p.suffix.lower() or 'none'})"] += 1
    roles = _split_roles(path, [p for p, _ in files], skipped)
    kept = [_source_file(path, p, st, roles[p] if roles else "") for p, st in files if not roles or p in roles]
    return Sources(name, source, str(path.resolve()), tuple(kept), dict(sorted(skipped.items())),
                   split_layout=roles is not None, target=os.path.realpath(path))


def _source_file(root: Path, p: Path, st: os.stat_result, role: Role) -> SourceFile:
    return SourceFile(p.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns, role)


def _walk(root: Path, skipped: Counter, excluded_names: Iterable[str], excluded_paths: set[str],
          run_dir: str | os.PathLike | None = None) -> list[tuple[Path, os.stat_result]]:
    """Every regular file under `root` with its stat, sorted by relative path. Links are
    followed, to files and to folders (a corpus assembled from shards kept elsewhere); a folder
    reached a second time, through a loop or a second link, is read once (at its first path in
    sorted order) and counted in `skipped`. Hidden entries (.git, .DS_Store: never training text)
    and __pycache__ are skipped silently, as are directories named in `excluded_names` or whose
    real path is in `excluded_paths`; special files (FIFOs, sockets, devices, broken links) are
    counted in `skipped`: opening a FIFO to read it would wait for a writer forever. A folder
    that is `run_dir` or holds it is refused (`_refuse_run_dir`)."""
    names = set(excluded_names) | {"__pycache__"}
    run_real = os.path.realpath(run_dir) if run_dir is not None else None
    seen = {os.path.realpath(root)}
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        kept = []
        for d in sorted(dirnames):  # sorted: which path of a folder reached twice is read is fixed
            real = os.path.realpath(os.path.join(dirpath, d))
            if d.startswith(".") or d in names or real in excluded_paths:
                continue
            if run_real is not None and (real == run_real or run_real.startswith(real + os.sep)):
                _refuse_run_dir(root, Path(dirpath, d), real, run_dir)
            if real in seen:
                skipped[REACHED_TWICE] += 1
                continue
            seen.add(real)
            kept.append(d)
        dirnames[:] = kept
        for f in filenames:
            if f.startswith("."):
                continue
            p = Path(dirpath, f)
            try:
                st = p.stat()  # follows a link to the file it names
            except OSError:
                st = None
            if st is None or not stat.S_ISREG(st.st_mode):
                skipped[SPECIAL] += 1
                continue
            out.append((p, st))
    return sorted(out, key=lambda e: e[0].relative_to(root).as_posix())


def _refuse_run_dir(root: Path, folder: Path, real: str, run_dir: str | os.PathLike) -> None:
    """A DataError: reading `folder` of the corpus would read the run's own directory."""
    link = next((p for p in (folder, *folder.parents) if p != root and root in p.parents and os.path.islink(p)), None)
    via = f" through the link {link} (to {os.readlink(link)})" if link is not None else ""
    raise DataError(f"--dataset_path {root}: {folder}{via} leads to {real}, which is or holds --run_dir {run_dir}: "
                    "the run's own files (metrics.jsonl, checkpoints) would become training data; choose a "
                    "--run_dir outside the corpus, or remove the link")


_SPLIT_NAME = re.compile(r"^(train|validation|valid|val|dev|test)(?=$|[-_.])", re.IGNORECASE)


def _split_roles(root: Path, files: list[Path], skipped: Counter) -> dict[Path, Role] | None:
    """The role of each file kept when the directory is laid out in splits, as the hub's datasets
    are (`ARC-Challenge/train-00000-of-00001.parquet`, `validation-*`, `test-*`, or
    `train.jsonl`...): a file whose name starts with train / validation (valid, val, dev) / test
    followed by `-`, `_`, `.` or nothing. Test files are never read; other files (a README) are
    skipped. Without validation files the train files are split by hash (role ""). None when no
    file is so named: the hash split applies to every file."""
    kinds = {p: m.group(1).lower() if (m := _SPLIT_NAME.match(p.name)) else None for p in files}
    if not any(k is not None for k in kinds.values()):
        return None
    train = [p for p, k in kinds.items() if k == "train"]
    val = [p for p, k in kinds.items() if k in ("validation", "valid", "val", "dev")]
    for reason, n in ((TEST_SPLIT, sum(k == "test" for k in kinds.values())),
                      (NOT_SPLIT, sum(k is None for k in kinds.values()))):
        if n:
            skipped[reason] += n
    if not train:
        raise DataError(f"{root} is laid out in split files but has no train file (found: "
                        f"{', '.join(sorted(p.relative_to(root).as_posix() for p in files))}); name the "
                        "training file(s) train*.jsonl / train-*.parquet, or remove the split names to use "
                        "the hash split. A test split is never trained on")
    roles: dict[Path, Role] = {p: "train" if val else "" for p in train}
    roles.update({p: "validation" for p in val})
    return roles


def unreadable(skipped: dict[str, int]) -> dict[str, int]:
    """The skips that deserve a warning: empty files and other extensions are expected."""
    return {why: n for why, n in skipped.items()
            if why not in (EMPTY, TEST_SPLIT, NOT_SPLIT) and not why.startswith("other")}
