"""Which model `--model_name` names: a nanochat preset, a local Hugging Face directory, or a hub id
found in the local Hugging Face cache. Nothing is downloaded, ever.

A hub id (`org/name`) is looked up in every cache directory huggingface_hub may use (HF_HUB_CACHE,
HUGGINGFACE_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub), at the revision refs/main names
or else the newest complete snapshot. The cache is read here, without huggingface_hub (not a
dependency; docs/design.md), and its refs and symlinks are checked to stay inside the cache (a
ref or a link that leads elsewhere is an error naming the file). A name that resolves nowhere is
an error listing the presets, the places searched and how to bring the weights onto this machine.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from nanochat.common import UsageError, read_json_object
from nanochat.model.gpt import PRESETS


@dataclass(frozen=True)
class ResolvedModel:
    """What `--model_name` names: a size preset, or a local Hugging Face model directory."""

    kind: Literal["preset", "hf"]
    name: str
    """The name as given."""
    path: Path | None = None
    """The model directory (the snapshot directory for a cached hub id); None for a preset."""


def hf_cache_dirs() -> list[Path]:
    """Hub cache directories to search: every place huggingface_hub may use, in its order of
    precedence (it uses only the first that is set; we search them all, so a cache copied to
    the default place is found even when HF_HOME points elsewhere)."""
    dirs = []
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            dirs.append(Path(os.environ[var]).expanduser())
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]).expanduser() / "hub")
    dirs.append(Path("~/.cache/huggingface/hub").expanduser())
    return list(dict.fromkeys(dirs))


def _find_in_cache(repo_id: str, cache: Path) -> Path | None:
    """The snapshot directory of `repo_id` in one cache: the revision refs/main points to if it
    is complete (has config.json), else the most recently modified snapshot that is.

    refs/main must hold a commit hash (40 hex digits, as huggingface_hub writes it), every
    snapshot must resolve inside the cache's snapshots/ directory and every file of the chosen
    one inside the model's cache folder (huggingface_hub links them to its blobs/): a ref or a
    symlink that leads elsewhere would load files from outside the cache, so it is an error
    naming the file."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / "main"
    chosen = None
    if ref.is_file():
        rev = ref.read_text(encoding="utf-8", errors="replace").strip()
        if not re.fullmatch(r"[0-9a-f]{40}", rev):
            raise UsageError(f"{ref} holds {rev[:60]!r}, not a commit hash (40 hex digits, what "
                             f"huggingface_hub writes); delete {ref} or download {repo_id} again")
        main = _inside(snapshots / rev, snapshots)
        if (main / "config.json").is_file():
            chosen = main
    if chosen is None:
        complete = [_inside(s, snapshots) for s in snapshots.iterdir() if (s / "config.json").is_file()]
        if not complete:
            return None
        chosen = max(complete, key=lambda s: s.stat().st_mtime)
    for entry in chosen.iterdir():
        _inside(entry, repo)
    return chosen


def _inside(path: Path, root: Path) -> Path:
    """`path`, refused unless it stays inside `root` once symlinks and `..` are resolved."""
    real, real_root = path.resolve(), root.resolve()
    if not real.is_relative_to(real_root):
        raise UsageError(f"Hugging Face cache entry {path} resolves to {real}, outside the cache folder "
                         f"{real_root}, and nanochat reads only files inside the cache; remove it and download "
                         "the model again")
    return path


def read_config_json(path: Path) -> dict:
    """A model directory's config.json as a dict; a clear error naming the file otherwise."""
    return read_json_object(Path(path) / "config.json", "restore it from the model's source")


def resolve_model(name: str) -> ResolvedModel:
    """Turn `--model_name` into a preset or a local HF directory, without network access.

    Order: a preset name (d4, ...); an existing directory (must hold config.json); a hub id
    `org/name` found in the local Hugging Face cache. Anything else is a FileNotFoundError that
    lists the presets, the places searched and how to get the weights onto this machine.
    """
    if name in PRESETS:
        return ResolvedModel("preset", name)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path} is a directory but not a Hugging Face model: config.json is missing (a model "
                "directory holds config.json, *.safetensors and tokenizer.json)"
            )
        return ResolvedModel("hf", name, path)
    searched = hf_cache_dirs()
    if re.fullmatch(r"[\w.\-]+/[\w.\-]+", name):
        for cache in searched:
            snapshot = _find_in_cache(name, cache)
            if snapshot is not None:
                return ResolvedModel("hf", name, snapshot)
    folder = "models--" + name.replace("/", "--")
    raise FileNotFoundError(
        f"model {name!r} not found. It is not a preset ({', '.join(PRESETS)}), not a local "
        f"directory, and not in the local Hugging Face cache; searched: "
        f"{', '.join(str(d / folder) for d in searched)}. Nothing is downloaded. To use a hub "
        f"model, on a machine with network run `huggingface-cli download {name}` (or "
        f"`hf download {name}`), then copy its cache folder {folder} into one of the "
        "directories above (or point HF_HUB_CACHE at where you put it); or pass the path of a "
        "directory holding config.json, *.safetensors and tokenizer.json."
    )
