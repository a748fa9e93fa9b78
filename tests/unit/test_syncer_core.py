"""SyncerCore without gRPC: quorum, adaptive grace window, staleness correction, fencing, restore.

The clock is a fake that the tests advance; `tick()` re-evaluates rounds, so no test sleeps.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ddiloco.algo import robust as robust_lib
from ddiloco.rpc import errors
from ddiloco.v1 import syncer_pb2
from ddiloco.wire import serde
from services.syncer import checkpointing
from services.syncer import config as config_lib
from services.syncer import wire_views
from tests.fakes import (FakeClock, join, join_request, make_core, progress, progress_request, settle, settle_until,
                         upload)


def test_grace_window_waits_for_stragglers_then_merges_everyone(clock):
    async def run():
        core = make_core(clock, min_quorum=1, grace_gamma=0.5)
        for lid in ("l1", "l2", "l3"):
            join(core, lid)
            progress(core, lid, step_time_s=2.0)  # grace = 0.5 * (tau=2 * 2 s) = 2 s
        assert core.grace_window_s() == pytest.approx(2.0)
        n = core.plan.fragments[0].numel
        await upload(core, "l1", 0, 0, np.full(n, 0.01))
        await settle()
        assert core.slots[0].version == 0  # quorum (K=1) reached, waiting for the grace window
        clock.now_s += 1.0
        await upload(core, "l2", 0, 0, np.full(n, 0.02))
        core.tick()
        await settle()
        assert core.slots[0].version == 0
        clock.now_s += 1.5  # past quorum + grace: merge without l3
        core.tick()
        await settle_until(lambda: core.slots[0].version == 1)
        assert core.slots[0].version == 1
        record = core.rounds.merges[-1]
        assert {c.learner_id for c in record.contributors} == {"l1", "l2"}
        assert record.reason == "grace_expired" and record.grace_used_s == pytest.approx(2.5)

    asyncio.run(run())


def test_merge_is_immediate_when_every_live_member_contributed_and_respects_quorum(clock):
    async def run():
        core = make_core(clock, min_quorum=2, grace_gamma=0.5)
        for lid in ("l1", "l2"):
            join(core, lid)
            progress(core, lid, step_time_s=5.0)
        n = core.plan.fragments[1].numel
        await upload(core, "l1", 1, 0, np.full(n, 0.01))
        clock.now_s += 100.0  # below quorum K=2: no merge however long we wait
        core.tick()
        await settle()
        assert core.slots[1].version == 0
        await upload(core, "l2", 1, 0, np.full(n, 0.03))
        await settle()
        assert core.slots[1].version == 1 and core.rounds.merges[-1].reason == "all_contributed"

    asyncio.run(run())


def test_stale_contribution_is_corrected_to_the_current_version(clock):
    async def run():
        core = make_core(clock, min_quorum=2, max_staleness_versions=2)
        for lid in ("l1", "l2", "l3"):
            join(core, lid)
        slot = core.slots[0]
        v0 = slot.params.copy()
        n = slot.fragment.numel
        await upload(core, "l1", 0, 0, np.full(n, 0.1))
        await upload(core, "l3", 0, 0, np.full(n, -0.05))
        clock.now_s += 100
        core.tick()
        await settle()
        assert slot.version == 1
        v1 = slot.params.copy()
        # l2 is one version behind: its local fragment is v0 - delta, so against v1 its outer
        # gradient is v1 - (v0 - delta). With one contribution (below K=2) the round stays open.
        delta = np.linspace(-0.1, 0.1, n).astype(np.float32)
        await upload(core, "l2", 0, 0, delta)
        await settle()
        assert slot.version == 1 and slot.round is not None
        np.testing.assert_allclose(slot.round.accumulator.result(), v1 - (v0 - delta), rtol=1e-5, atol=1e-6)

    asyncio.run(run())


def test_staleness_bound_fencing_and_duplicates(clock):
    async def run():
        core = make_core(clock, max_staleness_versions=0)
        join(core, "l1", incarnation=5)
        n = core.plan.fragments[0].numel
        first = await upload(core, "l1", 0, 0, np.full(n, 0.1), incarnation=5)
        assert first.result == syncer_pb2.UploadFragmentResponse.RESULT_ACCEPTED
        await settle()
        assert core.slots[0].version == 1
        again = await upload(core, "l1", 0, 0, np.full(n, 0.1), incarnation=5)
        assert again.result == syncer_pb2.UploadFragmentResponse.RESULT_DUPLICATE
        with pytest.raises(errors.AlreadyExists):
            await upload(core, "l1", 0, 0, np.full(n, 0.2), incarnation=5)
        join(core, "l2")
        with pytest.raises(errors.FailedPrecondition, match="stale"):
            await upload(core, "l2", 0, 0, np.full(n, 0.1))
        with pytest.raises(errors.FailedPrecondition, match="older"):
            join(core, "l1", incarnation=4)
        join(core, "l1", incarnation=6)
        with pytest.raises(errors.FailedPrecondition, match="fenced"):
            await upload(core, "l1", 1, 0, np.full(core.plan.fragments[1].numel, 0.1), incarnation=5)
        assert core.slots[0].version == 1  # the duplicate was never applied

    asyncio.run(run())


def test_snapshot_round_trips_bit_exactly_through_checkpoint_blobs(clock):
    async def run():
        core = make_core(clock)
        join(core, "l1")
        for fid in (0, 1):
            await upload(core, "l1", fid, 0, np.full(core.plan.fragments[fid].numel, 0.05))
        await settle()
        blobs, _ = checkpointing.encode_snapshot(await core.snapshot())
        restored = make_core(FakeClock())
        restored.restore(checkpointing.load_snapshot(blobs))
        for a, b in zip(core.slots, restored.slots):
            assert a.version == b.version and a.params.tobytes() == b.params.tobytes()
            assert all(np.array_equal(x, y) for x, y in zip(a.opt_state, b.opt_state))
        assert restored.outer_steps == core.outer_steps == 2
        # The next outer step from the restored state equals the one from the original.
        for c in (core, restored):
            join(c, "l1", incarnation=2)
            await upload(c, "l1", 0, c.slots[0].version, np.full(c.plan.fragments[0].numel, 0.02), incarnation=2)
        await settle()
        assert core.slots[0].params.tobytes() == restored.slots[0].params.tobytes()

    asyncio.run(run())


def _directed(numel: int, seed: int, sign: float) -> np.ndarray:
    """A pseudo-gradient sharing a common direction with every other one of the same sign."""
    rng = np.random.default_rng(seed)
    shared = np.random.default_rng(7).standard_normal(numel)
    return (sign * (shared + 0.5 * rng.standard_normal(numel)) * 1e-3).astype(np.float32)


def test_first_contributions_judge_each_other_before_anything_is_merged(clock):
    # Without the wait, x's sign-flipped first upload (nothing to compare it with yet) would be
    # merged alone at quorum 1; with it, the three simultaneous contributions are compared.
    # Which of them is judged first depends on thread timing: when x is refused (and withdrawn)
    # before a and b look again, they are left with one reference each and go on unjudged once
    # judge_wait_s has passed (bounded here well inside the test's timeout; a full CI run hit
    # that order once with a 30 s wait). Either way x is refused and only a and b are merged.
    async def run():
        core = make_core(clock, min_quorum=1, grace_gamma=0.0, direction=robust_lib.DirectionPolicy(judge_wait_s=3.0))
        for lid in ("x", "a", "b", "c"):
            join(core, lid)
        n = core.plan.fragments[0].numel
        results = await asyncio.wait_for(asyncio.gather(
            upload(core, "x", 0, 0, _directed(n, 1, -1.0)),
            upload(core, "a", 0, 0, _directed(n, 2, +1.0)),
            upload(core, "b", 0, 0, _directed(n, 3, +1.0)),
            return_exceptions=True), timeout=20)
        assert isinstance(results[0], errors.InvalidArgument) and results[0].reason == "direction", results[0]
        assert all(r.result == syncer_pb2.UploadFragmentResponse.RESULT_ACCEPTED for r in results[1:]), results
        await settle()
        merged = {c.learner_id for m in core.rounds.merges for c in m.contributors}
        assert merged == {"a", "b"}, merged
        judged = core.admission.direction_judgments
        assert judged["waited"] >= 1 and judged["waited"] + judged["unjudged"] >= 2, judged

    asyncio.run(run())


def test_the_wait_for_references_is_bounded_and_skipped_when_nobody_could_send_one(clock):
    async def run():
        # A 30 s wait inside a 10 s timeout: any of these uploads that waited would time out.
        core = make_core(clock, direction=robust_lib.DirectionPolicy(judge_wait_s=30.0))
        join(core, "a")
        join(core, "b")
        n = core.plan.fragments[0].numel
        await asyncio.wait_for(upload(core, "a", 0, 0, _directed(n, 1, 1.0)), timeout=10)  # one other: never comparable
        join(core, "c")
        clock.now_s += 100.0  # b and c fall silent (liveness 30 s): nobody could send a reference
        progress(core, "a", 1.0)
        await asyncio.wait_for(upload(core, "a", 1, 0, _directed(core.plan.fragments[1].numel, 2, 1.0)), timeout=10)
        assert core.admission.direction_judgments["unjudged"] == 2 and core.admission.direction_judgments["waited"] == 0
        # Two live others who could send one: the upload waits the configured time, then goes on.
        core = make_core(FakeClock(), direction=robust_lib.DirectionPolicy(judge_wait_s=0.3))
        for lid in ("a", "b", "c"):
            join(core, lid)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.wait_for(upload(core, "a", 0, 0, _directed(n, 3, 1.0)), timeout=10)
        assert loop.time() - started >= 0.3 and core.admission.direction_judgments["unjudged"] == 1
        await settle()
        assert core.slots[0].version == 1 and core.directions.references("b", 0, 1) == 1  # proposal withdrawn, a's kept

    asyncio.run(run())


def test_a_merge_of_fewer_steps_than_h_is_a_fractional_outer_step_when_asked():
    # H = 2. The second merge holds 1 inner step: with "steps" it is half an outer step (the
    # momentum decays by 0.9 ** 0.5 instead of 0.9); with "whole" a full step.
    async def merged_momenta(fraction: str):
        core = make_core(FakeClock(), outer_step_fraction=fraction)
        join(core, "l1")
        n = core.plan.fragments[0].numel
        await upload(core, "l1", 0, 0, np.full(n, 0.01), steps=2)
        await settle()
        first = core.slots[0].opt_state[0].copy()
        await upload(core, "l1", 0, 1, np.full(n, 0.01), steps=1)
        await settle()
        assert core.slots[0].version == 2
        return first, core.slots[0].opt_state[0].copy(), core.slots[0].params.copy()

    whole_first, whole_buf, whole_params = asyncio.run(merged_momenta("whole"))
    steps_first, steps_buf, steps_params = asyncio.run(merged_momenta("steps"))
    np.testing.assert_array_equal(whole_first, steps_first)  # a round of H steps: a whole step in both
    np.testing.assert_allclose(steps_buf - whole_buf, (0.9**0.5 - 0.9) * whole_first, rtol=1e-4, atol=1e-7)
    assert not np.allclose(steps_params, whole_params)


def test_a_merge_of_many_rounds_work_feeds_the_momentum_one_rounds_rate_with_steps():
    # H = 2. A contribution of 8 inner steps (a learner back from a long cut-off) is 4 rounds'
    # work: "steps" moves the fragment by all of it but the momentum takes a quarter; "whole"
    # puts all of it in the momentum, which carries it on into every later merge.
    async def first_merge(fraction: str):
        core = make_core(FakeClock(), outer_step_fraction=fraction)
        join(core, "l1")
        n = core.plan.fragments[0].numel
        before = core.slots[0].params.copy()
        await upload(core, "l1", 0, 0, np.full(n, 0.01), steps=8)
        await settle()
        assert core.slots[0].version == 1
        return core.slots[0].opt_state[0].copy(), core.slots[0].params - before

    whole_buf, whole_move = asyncio.run(first_merge("whole"))
    steps_buf, steps_move = asyncio.run(first_merge("steps"))
    np.testing.assert_allclose(steps_buf, whole_buf / 4, rtol=1e-5)
    # Nesterov from zero momentum: the move is lr x (Δ + μ·b'), b' = Δ (whole) or Δ/4 (steps).
    np.testing.assert_allclose(steps_move / whole_move, (1 + 0.9 / 4) / (1 + 0.9), rtol=1e-4)


def test_a_merge_of_one_of_two_expected_learners_is_half_a_round_with_work():
    # H = 2; l1 and l2 are expected. l1's round of 2 steps merged alone holds half the round's work:
    # "work" steps on Δ/2 as half an outer step (from zero momentum, a move of η·(Δ/2)·(1 + 0.5·μ)),
    # "steps" on all of Δ as a whole one (η·Δ·(1 + μ)). A merge of both learners is the same in both.
    async def merged(fraction: str, quorum: int) -> tuple[np.ndarray, np.ndarray]:
        core = make_core(FakeClock(), outer_step_fraction=fraction, min_quorum=quorum, direction_check="off")
        for lid in ("l1", "l2"):
            join(core, lid)
        n = core.plan.fragments[0].numel
        before = core.slots[0].params.copy()
        for lid, value in (("l1", 0.01), ("l2", 0.03))[:quorum]:
            await upload(core, lid, 0, 0, np.full(n, value))
        await settle()
        assert core.slots[0].version == 1 and len(core.rounds.merges[-1].contributors) == quorum
        return core.slots[0].params - before, core.slots[0].opt_state[0].copy()

    (work_move, work_buf), (steps_move, steps_buf) = [asyncio.run(merged(f, 1)) for f in ("work", "steps")]
    np.testing.assert_allclose(work_move / steps_move, 0.5 * (1 + 0.5 * 0.9) / (1 + 0.9), rtol=1e-4)
    np.testing.assert_allclose(work_buf, steps_buf / 2, rtol=1e-5)
    (work_move, work_buf), (steps_move, steps_buf) = [asyncio.run(merged(f, 2)) for f in ("work", "steps")]
    np.testing.assert_array_equal(work_move, steps_move)
    np.testing.assert_array_equal(work_buf, steps_buf)


def test_an_unknown_outer_step_fraction_is_refused():
    with pytest.raises(ValueError, match="outer_step_fraction"):
        make_core(FakeClock(), outer_step_fraction="half")


def test_the_token_budget_is_the_fleets_over_every_life_and_survives_a_restore():
    async def run():
        core = make_core(FakeClock(), token_budget=1000)

        def report(learner_id: str, tokens: int, incarnation: int = 1) -> bool:
            return progress_request(core, syncer_pb2.ReportProgressRequest(
                protocol_version=serde.PROTOCOL_VERSION, learner_id=learner_id, incarnation=incarnation,
                local_step=1, tokens_total=tokens)).budget_reached

        join(core, "a")
        join(core, "b")
        assert not report("a", 600) and not report("b", 300)  # 900 of 1000
        join(core, "a", incarnation=2)  # a new life: its first life's 600 tokens still count
        assert not report("a", 99, incarnation=2)  # 999
        assert report("a", 100, incarnation=2)  # 1000: spent
        assert report("b", 300)  # every learner hears it
        state = wire_views.training_state(core, 0)
        assert state.token_budget == 1000 and state.tokens_processed == 1000
        blobs, _ = checkpointing.encode_snapshot(await core.snapshot())
        restored = make_core(FakeClock(), token_budget=1000)
        restored.restore(checkpointing.load_snapshot(blobs))
        assert restored.budget_reached()  # a restarted syncer does not hand out the budget again
        # No budget: never reached, whatever was processed.
        unbounded = make_core(FakeClock())
        join(unbounded, "a")
        assert not progress_request(unbounded, syncer_pb2.ReportProgressRequest(
            protocol_version=serde.PROTOCOL_VERSION, learner_id="a", incarnation=1, local_step=1,
            tokens_total=10**12)).budget_reached
        with pytest.raises(ValueError, match="token_budget"):
            make_core(FakeClock(), token_budget=-1)
        with pytest.raises(ValueError, match="token_budget"):
            config_lib.SyncerConfig(token_budget=-1)
        assert config_lib.parse_config(["--token-budget", "5000"], {}).token_budget == 5000

    asyncio.run(run())


def test_the_history_start_record_holds_the_liveness_timeout_and_grace_cap(tmp_path):
    # bench goodput reports these from the record, so it states what the syncer ran, not what was meant.
    from ddiloco import history as chaos_history
    from services.syncer import history as history_lib

    core = make_core(FakeClock())
    history = history_lib.attach(core, str(tmp_path / "h.jsonl"))
    history.shutdown()
    start = next(r for r in chaos_history.read(tmp_path / "h.jsonl") if r["event"] == "start")
    assert (start["liveness_timeout_s"], start["max_grace_s"]) == (30.0, 10.0)


def _join_data(core, learner_id: str, *, incarnation: int = 1, shards: int = 4, pinned: int | None = None):
    """Joins as a learner with `shards` data shards: asks the syncer for one, or pins `pinned`."""
    return join_request(core, syncer_pb2.JoinRequest(
        protocol_version=serde.PROTOCOL_VERSION, learner_id=learner_id, incarnation=incarnation,
        num_data_shards=shards, assign_data_shard=pinned is None, data_shard=pinned or 0))


def _shards(core) -> dict[str, tuple[int, bool]]:
    """learner id -> (data shard, assigned by the syncer), from the training state (what operators see)."""
    return {m.learner_id: (m.data_shard, m.data_shard_assigned) for m in wire_views.training_state(core, 0).members
            if m.num_data_shards}


def test_learners_that_ask_get_distinct_data_shards_stable_across_their_lives(clock):
    """Hex container ids (`--learner-id auto` in compose) ask the syncer for a shard: each gets its
    own, a restarted learner (new incarnation) gets its shard back, a shard whose learner left or went
    silent is handed out again, and pinned shards (`--shard-index`, numbered ids) are recorded as the
    learners chose them."""
    async def run():
        core = make_core(clock)  # liveness timeout 30 s
        ids = ["region-a-3f2a9c1b0e1a", "region-a-77c0ffee00b2", "region-b-0d15ea5e0c3f"]
        responses = [_join_data(core, lid) for lid in ids]
        assert [(r.data_shard, r.data_shard_assigned) for r in responses] == [(0, True), (1, True), (2, True)]
        assert _shards(core) == {ids[0]: (0, True), ids[1]: (1, True), ids[2]: (2, True)}
        # A restart of the second learner (a new life) keeps its shard; so does the same life re-joining.
        assert _join_data(core, ids[1], incarnation=2).data_shard == 1
        assert _join_data(core, ids[1], incarnation=2).data_shard == 1
        # A pinned learner is recorded as it chose (modulo the shard count), never moved.
        pinned = _join_data(core, "learner-7", pinned=7)
        assert (pinned.data_shard, pinned.data_shard_assigned) == (3, False)
        assert _shards(core)["learner-7"] == (3, False)
        # The first learner leaves: a newcomer gets its shard.
        core.leave(learner_id=ids[0], incarnation=1, protocol_version=serde.PROTOCOL_VERSION)
        assert _join_data(core, "region-b-feedfacecafe").data_shard == 0
        # It comes back while all four shards are trained: more learners than shards, so the
        # least-trained shard, the lowest on ties.
        assert _join_data(core, ids[0], incarnation=2).data_shard == 0
        # Everyone silent past the liveness timeout: a newcomer gets shard 0, and a returning learner
        # its previous shard, which no live learner holds.
        clock.now_s += 31.0
        assert _join_data(core, "region-b-0123456789ab").data_shard == 0
        assert _join_data(core, ids[2], incarnation=2).data_shard == 2
        # A learner that reports nothing about its data (an older learner) shows no shard.
        join(core, "old-learner")
        assert "old-learner" not in _shards(core)

    asyncio.run(run())


def test_data_shards_survive_a_syncer_restart():
    """A restarted syncer restores each member's shard, so a learner that comes back asking gets its
    shard again instead of the lowest free one."""
    async def run():
        core = make_core(FakeClock())
        for lid in ("region-a-aaaaaaaaaaaa", "region-a-bbbbbbbbbbbb", "region-b-cccccccccccc"):
            _join_data(core, lid)
        blobs, _ = checkpointing.encode_snapshot(await core.snapshot())
        restored = make_core(FakeClock())
        restored.restore(checkpointing.load_snapshot(blobs))
        assert _join_data(restored, "region-b-cccccccccccc", incarnation=2).data_shard == 2
        assert _shards(restored)["region-b-cccccccccccc"] == (2, True)

    asyncio.run(run())


def test_work_merged_never_exceeds_the_work_processed_while_progress_reports_lag(clock):
    # Progress reports lag the uploads by up to one report interval: a merge could hold tokens the
    # syncer had not yet heard were processed, and work merged read 1.028 in a live run. Merged
    # contributions of a fragment carry disjoint progress, so their sum bounds the life's tokens.
    async def run():
        core = make_core(clock, min_quorum=1, grace_gamma=0.0)
        join(core, "l1")
        progress(core, "l1", step_time_s=1.0)  # reports local_step 1 and no tokens yet
        for fid in range(2):
            n = core.plan.fragments[fid].numel
            await upload(core, "l1", fid, 0, np.full(n, 0.01), steps=4)  # 400 tokens each
        await settle()
        assert [s.version for s in core.slots] == [1, 1]
        assert core.rounds.tokens_merged == 800
        assert core.membership.tokens_processed() == 400
        state = wire_views.training_state(core, 0)
        assert state.tokens_merged / (len(core.slots) * state.tokens_processed) == pytest.approx(1.0)
        # The next life starts from what this one is known to have processed.
        join(core, "l1", incarnation=2)
        assert core.membership.tokens_processed() == 400

    asyncio.run(run())
