"""ShardedSyncClient's start (ddiloco/learner/sharded.py): pointed at any shard, shard 0 is joined
first; a shard down at the start does not fail the join, its fragments start from the learner's
own initial values. With fake sessions; tests/integration/test_fragment_shards_start.py runs the
same with real processes.

Before this change a learner given shard 1's address pinned its fallback data shard and never
asked shard 0 first, and a shard down at the start raised TimeoutError out of `start()`.
"""

from __future__ import annotations

import numpy as np
import pytest

from ddiloco.learner import client as client_lib
from ddiloco.learner import ports
from ddiloco.learner import sharded as sharded_lib
from ddiloco.v1 import syncer_pb2

MAP = [syncer_pb2.SyncerShard(index=0, addresses=["a:1"], fragment_ids=[0, 2]),
       syncer_pb2.SyncerShard(index=1, addresses=["b:1"], fragment_ids=[1, 3])]


class _Shard(ports.NullSyncClient):
    """A session to one shard: "a:1" is shard 0 (assigns data shard 3), "b:1" shard 1; targets in `down` time out."""

    down: set[str] = set()
    log: list[tuple[str, str]] = []

    def __init__(self, cfg: client_lib.ClientConfig) -> None:
        self.cfg = cfg
        self.instance = ""
        self.shards: list[syncer_pb2.SyncerShard] = []
        self.shard_index = 0
        self.data_shard = cfg.data_shard
        self.schedule_start_step = 0
        self.budget_reached = False
        self.stats = client_lib.ClientStats()
        self.run_config = syncer_pb2.RunConfig(num_fragments=4)
        self.updates: list[client_lib.GlobalFragment] = []

    def start(self, timeout_s: float) -> syncer_pb2.RunConfig:
        first = self.cfg.target.split(",")[0]
        _Shard.log.append(("start", first))
        if first in _Shard.down:
            raise TimeoutError(f"could not join {first}")
        self.instance, self.shards, self.shard_index = f"life-{first}", MAP, 0 if first == "a:1" else 1
        if self.data_shard < 0:  # asked to assign: only shard 0 does; another gives the fallback
            self.data_shard = 3 if first == "a:1" else self.cfg.fallback_data_shard
        return self.run_config

    def take_updates(self):
        out, self.updates = self.updates, []
        return out

    def close(self, *, leave: bool, timeout_s: float = 5.0) -> None:
        _Shard.log.append(("close", self.cfg.target))


def _cfg(target: str, initial_values=None) -> client_lib.ClientConfig:
    return client_lib.ClientConfig(target=target, learner_id="l", incarnation=1, region="r", tokens_per_step=0,
                                   num_data_shards=4, fallback_data_shard=1, initial_values=initial_values)


@pytest.fixture(autouse=True)
def _reset():
    _Shard.down, _Shard.log = set(), []


def test_given_another_shards_address_the_learner_joins_shard_zero_first_and_pins_its_data_shard():
    client = sharded_lib.ShardedSyncClient(_cfg("b:1"), session_factory=_Shard)
    client.start(5.0)
    assert _Shard.log == [("start", "b:1"), ("close", "b:1"), ("start", "a:1"), ("start", "b:1")]
    assert client.data_shard == 3 and client.session_of(1).cfg.data_shard == 3
    assert client.instance_of(0) == "life-a:1" and client.instance_of(3) == "life-b:1"


def test_a_shard_down_at_the_start_leaves_its_fragments_on_the_learners_own_initial_values():
    _Shard.down = {"b:1"}
    own = {fid: np.full(2, fid, np.float32) for fid in range(4)}
    client = sharded_lib.ShardedSyncClient(_cfg("a:1", lambda _run_config: own), session_factory=_Shard,
                                           shard_join_wait_s=0.5)
    client.start(5.0)  # before: TimeoutError
    assert client.instance_of(0) == "life-a:1" and client.instance_of(1) == ""  # shard 1 not joined (yet)
    assert client.session_of(1).data_shard == 3  # its late join pins shard 0's data shard
    first = client.take_updates()
    assert [(u.fragment_id, u.version, u.syncer_instance) for u in first] == [(1, 0, ""), (3, 0, "")]
    assert all(np.array_equal(u.values, own[u.fragment_id]) for u in first)
    assert client.take_updates() == []  # once


def test_a_shard_down_without_initial_values_to_train_from_fails_the_start():
    _Shard.down = {"b:1"}
    client = sharded_lib.ShardedSyncClient(_cfg("a:1"), session_factory=_Shard, shard_join_wait_s=0.2)
    with pytest.raises(TimeoutError, match="no initial values"):
        client.start(5.0)


def test_given_shard_1_while_shard_0_is_down_the_learner_trains_on_shard_1_with_its_own_data_shard():
    _Shard.down = {"a:1"}
    client = sharded_lib.ShardedSyncClient(_cfg("b:1", lambda _rc: {f: np.zeros(2, np.float32) for f in range(4)}),
                                           session_factory=_Shard, shard_join_wait_s=0.2)
    client.start(5.0)
    assert client.instance_of(1) == "life-b:1" and client.instance_of(0) == ""
    assert client.data_shard == 1  # the learner's own choice (fallback), pinned on every shard
    assert client.session_of(0).data_shard == 1 and client.session_of(1).cfg.data_shard == 1
    assert sorted(u.fragment_id for u in client.take_updates()) == [0, 2]


def test_given_a_list_of_shards_each_session_is_reopened_on_its_own_shards_addresses():
    """A session given "a:1,b:1" would fail over from shard 0 to shard 1: it is replaced by one on
    shard 0's own addresses, which keeps the data shard shard 0 assigned."""
    client = sharded_lib.ShardedSyncClient(_cfg("a:1,b:1"), session_factory=_Shard)
    client.start(5.0)
    assert _Shard.log == [("start", "a:1"), ("close", "a:1,b:1"), ("start", "a:1"), ("start", "b:1")]
    assert client.session_of(0).cfg.target == "a:1" and client.session_of(1).cfg.target == "b:1"
    assert client.data_shard == 3 and client.session_of(0).cfg.data_shard == 3
