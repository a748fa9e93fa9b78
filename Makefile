# One entry point for set-up, running and testing. Every target installs what it needs first,
# into a project-local virtual environment (.venv), so a fresh clone needs nothing else.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install up test test-fast lint protos check-protos clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The main job: four learners, a syncer, a checkpoint store and an evaluator on 127.0.0.1.
up: install
	$(BIN)/ddiloco up $(ARGS)

# The whole test suite (CI runs exactly this): generated code fresh, lint clean, every test.
test: install check-protos lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .

# Unit and service tests only (seconds), for quick iterations.
test-fast: install
	$(BIN)/python -m pytest tests/unit tests/service $(PYTEST_ARGS)

protos: install
	$(BIN)/python scripts/gen_protos.py

check-protos: install
	$(BIN)/python scripts/gen_protos.py --check

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
