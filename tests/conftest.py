"""Fixtures for every tier. Helpers that tests call directly are plain modules beside this one:
tests/fakes.py (fake clock, SyncerCore factory), tests/waits.py (bounded polling), tests/ports.py
(local ports), tests/browser.py and tests/promtool.py (external tools)."""

from __future__ import annotations

import os
import pathlib

import pytest

from tests import fakes

# The learner's compilation cache, as its config reads it from the environment (services/learner/config.py).
LEARNER_CACHE_ENV = "DDILOCO_LEARNER_COMPILATION_CACHE_DIR"


@pytest.fixture
def clock() -> fakes.FakeClock:
    """A fake clock at 1000 s that moves only when the test moves it."""
    return fakes.FakeClock()


@pytest.fixture(scope="session", autouse=True)
def learner_compilation_cache(tmp_path_factory):
    """One XLA compilation cache for every learner process the session starts, as the shipped
    deployments give their learners one (docker-compose.yml, the kustomize base, `ddiloco up`):
    the tiny model's learner otherwise compiles for ~4 CPU-s at every start (services/learner/
    train.py), dozens of starts per session on 2 cores. Processes inherit it through the
    environment; a test that passes --compilation-cache-dir (or its own env) still gets its own,
    and a cache the developer set is kept."""
    if os.environ.get(LEARNER_CACHE_ENV):
        yield pathlib.Path(os.environ[LEARNER_CACHE_ENV])
        return
    path = tmp_path_factory.mktemp("learner-jax-cache")
    os.environ[LEARNER_CACHE_ENV] = str(path)
    try:
        yield path
    finally:
        os.environ.pop(LEARNER_CACHE_ENV, None)

