"""Verified atomic checkpoints, checked against the tensors that were saved:

- what is saved loads with plain `torch.load(weights_only=True)` and equals the saved tensors;
- a save interrupted midway leaves the previous checkpoint loadable and no temporary file;
- only the newest `keep` checkpoints remain, and a damaged newest one is refused with a message
  naming it and the older checkpoint that verifies (the damaged bytes are the reference);
- leftovers of a killed save (temporary files, a .pt without its manifest) are removed;
- a write failing with ENOSPC raises a clear error and leaves the previous checkpoint intact.
"""

import errno
import os

import pytest
import torch

from nanochat import checkpoint
from nanochat.checkpoint import (
    clean_interrupted, latest_checkpoint, list_checkpoints, load_checkpoint, rng_state, save_checkpoint,
    set_rng_state,
)
from nanochat.common import NanoChatError, UsageError


def test_round_trip_weights_only(tmp_path):
    payload = {"model": {"w": torch.randn(3, 4)}, "config": {"a": 1, "b": [1, 2]}, "step": 5,
               "rng": rng_state(), "data": {"epoch": 0, "position": 3}}
    path = save_checkpoint(tmp_path, payload)
    assert path.name == "checkpoint-000005.pt"
    # plain torch.load with weights_only=True must accept the file as is
    raw = torch.load(path, weights_only=True)
    assert torch.equal(raw["model"]["w"], payload["model"]["w"])
    loaded = load_checkpoint(tmp_path)
    assert loaded["step"] == 5 and loaded["config"] == {"a": 1, "b": [1, 2]}
    assert load_checkpoint(path)["step"] == 5  # a file path works too (export)


def test_interrupted_save_keeps_previous(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, {"model": {"w": torch.ones(8)}, "step": 1})
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
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-000001.json", "checkpoint-000001.pt"]


def test_keeps_the_newest_k(tmp_path):
    for step in range(1, 5):
        save_checkpoint(tmp_path, {"model": {"w": torch.full((4,), float(step))}, "step": step}, keep=2)
    assert [c.step for c in list_checkpoints(tmp_path)] == [3, 4]
    assert len(os.listdir(tmp_path)) == 4  # two .pt and two manifests, nothing else


def test_flipped_bytes_are_refused_naming_the_good_one(tmp_path):
    for step in (2, 4):
        save_checkpoint(tmp_path, {"model": {"w": torch.randn(256)}, "step": step})
    newest = latest_checkpoint(tmp_path).path
    data = bytearray(newest.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 200):  # 200 flipped bytes mid-file
        data[i] ^= 0xFF
    newest.write_bytes(bytes(data))
    with pytest.raises(NanoChatError, match=r"checkpoint-000004\.pt.*sha256.*checkpoint-000002\.pt \(step 2\) verifies"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "zero", "foreign"])
def test_truncated_zeroed_or_foreign_file_is_refused(tmp_path, damage):
    path = save_checkpoint(tmp_path, {"model": {"w": torch.randn(256)}, "step": 3})
    size = path.stat().st_size
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[: size // 2])
    elif damage == "zero":
        path.write_bytes(bytes(size))
    else:  # someone else's file under our name
        torch.save({"weights": torch.randn(256)}, path)
    with pytest.raises(NanoChatError, match=r"checkpoint-000003\.pt is not usable.*--overwrite"):
        load_checkpoint(tmp_path)


def test_killed_save_leftovers_are_removed(tmp_path):
    save_checkpoint(tmp_path, {"model": {"w": torch.ones(2)}, "step": 1})
    (tmp_path / ".checkpoint-000002.pt.abc.tmp").write_bytes(b"x" * 100)  # killed mid-write
    (tmp_path / "checkpoint-000002.pt").write_bytes(b"y" * 100)           # killed before its manifest
    removed = {p.name for p in clean_interrupted(tmp_path)}
    assert removed == {".checkpoint-000002.pt.abc.tmp", "checkpoint-000002.pt"}
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-000001.json", "checkpoint-000001.pt"]


def test_enospc_keeps_previous_and_says_so(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, {"model": {"w": torch.ones(4096)}, "step": 1})
    real_write = checkpoint._HashingWriter.write

    def full_disk(self, data):
        if self.size > 1000:
            self.error = OSError(errno.ENOSPC, "No space left on device")
            raise self.error
        return real_write(self, data)

    monkeypatch.setattr(checkpoint._HashingWriter, "write", full_disk)
    with pytest.raises(NanoChatError, match=r"no space left.*checkpoint-000002\.pt.*checkpoint-000001\.pt is intact"):
        save_checkpoint(tmp_path, {"model": {"w": torch.zeros(4096)}, "step": 2})
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-000001.json", "checkpoint-000001.pt"]
    assert torch.equal(load_checkpoint(tmp_path)["model"]["w"], torch.ones(4096))


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(UsageError, match="without --resume"):
        load_checkpoint(tmp_path / "nope")


def test_rng_state_restores_the_stream():
    state = rng_state()
    a = torch.rand(5)
    set_rng_state(state)
    assert torch.equal(torch.rand(5), a)
