"""A leader that goes silent (SIGSTOP: like a vanished host, it sends no TCP reset): learners move
to the new leader within about a second of its election, not when their calls' deadlines expire.

Real processes on loopback: etcd, a checkpoint store, two syncers, two learners given both
syncers (the frozen one first). The leading syncer is frozen with SIGSTOP; the standby is elected
once the lease (3 s) expires. Measured: from the new leader's election (its `elected: serving
learners` log line, when its gate opens) to each learner's first contribution it accepted (the
learner's history). Before ddiloco/learner/leader_watch.py a learner left the frozen leader only
when a call to it failed: its upload's deadline (10 s plus its size), retried for up to 30 s,
or HTTP/2 keepalive (30 + 10 s); the watch stream's deadline is 600 s.

A learner that starts while the leader is frozen, with the frozen syncer first in its list, joins
the new leader at once: before, its Join waited at the frozen syncer for its deadline (10 s). So
does `evaluate --once` (services/learner/leader_link.py): it reads the run from the new leader
within JOIN_BOUND_S of its start. Before, its first call at the frozen syncer failed only after
20.0 s, with UNAVAILABLE: gRPC's connect timeout (20 s) ended it before the call's deadline.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from ddiloco import history as history_lib
from tests.integration.conftest import check_uploads_once, json_log, wait_until
from tests.integration.test_failover import (_logged_at, _start_learner, _start_syncer, _state_of,
                                             _two_syncers_merging, _versions, _wait_leader)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

FOLLOW_BOUND_S = 4.0  # election -> first accepted contribution at the new leader, every learner
JOIN_BOUND_S = 2.0  # a fresh learner's client start -> joined the live leader (the frozen one first in its list)
OLD_WAIT_S = 60.0  # how long the test waits for it at most (the old behaviour took 10-40 s)
EVAL_CALL_TIMEOUT_S = 300.0  # the evaluator's per-call deadline in the frozen-head case
# Its overall bound (--timeout-s), which also covers loading the data and the model: a first call
# waiting at the frozen head for its deadline would exceed it.
EVAL_BOUND_S = 120.0


def _first_accepted_at(cluster, name: str, instance: str) -> float | None:
    for record in history_lib.read(cluster.workdir / f"{name}.history.jsonl"):
        if record["event"] == "ack" and record.get("instance") == instance and record.get("result") == "accepted":
            return record["t"]
    return None


def test_a_frozen_leader_is_left_within_seconds_of_the_new_election(cluster, etcd_server):
    a, _, b, learners = _two_syncers_merging(cluster, "failover-frozen", etcd_server.endpoint, etcd_server.endpoint,
                                             merges_timeout_s=300)
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
    check_uploads_once(cluster, ["syncer-a", "syncer-b"], learners)


def _evaluate_once(cluster, syncers: str) -> tuple[dict, float]:
    """`evaluate --once` against `syncers`: its JSON result (with `leader`, the fields of its
    `reading the run from the leader` log line) and its wall time."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "services.learner.evaluator", "--once", "--syncer", syncers, "--num-shards", "2",
         "--json-logs", "--call-timeout-s", str(EVAL_CALL_TIMEOUT_S), "--timeout-s", str(EVAL_BOUND_S)],
        capture_output=True, text=True, timeout=EVAL_BOUND_S + 120, env=cluster.env)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for line in done.stderr.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("msg") == "reading the run from the leader":
            result["leader"] = record
    return result, time.monotonic() - started


def _joined(cluster, name: str) -> dict | None:
    """The fields of the learner's first `joined the syncer` log line (its JSON log), with its time."""
    for record in json_log(cluster, name):
        if record.get("msg") == "joined the syncer":
            return record
    return None


def test_a_learner_starting_while_the_head_of_its_list_is_frozen_joins_the_new_leader_at_once(cluster, etcd_server):
    cluster.start_store()
    a = _start_syncer(cluster, "syncer-a", etcd_server.endpoint, "frozen-join")
    _wait_leader(a, timeout_s=60)
    b = _start_syncer(cluster, "syncer-b", etcd_server.endpoint, "frozen-join")
    try:
        a.signal(signal.SIGSTOP)  # by PID: only the process this test started
        epoch_b = _wait_leader(b, timeout_s=30)
        spawned_at = time.time()
        learner = _start_learner(cluster, 0, f"{a.address},{b.address}")  # the frozen syncer first
        wait_until(lambda: _joined(cluster, learner.name) is not None, timeout_s=OLD_WAIT_S, what="the learner joins",
                   interval_s=0.1)
        joined = _joined(cluster, learner.name)
        wait_until(lambda: any(r["epoch"] == epoch_b for r in _versions(cluster, learner.name)), timeout_s=60,
                   what="a version of the new leader folded in", interval_s=0.2)
        evaluated, evaluator_s = _evaluate_once(cluster, f"{a.address},{b.address}")  # the frozen syncer first
    finally:
        a.kill()  # SIGKILL by PID; a stopped process dies too
    leader = evaluated.pop("leader", None)
    print(f"evaluator --once, frozen syncer first in its list: reading the run from {leader and leader['syncer']} "
          f"{leader and leader['since_start_s']} s after it started, its result {evaluator_s:.2f} s after the spawn "
          f"(Python and JAX imports included; its calls' deadline {EVAL_CALL_TIMEOUT_S:.0f} s): {evaluated}")
    assert leader is not None and leader["syncer"] == b.address and leader["epoch"] == epoch_b, leader
    assert leader["since_start_s"] < JOIN_BOUND_S, leader  # before: 20.0 s (gRPC's connect timeout at the frozen one)
    assert evaluated["versions"], evaluated
    print(f"\nfresh learner, frozen syncer first in its list: joined {joined['syncer']} (epoch {joined['epoch']}) "
          f"{joined['since_start_s']:.2f} s after its client started, {joined['ts'] - spawned_at:.2f} s after the "
          "process was spawned (Python and JAX imports included)")
    assert joined["syncer"] == b.address and joined["epoch"] == epoch_b, joined
    assert joined["since_start_s"] < JOIN_BOUND_S, joined
