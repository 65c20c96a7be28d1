# Two commands: `make run` and `make test`. Each creates .venv on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-integration test-slow test-min clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The main job on the embedded default (see README).
run: $(STAMP)
	$(PY) -m scaleopt.cli run-default --out results

# Three tiers, by pytest marker (pyproject.toml), each file run whole by one of two workers:
#   test              every unit and contract test, one tiny run of each capability (budget:
#                     8 min on 2 CPU cores; measured times in docs/architecture.md)
#   test-integration  `integration`: whole training runs, several processes, sharding on
#                     simulated devices, kill loops (CI runs it after `test`)
#   test-slow         `slow`: long studies and benchmarks-as-tests (by hand, not in CI)
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not integration" -n 2 --dist loadfile

test-integration: $(STAMP)
	$(PY) -m pytest -q -m "integration and not slow" -n 2 --dist loadfile

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# The lowest dependency versions pyproject.toml allows (core + hf), in .venv-min, on a smoke
# subset of the tests. Not part of `make test` (it downloads a second JAX).
MIN_VENV := .venv-min
MIN_TESTS := tests/test_packaging.py tests/test_config_system.py \
  tests/models/test_models_config.py tests/train/test_train_config.py tests/optim/test_adam_bc.py \
  tests/train/test_train.py::test_tiny_run_beats_unigram_entropy
test-min:
	test -x $(MIN_VENV)/bin/python || $(PYTHON) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/python -m pip install -q --only-binary :all: \
	  $$($(PYTHON) scripts/min_requirements.py hf) "pytest>=8.0"
	PYTHONPATH=. $(MIN_VENV)/bin/python -m pytest -q -p no:cacheprovider -m "not slow" \
	  -k "not wheel and not editable" $(MIN_TESTS)

clean:
	rm -rf $(VENV) $(MIN_VENV) results .pytest_cache .jaxcache
