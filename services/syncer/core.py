"""SyncerCore: the facade the servicer calls, over the syncer's parts, with no gRPC.

Owns the wiring of the parts and the path of an upload through them: `membership` (learner lives,
fencing, liveness, quarantine; membership.py), `admission` (header checks, decoding, norm bound,
direction check; admission.py), `rounds` (merge rounds, grace window and timers, the outer step;
merging.py), `publisher` / `watchers` / `observers` (what leaves the core; publishing.py), the
per-fragment `slots` and which of them this syncer owns (slots.py), `evals` (the eval log;
evals.py) and `snapshots` (the typed snapshot a restart needs; snapshots.py). The parts tell the
core about changes through callbacks; only the core calls across parts. It is built from plain
settings (settings.py: the run's `RunSettings`, the syncer's `CoreSettings`, both from a SyncerConfig).
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

import asyncio
import collections
import logging
import uuid
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import merge as merge_lib
from ddiloco.algo import outer as outer_lib
from ddiloco.algo import robust as robust_lib
from ddiloco.algo import rounds as rounds_lib
from ddiloco.algo import shards as shards_lib
from ddiloco.rpc import errors
from ddiloco.wire import codec as codec_lib
from . import admission as admission_lib
from . import backpressure as backpressure_lib
from . import evals as evals_lib
from . import influence as influence_lib
from . import membership as membership_lib
from . import merging as merging_lib
from . import publishing as publishing_lib
from . import settings as settings_lib
from . import slots as slots_lib
from . import snapshots as snapshots_lib
from . import state as state_lib

_LOG = logging.getLogger("ddiloco.syncer")


# The core's configuration in plain values, from the flags (settings.py): tools build a core with them.
make_run_settings = settings_lib.RunSettings.of
CoreSettings = settings_lib.CoreSettings


class Joined(NamedTuple):
    """A join's result, what its JoinResponse is built from (wire_views.join_response)."""

    member: membership_lib.Member
    assign_data_shard: bool  # this syncer placed the learner on a data shard (shard 0 alone does)


class Accepted(NamedTuple):
    """An upload's result, what its UploadFragmentResponse is built from (wire_views.upload_response)."""

    duplicate: bool
    current_version: int
    weight: float


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


class SyncerCore:
    """The syncer's state machine. See the module docstring for the concurrency model."""

    commit_before_broadcast = False  # set by __main__ (--commit-before-broadcast): see sendable

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
        self.evals = evals_lib.EvalLog(wall_clock)
        self.uploads: collections.Counter = collections.Counter()  # shared by the parts: never rebound
        self.membership = membership_lib.Membership(
            model_fingerprint=run.model_fingerprint, model_name=run.model_name,
            clock=clock, wall_clock=wall_clock, liveness_timeout_s=settings.liveness_timeout_s,
            quarantine_after=settings.quarantine_after, quarantine_window_s=settings.quarantine_window_s,
            quarantine_s=settings.quarantine_s, uploads=self.uploads, emit=self._emit, on_change=self._notify,
            on_quarantine=self._after_quarantine)
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
        self.snapshots = snapshots_lib.Snapshots(
            slots=self.slots, owned_slots=self.owned_slots, shards=self.shards, membership=self.membership,
            rounds=self.rounds, uploads=self.uploads, evals=self.evals, clock=clock, wall_clock=wall_clock)
        self.started_at_unix_s = wall_clock()
        self.restored_from_checkpoint = False
        # The last committed checkpoint (note_checkpoint; restore too).
        self.last_checkpoint_outer_step, self.last_checkpoint_unix_s = 0, 0.0

    def _rounds(self, steppers: list[outer_lib.OuterStepper], shared_sgd: bool) -> merging_lib.Rounds:
        run, settings = self.run, self.settings
        rounds = merging_lib.Rounds(
            settings=settings_lib.round_settings(run), plan=self.plan, slots=self.slots, steppers=steppers,
            scheduled=settings.round_trigger == "schedule" and run.sync_mode in ("", "decoupled"),
            outer_step_fraction=settings.outer_step_fraction, merge_history=settings.merge_history,
            grace_gamma=settings.grace_gamma, max_grace_s=settings.max_grace_s, uploads=self.uploads,
            clock=self.clock, wall_clock=self.wall_clock, membership=self.membership, publisher=self.publisher,
            tick=lambda: self.tick(), notify=self._notify, emit=self._emit,
            failpoint=lambda name: self.failpoint(name), merged=self._merged, owned=self.owned)
        # For the ledger's replayable records: the outer optimizer, when it is the shared Nesterov SGD.
        rounds.outer = ({"lr": settings.outer_lr, "momentum": settings.outer_momentum, "nesterov": True}
                        if shared_sgd else None)
        return rounds

    # ------------------------------------------- the parts' state, as the views and tools read it

    @property
    def members(self) -> dict[str, membership_lib.Member]:
        return self.membership.members

    def member(self, learner_id: str) -> membership_lib.Member | None:
        """The registered member of this id (any life), None if it never joined."""
        return self.membership.members.get(learner_id)

    @property
    def direction_judgments(self) -> collections.Counter:
        return self.admission.direction_judgments

    @property
    def change_counter(self) -> int:
        return self.watchers.counter

    @property
    def liveness_timeout_s(self) -> float:
        return self.membership.liveness_timeout_s

    @property
    def max_grace_s(self) -> float:
        return self.rounds.max_grace_s

    @property
    def schedule(self) -> rounds_lib.RoundSchedule:
        return self.rounds.schedule

    @property
    def merges(self) -> collections.deque:
        return self.rounds.merges

    @property
    def outer_steps(self) -> int:
        return self.rounds.outer_steps

    @property
    def tokens_merged(self) -> int:
        return self.rounds.tokens_merged

    def _emit(self, event: str, *args) -> None:
        self.observers.emit(event, *args)

    def _notify(self) -> None:
        self.watchers.notify()

    # ----------------------------------------------------------------------------- membership

    def check_protocol(self, version: int) -> None:
        membership_lib.check_protocol(version)

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
            self.schedule.forget((replaced.learner_id, replaced.incarnation))
        return Joined(member, args.assign_data_shard)

    def require_member(self, learner_id: str, incarnation: int) -> membership_lib.Member:
        """The registered member for this exact life, or FAILED_PRECONDITION."""
        return self.membership.require_member(learner_id, incarnation)

    def is_current(self, learner_id: str, incarnation: int) -> bool:
        return self.membership.is_current(learner_id, incarnation)

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
            self.schedule.observe((member.learner_id, member.incarnation), progress.local_step,
                                  len(self.expected_learners()))
            self.rounds.open_due()  # the rounds the schedule says are due

    def leave(self, *, learner_id: str, incarnation: int, protocol_version: int) -> None:
        """A learner life leaves the run (a LeaveRequest's fields: wire_views.leave_args)."""
        member = self.membership.leave(learner_id=learner_id, incarnation=incarnation,
                                       protocol_version=protocol_version)
        self.schedule.forget((member.learner_id, member.incarnation))
        self.rounds.open_if_nobody_trains()
        self._notify()
        # Rounds that were waiting for this learner may now be complete.
        self.tick()

    def count_bytes(self, member: membership_lib.Member | None, *, inbound: int = 0, outbound: int = 0,
                    codec: str = "") -> None:
        self.membership.count_bytes(member, inbound=inbound, outbound=outbound, codec=codec)

    def expected_learners(self) -> set[str]:
        """Learners a round waits for: live, not left, not quarantined, not finished."""
        return self.membership.expected_learners()

    def tokens_processed(self) -> int:
        """Tokens processed by every life of every learner known to this run."""
        return self.membership.tokens_processed()

    def budget_reached(self) -> bool:
        """Whether the run's token budget is spent: learners are told to stop in their progress
        answers. Counted from the learners' reports (restored with the members after a restart),
        so the run overshoots by at most what the fleet processes in one report interval."""
        return self.token_budget > 0 and self.tokens_processed() >= self.token_budget

    def record_rejection(self, reason: str, learner_id: str = "", exc: BaseException | None = None, *,
                         work: tuple | None = None) -> None:
        """Counts one refused upload by reason, once; a strike once per `work` (Membership.record_rejection)."""
        self.membership.record_rejection(reason, learner_id, exc, work=work)

    def count_upload(self, event: str) -> None:
        """Counts an upload event the servicer sees (TrainingState.uploads): "waited_for_slot", "slowed"."""
        self.uploads[event] += 1

    def note_watch_refused(self, rpc: str, limit: str) -> None:
        """A watch stream refused at its cap (ddiloco_syncer_watch_refusals_total)."""
        self._emit("watch_refused", rpc, limit)

    def record_auth_failure(self, reason: str, *, caller: str = "", method: str = "") -> None:
        self.membership.record_auth_failure(reason, caller=caller, method=method)

    def _after_quarantine(self) -> None:
        # Rounds that were waiting for this learner may now be complete, as on leave: left to their
        # grace timer, they held every other learner's next upload of the fragment (already
        # pending) for the whole window; a short run ended with one merge per fragment.
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop (unit tests of pure parts)
            return
        self.tick()

    # -------------------------------------------------------------------------------- uploads

    def versions(self) -> dict[int, int]:
        """The version of each fragment this syncer (shard) owns."""
        return self.slots.versions()

    async def open_payload(self, header: admission_lib.UploadHeader) -> admission_lib.IncomingPayload:
        """The payload of a validated header, fed chunk by chunk as it arrives (Admission.open_payload)."""
        return await self.admission.open_payload(header)

    def close_payload(self, incoming: admission_lib.IncomingPayload | None) -> None:
        """Releases what `open_payload` took, once, whatever became of the upload."""
        self.admission.close_payload(incoming)

    def fragment_digest(self, fragment_id: int) -> tuple[int, str, str]:
        """(version, published_sha256, params_sha256) of a fragment now."""
        s = self.slots[fragment_id]
        return s.version, s.published_sha256, s.params_sha256

    def validate_upload_header(self, header: admission_lib.UploadHeader) -> admission_lib.UploadTicket:
        """All checks that need no payload (Admission.validate), on the UploadHeader's plain form
        (wire_views.upload_header; the ticket carries it). Raises ServiceError (counted)."""
        try:
            self.slots.require_owned(header.fragment_id)
        except errors.ServiceError as exc:
            self.record_rejection(exc.reason, header.learner_id, exc)
            raise
        return self.admission.validate(header)

    async def accept_upload(self, ticket: admission_lib.UploadTicket, payload: bytes, wire_bytes: int, *,
                            wait_budget_s: float | None = None) -> Accepted:
        """Decodes, bounds, corrects to the current version and folds one contribution into its
        round; the answer (wire_views.upload_response) is built from the result. Raises
        ServiceError (counted, on the learner too). `wait_budget_s` bounds how long the
        contribution may wait for others to be judged against (the caller's deadline)."""
        try:
            async with self.admission.decode_permit(payload):  # a payload decoded on arrival holds its own
                return await self._accept_upload(ticket, payload, wire_bytes, wait_budget_s)
        except errors.ServiceError as exc:
            self.record_rejection(exc.reason, ticket.header.learner_id, exc,
                                  work=admission_lib.work_key(ticket.header))
            self.influence.note_refused(ticket.header.learner_id, ticket.header.fragment_id, exc.reason, exc)
            raise
        finally:  # a proposal waiting for its judgment never outlives the upload
            self.directions.withdraw(ticket.header.learner_id, ticket.header.fragment_id)

    async def _accept_upload(self, ticket: admission_lib.UploadTicket, payload: bytes, wire_bytes: int,
                             wait_budget_s: float | None = None) -> Accepted:
        header = ticket.header
        member = self.require_member(header.learner_id, header.incarnation)
        self.count_bytes(member, inbound=wire_bytes, codec=ticket.codec)
        slot = self.slots[header.fragment_id]
        steps = self.admission.credited_steps(member, header)
        weight = merge_lib.contribution_weight(header.tokens * steps // header.steps if header.steps else 0, steps)
        if ticket.duplicate:
            return self._duplicate(slot, weight)
        decoded = await self.admission.decode(header, payload)
        await self.admission.await_direction_references(header, decoded.heading, wait_budget_s)
        contribution_sha256 = await self.rounds.contribution_sha256(decoded.values)  # for the ledger, before the lock
        async with slot.lock:
            # Re-check under the lock: the round may have moved while decoding (the base version's
            # values stay pinned: it was within the staleness bound when the header arrived).
            ticket = self.admission.validate(header, pinned_base=ticket.base_params)
            if ticket.duplicate:
                return self._duplicate(slot, weight)
            delta, norms = await self.admission.bound_norm(slot, member, header, steps, decoded)
            weight = self.admission.cap_weight(slot, header.learner_id, steps, weight)
            self.admission.judge_direction(header, decoded.heading, slot.version)
            rnd = self.rounds.round_for(slot)
            await self.rounds.fold(slot, rnd, header.fragment_id, delta, norms, weight, ticket.base_params,
                                   header.learner_id, steps, decoded=decoded.values,
                                   contribution_sha256=contribution_sha256,
                                   claims_unverified=self.admission.claims_unverified(header.learner_id, header.fragment_id))
            self.admission.accepted(slot, member, header, decoded, norms, steps, weight)
            self.rounds.add(rnd, header, weight)
            self._emit("upload_accepted", header)
            if header.final:
                member.finished = True  # its progress report saying so may come after this upload
            self.rounds.note_quorum(rnd)
            version_at_accept = slot.version
        self.rounds.open_if_nobody_trains()
        self.tick()
        return Accepted(duplicate=False, current_version=version_at_accept, weight=weight)

    def _duplicate(self, slot: slots_lib.FragmentSlot, weight: float) -> Accepted:
        self.uploads["duplicate"] += 1
        return Accepted(duplicate=True, current_version=slot.version, weight=weight)

    # ---------------------------------------------------------------------------------- rounds

    def step_time_s(self) -> float:
        """Mean smoothed step time over live learners that reported one."""
        return self.membership.step_time_s()

    def grace_window_s(self) -> float:
        return self.rounds.grace_window_s(self.step_time_s())

    def tick(self) -> None:
        """Re-evaluates every open round at the current time; merges those that are due."""
        self.rounds.open_if_nobody_trains()  # the last training learner may have gone silent
        self.rounds.decide(self.grace_window_s())

    def note_hold(self, header: admission_lib.UploadHeader, hold_s: float) -> None:
        """The back-pressure hint an accepted upload's response carries (Membership.note_hold)."""
        self.membership.note_hold(header.learner_id, header.incarnation, header.fragment_id, hold_s)

    def round_call(self, fragment_id: int, learner_id: str) -> merging_lib.RoundCall | None:
        """The call to send this learner for the fragment's open round, if it has not contributed."""
        return self.rounds.round_call(fragment_id, learner_id)

    def merged_through_step(self, learner_id: str, incarnation: int, fragment_id: int, version: int) -> int:
        """How far (local step) this learner life's work on the fragment is held by `version`: its
        MergeReceipt's mark (wire_views.merge_receipt); 0 when the version holds none of it."""
        member = self.members.get(learner_id)
        return member.mark_at(fragment_id, version) if member is not None and member.incarnation == incarnation else 0

    def broadcast_sent(self, learner_id: str, fragment_id: int, version: int) -> None:
        """A watch stream sent `version` to a learner (the grace window's sync time)."""
        self.rounds.broadcast_sent(learner_id, fragment_id, version)

    def pending_contributions(self) -> list[tuple[int, merging_lib.Contribution]]:
        """(fragment id, contribution) of every round not merged yet."""
        return self.rounds.pending_contributions()

    def cancel_timers(self) -> None:
        """Cancels every round's grace timer (shutdown: nothing merges after the last checkpoint)."""
        self.rounds.cancel_timers()

    @property
    def merging(self) -> bool:
        """Whether a merge is scheduled or running on some fragment."""
        return self.rounds.merging

    def _merged(self) -> None:
        if self.on_merge is not None:
            self.on_merge()

    # ------------------------------------------------------------------------------ downloads

    def delta_payload(self, slot: slots_lib.FragmentSlot,
                      from_version: int) -> tuple[int, codec_lib.EncodedPayload] | None:
        """The current version as a delta from `from_version`, if one is cached for exactly that step."""
        return self.publisher.delta_payload(slot, from_version)

    async def encoded_payload(self, slot: slots_lib.FragmentSlot) -> tuple[int, codec_lib.EncodedPayload]:
        """The current published values of a fragment as exact float32 (cached per version)."""
        return await self.publisher.encoded_payload(slot)

    def sendable(self, slot: slots_lib.FragmentSlot) -> bool:
        """Whether the slot's current version may leave the syncer: always, except with
        --commit-before-broadcast before a committed checkpoint holds it (commit_gate.py)."""
        return not self.commit_before_broadcast or slot.version <= slot.committed_version

    def mark_committed(self, snapshot: state_lib.SyncerSnapshot) -> None:
        """A checkpoint of `snapshot` is committed: its versions may be sent; wakes the watchers."""
        by_id = {f.fragment_id: f.version for f in snapshot.fragments}
        for slot in self.owned_slots:
            slot.committed_version = max(slot.committed_version, by_id.get(slot.fragment.fragment_id, 0))
        if self.commit_before_broadcast:
            self._notify()

    def owned_fragment_ids(self) -> list[int]:
        """The fragments this syncer (shard) owns, in order: those it streams and calls rounds of."""
        return [s.fragment.fragment_id for s in self.owned_slots]

    def published_sha256(self) -> dict[int, str]:
        """What learners hold of each owned fragment's current version, by digest."""
        return {s.fragment.fragment_id: s.published_sha256 for s in self.owned_slots}

    async def download(self, fragment_id: int, held_version: int, *,
                       accept_delta: bool) -> tuple[int, codec_lib.EncodedPayload, bool] | None:
        """(version, payload, is_delta) of an owned fragment for a watcher holding `held_version`
        (-1: none), None when it holds the current one. A watcher holding the previous version that
        accepts deltas gets the (smaller) delta when the download codec is lossy; anyone else gets
        the exact float32 values."""
        slot = self.slots[fragment_id]
        if slot.version <= held_version or not self.sendable(slot):
            return None
        delta = self.delta_payload(slot, held_version) if accept_delta else None
        if delta is not None:
            return (*delta, True)
        return (*(await self.encoded_payload(slot)), False)

    def wake_watchers(self) -> None:
        """Wakes every wait_for_change now (shutdown: watch streams end without waiting a poll)."""
        self._notify()

    async def wait_for_change(self, seen_counter: int, timeout_s: float) -> int:
        """Waits until the state changed after `seen_counter` (or timeout); returns the counter."""
        return await self.watchers.wait_for_change(seen_counter, timeout_s)

    # ---------------------------------------------------------------------------------- evals

    def report_eval(self, report: state_lib.EvalReport) -> None:
        """A ReportEvalRequest's plain form (wire_views.eval_report), kept in the eval log (EvalLog.report)."""
        self.evals.report(report)
        self._notify()

    # ---------------------------------------------------------------------------------- state

    def status(self, recent_merges: int) -> Status:
        """The state now, with the last `recent_merges` merges (0: none): the TrainingState's values."""
        membership, rounds = self.membership, self.rounds
        return Status(
            run=self.run, plan=self.plan, instance=self.instance, shards=self.shards,
            started_at_unix_s=self.started_at_unix_s, now_s=self.clock(), now_unix_s=self.wall_clock(),
            liveness_timeout_s=membership.liveness_timeout_s, outer_steps=rounds.outer_steps,
            tokens_merged=rounds.tokens_merged, tokens_processed=self.tokens_processed(),
            token_budget=self.token_budget, fragments=[s.status() for s in self.owned_slots],
            members=sorted(membership.members.values(), key=lambda m: m.learner_id),
            recent_merges=list(rounds.merges)[-recent_merges:] if recent_merges else [],
            evals=list(self.evals), influence=self.influence.summary(),
            bytes_in=membership.bytes_in, bytes_out=membership.bytes_out, uploads=dict(self.uploads),
            auth_failures=dict(membership.auth_failures), quarantines=membership.quarantines,
            direction_judgments=dict(self.admission.direction_judgments), grace_window_s=self.grace_window_s(),
            step_time_s=self.step_time_s(), quorum_time_s=rounds.quorum_time.value or 0.0,
            sync_time_s=rounds.sync_time.value or 0.0, last_checkpoint_outer_step=self.last_checkpoint_outer_step,
            last_checkpoint_unix_s=self.last_checkpoint_unix_s, restored_from_checkpoint=self.restored_from_checkpoint)

    def observe(self, observer) -> None:
        """Adds a passive observer of merges, uploads and traffic (publishing.Observers: metrics, history)."""
        self.observers.append(observer)

    def note_checkpoint(self, outer_step: int, unix_s: float) -> None:
        """A checkpoint of the state at `outer_step` was committed at `unix_s` (__main__'s checkpointer)."""
        self.last_checkpoint_outer_step, self.last_checkpoint_unix_s = outer_step, unix_s

    def attach_ledgers(self, *, ledger=None, store_ledger=None, retain_contributions: bool = False,
                       epoch: Callable[[], int] | None = None) -> None:
        """Where the merges' influence records go (Influence): a local MergeLedger file, and/or the
        checkpoint store's ledger with the contributions retained or not and the leader's epoch."""
        if ledger is not None:
            self.influence.ledger = ledger
        if store_ledger is not None:
            self.influence.store_ledger, self.influence.retain_contributions = store_ledger, retain_contributions
        if epoch is not None:
            self.influence.epoch = epoch

    async def snapshot(self) -> state_lib.SyncerSnapshot:
        """A consistent copy of everything a restart needs (Snapshots.take)."""
        return await self.snapshots.take()

    def restore(self, snapshot: state_lib.SyncerSnapshot) -> None:
        """Loads a snapshot: as `snapshot` returns it, or as checkpointing.load_snapshot reads it back
        (Snapshots.restore); this life then counts as restored from that checkpoint."""
        self.snapshots.restore(snapshot)
        for slot in self.owned_slots:  # restored from a committed checkpoint
            slot.committed_version = slot.version
        self.restored_from_checkpoint = True
        self.last_checkpoint_outer_step = self.outer_steps
        self.influence.restored_step = self.outer_steps  # the ledger's records name the lineage they follow
