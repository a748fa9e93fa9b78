"""How often a learner session reports progress (SyncClient._progress_interval_s): twice per round
slot of the syncer it talks to. A fragment shard serving F of P fragments opens a round every H / F
steps, so its session reports N times less often than an unsharded syncer's (issue 21: at fast steps
every shard otherwise spent as much CPU on progress as one syncer serving all P)."""

from __future__ import annotations

import pytest

from ddiloco.learner import client as client_lib
from ddiloco.v1 import syncer_pb2


def _session(num_fragments: int = 8, sync_period_steps: int = 16) -> client_lib.SyncClient:
    client = client_lib.SyncClient(client_lib.ClientConfig(target="127.0.0.1:1", learner_id="l", incarnation=1,
                                                           region="r", tokens_per_step=64))
    client.run_config = syncer_pb2.RunConfig(num_fragments=num_fragments, sync_period_steps=sync_period_steps)
    return client


def _progress(step_time_s: float) -> syncer_pb2.ReportProgressRequest:
    return syncer_pb2.ReportProgressRequest(step_time_s=step_time_s)


def test_an_unsharded_session_reports_twice_per_fragment_slot():
    client = _session()
    # slot = 0.02 s/step * 16 steps / 8 fragments = 0.04 s: every 0.02 s.
    assert client._progress_interval_s(_progress(0.02)) == pytest.approx(0.02)
    assert client._progress_interval_s(_progress(10.0)) == client.cfg.progress_interval_s  # slow steps: the cap
    assert client._progress_interval_s(None) == client.cfg.progress_interval_s


@pytest.mark.parametrize("shards", [2, 4])
def test_a_shard_session_reports_as_often_as_its_own_rounds_need(shards):
    client = _session()
    client.shards = [syncer_pb2.SyncerShard(index=i, fragment_ids=[f for f in range(8) if f % shards == i])
                     for i in range(shards)]
    client.shard_index = 1
    # The shard serves 8 / shards fragments: its rounds come every 16 / (8 / shards) steps.
    assert client._progress_interval_s(_progress(0.02)) == pytest.approx(0.02 * shards)
    assert client._progress_interval_s(_progress(0.005)) == client_lib.MIN_PROGRESS_INTERVAL_S  # never faster
