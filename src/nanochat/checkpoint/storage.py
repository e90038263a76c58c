"""One checkpoint of a run directory, and the questions a storage of checkpoints must answer.

A run keeps its checkpoints in one of two storages: a `.pt` file of one process (pt.py) or a DCP
step directory that every rank of a torchrun run writes into (dcp.py). Either way a checkpoint
is data plus a manifest, and the manifest is the commit: written last, it says which bytes make
the checkpoint (names, sizes, sha256). What to do with that is the same for both and is written
once, in store.py: which checkpoint is the newest, whether it verifies, which older one does,
which to keep, which may be deleted, what a killed save left behind. A storage answers only the
questions that depend on its layout: the methods below.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of `run_dir`, committed (its manifest is there) or not."""

    storage: Storage
    run_dir: Path
    path: Path
    """The .pt file, or the DCP step directory."""
    step: int
    resave: int = 1
    """DCP: `step-000200-2` is the second save of step 200 (a resumed run saved that step again)."""

    @property
    def kind(self) -> str:
        return self.storage.kind

    @property
    def manifest(self) -> Path:
        return self.storage.manifest_of(self.path)

    @property
    def committed(self) -> bool:
        return self.manifest.is_file()

    @property
    def order(self) -> tuple[int, int, int]:
        """Oldest first; the same step in both storages (only after a crash between writing one
        and deleting the other) counts the DCP one as the newer."""
        return self.step, self.resave, self.storage.tie_rank

    @property
    def name(self) -> str:
        """Its path inside the run directory, for lists in messages."""
        return self.path.relative_to(self.run_dir).as_posix()


class Storage:
    """How checkpoints of one kind lie on disk. Subclasses: pt.PtStorage, dcp.DcpStorage."""

    kind: str
    tie_rank: int

    def scan(self, run_dir: Path) -> list[Checkpoint]:
        """Every checkpoint of `run_dir` by its name, with or without a manifest, oldest first."""
        raise NotImplementedError

    def manifest_of(self, path: Path) -> Path:
        raise NotImplementedError

    def manifest_problem(self, c: Checkpoint) -> str | None:
        """None when `c`'s manifest describes it (its step, its files and their sizes), else why
        not. Cheap (no data is read): what deleting a checkpoint requires."""
        raise NotImplementedError

    def bytes_problem(self, c: Checkpoint) -> str | None:
        """None when the bytes of `c`, whose manifest describes it, hash as the manifest says.
        Reads every byte."""
        raise NotImplementedError

    def temporaries(self, run_dir: Path) -> tuple[list[Path], list[Path]]:
        """(what saves of this nanochat leave under their temporary names, other names that look
        like temporaries): the first may be finished or removed under the run lock, never the second."""
        raise NotImplementedError

    def finish(self, temporary: Path) -> str:
        """Complete or remove one of our temporaries (the run lock is held); a line for the log."""
        raise NotImplementedError

    def read(self, c: Checkpoint, keys: tuple[str, ...]) -> tuple[dict[str, Any] | None, str | None]:
        """(what `c` holds besides the tensors it loads lazily, None) or (None, why it is not a
        nanochat checkpoint holding `keys`): its format, its step, its keys. No verification."""
        raise NotImplementedError

    def nonfinite(self, c: Checkpoint) -> list[str] | None:
        """The tensors of `c` holding inf/nan, read in this process; None when it does not load."""
        raise NotImplementedError

    def files_of(self, c: Checkpoint) -> str:
        """What a person deletes or moves to discard `c`, in words."""
        raise NotImplementedError

    def tidy(self, run_dir: Path) -> None:
        """After deleting checkpoints: remove what only served them, once nothing else is left."""


__all__ = ["Checkpoint", "Storage"]
