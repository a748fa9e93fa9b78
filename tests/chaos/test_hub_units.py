"""The hub soak's pieces without processes: its seeded schedule (replayable, one etcd member / one
store / one syncer under a fault at a time, disk wipes on stores only), the proxy group, and I6."""

from __future__ import annotations

import json

import pytest

from ddiloco.chaos import invariants, scenarios
from ddiloco.chaos import schedule as schedule_lib
from ddiloco.chaos.harness import Scenario
from ddiloco.chaos.proxy import FaultProxy, ProxyGroup


def test_hub_soak_schedule_is_seeded_has_30_faults_and_replays_from_its_file(tmp_path):
    scenario, events = scenarios.build("hub-soak", 3)
    assert scenario.hub and events == scenarios.build("hub-soak", 3)[1]
    assert events != scenarios.build("hub-soak", 4)[1]
    assert len(events) >= 30
    groups = {e.target.split("-")[0] for e in events}
    assert groups == {"learner", "syncer", "store", "etcd"}
    path = schedule_lib.FaultSchedule(events, seed=3, scenario=scenario.to_dict()).save(tmp_path / "faults.jsonl")
    loaded = schedule_lib.FaultSchedule.load(path)
    assert loaded.events == sorted(events, key=lambda e: (e.at_merge, e.at_step, e.t))
    assert Scenario.from_dict(loaded.scenario) == scenario


@pytest.mark.parametrize("seed", range(1, 6))
def test_at_most_one_etcd_member_store_and_syncer_under_a_fault_at_once(seed):
    """And no store fault while a wiped store is being repaired (both copies would be gone)."""
    _, events = scenarios.build("hub-soak", seed)
    for prefix in ("etcd-", "store-", "syncer-"):
        spans = sorted((e.t, e.t + e.duration_s + (scenarios.HUB_WIPE_REPAIR_S if e.kind == "wipe" else 0))
                       for e in events if e.target.startswith(prefix))
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert start >= end, (prefix, spans)


def test_wipe_targets_stores_only_and_region_the_leading_hub():
    schedule_lib.FaultEvent(0, "wipe", "store-a", {"restart_after_s": 1.0})
    with pytest.raises(ValueError, match="store-a or store-b"):
        schedule_lib.FaultEvent(0, "wipe", "syncer-a")
    with pytest.raises(ValueError, match="fault target"):
        schedule_lib.FaultEvent(0, "kill", "etcd-9")
    schedule_lib.FaultEvent(0, "region", "hub-leader", {"restart_after_s": 5.0})
    with pytest.raises(ValueError, match="targets hub-leader"):
        schedule_lib.FaultEvent(0, "region", "syncer-a")
    with pytest.raises(ValueError, match="targets hub-leader"):
        schedule_lib.FaultEvent(0, "kill", "hub-leader")


def test_a_proxy_group_sets_toxics_on_every_link_and_sums_stats():
    proxies = [FaultProxy("127.0.0.1", "127.0.0.1", 9, name=f"p{i}") for i in range(2)]
    group = ProxyGroup(proxies)
    try:
        for p in proxies:
            p.start_in_thread()
        group.set(latency_s=0.2)
        assert all(p.toxics.latency_s == 0.2 for p in proxies)
        proxies[0].stats.connections, proxies[1].stats.connections = 2, 3
        assert group.stats.connections == 5
    finally:
        group.close()


def test_i6_flags_a_version_of_an_older_epoch_after_a_newer_one():
    ok = {"learner-0": [{"event": "version", "fragment": 0, "version": 1, "epoch": 5},
                        {"event": "version", "fragment": 0, "version": 1, "epoch": 9}]}
    assert invariants.check_epochs(ok).ok and invariants.check_epochs(ok).figures["epochs"] == 2
    bad = {"learner-0": [*ok["learner-0"], {"event": "version", "fragment": 1, "version": 7, "epoch": 5}]}
    check = invariants.check_epochs(bad)
    assert not check.ok and "epoch 5 after a version of epoch 9" in check.violations[0]


def test_outage_summary_tells_a_lost_leader_from_a_standby(tmp_path):
    from ddiloco.chaos import hub

    def fault(at, healed, target="syncer-a", kind="kill"):
        return {"at": at, "healed_at": healed, "target": target, "kind": kind, "scheduled": True, "detail": ""}

    (tmp_path / "report.json").write_text(json.dumps({"t0": 100.0, "faults": [
        fault(101.0, 102.0), fault(105.0, 106.0, "syncer-b"), fault(107.0, 108.0, "etcd-1")]}))
    merges = [(100.5, "A"), (103.5, "B"), (104.0, "B"), (105.5, "B"), (107.2, "B"), (107.9, "B"), (108.5, "B")]
    (tmp_path / "history").mkdir()
    (tmp_path / "history" / "syncer.jsonl").write_text("".join(
        json.dumps({"event": "merged", "t": t, "instance": i}) + "\n" for t, i in merges))
    rows = hub.outage_summary(tmp_path).splitlines()[2:]
    assert "**leader**: first merge by the new leader 2.50 s" in rows[0]
    assert "no leader change" in rows[1] and "0.50 s" in rows[1]
    assert "2 merges, 0 checkpoints" in rows[2] and "longest merge gap 0.70 s" in rows[2]
