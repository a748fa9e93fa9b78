"""`ddiloco up --syncer-shards M --syncer-replicas N` without processes: M fragment shards with N
failover instances each, every shard electing its own leader through the one etcd (the syncer's
election key and commit pointer are per shard, `<run>.shard-I-of-M`). The launches are recorded
(LocalCluster's wiring: names, ports chosen before any starts, the one map `a0|b0,a1|b1`, the
election flags on every instance), and the tools' reading of such a run is checked with fake
states. tests/integration/test_shard_failover.py runs it with real processes.

Before this, `up` refused the two flags together and start_syncer_replicas had no `shards`: every
test here failed.
"""

from __future__ import annotations

import argparse
import types

import pytest
from rich.console import Console

from ddiloco.cli import cluster as cluster_lib
from ddiloco.cli import run_view
from ddiloco.cli import up as up_lib
from ddiloco.v1 import syncer_pb2
from tests.unit.test_up_syncer_replicas import _with_etcd
from tests.unit.test_up_syncer_shards import _flag, launches  # noqa: F401 - the fixture

NAMES = ["syncer", "syncer-b", "syncer-1", "syncer-1-b"]


def test_two_shards_of_two_instances_share_one_map_and_each_shard_elects(tmp_path, launches):  # noqa: F811
    cluster = cluster_lib.LocalCluster(tmp_path)
    _with_etcd(cluster, tls=False)
    instances = cluster.start_syncer_replicas(2, shards=2, run_id="r", extra=["--num-fragments", "4"],
                                              instance_extra=lambda name: ["--history-file", f"{name}.jsonl"])
    assert [s.name for s in instances] == NAMES == [s.name for s in cluster.syncers()]
    (shard_map,) = {_flag(args, "--fragment-shards") for _, args in launches}
    entries = [entry.split("|") for entry in shard_map.split(",")]
    binds = [_flag(args, "--bind") for _, args in launches]
    # Shard i's entry lists its two instances' ports, chosen before any started (no port 0).
    assert entries == [binds[0:2], binds[2:4]] and len(set(binds)) == 4
    assert all(b.startswith("127.0.0.1:") and not b.endswith(":0") for b in binds)
    for index, (name, args) in enumerate(launches):
        assert _flag(args, "--fragment-shard") == str(index // 2), name
        assert _flag(args, "--run-id") == "r" and _flag(args, "--coord-etcd") == "127.0.0.1:2379"
        assert _flag(args, "--coord-lease-s") == str(cluster_lib.LOCAL_LEASE_S)
        assert _flag(args, "--ready-file").endswith(f"{name}.ready.json")
        assert _flag(args, "--history-file") == f"{name}.jsonl"  # the per-instance flags, each its own
        assert instances[index].address == binds[index]
    # Learners and the evaluator are given shard 0's instances; they find shard 1's in its answers.
    assert cluster.syncer_target() == ",".join(binds[0:2])
    cluster.start_learner(0, region="a")
    assert _flag(cluster.services["learner-0"].args, "--syncer") == ",".join(binds[0:2])


def test_one_shard_of_replicas_is_unchanged(tmp_path, launches):  # noqa: F811
    cluster = cluster_lib.LocalCluster(tmp_path)
    _with_etcd(cluster, tls=False)
    cluster.start_syncer_replicas(2, run_id="r")
    for _, args in launches:
        assert _flag(args, "--bind") == "127.0.0.1:0" and "--fragment-shards" not in args


def test_up_starts_shards_of_replicas_through_one_etcd(tmp_path, launches, monkeypatch):  # noqa: F811
    cluster = cluster_lib.LocalCluster(tmp_path)
    started_etcd = []
    monkeypatch.setattr(cluster, "start_etcd", lambda: started_etcd.append(1) or _with_etcd(cluster, tls=False)
                        or cluster.etcd)
    parser = argparse.ArgumentParser()
    up_lib.add_arguments(parser)
    args = parser.parse_args(["--syncer-shards", "2", "--syncer-replicas", "2", "--num-fragments", "4"])
    syncer = up_lib._start_syncer(Console(quiet=True), args, cluster, "r", 256)
    assert started_etcd == [1] and syncer.name == "syncer"
    assert [name for name, _ in launches] == ["checkpoint", *NAMES]
    (shard_map,) = {_flag(a, "--fragment-shards") for n, a in launches if n != "checkpoint"}
    assert shard_map.count("|") == 2 and shard_map.count(",") == 1


@pytest.mark.parametrize("flags, complaint", [
    (["--syncer-replicas", "0"], "--syncer-replicas must be 1 or more"),
    (["--syncer-replicas", "2", "--syncer-shards", "5"], "--syncer-shards must be between 1 and --num-fragments"),
    (["--syncer-replicas", "2", "--syncer-shards", "0"], "--syncer-shards must be between 1 and --num-fragments"),
])
def test_bad_counts_are_refused_before_anything_starts(tmp_path, launches, flags, complaint):  # noqa: F811
    parser = argparse.ArgumentParser()
    up_lib.add_arguments(parser)
    args = parser.parse_args([*flags, "--num-fragments", "4"])
    with pytest.raises(cluster_lib.ServiceStartError, match=complaint):
        up_lib._start_syncer(Console(quiet=True), args, cluster_lib.LocalCluster(tmp_path), "r", 256)
    cluster = cluster_lib.LocalCluster(tmp_path)
    _with_etcd(cluster, tls=False)
    with pytest.raises(cluster_lib.ServiceStartError, match="syncer shards must be 1 or more"):
        cluster.start_syncer_replicas(2, shards=0, run_id="r")
    assert launches == []


def test_a_deposed_leader_of_shard_1_is_restarted_on_its_port(tmp_path, launches):  # noqa: F811
    cluster = cluster_lib.LocalCluster(tmp_path)
    _with_etcd(cluster, tls=False)
    instances = cluster.start_syncer_replicas(2, shards=2, run_id="r")
    for svc in instances:
        svc.proc = types.SimpleNamespace(poll=lambda: None, pid=1)
    instances[3].proc = types.SimpleNamespace(poll=lambda: cluster_lib.EXIT_LOST_LEADERSHIP, pid=2)
    assert cluster.revive_syncer_replicas() == ["syncer-1-b"]
    assert launches[-1][0] == "syncer-1-b" and _flag(launches[-1][1], "--bind") == instances[3].address


def _states(addresses: list[str], leaders: dict[str, int]) -> dict[str, syncer_pb2.TrainingState]:
    """Every instance's answer: the map of two shards of two instances; a leader has its epoch and
    merges, a standby epoch 0 and nothing (it never merged)."""
    shards = [syncer_pb2.SyncerShard(index=i, addresses=addresses[2 * i:2 * i + 2], fragment_ids=[i, i + 2])
              for i in range(2)]
    out = {}
    for n, address in enumerate(addresses):
        epoch = leaders.get(address, 0)
        out[address] = syncer_pb2.TrainingState(epoch=epoch, shard_index=n // 2, shards=shards,
                                                outer_steps=10 * (n // 2 + 1) if epoch else 0)
    return out


def test_status_reads_the_leader_of_every_shard(monkeypatch):
    addresses = ["a0:1", "b0:2", "a1:3", "b1:4"]
    # Shard 1's standby is listed first and its leader second: the reader must not take the standby.
    states = _states(addresses, {"a0:1": 5, "b1:4": 9})
    reader = run_view.RunReader("a0:1,b0:2")
    monkeypatch.setattr(reader, "fetch", lambda address: states[address])
    view = reader.read()
    assert [(s.index, s.address, s.state.epoch) for s in view.shards] == [(0, "a0:1", 5), (1, "b1:4", 9)]
    assert view.state.outer_steps == 30  # both leaders' merges (10 + 20), none of a standby's


def test_stop_all_stops_every_shards_standby_before_the_leaders(tmp_path, launches, monkeypatch):  # noqa: F811
    cluster = cluster_lib.LocalCluster(tmp_path)
    _with_etcd(cluster, tls=False)
    instances = cluster.start_syncer_replicas(2, shards=2, run_id="r")
    for svc in instances:
        svc.proc = types.SimpleNamespace(poll=lambda: None, pid=1)
    epochs = {instances[1].address: 5, instances[2].address: 9}  # syncer-b and syncer-1 lead
    monkeypatch.setattr(run_view.RunReader, "fetch",
                        lambda self, address: syncer_pb2.TrainingState(epoch=epochs.get(address, 0)))
    stopped = []
    monkeypatch.setattr(cluster_lib.ServiceProcess, "stop", lambda self, timeout_s=15.0: stopped.append(self.name))
    cluster.stop_all()
    assert stopped == ["syncer", "syncer-1-b", "syncer-b", "syncer-1"]
