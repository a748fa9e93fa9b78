"""A real learner process's health endpoint: SERVING while its loop trains, NOT_SERVING once the loop
hangs while the process (its sync client, its health server) stays up.

The hang is the `learner.inner_step=stall@N` failpoint: the training thread blocks before step N
and every other thread goes on, as with a wedged device. (SIGSTOP would freeze the health server
too, and a probe that gets no answer proves nothing about the staleness rule.)
"""

from __future__ import annotations

import re
import signal

import pytest

from ddiloco import healthcheck
from tests.integration.conftest import LEARNER_PACE, TINY, SyncerProbe, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

LIVENESS_TIMEOUT_S = 4.0
STALL_AT_STEP = 120  # the hit before step 120: 119 steps are taken


def test_learner_health_turns_not_serving_when_its_training_loop_stalls(cluster):
    syncer = cluster.start_syncer(run_id="liveness", extra=TINY)
    learner = cluster.start_learner(0, region="eu", extra=[
        "--num-shards", "1", "--liveness-timeout-s", str(LIVENESS_TIMEOUT_S),
        "--failpoints", f"learner.inner_step=stall@{STALL_AT_STEP}", *LEARNER_PACE,
    ])
    # cluster.start_learner binds --health-bind 127.0.0.1:0; the learner logs the port it got.
    address = wait_until(lambda: _health_address(learner.log_path.read_text(errors="replace")),
                         timeout_s=60, what="the learner's 'health on' log line")
    probe = SyncerProbe(syncer.address)
    try:
        # Training: steps reach the syncer, and the endpoint says SERVING meanwhile.
        def serving_while_training():
            member = probe.member("learner-0")
            if member is None or not 5 <= member.local_step < STALL_AT_STEP - 1:
                return None
            code, message = healthcheck.check(address, timeout_s=5.0)
            assert code == healthcheck.EXIT_SERVING, message
            return member.local_step

        wait_until(serving_while_training, timeout_s=120, what="SERVING while the learner takes steps")

        # Stalled: the loop stops before step STALL_AT_STEP; within the bound (plus slack for a
        # loaded machine) the endpoint says NOT_SERVING, answered by the still-running process.
        def not_serving():
            code, message = healthcheck.check(address, timeout_s=5.0)
            assert code != healthcheck.EXIT_UNREACHABLE, f"the learner stopped answering: {message}"
            return code == healthcheck.EXIT_NOT_SERVING

        wait_until(not_serving, timeout_s=90, what="NOT_SERVING once the loop stalls", interval_s=0.5)
        assert learner.alive(), learner.log_tail()
        assert "failpoint learner.inner_step fired" in learner.log_path.read_text(errors="replace")
        # It stays NOT_SERVING (the loop does not come back) and the steps stay where they stopped.
        steps = probe.member("learner-0").local_step
        assert steps == STALL_AT_STEP - 1, steps
        assert healthcheck.check(address, timeout_s=5.0)[0] == healthcheck.EXIT_NOT_SERVING
    finally:
        probe.close()
        # A stalled loop never reads SIGTERM's stop flag: kill the learner we started, by PID,
        # rather than wait for the fixture's SIGTERM timeout.
        learner.signal(signal.SIGKILL)
        learner.wait(10.0)


def _health_address(log: str) -> str | None:
    match = re.search(r"health on (\S+:\d+)", log)
    return match.group(1) if match else None
