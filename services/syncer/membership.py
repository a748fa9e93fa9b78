"""Who takes part in the run: learner lives, fencing, liveness, data shards and the security record.

Owns `Member` (one learner's current life plus what is kept across its lives), the
MemberState.flags bits, the reasons that count as strikes, and `Membership`: join (incarnation
fencing, data-shard placement), progress, leave, liveness (who a round waits for), traffic and
token accounting, refusal counting, strikes and quarantine.
Must not: touch fragments, rounds or payloads, or protobuf messages (the requests arrive as `JoinArgs`
/ `Progress`, converted in services/syncer/wire_views.py). It tells the core what changed through the
callbacks it is given (`on_change`, `on_quarantine`, `emit`), all called on the core's loop.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
from collections.abc import Callable
from typing import NamedTuple

from ddiloco.rpc import errors
from ddiloco.wire import serde

_LOG = logging.getLogger("ddiloco.syncer")

MAX_ID_CHARS = 128
# Idempotency records kept per learner: enough to recognise retries of recent uploads.
IDEMPOTENCY_KEYS_PER_LEARNER = 64
RECEIPT_HISTORY = 16  # (version, mark) entries kept per learner and fragment for MergeReceipts
# Struck contributions remembered per learner ((fragment, base version, payload checksum)): a resend
# of the same refused work counts one strike, not one per send (a learner's barrier resends it).
STRUCK_WORK_PER_LEARNER = 64

# MemberState.flags bits (syncer.proto): suspicious events seen from a learner, never cleared.
FLAG_REPLAY_MISMATCH = 1 << 0  # same idempotency key with another payload (ALREADY_EXISTS)
FLAG_MALFORMED = 1 << 1  # sizes, checksum, corrupt frame, non-finite values or a message that does not parse
FLAG_NORM_BOUND = 1 << 2  # a contribution beyond the norm bound (rejected or clipped)
FLAG_IMPERSONATION = 1 << 3  # tried to act as another learner
FLAG_QUARANTINED = 1 << 4  # quarantined at least once
FLAG_DIRECTION = 1 << 5  # a contribution pointing away from the other learners' (direction check)
FLAG_BY_REASON = {
    "replay_mismatch": FLAG_REPLAY_MISMATCH,
    "size": FLAG_MALFORMED, "checksum": FLAG_MALFORMED, "corrupt": FLAG_MALFORMED, "nonfinite": FLAG_MALFORMED,
    "codec": FLAG_MALFORMED, "chunks": FLAG_MALFORMED, "malformed": FLAG_MALFORMED,
    "norm_bound": FLAG_NORM_BOUND, "clipped_norm_bound": FLAG_NORM_BOUND,
    "norm_bound_marginal": FLAG_NORM_BOUND, "clipped_norm_bound_marginal": FLAG_NORM_BOUND,
    "wrong_learner": FLAG_IMPERSONATION,
    "direction": FLAG_DIRECTION,
}
# Reasons that count towards quarantine: things an honest learner never sends. Network trouble,
# staleness, fencing and busy refusals do not count, nor do "marginal" norm-bound violations (less
# than admission.NORM_STRIKE_RATIO times the bound), which honest learners with unusual data can produce.
STRIKE_REASONS = frozenset({"replay_mismatch", "size", "checksum", "corrupt", "nonfinite", "malformed", "norm_bound",
                            "clipped_norm_bound", "wrong_learner", "direction"})


def check_protocol(version: int) -> None:
    """FAILED_PRECONDITION unless a request speaks this syncer's protocol version."""
    if version != serde.PROTOCOL_VERSION:
        raise errors.FailedPrecondition(
            f"protocol_version {version} is not supported; this syncer speaks "
            f"[{serde.PROTOCOL_VERSION}]",
            reason="protocol_version",
        )


@dataclasses.dataclass
class Member:
    learner_id: str
    incarnation: int
    region: str
    tokens_per_step: int
    last_seen_s: float  # clock()
    last_seen_unix_s: float
    left: bool = False
    local_step: int = 0
    tokens_total: int = 0
    step_time_s: float = 0.0
    inner_loss: float = 0.0
    uploads_accepted: int = 0
    uploads_rejected: int = 0
    joins: int = 1
    bytes_in: int = 0
    bytes_out: int = 0
    # (fragment_id, base_version, local_step) -> payload checksum of accepted uploads, oldest first.
    accepted_keys: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)
    # Security record, kept across incarnations (see Membership.record_rejection).
    flags: int = 0
    rejections: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    strikes: collections.deque = dataclasses.field(default_factory=collections.deque)  # clock() of each
    # The work of the strikes (Membership.flag's `work`), oldest first, bounded: struck once each.
    struck_work: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)
    quarantined_until_s: float = -math.inf  # clock()
    quarantined_until_unix_s: float = 0.0
    # Mean of cos(contribution, the fragment's last merged outer gradient) over the learner's
    # accepted contributions: honest learners agree with the merged direction on average; a
    # sign-flipping learner does not (observability only).
    direction_sum: float = 0.0
    direction_count: int = 0
    # Finished its steps (ReportProgressRequest.finished): flushing its last work, not waited for.
    finished: bool = False
    # clock() of this life's join or of its last report with a higher local step (schedule_stalled).
    progressed_at_s: float = -math.inf
    tokens_prev_lives: int = 0  # tokens processed by this learner's earlier incarnations
    # fragment -> clock() until which a back-pressure hint asked this life to hold its next upload.
    holds_until_s: dict = dataclasses.field(default_factory=dict)
    # Inner steps of its earlier incarnations (each one's last reported local_step): a new life
    # continues its LR schedule from there (JoinResponse.schedule_start_step).
    steps_prev_lives: int = 0
    # fragment -> (version, highest merged local_step mark of this life) per merge that held one.
    merged_marks: dict = dataclasses.field(default_factory=dict)
    # fragment -> tokens of this life's merged contributions. Each carries the progress since the
    # previous merged one, so each sum is a lower bound of the life's tokens processed, known before
    # the progress report that says so (reports lag uploads by up to one report interval).
    merged_tokens: dict = dataclasses.field(default_factory=dict)
    # The data shard this learner trains, of num_data_shards (0: not reported; see assign_data_shard).
    num_data_shards: int = 0
    data_shard: int = -1
    data_shard_assigned: bool = False  # chosen by this syncer, not pinned by the learner

    def tokens_this_life(self) -> int:
        """Tokens processed by this life: as reported, or more once merges hold more."""
        return max(self.tokens_total, max(self.merged_tokens.values(), default=0))

    def mark_at(self, fragment_id: int, version: int) -> int:
        """The highest mark of this life's contributions that `version` of the fragment holds."""
        best = 0
        for merged_version, mark in self.merged_marks.get(fragment_id, ()):
            if merged_version <= version:
                best = max(best, mark)
        return best

    def record_merged(self, fragment_id: int, version: int, mark: int, tokens: int) -> None:
        """`version` of the fragment holds this life's contribution up to local step `mark`."""
        marks = self.merged_marks.setdefault(fragment_id, collections.deque(maxlen=RECEIPT_HISTORY))
        marks.append((version, mark))
        self.merged_tokens[fragment_id] = self.merged_tokens.get(fragment_id, 0) + tokens

    def remember_accepted(self, key: tuple[int, int, int], checksum: bytes) -> None:
        """Records an accepted upload's idempotency key (bounded: the oldest go first)."""
        self.accepted_keys[key] = checksum
        while len(self.accepted_keys) > IDEMPOTENCY_KEYS_PER_LEARNER:
            self.accepted_keys.popitem(last=False)

    def carry_record_from(self, previous: Member) -> None:
        """A new life does not wipe the security record, the direction agreement or the tokens."""
        self.flags, self.rejections, self.strikes = previous.flags, previous.rejections, previous.strikes
        self.struck_work = previous.struck_work
        self.quarantined_until_s = previous.quarantined_until_s
        self.quarantined_until_unix_s = previous.quarantined_until_unix_s
        self.direction_sum, self.direction_count = previous.direction_sum, previous.direction_count
        self.tokens_prev_lives = previous.tokens_prev_lives + previous.tokens_this_life()
        self.steps_prev_lives = previous.steps_prev_lives + previous.local_step


def member_status(m: Member, *, now_s: float, liveness_timeout_s: float) -> str:
    """"left", "active" (heard from within the liveness timeout) or "silent": MemberState.status
    by name (wire_views.member_state; the metrics count learners by it)."""
    if m.left:
        return "left"
    return "active" if now_s - m.last_seen_s <= liveness_timeout_s else "silent"


class JoinArgs(NamedTuple):
    """A JoinRequest's fields that membership reads."""

    learner_id: str
    incarnation: int
    region: str = ""
    protocol_version: int = 0
    model_fingerprint: str = ""
    tokens_per_step: int = 0
    num_data_shards: int = 0
    data_shard: int = 0
    assign_data_shard: bool = False


class Progress(NamedTuple):
    """A ReportProgressRequest's fields that membership reads."""

    learner_id: str
    incarnation: int
    protocol_version: int = 0
    local_step: int = 0
    tokens_total: int = 0
    step_time_s: float = 0.0
    inner_loss: float = 0.0
    finished: bool = False  # the learner's last report: it trains no more


class Membership:
    """The membership table and its policies (liveness, quarantine). See the module docstring."""

    def __init__(self, *, model_fingerprint: str, model_name: str, clock: Callable[[], float],
                 wall_clock: Callable[[], float], liveness_timeout_s: float, quarantine_after: int,
                 quarantine_window_s: float, quarantine_s: float, uploads: collections.Counter,
                 emit: Callable[..., None], on_change: Callable[[], None],
                 on_quarantine: Callable[[], None]) -> None:
        """`uploads` is the core's upload counter (refusals are counted there by reason);
        `on_quarantine` runs after a learner is quarantined, on a running loop only (rounds waiting
        for it may be due: SyncerCore.tick);
        `model_fingerprint` / `model_name`: the run's model, which joining learners must match."""
        self.members: dict[str, Member] = {}
        self.auth_failures: collections.Counter = collections.Counter()
        self.quarantines = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.uploads = uploads
        self.liveness_timeout_s = liveness_timeout_s
        self.quarantine_after = quarantine_after
        self._model_fingerprint = model_fingerprint
        self._model_name = model_name
        self._clock = clock
        self._wall = wall_clock
        self._quarantine_window_s = quarantine_window_s
        self._quarantine_s = quarantine_s
        self._emit = emit
        self._on_change = on_change
        self._on_quarantine = on_quarantine

    # ---------------------------------------------------------------------------------- lives

    def join(self, req: JoinArgs) -> tuple[Member, Member | None]:
        """Registers a learner; a higher incarnation replaces (fences off) the previous life.
        Returns the member and the life it replaced (None when there was none)."""
        self._check_join(req)
        now, wall = self._clock(), self._wall()
        member = self.members.get(req.learner_id)
        if member is not None and req.incarnation < member.incarnation:
            raise errors.FailedPrecondition(
                f"learner {req.learner_id!r} incarnation {req.incarnation} is older than the "
                f"registered {member.incarnation}: a newer life of this learner has joined",
                reason=errors.REASON_FENCED,
            )
        replaced = None
        if member is None or req.incarnation > member.incarnation:
            replaced, member = member, self._new_life(req, member, now, wall)
        else:  # same incarnation re-joining after a broken connection
            member.left = False
            member.last_seen_s, member.last_seen_unix_s = now, wall
            # As a new life's join: a learner back after a syncer restart is not a stalled one.
            member.progressed_at_s = max(member.progressed_at_s, now)
            self._place_on_data_shard(member, req, member)
        self._on_change()
        return member, replaced

    def _check_join(self, req: JoinArgs) -> None:
        check_protocol(req.protocol_version)
        if not req.learner_id or len(req.learner_id) > MAX_ID_CHARS or len(req.region) > MAX_ID_CHARS:
            raise errors.InvalidArgument(
                f"learner_id must be 1-{MAX_ID_CHARS} characters and region at most {MAX_ID_CHARS}",
                reason="learner_id",
            )
        if req.model_fingerprint and req.model_fingerprint != self._model_fingerprint:
            raise errors.FailedPrecondition(
                f"model fingerprint {req.model_fingerprint[:12]}... does not match the run's "
                f"{self._model_fingerprint[:12]}... (model {self._model_name})",
                reason="fingerprint",
            )

    def _new_life(self, req: JoinArgs, previous: Member | None, now: float, wall: float) -> Member:
        if previous is not None and math.isfinite(previous.last_seen_s):
            self._emit("rejoined", req.learner_id, now - previous.last_seen_s)
        member = Member(
            learner_id=req.learner_id,
            incarnation=req.incarnation,
            region=req.region,
            tokens_per_step=req.tokens_per_step,
            last_seen_s=now,
            last_seen_unix_s=wall,
            progressed_at_s=now,
            joins=previous.joins + 1 if previous else 1,
            bytes_in=previous.bytes_in if previous else 0,
            bytes_out=previous.bytes_out if previous else 0,
        )
        if previous is not None:
            member.carry_record_from(previous)
        self.members[req.learner_id] = member
        self._place_on_data_shard(member, req, previous)
        _LOG.info("learner joined", extra={"fields": {"learner": req.learner_id, "incarnation": req.incarnation,
                                                      "region": req.region, "data_shard": member.data_shard}})
        return member

    def _place_on_data_shard(self, member: Member, req: JoinArgs, previous: Member | None) -> None:
        """Records the joining learner's data shard, choosing it when the learner asks
        (JoinRequest.assign_data_shard). Learners that pick their own shard from a hashed id
        (`--learner-id auto`: a container id) collide: with 4 shards and 4 learners most runs put
        two on one shard. The syncer sees every member, so it hands out the lowest shard no live
        learner (not left, heard from within the liveness timeout) of the same shard count trains;
        a returning learner id gets its previous shard back unless another live learner took it
        meanwhile. With more learners than shards, the least-trained shard (lowest on ties)."""
        shards = req.num_data_shards
        if shards == 0:  # the learner reports nothing about its data (older learners)
            member.num_data_shards, member.data_shard, member.data_shard_assigned = 0, -1, False
            return
        if not req.assign_data_shard:
            member.num_data_shards, member.data_shard, member.data_shard_assigned = shards, req.data_shard % shards, False
            return
        now = self._clock()
        held = collections.Counter(
            m.data_shard for m in self.members.values()
            if m.learner_id != member.learner_id and m.num_data_shards == shards and m.data_shard >= 0
            and not m.left and now - m.last_seen_s <= self.liveness_timeout_s)
        if previous is not None and previous.num_data_shards == shards and previous.data_shard >= 0 \
                and not held[previous.data_shard]:
            shard = previous.data_shard
        else:
            shard = min(range(shards), key=lambda index: (held[index], index))
        member.num_data_shards, member.data_shard, member.data_shard_assigned = shards, shard, True

    def require_member(self, learner_id: str, incarnation: int) -> Member:
        """The registered member for this exact life, or FAILED_PRECONDITION."""
        member = self.members.get(learner_id)
        if member is None:
            raise errors.FailedPrecondition(
                f"learner {learner_id!r} has not joined (or the syncer restarted): call Join first",
                reason=errors.REASON_NOT_JOINED,
            )
        if incarnation != member.incarnation:
            raise errors.FailedPrecondition(
                f"learner {learner_id!r} incarnation {incarnation} is fenced off: the registered "
                f"incarnation is {member.incarnation}",
                reason=errors.REASON_FENCED,
            )
        return member

    def is_current(self, learner_id: str, incarnation: int) -> bool:
        member = self.members.get(learner_id)
        return member is not None and member.incarnation == incarnation and not member.left

    def seen(self, req: Progress) -> Member:
        """A progress report's first effect: the life is alive at this local step and token count."""
        check_protocol(req.protocol_version)
        member = self.require_member(req.learner_id, req.incarnation)
        member.last_seen_s, member.last_seen_unix_s = self._clock(), self._wall()
        member.left = False
        if req.local_step > member.local_step:
            member.progressed_at_s = member.last_seen_s
        member.local_step = req.local_step
        member.tokens_total = req.tokens_total
        return member

    def note_step_stats(self, member: Member, req: Progress, wire_bytes: int) -> None:
        """A progress report's measurements (ignored when not finite) and its size."""
        if math.isfinite(req.step_time_s) and req.step_time_s > 0:
            member.step_time_s = req.step_time_s
        if math.isfinite(req.inner_loss):
            member.inner_loss = req.inner_loss
        self.count_bytes(member, inbound=wire_bytes)

    def leave(self, *, learner_id: str, incarnation: int, protocol_version: int) -> Member:
        check_protocol(protocol_version)
        member = self.require_member(learner_id, incarnation)
        member.left = True
        _LOG.info("learner left", extra={"fields": {"learner": learner_id}})
        return member

    # ------------------------------------------------------------------------------ liveness

    def _live(self, m: Member, now: float) -> bool:
        return not m.left and now - m.last_seen_s <= self.liveness_timeout_s

    def expected_learners(self) -> set[str]:
        """Learners a round waits for: live (seen within the liveness timeout), not left, not
        quarantined, not finished."""
        now = self._clock()
        return {m.learner_id for m in self.members.values()
                if self._live(m, now) and not m.finished and now >= m.quarantined_until_s}

    def merged_through_step(self, learner_id: str, incarnation: int, fragment_id: int, version: int) -> int:
        """How far (local step) this learner life's work on the fragment is held by `version`: its
        MergeReceipt's mark (wire_views.merge_receipt); 0 when the version holds none of it."""
        member = self.members.get(learner_id)
        return member.mark_at(fragment_id, version) if member is not None and member.incarnation == incarnation else 0

    def note_hold(self, learner_id: str, incarnation: int, fragment_id: int, hold_s: float) -> None:
        """A back-pressure hint asked this learner life to hold its next upload of the fragment for
        `hold_s` (UploadFragmentResponse.next_upload_after_s): see `holding`."""
        member = self.members.get(learner_id)
        if member is not None and member.incarnation == incarnation:
            member.holds_until_s[fragment_id] = self._clock() + hold_s

    def holding(self, fragment_id: int) -> set[str]:
        """Learners the syncer asked to hold their next upload of the fragment until after now: its
        rounds do not wait for them (a held learner answers no call; its work goes in a later round)."""
        now = self._clock()
        return {lid for lid, m in self.members.items() if m.holds_until_s.get(fragment_id, -math.inf) > now}

    def schedule_stalled(self, stall_s: float) -> bool:
        """Whether no expected learner has advanced its local step for `stall_s` (True when none is
        expected): a killed learner not yet past the liveness timeout, a stopped one, or a client that
        only watches moves no schedule, so nobody will bring the next scheduled round soon."""
        now = self._clock()
        return all(now - self.members[lid].progressed_at_s > stall_s for lid in self.expected_learners())

    def quorum_reachable(self, min_quorum: int, contributors: set[str]) -> bool:
        """Whether `min_quorum` distinct learners could still be in a round that holds `contributors`.
        Every member counts unless it finished or left: a silent, stopped or quarantined one may
        come back, and so may a killed one (as a new life), so only learners that are done end a
        quorum. Before the run has seen `min_quorum` learners the rest may still be joining."""
        if len(self.members) < min_quorum:
            return True
        could = {lid for lid, m in self.members.items() if not m.finished and not m.left}
        return len(could | contributors) >= min_quorum

    def comparable_learners(self, learner_id: str) -> int:
        """Live, unquarantined learners other than `learner_id`: who could still send a reference."""
        now = self._clock()
        return sum(1 for lid, m in self.members.items()
                   if lid != learner_id and self._live(m, now) and now >= m.quarantined_until_s)

    def step_time_s(self) -> float:
        """Mean smoothed step time over live learners that reported one."""
        now = self._clock()
        times = [m.step_time_s for m in self.members.values() if self._live(m, now) and m.step_time_s > 0]
        return sum(times) / len(times) if times else 0.0

    def tokens_processed(self) -> int:
        """Tokens processed by every life of every learner known to this run."""
        return sum(m.tokens_prev_lives + m.tokens_this_life() for m in self.members.values())

    def count_bytes(self, member: Member | None, *, inbound: int = 0, outbound: int = 0, codec: str = "") -> None:
        self.bytes_in += inbound
        self.bytes_out += outbound
        if member is not None:
            member.bytes_in += inbound
            member.bytes_out += outbound
        if codec:  # a fragment transfer: observers count it by the codec it actually used
            self._emit("fragment_bytes", "in" if inbound else "out", codec, inbound or outbound)

    # ------------------------------------------------------------------------------ security

    def is_quarantined(self, member: Member) -> bool:
        return self._clock() < member.quarantined_until_s

    def record_rejection(self, reason: str, learner_id: str = "", exc: BaseException | None = None, *,
                         work: tuple | None = None) -> None:
        """Counts one refused upload (or impersonation attempt) by reason, on the learner too.

        Every refusal path ends here exactly once (`exc` is marked as recorded). Reasons in
        STRIKE_REASONS count towards quarantining the learner, once per `work` (see `flag`).
        """
        if exc is not None:
            if getattr(exc, "recorded", False):
                return
            exc.recorded = True
        self.uploads[f"rejected_{reason}"] += 1
        member = self.members.get(learner_id) if learner_id else None
        if member is None:
            return
        member.uploads_rejected += 1
        member.rejections[reason] += 1
        self.flag(member, reason, work=work)

    def record_auth_failure(self, reason: str, *, caller: str = "", method: str = "") -> None:
        """Counts a call refused as UNAUTHENTICATED or PERMISSION_DENIED; flags the calling learner
        (by its authenticated identity, never by the id it claimed)."""
        self.auth_failures[reason] += 1
        if method == "UploadFragment":
            self.uploads[f"rejected_{reason}"] += 1
        member = self.members.get(caller) if caller else None
        if member is not None:
            member.rejections[reason] += 1
            self.flag(member, reason)

    def flag(self, member: Member, reason: str, *, work: tuple | None = None) -> None:
        """Sets the reason's flag bit; a strike reason may quarantine the learner.

        `work` names the contribution (admission.work_key: fragment, base version, payload
        checksum): the same work sent again after its refusal (a retry, a barrier's resend) is the
        same evidence, so it strikes once, however often it comes (counted as a refusal each time)."""
        member.flags |= FLAG_BY_REASON.get(reason, 0)
        if reason not in STRIKE_REASONS or self.quarantine_after <= 0:
            return
        if work is not None:
            if work in member.struck_work:
                return
            member.struck_work[work] = None
            while len(member.struck_work) > STRUCK_WORK_PER_LEARNER:
                member.struck_work.popitem(last=False)
        now = self._clock()
        member.strikes.append(now)
        while member.strikes and now - member.strikes[0] > self._quarantine_window_s:
            member.strikes.popleft()
        if len(member.strikes) >= self.quarantine_after and not self.is_quarantined(member):
            self.quarantine(member, reason=f"{len(member.strikes)} suspicious uploads, last {reason}")

    def quarantine(self, member: Member, *, reason: str, duration_s: float | None = None) -> None:
        """Refuses the learner's uploads for `duration_s` (default quarantine_s; 0 or inf: until restart)."""
        duration_s = self._quarantine_s if duration_s is None else duration_s
        if duration_s <= 0:
            duration_s = math.inf
        member.quarantined_until_s = self._clock() + duration_s
        member.quarantined_until_unix_s = self._wall() + duration_s
        member.flags |= FLAG_QUARANTINED
        member.strikes.clear()
        self.quarantines += 1
        _LOG.warning("learner quarantined", extra={"fields": {"learner": member.learner_id, "reason": reason,
                                                              "seconds": duration_s}})
        self._on_change()
        # Rounds that were waiting for this learner may now be complete, as on leave: left to their
        # grace timer, they held every other learner's next upload of the fragment (already
        # pending) for the whole window; a short run ended with one merge per fragment.
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop (unit tests of pure parts)
            return
        self._on_quarantine()
