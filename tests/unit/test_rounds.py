"""Syncer-scheduled rounds (ddiloco.algo.rounds, SyncerCore with round_trigger="schedule") and the
learner's on-arrival rules (ddiloco.algo.arrival). Pure: injected clock, no sleeps, no network."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ddiloco.algo import arrival as arrival_lib
from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import rounds as rounds_lib
from ddiloco.v1 import syncer_pb2
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde
from services.syncer import wire_views
from tests.fakes import FakeClock, accept, join, make_core, settle

# --------------------------------------------------------------------------------- schedule


def _plan(num_fragments: int = 4, period: int = 8) -> fragments_lib.FragmentPlan:
    specs = [fragments_lib.TensorSpec(f"t{i}", (4,)) for i in range(num_fragments)]
    return fragments_lib.plan_fragments(specs, num_fragments, period)


def test_schedule_opens_each_fragment_at_its_staggered_slot_of_the_mean_progress():
    plan = _plan(4, 8)  # offsets 0, 2, 4, 6: fragment 0 first at step 8
    schedule = rounds_lib.RoundSchedule(plan)
    opened: dict[int, list[float]] = {f: [] for f in range(4)}
    for step in range(0, 25):
        for learner in ("a", "b"):  # two learners in lockstep: the global step is their step
            schedule.observe(learner, step, live_learners=2)
        for fid in schedule.due(lambda fid: False):
            opened[fid].append(schedule.global_step)
    assert opened == {0: [8.0, 16.0, 24.0], 1: [2.0, 10.0, 18.0], 2: [4.0, 12.0, 20.0], 3: [6.0, 14.0, 22.0]}


def test_schedule_counts_mean_progress_so_learners_in_other_phases_share_rounds():
    schedule = rounds_lib.RoundSchedule(_plan(4, 8))
    schedule.observe("fast", 100, live_learners=2)  # baselines: a long-running and a new learner
    schedule.observe("new", 0, live_learners=2)
    schedule.observe("fast", 106, live_learners=2)
    schedule.observe("new", 2, live_learners=2)
    assert schedule.global_step == pytest.approx(4.0)  # (6 + 2) / 2
    schedule.observe("new", 1, live_learners=2)  # a restart (lower step) is a new baseline, not a step back
    assert schedule.global_step == pytest.approx(4.0)


def test_schedule_holds_a_round_while_the_previous_one_is_open_then_skips_to_the_next_slot():
    schedule = rounds_lib.RoundSchedule(_plan(1, 4))
    schedule.observe("a", 0, 1)
    schedule.observe("a", 4, 1)
    assert schedule.due(lambda fid: False) == [0]
    schedule.observe("a", 13, 1)  # the round at 8 is late: the previous one is still open
    assert schedule.due(lambda fid: True) == []
    assert schedule.due(lambda fid: False) == [0]  # opens at once when it merged ...
    assert schedule.next_open(0) == 16.0  # ... and the next is the first slot after step 13
    assert schedule.due(lambda fid: False) == []


# ------------------------------------------------------------------------------ on arrival


def _pending(delta, mark=10, steps=5, tokens=50, sent=None):
    return arrival_lib.PendingContribution(mark_step=mark, delta=np.asarray(delta, np.float32), steps=steps,
                                           tokens=tokens, sent=None if sent is None else np.asarray(sent, np.float32),
                                           accepted=True, accepted_version=3, syncer_instance="i")


def test_rebase_keeps_all_progress_when_the_new_version_does_not_hold_it():
    held, new = np.zeros(3, np.float32), np.array([1.0, 2.0, 3.0], np.float32)
    local = np.array([-0.5, 0.0, 0.5], np.float32)  # progress = held - local = [0.5, 0, -0.5]
    out = arrival_lib.fold_in(rule="rebase", local=local, held=held, new=new, pending=_pending([0.5, 0, -0.5]),
                              merged_through_step=9)
    assert out.merged is None and not out.reset_counters
    np.testing.assert_allclose(new - out.local, held - local)  # the same progress against the new version


def test_rebase_drops_exactly_the_merged_contribution_and_keeps_the_error_feedback():
    held, new = np.zeros(3, np.float32), np.array([0.2, 0.2, 0.2], np.float32)
    sent_delta = np.array([0.5, 0.0, -0.5], np.float32)
    local = held - sent_delta - np.array([0.1, 0.1, 0.1], np.float32)  # + 0.1 progress after the upload
    decoded = np.array([0.48, 0.0, -0.48], np.float32)  # what the lossy codec delivered
    out = arrival_lib.fold_in(rule="rebase", local=local, held=held, new=new,
                              pending=_pending(sent_delta, sent=decoded), merged_through_step=10)
    assert out.merged is not None
    # Left to contribute: the progress after the upload plus what quantization did not deliver.
    np.testing.assert_allclose(new - out.local, [0.1 + 0.02, 0.1, 0.1 - 0.02], atol=1e-6)


def test_overwrite_and_mix_reset_and_unknown_rules_fail():
    held, new, local = np.zeros(2, np.float32), np.ones(2, np.float32), np.full(2, 3.0, np.float32)
    over = arrival_lib.fold_in(rule="overwrite", local=local, held=held, new=new, pending=None, merged_through_step=0)
    np.testing.assert_array_equal(over.local, new)
    assert over.reset_counters
    mix = arrival_lib.fold_in(rule="mix", local=local, held=held, new=new, pending=None, merged_through_step=0, alpha=0.5)
    np.testing.assert_allclose(mix.local, [2.0, 2.0])
    with pytest.raises(ValueError, match="rule"):
        arrival_lib.fold_in(rule="keep", local=local, held=held, new=new, pending=None, merged_through_step=0)


def test_pending_is_resolved_unmerged_only_by_a_later_version_or_another_syncer_life():
    pending = _pending([1.0], mark=10)
    assert not pending.resolved_unmerged(3, "i", 0)  # produced before the accept: may still come
    assert pending.resolved_unmerged(4, "i", 7)  # the version after the accept does not hold it
    assert not pending.resolved_unmerged(4, "i", 10)  # it does
    assert pending.resolved_unmerged(1, "other", 0)  # a restarted syncer whose checkpoint lacks it


# ------------------------------------------------------------------------ scheduled core


def make_scheduled_core(clock: FakeClock, *, grace_gamma: float = 0.8, min_quorum: int = 1):
    # Offsets 0 and 2: rounds at global steps 2, 4, 6, ...
    return make_core(clock, sync_period_steps=4, overlap_steps=4, max_staleness_versions=4, initial_std=0.0,
                     grace_gamma=grace_gamma, merge_history=64, round_trigger="schedule", min_quorum=min_quorum)


def report(core, learner_id: str, step: int, *, step_time_s: float = 1.0, finished: bool = False) -> None:
    core.report_progress(wire_views.progress(syncer_pb2.ReportProgressRequest(
        protocol_version=serde.PROTOCOL_VERSION, learner_id=learner_id, incarnation=1, local_step=step,
        step_time_s=step_time_s, finished=finished)), wire_bytes=0)


def join_all(core, learner_ids, *, step: int = 0) -> None:
    """Each learner joins and reports `step`."""
    for lid in learner_ids:
        join(core, lid)
        report(core, lid, step)


async def contribute(core, learner_id: str, fid: int, *, mark: int, value: float = 0.01, final: bool = False):
    n = core.plan.fragments[fid].numel
    enc = codec_lib.encode(np.full(n, value, np.float32), "fp32")
    header = syncer_pb2.UploadHeader(
        protocol_version=serde.PROTOCOL_VERSION, learner_id=learner_id, incarnation=1, fragment_id=fid,
        base_version=core.slots[fid].version, syncer_instance=core.instance, steps=4, tokens=400,
        payload=serde.payload_info_to_proto(enc), local_step=mark, final=final)
    return await accept(core, header, enc.payload)


def test_rounds_open_on_the_syncers_schedule_and_merge_every_called_learner(clock):
    async def run():
        core = make_scheduled_core(clock)
        join_all(core, ("a", "b", "c"))
        await contribute(core, "a", 0, mark=1)  # early: no round open, it waits for the schedule
        core.tick()
        await settle()
        assert core.slots[0].version == 0 and core.round_call(0, "b") is None
        for lid in ("a", "b", "c"):
            report(core, lid, 2)  # global step 2: fragment 1's round (offset 2) opens
        assert core.round_call(1, "a") is not None and core.round_call(0, "a") is None
        for lid in ("a", "b", "c"):
            report(core, lid, 4)  # global step 4: fragment 0's round opens, holding a's early work
        call = core.round_call(0, "b")
        assert call is not None and call.version == 0 and core.round_call(0, "a") is None  # a is in already
        await contribute(core, "b", 0, mark=4)
        await settle()
        assert core.slots[0].version == 0  # waiting for c (grace window: 0.8 * 4 * 1 s)
        clock.now_s += 0.5
        await contribute(core, "c", 0, mark=4)
        await settle()
        assert core.slots[0].version == 1
        record = core.rounds.merges[-1]
        assert record.reason == "all_contributed" and len(record.contributors) == 3
        assert record.expected_contributors == 3 and record.round == 1
        assert record.quorum_wait_s == pytest.approx(0.0)  # a's early contribution met K = 1 at the call
        assert core.merged_through_step("b", 1, 0, 1) == 4
        assert core.merged_through_step("b", 1, 0, 0) == 0  # version 0 did not hold it
        state = wire_views.training_state(core, 0)
        assert state.fragments[0].round == 1 and not state.fragments[0].round_open
        assert state.fragments[1].round_open

    asyncio.run(run())


def test_quorum_time_runs_from_the_call_and_the_grace_window_closes_a_round_without_a_straggler(clock):
    async def run():
        core = make_scheduled_core(clock, grace_gamma=0.5)
        join_all(core, ("a", "b"))
        for lid in ("a", "b"):
            report(core, lid, 2)
        clock.now_s += 0.25  # a answers a quarter step after the call
        await contribute(core, "a", 1, mark=2)
        await settle()
        assert core.slots[1].version == 0
        assert wire_views.training_state(core, 0).quorum_time_s == pytest.approx(0.25)
        # grace = 0.5 * (4 * 1 s - 0.25 s - 0 s) = 1.875 s after quorum
        assert core.grace_window_s() == pytest.approx(1.875)
        clock.now_s += 1.8
        core.tick()
        await settle()
        assert core.slots[1].version == 0
        clock.now_s += 0.1
        core.tick()
        await settle()
        assert core.slots[1].version == 1 and core.rounds.merges[-1].reason == "grace_expired"
        assert core.rounds.merges[-1].expected_contributors == 2

    asyncio.run(run())


def test_final_contributions_join_the_next_scheduled_round_until_nobody_trains(clock):
    async def run():
        core = make_scheduled_core(clock)
        join_all(core, ("a", "b"))
        await contribute(core, "a", 0, mark=1, final=True)  # a is done; b still trains
        await settle()
        # No round of its own (that would add an outer step per learner at the end): a's last work
        # waits for fragment 0's next scheduled round, and a is no longer waited for.
        assert not core.slots[0].round.open and core.membership.expected_learners() == {"b"}
        report(core, "b", 4)  # global step 4: fragment 0's round opens with a's work in it
        assert core.slots[0].round.open and core.round_call(0, "b") is not None
        await contribute(core, "b", 0, mark=4)
        await settle()
        assert core.slots[0].version == 1 and len(core.rounds.merges[-1].contributors) == 2
        assert core.rounds.merges[-1].expected_contributors == 2
        await contribute(core, "b", 1, mark=5, final=True)  # the last learner finishes: no schedule left
        await settle()
        assert core.slots[1].version == 1 and core.rounds.merges[-1].reason == "all_contributed"
        assert core.membership.expected_learners() == set()
        # The reports carried no tokens; the merges hold a's 400 (fragment 0) and b's 400 per fragment.
        assert core.membership.tokens_processed() == 800

    asyncio.run(run())


def test_a_quorum_that_can_no_longer_form_does_not_hold_the_last_learners_work(clock):
    async def run():
        core = make_scheduled_core(clock, min_quorum=2)
        join_all(core, ("a", "b"))
        await contribute(core, "a", 0, mark=1, final=True)  # a is done, with nothing left on fragment 1
        await settle()
        report(core, "b", 4)  # both rounds open; fragment 0's holds a's last work
        await contribute(core, "b", 0, mark=4)
        await settle()
        assert core.slots[0].version == 1 and core.rounds.merges[-1].reason == "all_contributed"  # K = 2 met
        # Fragment 1: b is the only learner that could ever contribute (a finished): K = 2 cannot
        # form, and every expected learner is in. The old rule held the round below quorum for good.
        await contribute(core, "b", 1, mark=4)
        await settle()
        assert core.slots[1].version == 1 and core.rounds.merges[-1].reason == "quorum_unreachable"
        assert [c.learner_id for c in core.rounds.merges[-1].contributors] == ["b"]
        await contribute(core, "b", 0, mark=6, final=True)  # the last learner's last work merges at once
        await settle()
        assert core.slots[0].version == 2 and core.rounds.merges[-1].reason == "quorum_unreachable"
        assert core.merged_through_step("b", 1, 0, 2) == 6  # its receipt lets it stop

    asyncio.run(run())


def test_last_work_waits_for_no_learner_that_stopped_stepping(clock):
    async def run():
        core = make_scheduled_core(clock)
        join_all(core, ("a", "b", "c"), step=1)
        # c is killed here (it stays expected until the liveness timeout, 30 s); a and b finish.
        await contribute(core, "a", 0, mark=1, final=True)
        await contribute(core, "b", 0, mark=1, final=True)
        clock.now_s += 1.0
        report(core, "a", 1, finished=True)
        await settle()
        assert not core.slots[0].round.open  # c may still step: the work waits for a scheduled round
        clock.now_s += 7.5  # no step of c for 8.5 s, over 2 periods (H = 4 steps of 1 s): a stalled schedule
        report(core, "a", 1, finished=True)  # a finished learner's reports while it waits in finish()
        assert core.slots[0].round.open and core.round_call(0, "c") is not None
        clock.now_s += 0.8 * 4 * 1.0 + 0.1  # c does not answer: the grace window closes the round
        core.tick()
        await settle()
        assert core.slots[0].version == 1 and core.rounds.merges[-1].reason == "grace_expired"
        assert sorted(c.learner_id for c in core.rounds.merges[-1].contributors) == ["a", "b"]

    asyncio.run(run())


def test_below_quorum_rounds_still_wait_while_the_quorum_can_form(clock):
    async def run():
        core = make_scheduled_core(clock, min_quorum=2)
        join(core, "a")
        report(core, "a", 0)
        report(core, "a", 4)  # only a has joined yet: the run's other learners may still come
        await contribute(core, "a", 0, mark=4)
        await settle()
        assert core.slots[0].version == 0
        join(core, "b")
        report(core, "b", 4)
        clock.now_s += 100.0  # b falls silent (liveness 30 s): it is not waited for, but it may come back
        report(core, "a", 8)
        await contribute(core, "a", 1, mark=8)
        core.tick()
        await settle()
        assert core.versions() == {0: 0, 1: 0} and core.membership.expected_learners() == {"a"}
        report(core, "b", 8)  # it does, and the quorum forms
        await contribute(core, "b", 1, mark=8)
        await settle()
        assert core.slots[1].version == 1 and len(core.rounds.merges[-1].contributors) == 2

    asyncio.run(run())


def test_learners_that_ended_before_a_syncer_restart_do_not_keep_a_quorum_reachable(clock):
    async def run():
        core = make_scheduled_core(clock, min_quorum=2)
        join_all(core, ("a", "b", "c"))
        report(core, "a", 3, finished=True)
        core.leave(learner_id="b", incarnation=1, protocol_version=serde.PROTOCOL_VERSION)
        restored = make_scheduled_core(clock, min_quorum=2)
        restored.restore(await core.snapshot())
        assert restored.membership.quorum_reachable(2, set()) is False  # only c may still contribute
        assert core.membership.quorum_reachable(2, set()) is False
        join(core, "b", incarnation=2)  # a new life of b: the quorum can form again
        assert core.membership.quorum_reachable(2, set())

    asyncio.run(run())


def test_receipts_and_tokens_of_earlier_lives_survive_a_restart(clock):
    async def run():
        core = make_scheduled_core(clock)
        join(core, "a")
        core.report_progress(wire_views.progress(syncer_pb2.ReportProgressRequest(
            protocol_version=serde.PROTOCOL_VERSION, learner_id="a", incarnation=1, local_step=0, tokens_total=500)),
            wire_bytes=0)
        await contribute(core, "a", 0, mark=3, final=True)
        await settle()
        assert core.slots[0].version == 1
        snapshot = await core.snapshot()
        restored = make_scheduled_core(clock)
        restored.restore(snapshot)
        assert restored.merged_through_step("a", 1, 0, 1) == 3
        assert restored.membership.tokens_processed() == 500
        join(restored, "a", incarnation=2)
        assert restored.merged_through_step("a", 2, 0, 1) == 0  # a new life has no merged marks
        assert restored.membership.tokens_processed() == 500  # the earlier life's tokens still count

    asyncio.run(run())


def test_claimed_steps_beyond_the_local_steps_since_the_last_merged_mark_are_not_credited(clock):
    async def run():
        core = make_scheduled_core(clock)
        join(core, "a")
        await contribute(core, "a", 0, mark=4, final=True)  # merged at once (nobody else trains)
        await settle()
        assert core.merged_through_step("a", 1, 0, 1) == 4
        n = core.plan.fragments[0].numel
        enc = codec_lib.encode(np.full(n, 0.01, np.float32), "fp32")
        header = syncer_pb2.UploadHeader(
            protocol_version=serde.PROTOCOL_VERSION, learner_id="a", incarnation=1, fragment_id=0, base_version=1,
            syncer_instance=core.instance, steps=500, tokens=50_000, payload=serde.payload_info_to_proto(enc),
            local_step=6, final=True)  # 500 steps claimed, 2 taken since the merged mark 4
        response = await accept(core, header, enc.payload)
        assert core.uploads["capped_steps"] == 1
        assert response.weight == pytest.approx(2 * 100.0 ** 2)  # 2 steps of 100 tokens: tokens^2 / steps

    asyncio.run(run())
