"""The protobuf views of the syncer's plain state: the one place below the servicer that builds
syncer_pb2 messages from the parts' Python values.

Owns the RunConfig learners adopt (`run_config`, of the core's plain RunSettings), the TrainingState (`training_state`) and its rows (`member_state`,
`fragment_state`, `merge_record`, `learner_influence`, `eval_record`), the RoundCall of a watch
stream (`round_call`), and the plain forms of the requests membership reads (`join_args`,
`progress`) and of the upload header admission reads (`upload_header`).
The parts (state, membership, slots, checkpointing, admission, merging, influence, ...) stay free
of generated code; tests/unit/test_syncer_no_protobuf.py checks that.
Must not: hold state, take locks or mutate the core; called on the core's loop.
"""

from __future__ import annotations

import dataclasses
import functools

from ddiloco import build_info
from ddiloco.algo import fragments as fragments_lib
from ddiloco.v1 import syncer_pb2
from ddiloco.wire import serde
from . import admission as admission_lib
from . import influence as influence_lib
from . import membership as membership_lib
from . import merging as merging_lib
from . import settings as settings_lib
from . import slots as slots_lib
from . import state as state_lib

# membership.member_status's names as MemberState.status.
_MEMBER_STATUS = {"active": syncer_pb2.MemberState.STATUS_ACTIVE, "silent": syncer_pb2.MemberState.STATUS_SILENT,
                  "left": syncer_pb2.MemberState.STATUS_LEFT}


def join_args(req: syncer_pb2.JoinRequest) -> membership_lib.JoinArgs:
    """The JoinRequest as membership reads it."""
    return membership_lib.JoinArgs(
        learner_id=req.learner_id, incarnation=req.incarnation, region=req.region,
        protocol_version=req.protocol_version, model_fingerprint=req.model_fingerprint,
        tokens_per_step=req.tokens_per_step, num_data_shards=req.num_data_shards, data_shard=req.data_shard,
        assign_data_shard=req.assign_data_shard)


def progress(req: syncer_pb2.ReportProgressRequest) -> membership_lib.Progress:
    """The ReportProgressRequest as membership reads it."""
    return membership_lib.Progress(
        learner_id=req.learner_id, incarnation=req.incarnation, protocol_version=req.protocol_version,
        local_step=req.local_step, tokens_total=req.tokens_total, step_time_s=req.step_time_s,
        inner_loss=req.inner_loss, finished=req.finished)


def leave_args(req: syncer_pb2.LeaveRequest) -> dict:
    """The LeaveRequest as Membership.leave's keyword arguments."""
    return {"learner_id": req.learner_id, "incarnation": req.incarnation, "protocol_version": req.protocol_version}


def eval_report(req: syncer_pb2.ReportEvalRequest) -> state_lib.EvalReport:
    """The ReportEvalRequest as the core reads it."""
    return state_lib.EvalReport(protocol_version=req.protocol_version, evaluator_id=req.evaluator_id,
                                heldout_loss=req.heldout_loss, tokens_merged=req.tokens_merged,
                                outer_steps=sum(v.version for v in req.evaluated))


def join_response(core, member: membership_lib.Member, *, assign_data_shard: bool) -> syncer_pb2.JoinResponse:
    """A joined learner's answer: the run's config, the versions and digests, its data shard, and
    whether the run's token budget is already spent."""
    return syncer_pb2.JoinResponse(
        config=_run_config(core.run, core.plan),
        fragment_versions=serde.versions_to_proto(core.versions()),
        syncer_instance=core.instance,
        published_sha256=core.published_sha256(),
        data_shard=max(member.data_shard, 0),
        data_shard_assigned=member.data_shard_assigned and assign_data_shard,
        schedule_start_step=member.steps_prev_lives,
        budget_reached=core.budget_reached(),
        shards=shard_map(core.shards),
        shard_index=core.shards.index,
    )


def shard_map(layout) -> list[syncer_pb2.SyncerShard]:
    """The shard map (JoinResponse.shards, TrainingState.shards) of a ShardLayout: empty when unsharded."""
    return [syncer_pb2.SyncerShard(index=i, addresses=list(addresses), fragment_ids=list(layout.fragments_of(i)))
            for i, addresses in enumerate(layout.addresses)]


def progress_response(versions: dict[int, int], *, budget_reached: bool) -> syncer_pb2.ReportProgressResponse:
    """The answer to a progress report: the current versions, and whether the token budget is spent."""
    return syncer_pb2.ReportProgressResponse(fragment_versions=serde.versions_to_proto(versions),
                                             budget_reached=budget_reached)


def upload_response(*, duplicate: bool, current_version: int, weight: float) -> syncer_pb2.UploadFragmentResponse:
    """The answer to an accepted (or duplicate) upload."""
    result = syncer_pb2.UploadFragmentResponse
    return result(result=result.RESULT_DUPLICATE if duplicate else result.RESULT_ACCEPTED,
                  current_version=current_version, weight=weight)


def merge_receipt(fragment_id: int, version: int, merged_through_step: int) -> syncer_pb2.MergeReceipt:
    """A learner life's MergeReceipt for a version of a fragment."""
    return syncer_pb2.MergeReceipt(fragment_id=fragment_id, version=version, merged_through_step=merged_through_step)


def upload_header(header: syncer_pb2.UploadHeader) -> admission_lib.UploadHeader:
    """The UploadFragment header as admission reads it; its payload description in plain values
    (codec, compression and checksum kind by name: serde.PayloadDescription)."""
    return admission_lib.UploadHeader(
        protocol_version=header.protocol_version, learner_id=header.learner_id, incarnation=header.incarnation,
        fragment_id=header.fragment_id, base_version=header.base_version, syncer_instance=header.syncer_instance,
        steps=header.steps, tokens=header.tokens, payload=serde.payload_description_from_proto(header.payload),
        local_step=header.local_step, final=header.final)


def eval_record(e: state_lib.EvalSnapshot) -> syncer_pb2.EvalRecord:
    """One held-out evaluation as the TrainingState carries it."""
    return syncer_pb2.EvalRecord(**dataclasses.asdict(e))


def member_state(m: membership_lib.Member, *, now_s: float, liveness_timeout_s: float) -> syncer_pb2.MemberState:
    """One member's row of the TrainingState."""
    status = syncer_pb2.MemberState
    st = _MEMBER_STATUS[membership_lib.member_status(m, now_s=now_s, liveness_timeout_s=liveness_timeout_s)]
    quarantined = now_s < m.quarantined_until_s
    return status(
        learner_id=m.learner_id, incarnation=m.incarnation, region=m.region, status=st,
        last_seen_unix_s=m.last_seen_unix_s, local_step=m.local_step, tokens_total=m.tokens_total,
        step_time_s=m.step_time_s, inner_loss=m.inner_loss, uploads_accepted=m.uploads_accepted,
        uploads_rejected=m.uploads_rejected, joins=m.joins, bytes_in=m.bytes_in, bytes_out=m.bytes_out,
        quarantined=quarantined, flags=m.flags, rejections=dict(m.rejections),
        quarantined_until_unix_s=m.quarantined_until_unix_s if quarantined else 0.0,
        direction_agreement=m.direction_sum / m.direction_count if m.direction_count else 0.0,
        num_data_shards=m.num_data_shards, data_shard=max(m.data_shard, 0),
        data_shard_assigned=m.data_shard_assigned,
    )


def fragment_state(s: slots_lib.FragmentStatus) -> syncer_pb2.FragmentState:
    """One fragment's row of the TrainingState."""
    return syncer_pb2.FragmentState(**s._asdict())


def run_config(run: settings_lib.RunSettings, plan: fragments_lib.FragmentPlan) -> syncer_pb2.RunConfig:
    """The RunConfig learners adopt, from the run's settings and the fragment plan (the core's
    `run` and `plan`): a copy of its own."""
    config = syncer_pb2.RunConfig()
    config.CopyFrom(_run_config(run, plan))
    return config


@functools.lru_cache(maxsize=4)  # one run a syncer; its plan may list thousands of tensors. Shared: read only
def _run_config(run: settings_lib.RunSettings, plan: fragments_lib.FragmentPlan) -> syncer_pb2.RunConfig:
    return syncer_pb2.RunConfig(
        run_id=run.run_id,
        model_name=run.model_name,
        model_config_json=run.model_config_json,
        model_fingerprint=run.model_fingerprint,
        num_fragments=plan.num_fragments,
        sync_period_steps=plan.sync_period_steps,
        overlap_steps=run.overlap_steps,
        min_quorum=run.min_quorum,
        upload_codec=serde.codec_to_proto(run.upload_codec),
        upload_block_size=run.upload_block_size,
        download_codec=serde.codec_to_proto(run.download_codec),
        chunk_size_bytes=run.chunk_size_bytes,
        max_staleness_versions=run.max_staleness_versions,
        mixing_alpha=run.mixing_alpha,
        on_arrival=run.on_arrival,
        round_trigger=run.round_trigger,
        fragments=serde.plan_to_proto(plan),
        zstd_level=run.zstd_level,
        merge_rule=run.merge_rule,
        embedding_merge_rule=run.embedding_merge_rule,
        protocol_version=serde.PROTOCOL_VERSION,
        sync_mode=run.sync_mode,
        init_seed=run.init_seed,
    )


def round_call(call: merging_lib.RoundCall) -> syncer_pb2.RoundCall:
    """The call a watch stream sends a learner for a fragment's open round."""
    return syncer_pb2.RoundCall(fragment_id=call.fragment_id, round=call.round, version=call.version)


def contribution(c: merging_lib.Contribution) -> syncer_pb2.Contribution:
    """One contributor of a merge's record."""
    return syncer_pb2.Contribution(**dataclasses.asdict(c))


def merge_record(r: merging_lib.MergeRecord) -> syncer_pb2.MergeRecord:
    """One merge of the TrainingState's recent merges."""
    return syncer_pb2.MergeRecord(
        fragment_id=r.fragment_id, version=r.version, merged_at_unix_s=r.merged_at_unix_s,
        contributors=[contribution(c) for c in r.contributors], quorum_wait_s=r.quorum_wait_s,
        grace_window_s=r.grace_window_s, grace_used_s=r.grace_used_s, reason=r.reason,
        outer_grad_norm=r.outer_grad_norm, expected_contributors=r.expected_contributors, round=r.round)


def learner_influence(i: influence_lib.LearnerInfluence) -> syncer_pb2.LearnerInfluence:
    """One identity's row of TrainingState.influence."""
    return syncer_pb2.LearnerInfluence(**dataclasses.asdict(i))


def training_state(core, recent_merges: int) -> syncer_pb2.TrainingState:
    """The TrainingState of a SyncerCore now (SyncerCore.status), with its last `recent_merges`
    merges (0: none). Call on the core's loop."""
    st = core.status(recent_merges)
    return syncer_pb2.TrainingState(
        run_id=st.run.run_id,
        syncer_instance=st.instance,
        build_version=build_info.version(), build_commit=build_info.commit(),
        started_at_unix_s=st.started_at_unix_s,
        now_unix_s=st.now_unix_s,
        outer_steps=st.outer_steps,
        fragments=[fragment_state(s) for s in st.fragments],
        members=[member_state(m, now_s=st.now_s, liveness_timeout_s=st.liveness_timeout_s) for m in st.members],
        recent_merges=[merge_record(r) for r in st.recent_merges],
        tokens_merged=st.tokens_merged,
        bytes_in=st.bytes_in,
        bytes_out=st.bytes_out,
        evals=[eval_record(e) for e in st.evals],
        last_checkpoint_outer_step=st.last_checkpoint_outer_step,
        last_checkpoint_unix_s=st.last_checkpoint_unix_s,
        restored_from_checkpoint=st.restored_from_checkpoint,
        config=_run_config(st.run, st.plan),
        uploads=st.uploads,
        grace_window_s=st.grace_window_s,
        step_time_s=st.step_time_s,
        quorum_time_s=st.quorum_time_s,
        sync_time_s=st.sync_time_s,
        auth_failures=st.auth_failures,
        quarantines=st.quarantines,
        direction_judgments=st.direction_judgments,
        tokens_processed=st.tokens_processed,
        token_budget=st.token_budget,
        influence=[learner_influence(i) for i in st.influence],
        shards=shard_map(st.shards),
        shard_index=st.shards.index,
    )
