"""`ddiloco up --syncer-shards N` (issue 21): LocalCluster.start_syncer_shards starts N syncer
processes, each on its own port chosen before any starts, with its index and the one shard map;
shard 0 keeps the name "syncer" (learners, the evaluator and the tools are pointed at it), and
one shard is exactly the unsharded syncer of before. The processes are not started here (the
launch is recorded): the syncer side's flags are tested with real processes in
tests/integration/test_fragment_shards.py.
"""

from __future__ import annotations

import argparse

import pytest
from rich.console import Console

from ddiloco.cli import cluster as cluster_lib
from ddiloco.cli import up as up_lib


@pytest.fixture
def launches(monkeypatch):
    started: list[tuple[str, list[str]]] = []

    def start(self, extra_args=()):
        started.append((self.name, list(self.args)))

    def wait_ready(self, timeout_s):
        bind = self.args[self.args.index("--bind") + 1]
        self.address = bind if not bind.endswith(":0") else "127.0.0.1:5999"
        return self.address

    monkeypatch.setattr(cluster_lib.ServiceProcess, "start", start)
    monkeypatch.setattr(cluster_lib.ServiceProcess, "wait_ready", wait_ready)
    return started


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_three_shards_each_with_its_index_its_port_and_the_one_map(tmp_path, launches):
    cluster = cluster_lib.LocalCluster(tmp_path)
    shards = cluster.start_syncer_shards(3, run_id="r", extra=["--num-fragments", "4"])
    assert [s.name for s in shards] == ["syncer", "syncer-1", "syncer-2"] == [s.name for s in cluster.syncers()]
    maps = {_flag(args, "--fragment-shards") for _, args in launches}
    (shard_map,) = maps
    addresses = shard_map.split(",")
    assert len(set(addresses)) == 3 and all(a.startswith("127.0.0.1:") for a in addresses)
    for index, (name, args) in enumerate(launches):
        assert _flag(args, "--fragment-shard") == str(index)
        assert _flag(args, "--bind") == addresses[index] == shards[index].address
        assert _flag(args, "--ready-file").endswith(f"{name}.ready.json")
        assert _flag(args, "--num-fragments") == "4" and _flag(args, "--run-id") == "r"


def test_one_shard_is_the_unsharded_syncer(tmp_path, launches):
    cluster = cluster_lib.LocalCluster(tmp_path)
    (syncer,) = cluster.start_syncer_shards(1, run_id="r")
    ((name, args),) = launches
    assert name == "syncer" and _flag(args, "--bind") == "127.0.0.1:0"
    assert "--fragment-shard" not in args and "--fragment-shards" not in args


def test_shards_stop_after_the_learners_and_before_the_stores(tmp_path, launches, monkeypatch):
    cluster = cluster_lib.LocalCluster(tmp_path)
    cluster.start_store()
    cluster.start_syncer_shards(2, run_id="r")
    cluster.start_learner(0, region="a")
    stopped = []
    monkeypatch.setattr(cluster_lib.ServiceProcess, "stop", lambda self, timeout_s=15.0: stopped.append(self.name))
    cluster.stop_all()
    assert stopped == ["learner-0", "syncer", "syncer-1", "checkpoint"]
    # Learners are given shard 0, and the shard stores: both shards checkpoint to the store.
    learner_args = cluster.services["learner-0"].args
    assert _flag(learner_args, "--syncer") == cluster.services["syncer"].address
    assert _flag(cluster.services["syncer-1"].args, "--checkpoint-target") == cluster.services["checkpoint"].address


def test_up_refuses_more_shards_than_fragments_before_starting_anything(tmp_path, launches):
    parser = argparse.ArgumentParser()
    up_lib.add_arguments(parser)
    args = parser.parse_args(["--syncer-shards", "5", "--num-fragments", "4"])
    assert parser.parse_args([]).syncer_shards == 1
    with pytest.raises(cluster_lib.ServiceStartError, match="--syncer-shards"):
        up_lib._start_syncer(Console(quiet=True), args, cluster_lib.LocalCluster(tmp_path), "r", 256)
    assert launches == []
