# Two commands for a fresh machine: `make run` and `make test`. Everything else is a helper of those.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# Tests keep their temporary files under one directory they remove at the end (see tests/conftest.py).
PYTEST_ARGS ?=

# The container image every registered task runs in (it must hold this repo and its dependencies). One setting
# changes it for all tasks: `make package IMAGE=registry.example.com/flyte-ray-training:v3`.
IMAGE ?= localhost:30000/flyte-ray-training:latest
# Packages whose modules pyflyte loads; every task, workflow and launch plan defined in a loaded module (or one it
# imports) is serialized. training_core defines no Flyte entities: it travels in the image.
FLYTE_PKGS ?= workflows,tasks
PACKAGE ?= dist/flyte-package.tgz
# `none`: the image holds the code. `all`: the code travels in the tarball (fast registration), so code changes
# need no image rebuild; the image still needs the dependencies.
COPY ?= none

# Debian packages the tests run for real: Prometheus + promtool + Pushgateway (metrics and alert-rule tests) and
# headless Chromium (Deck screenshots). Installed only when a binary is missing.
SYSTEM_PACKAGES := prometheus prometheus-pushgateway chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: run test venv benchmarks clean package system-packages

run: $(STAMP)
	$(BIN)/pyflyte run workflows/training.py training_pipeline

test: $(STAMP) system-packages
	$(BIN)/python -m pytest $(PYTEST_ARGS)

system-packages:
	@if ! command -v promtool >/dev/null || ! command -v prometheus-pushgateway >/dev/null || ! command -v chromium >/dev/null; then \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $(SYSTEM_PACKAGES); \
	fi

venv: $(STAMP)

# torch and torchvision first: the build machines serve them from local disk, capped at these versions.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The registration tarball (TaskSpec/WorkflowSpec/LaunchPlan protobufs) for `python -m deployment.remote register`
# or `flytectl register files --archive`.
package: $(STAMP)
	mkdir -p $(dir $(PACKAGE))
	$(BIN)/pyflyte --pkgs $(FLYTE_PKGS) package --image $(IMAGE) --output $(PACKAGE) --copy $(COPY) --force

benchmarks: $(STAMP)
	$(BIN)/python benchmarks/loop_overhead.py

clean:
	rm -rf $(VENV) mlflow.db mlruns mlartifacts .pytest_cache
