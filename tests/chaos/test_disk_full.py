"""Fault-matrix row 7 end to end: the checkpoint store's disk fills up during a run.

Real processes on 127.0.0.1 (store, syncer, two tiny learners). Mid-run the store is restarted
with the `store.write=enospc` failpoint (every atomic write fails as on a full disk): the store
answers RESOURCE_EXHAUSTED, the syncer counts its failed checkpoints and trains on, nothing is
committed meanwhile and the last committed checkpoint stays loadable; once the store has space
again (restarted without the failpoint) checkpoints resume.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from ddiloco.chaos import harness
from ddiloco.cli import cluster as cluster_lib
from tests.integration.conftest import LEARNER_PACE, TINY, SyncerProbe, wait_until
from tests.waits import TEARDOWN_CLIENTS_S

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _counter(svc: cluster_lib.ServiceProcess, name: str, **labels) -> float:
    """Sum of a Prometheus counter's samples (matching `labels`) scraped from a service."""
    address = json.loads(svc.ready_file.read_text())["metrics_address"]
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _checkpoints(address: str, run_id: str) -> list[tuple[int, object]]:
    """Every retained checkpoint of the run, loaded (SyncerSnapshot); fails on one that does not load."""
    loaded = harness.load_checkpoints(address, run_id)
    assert not [step for step, snap in loaded if isinstance(snap, Exception)], loaded
    return loaded


def test_row07_store_disk_full_training_goes_on_and_the_last_checkpoint_stays(tmp_path):
    cluster = cluster_lib.LocalCluster(tmp_path)
    probe = None
    try:
        store = cluster.start_store()
        syncer = cluster.start_syncer(run_id="disk-full", extra=[*TINY, "--checkpoint-every-merges", "4"])
        for i in range(2):
            cluster.start_learner(i, region="r", extra=["--num-shards", "2", *LEARNER_PACE])
        probe = SyncerProbe(syncer.address)
        wait_until(lambda: probe.state(0).last_checkpoint_outer_step > 0, timeout_s=180, what="a first checkpoint")

        assert store.stop(15) == 0, store.log_tail()
        store.start(["--failpoints", "store.write=enospc"])
        store.wait_ready(60)
        full = probe.state(0)
        committed = full.last_checkpoint_outer_step
        failures_before = _counter(syncer, "ddiloco_syncer_checkpoint_failures_total")
        # Training goes on while every checkpoint fails: at least three checkpoint periods of merges.
        wait_until(lambda: _counter(syncer, "ddiloco_syncer_checkpoint_failures_total") >= failures_before + 2
                   and probe.state(0).outer_steps >= full.outer_steps + 12,
                   timeout_s=180, what="merges and failed checkpoints while the store's disk is full")
        during = probe.state(0)
        assert during.last_checkpoint_outer_step == committed, (during.last_checkpoint_outer_step, committed)
        refused = _counter(store, "grpc_server_handled_total", grpc_code="ResourceExhausted")
        assert refused >= 1, "the store did not answer RESOURCE_EXHAUSTED"
        retained = _checkpoints(store.address, "disk-full")
        assert retained and retained[-1][0] == committed, [step for step, _ in retained]
        assert retained[-1][1].outer_steps == committed

        # Space again: the next checkpoint commits, and everything retained loads.
        assert store.stop(15) == 0, store.log_tail()
        store.start()
        store.wait_ready(60)
        wait_until(lambda: probe.state(0).last_checkpoint_outer_step > during.outer_steps, timeout_s=180,
                   what="checkpoints resuming after the disk has space again")
        after = _checkpoints(store.address, "disk-full")
        assert after[-1][0] > committed and all(snap.outer_steps == step for step, snap in after)
        assert all(svc.proc.poll() is None for svc in cluster.learners()), "a learner exited"
    finally:
        if probe is not None:
            probe.close()
        cluster.stop_all(timeout_s=10.0, clients_timeout_s=TEARDOWN_CLIENTS_S)
