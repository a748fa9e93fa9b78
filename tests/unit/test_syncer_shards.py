"""Fragment shards (docs/architecture.md, "Fragment shards"): the shard map's parsing, the syncer's
ownership (what a shard refuses, answers, schedules and checkpoints) and the learner's routing
over one session per shard (ddiloco/learner/sharded.py).

Each test fails without the shards code: an unsharded core takes every upload and checkpoints
every fragment, a SyncClient alone sends every upload to one syncer.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ddiloco.algo import shards as shards_lib
from ddiloco.learner import client as client_lib
from ddiloco.learner import ports
from ddiloco.learner import sharded as sharded_lib
from ddiloco.rpc import errors
from ddiloco.v1 import syncer_pb2
from ddiloco.wire import serde
from services.syncer import checkpointing
from services.syncer import config as config_lib
from services.syncer import wire_views
from tests.fakes import FakeClock, join, join_request, make_core, settle_until, upload
from tests.unit import test_learner_resend

MAP = "127.0.0.1:7001|127.0.0.1:7101,127.0.0.1:7002"


# ------------------------------------------------------------------------------------- the map


def test_the_shard_map_parses_entries_in_order_with_failover_addresses():
    assert shards_lib.parse_shard_map(MAP) == (("127.0.0.1:7001", "127.0.0.1:7101"), ("127.0.0.1:7002",))
    assert shards_lib.parse_shard_map("  ") == ()
    assert shards_lib.format_shard_map(shards_lib.parse_shard_map(MAP)) == MAP


@pytest.mark.parametrize("text,match", [("a:1,,b:2", "shard 1 .* no address"), ("a:1,b", "must be host:port"),
                                        ("a:1|:2", "must be host:port"), ("a:x", "must be host:port")])
def test_a_bad_shard_map_is_refused_naming_the_entry(text, match):
    with pytest.raises(ValueError, match=match):
        shards_lib.parse_shard_map(text)


def test_the_layout_names_owners_and_a_checkpoint_namespace_per_shard():
    layout = shards_lib.ShardLayout(num_fragments=5, index=1, addresses=shards_lib.parse_shard_map("a:1,b:2"))
    assert layout.owned == (1, 3) and layout.fragments_of(0) == (0, 2, 4)
    assert [layout.owner_of(f) for f in range(5)] == [0, 1, 0, 1, 0]
    assert layout.store_run_id("run") == "run.shard-1-of-2"
    unsharded = shards_lib.ShardLayout(num_fragments=5)
    assert unsharded.owned == (0, 1, 2, 3, 4) and unsharded.store_run_id("run") == "run"


def test_the_syncer_flags_parse_the_map_and_refuse_a_bad_index():
    cfg = config_lib.parse_config(["--num-fragments", "4", "--fragment-shard", "1", "--fragment-shards", MAP], {})
    assert cfg.shard_layout.owned == (1, 3) and cfg.store_run_id == "default.shard-1-of-2"
    env = config_lib.parse_config(["--num-fragments", "4"], {"DDILOCO_SYNCER_FRAGMENT_SHARDS": MAP,
                                                               "DDILOCO_SYNCER_FRAGMENT_SHARD": "1"})
    assert env.shard_layout == cfg.shard_layout
    with pytest.raises(ValueError, match="fragment_shards.*outside"):
        config_lib.SyncerConfig(num_fragments=4, fragment_shard=2, fragment_shards=MAP)
    with pytest.raises(ValueError, match="fragment_shards.*at least as many fragments"):
        config_lib.SyncerConfig(num_fragments=1, fragment_shards=MAP)
    assert config_lib.SyncerConfig().store_run_id == "default"  # unsharded: the run's own namespace


# ---------------------------------------------------------------------------- the syncer shard


def _shard_core(clock, index: int, **overrides):
    layout = shards_lib.ShardLayout(num_fragments=2, index=index, addresses=shards_lib.parse_shard_map(MAP))
    return make_core(clock, shard_layout=layout, **overrides)


def test_a_shard_refuses_another_shards_fragment_naming_its_owner():
    async def run():
        core = _shard_core(FakeClock(), 0)
        join(core, "l1")
        with pytest.raises(errors.FailedPrecondition, match="fragment 1 belongs to syncer shard 1 .*127.0.0.1:7002"):
            await upload(core, "l1", 1, 0, np.full(core.plan.fragments[1].numel, 0.1))
        await upload(core, "l1", 0, 0, np.full(core.plan.fragments[0].numel, 0.1))
        await settle_until(lambda: core.slots[0].version == 1)  # the first merge may compile for seconds
        assert core.versions() == {0: 1}  # its own fragment merged; the other is not even listed
        assert core.slots[1].version == 0 and core.uploads["rejected_not_owner"] == 1

    asyncio.run(run())


def test_join_and_training_state_carry_the_map_and_only_owned_fragments():
    core = _shard_core(FakeClock(), 1)
    answer = join(core, "l1")
    assert [list(s.addresses) for s in answer.shards] == [["127.0.0.1:7001", "127.0.0.1:7101"], ["127.0.0.1:7002"]]
    assert [list(s.fragment_ids) for s in answer.shards] == [[0], [1]] and answer.shard_index == 1
    assert serde.versions_from_proto(answer.fragment_versions) == {1: 0} and set(answer.published_sha256) == {1}
    state = wire_views.training_state(core, 0)
    assert [f.fragment_id for f in state.fragments] == [1] and state.shard_index == 1 and len(state.shards) == 2
    unsharded = join(make_core(FakeClock()), "l1")
    assert not unsharded.shards and set(unsharded.published_sha256) == {0, 1}


def test_only_shard_zero_assigns_data_shards():
    request = syncer_pb2.JoinRequest(protocol_version=serde.PROTOCOL_VERSION, learner_id="l1", incarnation=1,
                                     num_data_shards=4, data_shard=2, assign_data_shard=True)
    assert join_request(_shard_core(FakeClock(), 0), request).data_shard_assigned
    other = join_request(_shard_core(FakeClock(), 1), request)
    assert not other.data_shard_assigned and other.data_shard == 2  # the learner's pinned one, recorded


def test_a_scheduled_shard_opens_rounds_only_for_its_fragments():
    core = _shard_core(FakeClock(), 1, round_trigger="schedule")
    join(core, "l1")
    for step in range(10):  # several periods of the schedule (H = 2): both fragments fall due
        core.rounds.schedule.observe(("l1", 1), step, 1)
        core.rounds.open_due()
    assert core.slots[1].rounds_opened > 0 and core.slots[0].rounds_opened == 0


def test_a_shard_checkpoints_and_restores_only_its_fragments_and_refuses_another_layout():
    async def run():
        core = _shard_core(FakeClock(), 1)
        join(core, "l1")
        await upload(core, "l1", 1, 0, np.full(core.plan.fragments[1].numel, 0.05))
        await settle_until(lambda: core.slots[1].version == 1)
        blobs, _ = checkpointing.encode_snapshot(await core.snapshot())
        assert sorted(n for n in blobs if n.startswith("fragment/")) == ["fragment/1"]
        restored = _shard_core(FakeClock(), 1)
        restored.restore(checkpointing.load_snapshot(blobs))
        assert restored.versions() == {1: 1} and restored.restored_from_checkpoint
        assert restored.slots[1].params.tobytes() == core.slots[1].params.tobytes()
        with pytest.raises(ValueError, match="shard 0 of 2 .* owns \\[0\\].*different .*shard layout"):
            _shard_core(FakeClock(), 0).restore(checkpointing.load_snapshot(blobs))
        with pytest.raises(ValueError, match="unsharded .* owns \\[0, 1\\]"):
            make_core(FakeClock()).restore(checkpointing.load_snapshot(blobs))

    asyncio.run(run())


# ---------------------------------------------------------------------------- the learner's routing


class _Session(ports.NullSyncClient):
    """A SyncClient stand-in for one shard: `joins` answers its Join with `shards` / `shard_index`."""

    made: list["_Session"] = []

    def __init__(self, cfg: client_lib.ClientConfig) -> None:
        self.cfg = cfg
        self.instance = f"life-of-{cfg.target}"
        self.shards: list[syncer_pb2.SyncerShard] = []
        self.shard_index = 0
        self.data_shard = 3
        self.schedule_start_step = 0
        self.budget_reached = False
        self.stats = client_lib.ClientStats(uploads_accepted=1)
        self.run_config = syncer_pb2.RunConfig(num_fragments=4)
        self.started = self.closed = False
        self.jobs: list[client_lib.UploadJob] = []
        self.progress: list = []
        self.updates: list[client_lib.GlobalFragment] = []
        _Session.made.append(self)

    def start(self, timeout_s: float) -> syncer_pb2.RunConfig:
        self.started = True
        if self.cfg.target == "first:1":  # the syncer the learner was pointed at: shard 0 of 2
            self.shards = [syncer_pb2.SyncerShard(index=0, addresses=["first:1"], fragment_ids=[0, 2]),
                           syncer_pb2.SyncerShard(index=1, addresses=["b:1", "b2:1"], fragment_ids=[1, 3])]
        return self.run_config

    def submit_upload(self, job: client_lib.UploadJob) -> None:
        self.jobs.append(job)

    def set_progress(self, request) -> None:
        self.progress.append(request)

    def take_updates(self):
        out, self.updates = self.updates, []
        return out

    def close(self, *, leave: bool, timeout_s: float = 5.0) -> None:
        self.closed = True


def _job(fid: int, instance: str) -> client_lib.UploadJob:
    return client_lib.UploadJob(fragment_id=fid, base_version=1, syncer_instance=instance, steps=1, tokens=1,
                                delta=np.zeros(2, np.float32), local_step=1)


def _client_config(target: str) -> client_lib.ClientConfig:
    return client_lib.ClientConfig(target=target, learner_id="l", incarnation=1, region="r", tokens_per_step=0,
                                   num_data_shards=4, failpoints="learner.inner_step=crash@9")


def test_the_learner_opens_one_session_per_shard_and_routes_each_fragment_to_its_owner():
    _Session.made = []
    client = sharded_lib.ShardedSyncClient(_client_config("first:1"), session_factory=_Session)
    client.start(5.0)
    first, second = _Session.made
    assert second.started and second.cfg.target == "b:1,b2:1"  # the shard's failover list, in order
    assert second.cfg.data_shard == 3 and second.cfg.failpoints == ""  # pins the first's data shard
    assert client.instance_of(1) == "life-of-b:1,b2:1" and client.instance_of(2) == "life-of-first:1"
    client.submit_upload(_job(3, client.instance_of(3)))
    client.submit_upload(_job(0, client.instance_of(0)))
    assert [j.fragment_id for j in first.jobs] == [0] and [j.fragment_id for j in second.jobs] == [3]
    client.set_progress(syncer_pb2.ReportProgressRequest(local_step=7))
    assert len(first.progress) == len(second.progress) == 1  # every shard counts the learner's tokens
    first.updates = [client_lib.GlobalFragment(0, 2, first.instance, np.zeros(2, np.float32))]
    second.updates = [client_lib.GlobalFragment(1, 5, second.instance, np.zeros(2, np.float32))]
    assert sorted((u.fragment_id, u.version) for u in client.take_updates()) == [(0, 2), (1, 5)]
    assert client.stats.uploads_accepted == 2
    second.fenced = client_lib.FencedError("newer life")
    assert client.fenced is second.fenced
    client.close(leave=True)
    assert first.closed and second.closed


def test_without_a_shard_map_the_learner_has_its_one_session():
    _Session.made = []
    client = sharded_lib.ShardedSyncClient(_client_config("plain:1"), session_factory=_Session)
    client.start(5.0)
    (only,) = _Session.made
    client.submit_upload(_job(3, only.instance))
    assert [j.fragment_id for j in only.jobs] == [3] and client.stats is only.stats
    assert client.instance_of(3) == only.instance == client.instance
    assert isinstance(client, ports.SyncClientLike)


class _ShardedCallClient(test_learner_resend._CallClient):
    """Two shards' lives: fragment 0 from shard A's, fragment 1 from shard B's."""

    def __init__(self) -> None:
        super().__init__()
        self.lives = {0: "life-a", 1: "life-b"}

    def instance_of(self, fragment_id: int) -> str | None:
        return self.lives[fragment_id]


def test_the_loop_answers_each_fragments_call_against_its_own_shards_life():
    # With one `instance` for the whole client, fragment 1 (held from shard B's life) was never
    # answered; and a restart of shard B must not drop fragment 0's call.
    client = _ShardedCallClient()
    loop, client, plan = test_learner_resend._make_loop(client, version=3, instance="life-a")
    client.inbox = [client_lib.GlobalFragment(1, 3, "life-b", loop.global_copy[1])]
    loop.apply_updates()
    for _ in range(2):
        loop.step()
    client.calls = {0: test_learner_resend._call(0, version=3), 1: test_learner_resend._call(1, version=3)}
    loop.step()
    jobs = {j.fragment_id: j.syncer_instance for j in client.uploads}
    assert jobs == {0: "life-a", 1: "life-b"}
    client.lives[1] = "life-b2"  # shard B restarts: its fragment waits for the new life's copy
    client.calls = {1: test_learner_resend._call(1, version=0, rnd=2)}
    loop.step()
    assert [j.fragment_id for j in client.uploads].count(1) == 1
    client.inbox = [client_lib.GlobalFragment(1, 0, "life-b2", loop.global_copy[1])]
    loop.step()
    assert [j.syncer_instance for j in client.uploads if j.fragment_id == 1] == ["life-b", "life-b2"]


class _Store:
    """A checkpoint client stand-in that has a manifest for some run ids only."""

    def __init__(self, runs_with_checkpoints: set[str]) -> None:
        self.runs = runs_with_checkpoints
        self.asked: list[str] = []

    async def latest_manifest(self, run_id: str):
        self.asked.append(run_id)
        return object() if run_id in self.runs else None


def test_a_shard_starts_fresh_in_its_own_namespace_and_refuses_a_run_with_unsharded_checkpoints():
    from services.syncer import __main__ as syncer_main

    cfg = config_lib.SyncerConfig(num_fragments=2, fragment_shard=1, fragment_shards=MAP, run_id="r")
    fresh = _Store(set())
    assert asyncio.run(syncer_main._restore_at_start(cfg, _shard_core(FakeClock(), 1), fresh, None)) is None
    assert fresh.asked == ["r.shard-1-of-2", "r"]  # its own namespace, then the unsharded run's
    unsharded = _Store({"r"})
    assert asyncio.run(syncer_main._restore_at_start(cfg, _shard_core(FakeClock(), 1), unsharded, None)) == 2
