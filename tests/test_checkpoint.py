"""Verified atomic .pt checkpoints (nanochat.checkpoint.pt, store and state), checked against the
tensors that were saved:

- what is saved loads with plain `torch.load(weights_only=True)` and equals the saved tensors;
- a save interrupted midway leaves the previous checkpoint loadable and no temporary file;
- only the newest `keep` checkpoints remain; a truncated, zeroed or foreign file is refused
  naming the flags of the command that failed;
- leftovers of a killed save under its own temporary names are removed, a save killed between
  its two renames is completed (the reference: the bytes it wrote), and what nanochat cannot
  prove it wrote (a .pt without a manifest, another program's temporary file) is left byte for
  byte and reported; a .pt without a manifest newer than the newest checkpoint is refused;
- a pickle payload and a checkpoint lacking keys are one-line errors naming the reason; a
  NaN in a weight or a moment is named by `nonfinite_tensors` and skipped by
  `newest_verified(finite=True)`;
- a write failing with ENOSPC raises a clear error and leaves the previous checkpoint intact.
A flipped byte and a checkpoint under another step's name are tests/test_checkpoint_store.py's
(on both storages, with load_checkpoint's messages for .pt).

Modules: nanochat.checkpoint.pt, nanochat.checkpoint.nonfinite (the non-finite check), nanochat.device (RNG states).
"""

import errno
import json
import os

import pytest
import torch

from nanochat import checkpoint
from nanochat.checkpoint import (
    clean_interrupted, committed, load_checkpoint, newest_verified, pt, save_checkpoint,
)
from nanochat.common import NanoChatError, UsageError
from nanochat.device import rng_state, set_rng_state
from nanochat.fs import AtomicFile, hash_file
from nanochat.rundir import LOCK_NAME


def _files(d) -> list[str]:
    """The directory's files, without the run lock's file (saves take the lock)."""
    return sorted(n for n in os.listdir(d) if n != LOCK_NAME)


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

    monkeypatch.setattr(pt.torch, "save", half_write)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, {"model": {"w": torch.zeros(8)}, "step": 2})
    monkeypatch.setattr(pt.torch, "save", real_save)
    loaded = load_checkpoint(tmp_path)
    assert loaded["step"] == 1 and torch.equal(loaded["model"]["w"], torch.ones(8))
    assert _files(tmp_path) == ["checkpoint-000001.json", "checkpoint-000001.pt"]


def test_keeps_the_newest_k(tmp_path):
    for step in range(1, 5):
        save_checkpoint(tmp_path, {"model": {"w": torch.full((4,), float(step))}, "step": step}, keep=2)
    assert [c.step for c in committed(tmp_path)] == [3, 4]
    assert len(_files(tmp_path)) == 4  # two .pt and two manifests, nothing else


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
    with pytest.raises(NanoChatError, match=r"--resume: checkpoint .*checkpoint-000003\.pt is not usable.*--overwrite"):
        load_checkpoint(tmp_path, flag="--resume")  # the fix names the flags of the command that failed


def test_killed_save_leftovers_ours_removed_others_kept(tmp_path):
    save_checkpoint(tmp_path, {"model": {"w": torch.ones(2)}, "step": 1})
    ours = tmp_path / ".checkpoint-000002.pt.tmp-4242-0badc0de"  # a save killed mid-write
    ours.write_bytes(b"x" * 100)
    foreign = {".checkpoint-000002.pt.abc.tmp": b"y" * 100,  # not a name this nanochat's saves write
               "checkpoint-000003.pt": b"z" * 100}           # a .pt without its manifest
    for name, data in foreign.items():
        (tmp_path / name).write_bytes(data)
    notes = clean_interrupted(tmp_path)
    assert not ours.exists()
    assert {n: (tmp_path / n).read_bytes() for n in foreign} == foreign  # byte for byte
    assert len(notes) == 3 and all(str(tmp_path) in n for n in notes), notes
    assert "removed" in notes[0] and all("left" in n and "alone" in n for n in notes[1:]), notes
    with pytest.raises(UsageError, match=r"newest checkpoint .*checkpoint-000003\.pt has no manifest.*restore its "
                                         r"manifest.*continue from step 1"):
        load_checkpoint(tmp_path)  # never silently the older one
    assert committed(tmp_path)[-1].step == 1 and load_checkpoint(tmp_path / "checkpoint-000001.pt")["step"] == 1


def test_save_killed_between_its_renames_is_completed(tmp_path):
    """A save killed after the .pt's rename, before its manifest's (the commit), leaves the .pt in
    place and the manifest under its temporary name: the clean-up commits it when the manifest
    matches the bytes, and otherwise removes only the temporary (tests/test_faults.py kills a
    real run at that instant)."""
    for step in (1, 2):
        save_checkpoint(tmp_path, {"model": {"w": torch.full((4,), float(step))}, "step": step})
    pending = tmp_path / ".checkpoint-000002.json.tmp-4242-0badc0de"
    os.replace(tmp_path / "checkpoint-000002.json", pending)
    notes = clean_interrupted(tmp_path)
    assert len(notes) == 1 and "completed the save" in notes[0], notes
    assert torch.equal(load_checkpoint(tmp_path)["model"]["w"], torch.full((4,), 2.0))

    os.replace(tmp_path / "checkpoint-000002.json", pending)
    (tmp_path / "checkpoint-000002.pt").write_bytes(b"not what the manifest hashed")
    notes = clean_interrupted(tmp_path)
    assert not pending.exists() and (tmp_path / "checkpoint-000002.pt").exists(), notes
    assert committed(tmp_path)[-1].step == 1


class _Payload:  # any class: unpickling it would run code of the file's choosing
    pass


def test_pickle_payload_and_missing_keys_are_one_line(tmp_path):
    save_checkpoint(tmp_path, {"model": {"w": torch.ones(2)}, "step": 1})  # no config: not a training one
    with pytest.raises(NanoChatError, match=r"lacks 'config', 'optimizer'") as e:
        load_checkpoint(tmp_path, keys=("model", "config", "optimizer"))
    assert "\n" not in str(e.value)
    path = tmp_path / "checkpoint-000002.pt"
    torch.save({"format_version": 1, "step": 2, "model": _Payload()}, path)
    # a manifest that verifies: the bytes are what they are
    path.with_suffix(".json").write_text(json.dumps({"file": path.name, **hash_file(path), "step": 2}))
    with pytest.raises(NanoChatError) as e:
        load_checkpoint(tmp_path)
    msg = str(e.value)
    assert "is not a nanochat checkpoint (it needs unpickling of arbitrary objects" in msg, msg
    assert "weights_only=False" not in msg and "\n" not in msg, msg


def test_nonfinite_tensors_are_named_and_skipped(tmp_path):
    from nanochat.optim import FP8Tensor

    moment = FP8Tensor.from_float(torch.randn(256))
    save_checkpoint(tmp_path, {"model": {"w": torch.ones(4)}, "optimizer": {"state": {0: {"exp_avg": moment}}},
                               "step": 1})
    bad_moment = FP8Tensor(moment.codes, moment.scale.clone().fill_(float("inf")), moment.block_size)
    save_checkpoint(tmp_path, {"model": {"w": torch.tensor([1.0, float("nan")])},
                               "optimizer": {"state": {0: {"exp_avg": bad_moment}}}, "step": 2})
    assert checkpoint.nonfinite_tensors(load_checkpoint(tmp_path)) == ["w", "optimizer state 0.exp_avg"]
    assert newest_verified(tmp_path).step == 2  # the bytes verify...
    assert newest_verified(tmp_path, finite=True).step == 1  # ...the values do not


def test_enospc_keeps_previous_and_says_so(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, {"model": {"w": torch.ones(4096)}, "step": 1})
    real_write = AtomicFile.write

    def full_disk(self, data):
        if self.size > 1000:
            self.error = OSError(errno.ENOSPC, "No space left on device")
            raise self.error
        return real_write(self, data)

    monkeypatch.setattr(AtomicFile, "write", full_disk)
    with pytest.raises(NanoChatError, match=r"no space left.*checkpoint-000002\.pt.*checkpoint-000001\.pt is intact"):
        save_checkpoint(tmp_path, {"model": {"w": torch.zeros(4096)}, "step": 2})
    monkeypatch.undo()
    assert _files(tmp_path) == ["checkpoint-000001.json", "checkpoint-000001.pt"]
    assert torch.equal(load_checkpoint(tmp_path)["model"]["w"], torch.ones(4096))


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(UsageError, match=r"--run_dir .*nope holds no checkpoint \(no such directory\); point --run_dir at"):
        load_checkpoint(tmp_path / "nope")


def test_rng_state_restores_the_stream():
    state = rng_state()
    a = torch.rand(5)
    set_rng_state(state)
    assert torch.equal(torch.rand(5), a)
