"""The token store: a corpus tokenized once into files that every run and every rank memory-maps.

A store directory, one per corpus and tokenizer (`$NANOCHAT_CACHE/stores/<corpus>/tokens-<tokenizer>/`):
    train.bin, val.bin            token streams `<|bos|> doc <|bos|> doc ...`, uint16 (vocabulary of at
                                  most 65,536) or uint32, no header: numpy.memmap reads them
    train.docs.bin, val.docs.bin  int64: where each document (record) starts in its stream
    train.mask.bin, val.mask.bin  uint8, instruction records only: 1 where a token is scored
    val.records.jsonl             instruction records only: the validation records (accuracy, samples)
    manifest.json                 committed last (nanochat.fs.commit_manifest): the sources listing
                                  the store was built from, the split, and each file's size and sha256
A store without its manifest is never read. Opening one (`open_store`) costs a stat per source
file (the listing must equal the manifest's), a stat per store file (a wrong size is refused) and a
few maps: start-up and memory do not grow with the corpus, and the ranks of a node share the page
cache. `verify_store` re-reads every byte against the manifest's sha256. The files are read
through nanochat.data.streams; nanochat.data.build makes them. Why this and not Hugging Face
`datasets` or mosaicml-streaming: docs/data.md.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from nanochat.common import format_bytes, warn_once
from nanochat.data.sources import DataError, Sources, named_changes, unreadable
from nanochat.data.split import describe
from nanochat.data.streams import TokenStream
from nanochat.fs import manifest_problems, read_manifest

if TYPE_CHECKING:
    from nanochat.tokenizer import Tokenizer

FORMAT = "nanochat-token-store"
VERSION = 1
MANIFEST = "manifest.json"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


@dataclass
class TokenStore:
    """A built store, open: its manifest and its two streams (memory-mapped)."""

    path: Path
    manifest: dict[str, Any]
    train: TokenStream
    val: TokenStream

    @property
    def kind(self) -> str:
        return self.manifest["kind"]

    @property
    def skipped(self) -> dict[str, int]:
        return self.manifest["skipped"]

    def describe(self) -> str:
        m, s = self.manifest, self.manifest["split"]
        return describe(m["name"], m["source"], kind=m["kind"], docs=(s["train"]["docs"], s["val"]["docs"]),
                        nbytes=(s["train"]["bytes"], s["val"]["bytes"]), split_note=s["note"],
                        skipped=m["skipped"], shapes=m["shapes"])

    def summary(self) -> str:
        """Where the store is and what it holds (the run header)."""
        size = sum(f["bytes"] for f in self.manifest["files"].values())
        b = self.manifest["build"]
        return (f"{self.path} ({format_bytes(size)}, {self.manifest['dtype']}; built in {b['seconds']:.0f} s "
                f"at {b['text_bytes'] / max(b['seconds'], 1e-9) / 1e6:.1f} MB/s of text)")

    def val_records(self) -> Sequence[list[dict[str, str]]]:
        """The validation split's instruction records (chat messages), in order, each read from
        disk when asked for (`JsonLines`); empty for plain text."""
        path = self.path / "val.records.jsonl"
        if self.kind != "instruct" or not path.is_file():
            return ()
        return JsonLines(path)


class JsonLines(Sequence):
    """The records of a JSON-lines file by index, one read from disk at a time: the file is
    scanned once for where each line starts (8 bytes a record), so an evaluation can take records
    from anywhere in a large split without holding it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            lengths = np.fromiter((len(line) for line in f), dtype=np.int64)
        self._starts = np.cumsum(lengths) - lengths  # where each line starts; none for an empty file

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        with open(self.path, "rb") as f:
            f.seek(int(self._starts[index]))
            return json.loads(f.readline())

    def __iter__(self) -> Iterator[Any]:
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)


def store_dir(dataset_dir: Path, tokenizer: Tokenizer) -> Path:
    return dataset_dir / f"tokens-{tokenizer.fingerprint}"


def dataset_dir(cache_root: str | os.PathLike, sources: Sources) -> Path:
    """`<cache_root>/stores/<name>-<12 hex of the corpus's real path>`: the corpus's plan and one
    token store per tokenizer."""
    key = hashlib.sha256(sources.target.encode()).hexdigest()[:12]
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in sources.name)[:40]
    return Path(cache_root) / "stores" / f"{safe}-{key}"


REBUILD_NAMED = 3
"""Changed sources a rebuild's log line names (then a count): the reason, not an inventory."""


def open_store(path: Path, sources: Sources) -> tuple[TokenStore | None, str]:
    """The store at `path` if it is complete and was built from `sources` as they are now:
    (store, ""), else (None, why not). A store file of the wrong size is a DataError: it was
    truncated or replaced after the build, which no rebuild should hide."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return None, ("an interrupted build, continued" if (path / "pieces").is_dir() else "not built yet")
    try:
        m = json.loads(manifest_path.read_text(encoding="utf-8"))
        if m.get("format") != FORMAT or m.get("version") != VERSION:
            return None, f"made by another nanochat (format {m.get('format')} {m.get('version')})"
    except (OSError, ValueError, AttributeError) as e:
        return None, f"its {MANIFEST} does not read ({e})"
    changes = sources.changes(m["sources"])
    if changes:
        return None, "its sources changed: " + named_changes(changes, REBUILD_NAMED)
    return map_store(path, m), ""


def store_changes(path: Path, sources: Sources) -> list[str]:
    """Every change of `sources` since the store at `path` was built (its manifest's listing)."""
    return sources.changes(json.loads((path / MANIFEST).read_text(encoding="utf-8"))["sources"])


def map_store(path: Path, m: dict[str, Any]) -> TokenStore:
    """The store at `path` that its manifest `m` describes, mapped: every file of the size `m`
    records (else a DataError), then its streams."""
    problem = next(manifest_problems(path, m["files"], hash=False), None)
    if problem is not None:
        raise DataError(f"token store {problem}; delete {path} and start again to rebuild it")
    dtype = np.dtype(m["dtype"])

    def array(name: str, dt: np.dtype) -> np.ndarray | None:
        if name not in m["files"]:
            return None
        if m["files"][name]["bytes"] == 0:
            return np.zeros(0, dtype=dt)
        return np.memmap(path / name, dtype=dt, mode="r")

    streams = {split: TokenStream(array(f"{split}.bin", dtype), array(f"{split}.mask.bin", np.dtype(np.uint8)),
                                  docs=array(f"{split}.docs.bin", np.dtype(np.int64)))
               for split in ("train", "val")}
    store = TokenStore(path, m, streams["train"], streams["val"])
    skipped = unreadable(m["skipped"])
    if skipped:
        warn_once(f"data-skipped:{m['source']}", f"{m['source']}: skipped " +
                  ", ".join(f"{n} {why}" for why, n in sorted(skipped.items())))
    return store


def verify_store(path: Path) -> list[str]:
    """What differs between the store's files and the checksums its manifest recorded at build
    time (reads every byte); empty when it verifies."""
    _, files = read_manifest(path / MANIFEST)
    return list(manifest_problems(path, files))


__all__ = ["TokenStore", "dataset_dir", "map_store", "open_store", "store_dir", "token_dtype", "verify_store"]
