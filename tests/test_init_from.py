"""--init_from: a new run that starts from another run's weights (fine-tuning a model trained here).

References: the source run's checkpoint (the new run's model holds its weights bit for bit, from a
.pt checkpoint and from a DCP directory), the source's own final validation loss (the new run's
step-0 evaluation runs the same code on the same weights and tokens: equal), and errors that
name the fix before any training.
"""

import json
import shutil

import pytest
import torch

from nanochat import distributed
from nanochat.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from nanochat.common import NanoChatError, UsageError
from nanochat.trainer import NanoChatTrainer
from tests.conftest import tiny_train_kwargs


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
    lines = [json.loads(line) for line in (tmp_path / "ft2" / "metrics.jsonl").read_text().splitlines()]
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
    distributed.save_dcp(dcp_run, donor.model, donor.optimizer, step=saved["step"], meta=meta)
    assert latest_checkpoint(dcp_run) is None and distributed.latest_dcp(dcp_run) is not None

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

    ckpt = latest_checkpoint(src).path
    data = bytearray(ckpt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    ckpt.write_bytes(bytes(data))
    with pytest.raises(NanoChatError, match="not usable"):
        NanoChatTrainer(**tiny_train_kwargs(small_corpus, tmp_path / "ft", init_from=str(src), num_samples=0)).train()
    assert not (tmp_path / "ft" / "metrics.jsonl").exists()  # nothing trained, nothing written
