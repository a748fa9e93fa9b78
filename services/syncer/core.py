"""SyncerCore: the syncer's state and merge policy, with no gRPC.

Owns the global parameters (one flat float32 vector per fragment), the outer optimizer state,
fragment versions with a short history for correcting stale contributions, the membership table
with incarnation fencing, the open merge round of every fragment (a streaming accumulator, so
memory does not grow with the number of learners), the adaptive grace window and the merge log.

Concurrency: everything runs on one asyncio loop. Heavy numpy work (decode, fold-in, outer
step, encode) runs in worker threads while the fragment's asyncio.Lock is held, so one fragment
never sees two mutations at once and the loop stays responsive.

Clocks are injected: `clock` (monotonic seconds) drives every timing decision, `wall_clock`
(unix seconds) only stamps records for humans. Tests advance a fake clock and call `tick()`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import logging
import math
import uuid
from collections.abc import Callable, Mapping

import numpy as np

from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import grace as grace_lib
from ddiloco.algo import merge as merge_lib
from ddiloco.algo import outer as outer_lib
from ddiloco.algo import robust as robust_lib
from ddiloco.algo import rounds as rounds_lib
from ddiloco.rpc import errors
from ddiloco.v1 import syncer_pb2
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde

_LOG = logging.getLogger("ddiloco.syncer")

# Idempotency records kept per learner: enough to recognise retries of recent uploads.
_IDEMPOTENCY_KEYS_PER_LEARNER = 64
_JUDGE_POLL_S = 0.02  # how often a contribution waiting for direction references looks again
_EVAL_HISTORY = 512
_RECEIPT_HISTORY = 16  # (version, mark) entries kept per learner and fragment for MergeReceipts
ROUND_TRIGGERS = ("schedule", "upload")
_MAX_ID_CHARS = 128

# MemberState.flags bits (syncer.proto): suspicious events seen from a learner, never cleared.
FLAG_REPLAY_MISMATCH = 1 << 0  # same idempotency key with another payload (ALREADY_EXISTS)
FLAG_MALFORMED = 1 << 1  # sizes, checksum, corrupt frame, non-finite values or a message that does not parse
FLAG_NORM_BOUND = 1 << 2  # a contribution beyond the norm bound (rejected or clipped)
FLAG_IMPERSONATION = 1 << 3  # tried to act as another learner
FLAG_QUARANTINED = 1 << 4  # quarantined at least once
FLAG_DIRECTION = 1 << 5  # a contribution pointing away from the other learners' (direction check)
_FLAG_BY_REASON = {
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
# than NORM_STRIKE_RATIO times the bound), which honest learners with unusual data can produce.
STRIKE_REASONS = frozenset({"replay_mismatch", "size", "checksum", "corrupt", "nonfinite", "malformed", "norm_bound",
                            "clipped_norm_bound", "wrong_learner", "direction"})
NORM_STRIKE_RATIO = 2.0
BOOTSTRAP_STRIKE_RATIO = 10.0  # the same, against the bootstrap bound (no other learners' reference yet)


params_sha256 = serde.params_sha256  # kept here too: tests and tools compare with it


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
    # (fragment_id, base_version) -> payload checksum of accepted uploads, oldest first.
    accepted_keys: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)
    # Security record, kept across incarnations (see SyncerCore.record_rejection).
    flags: int = 0
    rejections: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    strikes: collections.deque = dataclasses.field(default_factory=collections.deque)  # clock() of each
    quarantined_until_s: float = -math.inf  # clock()
    quarantined_until_unix_s: float = 0.0
    # Mean of cos(contribution, the fragment's last merged outer gradient) over the learner's
    # accepted contributions: honest learners agree with the merged direction on average; a
    # sign-flipping learner does not (observability only).
    direction_sum: float = 0.0
    direction_count: int = 0
    # Finished its steps (ReportProgressRequest.finished): flushing its last work, not waited for.
    finished: bool = False
    tokens_prev_lives: int = 0  # tokens processed by this learner's earlier incarnations
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


@dataclasses.dataclass
class _Round:
    """The open merge round of one fragment: an accumulator plus small per-contribution records."""

    accumulator: merge_lib.MergeAccumulator
    opened_at_s: float
    quorum_reached_at_s: float | None = None
    contributions: list = dataclasses.field(default_factory=list)  # syncer_pb2.Contribution
    learners: set = dataclasses.field(default_factory=set)
    # Opened by the schedule (its learners were called); before that, early contributions only
    # gather. The round number is the slot's count of rounds opened.
    open: bool = False
    number: int = 0


@dataclasses.dataclass
class _Slot:
    fragment: fragments_lib.Fragment
    version: int
    params: np.ndarray
    opt_state: list
    history: collections.OrderedDict  # version -> published values (current included)
    params_sha256: str
    # What learners hold for the current version: `params` itself when downloads are lossless;
    # with a lossy download codec, the reconstruction learners compute from the deltas sent so
    # far (the quantization error is carried into the next delta, error feedback).
    published: np.ndarray | None = None
    published_sha256: str = ""
    # (version, encoding of published[version] - published[version - 1]) for lossy downloads.
    delta_encoded: tuple[int, codec_lib.EncodedPayload] | None = None
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    round: _Round | None = None
    encoded: codec_lib.EncodedPayload | None = None  # current published values, float32
    # (version, the encode in progress): watchers asking at once share one encode.
    encoding: tuple[int, asyncio.Future] | None = None
    timer: asyncio.TimerHandle | None = None
    merging: bool = False  # a merge task is scheduled or running
    norms: robust_lib.NormHistory | None = None  # recent accepted contributions (norm bound)
    # The last merged outer gradient in factored form (the round's sums x per-tensor scales, never
    # written out) and its norm: the cosine's reference for direction agreement.
    last_outer_grad: tuple[merge_lib.ScaledResult, float] | None = None
    # (params_sha256, norm of params): the norm bound's reference, computed once per version, not
    # once per upload (a float64 pass over the fragment under its lock).
    params_norm: tuple[str, float] | None = None
    rounds_opened: int = 0
    # The latest merge's broadcast: (version, merge start, learners it has not reached yet); sync
    # time (grace window input) is measured when the last of them was sent the version.
    broadcast: tuple[int, float, set] | None = None


@dataclasses.dataclass(frozen=True)
class UploadTicket:
    """What a validated upload header allows the servicer to read."""

    header: syncer_pb2.UploadHeader
    codec: str
    duplicate: bool  # already accepted: acknowledge without applying
    # The published values of the base version, pinned when the header was admitted: merges that
    # happen while the payload streams in and waits for the fragment's lock may drop that version
    # from the history, and the syncer's own queueing must not make an admitted contribution stale.
    base_params: np.ndarray | None = None


class SyncerCore:
    """The syncer's state machine. See the module docstring for the concurrency model."""

    def __init__(
        self,
        *,
        run_config: syncer_pb2.RunConfig,
        plan: fragments_lib.FragmentPlan,
        initial_params: Mapping[int, np.ndarray],
        outer_lr: float,
        outer_momentum: float,
        grace_gamma: float,
        max_grace_s: float,
        liveness_timeout_s: float,
        merge_history: int,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
        on_merge: Callable[[], None] | None = None,
        norm_bound: robust_lib.NormBoundPolicy | None = None,
        quarantine_after: int = 3,
        quarantine_window_s: float = 600.0,
        quarantine_s: float = 3600.0,
        direction: robust_lib.DirectionPolicy | None = None,
        stepper_factory: Callable[[fragments_lib.Fragment], outer_lib.OuterStepper] | None = None,
        max_decoding: int | None = None,
        round_trigger: str = "schedule",
        outer_step_fraction: str = "whole",
        token_budget: int = 0,
    ) -> None:
        """See SyncerConfig for the meaning of each knob. `quarantine_after` 0 disables quarantine;
        `quarantine_s` 0 quarantines until restart. `stepper_factory` gives each fragment its own
        outer optimizer (the data-parallel baseline's AdamW); by default every fragment shares
        Nesterov SGD with `outer_lr` and `outer_momentum`. `max_decoding`: contributions between
        decode and fold-in at once (default below). `round_trigger`: "schedule" (decoupled mode: rounds
        open on the syncer's schedule, ddiloco.algo.rounds) or "upload" (a round opens with its first
        contribution; the synchronous modes, whose learners upload together, always use it).
        `outer_step_fraction`: "whole" or "steps" (see _step_fraction). `token_budget`: the run
        ends once tokens_processed() reaches it (0: never; see budget_reached)."""
        if round_trigger not in ROUND_TRIGGERS:
            raise ValueError(f"round_trigger={round_trigger!r} is not one of {ROUND_TRIGGERS}")
        if outer_step_fraction not in ("whole", "steps"):
            raise ValueError(f"outer_step_fraction={outer_step_fraction!r} is not whole or steps")
        if token_budget < 0:
            raise ValueError(f"token_budget={token_budget} must be >= 0")
        self._outer_step_fraction = outer_step_fraction
        self.token_budget = token_budget
        self.config = run_config
        self.plan = plan
        self.instance = uuid.uuid4().hex
        self._clock = clock
        self._wall = wall_clock
        self._grace_gamma = grace_gamma
        self._max_grace_s = max_grace_s
        self._liveness_s = liveness_timeout_s
        self.on_merge = on_merge
        self.norm_bound = norm_bound or robust_lib.NormBoundPolicy()
        # Off unless given (the syncer service passes SyncerConfig.direction_policy, on by default).
        self.direction = direction or robust_lib.DirectionPolicy(mode="off")
        self.directions = robust_lib.DirectionGuard(self.direction, plan.fragments)
        # Contributions between decode and fold-in at once. Each holds its float32 values, norms
        # and direction sample (~1.5x the fragment in float32) while it waits for the fragment's
        # lock; uploads beyond the bound wait with only their compressed payload, so peak memory
        # does not grow with the number of learners uploading at once (decoding is CPU-bound: more
        # at once than cores buys nothing). Enough that, at the start of a run, some fragment
        # always gathers the min_others + 1 contributions that judge each other (direction check).
        self.max_decoding = max_decoding or len(plan.fragments) * (self.direction.min_others + 1)
        self._decoding = asyncio.Semaphore(self.max_decoding)
        # The second thread of each large decode (codec.decode's executor): an upload's decode
        # then uses two cores. One thread: a decode whose half finds it busy does that half itself.
        self._decode_helper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="syncer-decode")
        self._quarantine_after = quarantine_after
        self._quarantine_window_s = quarantine_window_s
        self._quarantine_s = quarantine_s
        # Passive observers (metrics): objects with optional methods merged(record),
        # upload_accepted(header), rejoined(learner_id, gap_s) and fragment_bytes(direction, codec,
        # wire_bytes). They must not mutate state.
        self.observers: list = []
        # Fault tests only: __main__ arms named crash points here (ddiloco.failpoints).
        self.failpoint: Callable[[str], None] = lambda name: None
        if stepper_factory is None:
            shared = outer_lib.OuterStepper(outer_lib.make_outer_optimizer(outer_lr, outer_momentum))
            self._steppers = [shared for _ in plan.fragments]
        else:
            self._steppers = [stepper_factory(frag) for frag in plan.fragments]
        self.download_codec = serde.codec_from_proto(run_config.download_codec)
        # A lossy download codec sends each new version as a delta (error-fed, see _Slot).
        self.delta_downloads = self.download_codec != "fp32"
        self.slots: list[_Slot] = []
        for frag in plan.fragments:
            params = np.asarray(initial_params[frag.fragment_id], dtype=np.float32).copy()
            digest = params_sha256(params)
            self.slots.append(
                _Slot(
                    fragment=frag,
                    version=0,
                    params=params,
                    opt_state=self._steppers[frag.fragment_id].init(params),
                    history=collections.OrderedDict({0: params}),
                    params_sha256=digest,
                    published=params,
                    published_sha256=digest,
                    norms=robust_lib.NormHistory(self.norm_bound, frag),
                )
            )
        self.members: dict[str, Member] = {}
        self.scheduled = round_trigger == "schedule" and run_config.sync_mode in ("", "decoupled")
        self.schedule = rounds_lib.RoundSchedule(plan)
        self.merges: collections.deque = collections.deque(maxlen=merge_history)
        self.evals: collections.deque = collections.deque(maxlen=_EVAL_HISTORY)
        self.outer_steps = 0
        self.tokens_merged = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.uploads: collections.Counter = collections.Counter()
        self.direction_judgments: collections.Counter = collections.Counter()  # see _await_direction_references
        self.auth_failures: collections.Counter = collections.Counter()
        self.quarantines = 0
        self.started_at_unix_s = wall_clock()
        self.restored_from_checkpoint = False
        self.last_checkpoint_outer_step = 0
        self.last_checkpoint_unix_s = 0.0
        self._quorum_time = grace_lib.Ema()
        self._sync_time = grace_lib.Ema()
        self._changed = asyncio.Condition()
        self._change_counter = 0

    # ----------------------------------------------------------------------------- membership

    def check_protocol(self, version: int) -> None:
        if version != serde.PROTOCOL_VERSION:
            raise errors.FailedPrecondition(
                f"protocol_version {version} is not supported; this syncer speaks "
                f"[{serde.PROTOCOL_VERSION}]",
                reason="protocol_version",
            )

    def join(self, req: syncer_pb2.JoinRequest) -> syncer_pb2.JoinResponse:
        """Registers a learner; a higher incarnation replaces (fences off) the previous life."""
        self.check_protocol(req.protocol_version)
        if not req.learner_id or len(req.learner_id) > _MAX_ID_CHARS or len(req.region) > _MAX_ID_CHARS:
            raise errors.InvalidArgument(
                f"learner_id must be 1-{_MAX_ID_CHARS} characters and region at most {_MAX_ID_CHARS}",
                reason="learner_id",
            )
        if req.model_fingerprint and req.model_fingerprint != self.config.model_fingerprint:
            raise errors.FailedPrecondition(
                f"model fingerprint {req.model_fingerprint[:12]}... does not match the run's "
                f"{self.config.model_fingerprint[:12]}... (model {self.config.model_name})",
                reason="fingerprint",
            )
        now, wall = self._clock(), self._wall()
        member = self.members.get(req.learner_id)
        if member is not None and req.incarnation < member.incarnation:
            raise errors.FailedPrecondition(
                f"learner {req.learner_id!r} incarnation {req.incarnation} is older than the "
                f"registered {member.incarnation}: a newer life of this learner has joined",
                reason="fenced",
            )
        if member is None or req.incarnation > member.incarnation:
            if member is not None and math.isfinite(member.last_seen_s):
                self._emit("rejoined", req.learner_id, now - member.last_seen_s)
            joins = member.joins + 1 if member else 1
            previous = member
            member = Member(
                learner_id=req.learner_id,
                incarnation=req.incarnation,
                region=req.region,
                tokens_per_step=req.tokens_per_step,
                last_seen_s=now,
                last_seen_unix_s=wall,
                joins=joins,
                bytes_in=member.bytes_in if member else 0,
                bytes_out=member.bytes_out if member else 0,
            )
            if previous is not None:  # a new life does not wipe the security record
                member.flags, member.rejections, member.strikes = previous.flags, previous.rejections, previous.strikes
                member.quarantined_until_s = previous.quarantined_until_s
                member.quarantined_until_unix_s = previous.quarantined_until_unix_s
                member.direction_sum, member.direction_count = previous.direction_sum, previous.direction_count
                member.tokens_prev_lives = previous.tokens_prev_lives + previous.tokens_this_life()
                self.schedule.forget((previous.learner_id, previous.incarnation))
            self.members[req.learner_id] = member
            self._place_on_data_shard(member, req, previous)
            _LOG.info("learner joined", extra={"fields": {"learner": req.learner_id, "incarnation": req.incarnation,
                                                          "region": req.region, "data_shard": member.data_shard}})
        else:  # same incarnation re-joining after a broken connection
            member.left = False
            member.last_seen_s, member.last_seen_unix_s = now, wall
            self._place_on_data_shard(member, req, member)
        self._notify()
        return syncer_pb2.JoinResponse(
            config=self.config,
            fragment_versions=serde.versions_to_proto(self.versions()),
            syncer_instance=self.instance,
            published_sha256={s.fragment.fragment_id: s.published_sha256 for s in self.slots},
            data_shard=max(member.data_shard, 0),
            data_shard_assigned=member.data_shard_assigned and req.assign_data_shard,
        )

    def _place_on_data_shard(self, member: Member, req: syncer_pb2.JoinRequest, previous: Member | None) -> None:
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
            and not m.left and now - m.last_seen_s <= self._liveness_s)
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
                reason="not_joined",
            )
        if incarnation != member.incarnation:
            raise errors.FailedPrecondition(
                f"learner {learner_id!r} incarnation {incarnation} is fenced off: the registered "
                f"incarnation is {member.incarnation}",
                reason="fenced",
            )
        return member

    def is_current(self, learner_id: str, incarnation: int) -> bool:
        member = self.members.get(learner_id)
        return member is not None and member.incarnation == incarnation and not member.left

    def report_progress(self, req: syncer_pb2.ReportProgressRequest, wire_bytes: int) -> syncer_pb2.ReportProgressResponse:
        self.check_protocol(req.protocol_version)
        member = self.require_member(req.learner_id, req.incarnation)
        member.last_seen_s, member.last_seen_unix_s = self._clock(), self._wall()
        member.left = False
        member.local_step = req.local_step
        member.tokens_total = req.tokens_total
        if req.finished and not member.finished:
            member.finished = True
            self.tick()  # rounds that waited for it may be complete (tick also opens the last rounds)
        elif req.finished and self._open_if_nobody_trains():
            # A finished learner keeps reporting while it waits: the last training learner may have
            # gone silent (a crash) since, and only a report or a timer brings the syncer here.
            self.tick()
        if math.isfinite(req.step_time_s) and req.step_time_s > 0:
            member.step_time_s = req.step_time_s
        if math.isfinite(req.inner_loss):
            member.inner_loss = req.inner_loss
        self.count_bytes(member, inbound=wire_bytes)
        if self.scheduled and not member.finished:
            self.schedule.observe((member.learner_id, member.incarnation), req.local_step,
                                  len(self.expected_learners()))
            self.open_due_rounds()
        return syncer_pb2.ReportProgressResponse(fragment_versions=serde.versions_to_proto(self.versions()),
                                                 budget_reached=self.budget_reached())

    def leave(self, req: syncer_pb2.LeaveRequest) -> None:
        self.check_protocol(req.protocol_version)
        member = self.require_member(req.learner_id, req.incarnation)
        member.left = True
        self.schedule.forget((member.learner_id, member.incarnation))
        _LOG.info("learner left", extra={"fields": {"learner": req.learner_id}})
        self._open_if_nobody_trains()
        self._notify()
        # Rounds that were waiting for this learner may now be complete.
        self.tick()

    def count_bytes(self, member: Member | None, *, inbound: int = 0, outbound: int = 0, codec: str = "") -> None:
        self.bytes_in += inbound
        self.bytes_out += outbound
        if member is not None:
            member.bytes_in += inbound
            member.bytes_out += outbound
        if codec:  # a fragment transfer: observers count it by the codec it actually used
            self._emit("fragment_bytes", "in" if inbound else "out", codec, inbound or outbound)

    def expected_learners(self) -> set[str]:
        """Learners a round waits for: live (seen within the liveness timeout), not left, not
        quarantined, not finished."""
        now = self._clock()
        return {m.learner_id for m in self.members.values()
                if not m.left and not m.finished and now - m.last_seen_s <= self._liveness_s
                and now >= m.quarantined_until_s}

    def tokens_processed(self) -> int:
        """Tokens processed by every life of every learner known to this run."""
        return sum(m.tokens_prev_lives + m.tokens_this_life() for m in self.members.values())

    def budget_reached(self) -> bool:
        """Whether the run's token budget is spent: learners are told to stop in their progress
        answers. Counted from the learners' reports (restored with the members after a restart),
        so the run overshoots by at most what the fleet processes in one report interval."""
        return self.token_budget > 0 and self.tokens_processed() >= self.token_budget

    # ------------------------------------------------------------------------------ security

    def is_quarantined(self, member: Member) -> bool:
        return self._clock() < member.quarantined_until_s

    def record_rejection(self, reason: str, learner_id: str = "", exc: BaseException | None = None) -> None:
        """Counts one refused upload (or impersonation attempt) by reason, on the learner too.

        Every refusal path ends here exactly once (`exc` is marked as recorded). Reasons in
        STRIKE_REASONS count towards quarantining the learner.
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
        self._flag(member, reason)

    def record_auth_failure(self, reason: str, *, caller: str = "", method: str = "") -> None:
        """Counts a call refused as UNAUTHENTICATED or PERMISSION_DENIED; flags the calling learner
        (by its authenticated identity, never by the id it claimed)."""
        self.auth_failures[reason] += 1
        if method == "UploadFragment":
            self.uploads[f"rejected_{reason}"] += 1
        member = self.members.get(caller) if caller else None
        if member is not None:
            member.rejections[reason] += 1
            self._flag(member, reason)

    def _flag(self, member: Member, reason: str) -> None:
        member.flags |= _FLAG_BY_REASON.get(reason, 0)
        if reason not in STRIKE_REASONS or self._quarantine_after <= 0:
            return
        now = self._clock()
        member.strikes.append(now)
        while member.strikes and now - member.strikes[0] > self._quarantine_window_s:
            member.strikes.popleft()
        if len(member.strikes) >= self._quarantine_after and not self.is_quarantined(member):
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
        self._notify()
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
        return {s.fragment.fragment_id: s.version for s in self.slots}

    def validate_upload_header(self, header: syncer_pb2.UploadHeader, *,
                               pinned_base: np.ndarray | None = None) -> UploadTicket:
        """All checks that need no payload, cheapest first. Raises ServiceError (counted).

        The staleness bound applies at admission: with `pinned_base` (the values an earlier check
        of this header pinned) the base version need not be in the history any more."""
        try:
            return self._validate_upload_header(header, pinned_base)
        except errors.ServiceError as exc:
            self.record_rejection(exc.reason, header.learner_id, exc)
            raise

    def _validate_upload_header(self, header: syncer_pb2.UploadHeader,
                                pinned_base: np.ndarray | None = None) -> UploadTicket:
        self.check_protocol(header.protocol_version)
        member = self.require_member(header.learner_id, header.incarnation)
        if self.is_quarantined(member):
            until = ("until the syncer restarts" if math.isinf(member.quarantined_until_s)
                     else f"for another {member.quarantined_until_s - self._clock():.0f} s")
            raise errors.PermissionDenied(
                f"learner {header.learner_id!r} is quarantined {until} after repeated suspicious uploads",
                reason="quarantined",
            )
        if header.syncer_instance != self.instance:
            raise errors.FailedPrecondition(
                f"base version comes from syncer instance {header.syncer_instance[:8] or '(none)'}, "
                f"this is {self.instance[:8]}: re-sync from WatchFragments",
                reason="stale",
            )
        if header.fragment_id >= len(self.slots):
            raise errors.InvalidArgument(
                f"fragment_id {header.fragment_id} out of range (P = {len(self.slots)})", reason="fragment_id"
            )
        slot = self.slots[header.fragment_id]
        # The mark is part of the key: a learner whose accepted contribution was never merged (a
        # dropped round) sends its progress again on the same base version.
        key = (header.fragment_id, header.base_version, header.local_step)
        seen = member.accepted_keys.get(key)
        if seen is not None:
            if seen == header.payload.checksum:
                return UploadTicket(header=header, codec="", duplicate=True)
            raise errors.AlreadyExists(
                f"upload (learner {header.learner_id}, incarnation {header.incarnation}, fragment "
                f"{header.fragment_id}, base {header.base_version}) was already accepted with another payload",
                reason="replay_mismatch",
            )
        if pinned_base is None and header.base_version not in slot.history:
            raise errors.FailedPrecondition(
                f"base version {header.base_version} of fragment {header.fragment_id} is too stale or "
                f"unknown (current {slot.version}, kept {list(slot.history)}): re-sync",
                reason="stale",
            )
        info = header.payload
        try:
            codec = serde.codec_from_proto(info.codec)
        except ValueError as exc:
            raise errors.InvalidArgument(str(exc), reason="codec") from None
        if info.numel != slot.fragment.numel:
            raise errors.InvalidArgument(
                f"fragment {header.fragment_id} has {slot.fragment.numel} values, header says {info.numel}",
                reason="size",
            )
        if codec in codec_lib.QUANTIZED_CODECS and not 1 <= info.block_size <= codec_lib.MAX_BLOCK_SIZE:
            raise errors.InvalidArgument(f"block_size {info.block_size} out of range", reason="size")
        block = info.block_size or codec_lib.DEFAULT_BLOCK_SIZE
        expected_raw = codec_lib.expected_raw_size_bytes(codec, slot.fragment.numel, block)
        if info.raw_size_bytes != expected_raw:
            raise errors.InvalidArgument(
                f"raw_size_bytes {info.raw_size_bytes} != {expected_raw} implied by {codec} x "
                f"{slot.fragment.numel} values",
                reason="size",
            )
        if not 0 < info.payload_size_bytes <= codec_lib.max_payload_size_bytes(expected_raw):
            raise errors.InvalidArgument(
                f"payload_size_bytes {info.payload_size_bytes} outside (0, "
                f"{codec_lib.max_payload_size_bytes(expected_raw)}]",
                reason="size",
            )
        if len(info.checksum) != 32:
            raise errors.InvalidArgument("checksum must be a 32-byte sha256 digest", reason="checksum")
        if header.steps < 1:
            raise errors.InvalidArgument("steps must be >= 1 for a contribution", reason="steps")
        if slot.round is not None and header.learner_id in slot.round.learners:
            raise errors.FailedPrecondition(
                f"learner {header.learner_id} already has a contribution in fragment "
                f"{header.fragment_id}'s open round; send again after the next version arrives",
                reason="already_pending",
            )
        base = slot.history[header.base_version] if pinned_base is None else pinned_base
        return UploadTicket(header=header, codec=codec, duplicate=False, base_params=base)

    async def accept_upload(self, ticket: UploadTicket, payload: bytes, wire_bytes: int, *,
                            wait_budget_s: float | None = None) -> syncer_pb2.UploadFragmentResponse:
        """Decodes, bounds, corrects to the current version and folds one contribution into its
        round. Raises ServiceError (counted, on the learner too). `wait_budget_s` bounds how long
        the contribution may wait for others to be judged against (the caller's deadline)."""
        try:
            async with self._decoding:
                return await self._accept_upload(ticket, payload, wire_bytes, wait_budget_s)
        except errors.ServiceError as exc:
            self.record_rejection(exc.reason, ticket.header.learner_id, exc)
            raise
        finally:  # a proposal waiting for its judgment never outlives the upload
            self.directions.withdraw(ticket.header.learner_id, ticket.header.fragment_id)

    async def _await_direction_references(self, header, heading: np.ndarray | None, wait_budget_s: float | None) -> None:
        """Holds a contribution that has too few others to be compared with (robust.DirectionPolicy
        .judge_wait_s) while other learners who could send them are live; proposes it as a
        reference for them meanwhile. Returns at once when the check is off or cannot apply."""
        policy = self.direction
        if heading is None or not policy.enabled or policy.judge_wait_s <= 0:
            return
        learner, fid = header.learner_id, header.fragment_id
        slot = self.slots[fid]
        if self.directions.references(learner, fid, slot.version) >= policy.min_others:
            return
        if self.directions.bootstrapped(fid):
            # Mid-run the references only aged out (a learner partitioned, hung or slow): waiting
            # for it would stall the others' merges until the liveness timeout. Only the first
            # contributions of a fragment wait for each other.
            self.direction_judgments["unjudged"] += 1
            return
        self.directions.propose(learner, fid, heading, slot.version)
        loop = asyncio.get_running_loop()
        wait_s = policy.judge_wait_s if wait_budget_s is None else min(policy.judge_wait_s, wait_budget_s)
        deadline = loop.time() + wait_s
        while self.directions.references(learner, fid, slot.version) < policy.min_others:
            if self._comparable_learners(learner) < policy.min_others or loop.time() >= deadline:
                self.direction_judgments["unjudged"] += 1  # goes on without a comparison: visible
                return
            await asyncio.sleep(_JUDGE_POLL_S)
        self.direction_judgments["waited"] += 1

    def _comparable_learners(self, learner_id: str) -> int:
        """Live, unquarantined learners other than `learner_id`: who could still send a reference."""
        now = self._clock()
        return sum(1 for lid, m in self.members.items()
                   if lid != learner_id and not m.left and now - m.last_seen_s <= self._liveness_s
                   and now >= m.quarantined_until_s)

    def _credited_steps(self, member: Member, header: syncer_pb2.UploadHeader) -> int:
        """The steps a contribution is credited with (merge weight, norm bound): at most the local
        steps since this life's last merged contribution of the fragment (UploadHeader.local_step
        minus the receipt mark), which the syncer knows. A claim beyond it would inflate the weight
        and, as a per-step norm far below the others', collapse the norm bound's reference."""
        if not header.local_step:
            return header.steps  # a learner that sends no marks (synchronous modes' barrier uploads)
        since = header.local_step - member.mark_at(header.fragment_id, self.slots[header.fragment_id].version)
        if 0 < since < header.steps:
            self.uploads["capped_steps"] += 1
            return since
        return header.steps

    async def _accept_upload(self, ticket: UploadTicket, payload: bytes, wire_bytes: int,
                             wait_budget_s: float | None = None) -> syncer_pb2.UploadFragmentResponse:
        header = ticket.header
        member = self.require_member(header.learner_id, header.incarnation)
        self.count_bytes(member, inbound=wire_bytes, codec=ticket.codec)
        slot = self.slots[header.fragment_id]
        steps = self._credited_steps(member, header)
        weight = merge_lib.contribution_weight(header.tokens * steps // header.steps if header.steps else 0, steps)
        if ticket.duplicate:
            self.uploads["duplicate"] += 1
            return syncer_pb2.UploadFragmentResponse(
                result=syncer_pb2.UploadFragmentResponse.RESULT_DUPLICATE, current_version=slot.version, weight=weight
            )
        info = header.payload

        def decode() -> tuple[np.ndarray, np.ndarray, float | None, np.ndarray | None]:
            last, last_norm = slot.last_outer_grad or (None, None)  # read once: a merge may replace it
            # Norms and the dot with the last merge are gathered while each decoded piece is in
            # cache (one pass, not three), and the decode itself is shared with a second thread.
            stats = robust_lib.DecodedStats(slot.fragment, last, last_norm)
            values = serde.decode_payload(info, payload, on_chunk=stats.update, executor=self._decode_helper)
            norms = stats.tensor_norms(values)
            return (values, norms, stats.cosine(values, norms), self.directions.direction(header.fragment_id, values))

        try:
            delta, norms, direction, heading = await asyncio.to_thread(decode)
        except codec_lib.CodecError as exc:
            reason = {codec_lib.NonFiniteError: "nonfinite", codec_lib.ChecksumError: "checksum",
                      codec_lib.CorruptPayloadError: "corrupt"}.get(type(exc), "size")
            raise errors.InvalidArgument(f"fragment {header.fragment_id}: {exc}", reason=reason) from None
        await self._await_direction_references(header, heading, wait_budget_s)
        async with slot.lock:
            # Re-check under the lock: the round may have moved while decoding (the base version's
            # values stay pinned: it was within the staleness bound when the header arrived).
            ticket = self.validate_upload_header(header, pinned_base=ticket.base_params)
            if ticket.duplicate:
                self.uploads["duplicate"] += 1
                return syncer_pb2.UploadFragmentResponse(
                    result=syncer_pb2.UploadFragmentResponse.RESULT_DUPLICATE, current_version=slot.version, weight=weight
                )
            base = ticket.base_params
            if slot.params_norm is None or slot.params_norm[0] != slot.params_sha256:
                digest = slot.params_sha256
                # float32 dot products with float64 totals: no float64 copy of the fragment.
                norm = await asyncio.to_thread(merge_lib.vector_norm, slot.params)
                slot.params_norm = (digest, norm)
            params_norm = slot.params_norm[1]
            # Steps the syncer can vouch for: the contribution's mark is no later than the learner's
            # reported progress (plus one period of report lag), and the steps were capped to those
            # since its last merged mark (_credited_steps).
            verified = 0 < header.local_step <= member.local_step + self.plan.sync_period_steps
            verdict = slot.norms.check(header.learner_id, norms, steps, params_norm, steps_verified=verified)
            _LOG.debug("norm bound", extra={"fields": {"learner": header.learner_id, "fragment": header.fragment_id,
                                                       "steps": header.steps, "basis": verdict.basis,
                                                       "ratio": round(verdict.ratio, 4)}})
            if not verdict.within:
                basis = (f"{self.norm_bound.factor:g} x other learners' median" if verdict.basis == "others"
                         else f"{self.norm_bound.params_factor:g} x the global fragment's norm")
                where = (f"tensor {slot.fragment.tensors[verdict.tensor].name} norm "
                         f"{norms[verdict.tensor]:.4g} > limit {verdict.limit:.4g}" if verdict.tensor >= 0
                         else f"limit {verdict.limit:.4g}")
                detail = (f"fragment {header.fragment_id}: contribution norm {verdict.norm:.4g} over {header.steps} "
                          f"steps exceeds the norm bound ({basis}; {where})")
                # Against the bootstrap bound (the fragment's own norm, before other learners' contributions
                # give a per-step reference) an honest learner's progress over many steps can be large:
                # early in a run, a learner whose first contribution waited long (compilation, a slow
                # start) carries every step since (rebase on arrival keeps them; measured 2.1-2.5x the
                # bound at 87-124 steps of the tiny model). Only a far larger excess is a strike there.
                strike_ratio = NORM_STRIKE_RATIO if verdict.basis == "others" else BOOTSTRAP_STRIKE_RATIO
                gross = verdict.ratio >= strike_ratio
                if verdict.basis == "others" and slot.norms.refused(header.learner_id):
                    # A second learner refused against the same reference: the reference is stale
                    # (robust.NormHistory.refused), not the learners. No strike for this one.
                    self.uploads["norm_reference_reset"] += 1
                    gross = False
                if self.norm_bound.action == "reject":
                    raise errors.InvalidArgument(detail, reason="norm_bound" if gross else "norm_bound_marginal")
                _LOG.warning(f"{detail}: clipped", extra={"fields": {"learner": header.learner_id}})
                # Accepted, but clipped: counted (not as a refusal) and a strike towards quarantine.
                reason = "clipped_norm_bound" if gross else "clipped_norm_bound_marginal"
                self.uploads[reason] += 1
                member.rejections[reason] += 1
                self._flag(member, reason)
                delta = await asyncio.to_thread(robust_lib.scale_tensors, delta, slot.fragment, verdict.scales)
                norms = norms * verdict.scales
            cap = slot.norms.weight_cap(header.learner_id, steps)
            if weight > cap:
                self.uploads["capped_weight"] += 1
                weight = cap
            turned = self.directions.judge(header.learner_id, header.fragment_id, heading, slot.version)
            if turned.cosine is not None:
                _LOG.debug("direction", extra={"fields": {"learner": header.learner_id, "fragment": header.fragment_id,
                                                          "cosine": round(turned.cosine, 4), "others": turned.others,
                                                          "score": round(turned.score, 4)}})
            if not turned.within:
                raise errors.InvalidArgument(
                    f"fragment {header.fragment_id}: the contribution points away from the other learners' (median "
                    f"cosine {turned.cosine:+.3f} with their {turned.others} latest contributions, learner's recent "
                    f"mean {turned.score:+.3f}, both < {self.direction.min_cosine:+g}): a sign-flipped update?",
                    reason="direction")
            if slot.round is None:
                self._new_round(slot)
            rnd = slot.round

            def fold() -> None:
                # Re-anchor at the current global fragment (paper App. D.2): the learner's local
                # fragment is base - delta, so its outer gradient against the current version is
                # current - (base - delta).
                # Learners hold the published values, so the correction is in that space.
                if base is slot.published:
                    # The norms gathered while decoding are this delta's: no second pass over it.
                    rnd.accumulator.add(delta, weight, norms=norms)
                else:
                    rnd.accumulator.add(delta + (slot.published - base), weight)

            try:
                await asyncio.to_thread(fold)
            except ValueError as exc:
                raise errors.InvalidArgument(f"fragment {header.fragment_id}: {exc}", reason="nonfinite") from None
            slot.norms.add(header.learner_id, norms, steps, weight)
            self.directions.add(header.learner_id, header.fragment_id, heading, slot.version)
            if direction is not None:
                member.direction_sum += direction
                member.direction_count += 1
            rnd.learners.add(header.learner_id)
            rnd.contributions.append(
                syncer_pb2.Contribution(
                    learner_id=header.learner_id,
                    incarnation=header.incarnation,
                    base_version=header.base_version,
                    steps=header.steps,
                    tokens=header.tokens,
                    weight=weight,
                    local_step=header.local_step,
                )
            )
            member.accepted_keys[(header.fragment_id, header.base_version, header.local_step)] = bytes(info.checksum)
            while len(member.accepted_keys) > _IDEMPOTENCY_KEYS_PER_LEARNER:
                member.accepted_keys.popitem(last=False)
            member.uploads_accepted += 1
            self.uploads["accepted"] += 1
            self._emit("upload_accepted", header)
            if header.final:
                member.finished = True  # its progress report saying so may come after this upload
            self._note_quorum(rnd)
            version_at_accept = slot.version
        self._open_if_nobody_trains()
        self.tick()
        return syncer_pb2.UploadFragmentResponse(
            result=syncer_pb2.UploadFragmentResponse.RESULT_ACCEPTED, current_version=version_at_accept, weight=weight
        )

    # ------------------------------------------------------------------------------- merging

    def step_time_s(self) -> float:
        """Mean smoothed step time over live learners that reported one."""
        now = self._clock()
        times = [
            m.step_time_s
            for m in self.members.values()
            if not m.left and m.step_time_s > 0 and now - m.last_seen_s <= self._liveness_s
        ]
        return sum(times) / len(times) if times else 0.0

    def grace_window_s(self) -> float:
        window = grace_lib.grace_window_s(
            step_time_s=self.step_time_s(),
            quorum_time_s=self._quorum_time.value or 0.0,
            sync_time_s=self._sync_time.value or 0.0,
            tau_steps=self.config.overlap_steps,
            gamma=self._grace_gamma,
        )
        return min(window, self._max_grace_s)

    # -------------------------------------------------------------------------------- rounds

    def _new_round(self, slot: _Slot) -> _Round:
        """Starts gathering contributions for the slot's next merge. With the schedule, the round
        opens (calls its learners, may merge) only when the schedule says; until then early
        contributions (a learner's final work, an answer that came after its round closed) wait."""
        slot.round = _Round(
            accumulator=merge_lib.MergeAccumulator(
                slot.fragment, rule=self.config.merge_rule, embedding_rule=self.config.embedding_merge_rule
            ),
            opened_at_s=self._clock(),
        )
        if not self.scheduled:
            self._open_round(slot, "upload")
        return slot.round

    def _open_round(self, slot: _Slot, why: str) -> None:
        rnd = slot.round if slot.round is not None else self._new_round(slot)
        if rnd.open:
            return
        rnd.open = True
        rnd.opened_at_s = self._clock()
        slot.rounds_opened += 1
        rnd.number = slot.rounds_opened
        self._note_quorum(rnd)
        _LOG.debug("round opened", extra={"fields": {"fragment": slot.fragment.fragment_id, "round": rnd.number,
                                                     "why": why, "early": len(rnd.contributions)}})
        self._notify()  # watch streams call every learner

    def _note_quorum(self, rnd: _Round) -> None:
        """Marks when an open round first holds K contributions; ξ_quorum is measured from the
        round's opening (the syncer's call), as the paper means it."""
        if rnd.open and rnd.quorum_reached_at_s is None and len(rnd.contributions) >= self.config.min_quorum:
            rnd.quorum_reached_at_s = self._clock()
            self._quorum_time.update(rnd.quorum_reached_at_s - rnd.opened_at_s)

    def _open_if_nobody_trains(self) -> bool:
        """Opens every round holding contributions once no learner is training any more (all have
        finished, left or gone silent): nobody advances the schedule, and the last work must merge.
        While some learner trains, finished learners' last contributions join the fragments' next
        scheduled rounds: merging each learner's tail in a round of its own added a full outer step,
        momentum included, per learner and fragment at the end (16 extra merges of 4 learners)."""
        opened = False
        if self.scheduled and not self.expected_learners():
            for slot in self.slots:
                if slot.round is not None and slot.round.contributions and not slot.round.open:
                    self._open_round(slot, "last")
                    opened = True
        return opened

    def open_due_rounds(self) -> list[int]:
        """Opens the rounds the schedule says are due; returns their fragment ids."""
        if not self.scheduled:
            return []
        due = self.schedule.due(lambda fid: self.slots[fid].round is not None and self.slots[fid].round.open)
        for fid in due:
            self._open_round(self.slots[fid], "schedule")
        if due:
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # no loop (unit tests of pure parts)
                return due
            self.tick()
        return due

    def round_call(self, fragment_id: int, learner_id: str) -> syncer_pb2.RoundCall | None:
        """The call to send this learner for the fragment's open round, if it has not contributed."""
        slot = self.slots[fragment_id]
        rnd = slot.round
        if rnd is None or not rnd.open or learner_id in rnd.learners:
            return None
        return syncer_pb2.RoundCall(fragment_id=fragment_id, round=rnd.number, version=slot.version)

    def receipt(self, learner_id: str, incarnation: int, fragment_id: int, version: int) -> syncer_pb2.MergeReceipt:
        """This learner life's MergeReceipt for a version of a fragment."""
        member = self.members.get(learner_id)
        mark = member.mark_at(fragment_id, version) if member is not None and member.incarnation == incarnation else 0
        return syncer_pb2.MergeReceipt(fragment_id=fragment_id, version=version, merged_through_step=mark)

    def broadcast_sent(self, learner_id: str, fragment_id: int, version: int) -> None:
        """A watch stream sent `version` to a learner: once every learner the merge was broadcast
        to has it, the merge's sync time (merge + publish + broadcast) is measured."""
        pending = self.slots[fragment_id].broadcast
        if pending is None or version < pending[0]:
            return
        pending[2].discard(learner_id)
        if not pending[2]:
            self._sync_time.update(self._clock() - pending[1])
            self.slots[fragment_id].broadcast = None

    def tick(self) -> None:
        """Re-evaluates every open round at the current time; merges those that are due."""
        self._open_if_nobody_trains()  # the last training learner may have gone silent
        now = self._clock()
        grace_s = self.grace_window_s()
        expected = self.expected_learners()
        for slot in self.slots:
            rnd = slot.round
            if rnd is None or not rnd.open or slot.merging or slot.lock.locked():
                continue
            decision = grace_lib.decide_merge(
                now,
                grace_lib.RoundView(
                    opened_at_s=rnd.opened_at_s,
                    contributors=len(rnd.learners),
                    quorum_reached_at_s=rnd.quorum_reached_at_s,
                    expected_contributors=max(len(expected | rnd.learners), 1),
                ),
                min_quorum=self.config.min_quorum,
                grace_s=grace_s,
            )
            if decision.merge:
                slot.merging = True
                asyncio.get_running_loop().create_task(self._merge(slot, decision.reason, grace_s))
            elif decision.wake_at_s is not None:
                self._arm_timer(slot, decision.wake_at_s - now)

    def _arm_timer(self, slot: _Slot, delay_s: float) -> None:
        if slot.timer is not None:
            slot.timer.cancel()
        slot.timer = asyncio.get_running_loop().call_later(max(delay_s, 0.0) + 1e-3, self.tick)

    async def _merge(self, slot: _Slot, reason: str, grace_s: float) -> None:
        try:
            await self._merge_locked(slot, reason, grace_s)
        finally:
            slot.merging = False
        self._notify()
        if self.on_merge is not None:
            self.on_merge()
        if not self.open_due_rounds():  # a round the schedule held back while this one was open
            self.tick()  # contributions that arrived during the merge may already form a round

    def _step_fraction(self, rnd: _Round) -> float:
        """The outer step's fraction (config outer_step_fraction): the token-weighted mean of the
        contributions' inner steps over H (below 1: a short round; above 1: many rounds' work,
        whose momentum share OuterStepper.step_scaled bounds); 1 with "whole"."""
        if self._outer_step_fraction != "steps":
            return 1.0
        tokens = sum(c.tokens for c in rnd.contributions)
        if tokens <= 0:
            return 1.0
        mean_steps = sum(c.tokens * c.steps for c in rnd.contributions) / tokens
        return max(mean_steps, 1.0) / self.plan.sync_period_steps

    async def _merge_locked(self, slot: _Slot, reason: str, grace_s: float) -> None:
        async with slot.lock:
            rnd = slot.round
            if rnd is None:  # merged by a concurrent task
                return
            self.failpoint("syncer.after_quorum")  # quorum reached, outer step not yet applied
            started = self._clock()
            if slot.timer is not None:
                slot.timer.cancel()
                slot.timer = None
            stepper = self._steppers[slot.fragment.fragment_id]
            # The delta stays factored (sums x per-tensor scales) until the step writes it out.
            merged = await asyncio.to_thread(rnd.accumulator.scaled_result)
            # Δ is kept factored (the round's sums are not written again): one stream less.
            stepped = await asyncio.to_thread(functools.partial(
                stepper.step_scaled, slot.params, slot.opt_state, *merged, write_grad=False,
                fraction=self._step_fraction(rnd)))
            new_params, new_state = stepped.params, stepped.state
            slot.last_outer_grad = (merged, stepped.outer_grad_norm)
            if not stepped.finite:
                # Never publish a non-finite global fragment; drop the round instead.
                _LOG.error("outer step produced non-finite values; round dropped", extra={"fields": {"fragment": slot.fragment.fragment_id}})
                slot.round = None
                self.uploads["dropped_nonfinite_round"] += 1
                return
            if self.delta_downloads:
                published, delta_encoded = await asyncio.to_thread(self._publish_delta, slot.published, new_params)
                slot.delta_encoded = (slot.version + 1, delta_encoded)
            else:
                published = new_params
            slot.params, slot.opt_state = new_params, new_state
            slot.version += 1
            slot.published = published
            slot.history[slot.version] = published
            while len(slot.history) > self.config.max_staleness_versions + 1:
                slot.history.popitem(last=False)
            slot.params_sha256 = params_sha256(new_params)
            slot.published_sha256 = slot.params_sha256 if published is new_params else params_sha256(published)
            slot.encoded = None
            slot.round = None
            self.outer_steps += 1
            self.tokens_merged += sum(c.tokens for c in rnd.contributions)
            fid = slot.fragment.fragment_id
            for c in rnd.contributions:  # what each contributor's MergeReceipt will say
                member = self.members.get(c.learner_id)
                if member is not None and member.incarnation == c.incarnation:
                    marks = member.merged_marks.setdefault(fid, collections.deque(maxlen=_RECEIPT_HISTORY))
                    marks.append((slot.version, c.local_step))
                    member.merged_tokens[fid] = member.merged_tokens.get(fid, 0) + c.tokens
            expected = self.expected_learners()
            slot.broadcast = (slot.version, started, set(expected))
            quorum_at = rnd.quorum_reached_at_s if rnd.quorum_reached_at_s is not None else started
            record = syncer_pb2.MergeRecord(
                fragment_id=slot.fragment.fragment_id,
                version=slot.version,
                merged_at_unix_s=self._wall(),
                contributors=rnd.contributions,
                quorum_wait_s=quorum_at - rnd.opened_at_s,
                grace_window_s=grace_s,
                grace_used_s=max(0.0, started - quorum_at),
                reason=reason,
                outer_grad_norm=stepped.outer_grad_norm,
                expected_contributors=len(expected | rnd.learners),
                round=rnd.number,
            )
            self.merges.append(record)
            await self.encoded_payload(slot)
            if self._sync_time.value is None or not expected:
                # Until a broadcast has been measured (broadcast_sent), merge and publish time.
                self._sync_time.update(self._clock() - started)
            # This merge's record: after the await above, merges[-1] may be another fragment's.
            self._emit("merged", record)
            _LOG.info(
                "merged",
                extra={"fields": {"fragment": slot.fragment.fragment_id, "version": slot.version,
                                  "contributors": len(rnd.contributions), "reason": reason}},
            )

    def _publish_delta(self, published: np.ndarray, new_params: np.ndarray) -> tuple[np.ndarray, codec_lib.EncodedPayload]:
        """Encodes new_params - published in the download codec; returns what learners will hold
        after applying it (computed exactly as they compute it) and the encoding."""
        encoded = codec_lib.encode(
            (new_params - published).astype(np.float32), self.download_codec,
            block_size=self.config.upload_block_size, zstd_level=self.config.zstd_level,
        )
        step = codec_lib.decode(
            encoded.payload, codec=encoded.codec, numel=encoded.numel, raw_size_bytes=encoded.raw_size_bytes,
            checksum=encoded.checksum, block_size=encoded.block_size,
        )
        return serde.apply_delta(published, step), encoded

    def delta_payload(self, slot: _Slot, from_version: int) -> tuple[int, codec_lib.EncodedPayload] | None:
        """The current version as a delta from `from_version`, if one is cached for exactly that step."""
        cached = slot.delta_encoded
        if cached is None or cached[0] != slot.version or from_version != slot.version - 1:
            return None
        return cached

    async def encoded_payload(self, slot: _Slot) -> tuple[int, codec_lib.EncodedPayload]:
        """The current published values of a fragment as exact float32 (cached per version).

        Concurrent callers share one encode: at start (and after a restore) every watcher asks
        for the same uncached version at once, and one encode and one copy each per watcher made
        the syncer's peak memory grow with the number of learners."""
        if slot.encoded is None:
            version = slot.version
            if slot.encoding is None or slot.encoding[0] != version:
                slot.encoding = (version, asyncio.ensure_future(asyncio.to_thread(
                    codec_lib.encode, slot.published, "fp32", zstd_level=self.config.zstd_level,
                )))
            pending = slot.encoding[1]
            try:
                encoded = await asyncio.shield(pending)  # a watcher that goes away leaves it to the others
            finally:
                if slot.encoding is not None and slot.encoding[1] is pending and pending.done():
                    slot.encoding = None
            if slot.version == version:
                slot.encoded = encoded
            return version, encoded
        return slot.version, slot.encoded

    def _emit(self, event: str, *args) -> None:
        for observer in self.observers:
            handler = getattr(observer, event, None)
            if handler is not None:
                handler(*args)

    # ------------------------------------------------------------------------------ watchers

    def _notify(self) -> None:
        self._change_counter += 1

        async def _wake() -> None:
            async with self._changed:
                self._changed.notify_all()

        try:
            asyncio.get_running_loop().create_task(_wake())
        except RuntimeError:  # no loop (unit tests of pure parts)
            pass

    def wake_watchers(self) -> None:
        """Wakes every wait_for_change now (shutdown: watch streams end without waiting a poll)."""
        self._notify()

    async def wait_for_change(self, seen_counter: int, timeout_s: float) -> int:
        """Waits until the state changed after `seen_counter` (or timeout); returns the counter."""
        async with self._changed:
            if self._change_counter == seen_counter:
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout_s)
                except asyncio.TimeoutError:
                    pass
        return self._change_counter

    @property
    def change_counter(self) -> int:
        return self._change_counter

    @property
    def liveness_timeout_s(self) -> float:
        return self._liveness_s

    @property
    def max_grace_s(self) -> float:
        return self._max_grace_s

    # ------------------------------------------------------------------------------- evals

    def report_eval(self, req: syncer_pb2.ReportEvalRequest) -> None:
        self.check_protocol(req.protocol_version)
        if not math.isfinite(req.heldout_loss):
            raise errors.InvalidArgument("heldout_loss must be finite", reason="eval")
        self.evals.append(
            syncer_pb2.EvalRecord(
                at_unix_s=self._wall(),
                heldout_loss=req.heldout_loss,
                tokens_merged=req.tokens_merged,
                outer_steps=sum(v.version for v in req.evaluated),
            )
        )
        _LOG.info("held-out loss", extra={"fields": {"loss": round(req.heldout_loss, 4), "evaluator": req.evaluator_id}})
        self._notify()

    # ------------------------------------------------------------------------------- state

    def training_state(self, recent_merges: int) -> syncer_pb2.TrainingState:
        now = self._clock()
        status = syncer_pb2.MemberState
        members = []
        for m in sorted(self.members.values(), key=lambda m: m.learner_id):
            if m.left:
                st = status.STATUS_LEFT
            elif now - m.last_seen_s <= self._liveness_s:
                st = status.STATUS_ACTIVE
            else:
                st = status.STATUS_SILENT
            members.append(
                status(
                    learner_id=m.learner_id, incarnation=m.incarnation, region=m.region, status=st,
                    last_seen_unix_s=m.last_seen_unix_s, local_step=m.local_step, tokens_total=m.tokens_total,
                    step_time_s=m.step_time_s, inner_loss=m.inner_loss, uploads_accepted=m.uploads_accepted,
                    uploads_rejected=m.uploads_rejected, joins=m.joins, bytes_in=m.bytes_in, bytes_out=m.bytes_out,
                    quarantined=now < m.quarantined_until_s, flags=m.flags, rejections=dict(m.rejections),
                    quarantined_until_unix_s=m.quarantined_until_unix_s if now < m.quarantined_until_s else 0.0,
                    direction_agreement=m.direction_sum / m.direction_count if m.direction_count else 0.0,
                    num_data_shards=m.num_data_shards, data_shard=max(m.data_shard, 0),
                    data_shard_assigned=m.data_shard_assigned,
                )
            )
        merges = list(self.merges)[-recent_merges:] if recent_merges else []
        return syncer_pb2.TrainingState(
            run_id=self.config.run_id,
            syncer_instance=self.instance,
            started_at_unix_s=self.started_at_unix_s,
            now_unix_s=self._wall(),
            outer_steps=self.outer_steps,
            fragments=[
                syncer_pb2.FragmentState(
                    fragment_id=s.fragment.fragment_id, version=s.version, numel=s.fragment.numel,
                    pending_contributions=len(s.round.contributions) if s.round else 0,
                    params_sha256=s.params_sha256,
                    published_sha256=s.published_sha256,
                    round=s.rounds_opened,
                    round_open=bool(s.round is not None and s.round.open),
                )
                for s in self.slots
            ],
            members=members,
            recent_merges=merges,
            tokens_merged=self.tokens_merged,
            bytes_in=self.bytes_in,
            bytes_out=self.bytes_out,
            evals=list(self.evals),
            last_checkpoint_outer_step=self.last_checkpoint_outer_step,
            last_checkpoint_unix_s=self.last_checkpoint_unix_s,
            restored_from_checkpoint=self.restored_from_checkpoint,
            config=self.config,
            uploads=dict(self.uploads),
            grace_window_s=self.grace_window_s(),
            step_time_s=self.step_time_s(),
            quorum_time_s=self._quorum_time.value or 0.0,
            sync_time_s=self._sync_time.value or 0.0,
            auth_failures=dict(self.auth_failures),
            quarantines=self.quarantines,
            direction_judgments=dict(self.direction_judgments),
            tokens_processed=self.tokens_processed(),
            token_budget=self.token_budget,
        )

    # -------------------------------------------------------------------------- checkpoints

    async def snapshot(self) -> dict:
        """A consistent copy of everything a restart needs (each fragment copied under its lock)."""
        fragments = []
        for slot in self.slots:
            async with slot.lock:
                fragments.append(
                    {
                        "fragment_id": slot.fragment.fragment_id,
                        "version": slot.version,
                        "params": slot.params.copy(),
                        "opt_state": [np.array(a, copy=True) for a in slot.opt_state],
                        "params_sha256": slot.params_sha256,
                        # Receipts survive a restart: the checkpointed version holds these marks
                        # (read under the same lock as the values, so they agree).
                        "merged_marks": {m.learner_id: [m.incarnation, m.mark_at(slot.fragment.fragment_id, slot.version)]
                                         for m in self.members.values()
                                         if m.mark_at(slot.fragment.fragment_id, slot.version)},
                    }
                )
        return {
            "fragments": fragments,
            "outer_steps": self.outer_steps,
            "tokens_merged": self.tokens_merged,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "uploads": dict(self.uploads),
            "members": {m.learner_id: {"incarnation": m.incarnation, "region": m.region, "joins": m.joins,
                                       "flags": m.flags, "rejections": dict(m.rejections),
                                       "tokens_total": m.tokens_this_life(), "tokens_prev_lives": m.tokens_prev_lives,
                                       "num_data_shards": m.num_data_shards, "data_shard": m.data_shard,
                                       "data_shard_assigned": m.data_shard_assigned,
                                       # the time left, so a restart keeps it ("until restart" ones end)
                                       "quarantine_remaining_s": _remaining(m.quarantined_until_s - self._clock())}
                        for m in self.members.values()},
            "evals": [
                {"at_unix_s": e.at_unix_s, "heldout_loss": e.heldout_loss, "tokens_merged": e.tokens_merged,
                 "outer_steps": e.outer_steps}
                for e in self.evals
            ],
            "quorum_time_s": self._quorum_time.value,
            "sync_time_s": self._sync_time.value,
            "global_step": self.schedule.global_step,
            "rounds_opened": [s.rounds_opened for s in self.slots],
        }

    def restore(self, state: dict) -> None:
        """Loads a snapshot (as produced by `snapshot`, after a checkpoint round trip)."""
        by_id = {f["fragment_id"]: f for f in state["fragments"]}
        if sorted(by_id) != list(range(len(self.slots))):
            raise ValueError(f"checkpoint has fragments {sorted(by_id)}, the plan has {len(self.slots)}")
        for slot in self.slots:
            frag = by_id[slot.fragment.fragment_id]
            params = np.asarray(frag["params"], dtype=np.float32)
            if params.shape != (slot.fragment.numel,):
                raise ValueError(f"checkpoint fragment {slot.fragment.fragment_id} has shape {params.shape}")
            digest = params_sha256(params)
            if digest != frag["params_sha256"]:
                raise ValueError(f"checkpoint fragment {slot.fragment.fragment_id} fails its sha256 check")
            slot.params = params
            slot.opt_state = [np.asarray(a) for a in frag["opt_state"]]
            slot.version = int(frag["version"])
            # A new instance: every learner re-downloads exact values, so published restarts
            # from the parameters themselves.
            slot.published, slot.published_sha256, slot.delta_encoded = params, digest, None
            slot.history = collections.OrderedDict({slot.version: params})
            slot.params_sha256 = digest
            slot.encoded = None
            slot.round = None
        self.outer_steps = int(state["outer_steps"])
        self.tokens_merged = int(state["tokens_merged"])
        self.bytes_in = int(state.get("bytes_in", 0))
        self.bytes_out = int(state.get("bytes_out", 0))
        self.uploads = collections.Counter(state.get("uploads", {}))
        # Fencing survives restarts: a learner must come back with an incarnation at least as new.
        for learner_id, m in state.get("members", {}).items():
            member = self.members[learner_id] = Member(
                learner_id=learner_id, incarnation=int(m["incarnation"]), region=m.get("region", ""),
                tokens_per_step=0, last_seen_s=-math.inf, last_seen_unix_s=0.0, joins=int(m.get("joins", 1)),
                flags=int(m.get("flags", 0)), rejections=collections.Counter(m.get("rejections", {})),
                tokens_total=int(m.get("tokens_total", 0)), tokens_prev_lives=int(m.get("tokens_prev_lives", 0)),
                # A returning learner id is given its shard again (_place_on_data_shard).
                num_data_shards=int(m.get("num_data_shards", 0)), data_shard=int(m.get("data_shard", -1)),
                data_shard_assigned=bool(m.get("data_shard_assigned", False)),
            )
            for frag in state["fragments"]:
                incarnation, mark = frag.get("merged_marks", {}).get(learner_id, (-1, 0))
                if int(incarnation) == member.incarnation and mark:
                    member.merged_marks[int(frag["fragment_id"])] = collections.deque(
                        [(int(frag["version"]), int(mark))], maxlen=_RECEIPT_HISTORY)
            # Quarantine survives restarts too.
            remaining_s = float(m.get("quarantine_remaining_s", 0.0))
            if remaining_s > 0:
                member.quarantined_until_s = self._clock() + remaining_s
                member.quarantined_until_unix_s = self._wall() + remaining_s
                self.quarantines += 1
        for e in state.get("evals", []):
            self.evals.append(syncer_pb2.EvalRecord(**e))
        if state.get("quorum_time_s") is not None:
            self._quorum_time.update(state["quorum_time_s"])
        if state.get("sync_time_s") is not None:
            self._sync_time.update(state["sync_time_s"])
        self.schedule = rounds_lib.RoundSchedule(self.plan, global_step=float(state.get("global_step", 0.0)))
        for slot, opened in zip(self.slots, state.get("rounds_opened", ()), strict=False):
            slot.rounds_opened = int(opened)
        self.restored_from_checkpoint = True
        self.last_checkpoint_outer_step = self.outer_steps
        _LOG.info("restored", extra={"fields": {"outer_step": self.outer_steps,
                                                "versions": self.versions(),
                                                "sha256": [s.params_sha256[:12] for s in self.slots]}})


def _remaining(seconds: float) -> float:
    return seconds if 0 < seconds < math.inf else 0.0


def make_run_config(*, cfg, plan: fragments_lib.FragmentPlan, model_name: str, model_config_json: str, fingerprint: str) -> syncer_pb2.RunConfig:
    """The RunConfig learners adopt, from the syncer's configuration and fragment plan."""
    return syncer_pb2.RunConfig(
        run_id=cfg.run_id,
        model_name=model_name,
        model_config_json=model_config_json,
        model_fingerprint=fingerprint,
        num_fragments=plan.num_fragments,
        sync_period_steps=plan.sync_period_steps,
        overlap_steps=cfg.overlap_steps,
        min_quorum=cfg.min_quorum,
        upload_codec=serde.codec_to_proto(cfg.upload_codec),
        upload_block_size=cfg.upload_block_size,
        download_codec=serde.codec_to_proto(cfg.download_codec),
        chunk_size_bytes=cfg.chunk_size_bytes,
        max_staleness_versions=cfg.max_staleness_versions,
        mixing_alpha=cfg.mixing_alpha,
        on_arrival=cfg.on_arrival,
        round_trigger=cfg.round_trigger,
        fragments=serde.plan_to_proto(plan),
        zstd_level=cfg.zstd_level,
        merge_rule=cfg.merge_rule,
        embedding_merge_rule=cfg.embedding_merge_rule,
        protocol_version=serde.PROTOCOL_VERSION,
        sync_mode=cfg.sync_mode,
        init_seed=cfg.seed,
    )

