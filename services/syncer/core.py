"""SyncerCore: the facade the servicer calls, over the syncer's parts, with no gRPC.

Owns the wiring of the parts and the few calls that cross them (a learner's join, progress report and
leave; `tick`, which re-evaluates the open rounds). Each other job lives in the part that owns its
state: `membership` (learner lives, fencing, liveness, quarantine and its follow-up; membership.py),
`admission` (header checks, decoding, norm bound, direction check; admission.py), `intake` (the path
of an upload through admission into its round; intake.py), `rounds` (merge rounds, grace window and
timers, the outer step; merging.py), `publisher` / `downloads` / `watchers` / `observers` (what
leaves the core; publishing.py), the per-fragment `slots` and which of them this syncer owns
(slots.py), `evals` (the eval log; evals.py), `influence` (the merge ledger; influence.py) and
`snapshots` (the typed snapshot a restart needs, restore, the checkpoint bookkeeping; snapshots.py).
`status` (status.py) reads the parts into the plain values the TrainingState is built from. The
facade's names below say which part answers each call the servicer, `__main__`, wire_views and
metrics make; nothing else of the parts is reached through it. It is built from plain settings
(settings.py: the run's `RunSettings`, the syncer's `CoreSettings`, both from a SyncerConfig).
No protobuf here either: the core takes the plain forms of the requests and answers with plain
values; the servicer makes those forms and builds every response and the TrainingState from them
(services/syncer/wire_views.py).

Concurrency: everything runs on one asyncio loop. Heavy numpy work (decode, fold-in, outer
step, encode) runs in worker threads while the fragment's asyncio.Lock is held, so one fragment
never sees two mutations at once and the loop stays responsive.

Clocks are injected: `clock` (monotonic seconds) drives every timing decision, `wall_clock`
(unix seconds) only stamps records for humans. Tests advance a fake clock and call `tick()`.
"""

from __future__ import annotations

import collections
import uuid
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import outer as outer_lib
from ddiloco.algo import robust as robust_lib
from ddiloco.algo import rounds as rounds_lib
from . import admission as admission_lib
from . import backpressure as backpressure_lib
from . import evals as evals_lib
from . import influence as influence_lib
from . import intake as intake_lib
from . import membership as membership_lib
from . import merging as merging_lib
from . import publishing as publishing_lib
from . import settings as settings_lib
from . import slots as slots_lib
from . import snapshots as snapshots_lib
from . import state as state_lib
from . import status as status_lib

# The core's configuration in plain values, from the flags (settings.py): tools build a core with them.
make_run_settings = settings_lib.RunSettings.of
CoreSettings = settings_lib.CoreSettings


def _of(part: str, name: str, *, settable: bool = False) -> property:
    """The facade's name for `<part>.<name>`, a value or a bound method, read at each use."""
    def get(core):
        return getattr(getattr(core, part), name)

    def set_(core, value) -> None:
        setattr(getattr(core, part), name, value)
    return property(get, set_ if settable else None, doc=f"{part}.{name} (see there)")


class Joined(NamedTuple):
    """A join's result, what its JoinResponse is built from (wire_views.join_response)."""

    member: membership_lib.Member
    assign_data_shard: bool  # this syncer placed the learner on a data shard (shard 0 alone does)


class SyncerCore:
    """The syncer's state machine. See the module docstring for the concurrency model."""

    # `stepper_factory` gives each fragment its own outer optimizer (the data-parallel baseline's
    # AdamW); by default every fragment shares Nesterov SGD with `settings.outer_lr` and `outer_momentum`.
    def __init__(
        self,
        *,
        run: settings_lib.RunSettings,  # the run's configuration learners adopt (make_run_settings)
        plan: fragments_lib.FragmentPlan,
        initial_params: Mapping[int, np.ndarray],  # of the fragments this syncer owns, at least
        settings: CoreSettings,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
        stepper_factory: Callable[[fragments_lib.Fragment], outer_lib.OuterStepper] | None = None,
        on_merge: Callable[[], None] | None = None,
    ) -> None:
        self.run, self.plan, self.settings, self.token_budget = run, plan, settings, settings.token_budget
        self.instance = uuid.uuid4().hex
        self.clock, self.wall_clock = clock, wall_clock  # read by the views of the state too (wire_views, metrics)
        self.on_merge = on_merge
        self.norm_bound = settings.norm_bound or robust_lib.NormBoundPolicy()
        # Off unless given (the syncer service passes SyncerConfig.direction_policy, on by default).
        self.direction = settings.direction or robust_lib.DirectionPolicy(mode="off")
        self.observers = publishing_lib.Observers()
        self.watchers = publishing_lib.Watchers()
        # Fault tests only: __main__ arms named crash points here (ddiloco.failpoints).
        self.failpoint: Callable[[str], None] = lambda name: None
        steppers = slots_lib.outer_steppers(plan, settings.outer_lr, settings.outer_momentum, stepper_factory)
        # A shard builds only its own fragments' values and state (`initial_params` needs no others).
        self.slots = slots_lib.build_slots(plan, settings.shard_layout, initial_params, steppers, self.norm_bound)
        self.shards = self.slots.layout  # which fragments this syncer owns (fragment shards)
        self.owned, self.owned_slots = self.slots.owned, self.slots.owned_slots
        self.directions = robust_lib.DirectionGuard(self.direction, [plan.fragments[f] for f in sorted(self.owned)])
        self.publisher = publishing_lib.Publisher(download_codec=run.download_codec,
                                                  block_size=run.upload_block_size, zstd_level=run.zstd_level)
        self.downloads = publishing_lib.Downloads(publisher=self.publisher, slots=self.slots, watchers=self.watchers)
        self.evals = evals_lib.EvalLog(wall_clock)
        self.uploads: collections.Counter = collections.Counter()  # shared by the parts: never rebound
        self.membership = membership_lib.Membership(
            model_fingerprint=run.model_fingerprint, model_name=run.model_name,
            clock=clock, wall_clock=wall_clock, liveness_timeout_s=settings.liveness_timeout_s,
            quarantine_after=settings.quarantine_after, quarantine_window_s=settings.quarantine_window_s,
            quarantine_s=settings.quarantine_s, uploads=self.uploads, emit=self.observers.emit,
            on_change=self.watchers.notify, on_quarantine=lambda: self.tick())
        self.admission = admission_lib.Admission(
            instance=self.instance, plan=plan, slots=self.slots, membership=self.membership,
            directions=self.directions, direction_policy=self.direction, norm_bound=self.norm_bound,
            uploads=self.uploads, clock=clock, max_decoding=settings.max_decoding
            or backpressure_lib.decoding_bound(self.owned, self.direction.min_others))
        self.rounds = self._rounds(steppers, stepper_factory is None)
        # Who influenced each merge (services/syncer/influence.py); __main__ gives it the ledger.
        self.influence = influence_lib.Influence(run_id=run.run_id, instance=self.instance,
                                                 directions=self.directions)
        self.admission.influence = self.rounds.influence = self.influence
        self.intake = intake_lib.Intake(
            slots=self.slots, admission=self.admission, membership=self.membership, rounds=self.rounds,
            directions=self.directions, influence=self.influence, uploads=self.uploads,
            emit=self.observers.emit, tick=lambda: self.tick())
        self.snapshots = snapshots_lib.Snapshots(
            slots=self.slots, owned_slots=self.owned_slots, shards=self.shards, membership=self.membership,
            rounds=self.rounds, influence=self.influence, uploads=self.uploads, evals=self.evals, clock=clock,
            wall_clock=wall_clock)
        self.started_at_unix_s = wall_clock()

    def _rounds(self, steppers: list[outer_lib.OuterStepper], shared_sgd: bool) -> merging_lib.Rounds:
        run, settings = self.run, self.settings
        rounds = merging_lib.Rounds(
            settings=settings_lib.round_settings(run), plan=self.plan, slots=self.slots, steppers=steppers,
            scheduled=settings.round_trigger == "schedule" and run.sync_mode in ("", rounds_lib.DECOUPLED),
            outer_step_fraction=settings.outer_step_fraction, merge_history=settings.merge_history,
            grace_gamma=settings.grace_gamma, max_grace_s=settings.max_grace_s, uploads=self.uploads,
            clock=self.clock, wall_clock=self.wall_clock, membership=self.membership, publisher=self.publisher,
            tick=lambda: self.tick(), notify=self.watchers.notify, emit=self.observers.emit,
            failpoint=lambda name: self.failpoint(name), merged=self._merged, owned=self.owned)
        # For the ledger's replayable records: the outer optimizer, when it is the shared Nesterov SGD.
        rounds.outer = ({"lr": settings.outer_lr, "momentum": settings.outer_momentum, "nesterov": True}
                        if shared_sgd else None)
        return rounds

    def _merged(self) -> None:
        if self.on_merge is not None:
            self.on_merge()

    # ------------------------------------------------------- the facade: which part answers each call

    # Learners (membership.py).
    check_protocol = staticmethod(membership_lib.check_protocol)
    require_member = _of("membership", "require_member")  # the member for this exact life, or FAILED_PRECONDITION
    is_current = _of("membership", "is_current")
    count_bytes = _of("membership", "count_bytes")
    record_rejection = _of("membership", "record_rejection")  # counted once; a strike once per `work`
    record_auth_failure = _of("membership", "record_auth_failure")
    step_time_s = _of("membership", "step_time_s")  # mean smoothed step time over live learners
    merged_through_step = _of("membership", "merged_through_step")  # a MergeReceipt's mark
    liveness_timeout_s = _of("membership", "liveness_timeout_s")  # silent after this long unseen
    # Uploads (intake.py, admission.py).
    validate_upload_header = _of("intake", "validate_header")
    accept_upload = _of("intake", "accept")
    open_payload = _of("admission", "open_payload")  # fed chunk by chunk as the payload arrives
    close_payload = _of("admission", "close_payload")  # releases what open_payload took, once
    # Rounds (merging.py).
    round_call = _of("rounds", "round_call")  # the call to send a learner for a fragment's open round
    broadcast_sent = _of("rounds", "broadcast_sent")  # a watch stream sent a version (the sync time)
    pending_contributions = _of("rounds", "pending_contributions")  # of every round not merged yet
    cancel_timers = _of("rounds", "cancel_timers")  # shutdown: nothing merges after the last checkpoint
    merging = _of("rounds", "merging")  # a merge is scheduled or running on some fragment
    outer_steps = _of("rounds", "outer_steps")
    max_grace_s = _of("rounds", "max_grace_s")  # the cap on a round's grace window
    # What leaves the core (publishing.py) and the fragments (slots.py).
    versions = _of("slots", "versions")  # the version of each fragment this syncer (shard) owns
    fragment_digest = _of("slots", "digest")  # (version, published_sha256, params_sha256)
    download = _of("downloads", "download")
    mark_committed = _of("downloads", "mark_committed")  # a checkpoint is committed: its versions may leave
    owned_fragment_ids = _of("downloads", "owned_fragment_ids")
    published_sha256 = _of("downloads", "published_sha256")
    commit_before_broadcast = _of("downloads", "commit_before_broadcast", settable=True)  # set by __main__
    change_counter = _of("watchers", "counter")
    wait_for_change = _of("watchers", "wait_for_change")
    wake_watchers = _of("watchers", "notify")  # shutdown: watch streams end without waiting a poll
    observe = _of("observers", "append")  # a passive observer of merges, uploads, traffic (metrics, history)
    # Restarts and checkpoints (snapshots.py), the merge ledger (influence.py).
    snapshot = _of("snapshots", "take")  # a consistent copy of everything a restart needs
    restore = _of("snapshots", "restore")  # as `snapshot` returns it or checkpointing.load_snapshot reads it
    note_checkpoint = _of("snapshots", "note_checkpoint")
    restored_from_checkpoint = _of("snapshots", "restored_from_checkpoint")
    last_checkpoint_outer_step = _of("snapshots", "last_checkpoint_outer_step")
    attach_ledgers = _of("influence", "attach")  # where the merges' records go (__main__)
    influence_counts = _of("influence", "counts")  # per-identity counts the metrics export

    def member(self, learner_id: str) -> membership_lib.Member | None:
        """The registered member of this id (any life), None if it never joined."""
        return self.membership.members.get(learner_id)

    def status(self, recent_merges: int) -> status_lib.Status:
        """The state now, with the last `recent_merges` merges (0: none): the TrainingState's values."""
        return status_lib.status_of(self, recent_merges)

    # ------------------------------------------------------------------ the calls that cross parts

    def join(self, args: membership_lib.JoinArgs) -> Joined:
        """Registers a learner; a higher incarnation replaces (fences off) the previous life.
        `args`: a JoinRequest's plain form (wire_views.join_args); the answer is built from the
        result by wire_views.join_response."""
        if self.shards.index != 0 and args.assign_data_shard:
            # Data shards are assigned by shard 0 alone (the learner joins it first); the other shards
            # record the one the learner pins, so that two shards never hand out different ones.
            args = args._replace(assign_data_shard=False)
        member, replaced = self.membership.join(args)
        if replaced is not None:
            self.rounds.schedule.forget((replaced.learner_id, replaced.incarnation))
        return Joined(member, args.assign_data_shard)

    def report_progress(self, progress: membership_lib.Progress, wire_bytes: int) -> None:
        """`progress`: a ReportProgressRequest's plain form (wire_views.progress). The answer is the
        versions and whether the budget is spent (wire_views.progress_response)."""
        member = self.membership.seen(progress)
        if progress.finished and not member.finished:
            member.finished = True
            self.tick()  # rounds that waited for it may be complete (tick also opens the last rounds)
        elif progress.finished and self.rounds.open_if_nobody_trains():
            # A finished learner keeps reporting while it waits: the last training learner may have
            # gone silent (a crash) since, and only a report or a timer brings the syncer here.
            self.tick()
        self.membership.note_step_stats(member, progress, wire_bytes)
        if self.rounds.scheduled and not member.finished:
            self.rounds.schedule.observe((member.learner_id, member.incarnation), progress.local_step,
                                         len(self.membership.expected_learners()))
            self.rounds.open_due()  # the rounds the schedule says are due

    def leave(self, *, learner_id: str, incarnation: int, protocol_version: int) -> None:
        """A learner life leaves the run (a LeaveRequest's fields: wire_views.leave_args)."""
        member = self.membership.leave(learner_id=learner_id, incarnation=incarnation,
                                       protocol_version=protocol_version)
        self.rounds.schedule.forget((member.learner_id, member.incarnation))
        self.rounds.open_if_nobody_trains()
        self.watchers.notify()
        # Rounds that were waiting for this learner may now be complete.
        self.tick()

    def budget_reached(self) -> bool:
        """Whether the run's token budget is spent: learners are told to stop in their progress
        answers. Counted from the learners' reports (restored with the members after a restart),
        so the run overshoots by at most what the fleet processes in one report interval."""
        return self.token_budget > 0 and self.membership.tokens_processed() >= self.token_budget

    def note_hold(self, header: admission_lib.UploadHeader, hold_s: float) -> None:
        """The back-pressure hint an accepted upload's response carries (Membership.note_hold)."""
        self.membership.note_hold(header.learner_id, header.incarnation, header.fragment_id, hold_s)

    def count_upload(self, event: str) -> None:
        """Counts an upload event the servicer sees (TrainingState.uploads): "waited_for_slot", "slowed"."""
        self.uploads[event] += 1

    def note_watch_refused(self, rpc: str, limit: str) -> None:
        """A watch stream refused at its cap (ddiloco_syncer_watch_refusals_total)."""
        self.observers.emit("watch_refused", rpc, limit)

    def report_eval(self, report: state_lib.EvalReport) -> None:
        """A ReportEvalRequest's plain form (wire_views.eval_report), kept in the eval log (EvalLog.report)."""
        self.evals.report(report)
        self.watchers.notify()

    def grace_window_s(self) -> float:
        """The grace window now, from the learners' step times (Rounds.grace_window_s)."""
        return self.rounds.grace_window_s(self.membership.step_time_s())

    def tick(self) -> None:
        """Re-evaluates every open round at the current time; merges those that are due."""
        self.rounds.open_if_nobody_trains()  # the last training learner may have gone silent
        self.rounds.decide(self.grace_window_s())
