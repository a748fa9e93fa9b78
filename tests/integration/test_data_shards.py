"""Data shards assigned by the syncer, with real processes: a syncer and three learners whose ids
carry no shard number (as `--learner-id auto` makes them from container ids in compose; on one host
they would all get the same hostname, so the test spells such ids out).

Before the syncer assigned shards, each took sha256(id) % shards, and these three ids put two
learners on one shard. Now each trains its own: the shard the learner reports in its summary is the
one the syncer's training state shows, and no two are equal.
"""

from __future__ import annotations

import json

import pytest

from ddiloco.v1 import syncer_pb2
from services.learner import config as learner_config
from tests.integration.conftest import LEARNER_PACE, TINY, SyncerProbe, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

IDS = ["region-a-3f2a9c1b0e1a", "region-a-77c0ffee00b2", "region-b-0d15ea5e0c3f"]
NUM_SHARDS = 3


def test_learners_without_a_shard_number_train_the_distinct_shards_the_syncer_assigns(cluster):
    hashed = [learner_config.LearnerConfig(learner_id=lid, num_shards=NUM_SHARDS).resolved_shard_index for lid in IDS]
    assert len(set(hashed)) < NUM_SHARDS, hashed  # the old rule would have collided on these ids
    syncer = cluster.start_syncer(run_id="shards", extra=TINY)
    for index, learner_id in enumerate(IDS):
        cluster.start_learner(index, region=learner_id.rsplit("-", 1)[0],
                              extra=["--learner-id", learner_id, "--steps", "0", "--num-shards", str(NUM_SHARDS),
                                     *LEARNER_PACE])
    probe = SyncerProbe(syncer.address)
    try:
        def all_training():
            members = {m.learner_id: m for m in probe.state(0).members}
            ok = set(members) == set(IDS) and all(
                m.status == syncer_pb2.MemberState.STATUS_ACTIVE and m.local_step > 0 for m in members.values())
            return members if ok else None

        members = wait_until(all_training, timeout_s=300, what="three learners training at once")
    finally:
        probe.close()
    cluster.stop_all(timeout_s=30.0)  # SIGTERM: each learner finishes and writes its summary
    summaries = {s["learner_id"]: s for s in (
        json.loads((cluster.workdir / f"learner-{i}.summary.json").read_text()) for i in range(len(IDS)))}
    assert sorted(m.data_shard for m in members.values()) == list(range(NUM_SHARDS)), members
    assert all(m.data_shard_assigned and m.num_data_shards == NUM_SHARDS for m in members.values())
    assert {lid: s["data_shard"] for lid, s in summaries.items()} == {lid: m.data_shard for lid, m in members.items()}
