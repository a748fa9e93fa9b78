"""The baselines and delta downloads end to end, with real processes on 127.0.0.1.

* dp: every step each learner sends its gradient and waits; each merge has every learner's
  gradient and learners end holding the syncer's exact parameters.
* diloco: all fragments due together every H steps; each merge has every learner; learners wait.
* decoupled with a lossy download codec: learners receive deltas and hold bit-identical copies
  of the syncer's published values.
"""

from __future__ import annotations

import json

import pytest

from ddiloco.algo import fragments as fragments_lib
from ddiloco.rpc import security as security_lib
from ddiloco.learner import client as client_lib
from tests.integration.conftest import TINY, SyncerProbe, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _run(cluster, run_id: str, syncer_extra: list[str], *, learners: int, steps: int):
    syncer = cluster.start_syncer(run_id=run_id, extra=[*TINY, *syncer_extra])
    for i in range(learners):
        cluster.start_learner(i, region="r", extra=["--steps", str(steps), "--num-shards", str(learners),
                                                    "--log-every-steps", "50"])
    probe = SyncerProbe(syncer.address)
    try:
        for svc in cluster.learners():
            assert svc.wait(240) == 0, svc.log_tail()
        state = probe.state()
    finally:
        probe.close()
    summaries = [json.loads((cluster.workdir / f"learner-{i}.summary.json").read_text()) for i in range(learners)]
    return state, summaries


def test_dp_mode_is_synchronous_data_parallel_training(cluster):
    state, summaries = _run(cluster, "dp", ["--sync-mode", "dp", "--min-quorum", "2"], learners=2, steps=12)
    assert state.config.sync_mode == "dp" and state.config.num_fragments == 1 and state.config.sync_period_steps == 1
    assert state.outer_steps == 12  # one AdamW step per learner step
    assert len(state.recent_merges) == 12
    assert all(sorted(c.learner_id for c in m.contributors) == ["learner-0", "learner-1"] for m in state.recent_merges)
    assert all(c.steps == 1 for m in state.recent_merges for c in m.contributors)
    fragment = state.fragments[0]
    assert fragment.version == 12
    for s in summaries:
        assert s["sync_mode"] == "dp" and s["steps"] == 12 and s["wait_s"] > 0
        assert s["held"]["0"] == {"version": 12, "sha256": fragment.published_sha256}
    # Both learners apply the same global parameters after every step: identical models.
    assert summaries[0]["params_sha256"] == summaries[1]["params_sha256"]
    assert state.evals == [] and state.bytes_in > 0


def test_diloco_mode_merges_every_fragment_together_with_every_learner(cluster):
    state, summaries = _run(cluster, "diloco", ["--sync-mode", "diloco", "--min-quorum", "2"], learners=2, steps=12)
    assert state.config.sync_mode == "diloco" and all(f.offset_steps == 0 for f in state.config.fragments)
    assert [f.version for f in state.fragments] == [3, 3, 3, 3]  # H = 4: at steps 4, 8 and 12
    assert all(len(m.contributors) == 2 and all(c.steps == 4 for c in m.contributors) for m in state.recent_merges)
    assert all(m.grace_window_s == 0.0 for m in state.recent_merges)
    for s in summaries:
        assert s["wait_s"] > 0
        for f in state.fragments:
            assert s["held"][str(f.fragment_id)] == {"version": 3, "sha256": f.published_sha256}


def test_lossy_downloads_arrive_as_deltas_and_learners_hold_the_syncers_bytes(cluster):
    syncer = cluster.start_syncer(run_id="delta", extra=[*TINY, "--download-codec", "int8"])
    # A passive learner in this process (joins and watches, never uploads), to compare what a
    # learner holds with the syncer after the run: the trainers' last versions move on after
    # they leave.
    watcher = client_lib.SyncClient(client_lib.ClientConfig(
        target=syncer.address, learner_id="watcher-9", incarnation=1, region="r", tokens_per_step=0,
        call_timeout_s=5.0, retry_bound_s=10.0, security=security_lib.ClientSecurity(insecure=True)))
    probe = SyncerProbe(syncer.address)
    try:
        watcher.start(timeout_s=60.0)
        for i in range(2):
            cluster.start_learner(i, region="r", extra=["--steps", "40", "--num-shards", "2", "--log-every-steps", "50"])
        for svc in cluster.learners():
            assert svc.wait(240) == 0, svc.log_tail()

        def settled():
            state = probe.state(0)
            held = watcher.held_values()
            return state if all(held[f.fragment_id][0] == f.version for f in state.fragments) else None

        state = wait_until(settled, timeout_s=60, what="the watcher to hold every final version")
        held = watcher.held_values()
        stats = watcher.stats
    finally:
        watcher.close(leave=True)
        probe.close()
    assert stats.delta_fragments_received > 0 and stats.delta_fragments_received >= stats.fragments_received // 2
    for f in state.fragments:
        assert f.version > 0
        assert fragments_lib.fragment_sha256(held[f.fragment_id][1]) == f.published_sha256
    # The syncer's own parameters differ from what it published (lossy downloads), by design.
    assert any(f.params_sha256 != f.published_sha256 for f in state.fragments)
    summaries = [json.loads((cluster.workdir / f"learner-{i}.summary.json").read_text()) for i in range(2)]
    assert all(s["client"]["delta_fragments_received"] > 0 for s in summaries), summaries
