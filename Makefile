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

bench: $(STAMP)
	$(PY) -m benchmarks

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
