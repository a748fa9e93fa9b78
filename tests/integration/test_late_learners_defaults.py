"""Late and restarted learners under the syncer's shipped robustness defaults (issue 24).

The container tests turned quarantine off because, with the tiny model, a learner that started or
restarted late sent first pseudo-gradients far above the others' (their inner learning rate was
already decaying, its own at the peak of a fresh warm-up) and honest learners were quarantined for
an hour. This is the same case as real processes, without containers and without any robustness
flag: the syncer runs its defaults (norm bound refusing, quarantine after 3 strikes, direction
check, influence bounds), as the compose files do (quorum 1, liveness timeout 4 s, H = 4, P = 4).

Three learners train; once they are well into their run a fourth starts, and one of the three is
SIGKILLed and started again (a new life, fresh optimizer, from the current global model). No
learner may be quarantined, every learner's contributions must merge after it (re)started, and
every learner ends with all of its work merged.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from tests.integration.conftest import SyncerProbe, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# The compose files' training settings (docker-compose.yml and tests/docker/test_compose_e2e.py).
SYNCER_ARGS = ["--model-config", json.dumps({"preset": "tiny"}), "--num-fragments", "4", "--sync-period-steps", "4",
               "--min-quorum", "1", "--liveness-timeout-s", "4"]
LEARNER_ARGS = ["--num-shards", "4", "--batch-size", "8", "--step-delay-s", "0.03", "--log-every-steps", "50"]
STEPS = 360  # the first three learners'
LATE_STEPS = 120  # the late starter's and the restarted life's: all of it while the others train on
LATE_AT_STEP = 150  # the late ones come in once the others' learning rate decays
FLAG_QUARANTINED = 16  # MemberState.flags: quarantined at least once


def _summary(cluster, index: int) -> dict:
    return json.loads((cluster.workdir / f"learner-{index}.summary.json").read_text())


def test_late_and_restarted_learners_are_merged_and_never_quarantined_under_the_shipped_defaults(cluster):
    syncer = cluster.start_syncer(run_id="late-defaults", extra=SYNCER_ARGS)
    for i in range(3):
        cluster.start_learner(i, region="region-a", extra=["--steps", str(STEPS), *LEARNER_ARGS])
    probe = SyncerProbe(syncer.address)
    quarantined: set[str] = set()
    merges: dict = {}
    rejections: dict[str, dict[str, int]] = {}

    def poll():
        state = probe.state()
        merges.update({(m.fragment_id, m.version): m for m in state.recent_merges})
        for m in state.members:
            if m.quarantined or m.flags & FLAG_QUARANTINED:
                quarantined.add(m.learner_id)
            rejections[m.learner_id] = dict(m.rejections)
        return state

    try:
        wait_until(lambda: len((s := poll()).members) == 3 and min(m.local_step for m in s.members) >= LATE_AT_STEP,
                   timeout_s=300, what=f"three learners at step {LATE_AT_STEP}")
        late_at = time.time()
        cluster.start_learner(3, region="region-b", extra=["--steps", str(LATE_STEPS), *LEARNER_ARGS])
        victim = cluster.services["learner-1"]
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(10)
        time.sleep(5.0)  # past the liveness timeout: the syncer has dropped it from the rounds
        restarted_at = time.time()
        victim.start(["--steps", str(LATE_STEPS)])  # a new life (incarnation: its start time)
        deadline = time.monotonic() + 400
        while any(svc.alive() for svc in cluster.learners()) and time.monotonic() < deadline:
            poll()
            time.sleep(0.5)
        for svc in cluster.learners():
            assert svc.wait(10) == 0, svc.log_tail()
        state = poll()
    finally:
        probe.close()
    print("refusals by learner:", rejections)
    assert not quarantined, f"honest learners quarantined under the shipped defaults: {quarantined} ({rejections})"
    contributed_after = {
        lid: any(lid in {c.learner_id for c in m.contributors} and m.merged_at_unix_s > since
                 for m in merges.values())
        for lid, since in (("learner-0", late_at), ("learner-2", late_at), ("learner-3", late_at),
                           ("learner-1", restarted_at))}
    assert all(contributed_after.values()), contributed_after
    for i in range(4):  # learner-1: its second life's summary
        summary = _summary(cluster, i)
        assert summary["finish"]["all_merged"], (i, summary["finish"], rejections)
        assert summary["merged_contributions"] > 0, (i, summary)
    assert all(not m.quarantined for m in state.members)
