# Two commands: `make run` and `make test`. Each creates .venv on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-slow bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The main job on the embedded default (see README).
run: $(STAMP)
	$(PY) -m scaleopt.cli run-default --out results

# Fast suite (< 15 min on 2 CPU cores). Slow studies are marked `slow` and excluded.
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" -n 2 --dist loadfile

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

clean:
	rm -rf $(VENV) results .pytest_cache
