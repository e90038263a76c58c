"""The checkpoint store (nanochat.checkpoint.store over storage.py's Checkpoint): one policy, the
same on both storages. Each rule runs on .pt checkpoints and on DCP step directories (one
process, no process group), and the reference is what was saved: its steps and its bytes.

- `newest` is the newest committed checkpoint; a newer one without its manifest is refused (it
  names the older one to continue from), reported by `clean_interrupted`, never deleted;
- a flipped byte is refused by `verify` (and for .pt by `load_checkpoint`), naming the file and
  the previous checkpoint that verifies, which `newest_verified` returns;
- a checkpoint copied under another step's name is refused (`load_checkpoint` names the one its
  manifest describes), neither counted nor deleted by rotation, listed by `foreign` and left by
  `remove`, which deletes the others; a .pt whose payload holds another step than its name is
  refused too;
- what a killed save left under its own temporary name is removed, any other name kept byte for
  byte;
- across storages the later step is the newest (a tie: the DCP one).

Modules: nanochat.checkpoint.store, nanochat.checkpoint.storage (Checkpoint, Storage).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from nanochat import checkpoint
from nanochat.checkpoint import DCP, committed, load_checkpoint, newest, newest_verified, save_checkpoint, save_dcp
from nanochat.common import NanoChatError, UsageError


def _model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    return model, opt


def _save(run_dir: Path, kind: str, step: int, keep: int = 5) -> None:
    if kind == "pt":
        save_checkpoint(run_dir, {"model": {"w": torch.full((64,), float(step))}, "step": step}, keep=keep)
    else:
        model, opt = _model_and_optimizer()
        save_dcp(run_dir, model, opt, step=step, meta={}, keep=keep)


def _data_file(c: checkpoint.Checkpoint) -> Path:
    """A file holding the checkpoint's tensors."""
    return c.path if c.kind == "pt" else next(c.path.glob("*.distcp"))


def _plant(c: checkpoint.Checkpoint, step: int) -> Path:
    """A copy of checkpoint `c`, manifest included, under the name of `step`."""
    if c.kind == "pt":
        new = c.path.with_name(f"checkpoint-{step:06d}.pt")
        shutil.copyfile(c.path, new)
        shutil.copyfile(c.manifest, new.with_suffix(".json"))
        return new
    new = c.path.with_name(f"step-{step:06d}")
    shutil.copytree(c.path, new)
    return new


KINDS = ["pt", "dcp"]


@pytest.mark.parametrize("kind", KINDS)
def test_newest_is_committed_and_a_newer_unmanifested_one_is_refused(tmp_path, kind):
    for step in (1, 2):
        _save(tmp_path, kind, step)
    assert newest(tmp_path).step == 2 and newest(tmp_path).kind == kind
    loose = committed(tmp_path)[-1]
    loose.manifest.unlink()
    with pytest.raises(UsageError, match=rf"newest checkpoint {loose.path} has no manifest.*continue from step 1"):
        newest(tmp_path)
    notes = checkpoint.clean_interrupted(tmp_path)
    assert len(notes) == 1 and f"left {loose.path} alone" in notes[0], notes
    checkpoint.remove(tmp_path)
    assert loose.path.exists() and committed(tmp_path) == []  # the unmanifested one is never deleted


@pytest.mark.parametrize("kind", KINDS)
def test_a_flipped_byte_names_the_file_and_the_previous_checkpoint(tmp_path, kind):
    for step in (1, 2):
        _save(tmp_path, kind, step)
    bad = newest(tmp_path)
    data = bytearray(_data_file(bad).read_bytes())
    data[len(data) // 2] ^= 0x01
    _data_file(bad).write_bytes(bytes(data))
    assert "corrupted" in checkpoint.problem(bad)
    with pytest.raises(NanoChatError) as e:
        checkpoint.verify(bad)
    msg = str(e.value)
    assert f"checkpoint {bad.path} is not usable" in msg and "sha256" in msg, msg
    assert "(step 1) verifies" in msg and "run again with --resume to continue from step 1" in msg, msg
    assert newest_verified(tmp_path).step == 1 and newest_verified(tmp_path, before=committed(tmp_path)[0]) is None
    if kind == "pt":  # loading it says the same
        with pytest.raises(NanoChatError, match=r"checkpoint-000002\.pt.*sha256.*checkpoint-000001\.pt \(step 1\) "
                                                r"verifies"):
            load_checkpoint(tmp_path)


@pytest.mark.parametrize("kind", KINDS)
def test_a_planted_checkpoint_is_refused_never_rotated_and_never_removed(tmp_path, kind):
    for step in (1, 2, 3):
        _save(tmp_path, kind, step)
    planted = _plant(committed(tmp_path)[0], 10)
    with pytest.raises(NanoChatError, match=r"renamed or copied under another step's name.*\(step 3\) verifies"):
        checkpoint.verify(newest(tmp_path))
    if kind == "pt":  # loading it names the checkpoint the manifest describes
        with pytest.raises(NanoChatError, match=r"checkpoint-000010\.pt is not usable: its manifest describes "
                                                r"checkpoint-000001\.pt \(step 1\).*"
                                                r"checkpoint-000003\.pt \(step 3\) verifies"):
            load_checkpoint(tmp_path)
    _save(tmp_path, kind, 4, keep=2)
    assert [c.step for c in committed(tmp_path)] == [3, 4, 10]
    assert [f.split(" ")[0] for f in checkpoint.foreign(tmp_path)] == [planted.relative_to(tmp_path).as_posix()]
    checkpoint.remove(tmp_path)
    assert [c.step for c in committed(tmp_path)] == [10] and planted.exists()
    if kind == "pt":  # a manifest that matches, around a payload of another step (saved so on purpose here)
        save_checkpoint(tmp_path, {"model": {"w": torch.zeros(4)}, "step": 1}, step=11, keep=5)
        with pytest.raises(NanoChatError, match=r"holds step 1 under the name of step 11"):
            load_checkpoint(tmp_path)


@pytest.mark.parametrize("kind", KINDS)
def test_a_killed_saves_temporaries_go_other_names_stay(tmp_path, kind):
    _save(tmp_path, kind, 1)
    if kind == "pt":
        ours, other = tmp_path / ".checkpoint-000002.pt.tmp-4242-0badc0de", tmp_path / ".checkpoint-000002.pt.mine"
        ours.write_bytes(b"x" * 10)
    else:
        root = tmp_path / "checkpoint_dcp"
        ours, other = root / ".tmp-step-000002-4242-0badc0de", root / ".tmp-something-else"
        ours.mkdir()
        (ours / "__0_0.distcp").write_bytes(b"x" * 10)
    other.write_bytes(b"keep me")
    notes = checkpoint.clean_interrupted(tmp_path)
    assert not ours.exists() and other.read_bytes() == b"keep me"
    assert len(notes) == 2 and "removed" in notes[0] and f"left {other} alone" in notes[1], notes
    assert [c.step for c in committed(tmp_path)] == [1]


def test_across_storages_the_later_step_is_the_newest(tmp_path):
    _save(tmp_path, "pt", 3)
    _save(tmp_path, "dcp", 2)
    assert (newest(tmp_path).kind, newest(tmp_path).step) == ("pt", 3)
    _save(tmp_path, "dcp", 3)
    assert (newest(tmp_path).kind, newest(tmp_path).step) == ("dcp", 3)  # a tie: DCP
    _save(tmp_path, "dcp", 3)  # the same step saved again: step-000003-2, newer still
    assert newest(tmp_path).path.name == "step-000003-2"
    checkpoint.remove(tmp_path, (DCP,))
    assert [(c.kind, c.step) for c in committed(tmp_path)] == [("pt", 3)]
    assert not (tmp_path / "checkpoint_dcp").exists()  # emptied, LATEST included
