"""A DCP checkpoint's index (`.metadata`, a pickle) is read with an unpickler that admits only
what DCP writes. Checked against a real code-running payload (a `__reduce__` that calls
os.system to create a marker file), planted with a matching manifest so that it passes the
checkpoint's byte verification: every reader of a DCP step (resume's load, the weights-only load
behind --init_from, eval and export, the finite check) refuses it in one line naming the file, and
the marker file never appears. A checkpoint DCP wrote still loads, values equal to the saved ones."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nanochat.checkpoint import dcp as dcp_storage
from nanochat.checkpoint.dcp_index import read_index
from nanochat.checkpoint import loader
from nanochat.checkpoint import DCP, load_dcp, problem, save_dcp
from nanochat.common import NanoChatError
from nanochat.fs import hash_file
from tests.test_distributed import _tiny_model_and_optimizer, _train_steps


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _saved(tmp_path: Path):
    model, opt = _tiny_model_and_optimizer(0)
    _train_steps(model, opt, 2)
    return model, opt, DCP.at(save_dcp(tmp_path / "run", model, opt, step=2, meta={"step": 2}, keep=2))


def _plant_payload(step_dir: Path, marker: Path) -> None:
    """Replace the index with the payload and update the manifest, as an attacker would."""
    (step_dir / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"][".metadata"] = hash_file(step_dir / ".metadata")
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def _assert_refused(e: pytest.ExceptionInfo, step_dir: Path, marker: Path) -> None:
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert msg.startswith(f"{step_dir / '.metadata'}: refused, it names posix.system") and "run code" in msg, msg
    assert not marker.exists()


def test_a_payload_passes_byte_verification_yet_no_reader_runs_it(tmp_path):
    # unpickled the way torch's FileSystemReader does, this payload runs: the test's premise
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_Payload(probe)))
    assert probe.exists()

    model, opt, c = _saved(tmp_path)
    marker = tmp_path / "ran"
    _plant_payload(c.path, marker)
    assert problem(c) is None  # its bytes match its manifest: only the reader stands in the way
    with pytest.raises(NanoChatError) as e:  # --resume / --auto_resume (Checkpointer.read_resume)
        load_dcp(c.path, model, opt)
    _assert_refused(e, c.path, marker)
    with pytest.raises(NanoChatError) as e:  # --init_from, eval, export (checkpoint.loader)
        dcp_storage.load_weights(c.path, model)
    _assert_refused(e, c.path, marker)
    saved = SimpleNamespace(checkpoint=c, path=c.path, origin="--init_from run", weights=None,
                            meta={"config": {"model_name": "d2"}})
    with pytest.raises(NanoChatError) as e:  # through the loader: the refusal, not "weights do not fit"
        loader._load_weights(saved, model)
    _assert_refused(e, c.path, marker)
    assert DCP.nonfinite(c) is None  # the finite check: not a good checkpoint either
    with pytest.raises(NanoChatError) as e:
        read_index(c.path)
    _assert_refused(e, c.path, marker)


def test_a_checkpoint_dcp_wrote_loads_through_the_restricted_reader(tmp_path):
    model, opt, c = _saved(tmp_path)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    fresh, fresh_opt = _tiny_model_and_optimizer(1)
    _train_steps(fresh, fresh_opt, 1)  # optimizer state exists, of other values
    load_dcp(c.path, fresh, fresh_opt)
    for k, v in fresh.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=0)
    assert DCP.nonfinite(c) == []
    weights_only, _ = _tiny_model_and_optimizer(2)
    dcp_storage.load_weights(c.path, weights_only)
    torch.testing.assert_close(weights_only.state_dict(), want, rtol=0, atol=0)
