"""Whether a contribution may enter a merge round, and with what weight.

Owns `UploadTicket` and `Admission`: the upload header's checks (cheapest first, before any payload
is read), idempotency, the steps a contribution is credited with, decoding (bounded in number at
once; its norms and direction sample gathered in the same pass), the hold for direction references, the norm bound
(refuse, or clip and strike) with its weight cap, and the direction check. Refusals raise
ServiceError, counted once (Membership.record_rejection): by `validate` for the header's, by the
upload path (intake.Intake.accept) for the others.
Must not: fold contributions into rounds or merge; the norm and direction checks run under the
fragment's lock, which the upload path holds.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable

import numpy as np

from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import merge as merge_lib
from ddiloco.algo import robust as robust_lib
from ddiloco.rpc import errors
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde
from ddiloco.wire import stream as stream_lib
from . import influence as influence_lib
from . import membership as membership_lib
from . import slots as slots_lib

_LOG = logging.getLogger("ddiloco.syncer")

# Bounded influence: a learner may step this many times faster than the other learners' median step
# time (a unit with more devices), and contribute at most this much beyond what its measured rate allows.
STEP_RATE_FACTOR = 4.0
# Clips of what a contribution claims (the others, "norm", bound what it is).
CLAIMS = ("steps", "step_rate", "batch")
# What makes a contribution one the syncer cannot vouch for: its claims, or its norm clipped against
# the other learners' (claims_unverified).
UNVOUCHED = CLAIMS + ("norm",)
RATE_WINDOW_S = 5.0  # a learner's observed rate counts once its contributions span this long
JUDGE_POLL_S = 0.02  # how often a contribution waiting for direction references looks again
NORM_STRIKE_RATIO = 2.0
BOOTSTRAP_STRIKE_RATIO = 10.0  # the same, against the bootstrap bound (no other learners' reference yet)


@dataclasses.dataclass(frozen=True)
class UploadHeader:
    """An UploadFragment header as admission reads it (wire_views.upload_header builds it from the
    message; field meanings as in protos/ddiloco/v1/syncer.proto's UploadHeader)."""

    protocol_version: int
    learner_id: str
    incarnation: int
    fragment_id: int
    base_version: int
    syncer_instance: str
    steps: int
    tokens: int
    payload: serde.PayloadDescription
    local_step: int
    final: bool


@dataclasses.dataclass(frozen=True)
class UploadTicket:
    """What a validated upload header allows the servicer to read."""

    header: UploadHeader
    codec: str
    duplicate: bool  # already accepted: acknowledge without applying
    # The published values of the base version, pinned when the header was admitted: merges that
    # happen while the payload streams in and waits for the fragment's lock may drop that version
    # from the history, and the syncer's own queueing must not make an admitted contribution stale.
    base_params: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class Decoded:
    """A decoded contribution and what was gathered in the same pass over it."""

    values: np.ndarray
    norms: np.ndarray  # per tensor
    agreement: float | None  # cosine with the fragment's last merged outer gradient (observability)
    heading: np.ndarray | None  # the direction check's sample (robust.DirectionGuard)


@dataclasses.dataclass
class IncomingPayload:
    """An upload's payload while it streams in (Admission.open_payload): each chunk is hashed and,
    when the stream holds a decoding permit, dequantized on arrival, its norms and cosine
    gathered in the same pass. The servicer releases the permit when the upload ends."""

    stream: stream_lib.PayloadStream
    stats: robust_lib.DecodedStats
    permit: bool  # holds one of Admission.decoding's permits

    def feed(self, data: bytes) -> None:
        """The next chunk's bytes; INVALID_ARGUMENT when they cannot belong to the payload."""
        try:
            self.stream.feed(data)
        except codec_lib.CodecError as exc:
            raise errors.InvalidArgument(str(exc), reason=_codec_reason(exc)) from None


def work_key(header: UploadHeader) -> tuple[int, int, bytes] | None:
    """What a contribution is, for counting strikes (Membership.flag): its fragment, base version and
    payload checksum (the content, once the payload is checked against it). None without a checksum."""
    checksum = bytes(header.payload.checksum or b"")
    return (header.fragment_id, header.base_version, checksum) if checksum else None


def _codec_reason(exc: codec_lib.CodecError) -> str:
    return {codec_lib.NonFiniteError: "nonfinite", codec_lib.ChecksumError: "checksum",
            codec_lib.CorruptPayloadError: "corrupt"}.get(type(exc), "size")


class Admission:
    """The checks a contribution passes on its way into a round. See the module docstring."""

    def __init__(self, *, instance: str, plan: fragments_lib.FragmentPlan, slots: list[slots_lib.FragmentSlot],
                 membership: membership_lib.Membership, directions: robust_lib.DirectionGuard,
                 direction_policy: robust_lib.DirectionPolicy, norm_bound: robust_lib.NormBoundPolicy,
                 uploads: collections.Counter, max_decoding: int | None, clock: Callable[[], float]) -> None:
        """`uploads` is the core's upload counter; `max_decoding`: contributions between decode
        and fold-in at once (None: the default below)."""
        self._instance = instance
        self._plan = plan
        self._slots = slots
        self._membership = membership
        self._directions = directions
        self._direction = direction_policy
        self._norm_bound = norm_bound
        self._uploads = uploads
        # Contributions between decode and fold-in at once. Each holds its float32 values, norms
        # and direction sample (~1.5x the fragment in float32) while it waits for the fragment's
        # lock; uploads beyond the bound wait with only their compressed payload, so peak memory
        # does not grow with the number of learners uploading at once (decoding is CPU-bound: more
        # at once than cores buys nothing). Enough that, at the start of a run, some fragment
        # always gathers the min_others + 1 contributions that judge each other (direction check).
        self.max_decoding = max_decoding or len(plan.fragments) * (direction_policy.min_others + 1)
        self.decoding = asyncio.Semaphore(self.max_decoding)  # held from decode to fold-in (SyncerCore)
        # The second thread of each large decode (codec.decode's executor): an upload's decode
        # then uses two cores. One thread: a decode whose half finds it busy does that half itself.
        self._decode_helper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="syncer-decode")
        # Streamed payloads' bytes and values, reused across uploads (a 100M-parameter model's
        # fragments are 100 MB of values each: mapped and faulted in anew per upload otherwise).
        self._buffers = stream_lib.BufferPool()
        self._clock = clock
        self.direction_judgments: collections.Counter = collections.Counter()  # see await_direction_references
        # Bounded influence: who influenced which merge (services/syncer/influence.py; the core sets it).
        self.influence: influence_lib.Influence | None = None
        # (learner, fragment) -> what was clipped of the contribution being admitted, and the clock()
        # of the learner life's last accepted contribution to the fragment (its measured step rate).
        self._clips: dict[tuple[str, int], list[str]] = {}
        # (learner, incarnation) -> [clock(), local_step] of its first accepted contribution, then of
        # its latest: each life's step rate as the syncer observes it (STEP_RATE_FACTOR).
        self._progress: dict[tuple[str, int], list[float]] = {}
        self._unchecked: set[tuple[str, int]] = set()  # (learner, fragment): batch not checkable (cap_weight)

    # -------------------------------------------------------------------------------- header

    def validate(self, header: UploadHeader, *, pinned_base: np.ndarray | None = None) -> UploadTicket:
        """All checks that need no payload, cheapest first. Raises ServiceError (counted).

        The staleness bound applies at admission: with `pinned_base` (the values an earlier check
        of this header pinned) the base version need not be in the history any more."""
        try:
            return self._validate(header, pinned_base)
        except errors.ServiceError as exc:
            self._membership.record_rejection(exc.reason, header.learner_id, exc, work=work_key(header))
            if self.influence is not None:
                self.influence.note_refused(header.learner_id, header.fragment_id, exc.reason, exc)
            raise

    def _validate(self, header: UploadHeader, pinned_base: np.ndarray | None) -> UploadTicket:
        member = self._sender(header)
        if header.fragment_id >= len(self._slots):
            raise errors.InvalidArgument(
                f"fragment_id {header.fragment_id} out of range (P = {len(self._slots)})", reason="fragment_id"
            )
        slot = self._slots[header.fragment_id]
        if self._already_accepted(member, header):
            return UploadTicket(header=header, codec="", duplicate=True)
        if pinned_base is None and header.base_version not in slot.history:
            raise errors.FailedPrecondition(
                f"base version {header.base_version} of fragment {header.fragment_id} is too stale or "
                f"unknown (current {slot.version}, kept {list(slot.history)}): re-sync",
                reason="stale",
            )
        codec = self._payload_codec(header, slot.fragment.numel)
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

    def _sender(self, header: UploadHeader) -> membership_lib.Member:
        """The sending life, if it speaks the protocol, is current, not quarantined, and based its
        contribution on this syncer instance."""
        membership_lib.check_protocol(header.protocol_version)
        member = self._membership.require_member(header.learner_id, header.incarnation)
        if self._membership.is_quarantined(member):
            until = ("until the syncer restarts" if math.isinf(member.quarantined_until_s)
                     else f"for another {member.quarantined_until_s - self._clock():.0f} s")
            raise errors.PermissionDenied(
                f"learner {header.learner_id!r} is quarantined {until} after repeated suspicious uploads",
                reason="quarantined",
            )
        if header.syncer_instance != self._instance:
            raise errors.FailedPrecondition(
                f"base version comes from syncer instance {header.syncer_instance[:8] or '(none)'}, "
                f"this is {self._instance[:8]}: re-sync from WatchFragments",
                reason="stale",
            )
        return member

    @staticmethod
    def _already_accepted(member: membership_lib.Member, header: UploadHeader) -> bool:
        """True for a retry of an accepted upload; ALREADY_EXISTS for another payload under its key."""
        # The mark is part of the key: a learner whose accepted contribution was never merged (a
        # dropped round) sends its progress again on the same base version.
        seen = member.accepted_keys.get((header.fragment_id, header.base_version, header.local_step))
        if seen is None:
            return False
        if seen == header.payload.checksum:
            return True
        raise errors.AlreadyExists(
            f"upload (learner {header.learner_id}, incarnation {header.incarnation}, fragment "
            f"{header.fragment_id}, base {header.base_version}) was already accepted with another payload",
            reason="replay_mismatch",
        )

    @staticmethod
    def _payload_codec(header: UploadHeader, numel: int) -> str:
        """The payload's codec, once its declared sizes and checksum fit the fragment."""
        info = header.payload
        if info.codec_error:
            raise errors.InvalidArgument(info.codec_error, reason="codec")
        codec = info.codec
        if info.numel != numel:
            raise errors.InvalidArgument(
                f"fragment {header.fragment_id} has {numel} values, header says {info.numel}",
                reason="size",
            )
        if codec in codec_lib.QUANTIZED_CODECS and not 1 <= info.block_size <= codec_lib.MAX_BLOCK_SIZE:
            raise errors.InvalidArgument(f"block_size {info.block_size} out of range", reason="size")
        block = info.block_size or codec_lib.DEFAULT_BLOCK_SIZE
        expected_raw = codec_lib.expected_raw_size_bytes(codec, numel, block)
        if info.raw_size_bytes != expected_raw:
            raise errors.InvalidArgument(
                f"raw_size_bytes {info.raw_size_bytes} != {expected_raw} implied by {codec} x "
                f"{numel} values",
                reason="size",
            )
        if not 0 < info.payload_size_bytes <= codec_lib.max_payload_size_bytes(expected_raw):
            raise errors.InvalidArgument(
                f"payload_size_bytes {info.payload_size_bytes} outside (0, "
                f"{codec_lib.max_payload_size_bytes(expected_raw)}]",
                reason="size",
            )
        if info.format_error:
            raise errors.InvalidArgument(info.format_error, reason="codec")
        checksum_kind = info.checksum_kind
        if len(info.checksum) != codec_lib.CHECKSUM_BYTES[checksum_kind]:
            raise errors.InvalidArgument(
                f"checksum must be a {codec_lib.CHECKSUM_BYTES[checksum_kind]}-byte {checksum_kind} digest",
                reason="checksum")
        return codec

    def credited_steps(self, member: membership_lib.Member, header: UploadHeader) -> int:
        """The steps a contribution is credited with (merge weight, norm bound): at most the local
        steps since this life's last merged contribution of the fragment (UploadHeader.local_step
        minus the receipt mark), which the syncer knows. A claim beyond it would inflate the weight
        and, as a per-step norm far below the others', collapse the norm bound's reference."""
        clips = self._clips[(header.learner_id, header.fragment_id)] = []
        steps = header.steps
        if header.local_step:  # a learner that sends no marks (synchronous modes' barrier uploads): no cap
            since = header.local_step - member.mark_at(header.fragment_id, self._slots[header.fragment_id].version)
            if 0 < since < steps:
                self._uploads["capped_steps"] += 1
                self._clip(clips, "steps")
                steps = since
        allowed = self._steps_allowed(member, header)
        if allowed is not None and steps > allowed:
            self._clip(clips, "step_rate")
            steps = allowed
        return steps

    def claims_unverified(self, learner_id: str, fragment_id: int) -> bool:
        """Whether the contribution being admitted had its claimed steps or batch or its norm
        clipped, or its batch could not be checked (no other learners' history yet): the merge's
        share cap then applies to it in a merge of any size, and its tighter norm clip
        (MergeAccumulator.add, unverified_norm_ratio)."""
        key = (learner_id, fragment_id)
        return key in self._unchecked or any(what in UNVOUCHED for what in self._clips.get(key, ()))

    def _clip(self, clips: list[str], what: str) -> None:
        clips.append(what)
        if self.influence is not None:
            self.influence.note_clipped(what)

    def _steps_allowed(self, member: membership_lib.Member, header: UploadHeader) -> int | None:
        """The steps the contribution may be credited with by the step rate the syncer observed: its
        mark (UploadHeader.local_step) at most the mark of this life's first accepted contribution
        plus STEP_RATE_FACTOR x the other learners' median observed rate since then, plus one sync
        period. Rates are taken between contributions' arrivals, so upload latency cancels out.
        None when within, or before there are rates to compare with (RATE_WINDOW_S)."""
        mine = self._progress.get((member.learner_id, member.incarnation))
        if mine is None or not header.local_step:
            return None
        rates = [(l1 - l0) / (t1 - t0) for (lid, _), (t0, l0, t1, l1) in self._progress.items()
                 if lid != member.learner_id and t1 - t0 >= RATE_WINDOW_S and l1 > l0]
        if not rates:
            return None
        allowed = mine[1] + (self._clock() - mine[0]) * STEP_RATE_FACTOR * float(np.median(rates))
        excess = header.local_step - (allowed + self._plan.sync_period_steps)
        return max(1, header.steps - math.ceil(excess)) if excess > 0 else None

    # ------------------------------------------------------------------------------- payload

    async def open_payload(self, header: UploadHeader) -> IncomingPayload:
        """The payload of a validated header, to be fed chunk by chunk as it arrives. Decoded on
        arrival when a decoding permit is free now (taken without waiting: the transfer never
        stalls for one); otherwise only hashed, and decoded under a permit once complete
        (intake.Intake.accept), as a compressed payload always is. Release with
        `close_payload`."""
        slot = self._slots[header.fragment_id]
        last, last_norm = slot.last_outer_grad or (None, None)
        stats = robust_lib.DecodedStats(slot.fragment, last, last_norm,
                                        sample_index=self._directions.sample_index(header.fragment_id))
        permit = not self.decoding.locked() and header.payload.compression == "none"
        try:
            stream = serde.described_payload_stream(header.payload, on_chunk=stats.update, decode_on_arrival=permit,
                                                    buffers=self._buffers)
        except codec_lib.CodecError as exc:
            raise errors.InvalidArgument(f"fragment {header.fragment_id}: {exc}", reason=_codec_reason(exc)) from None
        if permit:
            await self.decoding.acquire()  # free (checked above, nothing awaited since): returns at once
        return IncomingPayload(stream, stats, permit)

    def close_payload(self, incoming: IncomingPayload | None) -> None:
        """Releases what `open_payload` took (the decoding permit), once."""
        if incoming is not None and incoming.permit:
            incoming.permit = False
            self.decoding.release()

    def decode_permit(self, payload) -> contextlib.AbstractAsyncContextManager:
        """The decoding permit a contribution holds from decode to fold-in: its own, for a payload
        decoded on arrival (IncomingPayload.permit), else one of `decoding`'s."""
        if isinstance(payload, IncomingPayload) and payload.permit:
            return contextlib.nullcontext()
        return self.decoding

    async def decode(self, header: UploadHeader, payload: bytes | IncomingPayload) -> Decoded:
        """The decoded contribution: finished in place when the payload was decoded on arrival,
        else decoded in a worker thread; INVALID_ARGUMENT when it does not decode."""
        if isinstance(payload, IncomingPayload):
            return await self._finish(header, payload)
        slot = self._slots[header.fragment_id]
        info = header.payload

        def decode() -> Decoded:
            last, last_norm = slot.last_outer_grad or (None, None)  # read once: a merge may replace it
            # Norms and the dot with the last merge are gathered while each decoded piece is in
            # cache (one pass, not three), and the decode itself is shared with a second thread.
            stats = robust_lib.DecodedStats(slot.fragment, last, last_norm,
                                            sample_index=self._directions.sample_index(header.fragment_id))
            values = serde.decode_described(info, payload, on_chunk=stats.update, executor=self._decode_helper)
            norms = stats.tensor_norms(values)
            return Decoded(values, norms, stats.cosine(values, norms),
                           self._directions.direction(header.fragment_id, values, stats.sample))

        try:
            return await asyncio.to_thread(decode)
        except codec_lib.CodecError as exc:
            raise errors.InvalidArgument(f"fragment {header.fragment_id}: {exc}", reason=_codec_reason(exc)) from None

    async def _finish(self, header: UploadHeader, incoming: IncomingPayload) -> Decoded:
        """Checks and finishes a streamed payload: in the event loop when it was decoded on arrival
        (a digest comparison, the tail and the norms: no thread hand-off), else in a worker thread."""

        def finish() -> Decoded:
            values = incoming.stream.finish()
            norms = incoming.stats.tensor_norms(values)
            return Decoded(values, norms, incoming.stats.cosine(values, norms),
                           self._directions.direction(header.fragment_id, values, incoming.stats.sample))

        try:
            return finish() if incoming.stream.decodes_on_arrival else await asyncio.to_thread(finish)
        except codec_lib.CodecError as exc:
            raise errors.InvalidArgument(f"fragment {header.fragment_id}: {exc}", reason=_codec_reason(exc)) from None

    async def await_direction_references(self, header: UploadHeader, heading: np.ndarray | None,
                                         wait_budget_s: float | None) -> None:
        """Holds a contribution that has too few others to be compared with (robust.DirectionPolicy
        .judge_wait_s) while other learners who could send them are live; proposes it as a
        reference for them meanwhile. Returns at once when the check is off or cannot apply."""
        policy = self._direction
        if heading is None or not policy.enabled or policy.judge_wait_s <= 0:
            return
        learner, fid = header.learner_id, header.fragment_id
        slot = self._slots[fid]
        if self._directions.references(learner, fid, slot.version) >= policy.min_others:
            return
        if self._directions.bootstrapped(fid):
            # Mid-run the references only aged out (a learner partitioned, hung or slow): waiting
            # for it would stall the others' merges until the liveness timeout. Only the first
            # contributions of a fragment wait for each other.
            self.direction_judgments["unjudged"] += 1
            return
        self._directions.propose(learner, fid, heading, slot.version)
        loop = asyncio.get_running_loop()
        wait_s = policy.judge_wait_s if wait_budget_s is None else min(policy.judge_wait_s, wait_budget_s)
        deadline = loop.time() + wait_s
        while self._directions.references(learner, fid, slot.version) < policy.min_others:
            if self._membership.comparable_learners(learner) < policy.min_others or loop.time() >= deadline:
                self.direction_judgments["unjudged"] += 1  # goes on without a comparison: visible
                return
            await asyncio.sleep(JUDGE_POLL_S)
        self.direction_judgments["waited"] += 1

    # ------------------------------------------------------------- under the fragment's lock

    async def bound_norm(self, slot: slots_lib.FragmentSlot, member: membership_lib.Member,
                         header: UploadHeader, steps: int,
                         decoded: Decoded) -> tuple[np.ndarray, np.ndarray]:
        """The contribution within the norm bound: as decoded, or clipped (counted, a strike when
        gross) with the "clip" action; INVALID_ARGUMENT beyond it with "reject". Returns the
        values and their per-tensor norms."""
        params_norm = await self._params_norm(slot)
        # Steps the syncer can vouch for: the contribution's mark is no later than the learner's
        # reported progress (plus one period of report lag), and the steps were capped to those
        # since its last merged mark (credited_steps).
        verified = 0 < header.local_step <= member.local_step + self._plan.sync_period_steps
        norms = decoded.norms
        verdict = slot.norms.check(header.learner_id, norms, steps, params_norm, steps_verified=verified)
        _LOG.debug("norm bound", extra={"fields": {"learner": header.learner_id, "fragment": header.fragment_id,
                                                   "steps": header.steps, "basis": verdict.basis,
                                                   "ratio": round(verdict.ratio, 4)}})
        if verdict.within:
            return await self._clip_norm(slot, header, steps, decoded.values, norms)
        detail, gross = self._norm_violation(slot, header, norms, verdict)
        if self._norm_bound.action == "reject":
            raise errors.InvalidArgument(detail, reason="norm_bound" if gross else "norm_bound_marginal")
        _LOG.warning(f"{detail}: clipped", extra={"fields": {"learner": header.learner_id}})
        # Accepted, but clipped: counted (not as a refusal) and a strike towards quarantine.
        reason = "clipped_norm_bound" if gross else "clipped_norm_bound_marginal"
        self._uploads[reason] += 1
        member.rejections[reason] += 1
        self._membership.flag(member, reason, work=work_key(header))
        values = await asyncio.to_thread(robust_lib.scale_tensors, decoded.values, slot.fragment, verdict.scales)
        return await self._clip_norm(slot, header, steps, values, norms * verdict.scales)

    async def _clip_norm(self, slot: slots_lib.FragmentSlot, header: UploadHeader, steps: int,
                         values: np.ndarray, norms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Median-of-norms clipping (robust.NormHistory.clip_scale): a contribution within the
        bound but far above the others' per-step norm is scaled down to clip_factor x it. Not a
        strike: it bounds what an update inside the (loose) reject bound can do to the merge."""
        total = float(np.sqrt(np.sum(np.square(norms))))
        scale = slot.norms.clip_scale(header.learner_id, total, steps, slot.version)
        if scale >= 1.0:
            return values, norms
        self._clip(self._clips.setdefault((header.learner_id, header.fragment_id), []), "norm")
        self._uploads["clipped_norm"] += 1
        scaled = await asyncio.to_thread(np.multiply, values, np.float32(scale), dtype=np.float32)
        return scaled, norms * scale

    async def _params_norm(self, slot: slots_lib.FragmentSlot) -> float:
        """The norm of the slot's current values: the bootstrap bound's reference (once per version)."""
        if slot.params_norm is None or slot.params_norm[0] != slot.params_sha256:
            digest = slot.params_sha256
            # float32 dot products with float64 totals: no float64 copy of the fragment.
            norm = await asyncio.to_thread(merge_lib.vector_norm, slot.params)
            slot.params_norm = (digest, norm)
        return slot.params_norm[1]

    def _norm_violation(self, slot: slots_lib.FragmentSlot, header: UploadHeader, norms: np.ndarray,
                        verdict: robust_lib.Verdict) -> tuple[str, bool]:
        """What to say about a contribution beyond the norm bound, and whether it is gross (a strike)."""
        basis = (f"{self._norm_bound.factor:g} x other learners' median" if verdict.basis == "others"
                 else f"{self._norm_bound.params_factor:g} x the global fragment's norm")
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
        if gross and "step_rate" in self._clips.get((header.learner_id, header.fragment_id), ()):
            # Its steps were cut to what the syncer's observed rates allow, so its norm is judged
            # per fewer steps than it took: an honest learner running faster than the others
            # measured (alone once they finished, after a late start) was refused as gross twice in
            # the hostile matrix, one strike short of quarantine. Still refused; not a strike.
            self._uploads["norm_bound_after_step_rate_clip"] += 1
            gross = False
        if verdict.basis == "others" and slot.norms.refused(header.learner_id):
            # A second learner refused against the same reference: the reference is stale
            # (robust.NormHistory.refused), not the learners. No strike for this one.
            self._uploads["norm_reference_reset"] += 1
            gross = False
        return detail, gross

    def cap_weight(self, slot: slots_lib.FragmentSlot, learner_id: str, steps: int, weight: float) -> float:
        """The merge weight, at most the norm history's cap for this learner."""
        cap = slot.norms.weight_cap(learner_id, steps)
        key = (learner_id, slot.fragment.fragment_id)
        if math.isinf(cap):
            self._unchecked.add(key)
        else:
            self._unchecked.discard(key)
        if weight > cap:
            self._uploads["capped_weight"] += 1
            self._clip(self._clips.setdefault((learner_id, slot.fragment.fragment_id), []), "batch")
            return cap
        return weight

    def judge_direction(self, header: UploadHeader, heading: np.ndarray | None, version: int) -> None:
        """INVALID_ARGUMENT for a contribution pointing away from the other learners' (direction check)."""
        turned = self._directions.judge(header.learner_id, header.fragment_id, heading, version)
        if turned.cosine is not None:
            _LOG.debug("direction", extra={"fields": {"learner": header.learner_id, "fragment": header.fragment_id,
                                                      "cosine": round(turned.cosine, 4), "others": turned.others,
                                                      "score": round(turned.score, 4)}})
        if not turned.within:
            raise errors.InvalidArgument(
                f"fragment {header.fragment_id}: the contribution points away from the other learners' (median "
                f"cosine {turned.cosine:+.3f} with their {turned.others} latest contributions, learner's recent "
                f"mean {turned.score:+.3f}, both < {self._direction.min_cosine:+g}): a sign-flipped update?",
                reason="direction")

    def accepted(self, slot: slots_lib.FragmentSlot, member: membership_lib.Member, header: UploadHeader,
                 decoded: Decoded, norms: np.ndarray, steps: int, weight: float) -> None:
        """Records a contribution folded into its round: the references later ones are checked
        against, the learner's direction agreement, its idempotency key and the counts."""
        total_norm = float(np.sqrt(np.sum(np.square(norms))))
        # As sent (before any clipping), against the reference before this one joins it.
        reference = slot.norms.clip_reference(header.learner_id, slot.version, steps)
        ratio = slot.norms.norm_ratio(header.learner_id, float(np.sqrt(np.sum(np.square(decoded.norms)))), steps,
                                      slot.version)
        slot.norms.add(header.learner_id, norms, steps, weight, slot.version)
        if header.local_step:
            progress = self._progress.setdefault((member.learner_id, member.incarnation),
                                                 [self._clock(), header.local_step, self._clock(), header.local_step])
            if header.local_step > progress[3]:
                progress[2:] = [self._clock(), header.local_step]
        if slot.round is not None:
            claimed = merge_lib.contribution_weight(header.tokens, header.steps)
            slot.round.influence.append({
                "learner": header.learner_id, "incarnation": header.incarnation,
                "base_version": header.base_version, "claimed_steps": header.steps,
                "claimed_tokens": header.tokens, "steps": steps, "claimed_weight": round(claimed, 9),
                "weight": weight, "norm": round(total_norm, 9),
                "norm_ratio": None if ratio is None else round(ratio, 6), "heading": decoded.heading,
                # The clip's reference: the others' median norm per step and steps (None: no clip).
                "norm_reference": None if reference is None else [round(reference[0], 9), reference[1]],
                "clipped": self._clips.pop((header.learner_id, header.fragment_id), [])})
        self._directions.add(header.learner_id, header.fragment_id, decoded.heading, slot.version)
        if decoded.agreement is not None:
            member.direction_sum += decoded.agreement
            member.direction_count += 1
        member.remember_accepted((header.fragment_id, header.base_version, header.local_step),
                                 header.payload.checksum)
        member.uploads_accepted += 1
        self._uploads["accepted"] += 1
