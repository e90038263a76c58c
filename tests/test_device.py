"""nanochat.device (and the split from nanochat.common that it exists for), checked against torch.

- resolve_device: auto is what torch reports available (cuda, else mps, else cpu); a name torch
  does not know, a device type nanochat does not run on, and CUDA on a machine without it are
  UsageErrors (exit status 2) naming --device and what to give instead;
- resolve_dtype: auto is bf16 on CUDA and fp32 elsewhere, the names map to torch's dtypes, an
  unknown name is a UsageError listing the choices;
- seed_everything: re-seeding reproduces torch's and Python's draws exactly (the reference is
  the first draws);
- DeviceReads counts what makes the host wait: `.item()` and host_read once each, arithmetic on
  the device never; host_read returns the tensor's values (reference: tolist());
- importing nanochat.common, nanochat.config and nanochat.rundir in a fresh interpreter loads no
  torch (the reason nanochat.device is a module of its own).
"""

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanochat.common import UsageError, describe_error
from nanochat.device import DeviceReads, host_read, resolve_device, resolve_dtype, seed_everything

ROOT = Path(__file__).resolve().parents[1]


def test_auto_is_what_torch_reports():
    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    want = "cuda" if torch.cuda.is_available() else "mps" if mps else "cpu"
    assert resolve_device("auto").type == want
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name, fragments", [
    ("tpu9", ["--device 'tpu9' is not a device torch knows", "use cpu, cuda, cuda:N, mps or auto"]),
    ("meta", ["--device 'meta': nanochat runs on cpu, cuda (cuda:N) or mps"]),
])
def test_bad_devices_are_usage_errors(name, fragments):
    with pytest.raises(UsageError) as e:
        resolve_device(name)
    assert describe_error(e.value)[0] == 2
    for fragment in fragments:
        assert fragment in str(e.value), str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_names_the_fix():
    with pytest.raises(UsageError, match=r"torch.cuda.is_available\(\) is False .*Use --device cpu, or install a "
                                         "CUDA build: make install TORCH=torch"):
        resolve_device("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_index_past_the_last_gpu():
    n = torch.cuda.device_count()
    with pytest.raises(UsageError, match=f"this machine has {n} CUDA device"):
        resolve_device(f"cuda:{n}")


def test_dtypes():
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16  # a device object needs no GPU
    assert resolve_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16
    assert resolve_dtype("float32", torch.device("cuda")) is torch.float32
    with pytest.raises(UsageError, match="unknown --dtype 'int8'; expected one of auto, float32, bfloat16"):
        resolve_dtype("int8", torch.device("cpu"))


def test_seed_everything_reproduces_the_draws():
    seed_everything(7)
    first = (torch.rand(5), random.random())
    torch.rand(3), random.random()  # move both generators on
    seed_everything(7)
    again = (torch.rand(5), random.random())
    assert torch.equal(first[0], again[0]) and first[1] == again[1]


def test_device_reads_counts_host_waits():
    t = torch.arange(6, dtype=torch.float32)
    with DeviceReads() as r:
        u = t * 2 + 1
    assert r.count == 0
    with DeviceReads() as r:
        total = u.sum().item()
        values = host_read(u)
    assert r.count == 2, r.reads
    assert total == 36.0 and values == (t * 2 + 1).tolist()


def test_the_bottom_layer_loads_no_torch():
    code = ("import sys, nanochat.common, nanochat.config, nanochat.rundir\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"PATH": "", "PYTHONPATH": str(ROOT / "src")})
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr[-2000:])
