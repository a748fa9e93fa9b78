"""A fleet-wide token budget (syncer --token-budget) with real processes.

Three learners with no step limit of their own, one of them 3x slower: the run ends when all of
them together processed the budget. Each learner hears it in a progress answer, contributes its
remaining work and leaves; the slow learner does not hold the end back (the fast ones ran more
steps), the overshoot is at most what the fleet processes between two progress reports, and every
token processed is in the global model. A learner life that starts after the end (a restart that
comes back late) hears it at its join and leaves without an inner step.
"""

from __future__ import annotations

import json

import pytest

from ddiloco import models
from services.learner import config as learner_config
from tests.integration.conftest import LEARNER_PACE, TINY, SyncerProbe

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

BUDGET_STEPS = 300  # the budget, in inner steps of one learner's batch (~100 per learner)


def test_the_run_ends_at_the_fleets_token_budget_and_every_token_is_merged(cluster):
    tokens_per_step = learner_config.LearnerConfig().batch_size * models.get_model(
        "transformer", {"preset": "tiny"}).seq_len
    budget = BUDGET_STEPS * tokens_per_step
    syncer = cluster.start_syncer(run_id="budget", extra=[*TINY, "--token-budget", str(budget)])
    unbounded = ["--steps", "0", "--num-shards", "3"]
    cluster.start_learner(0, region="region-a", extra=[*unbounded, *LEARNER_PACE])
    cluster.start_learner(1, region="region-a", extra=[*unbounded, *LEARNER_PACE])
    cluster.start_learner(2, region="region-b", extra=[*unbounded, "--step-delay-s", "0.09", "--log-every-steps", "50"])
    for svc in cluster.learners():
        assert svc.wait(300) == 0, svc.log_tail()
    probe = SyncerProbe(syncer.address)
    try:
        state = probe.state()
    finally:
        probe.close()
    summaries = [json.loads((cluster.workdir / f"learner-{i}.summary.json").read_text()) for i in range(3)]
    assert all(s["tokens_per_step"] == tokens_per_step for s in summaries)
    assert all(s["budget_reached"] for s in summaries), [s["budget_reached"] for s in summaries]
    assert state.token_budget == budget
    # Spent, and not by much more: learners report every 0.05-1 s, a step takes >= 0.03 s here.
    assert budget <= state.tokens_processed <= budget + 3 * 40 * tokens_per_step, (state.tokens_processed, budget)
    assert state.tokens_processed == sum(s["tokens"] for s in summaries)
    # The slow learner did its share at its speed; the others made up the difference.
    assert summaries[2]["steps"] < min(summaries[0]["steps"], summaries[1]["steps"]), [s["steps"] for s in summaries]
    # Everything processed reached the global model (each learner's final contributions).
    assert all(s["finish"]["all_merged"] for s in summaries), [s["finish"] for s in summaries]
    assert state.tokens_merged == len(state.fragments) * state.tokens_processed

    # A life that starts once the budget is spent: told at the join, it takes no step and leaves.
    late = cluster.start_learner(3, region="region-b", extra=[*unbounded, *LEARNER_PACE])
    assert late.wait(120) == 0, late.log_tail()
    log = late.log_path.read_text()
    assert "reached before this life joined" in log and "first inner step" not in log, late.log_tail()
    late_summary = json.loads((cluster.workdir / "learner-3.summary.json").read_text())
    assert late_summary["steps"] == 0 and late_summary["tokens"] == 0 and late_summary["budget_reached"]
    probe = SyncerProbe(syncer.address)
    try:
        assert probe.state().tokens_processed == state.tokens_processed  # nothing past the end
    finally:
        probe.close()
