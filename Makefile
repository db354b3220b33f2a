# Every target installs what it needs first, so a fresh machine with only python3 works.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev,demo]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m tapegrad.demo

test: $(STAMP)
	$(PY) -m pytest
	$(VENV)/bin/pyright
	$(VENV)/bin/ruff check src tests benchmarks

# PyTorch is only for comparison: installed here, not a dependency. If it cannot be installed,
# the bench still runs and its torch columns say so.
bench: $(STAMP)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0 \
		|| echo "torch==2.13.0 could not be installed: benchmarks run without it"
	$(PY) -m benchmarks

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
