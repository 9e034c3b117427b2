# Two commands for a fresh machine: `make run` and `make test`. Everything else is a helper of those.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# Tests keep their temporary files under one directory they remove at the end (see tests/conftest.py).
PYTEST_ARGS ?=

.PHONY: run test venv benchmarks clean

run: $(STAMP)
	$(BIN)/pyflyte run workflows/training.py training_pipeline

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

venv: $(STAMP)

# torch and torchvision first: the build machines serve them from local disk, capped at these versions.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

benchmarks: $(STAMP)
	$(BIN)/python benchmarks/loop_overhead.py

clean:
	rm -rf $(VENV) mlflow.db mlruns mlartifacts .pytest_cache
