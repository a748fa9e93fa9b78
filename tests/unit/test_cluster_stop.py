"""LocalCluster.stop_all: the learners and the evaluator stop together (each may wait its finish
timeout after SIGTERM), and all of them are gone before the syncer stops, which is stopped before
the store. No process is started: start, wait_ready and stop are recorded."""

from __future__ import annotations

import threading
import time

import pytest

from ddiloco.cli import cluster as cluster_lib

pytestmark = pytest.mark.timeout(60)

STOP_S = 0.5  # how long each recorded stop takes, as a learner finishing after SIGTERM does


@pytest.fixture
def recorded(monkeypatch):
    spans: dict[str, tuple[float, float]] = {}
    timeouts: dict[str, float] = {}
    lock = threading.Lock()

    def wait_ready(self, timeout_s):
        self.address = "127.0.0.1:5999"
        return self.address

    def stop(self, timeout_s=15.0):
        started = time.monotonic()
        time.sleep(STOP_S)
        with lock:
            spans[self.name] = (started, time.monotonic())
            timeouts[self.name] = timeout_s
        return 0

    monkeypatch.setattr(cluster_lib.ServiceProcess, "start", lambda self, extra_args=(): None)
    monkeypatch.setattr(cluster_lib.ServiceProcess, "wait_ready", wait_ready)
    monkeypatch.setattr(cluster_lib.ServiceProcess, "stop", stop)
    spans_and_timeouts = spans, timeouts
    return spans_and_timeouts


def _cluster(tmp_path) -> cluster_lib.LocalCluster:
    cluster = cluster_lib.LocalCluster(tmp_path)
    cluster.start_store()
    cluster.start_syncer(run_id="r")
    for i in range(3):
        cluster.start_learner(i, region="a")
    cluster.start_evaluator()
    return cluster


def test_learners_stop_together_before_the_syncer_and_the_store(tmp_path, recorded):
    recorded, timeouts = recorded
    cluster = _cluster(tmp_path)
    started = time.monotonic()
    cluster.stop_all(timeout_s=10.0)
    elapsed = time.monotonic() - started
    clients = ["learner-0", "learner-1", "learner-2", "evaluator"]
    assert set(recorded) == {*clients, "syncer", "checkpoint"}
    # Together: the four stops overlap (one after the other they would take 4 x STOP_S).
    assert max(recorded[n][0] for n in clients) < min(recorded[n][1] for n in clients)
    assert elapsed < 3 * STOP_S + 2 * STOP_S, elapsed  # 4 clients at once, then syncer, then store
    # Order between the groups is kept: every client is gone before the syncer stops, and the
    # syncer (its final checkpoint) before the store.
    assert max(recorded[n][1] for n in clients) <= recorded["syncer"][0]
    assert recorded["syncer"][1] <= recorded["checkpoint"][0]
    assert set(timeouts.values()) == {10.0}  # one timeout for all unless the clients are given theirs


def test_the_clients_may_be_given_a_shorter_timeout_than_the_servers(tmp_path, recorded):
    _, timeouts = recorded
    _cluster(tmp_path).stop_all(timeout_s=10.0, clients_timeout_s=3.0)
    assert timeouts == {"learner-0": 3.0, "learner-1": 3.0, "learner-2": 3.0, "evaluator": 3.0,
                        "syncer": 10.0, "checkpoint": 10.0}
