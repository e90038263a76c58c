"""--init_from: a new run that starts from another run's weights (fine-tuning a model trained here).

References: the source run's checkpoint (the new run's model holds its weights bit for bit, from a
.pt checkpoint and from a DCP directory), the source's own final validation loss (the new run's
step-0 evaluation runs the same code on the same weights and tokens: equal), and errors that
name the fix before any training: one line each through the CLI for a source checkpoint that is
a pickle payload, one lacking keys, and a newest one without its manifest.
"""

import json
import shutil

import pytest
import torch

from nanochat import checkpoint
from nanochat.checkpoint import DCP, PT, committed, load_checkpoint, save_checkpoint
from nanochat.common import NanoChatError, UsageError
from nanochat.fs import hash_file
from nanochat.train.trainer import NanoChatTrainer
from tests.conftest import load_script, run_records, tiny_train_kwargs


@pytest.fixture
def source(small_corpus, tmp_path):
    """A finished d2 run (20 steps), its directory and result."""
    d = tmp_path / "source"
    result = NanoChatTrainer(**tiny_train_kwargs(small_corpus, d, num_iterations=20, num_samples=0)).train()
    return d, result


def _setup(small_corpus, run_dir, **kw) -> NanoChatTrainer:
    t = NanoChatTrainer(**tiny_train_kwargs(small_corpus, run_dir, num_samples=0, **kw))
    t._setup()
    return t


def _same_weights(model, state: dict) -> bool:
    mine = model.state_dict()
    return mine.keys() == state.keys() and all(torch.equal(mine[k], state[k]) for k in state)


def test_the_new_run_starts_from_the_source_weights(small_corpus, tmp_path, source):
    src, src_result = source
    saved = load_checkpoint(src)
    t = _setup(small_corpus, tmp_path / "ft", init_from=str(src), seed=7)
    assert _same_weights(t.model, saved["model"])
    assert len(t.optimizer.state) == 0  # a fresh optimizer, nothing of the source's moments

    result = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "ft2", init_from=str(src), seed=7,
                                                 num_iterations=4, lr=1e-3, num_samples=0)).train()
    lines = [r for r in run_records(tmp_path / "ft2") if r.get("event") != "start"]  # the start's record is first
    assert lines[0]["step"] == 0 and lines[0]["val_loss"] == src_result.val_loss  # same weights, same code
    assert [r["step"] for r in lines if "loss" in r] == [1, 2, 3, 4]  # the step count starts again
    assert result.steps == 4 and result.val_loss < 1.05 * src_result.val_loss


def test_a_dcp_source_loads_the_same_weights(small_corpus, tmp_path, source):
    """A distributed run's checkpoint (a DCP directory, any world size) is read model-only."""
    src, _ = source
    donor = _setup(small_corpus, src, resume=True)
    donor._resume()
    saved = load_checkpoint(src)
    dcp_run = tmp_path / "dcp_source"
    shutil.copytree(src / "tokenizer", dcp_run / "tokenizer")
    meta = {k: saved[k] for k in ("config", "step", "tokenizer_fingerprint")}
    checkpoint.save_dcp(dcp_run, donor.model, donor.optimizer, step=saved["step"], meta=meta)
    assert not committed(dcp_run, (PT,)) and committed(dcp_run, (DCP,))

    t = _setup(small_corpus, tmp_path / "ft", init_from=str(dcp_run))
    assert _same_weights(t.model, saved["model"])


def test_a_resumed_fine_tune_keeps_its_own_tokenizer_and_names_init_from(small_corpus, tmp_path, source):
    src, _ = source
    kw = dict(init_from=str(src), num_iterations=2, lr=1e-3, num_samples=0)
    NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "ft", **kw)).train()
    with pytest.raises(UsageError, match="--init_from"):  # resumed without it: the settings differ
        NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "ft", resume=True, num_iterations=3)).train()
    shutil.rmtree(src)  # the source may be gone by the time the fine-tune is continued
    result = NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "ft", resume=True,
                                                 **{**kw, "num_iterations": 3})).train()
    assert result.steps == 3


def test_bad_sources_are_refused_before_training(small_corpus, tmp_path, source):
    src, _ = source
    cases = [
        (dict(init_from=str(src), model_name="d4"), UsageError, "holds a d2 model.*pass --model_name d2"),
        (dict(init_from=str(tmp_path / "nowhere")), UsageError, "no such directory"),
        (dict(init_from=str(src / "tokenizer")), UsageError, "no checkpoint there"),
    ]
    for over, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "ft", num_samples=0, **over)).train()
    with pytest.raises(ValueError, match="drop --tokenizer_dir"):
        NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "ft", init_from=str(src),
                                            tokenizer_dir=str(src / "tokenizer")))
    with pytest.raises(ValueError, match="also --run_dir"):
        NanoChatTrainer(**tiny_train_kwargs(small_corpus, src, init_from=str(src)))

    hf_run = tmp_path / "hf_run"  # a run of a Hugging Face model: continued from its export instead
    payload = load_checkpoint(src)
    payload["config"]["model_name"] = str(tmp_path / "some-llama")
    payload.pop("format_version")
    save_checkpoint(hf_run, payload)
    shutil.copytree(src / "tokenizer", hf_run / "tokenizer")
    with pytest.raises(UsageError, match="export_hf.py --run_dir"):
        NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "ft", init_from=str(hf_run))).train()

    ckpt = committed(src)[-1].path
    data = bytearray(ckpt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    ckpt.write_bytes(bytes(data))
    with pytest.raises(NanoChatError, match="not usable"):
        NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "ft", init_from=str(src), num_samples=0)).train()
    assert not (tmp_path / "ft" / "metrics.jsonl").exists()  # nothing trained, nothing written


class _Payload:  # any class: unpickling it would run code of the file's choosing
    pass


def _cli(capsys, kw: dict) -> tuple[int, list[str]]:
    """scripts/base_train.py in this process: (exit status, its error lines); never a traceback."""
    from nanochat.common import logger

    logger.handlers.clear()  # log to this test's stderr (capsys replaces it per test)
    module = load_script("base_train")
    argv = [a for k, v in kw.items()
            for a in ((f"--{k}",) if v is True else (f"--no_{k}",) if v is False else (f"--{k}", str(v)))]
    capsys.readouterr()
    code = module.main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-2000:]
    return code, [line for line in err.splitlines() if line.startswith("error:")]


def test_unloadable_or_incomplete_sources_are_one_line(small_corpus, tmp_path, source, capsys):
    """The source's newest checkpoint as a pickle payload (a manifest that verifies), then as a
    checkpoint lacking its config, then without its manifest: one error line each, naming why,
    never torch's advice to unpickle, never a silent fall back to an older checkpoint."""
    src, _ = source
    newest = committed(src)[-1]
    kw = tiny_train_kwargs(small_corpus, tmp_path / "ft", init_from=str(src), num_samples=0, num_iterations=2)

    torch.save({"format_version": 1, "step": newest.step, "model": _Payload()}, newest.path)
    newest.manifest.write_text(json.dumps({"file": newest.path.name, **hash_file(newest.path), "step": newest.step}))
    code, errors = _cli(capsys, kw)
    assert code == 1 and len(errors) == 1, errors
    assert ("is not a nanochat checkpoint (it needs unpickling of arbitrary objects, which nanochat never does)"
            in errors[0] and "weights_only" not in errors[0]), errors

    payload = {"format_version": 1, "step": newest.step, "model": {"w": torch.ones(2)}}
    newest.path.unlink()
    save_checkpoint(src, payload)
    code, errors = _cli(capsys, kw)
    assert code == 1 and len(errors) == 1 and "lacks 'config', 'tokenizer_fingerprint'" in errors[0], errors

    newest.manifest.unlink()
    code, errors = _cli(capsys, kw)
    assert code == 2 and len(errors) == 1, errors
    assert "--init_from: the newest checkpoint" in errors[0] and "has no manifest" in errors[0], errors
    assert not (tmp_path / "ft" / "metrics.jsonl").exists()
