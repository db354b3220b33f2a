# Every target installs what it needs first, so a fresh machine with only python3 works.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev

.PHONY: install demo test bench clean torch

# The mpi extra (mpi4py, MPICH's wheel with its mpiexec) lets `make test` run
# tests/test_distributed.py under `mpiexec -n 2`.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev,demo,mpi]"
	touch $(STAMP)

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
