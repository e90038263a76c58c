#!/usr/bin/env bash
# The command of the GPU device call: install the carried wheels, run scripts/gpu_check.py.
#
#   device:  run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
#   here:    PYTHON=.venv/bin/python GPU_CHECK_SKIP_WHEELS=1 bash scripts/gpu_check.sh --dry_run
#
# Arguments go to scripts/gpu_check.py (e.g. --sections train --train_models d20:32).
# Environment: OUT (default .cache/gpu_check; the device sets it), PYTHON (default python3, which
# on the device machine is the interpreter that holds torch 2.11), GPU_CHECK_SKIP_WHEELS=1 to use
# the interpreter's own packages instead of .whl (the dry-run test does).
# Exit status: gpu_check.py's: 0 even when single measurements fail (they are in the JSON), 4 when
# torchao or nanochat.fp8 does not import (checked before anything else: nothing can be measured
# then, and that must not look like a run); or 3 when the wheels are missing or do not install.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/.cache/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if [ "${GPU_CHECK_SKIP_WHEELS:-0}" != 1 ]; then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "error: no wheels in .whl/: run ../shared/tools/gpu-wheels.sh before the device call and pass carry=[\".whl\"]" >&2
    exit 3
  fi
  # --target: the device's environment stays untouched; --no-deps: the device has the rest (KINDS.md)
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target .site .whl/*.whl; then
    echo "error: installing the carried wheels (.whl/) into .site failed; see pip's message above" >&2
    exit 3
  fi
  export PYTHONPATH=$PWD/.site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
fi

if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
fi

"$PY" scripts/gpu_check.py --out "$OUT/gpu_check.json" "$@" 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
