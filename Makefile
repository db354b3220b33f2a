# Every target installs what it needs first, so a fresh machine with only python3 works.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev

.PHONY: install demo test bench clean torch opencl-driver

# The mpi extra (mpi4py, MPICH's wheel with its mpiexec) lets `make test` run
# tests/test_distributed.py under `mpiexec -n 2`.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev,demo,mpi]"
	@$(PY) -c "import pyopencl; pyopencl.get_platforms()" 2>/dev/null || $(MAKE) --no-print-directory opencl-driver
	touch $(STAMP)

# PoCL's wheels (pocl-binary-distribution) are Linux x86-64 only: on another Linux machine with
# no OpenCL driver (aarch64, say), Debian's PoCL, which pyopencl's ICD loader finds in
# /etc/OpenCL/vendors. Elsewhere the driver is the user's to install (README).
opencl-driver:
	@if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "no OpenCL platform: installing Debian's PoCL (pocl-opencl-icd)"; \
		apt-get install -y -q pocl-opencl-icd >/dev/null 2>&1 \
			|| (apt-get update -q >/dev/null && apt-get install -y -q pocl-opencl-icd >/dev/null); \
	else \
		echo "no OpenCL platform found: install a driver (Debian: apt-get install pocl-opencl-icd)"; \
	fi

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m tapegrad.demo

# The PyTorch cross-checks (tests/test_against_torch.py) run when torch can be installed; they
# skip otherwise. torch is never a dependency of tapegrad itself.
TORCH_PIN := torch==2.13.0

torch: $(STAMP)
	@$(PY) -c "import torch" 2>/dev/null || timeout 900 $(PY) -m pip install -q $(TORCH_PIN) \
		|| echo "$(TORCH_PIN) could not be installed: the PyTorch comparisons will be skipped"

test: $(STAMP) torch
	$(PY) -m pytest
	$(VENV)/bin/pyright
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/lint-imports

# PyTorch is only for comparison: installed here, not a dependency. If it cannot be installed,
# the bench still runs and its torch columns say so.
bench: $(STAMP) torch
	$(PY) -m benchmarks

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
