#!/usr/bin/env bash
# Run scripts/gpu_check.py on a CUDA machine with sm_89+ and collect its figures in $OUT.
#
#   bash scripts/gpu_check.sh [gpu_check.py flags]       e.g. --jobs env train --budget_s 200
#
# 8 minutes in all by default: gpu_check.py measures for --budget_s seconds (440 unless given) and
# is stopped 25 s after that whatever happens (TERM, then KILL 10 s later); its JSON keeps every
# measurement that finished.
#
# Install first, on the CUDA machine: `make install TORCH=torch` (a CUDA build of torch >= 2.11,
# then nanochat and its dependencies). A machine without internet access takes wheels instead:
# download them elsewhere for its Python version and platform, e.g.
#   pip download -d .whl --python-version 3.12 --only-binary=:all: torchao tyro rustbpe tiktoken tqdm \
#     safetensors numpy pyarrow tokenizers jinja2 pytest docstring-parser typeguard
# and this script installs what does not import from .whl/ into .site, leaving the machine's own
# environment as it is.
# Environment: OUT (default .cache/gpu_check), PYTHON (default python3), WHEELS (default .whl).
# Exit status: gpu_check.py's (124: stopped by the limit); 3 if the wheels in .whl/ do not install;
# 4 if a package a job needs does not import (nothing could be measured).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/.cache/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}
# the tokenizer and token caches outlive a run; keep them out of $OUT
export NANOCHAT_CACHE=${NANOCHAT_CACHE:-$PWD/.cache}

# What the jobs import: every dependency nanochat declares (pyproject.toml) and pytest (the tests
# job), then the modules the jobs run. tests/test_gpu_check.py keeps PROBE in step with pyproject.toml.
PROBE="torch torchao tyro rustbpe tiktoken tqdm safetensors numpy pyarrow tokenizers jinja2 pytest"
imports() {
  "$PY" -c "import ${PROBE// /, }; import nanochat.fp8, nanochat.train.trainer, tests.test_gpu" 2>"$OUT/import_error.txt"
}
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
  echo "error: a package the GPU check needs does not import (make install TORCH=torch first, or put the" \
       "wheels in .whl/):" >&2
  tail -3 "$OUT/import_error.txt" >&2
  exit 4
fi
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1

# the limit follows --budget_s (gpu_check.py's default when it is not given)
BUDGET_S=440
for ((i = 1; i <= $#; i++)); do
  case "${!i}" in
    --budget_s=*) BUDGET_S=${!i#--budget_s=} ;;
    --budget_s) j=$((i + 1)); BUDGET_S=${!j:-$BUDGET_S} ;;
  esac
done
LIMIT_S=$(awk -v b="$BUDGET_S" 'BEGIN { if (b + 0 > 0) printf "%d", b + 25.999; else print 465 }')

# TERM first (gpu_check.py records the measurement it cuts short), KILL 10 s later
timeout -k 10 "$LIMIT_S" "$PY" scripts/gpu_check.py --out "$OUT/gpu_check.json" "$@" 2>&1 \
  | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
