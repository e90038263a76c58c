"""Atomic checkpoints: what is saved loads with weights_only=True, and a save interrupted midway
leaves the previous checkpoint loadable (reference: the previous checkpoint's own tensors)."""

import os

import pytest
import torch

from nanochat import checkpoint
from nanochat.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state


def test_round_trip_weights_only(tmp_path):
    payload = {"model": {"w": torch.randn(3, 4)}, "config": {"a": 1, "b": [1, 2]}, "step": 5,
               "rng": rng_state(), "data": {"epoch": 0, "position": 3}}
    save_checkpoint(tmp_path, payload)
    # plain torch.load with weights_only=True must accept the file as is
    raw = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert torch.equal(raw["model"]["w"], payload["model"]["w"])
    loaded = load_checkpoint(tmp_path)
    assert loaded["step"] == 5 and loaded["config"] == {"a": 1, "b": [1, 2]}


def test_interrupted_save_keeps_previous(tmp_path, monkeypatch):
    first = {"model": {"w": torch.ones(8)}, "step": 1}
    save_checkpoint(tmp_path, first)
    real_save = torch.save

    def half_write(obj, f, *a, **k):
        f.write(b"PK\x03\x04 partial")  # some bytes reach the temp file, then the process "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.torch, "save", half_write)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, {"model": {"w": torch.zeros(8)}, "step": 2})
    monkeypatch.setattr(checkpoint.torch, "save", real_save)
    loaded = load_checkpoint(tmp_path)
    assert loaded["step"] == 1 and torch.equal(loaded["model"]["w"], torch.ones(8))
    assert os.listdir(tmp_path) == ["checkpoint.pt"]  # no temp file left behind


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="without --resume"):
        load_checkpoint(tmp_path / "nope")


def test_rng_state_restores_the_stream():
    state = rng_state()
    a = torch.rand(5)
    set_rng_state(state)
    assert torch.equal(torch.rand(5), a)
