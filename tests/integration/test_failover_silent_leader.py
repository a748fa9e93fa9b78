"""A leader that goes silent (SIGSTOP: like a vanished host, it sends no TCP reset): learners move
to the new leader within about a second of its election, not when their calls' deadlines expire.

Real processes on loopback: etcd, a checkpoint store, two syncers, two learners given both
syncers (the frozen one first). The leading syncer is frozen with SIGSTOP; the standby is elected
once the lease (3 s) expires. Measured: from the new leader's election (its `elected: serving
learners` log line, when its gate opens) to each learner's first contribution it accepted (the
learner's history). Before ddiloco/learner/leader_watch.py a learner left the frozen leader only
when a call to it failed: its upload's deadline (10 s plus its size), retried for up to 30 s,
or HTTP/2 keepalive (30 + 10 s); the watch stream's deadline is 600 s.
"""

from __future__ import annotations

import signal
import time

import pytest

from ddiloco import history as history_lib
from ddiloco.chaos import invariants
from tests.integration.conftest import SyncerProbe, wait_until
from tests import etcd as etcd_helper
from tests.integration.test_failover import _logged_at, _start_learner, _start_syncer, _state_of, _wait_leader

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

FOLLOW_BOUND_S = 4.0  # election -> first accepted contribution at the new leader, every learner
OLD_WAIT_S = 60.0  # how long the test waits for it at most (the old behaviour took 10-40 s)


@pytest.fixture
def etcd_server(tmp_path):
    with etcd_helper.running_etcd(tmp_path / "etcd") as server:
        yield server


def _first_accepted_at(cluster, name: str, instance: str) -> float | None:
    for record in history_lib.read(cluster.workdir / f"{name}.history.jsonl"):
        if record["event"] == "ack" and record.get("instance") == instance and record.get("result") == "accepted":
            return record["t"]
    return None


def test_a_frozen_leader_is_left_within_seconds_of_the_new_election(cluster, etcd_server):
    cluster.start_store()
    a = _start_syncer(cluster, "syncer-a", etcd_server.endpoint, "failover-frozen")
    _wait_leader(a, timeout_s=60)
    b = _start_syncer(cluster, "syncer-b", etcd_server.endpoint, "failover-frozen")
    learners = [_start_learner(cluster, i, f"{a.address},{b.address}").name for i in range(2)]
    probe = SyncerProbe(a.address)
    try:
        wait_until(lambda: probe.state(0).outer_steps >= 4, timeout_s=300, what="merges on a")
    finally:
        probe.close()
    try:
        a.signal(signal.SIGSTOP)  # by PID: only the process this test started
        frozen_at = time.time()
        _wait_leader(b, timeout_s=30)
        instance_b = _state_of(b.address).syncer_instance
        elected_at = _logged_at(cluster, "syncer-b", "elected leader")
        serving_at = _logged_at(cluster, "syncer-b", "elected: serving learners")
        accepted = {}
        deadline = time.time() + OLD_WAIT_S
        while len(accepted) < len(learners) and time.time() < deadline:
            for name in learners:
                if name not in accepted and (t := _first_accepted_at(cluster, name, instance_b)) is not None:
                    accepted[name] = t
            time.sleep(0.2)
    finally:
        a.kill()  # SIGKILL by PID; a stopped process dies too
    follow_s = {name: round(t - serving_at, 2) for name, t in accepted.items()}
    print(f"\nfrozen leader: syncer-b elected {elected_at - frozen_at:.2f} s after SIGSTOP, serving after "
          f"{serving_at - frozen_at:.2f} s; first contribution accepted by it, after its gate opened: {follow_s} s "
          f"({ {n: round(t - frozen_at, 2) for n, t in accepted.items()} } s after SIGSTOP)")
    assert set(accepted) == set(learners), f"not every learner reached syncer-b within {OLD_WAIT_S} s: {follow_s}"
    assert max(follow_s.values()) < FOLLOW_BOUND_S, follow_s
    for name in learners:
        cluster.services[name].stop(30)
    b.stop(30)
    # The move cancelled uploads in flight to the frozen leader: none was applied twice, and every
    # acknowledged one is accounted for.
    syncer_records = sorted(history_lib.read(cluster.workdir / "syncer-a.history.jsonl")
                            + history_lib.read(cluster.workdir / "syncer-b.history.jsonl"), key=lambda r: r["t"])
    learner_records = {n: history_lib.read(cluster.workdir / f"{n}.history.jsonl") for n in learners}
    uploads = invariants.check_uploads(syncer_records, learner_records)
    print(f"uploads: {uploads.figures}")
    assert uploads.ok, uploads.violations
    assert not uploads.figures.get("double_applied"), uploads.figures
