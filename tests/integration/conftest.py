"""Fixtures for tests that run the services as real processes on 127.0.0.1.

The `cluster` fixture is the same LocalCluster that `ddiloco up` uses; it stops (and if needed
SIGKILLs) only the processes it started, by PID, whatever the test outcome.
"""

from __future__ import annotations

import asyncio
import datetime
import json

import pytest

from ddiloco import checkpoint_client
from ddiloco import history as history_lib
from ddiloco.chaos import invariants
from ddiloco.cli import cluster as cluster_lib
from ddiloco.rpc import channel as channel_lib
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc
from tests import etcd as etcd_helper
from tests import waits

# A small, fast configuration: the tiny transformer, 4 fragments due every 4 steps, learners
# paced at ~30 ms per step so that 2 cores can host a store, a syncer and several learners.
TINY = ["--model-config", json.dumps({"preset": "tiny"}), "--num-fragments", "4", "--sync-period-steps", "4"]
LEARNER_PACE = ["--step-delay-s", "0.03", "--log-every-steps", "50"]


@pytest.fixture
def cluster(tmp_path):
    c = cluster_lib.LocalCluster(tmp_path / "cluster")
    try:
        yield c
    finally:
        c.stop_all(timeout_s=10.0, clients_timeout_s=waits.TEARDOWN_CLIENTS_S)


@pytest.fixture
def etcd_server(tmp_path):
    """A real single-member etcd (tests/etcd.py) in the test's directory, stopped by its PID."""
    with etcd_helper.running_etcd(tmp_path / "etcd") as server:
        yield server


# The tier's tests import it from here: polls a service, gRPC errors (a restarting service) are "not yet".
wait_until = waits.wait_for_rpc


class SyncerProbe:
    """A blocking client for reading a syncer's training state in tests."""

    def __init__(self, address: str) -> None:
        self.channel = channel_lib.sync_channel(address)
        self.stub = syncer_pb2_grpc.SyncerStub(self.channel)

    def state(self, merges: int = 256) -> syncer_pb2.TrainingState:
        return self.stub.GetTrainingState(syncer_pb2.GetTrainingStateRequest(recent_merges=merges), timeout=5).state

    def member(self, learner_id: str) -> syncer_pb2.MemberState | None:
        for m in self.state(0).members:
            if m.learner_id == learner_id:
                return m
        return None

    def close(self) -> None:
        self.channel.close()


def store_call(address: str, fn):
    """Runs `await fn(client)` against the checkpoint store at `address` (a fresh event loop)."""

    async def _run():
        channel = channel_lib.aio_channel(address)
        try:
            client = checkpoint_client.CheckpointClient(
                channel, timeout=datetime.timedelta(seconds=5), retry_timeout=datetime.timedelta(seconds=10)
            )
            return await fn(client)
        finally:
            await channel.close()

    return asyncio.run(_run())


def json_log(cluster, name: str):
    """The JSON records of a service's log (`--json-logs`), in order; other lines are skipped."""
    for line in cluster.services[name].log_path.read_text(errors="replace").splitlines():
        try:
            yield json.loads(line)
        except ValueError:
            continue


def step_times(cluster, name: str) -> list[float]:
    """When a learner logged its steps (every --log-every-steps): gaps show the loop waiting."""
    return [record["ts"] for record in json_log(cluster, name) if record.get("msg") == "step"]


def check_uploads_once(cluster, syncers, learners):
    """No upload applied twice and every acknowledged one accounted for, over the histories of
    `syncers` (names, one run's instances) and `learners` (chaos invariant I1); returns the check."""
    read = lambda name: history_lib.read(cluster.workdir / f"{name}.history.jsonl")  # noqa: E731
    syncer_records = sorted((r for name in syncers for r in read(name)), key=lambda r: r["t"])
    uploads = invariants.check_uploads(syncer_records, {n: read(n) for n in learners})
    print(f"uploads: {uploads.figures}")
    assert uploads.ok, uploads.violations
    assert not uploads.figures.get("double_applied"), uploads.figures
    return uploads, syncer_records
