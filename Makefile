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

.PHONY: run test lint venv benchmarks clean package system-packages image lock device-check device-carry

# --overwrite-cache: flytekit's local cache (~/.flyte/local-cache) outlives the temporary directory that held the
# cached outputs; a stale entry would hand the pipeline a data directory that is gone. Preparing digits takes seconds.
run: $(STAMP)
	$(BIN)/pyflyte run --overwrite-cache workflows/training.py training_pipeline

# The whole suite in two phases: the unit and tools tiers (CPU-bound, no Ray cluster) spread over up to 4 cores by
# pytest-xdist, then the other tiers one test at a time (each of their runs takes both cores of a 2-core machine
# itself, and some measure time). Both phases always run; either failing fails `make test`. With PYTEST_ARGS, one
# pytest run of exactly those arguments instead: `make test PYTEST_ARGS="-m flyte"`.
test: $(STAMP) system-packages lint
ifeq ($(strip $(PYTEST_ARGS)),)
	@status=0; \
	$(BIN)/python -m pytest -m "unit or tools" -n auto --maxprocesses=4 || status=1; \
	$(BIN)/python -m pytest -m "not (unit or tools)" || status=1; \
	exit $$status
else
	$(BIN)/python -m pytest $(PYTEST_ARGS)
endif

# ruff (configured in pyproject.toml): a lint violation or an unformatted file fails `make test`.
# `$(BIN)/ruff format . && $(BIN)/ruff check --fix .` fixes most of them.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

system-packages:
	@if ! command -v promtool >/dev/null || ! command -v prometheus-pushgateway >/dev/null || ! command -v chromium >/dev/null; then \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $(SYSTEM_PACKAGES); \
	fi
	@# kubectl renders the Kustomize overlays in the manifest tests. These machines carry it from Google's apt
	@# repository (Debian itself only ships kubernetes-client 1.20, which these tests were not run with).
	@command -v kubectl >/dev/null || DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq kubectl \
		|| echo "kubectl could not be installed: the Kubernetes manifest tests will fail until it is on PATH"

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

# The GPU check (docs/gpu_check.md): every GPU path and figure in one command of at most 8 minutes, on a lent GPU
# machine that has no venv, no Ray and no network (so no $(STAMP) here: it runs with whatever python is there).
# `make device-check DEVICE=cpu` rehearses it here at tiny sizes. `make device-carry` builds what travels with it.
DEVICE ?= cuda
DEVICE_OUT ?= benchmarks/results/device
CHECK_PYTHON ?= $(shell test -x $(BIN)/python && echo $(BIN)/python || echo python3)
device-check:
	$(CHECK_PYTHON) benchmarks/device_check.py --device $(DEVICE) --out $(DEVICE_OUT)

device-carry: $(STAMP)
	$(BIN)/python benchmarks/device_wheels.py

clean:
	rm -rf $(VENV) mlflow.db mlruns mlartifacts .pytest_cache

# The runtime image of every task and of the RayJob head/worker pods (Dockerfile), tagged IMAGE, the same setting
# `make package` bakes into the tasks: build, push, then package with the same IMAGE. Needs a Docker engine, which
# this development machine does not have: here only tests/unit/test_dockerfile.py checks the Dockerfile.
image:
	docker build -t $(IMAGE) .

# requirements.lock, what the image installs: the project's runtime dependencies (no test extras) resolved by pip
# with every version held to the one installed in the tested venv, `name==version` per line. Run after changing
# pyproject.toml and `make venv`; tests/unit/test_dockerfile.py checks the lock against pyproject's pins.
LOCK := requirements.lock
define LOCK_WRITER
import json, sys
report = json.load(open(sys.argv[1]))
pins = [(i["metadata"]["name"], i["metadata"]["version"]) for i in report["install"] if i["metadata"]["name"] != sys.argv[2]]
print("# The image's exact dependencies (Python 3.11, linux x86_64). Generated by `make lock`; do not edit by hand.")
print("\n".join(f"{name}=={version}" for name, version in sorted(pins, key=lambda p: p[0].lower())))
endef
export LOCK_WRITER

lock: $(STAMP)
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	$(BIN)/pip freeze --all --exclude-editable > "$$tmp/constraints.txt" && \
	$(BIN)/pip install --quiet --dry-run --ignore-installed --report "$$tmp/report.json" --constraint "$$tmp/constraints.txt" . && \
	$(BIN)/python -c "$$LOCK_WRITER" "$$tmp/report.json" flyte-ray-training > $(LOCK)
