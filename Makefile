# The two commands of the README. Each does all set-up on a fresh machine: a virtual
# environment in .venv, torch first (the extension compiles against it), then radixserve
# itself (editable; builds radixserve._C when nvcc and a CUDA torch are present).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: serve test setup

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python setup.py
	$(BIN)/pip install -q setuptools wheel
	$(BIN)/pip install -q torch pybind11 ninja nvidia-cutlass
	$(BIN)/pip install -q --no-build-isolation -e '.[test]'
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(BIN)/radixserve serve $(ARGS)

test: setup
	$(BIN)/python -m pytest -q tests $(ARGS)
