"""`ddiloco up --syncer-replicas N` without processes: LocalCluster's failover wiring (the launches
are recorded, etcd is not started), the reader of several instances, and the restart of a deposed
leader. tests/integration/test_up_failover_tls.py runs it all with real processes.

Before --syncer-replicas, LocalCluster had no etcd, no replicas and no syncer_target: every test
here failed.
"""

from __future__ import annotations

import argparse
import types

import pytest
from rich.console import Console

from ddiloco.cli import certs
from ddiloco.cli import cluster as cluster_lib
from ddiloco.cli import etcd_local
from ddiloco.cli import run_view
from ddiloco.cli import up as up_lib
from ddiloco.v1 import syncer_pb2
from tests.unit.test_up_syncer_shards import _flag, launches  # noqa: F401 - the fixture


def _with_etcd(cluster: cluster_lib.LocalCluster, *, tls: bool) -> None:
    """A member as start_etcd records it, not started (the PKI written as start_etcd does)."""
    server_tls = peer_tls = None
    if tls:
        certs.write_etcd_certs(cluster.tls_dir, names=["localhost"])
        server_tls, peer_tls = etcd_local.pki_tls(cluster.tls_dir)
    cluster.etcd = etcd_local.EtcdMember("etcd-0", "etcd", cluster.workdir, 2379, 2380, "etcd-0=https://127.0.0.1:2380",
                                         tls=server_tls, peer_tls=peer_tls)


@pytest.mark.parametrize("tls", [False, True])
def test_replicas_elect_through_the_clusters_etcd_and_clients_get_every_instance(tmp_path, launches, tls):  # noqa: F811
    cluster = cluster_lib.LocalCluster(tmp_path, tls=tls)
    _with_etcd(cluster, tls=tls)
    replicas = cluster.start_syncer_replicas(2, run_id="r", extra=["--num-fragments", "4"])
    assert [s.name for s in replicas] == ["syncer", "syncer-b"] == [s.name for s in cluster.syncers()]
    for name, args in launches:
        assert _flag(args, "--run-id") == "r" and _flag(args, "--ready-file").endswith(f"{name}.ready.json")
        assert _flag(args, "--coord-lease-s") == str(cluster_lib.LOCAL_LEASE_S)
        if tls:
            assert _flag(args, "--coord-etcd") == "https://127.0.0.1:2379"
            assert _flag(args, "--coord-tls-ca") == str(cluster.tls_dir / "etcd-ca.pem")
            assert _flag(args, "--coord-tls-cert") == str(cluster.tls_dir / "etcd-client.pem")
            assert _flag(args, "--tls-cert") == str(cluster.tls_dir / "syncer.pem")  # gRPC: the main CA's
        else:
            assert _flag(args, "--coord-etcd") == "127.0.0.1:2379" and "--coord-tls-ca" not in args
    # Two instances on port 0 get the stubbed address; the target lists both, in order.
    assert cluster.syncer_target() == ",".join(s.address for s in replicas)
    cluster.start_learner(0, region="a")
    cluster.start_evaluator()
    for name, args in launches[2:]:
        assert _flag(args, "--syncer") == cluster.syncer_target(), name
    if tls:  # a syncer left without the client certificate (what the integration test starts)
        bare = cluster.coord_args(client_certificate=False)
        assert "--coord-tls-ca" in bare and "--coord-tls-cert" not in bare and "--coord-tls-key" not in bare


def test_one_replica_and_no_replicas_are_refused(tmp_path, launches):  # noqa: F811
    cluster = cluster_lib.LocalCluster(tmp_path)
    with pytest.raises(cluster_lib.ServiceStartError):
        cluster.coord_args()  # no etcd yet
    _with_etcd(cluster, tls=False)
    with pytest.raises(cluster_lib.ServiceStartError):
        cluster.start_syncer_replicas(1, run_id="r")
    # (with --syncer-shards they combine: tests/unit/test_up_syncer_shard_replicas.py)
    args = argparse.Namespace(checkpoint_stores=1, syncer_shards=2, num_fragments=4, syncer_replicas=0)
    with pytest.raises(cluster_lib.ServiceStartError, match="--syncer-replicas"):
        up_lib._start_syncer(Console(), args, cluster, "r", 256)
    assert launches == []  # refused before anything started


def test_a_reader_of_several_instances_reads_the_leader(monkeypatch):
    states = {"a:1": syncer_pb2.TrainingState(epoch=0, outer_steps=0),
              "b:2": syncer_pb2.TrainingState(epoch=7, outer_steps=12)}
    reader = run_view.RunReader("a:1,b:2")
    monkeypatch.setattr(reader, "fetch", lambda address: states[address])
    assert reader.read().state.outer_steps == 12
    states["a:1"], states["b:2"] = syncer_pb2.TrainingState(epoch=9, outer_steps=13), states["b:2"]
    assert reader.read().state.outer_steps == 13


def test_only_an_instance_that_lost_its_leadership_is_restarted(tmp_path, launches):  # noqa: F811
    cluster = cluster_lib.LocalCluster(tmp_path)
    _with_etcd(cluster, tls=False)
    syncer, standby = cluster.start_syncer_replicas(2, run_id="r")
    syncer.proc = types.SimpleNamespace(poll=lambda: cluster_lib.EXIT_LOST_LEADERSHIP, pid=1)
    standby.proc = types.SimpleNamespace(poll=lambda: 1, pid=2)  # a crash: not hidden by a restart
    assert cluster.revive_syncer_replicas() == ["syncer"]
    assert [name for name, _ in launches] == ["syncer", "syncer-b", "syncer"]
