"""Paths reached through symbolic links do what the link's target implies and say so. Checked
against the file system afterwards: --overwrite through a --run_dir link names the directory
whose run it deletes; a link inside --dataset_path that leads to the run directory is refused
before anything is read (as a run directory inside the corpus is); an export over a link to a
directory replaces that directory and keeps the link, leaving no temporary of its own; a
dangling --out_dir link is refused naming the link and its target."""

from __future__ import annotations

import os

import pytest

from nanochat import rundir
from nanochat.common import UsageError
from nanochat.data.sources import DataError, list_sources
from nanochat.fs import publish_directory
from nanochat.model.export import check_export_dir
from tests.conftest import tiny_train_kwargs


def test_overwrite_through_a_run_dir_link_names_the_run_it_deletes(tmp_path, nanochat_log):
    real = tmp_path / "real-run"
    real.mkdir()
    (real / "metrics.jsonl").write_text("{}\n")
    link = tmp_path / "latest"
    link.symlink_to(real)
    rundir.check_claim(link, resume=False, overwrite=True, resumable=False, foreign=[])
    said = [r.getMessage() for r in nanochat_log.records if r.levelname == "WARNING"]
    assert said and f"--run_dir {link} is reached through a symbolic link" in said[0], said
    assert said[0].endswith(f"the run it deletes is the one in {real}"), said
    nanochat_log.clear()
    rundir.check_claim(real, resume=False, overwrite=True, resumable=False, foreign=[])
    assert not [r for r in nanochat_log.records if "symbolic link" in r.getMessage()]


def test_a_link_in_the_corpus_to_the_run_dir_is_refused_before_reading(small_corpus, tmp_path):
    from nanochat.train.trainer import NanoChatTrainer

    corpus, run = tmp_path / "corpus", tmp_path / "runs" / "r"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text to train on\n" * 200)
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 4.2}\n')
    (corpus / "shards").symlink_to(tmp_path / "runs")  # a link to the folder that holds the run
    assert "shards/r/metrics.jsonl" in [f.path for f in list_sources(corpus).files]  # the premise
    with pytest.raises(DataError) as e:
        list_sources(corpus, run_dir=run)
    msg = str(e.value)
    assert "\n" not in msg and f"through the link {corpus / 'shards'}" in msg and f"--run_dir {run}" in msg, msg
    with pytest.raises(DataError, match="through the link .*shards.*which is or holds --run_dir"):
        NanoChatTrainer(**tiny_train_kwargs(corpus, run, overwrite=True)).train()
    assert (run / "metrics.jsonl").read_text() == '{"step": 1, "loss": 4.2}\n'  # the run's records untouched


def test_export_overwrite_onto_a_link_replaces_its_target_and_keeps_the_link(tmp_path):
    target, link = tmp_path / "exports" / "v1", tmp_path / "served"
    target.mkdir(parents=True)
    (target / "old.safetensors").write_text("old")
    link.symlink_to(target)
    check_export_dir(link, overwrite=True)
    out = publish_directory(link, lambda tmp: (tmp / "model.safetensors").write_text("new"))
    assert out == target and os.path.islink(link) and os.readlink(link) == str(target)
    assert sorted(p.name for p in target.iterdir()) == ["model.safetensors"]
    assert (link / "model.safetensors").read_text() == "new"
    leftovers = [p.name for d in (tmp_path, target.parent) for p in d.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_a_dangling_out_dir_link_is_refused_naming_link_and_target(tmp_path):
    link = tmp_path / "served"
    link.symlink_to(tmp_path / "gone")
    for overwrite in (False, True):
        with pytest.raises(UsageError) as e:
            check_export_dir(link, overwrite=overwrite)
        assert str(e.value) == (f"--out_dir {link} is a symbolic link to {tmp_path / 'gone'}, which does not exist; "
                                "create that directory, repair the link, or give another --out_dir")
    assert not (tmp_path / "gone").exists()
