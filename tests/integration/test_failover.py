"""Syncer leader election with real processes: etcd, a checkpoint store, two syncers, two learners.

1. SIGKILL the leader: the standby leads within 10 s, restores the last committed checkpoint and
   merges on from it; no upload is applied twice (the chaos invariant checkers over both syncers'
   histories); learners keep stepping throughout and fold in versions of the leaders' epochs only,
   never an older epoch after a newer one.
2. Cut the leader off from etcd only (a blackholing proxy between it and etcd; learners still reach
   it): it stops broadcasting and exits within its lease, and no learner folds in a version of its
   epoch after the new leader's first one.

Every setting is the shipped default (lease 3 s, checkpoint every 16 merges), but the tiny model.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddiloco import history as history_lib
from ddiloco.coord import commit as commit_lib
from ddiloco.coord import election as election_lib
from ddiloco.coord import etcd as etcd_lib
from ddiloco.rpc import channel as channel_lib
from ddiloco.rpc import errors
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc
from ddiloco.wire import serde
from ddiloco.chaos import invariants
from ddiloco.chaos import proxy as proxy_lib
from tests.integration.conftest import (LEARNER_PACE, TINY, SyncerProbe, check_uploads_once, json_log, step_times,
                                       wait_until)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

FAILOVER_BOUND_S = 10.0


def _start_syncer(cluster, name: str, etcd_endpoint: str, run_id: str):
    svc = cluster.add(name, "services.syncer", [
        "--bind", "127.0.0.1:0", "--run-id", run_id, "--ready-file", str(cluster.workdir / f"{name}.ready.json"),
        "--checkpoint-target", cluster.services["checkpoint"].address, "--coord-etcd", etcd_endpoint,
        "--history-file", str(cluster.workdir / f"{name}.history.jsonl"), "--json-logs", "--metrics-bind",
        "127.0.0.1:0", *TINY])
    svc.start()
    svc.wait_ready(120)
    return svc


def _start_learner(cluster, index: int, syncers: str):
    name = f"learner-{index}"
    svc = cluster.add(name, "services.learner", [
        "--syncer", syncers, "--learner-id", name, "--region", f"region-{index}",
        "--summary-file", str(cluster.workdir / f"{name}.summary.json"), "--health-bind", "127.0.0.1:0",
        "--history-file", str(cluster.workdir / f"{name}.history.jsonl"), "--json-logs", "--num-shards", "2",
        "--steps", "100000", *LEARNER_PACE[:2], "--log-every-steps", "5"])
    svc.start()
    return svc


def _two_syncers_merging(cluster, run_id: str, etcd_a: str, etcd_b: str, *, merges_timeout_s: float):
    """The store, syncer-a leading (its etcd through `etcd_a`), syncer-b a standby (`etcd_b`) and
    two learners given both syncers, a first, once a merged 4 times: (a, a's epoch, b, learner names)."""
    cluster.start_store()
    a = _start_syncer(cluster, "syncer-a", etcd_a, run_id)
    epoch_a = _wait_leader(a, timeout_s=60)
    b = _start_syncer(cluster, "syncer-b", etcd_b, run_id)
    learners = [_start_learner(cluster, i, f"{a.address},{b.address}").name for i in range(2)]
    probe = SyncerProbe(a.address)
    try:
        wait_until(lambda: probe.state(0).outer_steps >= 4, timeout_s=merges_timeout_s, what="merges on a")
    finally:
        probe.close()
    return a, epoch_a, b, learners


def _epoch(address: str) -> tuple[int, str]:
    probe = SyncerProbe(address)
    try:
        state = probe.state(0)
        return state.epoch, state.leader_address
    finally:
        probe.close()


def _state_of(address: str) -> syncer_pb2.TrainingState:
    probe = SyncerProbe(address)
    try:
        return probe.state(0)
    finally:
        probe.close()


def _wait_leader(svc, *, timeout_s: float) -> int:
    wait_until(lambda: _epoch(svc.address)[0] > 0, timeout_s=timeout_s, what=f"{svc.name} leads", interval_s=0.05)
    return _epoch(svc.address)[0]


def _metric(svc, name: str) -> float:
    """The value of an unlabelled metric on the syncer's /metrics endpoint (its ready file's address)."""
    address = json.loads(svc.ready_file.read_text())["metrics_address"].replace("0.0.0.0", "127.0.0.1")
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} is not exported")


def _logged_at(cluster, name: str, prefix: str) -> float:
    """The time of the first JSON log line of `name` whose message starts with `prefix`."""
    for record in json_log(cluster, name):
        if str(record.get("msg", "")).startswith(prefix):
            return record["ts"]
    raise AssertionError(f"{name} never logged {prefix!r}")


def _versions(cluster, name: str) -> list[dict]:
    return [r for r in history_lib.read(cluster.workdir / f"{name}.history.jsonl") if r["event"] == "version"]


def _check_epochs(cluster, learners, epochs: set[int]) -> dict[int, list[float]]:
    """Every version a learner folded in carries a leader's epoch, and per learner they never go
    back to an older epoch; returns {epoch: fold-in times} over all learners."""
    times: dict[int, list[float]] = {}
    for name in learners:
        seen = 0
        for record in _versions(cluster, name):
            assert record["epoch"] in epochs, (name, record, epochs)
            assert record["epoch"] >= seen, (name, record, seen)
            seen = record["epoch"]
            times.setdefault(record["epoch"], []).append(record["t"])
    return times


def test_a_standby_refuses_learners_naming_the_leader_and_leads_once_the_key_is_free(cluster, etcd_server):
    """Another candidate (this test) holds the run's leader key: the syncer stays a standby, refuses
    Join with UNAVAILABLE + not_leader + the leader's address, answers the training state; once the
    key is given up it leads with a newer epoch, which Join and the training state carry."""
    run_id = "failover-standby"
    other = election_lib.Election(etcd_lib.Etcd([etcd_server.endpoint]), election_lib.leader_key("/ddiloco", run_id),
                                  address="10.0.0.9:50051", lease_ttl_s=600)
    assert asyncio.run(other.try_acquire())
    cluster.start_store()
    syncer = _start_syncer(cluster, "syncer-a", etcd_server.endpoint, run_id)
    channel = channel_lib.sync_channel(syncer.address)
    stub = syncer_pb2_grpc.SyncerStub(channel)
    join = syncer_pb2.JoinRequest(protocol_version=serde.PROTOCOL_VERSION, learner_id="l0", incarnation=1, region="r")
    try:
        wait_until(lambda: _epoch(syncer.address) == (0, "10.0.0.9:50051"), timeout_s=10, what="standby sees leader")
        with pytest.raises(grpc.RpcError) as refused:
            stub.Join(join, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert errors.reason_of(refused.value) == errors.REASON_NOT_LEADER
        assert errors.metadata_value(refused.value, errors.LEADER_KEY) == "10.0.0.9:50051"
        assert "standby" in refused.value.details()
        # Alive (overall SERVING), but not ready as the Syncer: a Service's readiness probe on it
        # routes to the leader only.
        health = health_pb2_grpc.HealthStub(channel)
        status = lambda service: health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status  # noqa: E731
        assert status("") == health_pb2.HealthCheckResponse.SERVING
        assert status("ddiloco.v1.Syncer") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert _metric(syncer, "ddiloco_syncer_leader") == 0.0
        # The other candidate gives up (its lease revoked, from a fresh client on a fresh loop).
        asyncio.run(etcd_lib.Etcd([etcd_server.endpoint]).revoke(other.lease_id))
        other_epoch = other.epoch
        epoch = _wait_leader(syncer, timeout_s=10)
        assert epoch > other_epoch
        response = stub.Join(join, timeout=10)
        assert response.epoch == epoch
        assert status("ddiloco.v1.Syncer") == health_pb2.HealthCheckResponse.SERVING
        assert _metric(syncer, "ddiloco_syncer_leader") == 1.0
        assert _metric(syncer, "ddiloco_syncer_leader_epoch") == float(epoch)
    finally:
        channel.close()


def test_sigkill_of_the_leader_the_standby_leads_within_10_s_and_merges_resume(cluster, etcd_server):
    cluster.start_store()
    a = _start_syncer(cluster, "syncer-a", etcd_server.endpoint, "failover-kill")
    epoch_a = _wait_leader(a, timeout_s=60)
    b = _start_syncer(cluster, "syncer-b", etcd_server.endpoint, "failover-kill")
    # The standby knows the leader (it would redirect a learner there); learners list it first, and
    # find the leader by asking both syncers' health before they join (ddiloco/learner/targets.py).
    wait_until(lambda: _epoch(b.address) == (0, a.address), timeout_s=10, what="b is a standby naming a")
    learners = [_start_learner(cluster, i, f"{b.address},{a.address}").name for i in range(2)]
    probe = SyncerProbe(a.address)
    try:
        # At least one checkpoint committed (shipped default: every 16 merges) and merges beyond it.
        wait_until(lambda: (s := probe.state(0)).last_checkpoint_outer_step > 0
                   and s.outer_steps >= s.last_checkpoint_outer_step + 2, timeout_s=240, what="a checkpoint and merges")
        committed = probe.state(0).last_checkpoint_outer_step
    finally:
        probe.close()
    a.proc.send_signal(signal.SIGKILL)
    killed_at = time.time()
    a.proc.wait(10)
    epoch_b = _wait_leader(b, timeout_s=FAILOVER_BOUND_S + 5)
    failover_s = time.time() - killed_at
    print(f"\nfailover: syncer-b leads {failover_s:.2f} s after SIGKILL of the leader (lease 3 s); "
          f"epochs {epoch_a} -> {epoch_b}")
    assert epoch_b > epoch_a
    assert failover_s < FAILOVER_BOUND_S
    probe = SyncerProbe(b.address)
    try:
        state = probe.state(0)
        assert state.restored_from_checkpoint and state.outer_steps >= committed, (state.outer_steps, committed)
        restored = state.outer_steps
        wait_until(lambda: probe.state(0).outer_steps >= restored + 8, timeout_s=60, what="merges resume on b")
        resumed_at = time.time()
    finally:
        probe.close()
    print(f"merges resumed from outer step {restored} (committed {committed}); 8 more merges "
          f"{resumed_at - killed_at:.2f} s after the kill")
    for name in learners:
        cluster.services[name].stop(30)
    final_step = _state_of(b.address).outer_steps
    assert b.stop(30) == 0, b.log_tail()
    # The new leader's final checkpoint went through the fenced commit pointer, under its epoch.
    pointer = commit_lib.EtcdCommitPointer(etcd_lib.Etcd([etcd_server.endpoint]), prefix="/ddiloco",
                                           leader_key=election_lib.leader_key("/ddiloco", "failover-kill"))
    committed_at_end = asyncio.run(pointer.latest("failover-kill"))
    # (a round's grace timer may still merge between the read and the SIGTERM: at least that step)
    assert committed_at_end.epoch == epoch_b and committed_at_end.step >= final_step, (committed_at_end, final_step)
    # Learners stepped throughout: no gap between logged steps (every 5) while the leader changed.
    for name in learners:
        times = [t for t in step_times(cluster, name) if killed_at - 5 <= t <= resumed_at]
        gaps = [t1 - t0 for t0, t1 in zip(times, times[1:])]
        assert times and max(gaps, default=0) < 3.0, (name, gaps)
        summary = json.loads((cluster.workdir / f"{name}.summary.json").read_text())
        assert summary["wait_s"] < 1.0, summary  # the training loop never waited on the network
    # Versions folded in: the leaders' epochs only, never backwards.
    times = _check_epochs(cluster, learners, {epoch_a, epoch_b})
    assert times.get(epoch_b), "no learner folded in a version of the new leader"
    # No upload applied twice, every acknowledged upload accounted for (a's crash loses its open
    # rounds and its merges after the last commit: classified, not hidden).
    _, syncer_records = check_uploads_once(cluster, ["syncer-a", "syncer-b"], learners)
    versions = invariants.check_versions(syncer_records)
    assert versions.ok, versions.violations


def test_a_leader_cut_off_from_etcd_stops_within_its_lease_and_learners_follow_the_new_one(cluster, etcd_server):
    host, port = etcd_server.endpoint.rsplit(":", 1)
    link = proxy_lib.FaultProxy("127.0.0.1", host, int(port))
    link_port = link.start_in_thread()
    try:
        a, epoch_a, b, learners = _two_syncers_merging(cluster, "failover-cut", f"127.0.0.1:{link_port}",
                                                        etcd_server.endpoint, merges_timeout_s=240)
        link.set(blackhole=True)  # a's keep-alives go nowhere; learners still reach a
        cut_at = time.time()
        code = a.wait(15)
        exited_s = time.time() - cut_at
        epoch_b = _wait_leader(b, timeout_s=FAILOVER_BOUND_S + 5)
        failover_s = time.time() - cut_at
        stepped_down_s = _logged_at(cluster, "syncer-a", "lost leadership") - cut_at
        print(f"\ncut off from etcd: syncer-a stepped down {stepped_down_s:.2f} s after the cut (lease 3 s) and "
              f"exited ({code}) after {exited_s:.2f} s; syncer-b leads {failover_s:.2f} s after the cut")
        assert code == 4, a.log_tail()
        assert stepped_down_s <= 3.0  # within its lease: before etcd could elect anyone else
        assert epoch_b > epoch_a
        probe = SyncerProbe(b.address)
        try:
            restored = probe.state(0).outer_steps
            wait_until(lambda: probe.state(0).outer_steps >= restored + 4, timeout_s=60, what="merges on b")
        finally:
            probe.close()
    finally:
        link.close()
    for name in learners:
        cluster.services[name].stop(30)
    b.stop(30)
    times = _check_epochs(cluster, learners, {epoch_a, epoch_b})
    assert times.get(epoch_b), "no learner folded in a version of the new leader"
    # Fencing: nothing of the old epoch was folded in after a stepped down, nor after the new
    # leader's first version.
    assert max(times.get(epoch_a, [0.0])) <= cut_at + stepped_down_s + 0.5
    assert max(times.get(epoch_a, [0.0])) < min(times[epoch_b]), (max(times.get(epoch_a, [0.0])), min(times[epoch_b]))
