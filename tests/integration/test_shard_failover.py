"""Standby syncers per fragment shard, with real processes (issue 23 with issue 21's shards).

etcd, a checkpoint store, two fragment shards of two syncer instances each (LocalCluster's
`start_syncer_replicas(2, shards=2)`, what `ddiloco up --syncer-shards 2 --syncer-replicas 2`
starts: every instance given the map `a0|b0,a1|b1`; each shard elects its own leader under its
own key) and two learners given shard 0's instances. Once shard 1 has committed a checkpoint, its
leader is SIGKILLed:

- shard 1's standby leads within 10 s and restores exactly the checkpoint the shard's commit
  pointer names, and shard 1's fragments merge again;
- shard 0's merges go on without a pause: its longest gap between merges from the kill until
  shard 1 merges again is at most GAP_FACTOR x its longest gap in the window before the kill
  (plus GAP_SLACK_S for the scheduling noise of a shared machine), and its leader never changes;
- no upload is applied twice (the chaos invariant checkers over each shard's histories);
- learners keep stepping, and every version a learner folds in for a shard-1 fragment carries
  one of shard 1's leaders' epochs, never an older one after a newer one.

Every setting is the shipped default (lease 3 s, its 1 s etcd call deadline, a checkpoint every
16 merges) but the tiny model and the learners' pace. `-s` prints the timings.

Before this change LocalCluster could not start shards with standbys (`up` refused the two flags
together; start_syncer_replicas had no `shards`): the test failed at its start.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from ddiloco import history as history_lib
from ddiloco.chaos import invariants
from ddiloco.coord import commit as commit_lib
from ddiloco.coord import election as election_lib
from ddiloco.coord import etcd as etcd_lib
from tests.integration.conftest import LEARNER_PACE, TINY, SyncerProbe, step_times, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

RUN_ID = "shard-failover"
SHARDS, REPLICAS = 2, 2
FAILOVER_BOUND_S = 10.0
# The syncer's shipped election settings (the cluster gives `up`'s instances a 10 s lease; restated here).
SHIPPED_COORD = ["--coord-lease-s", "3", "--coord-call-timeout-s", "1.0"]
# Shard 0's longest gap between merges from the kill until shard 1 merges again: at most this many
# times its longest gap between merges in the BEFORE_WINDOW_S before the kill, plus the slack (the
# scheduling noise of a shared machine, where a new leader's restore takes CPU from everyone).
GAP_FACTOR, GAP_SLACK_S = 2.0, 1.5
BEFORE_WINDOW_S = 15.0


def _state(address: str, merges: int = 0):
    probe = SyncerProbe(address)
    try:
        return probe.state(merges)
    finally:
        probe.close()


def _leader(instances) -> tuple[object, int] | None:
    """The instance of `instances` (one shard's) that leads, and its epoch; None while none does."""
    for svc in instances:
        if svc.alive():
            state = _state(svc.address)
            if state.epoch > 0:
                return svc, state.epoch
    return None


def _history(cluster, name: str) -> list[dict]:
    return history_lib.read(cluster.workdir / f"{name}.history.jsonl")


def _merge_times(records: list[dict]) -> list[float]:
    return sorted(r["t"] for r in records if r["event"] == "merged")


def _longest_gap(times: list[float], start: float | None, end: float) -> float:
    """The longest gap between consecutive `times` in (start, end], the last one to `end` included,
    and the first one from `start` unless it is None (a window opening on the run's first merges)."""
    inside = [t for t in times if (start is None or start < t) and t <= end]
    edges = [*([] if start is None else [start]), *inside, end]
    return max(b - a for a, b in zip(edges, edges[1:]))


def _committed(etcd_endpoint: str, shard: int):
    """Shard `shard`'s commit pointer (its own key and record: the syncer's `<run>.shard-I-of-N`)."""
    store_run_id = f"{RUN_ID}.shard-{shard}-of-{SHARDS}"
    pointer = commit_lib.EtcdCommitPointer(etcd_lib.Etcd([etcd_endpoint]), prefix="/ddiloco",
                                           leader_key=election_lib.leader_key("/ddiloco", store_run_id))
    return asyncio.run(pointer.latest(store_run_id))


def _check_no_upload_applied_twice(cluster, by_shard, learner_records: dict[str, list[dict]]) -> None:
    """No upload applied twice, every acknowledged upload accounted for, versions +1 per merge from
    durable states: per shard, over its instances' histories and the learners' records of its fragments."""
    for index, shard in enumerate(by_shard):
        syncer_records = sorted((r for svc in shard for r in _history(cluster, svc.name)), key=lambda r: r["t"])
        mine = {n: [r for r in records if "fragment" not in r or int(r["fragment"]) % SHARDS == index]
                for n, records in learner_records.items()}
        uploads = invariants.check_uploads(syncer_records, mine)
        versions = invariants.check_versions(syncer_records)
        print(f"shard {index}: uploads {uploads.figures}; versions {versions.figures}")
        assert uploads.ok and not uploads.figures["double_applied"], uploads.violations
        assert versions.ok, versions.violations


def _check_learners(cluster, learner_records: dict[str, list[dict]], killed_at: float, resumed_at: float,
                    epoch_0: int, epochs_1: tuple[int, int]) -> None:
    """Learners stepped throughout, and folded in shard 1's versions of its leaders' epochs
    (`epochs_1`: old, new) only, never an older after a newer; shard 0's of its one leader."""
    for name, records in learner_records.items():
        times = [t for t in step_times(cluster, name) if killed_at - 5 <= t <= resumed_at]
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert times and max(gaps, default=0) < 3.0, (name, gaps)
        newest, shard_1_epochs = 0, set()
        for record in records:
            if record["event"] != "version":
                continue
            if int(record["fragment"]) % SHARDS == 0:
                assert record["epoch"] == epoch_0, (name, record)
                continue
            assert record["epoch"] in epochs_1 and record["epoch"] >= newest, (name, record, newest)
            newest = record["epoch"]
            shard_1_epochs.add(record["epoch"])
        assert shard_1_epochs == set(epochs_1), (name, shard_1_epochs)


def test_sigkill_of_one_shards_leader_its_standby_takes_over_and_the_other_shard_merges_on(cluster):
    etcd = cluster.start_etcd()
    cluster.start_store()
    started = time.time()
    instances = cluster.start_syncer_replicas(
        REPLICAS, shards=SHARDS, run_id=RUN_ID, extra=[*TINY, "--json-logs", *SHIPPED_COORD],
        instance_extra=lambda name: ["--history-file", str(cluster.workdir / f"{name}.history.jsonl")])
    by_shard = [instances[i * REPLICAS:(i + 1) * REPLICAS] for i in range(SHARDS)]
    leaders = []
    for shard in by_shard:
        wait_until(lambda shard=shard: _leader(shard) is not None, timeout_s=60, what="a leader per shard")
        leaders.append(_leader(shard))
    learners = [cluster.start_learner(i, region=f"region-{i}", extra=[
        "--history-file", str(cluster.workdir / f"learner-{i}.history.jsonl"), "--json-logs", "--num-shards", "2",
        "--steps", "100000", *LEARNER_PACE[:2], "--log-every-steps", "5"]).name for i in range(2)]
    (leader_0, epoch_0), (leader_1, epoch_1) = leaders
    # Shard 1 committed a checkpoint (shipped default: every 16 of its merges) and merged beyond it.
    wait_until(lambda: (s := _state(leader_1.address)).last_checkpoint_outer_step > 0
               and s.outer_steps >= s.last_checkpoint_outer_step + 2, timeout_s=240, what="shard 1's checkpoint")
    merging_s = time.time() - started
    leader_1.proc.send_signal(signal.SIGKILL)
    killed_at = time.time()
    leader_1.proc.wait(10)
    committed = _committed(etcd.endpoint, 1)
    standby_1 = next(svc for svc in by_shard[1] if svc is not leader_1)
    wait_until(lambda: _state(standby_1.address).epoch > 0, timeout_s=FAILOVER_BOUND_S + 5,
               what="shard 1's standby leads", interval_s=0.05)
    failover_s = time.time() - killed_at
    new_epoch_1 = _state(standby_1.address).epoch
    restored = _state(standby_1.address).outer_steps
    wait_until(lambda: _state(standby_1.address).outer_steps >= restored + 4, timeout_s=60,
               what="shard 1 merges again")
    resumed_at = time.time()
    for name in learners:
        cluster.services[name].stop(30)

    # Shard 1: the standby led within the bound, from exactly the committed checkpoint.
    new_life = next(r for r in _history(cluster, standby_1.name) if r["event"] == "start")
    print(f"\nshard failover: 4 syncers merging after {merging_s:.1f} s; shard 1's standby ({standby_1.name}) "
          f"leads {failover_s:.2f} s after SIGKILL of its leader ({leader_1.name}; lease 3 s), epochs {epoch_1} -> "
          f"{new_epoch_1}; restored outer step {new_life['outer_steps']} (committed {committed.step}); 4 merges of "
          f"shard 1 {resumed_at - killed_at:.2f} s after the kill")
    assert failover_s < FAILOVER_BOUND_S and new_epoch_1 > epoch_1
    assert new_life["restored"] and new_life["outer_steps"] == committed.step, (new_life, committed)
    assert committed.epoch == epoch_1

    # Shard 0 merged on across the kill window, with its leader of before.
    merges_0 = _merge_times(_history(cluster, leader_0.name))
    # Before: between shard 0's merges of the window (its start left out: the learners may still
    # have been starting), and from the last of them to the kill.
    before = [t for t in merges_0 if killed_at - BEFORE_WINDOW_S < t <= killed_at]
    assert len(before) >= 4, before
    before_s = _longest_gap(before, None, killed_at)
    across_s = _longest_gap(merges_0, killed_at, resumed_at)
    bound_s = GAP_FACTOR * before_s + GAP_SLACK_S
    print(f"shard 0: longest gap between merges {before_s:.2f} s in the {BEFORE_WINDOW_S:.0f} s before the kill, "
          f"{across_s:.2f} s from the kill until shard 1 merged again (bound {bound_s:.2f} s); "
          f"{sum(killed_at < t <= resumed_at for t in merges_0)} merges in that window")
    assert across_s <= bound_s, (across_s, before_s)
    assert sum(killed_at < t <= resumed_at for t in merges_0) >= 2
    assert _state(leader_0.address).epoch == epoch_0

    learner_records = {n: _history(cluster, n) for n in learners}
    _check_no_upload_applied_twice(cluster, by_shard, learner_records)
    _check_learners(cluster, learner_records, killed_at, resumed_at, epoch_0, (epoch_1, new_epoch_1))
