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
# JAX's own configuration, read from the environment once per process when JAX is imported: the
# persistent cache for every other process (syncers, evaluators, bench workers, CLI commands), with
# the settings the learner's enable_compilation_cache uses (services/learner/train.py). The chaos
# harness gives its services the same (ddiloco/chaos/harness.py).
JAX_CACHE_ENV = {
    "JAX_COMPILATION_CACHE_DIR": None,  # the session's directory
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    # Bounded: JAX then writes entries under a file lock, as processes starting together need.
    "JAX_COMPILATION_CACHE_MAX_SIZE": str(512 * 2**20),
}


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



@pytest.fixture(scope="session", autouse=True)
def jax_compilation_cache(learner_compilation_cache):
    """The learners' compilation cache for every other process the session starts too (through
    JAX's environment variables, JAX_CACHE_ENV): a syncer builds its initial fragments with eager
    JAX ops, ~3 CPU-s of small compilations at every start of the tiny model's syncer (0.5 CPU-s
    from the cache), and evaluators and CLI commands compile the model too; the suite starts
    hundreds of them on 2 cores. The same programs, compiled once per session: the processes'
    behaviour does not change. This process keeps JAX's defaults (it imports JAX first; the
    tests of the cache itself start their own interpreters), and a cache the developer set is
    kept."""
    import jax  # noqa: F401 - JAX reads its environment at import: this process is left as it was

    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        yield pathlib.Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
        return
    values = {**JAX_CACHE_ENV, "JAX_COMPILATION_CACHE_DIR": str(learner_compilation_cache)}
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield learner_compilation_cache
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
