"""The syncer's state now in plain values, read from its parts: what the TrainingState is built from.

Owns `Status` and `status_of`, which reads the run, the owned fragments, the members, the recent
merges, the eval log, influence, the counters, the grace window inputs and the checkpoint bookkeeping
off a SyncerCore at its clocks. wire_views.training_state and metrics build their forms from it.
Must not: build protobuf (wire_views.py does) or change any part's state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import shards as shards_lib
from . import influence as influence_lib
from . import membership as membership_lib
from . import merging as merging_lib
from . import settings as settings_lib
from . import slots as slots_lib
from . import state as state_lib

if TYPE_CHECKING:
    from .core import SyncerCore


class Status(NamedTuple):
    """The syncer's state now in plain values, what the TrainingState is built from
    (wire_views.training_state)."""

    run: settings_lib.RunSettings
    plan: fragments_lib.FragmentPlan
    instance: str
    shards: shards_lib.ShardLayout
    started_at_unix_s: float
    now_s: float  # the core's clock: the members' status is judged at it
    now_unix_s: float
    liveness_timeout_s: float
    outer_steps: int
    tokens_merged: int
    tokens_processed: int
    token_budget: int
    fragments: list[slots_lib.FragmentStatus]  # the owned ones
    members: list[membership_lib.Member]  # by learner id; read only
    recent_merges: list[merging_lib.MergeRecord]
    evals: list[state_lib.EvalSnapshot]
    influence: list[influence_lib.LearnerInfluence]
    bytes_in: int
    bytes_out: int
    uploads: dict[str, int]
    auth_failures: dict[str, int]
    quarantines: int
    direction_judgments: dict[str, int]
    grace_window_s: float
    step_time_s: float
    quorum_time_s: float
    sync_time_s: float
    last_checkpoint_outer_step: int
    last_checkpoint_unix_s: float
    restored_from_checkpoint: bool


def status_of(core: SyncerCore, recent_merges: int) -> Status:
    """The state of `core` now, with the last `recent_merges` merges (0: none)."""
    membership, rounds, checkpoints = core.membership, core.rounds, core.snapshots
    return Status(
        run=core.run, plan=core.plan, instance=core.instance, shards=core.shards,
        started_at_unix_s=core.started_at_unix_s, now_s=core.clock(), now_unix_s=core.wall_clock(),
        liveness_timeout_s=membership.liveness_timeout_s, outer_steps=rounds.outer_steps,
        tokens_merged=rounds.tokens_merged, tokens_processed=membership.tokens_processed(),
        token_budget=core.token_budget, fragments=[s.status() for s in core.owned_slots],
        members=sorted(membership.members.values(), key=lambda m: m.learner_id),
        recent_merges=list(rounds.merges)[-recent_merges:] if recent_merges else [],
        evals=list(core.evals), influence=core.influence.summary(),
        bytes_in=membership.bytes_in, bytes_out=membership.bytes_out, uploads=dict(core.uploads),
        auth_failures=dict(membership.auth_failures), quarantines=membership.quarantines,
        direction_judgments=dict(core.admission.direction_judgments), grace_window_s=core.grace_window_s(),
        step_time_s=membership.step_time_s(), quorum_time_s=rounds.quorum_time.value or 0.0,
        sync_time_s=rounds.sync_time.value or 0.0, last_checkpoint_outer_step=checkpoints.last_checkpoint_outer_step,
        last_checkpoint_unix_s=checkpoints.last_checkpoint_unix_s,
        restored_from_checkpoint=checkpoints.restored_from_checkpoint)
