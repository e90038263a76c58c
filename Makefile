# Two commands for a fresh machine: `make train` and `make test`. Both set themselves up.
#   make install TORCH=torch          # e.g. on a CUDA machine: let pip choose a CUDA build of torch
#   make install TORCH=torch==2.11.0  # any pip requirement works
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.nanochat-installed
# pytest workers: one per core up to 4. The suite runs one thread per process (tests/conftest.py),
# and most of its time is single-threaded (compiling, starting processes), so two workers on 2
# cores take about half the time. Past 4 the memory of the workers (~2 GB each) costs more than
# the few long files that bound the wall time give back.
TEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)
# --dist loadfile: a file's tests share one worker, so a module fixture (a trained run) is built once.
PYTEST := $(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadfile

.PHONY: install train test test-numerics test-all clean

# Re-install only when pyproject.toml changes or TORCH differs from what is installed.
install:
	@if [ ! -f $(STAMP) ] || [ pyproject.toml -nt $(STAMP) ] || [ "$$(cat $(STAMP))" != "$(TORCH)" ]; then \
		set -e; \
		[ -x $(BIN)/python ] || $(PYTHON) -m venv $(VENV); \
		$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH)"; \
		$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[dev]'; \
		echo "$(TORCH)" > $(STAMP); \
	fi

# The main job: a d4 GPT (5.2M parameters) on this Python's standard library, 250 steps of
# 8 x 256 tokens, ~4 minutes on 2 CPU cores (README states the measured figures). ARGS adds or
# overrides flags, e.g. make train ARGS="--fp8 --fp8_emulate --fp8_layers all". A demo: each `make train` starts
# its run directory over (--overwrite); run scripts/base_train.py yourself to keep or resume runs.
TRAIN_ARGS ?= --model_name d4 --batch_size 8 --seq_len 256 --num_iterations 250 --eval_every 50 --run_dir runs/make_train --overwrite
train: install
	$(BIN)/python scripts/base_train.py $(TRAIN_ARGS) $(ARGS)

# lint-imports first: the layer contract in pyproject.toml ([tool.importlinter]), no import cycle.
# --durations=25 lists the 25 slowest tests: where the time of a slower suite went.
test: install
	$(BIN)/lint-imports
	$(PYTEST) -q --durations=25 $(ARGS)

# The numerics pass, after `make test`: the tests that compare two different computations
# (marked two_computations: batch splits, kernels, compiled vs eager, process layouts), with one
# side moved by a last-bit perturbation (NANOCHAT_PERTURB=1, tests/conftest.py), so a tolerance
# that only holds for one order of fp32 summation fails on any machine; and with ATen and inductor
# on another vector ISA than this CPU's best (AVX-512 -> AVX2, otherwise none), with the other tests
# that compile, so a check that only holds for one vector width fails here too. Inductor's cache
# does not key on ATEN_CPU_CAPABILITY, hence a cache directory of its own.
test-numerics: install
	isa=$$($(BIN)/python -c "import torch; print('avx2' if torch.backends.cpu.get_cpu_capability() == 'AVX512' else 'default')"); \
	echo "numerics pass: last-bit perturbation, ATEN_CPU_CAPABILITY=$$isa"; \
	export TORCHINDUCTOR_CACHE_DIR=$$(mktemp -d) ATEN_CPU_CAPABILITY=$$isa; \
	NANOCHAT_PERTURB=1 $(PYTEST) -q -m 'two_computations and not slow and not gpu' $(ARGS) && \
	$(PYTEST) -q -k compile -m 'not two_computations and not slow and not gpu' $(ARGS)

# Everything, the slow tests included (GPU tests still skip without a GPU).
test-all: install
	$(PYTEST) -q -m 'not gpu' $(ARGS)

clean:
	rm -rf $(VENV) runs .cache
