"""The run directory (nanochat.rundir): what belongs to a run, the claim rules, the lock. The
references are the files put there and the rule each message states.

- `run_contents` names checkpoints (with or without manifest), the DCP directory and the
  records, in step order, and nothing for a directory that holds no run (a tokenizer alone,
  files of names nanochat does not write);
- `check_claim`: --resume needs a checkpoint; a fresh start refuses a directory holding a run
  unless --overwrite, which refuses checkpoints nanochat cannot tell it wrote, naming them;
- `check_path` names a link that loops or leads nowhere, and a file given as --run_dir;
- the lock is counted per process (`holder` says this process while held, nobody after); a
  second process on a locked directory: tests/test_faults.py.
"""

from __future__ import annotations

import os

import pytest

from nanochat import rundir
from nanochat.common import UsageError


def test_run_contents_names_what_makes_a_run(tmp_path):
    assert rundir.run_contents(tmp_path / "missing") == []
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "checkpoint.pt").write_bytes(b"")  # not a name nanochat writes
    (tmp_path / "checkpoint-000010.pt.bak").write_bytes(b"")
    assert rundir.run_contents(tmp_path) == []
    for name in ("checkpoint-000010.pt", "checkpoint-000002.pt", "checkpoint-000002.json", "metrics.jsonl"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "checkpoint_dcp").mkdir()
    assert rundir.run_contents(tmp_path) == ["checkpoint-000002.pt", "checkpoint-000010.pt", "metrics.jsonl",
                                             "checkpoint_dcp/"]


def test_the_claim_rules(tmp_path):
    claim = dict(resume=False, overwrite=False, resumable=False, foreign=[])
    rundir.check_claim(tmp_path, **claim)  # nothing there: a fresh start
    with pytest.raises(UsageError, match=r"--resume: no checkpoint in .*Start a fresh run without --resume"):
        rundir.check_claim(tmp_path, **{**claim, "resume": True})
    rundir.check_claim(tmp_path, **{**claim, "resume": True, "resumable": True})
    (tmp_path / "result.json").write_text("{}")
    with pytest.raises(UsageError, match=r"already holds a run \(result.json\); continue it with --resume, replace"):
        rundir.check_claim(tmp_path, **claim)
    rundir.check_claim(tmp_path, **{**claim, "overwrite": True})
    with pytest.raises(UsageError, match=r"--overwrite: .* cannot tell it wrote \(checkpoint-000003.pt \(it has no "
                                         r"manifest\)\), and it deletes only its own; move them out"):
        rundir.check_claim(tmp_path, **{**claim, "overwrite": True, "foreign": ["checkpoint-000003.pt (it has no manifest)"]})
    rundir.remove_records(tmp_path)
    assert rundir.run_contents(tmp_path) == []


def test_check_path_names_broken_links_and_files(tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(UsageError, match=r"loop is a symbolic link that loops"):
        rundir.check_path(tmp_path / "loop" / "run")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    with pytest.raises(UsageError, match=r"gone is a symbolic link to .*nowhere, which does not exist"):
        rundir.check_path(tmp_path / "gone")
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match=r"exists and is not a directory"):
        rundir.check_path(tmp_path / "file")
    rundir.check_path(tmp_path / "new" / "run")  # to be created: fine


def test_the_lock_is_counted_per_process(tmp_path):
    assert rundir.holder(tmp_path) is None
    rundir.own(tmp_path)
    with rundir.holding(tmp_path):  # a save inside the run shares the run's hold
        assert rundir.holder(tmp_path) == f"this process, pid {os.getpid()}"
    assert rundir.holder(tmp_path) is not None  # still the run's
    rundir.release(tmp_path)
    assert rundir.holder(tmp_path) is None
    assert (tmp_path / rundir.LOCK_NAME).is_file()  # the file stays: only the lock on it counts
