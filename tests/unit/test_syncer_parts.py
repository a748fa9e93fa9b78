"""The syncer core's parts, through the facade: the typed snapshot and its checkpoint form (older
checkpoints included), the digests and pending contributions the history records, and the grace
timers shutdown cancels. Without gRPC; the clock is a fake the tests advance."""

from __future__ import annotations

import asyncio
import json
from typing import NamedTuple

import numpy as np
import pytest

from ddiloco.rpc import errors
from ddiloco.v1 import syncer_pb2
from ddiloco.wire import serde
from services.syncer import checkpointing
from services.syncer import state as state_lib
from services.syncer import wire_views
from tests.fakes import FakeClock, join, make_core, progress, settle, upload


def _plain(checkpoint_form: dict) -> str:
    """The JSON part of a snapshot's checkpoint form (what the `state` blob holds, arrays aside)."""
    fragments = [{k: v for k, v in f.items() if k not in ("params", "opt_state")} for f in checkpoint_form["fragments"]]
    return json.dumps({**checkpoint_form, "fragments": fragments}, sort_keys=True)


def test_the_snapshot_is_typed_and_its_checkpoint_form_round_trips():
    async def run():
        clock = FakeClock()
        core = make_core(clock, quarantine_after=3)
        join(core, "a")
        join(core, "b")
        core.membership.quarantine(core.membership.members["b"], reason="test", duration_s=100.0)
        n = core.plan.fragments[0].numel
        await upload(core, "a", 0, 0, np.full(n, 0.05))
        await settle()
        core.report_eval(wire_views.eval_report(syncer_pb2.ReportEvalRequest(
            protocol_version=serde.PROTOCOL_VERSION, heldout_loss=3.5, tokens_merged=200)))
        clock.advance(40.0)
        snap = await core.snapshot()
        assert isinstance(snap, state_lib.SyncerSnapshot) and snap.outer_steps == 1
        assert snap.fragments[0].merged_marks == {} and snap.fragments[0].version == 1
        assert snap.members["b"].quarantine_remaining_s == pytest.approx(60.0)
        assert snap.members["a"].quarantine_remaining_s == 0.0 and snap.evals[0].heldout_loss == 3.5
        # The copy is a copy: a later merge does not change it.
        kept = snap.fragments[0].params.copy()
        await upload(core, "a", 0, 1, np.full(n, 0.05))
        await settle()
        assert core.slots[0].version == 2 and np.array_equal(snap.fragments[0].params, kept)

        form = snap.to_dict()
        again = state_lib.SyncerSnapshot.from_dict(form)
        assert _plain(again.to_dict()) == _plain(form)
        assert all(np.array_equal(x.params, y.params) for x, y in zip(again.fragments, snap.fragments))
        assert form["members"]["b"]["incarnation"] == 1 and "learner_id" not in form["members"]["b"]
        # The checkpoint's blobs read back as the typed snapshot (a syncer restores nothing else).
        blobs, _ = checkpointing.encode_snapshot(snap)
        loaded = checkpointing.load_snapshot(blobs)
        assert isinstance(loaded, state_lib.SyncerSnapshot) and _plain(loaded.to_dict()) == _plain(form)
        assert checkpointing.encode_snapshot(loaded) == (blobs, _)
        with pytest.raises(TypeError, match="SyncerSnapshot"):
            checkpointing.encode_snapshot(form)
        with pytest.raises(TypeError, match="SyncerSnapshot"):
            make_core(clock).restore(loaded.to_dict())  # the checkpoint form is not a snapshot

        restored = make_core(clock)
        restored.restore(snap)
        b = restored.membership.members["b"]
        assert restored.membership.is_quarantined(b) and b.quarantined_until_s == pytest.approx(clock.now_s + 60.0)
        assert wire_views.training_state(restored, 0).quarantines == 1 and restored.outer_steps == 1
        assert [e.heldout_loss for e in wire_views.training_state(restored, 0).evals] == [3.5]

    asyncio.run(run())


def test_a_checkpoint_from_before_the_newer_fields_restores_with_their_defaults():
    async def run():
        template = (await make_core(FakeClock()).snapshot()).to_dict()
        # What the oldest checkpoints hold: no merged marks, traffic, counters, evals or schedule.
        oldest = {
            "fragments": [{k: f[k] for k in ("fragment_id", "version", "params", "opt_state", "params_sha256")}
                          for f in template["fragments"]],
            "outer_steps": 7,
            "tokens_merged": 900,
            "members": {"a": {"incarnation": 3}},
        }
        core = make_core(FakeClock())
        core.restore(state_lib.SyncerSnapshot.from_dict(oldest))
        member = core.membership.members["a"]
        assert (member.incarnation, member.region, member.joins, member.data_shard) == (3, "", 1, -1)
        assert not core.membership.is_quarantined(member) and member.merged_marks == {}
        state = wire_views.training_state(core, 0)
        assert (state.outer_steps, state.tokens_merged, state.bytes_in, dict(state.uploads)) == (7, 900, 0, {})
        assert state.restored_from_checkpoint and core.rounds.schedule.global_step == 0.0
        with pytest.raises(errors.FailedPrecondition, match="older than the registered"):
            join(core, "a", incarnation=2)  # fencing survived

        # A checkpoint whose fragment fails its digest is refused.
        oldest["fragments"][0] = {**oldest["fragments"][0], "params_sha256": "0" * 64}
        with pytest.raises(ValueError, match="sha256"):
            make_core(FakeClock()).restore(state_lib.SyncerSnapshot.from_dict(oldest))

    asyncio.run(run())


def test_the_facade_reports_digests_pending_work_and_cancels_grace_timers():
    async def run():
        clock = FakeClock()
        core = make_core(clock, min_quorum=1, grace_gamma=0.5)
        for lid in ("l1", "l2"):
            join(core, lid)
            progress(core, lid, step_time_s=2.0)  # a grace window of 2 s: l1's contribution waits for l2
        assert core.fragment_digest(0) == (0, core.slots[0].published_sha256, core.slots[0].params_sha256)
        n = core.plan.fragments[0].numel
        await upload(core, "l1", 0, 0, np.full(n, 0.01))
        await settle()
        assert [(fid, c.learner_id) for fid, c in core.pending_contributions()] == [(0, "l1")]
        assert core.slots[0].timer is not None and not core.merging
        assert core.member("l1") is core.membership.members["l1"] and core.member("nobody") is None
        core.cancel_timers()
        assert all(slot.timer is None for slot in core.slots)
        clock.advance(5.0)  # past the grace window: the next tick merges
        core.tick()
        await settle()
        version, published, params = core.fragment_digest(0)
        assert version == 1 and core.pending_contributions() == []
        assert (published, params) == (core.slots[0].published_sha256, core.slots[0].params_sha256)
        assert published == serde.params_sha256(core.slots[0].published)

    asyncio.run(run())


class _Ref(NamedTuple):
    name: str
    digest: str


class _Manifest(NamedTuple):
    step: int
    blobs: list[_Ref]


class _Store:
    """The two calls a syncer's restore makes of the checkpoint client, over one checkpoint's blobs."""

    def __init__(self, step: int, blobs: dict[str, bytes]) -> None:
        self._blobs = {f"sha-{name}": data for name, data in blobs.items()}
        self._manifest = _Manifest(step, [_Ref(name, f"sha-{name}") for name in blobs])

    async def latest_manifest(self, run_id: str) -> _Manifest:
        return self._manifest

    async def get_blob(self, digest: str) -> bytes:
        return self._blobs[digest]


def test_a_syncer_restores_the_typed_snapshot_it_reads_from_the_store():
    """__main__'s restore path: the store's blobs come back as a SyncerSnapshot (never the dict
    form), which a new core takes as it is."""
    from services.syncer import __main__ as syncer_main
    from services.syncer import config as config_lib

    async def run():
        core = make_core(FakeClock())
        join(core, "a")
        await upload(core, "a", 0, 0, np.full(core.plan.fragments[0].numel, 0.05))
        await settle()
        blobs, _ = checkpointing.encode_snapshot(await core.snapshot())
        state = await syncer_main._restore(_Store(core.outer_steps, blobs), config_lib.SyncerConfig(insecure=True))
        assert isinstance(state, state_lib.SyncerSnapshot) and state.outer_steps == core.outer_steps == 1
        restored = make_core(FakeClock())
        restored.restore(state)
        assert restored.versions() == core.versions() and restored.slots[0].params_sha256 == core.slots[0].params_sha256
        assert restored.membership.members["a"].incarnation == 1 and restored.restored_from_checkpoint

    asyncio.run(run())
