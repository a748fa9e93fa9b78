"""Syncer-scheduled rounds with real processes: every learner's work reaches the global model.

1. Three learners, one of them 2x slower, and a fourth that joins mid-run: every round is called
   by the syncer, the joiner contributes to the same rounds as the others, and at the end every
   token of every learner is merged (work merged = tokens_merged / (P x tokens processed) = 100%).
2. A learner SIGKILLed while rounds are open: the rounds close without it within the grace window
   and merges go on; the survivors' work is all merged at the end.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from tests.integration.conftest import LEARNER_PACE, TINY, SyncerProbe, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

STEPS = 120


def _work_merged(state) -> float:
    return state.tokens_merged / (len(state.fragments) * state.tokens_processed)


def _summary(cluster, index: int) -> dict:
    return json.loads((cluster.workdir / f"learner-{index}.summary.json").read_text())


def test_slow_and_late_learners_share_the_syncers_rounds_and_all_work_is_merged(cluster):
    syncer = cluster.start_syncer(run_id="rounds-mixed", extra=TINY)
    # The first three train long enough that the joiner (which compiles for seconds) trains beside them.
    # The 2x slower one takes 2/3 of the steps: it ends about when the others do (0.06 s instead of
    # 0.03 s of pacing per step, plus the same compute). With as many steps it trained alone for the
    # last third of the run, which merged its work the same way and tested nothing more.
    learner_args = ["--num-shards", "4"]
    cluster.start_learner(0, region="region-a", extra=["--steps", str(3 * STEPS), *learner_args, *LEARNER_PACE])
    cluster.start_learner(1, region="region-a", extra=["--steps", str(3 * STEPS), *learner_args, *LEARNER_PACE])
    cluster.start_learner(2, region="region-a", extra=["--steps", str(2 * STEPS), *learner_args,
                                                       "--step-delay-s", "0.06", "--log-every-steps", "50"])
    probe = SyncerProbe(syncer.address)
    try:
        wait_until(lambda: any(m.local_step >= 40 for m in probe.state().members), timeout_s=180,
                   what="learner-0 at step 40")
        joined_at = time.time()
        cluster.start_learner(3, region="region-a", extra=["--steps", str(STEPS), "--num-shards", "4", *LEARNER_PACE])
        # Every merge record, polled while they train: the training state keeps only the latest
        # ones, and the three long runs' merges after the joiner finished would push its out.
        merges: dict = {}
        deadline = time.monotonic() + 300
        while any(svc.alive() for svc in cluster.learners()) and time.monotonic() < deadline:
            merges.update({(m.fragment_id, m.version): m for m in probe.state().recent_merges})
            time.sleep(0.5)
        for svc in cluster.learners():
            assert svc.wait(10) == 0, svc.log_tail()
        state = probe.state()
        merges.update({(m.fragment_id, m.version): m for m in state.recent_merges})
    finally:
        probe.close()
    tokens = sum(_summary(cluster, i)["tokens"] for i in range(4))
    assert state.tokens_processed == tokens
    assert _work_merged(state) == pytest.approx(1.0), (state.tokens_merged, tokens)
    for i in range(4):
        summary = _summary(cluster, i)
        assert summary["finish"]["all_merged"], (i, summary["finish"])
        assert summary["merged_contributions"] > 0
    # The late joiner contributed to rounds that the others contributed to as well.
    shared = [m for m in merges.values() if m.merged_at_unix_s >= joined_at
              and "learner-3" in {c.learner_id for c in m.contributors} and len(m.contributors) >= 3]
    assert shared, [(m.fragment_id, [c.learner_id for c in m.contributors]) for m in merges.values()]
    # Rounds are the syncer's: every fragment went through numbered rounds.
    assert all(f.round > 0 for f in state.fragments)


def test_a_learner_killed_mid_round_does_not_hold_the_rounds_and_survivors_lose_nothing(cluster):
    syncer = cluster.start_syncer(run_id="rounds-kill", extra=TINY)
    learner_args = ["--steps", str(STEPS), "--num-shards", "3", *LEARNER_PACE]
    for i in range(3):
        cluster.start_learner(i, region="region-a", extra=learner_args)
    probe = SyncerProbe(syncer.address)
    try:
        wait_until(lambda: (s := probe.state()).outer_steps >= 8 and any(f.round_open for f in s.fragments),
                   timeout_s=180, what="a few merges and an open round")
        victim = cluster.services["learner-1"]
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(10)
        killed_at = time.time()
        killed_steps = probe.state().outer_steps
        # Rounds wait at most the grace window for the dead learner (it is still "live" until the
        # liveness timeout): merges go on.
        wait_until(lambda: probe.state().outer_steps >= killed_steps + 8, timeout_s=30,
                   what="merges after the kill")
        for i in (0, 2):
            assert cluster.services[f"learner-{i}"].wait(300) == 0, cluster.services[f"learner-{i}"].log_tail()
        state = probe.state()
    finally:
        probe.close()
    after = [m for m in state.recent_merges if m.merged_at_unix_s > killed_at + 1.0]
    assert after and all("learner-1" not in {c.learner_id for c in m.contributors} for m in after)
    for i in (0, 2):
        summary = _summary(cluster, i)
        assert summary["finish"]["all_merged"], summary["finish"]
    survivors = sum(_summary(cluster, i)["tokens"] for i in (0, 2))
    # Everything the survivors processed is merged; only the killed learner's last work is lost.
    victim_tokens = next(m.tokens_total for m in state.members if m.learner_id == "learner-1")
    merged_tokens = state.tokens_merged / len(state.fragments)
    assert merged_tokens >= survivors, (merged_tokens, survivors, victim_tokens)
