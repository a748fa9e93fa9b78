"""Merge rounds: when each fragment's round opens and merges, and the merge itself.

Owns `Rounds`: the open merge round of every fragment (early contributions gather until the
schedule, ddiloco.algo.rounds, or the first contribution opens it), folding admitted
contributions in (re-anchored, ddiloco.algo.reanchor), the merge decision (quorum plus the adaptive
grace window, ddiloco.algo.grace: its measurements, the decision, the timers), and the merge: the
outer step in a worker thread under the fragment's lock, the new version, the contributors'
receipt marks and the merge log; and the plain records of its rounds (`Contribution`,
`MergeRecord`, `RoundCall`), whose messages services/syncer/wire_views.py builds.
Must not: admit or refuse contributions (services/syncer/admission.py) or encode (it asks the
publisher). It re-evaluates rounds through the core's `tick` hook, so that the core stays the one
entry point.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import grace as grace_lib
from ddiloco.algo import merge as merge_lib
from ddiloco.algo import outer as outer_lib
from ddiloco.algo import reanchor as reanchor_lib
from ddiloco.algo import rounds as rounds_lib
from ddiloco.rpc import errors
from . import influence as influence_lib
from . import membership as membership_lib
from . import publishing as publishing_lib
from . import slots as slots_lib
from . import state as state_lib

_LOG = logging.getLogger("ddiloco.syncer")
# The least time without a step of any expected learner that counts as a stalled schedule: several
# of the learners' progress intervals (0.25 s by default), so a report in flight never counts.
_MIN_STALL_S = 2.0


@dataclasses.dataclass(frozen=True)
class RoundSettings:
    """What the rounds read of the run's configuration (wire_views.round_settings takes it from
    the RunConfig learners adopt)."""

    merge_rule: str
    embedding_merge_rule: str
    overlap_steps: int  # tau: the grace window's overlap
    min_quorum: int  # K
    max_staleness_versions: int


@dataclasses.dataclass
class Contribution:
    """One folded-in contribution of a round, as its merge's record lists it (wire_views.contribution
    builds the wire form). `weight` is lowered to what the share cap left it, at the merge."""

    learner_id: str
    incarnation: int
    base_version: int
    steps: int
    tokens: int
    weight: float
    local_step: int


@dataclasses.dataclass(frozen=True)
class MergeRecord:
    """One merge, as the training state's recent merges show it (wire_views.merge_record)."""

    fragment_id: int
    version: int
    merged_at_unix_s: float
    contributors: tuple[Contribution, ...]
    quorum_wait_s: float
    grace_window_s: float
    grace_used_s: float
    reason: str
    outer_grad_norm: float
    expected_contributors: int
    round: int


class RoundCall(NamedTuple):
    """The call a watch stream sends a learner for a fragment's open round (wire_views.round_call)."""

    fragment_id: int
    round: int
    version: int


class Rounds:
    """Every fragment's merge round and the outer step. See the module docstring."""

    def __init__(self, *, settings: RoundSettings, plan: fragments_lib.FragmentPlan,
                 slots: list[slots_lib.FragmentSlot], steppers: list[outer_lib.OuterStepper], scheduled: bool,
                 outer_step_fraction: str, merge_history: int, grace_gamma: float, max_grace_s: float,
                 uploads: collections.Counter, clock: Callable[[], float], wall_clock: Callable[[], float],
                 membership: membership_lib.Membership, publisher: publishing_lib.Publisher,
                 tick: Callable[[], None], notify: Callable[[], None], emit: Callable[..., None],
                 failpoint: Callable[[str], None], merged: Callable[[], None],
                 owned: frozenset[int] | None = None) -> None:
        """`uploads` is the core's upload counter (dropped rounds are counted there); `tick`
        re-evaluates every round (the core's, so that an override there applies);
        `merged` runs after each merge (the checkpointer's hook); `failpoint` is the core's."""
        self.settings = settings
        self.influence = None  # services.syncer.influence.Influence, set by the core (who influenced each merge)
        # The outer optimizer's hyperparameters for the ledger (None: not Nesterov SGD; set by the core).
        self.outer: dict | None = None
        self.plan = plan
        self.slots = slots
        # Fragment shards: the fragments whose rounds this syncer opens (None: every one).
        self._owned = owned
        self.scheduled = scheduled
        self.schedule = rounds_lib.RoundSchedule(plan)
        self.merges: collections.deque = collections.deque(maxlen=merge_history)
        self.outer_steps = 0
        self.tokens_merged = 0
        self.quorum_time = grace_lib.Ema()
        self.sync_time = grace_lib.Ema()
        self.max_grace_s = max_grace_s
        self._steppers = steppers
        self._uploads = uploads
        self._outer_step_fraction = outer_step_fraction
        self._grace_gamma = grace_gamma
        self._clock = clock
        self._wall = wall_clock
        self._membership = membership
        self._publisher = publisher
        self._tick = tick
        self._notify = notify
        self._emit = emit
        self._failpoint = failpoint
        self._merged = merged

    def grace_window_s(self, step_time_s: float) -> float:
        window = grace_lib.grace_window_s(
            step_time_s=step_time_s,
            quorum_time_s=self.quorum_time.value or 0.0,
            sync_time_s=self.sync_time.value or 0.0,
            tau_steps=self.settings.overlap_steps,
            gamma=self._grace_gamma,
        )
        return min(window, self.max_grace_s)

    # ------------------------------------------------------------------------- gathering

    def round_for(self, slot: slots_lib.FragmentSlot) -> slots_lib.Round:
        """The slot's round gathering contributions, started if there is none."""
        return slot.round if slot.round is not None else self._new_round(slot)

    def _new_round(self, slot: slots_lib.FragmentSlot) -> slots_lib.Round:
        """Starts gathering contributions for the slot's next merge. With the schedule, the round
        opens (calls its learners, may merge) only when the schedule says; until then early
        contributions (a learner's final work, an answer that came after its round closed) wait."""
        policy = slot.norms.policy  # bounded influence: the share cap goes with the norm bound
        # Every input the merge's result depends on goes to the ledger (replay passes them back).
        inputs = {"rule": self.settings.merge_rule, "embedding_rule": self.settings.embedding_merge_rule,
                  "max_share": policy.max_share if policy.enabled else 1.0,
                  "max_norm_ratio": policy.clip_factor if policy.enabled else 0.0,
                  "unverified_norm_ratio": policy.unverified_clip_factor if policy.enabled else 0.0,
                  "share_cap_min_count": policy.share_min_contributors, "step_scaling": policy.step_scaling}
        slot.round = slots_lib.Round(
            accumulator=merge_lib.MergeAccumulator(slot.fragment, **inputs),
            opened_at_s=self._clock(),
            merge_inputs={**inputs, "outer": self.outer, "download": self._publisher.settings()},
        )
        if not self.scheduled:
            self._open_round(slot, "upload")
        return slot.round

    async def contribution_sha256(self, values: np.ndarray) -> str:
        """The hash of a decoded contribution the ledger names ("" without a ledger); a worker
        thread, before the fragment's lock is taken."""
        if self.influence is None or not self.influence.audit_mode:
            return ""
        return await asyncio.to_thread(fragments_lib.fragment_sha256, values)

    async def fold(self, slot: slots_lib.FragmentSlot, rnd: slots_lib.Round, fragment_id: int, delta: np.ndarray,
                   norms: np.ndarray, weight: float, base: np.ndarray, learner_id: str = "", steps: int = 1,
                   decoded: np.ndarray | None = None, contribution_sha256: str = "",
                   claims_unverified: bool = False) -> None:
        """Adds a contribution to the round in a worker thread, re-anchored at the current global
        fragment (paper App. D.2); learners hold the published values, so the correction is in
        that space. Call under the slot's lock. With a ledger, the fold-in's inputs are recorded
        in the order of the adds (`decoded`: the contribution as decoded, before clipping, whose
        hash is `contribution_sha256`). `claims_unverified`: admission clipped its claimed steps or
        batch or its norm, or could not check the batch (the share cap applies to it in any merge,
        and the merge's tighter norm clip, MergeAccumulator unverified_norm_ratio)."""
        audit = self.influence.audit_mode if self.influence is not None else ""

        def fold() -> None:
            corrected = reanchor_lib.reanchor(delta, base, slot.published)
            # Not stale: the norms gathered while decoding are this delta's, no second pass over it.
            folded_norms = norms if corrected is delta else None
            rnd.accumulator.add(corrected, weight, norms=folded_norms, key=learner_id, steps=steps,
                                claims_unverified=claims_unverified)
            if audit:  # after add: a refused contribution leaves no trace in the order
                rnd.folds.append(influence_lib.fold_record(
                    learner_id, weight, folded_norms, steps, contribution_sha256 or fragments_lib.fragment_sha256(delta),
                    delta if decoded is None else decoded, corrected, retain=audit == "retain",
                    claims_unverified=claims_unverified))

        try:
            await asyncio.to_thread(fold)
        except ValueError as exc:
            raise errors.InvalidArgument(f"fragment {fragment_id}: {exc}", reason="nonfinite") from None

    def add(self, rnd: slots_lib.Round, header, weight: float) -> None:
        """Records a folded-in contribution in its round (`header`: admission.UploadHeader)."""
        rnd.learners.add(header.learner_id)
        rnd.contributions.append(
            Contribution(
                learner_id=header.learner_id,
                incarnation=header.incarnation,
                base_version=header.base_version,
                steps=header.steps,
                tokens=header.tokens,
                weight=float(weight),
                local_step=header.local_step,
            )
        )

    def note_quorum(self, rnd: slots_lib.Round) -> None:
        """Marks when an open round first holds K contributions; ξ_quorum is measured from the
        round's opening (the syncer's call), as the paper means it."""
        if rnd.open and rnd.quorum_reached_at_s is None and len(rnd.contributions) >= self.settings.min_quorum:
            rnd.quorum_reached_at_s = self._clock()
            self.quorum_time.update(rnd.quorum_reached_at_s - rnd.opened_at_s)

    # --------------------------------------------------------------------------- opening

    def _open_round(self, slot: slots_lib.FragmentSlot, why: str) -> None:
        rnd = self.round_for(slot)
        if rnd.open:
            return
        rnd.open = True
        rnd.opened_at_s = self._clock()
        slot.rounds_opened += 1
        rnd.number = slot.rounds_opened
        self.note_quorum(rnd)
        _LOG.debug("round opened", extra={"fields": {"fragment": slot.fragment.fragment_id, "round": rnd.number,
                                                     "why": why, "early": len(rnd.contributions)}})
        self._notify()  # watch streams call every learner

    def open_if_nobody_trains(self) -> bool:
        """Opens every round holding contributions once no learner is training any more (all have
        finished, left or gone silent): nobody advances the schedule, and the last work must merge.
        While some learner trains, finished learners' last contributions join the fragments' next
        scheduled rounds: merging each learner's tail in a round of its own added a full outer step,
        momentum included, per learner and fragment at the end (16 extra merges of 4 learners).
        Those rounds open too once the schedule has stalled (_stall_s): the learners still expected
        have not stepped for a while (killed but not yet past the liveness timeout, stopped, or a
        client that only watches), and the finished learners waited for them until the timeout."""
        if not self.scheduled:
            return False
        nobody = not self._membership.expected_learners()
        stalled = nobody or self._membership.schedule_stalled(self._stall_s())
        opened = False
        for slot in self.slots:
            rnd = slot.round
            if rnd is None or not rnd.contributions or rnd.open or not stalled:
                continue
            if nobody or any(self._is_finished(lid) for lid in rnd.learners):
                self._open_round(slot, "last")
                opened = True
        return opened

    def _stall_s(self) -> float:
        """How long without any expected learner's step means the schedule stalled: twice a period
        of H steps at the learners' pace (a scheduled round is at most H global steps away), and
        never less than _MIN_STALL_S."""
        return max(_MIN_STALL_S, 2.0 * self.plan.sync_period_steps * self._membership.step_time_s())

    def _is_finished(self, learner_id: str) -> bool:
        member = self._membership.members.get(learner_id)
        return member is not None and member.finished

    def open_due(self) -> list[int]:
        """Opens the rounds the schedule says are due; returns their fragment ids."""
        if not self.scheduled:
            return []
        due = self.schedule.due(lambda fid: self.slots[fid].round is not None and self.slots[fid].round.open)
        if self._owned is not None:  # another shard opens (and calls learners to) the others' rounds
            due = [fid for fid in due if fid in self._owned]
        for fid in due:
            self._open_round(self.slots[fid], "schedule")
        if due:
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # no loop (unit tests of pure parts)
                return due
            self._tick()
        return due

    def round_call(self, fragment_id: int, learner_id: str) -> RoundCall | None:
        """The call to send this learner for the fragment's open round, if it has not contributed."""
        slot = self.slots[fragment_id]
        rnd = slot.round
        if rnd is None or not rnd.open or learner_id in rnd.learners:
            return None
        return RoundCall(fragment_id=fragment_id, round=rnd.number, version=slot.version)

    def broadcast_sent(self, learner_id: str, fragment_id: int, version: int) -> None:
        """A watch stream sent `version` to a learner: once every learner the merge was broadcast
        to has it, the merge's sync time (merge + publish + broadcast) is measured."""
        pending = self.slots[fragment_id].broadcast
        if pending is None or version < pending[0]:
            return
        pending[2].discard(learner_id)
        if not pending[2]:
            self.sync_time.update(self._clock() - pending[1])
            self.slots[fragment_id].broadcast = None

    # ------------------------------------------------------------------- deciding, timers

    def decide(self, grace_s: float) -> None:
        """Merges the open rounds that are due at the current time; arms timers for the others."""
        now = self._clock()
        expected = self._membership.expected_learners()
        for slot in self.slots:
            rnd = slot.round
            if rnd is None or not rnd.open or slot.merging or slot.lock.locked():
                continue
            # A learner asked to hold its uploads of this fragment (back-pressure) answers no call
            # meanwhile: waiting the grace window for it only delayed everyone else's work (issue 20).
            waited_for = expected - self._membership.holding(slot.fragment.fragment_id)
            decision = grace_lib.decide_merge(
                now,
                grace_lib.RoundView(
                    opened_at_s=rnd.opened_at_s,
                    contributors=len(rnd.learners),
                    quorum_reached_at_s=rnd.quorum_reached_at_s,
                    expected_contributors=max(len(waited_for | rnd.learners), 1),
                    quorum_reachable=self._membership.quorum_reachable(self.settings.min_quorum, rnd.learners),
                ),
                min_quorum=self.settings.min_quorum,
                grace_s=grace_s,
            )
            if decision.merge:
                slot.merging = True
                asyncio.get_running_loop().create_task(self._merge(slot, decision.reason, grace_s))
            elif decision.wake_at_s is not None:
                self._arm_timer(slot, decision.wake_at_s - now)

    def _arm_timer(self, slot: slots_lib.FragmentSlot, delay_s: float) -> None:
        if slot.timer is not None:
            slot.timer.cancel()
        slot.timer = asyncio.get_running_loop().call_later(max(delay_s, 0.0) + 1e-3, self._tick)

    # ---------------------------------------------------------------------------- merging

    async def _merge(self, slot: slots_lib.FragmentSlot, reason: str, grace_s: float) -> None:
        try:
            await self._merge_locked(slot, reason, grace_s)
        finally:
            slot.merging = False
        self._notify()
        self._merged()
        if not self.open_due():  # a round the schedule held back while this one was open
            self._tick()  # contributions that arrived during the merge may already form a round

    def _merge_share(self, rnd: slots_lib.Round) -> outer_lib.MergeShare:
        """The outer step's fraction and the merged delta's scale (config outer_step_fraction,
        ddiloco.algo.outer.merge_share): the share of a round's work the merge holds, in inner
        steps over H and, with "work", in learners over those the round expected."""
        expected = self._membership.expected_learners() | rnd.learners
        return outer_lib.merge_share(
            self._outer_step_fraction, [(c.tokens, c.steps) for c in rnd.contributions],
            contributors=len(rnd.learners), expected_contributors=len(expected),
            sync_period_steps=self.plan.sync_period_steps)

    async def _merge_locked(self, slot: slots_lib.FragmentSlot, reason: str, grace_s: float) -> None:
        async with slot.lock:
            rnd = slot.round
            if rnd is None:  # merged by a concurrent task
                return
            self._failpoint("syncer.after_quorum")  # quorum reached, outer step not yet applied
            started = self._clock()
            slot.cancel_timer()
            stepped = await self._outer_step(slot, rnd)
            if not stepped.finite:
                # Never publish a non-finite global fragment; drop the round instead.
                _LOG.error("outer step produced non-finite values; round dropped",
                           extra={"fields": {"fragment": slot.fragment.fragment_id}})
                slot.round = None
                self._uploads["dropped_nonfinite_round"] += 1
                return
            published = await self._publisher.next_published(slot, stepped.params)
            slot.advance(stepped.params, stepped.state, published, self.settings.max_staleness_versions + 1)
            self.outer_steps += 1
            self.tokens_merged += sum(c.tokens for c in rnd.contributions)
            self._credit_contributors(slot.fragment.fragment_id, slot.version, rnd)
            expected = self._membership.expected_learners()
            slot.broadcast = (slot.version, started, set(expected))
            self._note_capped_share(rnd)
            record = self._merge_record(slot, rnd, reason, grace_s, started, expected, stepped.outer_grad_norm)
            self.merges.append(record)
            if self.influence is not None:
                direction = await asyncio.to_thread(self.influence.merged_direction, slot.fragment.fragment_id,
                                                    slot.last_outer_grad[0])
                state_sha256 = (await asyncio.to_thread(fragments_lib.state_sha256, slot.opt_state)
                                if self.influence.audit_mode else "")
                self.influence.merged(rnd, record, direction, slot.published_sha256, slot.params_sha256,
                                      outer_step=self.outer_steps, outer_state_sha256=state_sha256)
            await self._publisher.encoded_payload(slot)
            if self.sync_time.value is None or not expected:
                # Until a broadcast has been measured (broadcast_sent), merge and publish time.
                self.sync_time.update(self._clock() - started)
            # This merge's record: after the await above, merges[-1] may be another fragment's.
            self._emit("merged", record)
            _LOG.info(
                "merged",
                extra={"fields": {"fragment": slot.fragment.fragment_id, "version": slot.version,
                                  "contributors": len(rnd.contributions), "reason": reason}},
            )

    async def _outer_step(self, slot: slots_lib.FragmentSlot, rnd: slots_lib.Round) -> outer_lib.OuterStepResult:
        """The round's merged outer gradient, stepped on from the slot's values in a worker thread;
        the gradient (factored) becomes the direction agreement's reference."""
        stepper = self._steppers[slot.fragment.fragment_id]
        # The delta stays factored (sums x per-tensor scales) until the step writes it out.
        share = self._merge_share(rnd)
        merged = outer_lib.scale_delta(await asyncio.to_thread(rnd.accumulator.scaled_result), share.delta_scale)
        if rnd.merge_inputs is not None:
            rnd.merge_inputs.update(fraction=share.fraction, delta_scale=share.delta_scale)
        # Δ is kept factored (the round's sums are not written again): one stream less.
        stepped = await asyncio.to_thread(functools.partial(
            stepper.step_scaled, slot.params, slot.opt_state, *merged, write_grad=False, fraction=share.fraction))
        slot.last_outer_grad = (merged, stepped.outer_grad_norm)
        return stepped

    @staticmethod
    def _note_capped_share(rnd: slots_lib.Round) -> None:
        """The merge's record shows the weight the share cap left a contribution (MergeAccumulator.capped)."""
        capped = rnd.accumulator.capped
        if capped is None:
            return
        for c in rnd.contributions:
            if c.learner_id == capped[0]:
                c.weight = float(capped[2])

    def _credit_contributors(self, fragment_id: int, version: int, rnd: slots_lib.Round) -> None:
        """What each contributor's MergeReceipt will say (only the life that sent it is credited)."""
        for c in rnd.contributions:
            member = self._membership.members.get(c.learner_id)
            if member is not None and member.incarnation == c.incarnation:
                member.record_merged(fragment_id, version, c.local_step, c.tokens)

    def _merge_record(self, slot: slots_lib.FragmentSlot, rnd: slots_lib.Round, reason: str, grace_s: float,
                      started: float, expected: set[str], outer_grad_norm: float) -> MergeRecord:
        quorum_at = rnd.quorum_reached_at_s if rnd.quorum_reached_at_s is not None else started
        return MergeRecord(
            fragment_id=slot.fragment.fragment_id,
            version=slot.version,
            merged_at_unix_s=float(self._wall()),
            # Copies, as the message's repeated field took: the record never changes after the merge.
            contributors=tuple(dataclasses.replace(c) for c in rnd.contributions),
            quorum_wait_s=float(quorum_at - rnd.opened_at_s),
            grace_window_s=float(grace_s),
            grace_used_s=float(max(0.0, started - quorum_at)),
            reason=reason,
            outer_grad_norm=float(outer_grad_norm),
            expected_contributors=len(expected | rnd.learners),
            round=rnd.number,
        )

    # ---------------------------------------------------------------------- restart, shutdown

    def restore(self, snapshot: state_lib.SyncerSnapshot) -> None:
        """Takes up the counters, the grace window's measurements and the schedule's position of
        a snapshot (the slots themselves are restored by the core)."""
        self.outer_steps = snapshot.outer_steps
        self.tokens_merged = snapshot.tokens_merged
        if snapshot.quorum_time_s is not None:
            self.quorum_time.update(snapshot.quorum_time_s)
        if snapshot.sync_time_s is not None:
            self.sync_time.update(snapshot.sync_time_s)
        self.schedule = rounds_lib.RoundSchedule(self.plan, global_step=snapshot.global_step)
        for slot, opened in zip(self.slots, snapshot.rounds_opened, strict=False):
            slot.rounds_opened = opened

    def cancel_timers(self) -> None:
        """Cancels every round's grace timer (shutdown: nothing merges after the last checkpoint)."""
        for slot in self.slots:
            slot.cancel_timer()

    @property
    def merging(self) -> bool:
        """Whether a merge is scheduled or running on some fragment."""
        return any(slot.merging for slot in self.slots)

    def pending_contributions(self) -> list[tuple[int, Contribution]]:
        """(fragment id, contribution) of every round not merged yet."""
        return [(s.fragment.fragment_id, c) for s in self.slots if s.round is not None for c in s.round.contributions]
