# Two entry points, both self-installing on a fresh Debian machine (root):
#   make runbook   the whole runbook against the lab; the executed run is archived under outputs/lab/
#   make test      the test suite (unit, lab integration, nbval over notebooks/) against the lab
# and the quick one, no root and no lab: make unit (lint, then the unit tests)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export SPARKBOOK_HEADLESS := 1

BROWSER := /usr/bin/chromium /usr/bin/chromedriver

.PHONY: setup lab runbook test test-all unit bench lint docs router-pins
setup: $(BIN)/sparkbook
# Debian's Chromium and chromedriver for the browser test (tests/lab/test_browser.py); no browser downloads
$(BROWSER) &:
	DEBIAN_FRONTEND=noninteractive apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver
# rsync on the lab nodes (they run this machine's binaries): 03 copies the model node to node with it
/usr/bin/rsync:
	DEBIAN_FRONTEND=noninteractive apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rsync
$(BIN)/sparkbook: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

lab: setup /usr/bin/rsync
	$(BIN)/sparkbook lab up

# from the lab's initial state (the old deployment serving), whatever earlier runs or tests left on it: a test
# session's cluster left serving held 04's Ray port and the runbook stopped there
runbook: lab
	$(BIN)/sparkbook lab reset --keep-worker-images
	$(BIN)/sparkbook run params/lab.yaml -p confirm_cleanup=true --archive

# ruff (E,F,W,I,B,UP) and mypy (strict on sparkbook.core) as pyproject.toml configures them
lint: setup
	$(BIN)/ruff check sparkbook tests
	$(BIN)/mypy sparkbook

unit: setup lint
	$(PYTEST_UNITS)

# docs/params.md rendered from the params schema (tests/unit/test_paramsdoc.py fails while it differs)
docs: setup
	$(BIN)/python -c 'from sparkbook.core.values.paramsdoc import render; print(render(), end="")' > docs/params.md

# sparkbook/stages/serve/router-pins/: vllm-router's wheels pinned by sha256 per Python and machine, from PyPI, each
# file then checked (pip --require-hashes --no-deps fetches exactly the set); `ARGS=--check` only checks them
router-pins: setup
	$(BIN)/python tests/router_pins.py $(ARGS)

# make test: every capability with at least one lab proof (tests/README.md), inside CI's time: the unit tests on both
# cores (pytest-xdist; they share no lab), then the lab's and nbval's in one session (they share the lab's set-ups),
# each with pytest's slowest durations at its end. make test-all adds the heavy scenarios marked `slow` (what they
# add: tests/README.md).
PYTEST_UNITS := $(BIN)/pytest tests/unit -n 2 --durations=10
PYTEST_LAB := $(BIN)/pytest tests/lab notebooks --nbval-lax --durations=30
test: lab $(BROWSER) lint
	$(PYTEST_UNITS)
	$(PYTEST_LAB) -m "not benchmark and not slow"

test-all: lab $(BROWSER) lint
	$(PYTEST_UNITS)
	$(PYTEST_LAB) -m "not benchmark"

bench: lab
	$(BIN)/pytest tests -m benchmark -s
