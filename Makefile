# fmoe developer commands.
#   make setup     create .venv and install what is missing (idempotent)
#   make test      setup, then the whole suite (Triton kernels via the interpreter on CPU), in one
#                  pytest-xdist worker per core, a test file per worker; TEST_WORKERS=0 runs it in one process
#   make test-gpu  setup, then the tests marked `gpu` (they skip, saying why, without CUDA)
#   make train     setup, then train the default small MoE on the embedded corpus (CPU: minutes)
#                  and plot it; ARGS="--steps=400 ..." passes knobs, TRAIN_OUT=dir the output
#   make bench     setup, then the gpu tests and every benchmark on a CUDA machine, appended to
#                  benchmarks/RESULTS.md (benchmarks/run_all.py; ARGS="--only bench_rope ...")
#   make bench-smoke  every benchmark's --smoke mode (CPU, tiny shapes)
#   make clean     remove the venv, outputs and build folders (setuptools reuses build/: a deleted module stayed in the next wheel)

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# CPU machines get pinned versions (the CPU builds where pip's index holds them); a CUDA machine takes the registry's CUDA builds
CPU_PINS := torch==2.13.0 triton==3.7.1

.PHONY: setup test test-gpu train bench bench-smoke clean

setup:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if $(PY) -c "import sys, torch, triton, einops, tensordict, pytest, xdist, matplotlib, safetensors, tokenizers, pyarrow, tensorboard, jinja2, fmoe; sys.version_info < (3, 11) or __import__('transformers')" 2>/dev/null; then \
		echo "setup: $(VENV) already has everything"; \
	else \
		if nvidia-smi -L >/dev/null 2>&1; then pins="torch triton"; else pins="$(CPU_PINS)"; fi; \
		echo "setup: installing $$pins and fmoe[test] into $(VENV)"; \
		$(PY) -m pip install -q $$pins && $(PY) -m pip install -q -e ".[test]"; \
	fi

# a test file's tests stay in one worker (--dist loadfile): its spawned process group runs once; the files start in
# the order tests/conftest.py gives them, the longest first (--no-loadscope-reorder)
TEST_WORKERS ?= auto
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

TRAIN_OUT ?= out/train_moe
train: setup
	$(PY) examples/train_moe.py --resume --out_dir=$(TRAIN_OUT) $(ARGS)
	$(PY) -m fmoe.train.plot $(TRAIN_OUT)

test-gpu: setup
	TRITON_INTERPRET=0 $(PY) -m pytest -q -m gpu

bench: setup
	$(PY) benchmarks/run_all.py --gpu-tests $(ARGS)

bench-smoke: setup
	@for b in benchmarks/bench_*.py; do echo "== $$b --smoke"; $(PY) $$b --smoke || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache bench_out out build dist fmoe.egg-info
