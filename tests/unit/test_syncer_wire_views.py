"""The syncer's plain records against their messages (issue 22): services/syncer/wire_views.py
carries every field of a merge, a contribution, a round call and an influence row into its message,
and the metrics' scrape (services/syncer/metrics.scrape_state, no protobuf) reads the same values
as the TrainingState. Without gRPC; the clock is a fake the tests advance."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np

from ddiloco.v1 import syncer_pb2
from ddiloco.wire import serde
from services.syncer import influence as influence_lib
from services.syncer import merging as merging_lib
from services.syncer import metrics as metrics_lib
from services.syncer import wire_views
from tests.fakes import FakeClock, join, make_core, progress, settle, upload


def _names(message_type) -> list[str]:
    return [f.name for f in message_type.DESCRIPTOR.fields]


def test_each_plain_record_has_the_fields_of_its_message_in_order():
    # A field added to the message but not to the record (or the other way) fails here.
    for plain, message in ((merging_lib.Contribution, syncer_pb2.Contribution),
                           (merging_lib.MergeRecord, syncer_pb2.MergeRecord),
                           (influence_lib.LearnerInfluence, syncer_pb2.LearnerInfluence)):
        assert [f.name for f in dataclasses.fields(plain)] == _names(message), plain.__name__
    assert list(merging_lib.RoundCall._fields) == _names(syncer_pb2.RoundCall)


def _status_name(member: syncer_pb2.MemberState) -> str:
    enum = syncer_pb2.MemberState.DESCRIPTOR.fields_by_name["status"].enum_type
    return enum.values_by_number[member.status].name.removeprefix("STATUS_").lower()


def test_the_training_state_and_the_scrape_read_the_same_values():
    async def run():
        clock = FakeClock()
        core = make_core(clock, min_quorum=2)
        for learner in ("a", "b", "c", "d"):
            join(core, learner)
        n = core.plan.fragments[0].numel
        await upload(core, "a", 0, 0, np.full(n, 0.05))
        await upload(core, "b", 0, 0, np.full(n, -0.02), steps=3)
        await settle()
        assert core.slots[0].version == 1
        await upload(core, "a", 1, 0, np.full(core.plan.fragments[1].numel, 0.01))  # pending in fragment 1
        core.report_eval(wire_views.eval_report(syncer_pb2.ReportEvalRequest(
            protocol_version=serde.PROTOCOL_VERSION, heldout_loss=3.5, tokens_merged=200)))
        clock.advance(core.membership.liveness_timeout_s + 1.0)
        progress(core, "a", 0.5)
        progress(core, "b", 0.7)
        core.membership.quarantine(core.membership.members["b"], reason="test", duration_s=100.0)
        core.leave(**wire_views.leave_args(syncer_pb2.LeaveRequest(
            protocol_version=serde.PROTOCOL_VERSION, learner_id="c", incarnation=1)))
        await settle()
        return core

    core = asyncio.run(run())
    state = wire_views.training_state(core, 16)
    scrape = metrics_lib.scrape_state(core)

    # The merge's message holds every value of the plain record, contributors included.
    record, message = core.rounds.merges[-1], state.recent_merges[-1]
    assert len(record.contributors) == 2 and message.ByteSize() > 0
    for name in _names(syncer_pb2.MergeRecord):
        if name != "contributors":
            assert getattr(message, name) == getattr(record, name), name
    assert [[getattr(c, name) for name in _names(syncer_pb2.Contribution)] for c in message.contributors] == \
        [list(dataclasses.astuple(c)) for c in record.contributors]
    assert [wire_views.learner_influence(i) for i in core.influence.summary()] == list(state.influence)
    assert {i.learner_id for i in state.influence} == {"a", "b"}

    for name in ("outer_steps", "tokens_merged", "tokens_processed", "bytes_in", "bytes_out", "quarantines",
                 "grace_window_s", "step_time_s", "quorum_time_s", "sync_time_s", "last_checkpoint_outer_step"):
        assert getattr(scrape, name) == getattr(state, name), name
    assert (scrape.min_quorum, scrape.num_fragments) == (state.config.min_quorum, state.config.num_fragments)
    assert (scrape.uploads, scrape.auth_failures, scrape.direction_judgments) == \
        (dict(state.uploads), dict(state.auth_failures), dict(state.direction_judgments))
    assert scrape.fragments == tuple((f.fragment_id, f.version, f.pending_contributions) for f in state.fragments)
    assert scrape.fragments[1][2] == 1  # the pending contribution is counted
    assert scrape.heldout_loss == state.evals[-1].heldout_loss == 3.5
    assert [(r.learner_id, r.region, r.status, r.quarantined, r.local_step, r.tokens_total, r.inner_loss,
             r.last_seen_unix_s) for r in scrape.members] == \
        [(m.learner_id, m.region, _status_name(m), m.quarantined, m.local_step, m.tokens_total, m.inner_loss,
          m.last_seen_unix_s) for m in state.members]
    # Every status shows: a active, b active and quarantined, c left, d silent.
    assert [(r.status, r.quarantined) for r in scrape.members] == \
        [("active", False), ("active", True), ("left", False), ("silent", False)]
