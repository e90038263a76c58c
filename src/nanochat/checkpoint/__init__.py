"""Checkpoints: verified, atomic, loaded without unpickling; one store over two storages.

    storage.py       a checkpoint, and what a storage must answer about its layout
    pt.py            one process: checkpoint-<step>.pt + its .json manifest (torch.save, weights_only)
    dcp.py           torchrun: checkpoint_dcp/step-<step>/, every rank's shards + manifest.json (DCP)
    store.py         the policy, once: newest, verify, newest verified, rotate, remove, clean, foreign
    state.py         RNG states, and the inf/nan check a checkpoint must pass to be saved or resumed
    resume.py        what --resume must share with its checkpoint, what --init_from takes
    checkpointer.py  Checkpointer: the trainer's component (claim, read, restore, save)
    loader.py        load_model: a GPT from a preset, a Hugging Face directory or a run's checkpoint

A checkpoint is data plus a manifest (names, sizes, sha256), and the manifest is the commit: a
save writes the data under temporary names, then the manifest, then renames, so a kill at any
instant leaves the previous checkpoints whole. Loading re-hashes the bytes and refuses a
mismatch, naming the newest older checkpoint that verifies. Nothing is deleted that a manifest
does not prove nanochat wrote. The run directory itself (its lock, what it holds, the claim
rules) is nanochat.rundir's. The alternative rejected: each format with its own newest / verify
/ rotate code, two copies of one policy that can disagree on which checkpoint is the newest or
which may be deleted.

    from nanochat import checkpoint
    c = checkpoint.newest(run_dir)            # the newest committed checkpoint, or None
    checkpoint.verify(c)                      # raises, naming the older one that verifies
    payload = checkpoint.load_checkpoint(run_dir)   # a .pt run's payload, verified
    model, tokenizer = checkpoint.load_model(checkpoint.read_run(run_dir))   # its model, on the CPU
"""

from nanochat.checkpoint.checkpointer import Checkpointer, Saved
from nanochat.checkpoint.dcp import DCP
from nanochat.checkpoint.loader import gpt_config, load_model, read_run
from nanochat.checkpoint.pt import FORMAT_VERSION, PT, checkpoint_name
from nanochat.checkpoint.state import nonfinite_state, nonfinite_tensors, rng_state, set_rng_state
from nanochat.checkpoint.storage import Checkpoint, Storage
from nanochat.checkpoint.store import (
    clean_interrupted, committed, foreign, load_checkpoint, load_dcp, newest, newest_verified, problem, remove,
    save_checkpoint, save_dcp, uncommitted, verify,
)

__all__ = [
    "Checkpoint", "Storage", "PT", "DCP", "FORMAT_VERSION", "checkpoint_name",
    "committed", "uncommitted", "newest", "problem", "verify", "newest_verified", "clean_interrupted", "foreign",
    "remove", "save_checkpoint", "load_checkpoint", "save_dcp", "load_dcp",
    "rng_state", "set_rng_state", "nonfinite_state", "nonfinite_tensors",
    "Checkpointer", "Saved", "gpt_config", "load_model", "read_run",
]
