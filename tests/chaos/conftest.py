"""Fixtures for the chaos tier: one fault-free baseline per session (I5's reference), a shared JAX
compilation cache (restarted services reuse compiled steps, and every run's learners reuse the
session's: tests/conftest.py), and `run_scenario`, which runs a named scenario of
ddiloco/chaos/scenarios.py once per session and prints its one-line report.

Reproduce any test from the command line: `ddiloco chaos run --scenario NAME --seed 1`.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from ddiloco.chaos import harness, scenarios

SEED = int(os.environ.get("DDILOCO_CHAOS_SEED", "1"))


@pytest.fixture(scope="session")
def jax_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax-cache")


def build(name: str, learner_cache) -> tuple[harness.Scenario, list]:
    """The named scenario, its learners on the session's compilation cache instead of one per run
    (the harness's default, <workdir>/jax-cache; the later flag wins): the same programs, compiled
    once per session instead of once per run."""
    scenario, events = scenarios.build(name, SEED)
    args = (*scenario.learner_args, "--compilation-cache-dir", str(learner_cache))
    return dataclasses.replace(scenario, learner_args=args), events


@pytest.fixture(scope="session")
def baseline_loss(tmp_path_factory, jax_cache, learner_compilation_cache) -> float:
    scenario, events = build("baseline", learner_compilation_cache)
    result = harness.run_scenario(scenario, events, tmp_path_factory.mktemp("baseline"), jax_cache_dir=jax_cache)
    assert result.ok and result.loss is not None, "\n".join([result.report_line, *result.violations()])
    return result.loss


_RESULTS: dict[str, harness.Result] = {}


@pytest.fixture
def run_scenario(tmp_path_factory, jax_cache, baseline_loss, learner_compilation_cache, capsys):
    """Runs a named scenario once per session (the rows of a group share its run) and prints its
    one-line report."""

    def run(name: str) -> harness.Result:
        if name not in _RESULTS:
            scenario, events = build(name, learner_compilation_cache)
            _RESULTS[name] = harness.run_scenario(scenario, events, tmp_path_factory.mktemp(name),
                                                  baseline_loss=baseline_loss, jax_cache_dir=jax_cache)
            with capsys.disabled():
                print(f"\n{_RESULTS[name].report_line}")
        return _RESULTS[name]

    return run


def assert_invariants(result: harness.Result) -> None:
    """Every invariant held, including I5 (which must have run), and nothing was lost."""
    assert result.ok, "\n".join([result.report_line, *result.violations()])
    assert not result.check("I5").skipped, result.check("I5").skipped
    i1 = result.check("I1").figures
    assert i1["lost"] == 0 and i1["double_applied"] == 0, i1
