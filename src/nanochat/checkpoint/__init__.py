"""Checkpoints: verified, atomic, loaded without unpickling; one store over two storages.

    from nanochat import checkpoint
    c = checkpoint.newest(run_dir)            # the newest committed checkpoint, or None
    checkpoint.verify(c)                      # raises, naming the older one that verifies
    payload = checkpoint.load_checkpoint(run_dir)   # a .pt run's payload, verified
    model, tokenizer = checkpoint.load_model(checkpoint.read_run(run_dir))   # its model, on the CPU

Two storages, one policy: a single process writes `checkpoint-<step>.pt` (torch.save, loaded
with weights_only), torchrun writes a DCP step directory of every rank's shards; newest, verify,
rotate and the cleaning of interrupted saves are written once over both (alternatives:
docs/design.md). `Checkpointer` is the trainer's component; `load_model` builds a GPT from a
preset, a Hugging Face directory or a run's checkpoint.

A checkpoint is data plus a manifest (names, sizes, sha256), and the manifest is the commit: a
save writes the data under temporary names, then the manifest, then renames, so a kill at any
instant leaves the previous checkpoints whole. Loading re-hashes the bytes and refuses a
mismatch, naming the newest older checkpoint that verifies. Nothing is deleted that a manifest
does not prove nanochat wrote. The run directory itself (its lock, what it holds, the claim
rules) is nanochat.rundir's.
"""

from nanochat.checkpoint.checkpointer import Checkpointer, Saved
from nanochat.checkpoint.dcp import DCP
from nanochat.checkpoint.loader import gpt_config, load_model, read_run
from nanochat.checkpoint.pt import FORMAT_VERSION, PT, checkpoint_name
from nanochat.checkpoint.nonfinite import nonfinite_state, nonfinite_tensors
from nanochat.checkpoint.storage import Checkpoint, Storage
from nanochat.checkpoint.store import (
    clean_interrupted, committed, foreign, load_checkpoint, load_dcp, newest, newest_verified, problem, remove,
    save_checkpoint, save_dcp, uncommitted, verify,
)

__all__ = [
    "Checkpoint", "Storage", "PT", "DCP", "FORMAT_VERSION", "checkpoint_name",
    "committed", "uncommitted", "newest", "problem", "verify", "newest_verified", "clean_interrupted", "foreign",
    "remove", "save_checkpoint", "load_checkpoint", "save_dcp", "load_dcp",
    "nonfinite_state", "nonfinite_tensors",
    "Checkpointer", "Saved", "gpt_config", "load_model", "read_run",
]
