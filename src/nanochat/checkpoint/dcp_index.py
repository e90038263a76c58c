"""A DCP checkpoint's index (`.metadata`) read without running what it names.

DCP keeps its index as a pickle and torch reads it with plain `pickle.load`, which runs whatever
code the file names; the shards themselves load with `weights_only`. `read_index` unpickles it
admitting only the classes a DCP index is made of (`_INDEX_GLOBALS`), so a crafted `.metadata`
is refused in one line before it can run anything; `SafeReader` is DCP's file reader with its
index read that way, which every load in dcp.py goes through.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo

from nanochat.common import NanoChatError

# What a DCP index holds, found by recording the globals of indexes dcp.py writes: its
# dataclasses and enums, _StorageInfo (where each chunk lies), torch.Size, dtypes, layouts
# (rebuilt by torch.serialization._get_layout from their names) and the checkpoint_id path.
_INDEX_GLOBALS = {
    **{(dcp_metadata.__name__, n): c for n, c in vars(dcp_metadata).items()
       if isinstance(c, type) and c.__module__ == dcp_metadata.__name__},
    (_StorageInfo.__module__, _StorageInfo.__name__): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    **{("pathlib", c.__name__): c for c in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath,
                                            pathlib.PureWindowsPath)},
    **{("torch", n): d for n, d in vars(torch).items() if isinstance(d, torch.dtype)},
}


class _Refused(pickle.UnpicklingError):
    """A global outside `_INDEX_GLOBALS`; its message is the global's dotted name."""


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _INDEX_GLOBALS.get((module, name))
        if found is None:
            raise _Refused(f"{module}.{name}")
        return found


def read_index(path: str | os.PathLike) -> dcp_metadata.Metadata:
    """The DCP index (`.metadata`) of step directory `path`, unpickled with only the classes an
    index is made of; anything else (a payload that would run code) is refused in one line."""
    index = Path(path) / ".metadata"
    fix = f"move {Path(path)} away and resume from a checkpoint this run saved"
    try:
        data = index.read_bytes()
    except OSError as e:
        raise NanoChatError(f"{index}: cannot be read ({e.strerror or e}); {fix}") from None
    try:
        md = _IndexUnpickler(io.BytesIO(data)).load()
    except _Refused as e:
        raise NanoChatError(f"{index}: refused, it names {e}, which a DCP index never holds (a pickle made to "
                            f"run code when read); {fix}") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, IndexError) as e:
        raise NanoChatError(f"{index}: not a DCP index ({type(e).__name__}: {e}); {fix}") from None
    if not isinstance(md, dcp_metadata.Metadata):
        raise NanoChatError(f"{index}: refused, it holds a {type(md).__name__}, not a DCP index; {fix}")
    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = dcp_metadata.StorageMeta()
    return md


class SafeReader(FileSystemReader):
    """DCP's file reader with the index read by `read_index` instead of plain pickle.load."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None:
            raise NanoChatError(f"{self.path}: per-rank DCP indexes are not written by nanochat; resume from a "
                                "checkpoint nanochat saved")
        md = read_index(self.path)
        md.storage_meta.load_id = self.load_id
        return md


__all__ = ["SafeReader", "read_index"]
