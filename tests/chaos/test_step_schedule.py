"""Step-gated faults (`FaultEvent.at_step`, what `ddiloco bench goodput` uses) in a real run.

Two learners in the synchronous DiLoCo mode (quorum = both, the goodput benchmark's `diloco`): a
SIGKILL of learner-1 gated on its 60th inner step and a SIGSTOP of learner-0 gated on its 120th.
The faults fire at those points of the training (not at a wall time), the restarted learner runs
only the steps its first life did not report, and the run keeps its invariants.
"""

from __future__ import annotations

import re

import pytest

from ddiloco.chaos import harness
from ddiloco.chaos.schedule import FaultEvent

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.timeout(300)]


def test_step_gated_faults_fire_at_the_target_learners_step(tmp_path, jax_cache, learner_compilation_cache):
    scenario = harness.Scenario(name="step-gated", seed=1, learners=2, min_quorum=2, steps=200, step_delay_s=0.03,
                                syncer_args=("--sync-mode", "diloco"),
                                learner_args=("--compilation-cache-dir", str(learner_compilation_cache)),
                                finish_grace_s=5.0, max_wall_s=240.0)
    events = [FaultEvent(0.0, "kill", "learner-1", {"restart_after_s": 0.5}, at_step=60),
              FaultEvent(0.0, "stop", "learner-0", {"duration_s": 1.0}, at_step=120)]
    result = harness.run_scenario(scenario, events, tmp_path, jax_cache_dir=jax_cache)
    print(result.report_line)
    assert result.ok, "\n".join([result.report_line, *result.violations()])
    assert not result.not_injected and [(f.kind, f.target) for f in result.faults] == [
        ("kill", "learner-1"), ("stop", "learner-0")]
    for fault, ev in zip(result.faults, events, strict=True):
        step = int(re.search(r"at step (\d+)", fault.detail).group(1))
        # At or after its step; the progress poll lags by well under 40 steps at this pace.
        assert ev.at_step <= step < ev.at_step + 40, (fault, ev)
    kill = result.faults[0]
    assert kill.recovery_s is not None, kill  # the restarted learner-1 contributed again
    assert result.summaries["learner-1"] is not None and result.summaries["learner-1"]["steps"] < 200


def test_a_job_scoped_kill_restarts_every_learner_and_the_run_keeps_its_invariants(tmp_path, jax_cache):
    """kill_scope "job" (the goodput benchmark's dp-job / diloco-job): one learner's kill takes the whole
    learner job down, every learner restarts after the kill's delay and rejoins the syncer's state."""
    scenario = harness.Scenario(name="job-kill", seed=1, learners=2, min_quorum=2, steps=120, step_delay_s=0.03,
                                syncer_args=("--sync-mode", "diloco"),
                                finish_grace_s=5.0, max_wall_s=200.0, kill_scope="job")
    events = [FaultEvent(0.0, "kill", "learner-1", {"restart_after_s": 0.5}, at_step=50)]
    result = harness.run_scenario(scenario, events, tmp_path, jax_cache_dir=jax_cache)
    print(result.report_line)
    assert result.ok, "\n".join([result.report_line, *result.violations()])
    [kill] = result.faults
    assert "job restart: 1 other learners killed" in kill.detail, kill
    assert kill.recovery_s is not None, kill
    # Both learners' last lives started after the kill: each ran only the steps left to it.
    for name in ("learner-0", "learner-1"):
        assert result.summaries[name] is not None and result.summaries[name]["steps"] < 120, (name, result.summaries)
