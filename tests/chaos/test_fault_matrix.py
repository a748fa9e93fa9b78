"""The fault matrix rows on crashes, hangs, partitions, bandwidth, resets and flapping links.

One test per row. To fit the CI budget the rows run in four scenario runs of three rows each
(ddiloco/chaos/scenarios.py GROUPS: 3 learners, K = 2, a store, a fault proxy in front of the
syncer for every learner; the rows of a run are phases that start once the previous one
recovered); the first test of a group runs it, the others read its result. Each test asserts the
invariants I1-I5 of the run (ddiloco/chaos/invariants.py: nothing acknowledged is lost or applied
twice, quorum and versions respected, learners hold the syncer's bytes, checkpoints load, the loss
within the margin of the fault-free run), I7 (no learner quarantined: the syncer runs its shipped
defaults) and its own row's expected behaviour and recovery. Each
run prints its one-line report. Reproduce one with `ddiloco chaos run --scenario GROUP --seed 1`
(or a single row: `ddiloco chaos list`).
"""

from __future__ import annotations

import collections
import statistics

import pytest

from ddiloco.chaos import harness, invariants, scenarios
from tests.chaos.conftest import assert_invariants

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.timeout(360)]


def _fault(result: harness.Result, kind: str, target: str | None = None, scheduled: bool = True) -> harness.InjectedFault:
    found = [f for f in result.faults if f.kind == kind and f.scheduled == scheduled
             and (target is None or f.target == target)]
    assert found, f"no {kind} fault on {target} in {result.faults}"
    return found[0]


def _failpoint_crash(result: harness.Result, target: str) -> harness.InjectedFault:
    """The crash of `target` that a failpoint (not the schedule) caused."""
    crash = _fault(result, "crash", target, scheduled=False)
    assert "failpoint" in crash.detail, crash
    return crash


def _contributors(merge: dict) -> set[str]:
    return {c[0] for c in merge["contributors"]}


def _window_end(fault: harness.InjectedFault) -> float:
    assert fault.healed_at is not None, fault
    return fault.healed_at


def _assert_marked_silent(result: harness.Result, fault: harness.InjectedFault, learner: str, *,
                          slack_s: float) -> None:
    """The syncer marked `learner` silent while `fault` lasted, within the liveness timeout (+ `slack_s`
    of polling)."""
    silent = [t for t, members in result.member_samples if fault.at <= t <= fault.healed_at
              and members.get(learner) == "SILENT"]
    assert silent and silent[0] - fault.at <= result.scenario.liveness_timeout_s + slack_s, silent[:1]


def _throughput(result: harness.Result, learner: str, start: float, end: float) -> tuple[float, float]:
    """Bytes per second through a learner's proxy (up, down) over the samples inside [start, end]."""
    inside = [s for s in result.proxy_samples[learner] if start <= s[0] <= end]
    assert len(inside) >= 2, (start, end, result.proxy_samples[learner][:3])
    (t0, up0, down0, _), (t1, up1, down1, _) = inside[0], inside[-1]
    return (up1 - up0) / (t1 - t0), (down1 - down0) / (t1 - t0)


def _upload_seconds(result: harness.Result, start: float, end: float) -> list[float]:
    return [r["t"] - r["sent_at"] for records in result.learner_histories.values() for r in records
            if r["event"] == "ack" and start <= r["sent_at"] and r["t"] <= end]


def _upload_failures(result: harness.Result) -> dict:
    """Uploads without an acknowledgement, classified (invariants.upload_failures): an upload whose
    call ended without the syncer's verdict is an unknown outcome that I1 accounts for, not a loss."""
    return invariants.upload_failures(result.syncer_history, result.learner_histories)


def test_row01_learner_sigkill_quorum_continues_and_restart_rejoins(run_scenario):
    result = run_scenario("learner-process")
    assert_invariants(result)
    kill = _fault(result, "kill", "learner-0")
    assert kill.recovery_s is not None and kill.recovery_s < 60, kill
    # Training went on: every fragment merged in the 15 s after the kill (a round waits for an
    # expected learner at most the grace window, 10 s at most). Merges without learner-0 are not
    # required: its restart (1 s after the kill) can rejoin before any round needed it.
    after = result.merges_between(kill.at, kill.at + 15.0)
    assert len({m["fragment"] for m in after}) == result.scenario.num_fragments, after
    # The restarted life (a newer incarnation) rejoined and contributed.
    lives = {c[1] for r in result.syncer_history if r["event"] == "merged" for c in r["contributors"]
             if c[0] == "learner-0"}
    assert len(lives) == 2, lives


def test_row02_learner_crash_mid_upload_is_never_applied(run_scenario):
    result = run_scenario("server-failpoints")
    assert_invariants(result)
    crash = _failpoint_crash(result, "learner-1")
    assert crash.recovery_s is not None, crash
    # The dead life's last upload was cut after a chunk: the syncer accepted nothing of it after
    # the crash, and every contribution it merged has a complete, recorded acceptance (I1).
    dead = {c[1] for r in result.syncer_history if r["event"] == "merged" for c in r["contributors"]
            if c[0] == "learner-1"}
    assert len(dead) == 2, dead  # the dead life and the restarted one both contributed
    first_life = min(dead)
    assert not [r for r in result.syncer_history if r["event"] == "accepted" and r["learner"] == "learner-1"
                and r["incarnation"] == first_life and r["t"] > crash.at + 1.0]


def test_row03_hung_learner_sigstop_merges_go_ahead_then_it_resumes(run_scenario):
    result = run_scenario("learner-process")
    assert_invariants(result)
    stop = _fault(result, "stop", "learner-2")
    during = result.merges_between(stop.at + 1.0, _window_end(stop))
    # Merges go ahead without it. A contribution it made before the stop may still be merged then (it
    # waits in its fragment's round, or the next one if it came late), but only once per fragment.
    with_it = collections.Counter(m["fragment"] for m in during if "learner-2" in _contributors(m))
    assert len(during) >= 3 and all(n <= 1 for n in with_it.values()), (with_it, len(during))
    assert any("learner-2" not in _contributors(m) for m in during), during
    # The syncer stopped waiting for it: marked silent within the liveness timeout (+ polling).
    _assert_marked_silent(result, stop, "learner-2", slack_s=2.0)
    assert stop.recovery_s is not None and stop.recovery_s < 30, stop


def test_row04_syncer_crash_between_quorum_and_apply_restores_checkpoint(run_scenario):
    result = run_scenario("server-failpoints")
    assert_invariants(result)
    crash = _failpoint_crash(result, "syncer")
    first, *later = [r["instance"] for r in result.syncer_history if r["event"] == "start"]
    assert len(later) == 1, later
    # The failpoint fired on the FAULT_AT_MERGE-th merge to start, after its quorum and before its outer step.
    # Merges of other fragments run concurrently (one task per fragment): up to P - 1 of them had
    # started (passed the failpoint) but not finished when the process died, so the crashed life
    # applied between FAULT_AT_MERGE - P and FAULT_AT_MERGE - 1, never that one.
    applied = [r for r in result.syncer_history if r["event"] == "merged" and r["instance"] == first]
    fragments = len(next(r for r in result.syncer_history if r["event"] == "start")["fragments"])
    n = scenarios.FAULT_AT_MERGE
    assert n - fragments <= len(applied) <= n - 1, (len(applied), fragments)
    assert result.check("I2").figures["restarts"] == 1
    assert crash.recovery_s is not None and crash.recovery_s < 60, crash


def test_row05_syncer_sigterm_rolling_restart_loses_nothing(run_scenario):
    result = run_scenario("learner-process")
    assert_invariants(result)
    term = _fault(result, "term", "syncer")
    assert term.detail.startswith("exited 0 after"), term.detail
    shutdown_s = float(term.detail.split()[3])
    assert shutdown_s < 10, term.detail
    lives = [r for r in result.syncer_history if r["event"] == "start"]
    assert len(lives) == 2 and lives[1]["restored"]
    first = lives[0]["instance"]
    assert any(r["event"] == "shutdown" and r["instance"] == first for r in result.syncer_history)
    # The new life restored exactly the old life's last state (graceful: the final checkpoint).
    # Compared on the global parameters: with lossy (delta) downloads what learners held in the
    # old life is their reconstruction, and a new life publishes the exact values again.
    last = {}
    for r in result.syncer_history:
        if r["event"] == "merged" and r["instance"] == first:
            last[str(r["fragment"])] = [r["version"], r["params_sha256"]]
    assert {f: [v[0], v[2]] for f, v in lives[1]["fragments"].items()} == last
    i1 = result.check("I1").figures
    assert i1["rolled_back"] == 0 and i1["lost_on_syncer_crash"] == 0, i1
    # No upload gave up or ran into a deadline. Uploads in flight when the old life stopped serving
    # may end without a verdict (outcome unknown): I1 above accounts for each one the old life took.
    failures = _upload_failures(result)
    assert failures["gave_up"] == 0 and failures["refused_deadline"] == 0, failures
    assert term.recovery_s is not None and term.recovery_s < 60, term


def test_row06_store_crash_during_checkpoint_write_keeps_checkpoints_loadable(run_scenario):
    result = run_scenario("server-failpoints")
    assert_invariants(result)
    crash = _failpoint_crash(result, "checkpoint")
    kill = _fault(result, "kill", "checkpoint")
    i4 = result.check("I4").figures
    assert i4["checkpoints"] >= 10 and i4["loadable"] == i4["checkpoints"], i4
    for fault in (crash, kill):  # checkpoints resume after each restart, training never stalled
        assert fault.recovery_s is not None and fault.recovery_s < 30, fault
        assert result.merges_between(fault.at, fault.healed_at + 1.0)
    store = result.workdir / "cluster" / "store"
    assert not [p for p in store.rglob("*") if ".tmp-" in p.name], "temp files left behind"


def test_row08_wan_latency_no_deadline_errors(run_scenario):
    result = run_scenario("link-degraded")
    assert_invariants(result)
    faults = [f for f in result.faults if f.kind == "latency"]
    assert len(faults) == 3
    start, end = max(f.at for f in faults), min(_window_end(f) for f in faults)
    uploads = _upload_seconds(result, start, end)
    # An upload is a client stream plus its response: at least one 2 x (200 +- 50) ms round trip.
    assert uploads and statistics.median(uploads) >= 0.3, uploads
    assert result.merges_between(start, end), "no merge under latency"
    failures = _upload_failures(result)
    assert failures["gave_up"] == 0 and failures["refused_deadline"] == 0, failures
    assert "DEADLINE_EXCEEDED" not in failures["by_code"], failures


def test_row09_bandwidth_cap_bounds_throughput_and_training_continues(run_scenario):
    result = run_scenario("link-degraded")
    assert_invariants(result)
    faults = [f for f in result.faults if f.kind == "bandwidth"]
    assert len(faults) == 3
    start, end = max(f.at for f in faults) + 0.5, min(_window_end(f) for f in faults)
    for learner in ("learner-0", "learner-1", "learner-2"):
        up, down = _throughput(result, learner, start, end)
        assert up <= 48_000 * 1.2 and down <= 48_000 * 1.2, (learner, up, down)
        assert down > 48_000 * 0.3, (learner, down)  # the capped link was in use
    assert result.merges_between(start, end), "training stalled under the cap"


def test_row10_partition_one_learner_quorum_continues_and_it_resyncs(run_scenario):
    result = run_scenario("link-cuts")
    assert_invariants(result)
    cut = _fault(result, "blackhole", "learner-0")
    during = result.merges_between(cut.at + 1.0, _window_end(cut))
    assert len(during) >= 3 and all("learner-0" not in _contributors(m) for m in during), during
    _assert_marked_silent(result, cut, "learner-0", slack_s=2.5)
    assert cut.recovery_s is not None and cut.recovery_s < 40, cut


def test_row11_syncer_cut_off_from_majority_makes_no_outer_step(run_scenario):
    result = run_scenario("link-cuts")
    assert_invariants(result)
    cuts = [f for f in result.faults if f.kind == "partition"]
    assert {f.target for f in cuts} == {"learner-1", "learner-2"}
    start, end = max(f.at for f in cuts), min(_window_end(f) for f in cuts)
    # Rounds that had their quorum before the cut may close within the grace window; after that,
    # below K = 2, no outer step at all (no split-brain update).
    settled = start + result.scenario.max_grace_s + 0.5
    assert not result.merges_between(settled, end), result.merges_between(settled, end)
    for cut in cuts:
        assert cut.recovery_s is not None and cut.recovery_s < 40, cut


def test_row12_connection_resets_mid_stream_never_apply_twice(run_scenario):
    result = run_scenario("link-cuts")
    assert_invariants(result)
    assert len([f for f in result.faults if f.kind == "reset"]) == 6
    # Learner-1's link resets every connection after 3 KB for 5 s: at least one upload was cut
    # mid-stream. (Before rounds were the syncer's, learner-1 uploaded on every due step and the
    # window saw 3+ resets; now it sends one upload per fragment per round and, after a reset
    # breaks its session, re-joins with backoff, so the window holds 1-2.)
    assert result.proxy_stats["learner-1"]["resets"] >= 1, result.proxy_stats["learner-1"]
    assert result.check("I1").figures["double_applied"] == 0
    limit = _fault(result, "limit_data", "learner-1")
    assert limit.recovery_s is not None and limit.recovery_s < 40, limit


def test_row13_flapping_link_no_retry_storm_progress_continues(run_scenario):
    result = run_scenario("link-degraded")
    assert_invariants(result)
    flap = _fault(result, "flap", "learner-0")
    assert result.proxy_stats["learner-0"]["flaps"] >= 3
    samples = [s for s in result.proxy_samples["learner-0"] if flap.at <= s[0] <= flap.healed_at]
    connections = samples[-1][3] - samples[0][3]
    # Jittered, capped backoff: a handful of reconnections per 3 s cycle, not a storm.
    assert connections <= 4 * (flap.healed_at - flap.at), connections
    assert result.merges_between(flap.at, flap.healed_at), "no progress while flapping"
    assert flap.recovery_s is not None and flap.recovery_s < 30, flap
