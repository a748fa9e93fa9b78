"""Fault-matrix row 21 (reliability.md §5), in the syncer: malicious but well-formed updates.

A norm bound relative to the other contributors (reject or clip), a cap on inflated merge
weights, and quarantine after repeated suspicious uploads, visible in the training state and
kept across the learner's restarts and the syncer's checkpoints. The end-to-end hostile-learner
run (held-out loss against an honest run) is tests/security/test_hostile_run.py; the last test here
runs the chaos tools' hostile client (ddiloco.chaos.hostile_learner) against a real syncer.
"""

from __future__ import annotations

import asyncio
import math
import time

import grpc
import numpy as np
import pytest

from ddiloco.chaos import hostile_learner
from ddiloco.rpc import errors
from ddiloco.rpc import security
from ddiloco.v1 import syncer_pb2
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde
from ddiloco.learner import client as client_lib
from services.syncer import checkpointing
from services.syncer import membership as membership_lib
from services.syncer import wire_views
from tests.fakes import FakeClock, accept, join, join_all, settle
from tests.security.conftest import Harness, Learner, code_of, encoded, honest_delta
from tests.security.conftest import hostile_core as make_core

pytestmark = pytest.mark.timeout(120)


async def upload(core, learner_id: str, fid: int, delta: np.ndarray, *, base: int | None = None, tokens: int = 1024,
                 steps: int = 2, incarnation: int = 1):
    enc = codec_lib.encode(np.asarray(delta, dtype=np.float32), "fp32")
    header = syncer_pb2.UploadHeader(
        protocol_version=serde.PROTOCOL_VERSION, learner_id=learner_id, incarnation=incarnation, fragment_id=fid,
        base_version=core.slots[fid].version if base is None else base, syncer_instance=core.instance,
        steps=steps, tokens=tokens, payload=serde.payload_info_to_proto(enc))
    return await accept(core, header, enc.payload, wire_bytes=len(enc.payload))


async def rounds_of_honest_history(core, learners=("h1", "h2", "h3"), fid: int = 0, rounds: int = 2) -> None:
    """Honest contributions (each merged at once: K=1, everyone contributed) build the norm history."""
    n = core.plan.fragments[fid].numel
    for r in range(rounds):
        for i, lid in enumerate(learners):
            await upload(core, lid, fid, honest_delta(n, 100 * r + i))
        await settle()


def member(core, learner_id: str) -> syncer_pb2.MemberState:
    return next(m for m in wire_views.training_state(core, 0).members if m.learner_id == learner_id)


def test_norm_bound_rejects_a_huge_update_from_the_first_round():
    async def run():
        core = make_core(FakeClock())
        join(core, "hostile")
        before = core.slots[0].params_sha256
        # No history yet: the bound is k x the norm of the global fragment itself.
        with pytest.raises(errors.InvalidArgument, match="norm bound"):
            await upload(core, "hostile", 0, 1e4 * honest_delta(core.plan.fragments[0].numel, 1))
        assert core.slots[0].params_sha256 == before and core.slots[0].round is None
        assert core.uploads["rejected_norm_bound"] == 1
        m = member(core, "hostile")
        assert m.rejections["norm_bound"] == 1 and m.flags & membership_lib.FLAG_NORM_BOUND and not m.quarantined

    asyncio.run(run())


def test_norm_bound_is_relative_to_other_learners_per_tensor():
    async def run():
        core = make_core(FakeClock())
        join_all(core, ("h1", "h2", "h3", "x"))
        await rounds_of_honest_history(core, learners=("h1", "h2", "h3", "x"))
        n = core.plan.fragments[1].numel
        await rounds_of_honest_history(core, learners=("h1", "h2", "h3", "x"), fid=1)
        # Twice the usual norm passes; 30 times is refused (k = 20, relative to the others' median).
        assert (await upload(core, "x", 0, 2 * honest_delta(core.plan.fragments[0].numel, 7))).result == \
            syncer_pb2.UploadFragmentResponse.RESULT_ACCEPTED
        await settle()
        with pytest.raises(errors.InvalidArgument, match="norm bound"):
            await upload(core, "x", 0, 30 * honest_delta(core.plan.fragments[0].numel, 8))
        # Small tensors (the 256-value bias) differ a lot between honest learners' data: they are
        # bounded through the whole fragment only, so a bias 60x the others' passes.
        biased = honest_delta(n, 10)
        biased[core.plan.fragments[1].slices()["b"]] *= 60
        assert (await upload(core, "x", 1, biased)).result == syncer_pb2.UploadFragmentResponse.RESULT_ACCEPTED
        await settle()
        # Inflating one tensor only (the 32x64 matrix "v" of fragment 1) is caught per tensor,
        # although the fragment's total norm grows by less than the factor.
        delta = honest_delta(n, 9)
        where = core.plan.fragments[1].slices()["v"]
        delta[where] *= 25
        total_growth = np.linalg.norm(delta) / np.linalg.norm(honest_delta(n, 9))
        assert total_growth < 20
        with pytest.raises(errors.InvalidArgument, match="norm bound"):
            await upload(core, "x", 1, delta)
        # Both were less than twice the bound: refused, but "marginal", so no strikes towards quarantine.
        assert core.uploads["rejected_norm_bound_marginal"] == 2 and core.uploads["rejected_norm_bound"] == 0
        m = member(core, "x")
        assert m.flags & membership_lib.FLAG_NORM_BOUND and not m.quarantined
        with pytest.raises(errors.InvalidArgument, match="norm bound"):  # a gross one is a strike
            await upload(core, "x", 1, 1e3 * honest_delta(n, 11))
        assert core.uploads["rejected_norm_bound"] == 1

    asyncio.run(run())


def test_an_honest_learner_contributing_many_steps_at_once_passes_but_claimed_steps_are_capped():
    async def run():
        core = make_core(FakeClock())
        join_all(core, ("h1", "h2", "h3", "x"))
        await rounds_of_honest_history(core)  # 2 steps per contribution
        n = core.plan.fragments[0].numel
        # A learner whose fragment waited for a new version: 16 steps, a norm ~8x the others'.
        response = await upload(core, "x", 0, 8 * honest_delta(n, 40), steps=16, tokens=16 * 512)
        assert response.result == syncer_pb2.UploadFragmentResponse.RESULT_ACCEPTED
        await settle()
        # Claiming 10 000 steps does not buy a x1000 update: credited steps are capped at 4 x 2, so
        # at most 20 x 8 / 2 = 80 times the others' per-contribution norm passes.
        with pytest.raises(errors.InvalidArgument, match="norm bound"):
            await upload(core, "x", 0, 1000 * honest_delta(n, 41), steps=10_000, tokens=10_000 * 512)

    asyncio.run(run())


def test_clip_mode_scales_the_update_down_to_the_bound():
    async def run():
        core = make_core(FakeClock(), action="clip", min_quorum=2)
        join_all(core, ("h1", "h2", "h3", "x"))
        core.membership.quarantine_after = 0  # this test looks at clipping alone
        n = core.plan.fragments[0].numel
        for r in range(2):
            for i, lid in enumerate(("h1", "h2", "h3")):
                await upload(core, lid, 0, honest_delta(n, 10 * r + i))
            core.clock.now_s += 100  # past the grace window: the round (K=2) merges without x
            core.tick()
            await settle()
        reference = np.median([np.linalg.norm(honest_delta(n, s)) for s in (10, 11, 12, 0, 1, 2)])
        response = await upload(core, "x", 0, 1e4 * honest_delta(n, 50))
        assert response.result == syncer_pb2.UploadFragmentResponse.RESULT_ACCEPTED
        accumulated = core.slots[0].round.accumulator.result()  # only x's clipped contribution so far
        assert np.linalg.norm(accumulated) <= 20 * reference * 1.01
        assert core.uploads["clipped_norm_bound"] == 1
        assert member(core, "x").rejections["clipped_norm_bound"] == 1

    asyncio.run(run())


def test_inflated_token_counts_are_capped():
    async def run():
        core = make_core(FakeClock())
        join_all(core, ("h1", "h2", "h3", "x"))
        await rounds_of_honest_history(core)
        response = await upload(core, "x", 0, honest_delta(core.plan.fragments[0].numel, 3), tokens=10**9)
        # The claimed batch is capped at --max-batch-ratio (4) x the others' median tokens per step
        # (512), over the 2 steps: weight 2 x (4 x 512)^2, 16x an honest contribution (1024^2 / 2),
        # not 1e9^2 / 2 (issue 24: it was k = 20x the batch, 400x the weight).
        assert response.weight == pytest.approx(2 * (4 * 512) ** 2)
        assert core.uploads["capped_weight"] == 1
        # A unit with a legitimately 4x bigger batch (16x the weight per step) is not capped.
        await settle()
        big = await upload(core, "h1", 0, honest_delta(core.plan.fragments[0].numel, 4), tokens=4 * 1024)
        assert core.slots[0].norms.weight_cap("h1", 2) < float("inf")
        assert big.weight == pytest.approx((4 * 1024) ** 2 / 2) and core.uploads["capped_weight"] == 1

    asyncio.run(run())


def test_quarantine_after_repeated_rejections_is_visible_and_sticky():
    async def run():
        clock = FakeClock()
        core = make_core(clock, quarantine_s=600.0, min_quorum=1)
        join_all(core, ("h1", "x"))
        n = core.plan.fragments[0].numel
        for i in range(3):
            with pytest.raises(errors.InvalidArgument):
                await upload(core, "x", 0, 1e4 * honest_delta(n, i))
        m = member(core, "x")
        assert m.quarantined and m.flags & membership_lib.FLAG_QUARANTINED and m.rejections["norm_bound"] == 3
        assert m.quarantined_until_unix_s == pytest.approx(clock.now_s + 600)
        assert wire_views.training_state(core, 0).quarantines == 1
        # Refused before any payload check, even a perfectly honest one; and no longer waited for:
        # h1 alone completes rounds (x would otherwise hold them for the grace window).
        with pytest.raises(errors.PermissionDenied, match="quarantined"):
            await upload(core, "x", 1, honest_delta(core.plan.fragments[1].numel, 1))
        assert len(core.membership.expected_learners()) == 1
        await upload(core, "h1", 1, honest_delta(core.plan.fragments[1].numel, 2))
        await settle()
        assert core.slots[1].version == 1
        # A restart (new incarnation) does not lift it; neither does a syncer restart.
        join(core, "x", incarnation=2)
        with pytest.raises(errors.PermissionDenied):
            await upload(core, "x", 1, honest_delta(core.plan.fragments[1].numel, 3), incarnation=2)
        blobs, _ = checkpointing.encode_snapshot(await core.snapshot())
        restored = make_core(FakeClock())
        restored.clock.now_s = clock.now_s
        restored.restore(checkpointing.load_snapshot(blobs))
        rm = member(restored, "x")
        assert rm.quarantined and rm.flags & membership_lib.FLAG_QUARANTINED and rm.rejections["norm_bound"] == 3
        # It ends after quarantine_s.
        clock.now_s += 601
        assert not member(core, "x").quarantined
        response = await upload(core, "x", 0, honest_delta(n, 9), incarnation=2)
        assert response.result == syncer_pb2.UploadFragmentResponse.RESULT_ACCEPTED
        assert core.uploads["rejected_quarantined"] == 2

    asyncio.run(run())


def test_a_round_waiting_only_for_a_learner_that_gets_quarantined_merges_at_once():
    async def run():
        core = make_core(FakeClock(), min_quorum=1)
        core.grace_window_s = lambda: 5.0  # as measured on a run with slack (none measured here)
        join_all(core, ("h1", "h2", "x"))
        n = core.plan.fragments[0].numel
        await upload(core, "h1", 0, honest_delta(n, 1))
        await upload(core, "h2", 0, honest_delta(n, 2))
        await settle()
        # Quorum reached, x expected: the round holds for the grace window (seconds; the fake
        # clock does not move, so only a re-evaluation can close it here).
        assert core.slots[0].version == 0 and len(core.slots[0].round.contributions) == 2
        for i in range(3):  # x is refused on the other fragment until quarantined
            with pytest.raises(errors.InvalidArgument):
                await upload(core, "x", 1, 1e4 * honest_delta(core.plan.fragments[1].numel, i))
        assert member(core, "x").quarantined
        await settle()
        # Everyone the round waits for has contributed: merged now, not at the end of the window
        # (meanwhile h1's and h2's next uploads of fragment 0 would be refused as already pending).
        assert core.slots[0].version == 1 and core.slots[0].round is None

    asyncio.run(run())


def test_honest_refusals_never_quarantine():
    async def run():
        core = make_core(FakeClock(), quarantine_after=2)
        join(core, "h1")
        n = core.plan.fragments[0].numel
        await upload(core, "h1", 0, honest_delta(n, 1))
        await settle()
        for _ in range(5):  # stale bases and unknown syncer lives are network trouble, not hostility
            with pytest.raises(errors.FailedPrecondition):
                await upload(core, "h1", 0, honest_delta(n, 2), base=7)
        m = member(core, "h1")
        assert not m.quarantined and m.flags == 0 and m.rejections["stale"] == 5

    asyncio.run(run())


def test_the_same_refused_contribution_sent_again_counts_one_strike():
    # Before this rule every send was a strike: the third send of one refused contribution (a
    # retry, a barrier's resend) quarantined its learner.
    async def run():
        core = make_core(FakeClock(), quarantine_after=3)
        join_all(core, ("h1", "x"))
        n = core.plan.fragments[0].numel
        same = 1e4 * honest_delta(n, 1)
        for _ in range(4):
            with pytest.raises(errors.InvalidArgument, match="norm bound"):
                await upload(core, "x", 0, same)
        m = member(core, "x")
        assert m.rejections["norm_bound"] == 4 and m.flags & membership_lib.FLAG_NORM_BOUND and not m.quarantined
        # Other work is other evidence: on another fragment (same content) and with other content.
        with pytest.raises(errors.InvalidArgument, match="norm bound"):
            await upload(core, "x", 1, 1e4 * honest_delta(core.plan.fragments[1].numel, 1))
        assert not member(core, "x").quarantined
        with pytest.raises(errors.InvalidArgument, match="norm bound"):
            await upload(core, "x", 0, 1e4 * honest_delta(n, 2))
        assert member(core, "x").quarantined and wire_views.training_state(core, 0).quarantines == 1

    asyncio.run(run())


async def _upload_at(core, learner_id: str, fid: int, delta: np.ndarray, local_step: int, steps: int = 2):
    """An upload carrying its mark (local_step), after a progress report saying the learner got there."""
    core.report_progress(wire_views.progress(syncer_pb2.ReportProgressRequest(
        protocol_version=serde.PROTOCOL_VERSION, learner_id=learner_id, incarnation=1, local_step=local_step,
        step_time_s=0.1)), wire_bytes=0)
    enc = codec_lib.encode(np.asarray(delta, dtype=np.float32), "fp32")
    header = syncer_pb2.UploadHeader(
        protocol_version=serde.PROTOCOL_VERSION, learner_id=learner_id, incarnation=1, fragment_id=fid,
        base_version=core.slots[fid].version, syncer_instance=core.instance, steps=steps, tokens=512 * steps,
        payload=serde.payload_info_to_proto(enc), local_step=local_step)
    return await accept(core, header, enc.payload, wire_bytes=len(enc.payload))


def test_a_norm_violation_after_a_step_rate_clip_is_refused_without_a_strike():
    # The step-rate clip cuts the steps a contribution is judged over, so its norm per step looks
    # larger than it is: an honest learner running alone after the others finished was refused as
    # gross (a strike) in the hostile matrix. Before this rule, this test's one strike quarantined x.
    async def run():
        clock = FakeClock()
        core = make_core(clock, quarantine_after=1)
        learners = ("h1", "h2", "h3", "x")
        join_all(core, learners)
        await rounds_of_honest_history(core, learners=learners)
        n1 = core.plan.fragments[1].numel
        for i, lid in enumerate(learners):  # everyone's first mark (local step 4) at t = 0
            await _upload_at(core, lid, 1, honest_delta(n1, 50 + i), local_step=4)
        await settle()
        clock.now_s += 10.0
        for i, lid in enumerate(learners[:3]):  # the others advance 0.4 steps/s
            await _upload_at(core, lid, 1, honest_delta(n1, 60 + i), local_step=8)
        # x claims 400 local steps 10 s after its first mark: its 2 steps are cut to 1 (step rate).
        n0 = core.plan.fragments[0].numel
        with pytest.raises(errors.InvalidArgument, match="norm bound"):
            await _upload_at(core, "x", 0, 1e3 * honest_delta(n0, 70), local_step=400)
        assert core.uploads["norm_bound_after_step_rate_clip"] == 1, dict(core.uploads)
        assert not member(core, "x").quarantined
        # Without the clip, the same excess is a strike (and quarantine_after is 1 here).
        with pytest.raises(errors.InvalidArgument, match="norm bound"):
            await upload(core, "x", 0, 1e3 * honest_delta(n0, 71))
        assert member(core, "x").quarantined

    asyncio.run(run())


def test_hostile_learner_over_grpc_is_refused_then_quarantined(tmp_path):
    with Harness(tmp_path) as h:
        honest = Learner(h.address, "learner-0")
        hostile = Learner(h.address, "learner-1")
        payload, info = encoded(honest_delta(h.numel(0), 0))
        honest.upload(0, 0, payload, info)
        before = h.model()
        for i in range(3):
            bad, bad_info = encoded(1e4 * honest_delta(h.numel(1), i))
            assert code_of(lambda b=bad, bi=bad_info: hostile.upload(1, 0, b, bi)) == grpc.StatusCode.INVALID_ARGUMENT
        good, good_info = encoded(honest_delta(h.numel(1), 5))
        error = code_of(lambda: hostile.upload(1, 0, good, good_info))
        assert error == grpc.StatusCode.PERMISSION_DENIED
        state = h.state()
        m = next(m for m in state.members if m.learner_id == "learner-1")
        assert m.quarantined and m.rejections["norm_bound"] == 3 and m.rejections["quarantined"] == 1
        assert state.uploads["rejected_norm_bound"] == 3 and state.uploads["rejected_quarantined"] == 1
        assert math.isfinite(m.quarantined_until_unix_s) and state.quarantines == 1
        assert h.model()[1] == before[1]  # fragment 1 untouched
        honest.close()
        hostile.close()


def _upload_outcome(client: client_lib.SyncClient, fid: int, delta: np.ndarray, step: int) -> str:
    """Submits one upload through `client` and waits (bounded) for what became of it."""
    client.submit_upload(client_lib.UploadJob(fragment_id=fid, base_version=0, syncer_instance=client.instance,
                                              steps=1, tokens=10, delta=delta, local_step=step))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        outcomes = [o for o in client.take_outcomes() if o.local_step == step]
        if outcomes:
            return outcomes[0].result
        time.sleep(0.02)
    raise AssertionError(f"no outcome for upload {step}: {vars(client.stats)}")


def test_the_chaos_hostile_learner_corrupts_every_upload_over_grpc(tmp_path):
    # The hostile learner of the chaos tools (no knob in the production client): the deltas the loop
    # submits are honest, the ones on the wire x1e4; refused by the norm bound, then quarantined. The
    # same deltas through a plain SyncClient are accepted.
    def client(cls, learner_id: str, **kwargs) -> client_lib.SyncClient:
        out = cls(client_lib.ClientConfig(target=h.address, learner_id=learner_id, incarnation=1, region="r",
                                          tokens_per_step=0, call_timeout_s=5.0, retry_bound_s=5.0,
                                          security=security.ClientSecurity(insecure=True)), **kwargs)
        out.start(30.0)
        return out

    with Harness(tmp_path) as h:
        honest = Learner(h.address, "learner-0")
        payload, info = encoded(honest_delta(h.numel(0), 0))
        honest.upload(0, 0, payload, info)
        hostile = client(hostile_learner.HostileSyncClient, "learner-1", factor=hostile_learner.parse_hostile("scale:1e4"))
        plain = client(client_lib.SyncClient, "learner-2")
        try:
            deltas = [honest_delta(h.numel(1), i) for i in range(3)]
            sent = [d.copy() for d in deltas]
            assert [_upload_outcome(hostile, 1, d, step) for step, d in enumerate(deltas, 1)] == \
                [client_lib.OUTCOME_NOT_TAKEN] * 3
            assert all(np.array_equal(d, s) for d, s in zip(deltas, sent))  # the loop's own values stay honest
            m = next(m for m in h.state().members if m.learner_id == "learner-1")
            assert m.quarantined and m.rejections["norm_bound"] == 3 and m.uploads_accepted == 0, m
            assert _upload_outcome(plain, 1, deltas[0], 1) == client_lib.OUTCOME_ACCEPTED
        finally:
            for c in (hostile, plain):
                c.close(leave=False)
            honest.close()
