#!/usr/bin/env bash
# Run scripts/gpu_check.py on a CUDA machine with sm_89+ and collect its figures in $OUT.
#
#   bash scripts/gpu_check.sh [gpu_check.py flags]       e.g. --jobs env train --budget_s 200
#
# The machine needs torch with CUDA (>= 2.11) and the other packages: the interpreter's own
# (`pip install -e .` done beforehand) or, where they do not import, the wheels in .whl/, installed
# into .site without touching the machine's environment (for a machine without internet access:
# `pip download -d .whl torchao tyro docstring-parser typeguard rustbpe tiktoken` elsewhere, for
# its Python version and platform).
# gpu_check.py is stopped after LIMIT_S seconds (default 525: with this wrapper's own start, 9
# minutes); its JSON keeps every measurement that finished.
# Environment: OUT (default .cache/gpu_check), PYTHON (default python3), WHEELS (default .whl), LIMIT_S.
# Exit status: gpu_check.py's (124: stopped by the limit); 3 if the wheels in .whl/ do not install;
# 4 if torchao or nanochat.fp8 does not import (nothing could be measured).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/.cache/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
# the tokenizer and token caches outlive a run; keep them out of $OUT
export NANOCHAT_CACHE=${NANOCHAT_CACHE:-$PWD/.cache}

imports() { "$PY" -c "import torchao, tyro, nanochat.fp8" 2>"$OUT/import_error.txt"; }
WHEELS=${WHEELS:-.whl}
if ! imports && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target .site "$WHEELS"/*.whl; then
    echo "error: installing the wheels in $WHEELS/ into .site failed; see pip's message above" >&2
    exit 3
  fi
  export PYTHONPATH=$PWD/.site:$PYTHONPATH
fi
if ! imports; then
  echo "error: torchao, tyro or nanochat.fp8 does not import (pip install -e . first, or put the wheels in .whl/):" >&2
  tail -3 "$OUT/import_error.txt" >&2
  exit 4
fi
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1

# TERM first (gpu_check.py records the measurement it cuts short), KILL 15 s later
timeout -k 15 "${LIMIT_S:-525}" "$PY" scripts/gpu_check.py --out "$OUT/gpu_check.json" "$@" 2>&1 \
  | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
