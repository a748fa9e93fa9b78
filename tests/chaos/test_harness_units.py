"""Unit tests of the chaos harness's pure parts: failpoint specs, schedules, invariant checkers."""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

from ddiloco.algo import fragments as fragments_lib
from ddiloco import failpoints, history
from ddiloco.chaos import invariants, schedule
from ddiloco.chaos.schedule import FaultEvent, FaultSchedule
from ddiloco.cli import processes
from services.syncer import state as state_lib

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------------------- failpoints

def test_failpoint_specs_parse_and_refuse_typos():
    assert failpoints.parse("syncer.after_quorum=crash, learner.after_chunk=crash@3") == {
        "syncer.after_quorum": ("crash", 1), "learner.after_chunk": ("crash", 3)}
    assert failpoints.parse("") == {}
    for bad in ("syncer.after_quorum", "syncer.nope=crash", "syncer.after_quorum=explode",
                "syncer.after_quorum=crash@0", "syncer.after_quorum=crash@x"):
        with pytest.raises(ValueError):
            failpoints.parse(bad)
    with pytest.raises(ValueError, match="unknown failpoint"):  # a learner point on the syncer
        failpoints.parse("learner.after_chunk=crash", prefix="syncer.")


def test_failpoint_crashes_the_process_on_the_nth_hit_with_status_137():
    code = ("from ddiloco import failpoints\n"
            "fp = failpoints.Failpoints('learner.after_chunk=crash@3')\n"
            "for i in range(5):\n"
            "    print(i, flush=True)\n"
            "    fp.hit('learner.after_chunk')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == failpoints.CRASH_EXIT_CODE
    assert out.stdout.split() == ["0", "1", "2"]


def test_services_accept_failpoints_and_history_flags():
    from services.learner import config as learner_config
    from services.syncer import config as syncer_config

    cfg = syncer_config.parse_config(["--failpoints", "syncer.after_quorum=crash@2", "--history-file", "h.jsonl"], {})
    assert cfg.failpoints == "syncer.after_quorum=crash@2" and cfg.history_file == "h.jsonl"
    env = {"DDILOCO_LEARNER_FAILPOINTS": "learner.after_chunk=crash", "DDILOCO_LEARNER_HISTORY_FILE": "l.jsonl"}
    lcfg = learner_config.parse_learner_config([], env)
    assert lcfg.failpoints == "learner.after_chunk=crash" and lcfg.history_file == "l.jsonl"
    with pytest.raises(SystemExit):
        syncer_config.parse_config(["--failpoints", "learner.after_chunk=crash"], {})


# ---------------------------------------------------------------------------------- schedules

def test_kill_loop_is_seeded_and_respects_its_bounds(tmp_path):
    a = schedule.kill_loop(seed=7, duration_s=200, mtbf_s=4, learners=3)
    assert a == schedule.kill_loop(seed=7, duration_s=200, mtbf_s=4, learners=3)
    assert a != schedule.kill_loop(seed=8, duration_s=200, mtbf_s=4, learners=3)
    assert 25 <= len(a) <= 60 and all(0 <= e.t < 200 for e in a)
    assert {e.target for e in a} >= {"syncer", "checkpoint", "learner-0", "learner-1", "learner-2"}
    # One fault at a time per target, and at most one learner under a fault at once.
    busy: dict[str, float] = {}
    for e in sorted(a, key=lambda e: e.t):
        assert busy.get(e.target, -1) <= e.t, e
        learners_down = [t for t, until in busy.items() if t.startswith("learner-") and until > e.t]
        assert not (e.target.startswith("learner-") and learners_down), (e, learners_down)
        busy[e.target] = e.t + e.duration_s
    only_process = schedule.kill_loop(seed=7, duration_s=200, mtbf_s=4, learners=3, network=False)
    assert {e.kind for e in only_process} <= set(schedule.PROCESS_KINDS)


def test_schedule_file_round_trip_replays_exactly(tmp_path):
    events = schedule.kill_loop(seed=3, duration_s=60, mtbf_s=3, learners=2)
    events.append(FaultEvent(1.5, "partition", "learner-1", {"duration_s": 2}, at_merge=40))
    path = FaultSchedule(events=events, seed=3, scenario={"name": "x", "learners": 2}).save(tmp_path / "faults.jsonl")
    loaded = FaultSchedule.load(path)
    assert loaded.seed == 3 and loaded.scenario == {"name": "x", "learners": 2}
    assert sorted(loaded.events, key=lambda e: (e.at_merge, e.t)) == sorted(events, key=lambda e: (e.at_merge, e.t))
    (tmp_path / "bad.jsonl").write_text('{"t": 1, "kind": "explode", "target": "syncer"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        FaultSchedule.load(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError):
        FaultEvent(0, "latency", "syncer")  # link faults act on a learner's link


def test_history_writer_survives_a_torn_last_line(tmp_path):
    w = history.HistoryWriter(tmp_path / "h.jsonl")
    w.write("accepted", learner="a", fragment=1)
    w.close()
    with open(tmp_path / "h.jsonl", "a") as f:
        f.write('{"event": "merged", "t": 1')  # a process killed mid-write
    records = history.read(tmp_path / "h.jsonl")
    assert [r["event"] for r in records] == ["accepted"] and records[0]["learner"] == "a"
    assert history.read(tmp_path / "missing.jsonl") == []


# ---------------------------------------------------------------------------------- invariants

def _start(inst, t, versions, restored=False, steps=0, k=2):
    return {"event": "start", "t": t, "instance": inst, "restored": restored, "outer_steps": steps, "min_quorum": k,
            "fragments": {str(f): [v, f"p{inst}{f}v{v}", f"p{inst}{f}v{v}"] for f, v in versions.items()}}


def _acc(inst, t, learner, frag, base, inc=1):
    return {"event": "accepted", "t": t, "instance": inst, "learner": learner, "incarnation": inc, "fragment": frag,
            "base_version": base, "tokens": 10}


def _merged(inst, t, frag, version, contributors, sha=None):
    sha = sha or f"p{inst}{frag}v{version}"
    return {"event": "merged", "t": t, "instance": inst, "fragment": frag, "version": version, "sha256": sha,
            "params_sha256": sha, "reason": "all_contributed",
            "contributors": [[lid, 1, base, 10] for lid, base in contributors]}


def _ack(inst, learner, frag, base, result="accepted"):
    return {"event": "ack", "t": 0, "learner": learner, "incarnation": 1, "instance": inst, "fragment": frag,
            "base_version": base, "result": result, "sent_at": 0}


def _healthy_history():
    return [
        _start("A", 0, {0: 0}),
        _acc("A", 1, "l0", 0, 0), _acc("A", 1, "l1", 0, 0),
        _merged("A", 2, 0, 1, [("l0", 0), ("l1", 0)]),
        {"event": "checkpoint", "t": 3, "instance": "A", "outer_step": 1, "versions": {"0": 1}},
        _acc("A", 4, "l0", 0, 1),
        {"event": "shutdown", "t": 5, "instance": "A", "pending": [[0, "l0", 1, 1]]},
    ]


def test_i1_healthy_history_classifies_pending_and_applied():
    learners = {"l0": [_ack("A", "l0", 0, 0), _ack("A", "l0", 0, 1)], "l1": [_ack("A", "l1", 0, 0, "duplicate")]}
    check = invariants.check_uploads(_healthy_history(), learners)
    assert check.ok, check.violations
    assert check.figures["applied"] == 2 and check.figures["pending"] == 1 and check.figures["lost"] == 0


def test_i1_finds_lost_acks_double_applies_and_unrecorded_contributors():
    syncer = _healthy_history()[:-1] + [_merged("A", 4.5, 0, 2, [("l0", 0), ("l2", 0)]),
                                        {"event": "shutdown", "t": 5, "instance": "A", "pending": []}]
    learners = {"l0": [_ack("A", "l0", 0, 0), _ack("A", "l0", 0, 1)], "l1": [_ack("A", "l1", 0, 7)]}
    check = invariants.check_uploads(syncer, learners)
    text = "\n".join(check.violations)
    assert not check.ok
    assert check.figures["double_applied"] == 1 and "applied 2 times" in text  # l0's base-0 upload
    assert "never recorded as accepted" in text  # l2 was never accepted
    assert check.figures["lost"] == 2  # l0 base 1 (life ended gracefully, not pending) and l1 base 7


def test_i1_counts_uploads_dropped_or_rolled_back_by_a_syncer_crash_without_failing():
    syncer = [
        _start("A", 0, {0: 0}),
        _acc("A", 1, "l0", 0, 0), _acc("A", 1, "l1", 0, 0),
        _merged("A", 2, 0, 1, [("l0", 0), ("l1", 0)]),
        _acc("A", 3, "l0", 0, 1),  # in the open round when A crashes
        _start("B", 10, {0: 0}, restored=False),  # B restored nothing: merge 1 of A is rolled back
        {"event": "shutdown", "t": 11, "instance": "B", "pending": []},
    ]
    learners = {"l0": [_ack("A", "l0", 0, 0), _ack("A", "l0", 0, 1)], "l1": [_ack("A", "l1", 0, 0)]}
    check = invariants.check_uploads(syncer, learners)
    assert check.ok, check.violations
    assert check.figures["rolled_back"] == 2 and check.figures["lost_on_syncer_crash"] == 1


def test_i1_classifies_accepted_but_unacknowledged_uploads_by_the_same_rules():
    # l2's uploads were accepted but their acknowledgements never arrived: one merged in a merge that
    # B then rolled back (counted as applied: only acknowledged uploads are called rolled back), one
    # in the open round when A crashed, one pending at B's graceful shutdown, one in nothing (lost).
    syncer = [
        _start("A", 0, {0: 0}),
        _acc("A", 1, "l0", 0, 0), _acc("A", 1, "l2", 0, 0),
        _merged("A", 2, 0, 1, [("l0", 0), ("l2", 0)]),
        _acc("A", 3, "l2", 0, 1),
        _start("B", 10, {0: 0}),
        _acc("B", 11, "l2", 0, 0, inc=2), _acc("B", 11, "l2", 0, 0, inc=3),
        {"event": "shutdown", "t": 12, "instance": "B", "pending": [[0, "l2", 2, 0]]},
    ]
    check = invariants.check_uploads(syncer, {"l0": [_ack("A", "l0", 0, 0)]})
    assert check.figures["rolled_back"] == 1 and check.figures["applied"] == 0
    assert check.figures["accepted_unacked"] == {"applied": 1, "lost_on_syncer_crash": 1, "pending": 1, "lost": 1}
    assert not check.ok and check.violations == [
        "upload ('B', 'l2', 3, 0, 0) was accepted by a syncer life that ended gracefully but is in no merge and not pending"]


def _failed(inst, learner, frag, base, code=None):
    rec = {"event": "failed", "t": 0, "learner": learner, "incarnation": 1, "instance": inst, "fragment": frag,
           "base_version": base, "sent_at": 0}
    return rec if code is None else {**rec, "code": code}


def test_upload_failures_tell_an_unknown_outcome_from_a_failure():
    # A rolling restart (row 5): A stops serving while l0's and l1's uploads are in flight. A took
    # l0's (accepted, left pending at the graceful shutdown) before its stream was cut; l1's
    # never arrived. Both learners recorded `failed` with an outcome-unknown code: no loss (I1
    # holds), and neither may count as a failed upload (it did, in CI's row 5).
    syncer = [_start("A", 0, {0: 0}), _acc("A", 1, "l0", 0, 0),
              {"event": "shutdown", "t": 2, "instance": "A", "pending": [[0, "l0", 1, 0]]},
              _start("B", 3, {0: 0}, restored=True)]
    learners = {"l0": [_failed("A", "l0", 0, 0, "CANCELLED")], "l1": [_failed("A", "l1", 0, 0, "UNAVAILABLE")]}
    assert invariants.check_uploads(syncer, learners).ok
    failures = invariants.upload_failures(syncer, learners)
    assert failures["gave_up"] == failures["refused_deadline"] == 0, failures
    assert failures["outcome_unknown"] == 2 and failures["taken"] == 1 and failures["not_taken"] == 1, failures
    assert failures["by_code"] == {"CANCELLED": 1, "UNAVAILABLE": 1}
    # Retries that ran out, and the syncer's DEADLINE_EXCEEDED verdict, are failures.
    learners["l1"] += [_failed("B", "l1", 0, 0), {**_failed("B", "l1", 0, 1), "event": "refused",
                                                  "code": "DEADLINE_EXCEEDED"}]
    failures = invariants.upload_failures(syncer, learners)
    assert failures["gave_up"] == 1 and failures["refused_deadline"] == 1 and failures["outcome_unknown"] == 2


def test_i2_finds_version_gaps_small_quorums_and_restores_of_unknown_states():
    syncer = [
        _start("A", 0, {0: 0, 1: 0}),
        _merged("A", 1, 0, 1, [("l0", 0), ("l1", 0)]),
        _merged("A", 2, 0, 3, [("l0", 1), ("l1", 1)]),  # gap
        _merged("A", 3, 1, 1, [("l0", 0)]),  # one contributor < K = 2
        {"event": "checkpoint", "t": 4, "instance": "A", "outer_step": 3, "versions": {"0": 3, "1": 1}},
        _start("B", 5, {0: 2, 1: 1}, steps=2),  # version 2 of fragment 0 never existed; older than the checkpoint
    ]
    check = invariants.check_versions(syncer)
    text = "\n".join(check.violations)
    assert "expected 2" in text and "< min_quorum 2" in text
    assert "no earlier life had" in text and "older than the committed checkpoint" in text
    assert invariants.check_versions(_healthy_history()).ok


def test_i2_counts_a_merge_below_k_only_when_the_syncer_found_the_quorum_unreachable():
    last = {**_merged("A", 2, 0, 2, [("l1", 1)]), "reason": "quorum_unreachable"}  # the last learner's last work
    check = invariants.check_versions([*_healthy_history()[:4], last])
    assert check.ok and check.figures["quorum_unreachable"] == 1 and check.figures["below_quorum"] == 0
    hidden = {**last, "reason": "grace_expired"}
    assert not invariants.check_versions([*_healthy_history()[:4], hidden]).ok


def test_i3_compares_learner_hashes_with_the_syncer_life_they_came_from():
    syncer = _healthy_history()
    good = {"held": {"0": {"version": 1, "sha256": "pA0v1"}}, "held_instances": {"0": "A"}, "incarnation": 1}
    assert invariants.check_learner_hashes(syncer, {"l0": good}).ok
    bad = {"held": {"0": {"version": 1, "sha256": "something else"}}, "held_instances": {"0": "A"}, "incarnation": 1}
    check = invariants.check_learner_hashes(syncer, {"l0": bad, "l1": None})
    assert not check.ok and check.figures["hash_equal"] == 0 and len(check.violations) == 2


def test_i4_and_i5_checkpoints_and_loss():
    params = np.arange(4, dtype=np.float32)
    digest = fragments_lib.fragment_sha256(params)
    syncer = [_start("A", 0, {0: 0}), _merged("A", 1, 0, 1, [("l0", 0), ("l1", 0)], sha=digest)]
    good, torn = (state_lib.SyncerSnapshot(outer_steps=1, tokens_merged=0, fragments=[state_lib.FragmentSnapshot(
        fragment_id=0, version=1, params=values, opt_state=[], params_sha256=digest)]) for values in (params, params + 1))
    assert invariants.check_checkpoints(syncer, [(1, good)]).ok
    check = invariants.check_checkpoints(syncer, [(1, good), (2, torn), (3, ValueError("unreadable"))])
    assert check.figures == {"checkpoints": 3, "loadable": 1} and len(check.violations) >= 3
    assert invariants.check_loss(3.0, 2.9, 0.15).ok
    assert not invariants.check_loss(3.5, 2.9, 0.15).ok
    assert invariants.check_loss(None, 2.9, 0.15).skipped


def test_i7_fails_on_a_learner_quarantined_at_the_end_or_seen_quarantined_by_the_poller():
    members = [{"learner_id": "learner-0", "flags": "4"}, {"learner_id": "learner-1"}]
    assert invariants.check_quarantines(members, {}).ok  # flag 4: beyond the norm bound once, no quarantine
    # Quarantined at least once (flag 16, uint64 as MessageToDict gives it), or now.
    ended = invariants.check_quarantines([*members, {"learner_id": "learner-2", "flags": "20"}], {})
    assert not ended.ok and ended.figures == {"quarantined": ["learner-2"]}
    assert not invariants.check_quarantines([{"learner_id": "learner-1", "quarantined": True}], {}).ok
    seen = invariants.check_quarantines(members, {"learner-1": 1.0})  # a restarted syncer forgot it
    assert seen.violations == ["learner-1 was quarantined"]


def test_chaos_rows_and_goodput_run_the_shipped_robustness_defaults():
    # Issue 24: what ships is what is tested. No scenario, and no mode of the goodput benchmark,
    # passes a robustness flag to the syncer (norm bound, quarantine, direction, influence).
    from ddiloco.bench import goodput
    from ddiloco.chaos import scenarios as scenarios_lib

    robustness = ("--norm-bound", "--quarantine", "--direction", "--max-merge-share", "--max-batch-ratio",
                  "--norm-clip-factor")
    built = [scenarios_lib.base("row", 1)] + [goodput.mode_scenario(goodput.GoodputConfig(), m) for m in goodput.MODES]
    for sc in built:
        assert not [a for a in sc.syncer_args if a.startswith(robustness)], (sc.name, sc.syncer_args)


# ---------------------------------------------------------------------------------- CLI

def test_cli_list_schedule_and_replay_rebuild_the_same_run(tmp_path, monkeypatch, capsys):
    from ddiloco.chaos import cli, scenarios
    from ddiloco.chaos.harness import Scenario

    assert cli.main(["list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in (*scenarios.GROUPS, "soak", "baseline"))
    assert cli.main(["schedule", "--seed", "5", "--duration-s", "60", "--mtbf-s", "3", "--out",
                     str(tmp_path / "f.jsonl")]) == 0
    written = FaultSchedule.load(tmp_path / "f.jsonl")
    assert written.events == sorted(schedule.kill_loop(seed=5, duration_s=60, mtbf_s=3, learners=3),
                                    key=lambda e: (e.at_merge, e.t))
    # A run's faults.jsonl replays the same scenario and events (the cluster itself is not started here).
    seen = []
    monkeypatch.setattr(cli, "_run", lambda scenario, events, args: seen.append((scenario, list(events))) or 0)
    assert cli.main(["run", "--scenario", "link-cuts", "--seed", "3"]) == 0
    scenario, events = scenarios.build("link-cuts", 3)
    FaultSchedule(events=events, seed=3, scenario=scenario.to_dict()).save(tmp_path / "faults.jsonl")
    assert cli.main(["replay", str(tmp_path / "faults.jsonl")]) == 0
    assert seen[0][0] == seen[1][0] == scenario and Scenario.from_dict(scenario.to_dict()) == scenario
    assert sorted(seen[1][1], key=lambda e: (e.at_merge, e.t)) == sorted(events, key=lambda e: (e.at_merge, e.t))


def test_step_loop_places_faults_in_training_progress(tmp_path):
    a = schedule.step_loop(seed=4, steps=300, mtbf_steps=30, learners=6)
    assert a == schedule.step_loop(seed=4, steps=300, mtbf_steps=30, learners=6)
    assert a != schedule.step_loop(seed=5, steps=300, mtbf_steps=30, learners=6)
    assert 4 <= len(a) <= 20
    assert {e.kind for e in a} == {"kill", "stop"} and all(e.t == 0 and not e.at_merge for e in a)
    assert all(10 <= e.at_step < 280 and e.target.startswith("learner-") for e in a)
    last: dict[str, int] = {}
    for e in sorted(a, key=lambda e: e.at_step):  # a learner's faults are cooldown_steps apart
        assert e.at_step - last.get(e.target, -100) >= 19, e
        last[e.target] = e.at_step
    # at_step survives the file round trip and gates only on a learner's own steps.
    loaded = FaultSchedule.load(FaultSchedule(events=a, seed=4).save(tmp_path / "faults.jsonl"))
    assert loaded.events == sorted(a, key=lambda e: e.at_step) and a[0].to_json()["at_step"] == a[0].at_step
    with pytest.raises(ValueError):
        FaultEvent(0, "kill", "syncer", at_step=5)
    with pytest.raises(ValueError):
        FaultEvent(0, "kill", "learner-0", at_step=5, at_merge=3)
    with pytest.raises(ValueError):
        schedule.step_loop(seed=1, steps=100, mtbf_steps=10, learners=2, mix={"partition": 1.0})


def test_goodput_benchmark_gives_every_mode_the_same_faults():
    from ddiloco.bench import goodput

    cfg = goodput.GoodputConfig(learners=6, steps=300, mtbf_steps=30, seed=2)
    events = goodput.failure_schedule(cfg)
    # A function of the config only (no clock): the same faults, targets and steps for each mode.
    assert events == goodput.failure_schedule(cfg) and events
    assert all(e.at_step and not e.at_merge for e in events)
    scenarios = {m: goodput.mode_scenario(cfg, m) for m in goodput.MODES}
    assert {s.learners for s in scenarios.values()} == {6}
    assert {s.steps for s in scenarios.values()} == {goodput.BUDGET_STEP_CAP * 300}  # the budget ends the run
    assert {s.syncer_args[-1] for s in scenarios.values()} == {str(goodput.token_budget(cfg))}
    assert scenarios["decoupled"].min_quorum == cfg.decoupled_quorum
    assert scenarios["diloco"].min_quorum == scenarios["dp"].min_quorum == 6
    # A synchronous straggler cannot progress once a peer finished: not charged a 90 s wait.
    assert scenarios["diloco"].finish_grace_s == scenarios["dp"].finish_grace_s < scenarios["decoupled"].finish_grace_s
    assert len(goodput.failure_schedule(goodput.GoodputConfig(learners=6, steps=300, mtbf_steps=15, seed=2))) > len(events)


def test_goodput_time_to_merged_tokens_reads_the_syncer_histories(tmp_path):
    from ddiloco.bench import goodput

    def history(name: str, merges: list[tuple[float, list[int]]]) -> None:
        path = tmp_path / name / "history" / "syncer.jsonl"
        path.parent.mkdir(parents=True)
        lines = [{"event": "joined", "t": 0.5}]
        lines += [{"event": "merged", "t": t, "fragment": i % 2,
                   "contributors": [[f"learner-{k}", 1, 0, tokens] for k, tokens in enumerate(contrib)]}
                  for i, (t, contrib) in enumerate(merges)]
        path.write_text("\n".join(json.dumps(rec) for rec in lines) + "\n")

    # Two fragments: a merge counts its contributors' tokens / 2.
    history("decoupled", [(10.0, [100]), (11.0, [100, 100]), (14.0, [300])])  # 50, 150, 300
    history("decoupled-baseline", [(5.0, [200]), (6.0, [200]), (7.0, [200])])  # 100, 200, 300
    history("dp", [(3.0, [400, 400])])  # 400
    history("dp-baseline", [(2.0, [200]), (3.5, [800])])  # 100, 500
    curve = goodput.merged_token_curve(tmp_path / "decoupled" / "history" / "syncer.jsonl", fragments=2)
    assert curve == [(0.0, 50.0), (1.0, 150.0), (4.0, 300.0)]
    assert goodput.time_to_tokens(curve, 150.0) == 1.0 and goodput.time_to_tokens(curve, 301.0) is None

    out = {"config": {"num_fragments": 2}, "modes": {"decoupled": {}, "dp": {}}}
    goodput.add_token_milestones(out, tmp_path)
    assert out["tokens_target"] == 150.0  # half of the smallest total (300)
    assert out["modes"]["decoupled"] == {"time_to_tokens_s": 1.0, "baseline_time_to_tokens_s": 1.0}
    assert out["modes"]["dp"] == {"time_to_tokens_s": 0.0, "baseline_time_to_tokens_s": 1.5}


def test_slowdown_ratio_of_a_run_stopped_at_the_wall_limit_is_an_upper_bound():
    from types import SimpleNamespace

    from ddiloco.bench import goodput

    def run(finished: dict[str, float], stopped_at: float):
        return SimpleNamespace(t0=100.0, stopped_at=stopped_at, learner_finished_at=finished,
                               scenario=SimpleNamespace(learners=3))

    done = run({"learner-0": 110.0, "learner-1": 120.0, "learner-2": 130.0}, stopped_at=130.0)
    assert goodput.learner_time(done) == (60.0, True)
    # One learner still training when the run was stopped at t = 200: counted until the stop.
    stopped = run({"learner-0": 150.0, "learner-1": 160.0}, stopped_at=200.0)
    assert goodput.learner_time(stopped) == (50.0 + 60.0 + 100.0, False)
    # No stop time and learners missing (the schedule never started, or the driver crashed): unknown.
    assert goodput.learner_time(run({"learner-0": 150.0}, stopped_at=0.0)) == (None, False)

    row = {"slowdown_ratio": None, "slowdown_ratio_at_most": 60.0 / 210.0, "stopped_after_s": 100.0}
    assert goodput._slowdown_cell(row) == "<= 28.6 % (stopped 100 s into the schedule)"
    assert goodput._slowdown_cell({"slowdown_ratio": 0.922}) == "92.2 %"


def test_a_services_preset_port_is_free_and_outside_the_ephemeral_range():
    # A port from bind(0) is ephemeral: an outgoing connection could take it before the syncer
    # binds it. The preset port is below the kernel's ephemeral range and free when chosen.
    low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {processes.preset_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports), sorted(ports)
    assert len(ports) > 1  # random, not a fixed port
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))
