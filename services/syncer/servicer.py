"""The Syncer gRPC servicer: decode -> SyncerCore -> encode. No state and no policy here.

Every `ServiceError` from the core becomes `context.abort(error.code, message)`, its reason in the
trailing metadata (errors.status_metadata); log lines carry
the `[Syncer.<Rpc>]` prefix. Authentication and the per-method role check happen before any
handler runs (security.AuthInterceptor); handlers check that a learner acts only as itself
(`security.require_learner`) before touching the core.

Upload order, cheapest first: identity (interceptor), total concurrency (waits for a slot), header, learner id ==
identity, per-learner concurrency, then the core's header checks (protocol, fencing, quarantine,
idempotency key, staleness, sizes against the fragment plan), chunks (order, sizes, count, total),
then the core's payload checks (checksum, zstd frame size before decompressing, values, norm bound).
Each chunk is hashed, and an uncompressed payload dequantized, as it arrives (admission.open_payload).
A refusal before the header's acknowledgement first reads what the learner may have pipelined
(_drain_window); responses carry the back-pressure hint (backpressure.LoadGauge).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
import weakref
from collections.abc import Callable

import grpc
from google.protobuf import message as protobuf_message

from ddiloco.rpc import errors
from ddiloco.rpc import security
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc
from ddiloco.wire import serde
from . import backpressure
from . import core as core_lib
from . import wire_views

_LOG = logging.getLogger("ddiloco.syncer")
_DEADLINE_MARGIN_S = 2.0  # left of an upload's deadline for the fold-in and the response

# A WatchFragments stream re-checks fencing at least this often even when nothing changes.
_WATCH_POLL_S = 2.0
# How long a refusal waits, at most, for the header and the pipelined chunks it drains first.
_BUSY_HEADER_WAIT_S = 1.0
# A learner may send the chunks that start within this many payload bytes before its header is
# acknowledged (JoinResponse.upload_pipeline_bytes): the header's round trip then overlaps the
# transfer instead of preceding it (one WAN RTT per upload), and a refused upload wastes at most
# this much plus one chunk. 4 MiB covers a 50 ms RTT at ~80 MB/s, and a default upload whole.
UPLOAD_PIPELINE_BYTES = 4 * 1024 * 1024
# Largest download chunk. gRPC keeps the message a watcher has not taken yet (serialized, per
# stream) until the peer's flow-control window lets it out, so a stream's buffered bytes are one
# chunk, not one fragment: with 64 watchers, 512 KiB chunks cost ~80 MiB more peak RSS than 128 KiB.
WATCH_CHUNK_BYTES = 128 * 1024


async def _next_request(iterator, timeout_s: float):
    """The upload stream's next message (StopAsyncIteration at its end, TimeoutError after
    timeout_s). grpc deserializes each message as it is read and raises the parser's DecodeError
    from the read: a frame that is not an UploadFragmentRequest is bad input from the client
    (INVALID_ARGUMENT, reason "malformed"), not an internal error of the syncer."""
    try:
        # A deadline on the read itself, not asyncio.wait_for: that wraps each read in a Task of
        # its own (one more hand-off through the event loop per chunk, for every chunk).
        async with asyncio.timeout(timeout_s):
            return await iterator.__anext__()
    except protobuf_message.DecodeError:
        raise errors.InvalidArgument("a message of the upload stream is not a valid UploadFragmentRequest",
                                     reason="malformed") from None


@dataclasses.dataclass(frozen=True)
class StreamCap:
    """Concurrent streams of one watch RPC: at most `total`, and `per_identity` per authenticated
    caller (without authentication every caller is anonymous and only `total` applies). `flag` names
    the setting in refusals."""

    total: int
    per_identity: int
    flag: str

    def __post_init__(self) -> None:
        if self.total < 1 or self.per_identity < 1:
            raise ValueError(f"stream caps must be >= 1, got total={self.total} per_identity={self.per_identity}")


# Each WatchTrainingState stream rebuilds the training state as often as every 0.1 s; each
# WatchFragments stream holds a buffered chunk (WATCH_CHUNK_BYTES) and wakes on every merge. A
# caller must not be able to open them without bound.
STATE_WATCH_CAP = StreamCap(total=64, per_identity=16, flag="--max-state-watchers")
FRAGMENT_WATCH_CAP = StreamCap(total=1024, per_identity=8, flag="--max-fragment-watchers")


class _OpenStreams:
    """The open streams of one watch RPC, in total and per identity (the servicer's event loop
    only: no lock). A slot is released by the call's done callback, which grpc runs however the
    call ends (finished, cancelled by the client, aborted, shut down)."""

    def __init__(self, rpc: str, cap: StreamCap, on_refused: Callable[[str, str], None] | None = None) -> None:
        self._rpc = rpc
        self._cap = cap
        self._on_refused = on_refused or (lambda rpc, limit: None)  # (rpc, "total" | "per_identity"): metrics
        self._total = 0
        self._per_identity: collections.Counter[str] = collections.Counter()

    def open(self, identity: security.Identity, context) -> None:
        """Takes a slot for the call of `context` (ResourceExhausted when none is left)."""
        cap = self._cap
        if self._total >= cap.total:
            self._on_refused(self._rpc, "total")
            raise errors.ResourceExhausted(
                f"{self._rpc}: {self._total} streams are open, the syncer's limit ({cap.flag} {cap.total}); "
                "close one or retry later", reason="watch_streams")
        key = "" if identity.anonymous else str(identity)
        if key and self._per_identity[key] >= cap.per_identity:
            self._on_refused(self._rpc, "per_identity")
            raise errors.ResourceExhausted(
                f"{self._rpc}: {key} already has {self._per_identity[key]} streams open, the limit per identity "
                f"({cap.flag}-per-identity {cap.per_identity}); close one before opening another",
                reason="watch_streams_identity")
        self._total += 1
        if key:
            self._per_identity[key] += 1
        released = False

        def release(_context) -> None:
            nonlocal released
            if released:
                return
            released = True
            self._total -= 1
            if key:
                self._per_identity[key] -= 1
                if not self._per_identity[key]:
                    del self._per_identity[key]

        context.add_done_callback(release)

    @property
    def total(self) -> int:
        return self._total


class _UploadScope:
    """What one upload stream has claimed and read so far: its learner id once read, an in-flight
    count, its payload as it streams in, and how far into the pipeline window it was read."""

    learner_id = ""
    counted = False
    incoming = None  # admission.IncomingPayload
    header_read = False
    acknowledged = False
    drained = False
    window_bytes = 0  # UploadHeader.pipeline_bytes: what the learner sends before the acknowledgement
    offset_bytes = 0  # payload bytes read while draining (chunks that start below the window)
    last_seen = False


class _Messages(list):
    """One version's WatchFragments messages (the header, then the chunks) and their wire bytes."""

    __slots__ = ("__weakref__", "encoded", "wire_bytes")


class _WatchMessages:
    """The WatchFragments messages of each fragment's newest version, built once and shared by
    every watcher: each version goes to every learner, and building the messages per watcher
    copied the payload three times per learner (CPU and memory grew with the learners).

    A whole version (exact float32: a join, or a learner more than one version behind) is kept
    only while some watch stream still sends it (a weak reference): kept until the next whole
    download, it held a copy of the fragment and pinned that version's values (8 bytes per owned
    parameter at a shard's peak, mostly version 0's from the joins at start). Deltas (~0.5 bytes
    per value with int4, sent to every learner at every version) stay cached."""

    def __init__(self) -> None:
        # (fragment_id, delta) -> (version, the messages: themselves for a delta, a weak reference
        # for a whole version)
        self._newest: dict[tuple[int, bool], tuple[int, object]] = {}

    def get(self, instance: str, fid: int, version: int, encoded, delta: bool,
            chunk_size_bytes: int, epoch: int = 0) -> tuple[list, int]:
        key = (fid, delta)
        entry = self._newest.get(key)
        if entry is not None and entry[0] == version:
            cached = entry[1] if delta else entry[1]()
            if cached is not None and cached.encoded is encoded:
                return cached, cached.wire_bytes
        header = syncer_pb2.WatchFragmentsResponse(
            header=syncer_pb2.GlobalFragmentHeader(
                fragment_id=fid, version=version, syncer_instance=instance,
                payload=serde.payload_info_to_proto(encoded),
                delta=delta, delta_base_version=version - 1 if delta else 0, epoch=epoch,
            )
        )
        messages = _Messages((header, *(syncer_pb2.WatchFragmentsResponse(chunk=chunk)
                                        for chunk in serde.payload_chunks(encoded.payload, chunk_size_bytes))))
        messages.encoded = encoded
        messages.wire_bytes = sum(m.ByteSize() for m in messages)
        if entry is None or entry[0] <= version:  # a slow watcher's older version is not kept
            self._newest[key] = (version, messages if delta else weakref.ref(messages))
        return messages, messages.wire_bytes


class SyncerServicer(syncer_pb2_grpc.SyncerServicer):
    def __init__(self, core: core_lib.SyncerCore, *, max_concurrent_uploads: int, upload_idle_timeout_s: float = 60.0,
                 max_concurrent_uploads_per_learner: int = 4, state_watch_cap: StreamCap = STATE_WATCH_CAP,
                 fragment_watch_cap: StreamCap = FRAGMENT_WATCH_CAP,
                 upload_pipeline_bytes: int = UPLOAD_PIPELINE_BYTES) -> None:
        self._core = core
        self._pipeline_bytes = upload_pipeline_bytes
        self._gauge = backpressure.LoadGauge(contended=lambda: self._uploads_running > 1)

        def refused(rpc: str, limit: str) -> None:
            core.note_watch_refused(rpc, limit)  # ddiloco_syncer_watch_refusals_total

        self._state_streams = _OpenStreams("WatchTrainingState", state_watch_cap, refused)
        self._fragment_streams = _OpenStreams("WatchFragments", fragment_watch_cap, refused)
        self._upload_slots = asyncio.Semaphore(max_concurrent_uploads)
        self._max_uploads = max_concurrent_uploads
        self._max_per_learner = max_concurrent_uploads_per_learner
        self._in_flight: dict[str, int] = {}
        self._upload_idle_timeout_s = upload_idle_timeout_s
        self._watch_messages = _WatchMessages()
        self._uploads_running = 0
        self._ending_streams = asyncio.Event()
        # The leader epoch (services/syncer/leadership.py) on every version and join answer; 0
        # without election. Set once, before this syncer serves learners as the leader.
        self.epoch = 0
        self.leader_address = ""  # the leader as last seen (standby), for the training state

    async def end_streams(self, timeout_s: float) -> None:
        """Shutdown, once the server refuses new calls: waits (at most timeout_s) for the uploads in
        flight, then ends every watch stream with UNAVAILABLE. Watch streams never finish on their
        own, so without this the server's stop held the whole grace period open while learners'
        uploads were refused: a rolling restart took 7 s instead of 2, longer than a learner's
        retry bound in the chaos rows (an upload 'failed', CI)."""
        deadline = time.monotonic() + timeout_s
        while self._uploads_running and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self._ending_streams.set()
        self._core.wake_watchers()
        await self._gauge.stop()

    async def _end_if_shutting_down(self, context) -> None:
        if self._ending_streams.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the syncer is shutting down; reconnect")

    async def _abort(self, context: grpc.aio.ServicerContext, rpc: str, exc: errors.ServiceError) -> None:
        _LOG.info(f"[Syncer.{rpc}] {exc.code.name}: {exc}")
        if isinstance(exc, (errors.PermissionDenied, errors.Unauthenticated)) and exc.reason != "quarantined":
            self._record_auth_failure(rpc, exc)
        # The reason rides along as trailing metadata: learners act on it (fenced, not joined).
        await context.abort(exc.code, str(exc), trailing_metadata=errors.status_metadata(exc))

    def _record_auth_failure(self, rpc: str, exc: errors.ServiceError) -> None:
        if getattr(exc, "recorded", False):
            return
        exc.recorded = True
        caller = security.current_identity()
        self._core.record_auth_failure(exc.reason, caller=caller.name if caller.kind == security.KIND_LEARNER else "",
                                       method=rpc)

    def record_interceptor_refusal(self, method: str, reason: str) -> None:
        """AuthInterceptor's on_reject: counts calls refused before reaching a handler."""
        self._core.record_auth_failure(reason, method=method.rsplit("/", 1)[-1])

    async def Join(self, request, context):
        self._gauge.start()  # on the serving loop, from the first learner on (idempotent)
        try:
            security.require_learner(request.learner_id)
            joined = self._core.join(wire_views.join_args(request))
        except errors.ServiceError as exc:
            await self._abort(context, "Join", exc)
        response = wire_views.join_response(self._core, joined.member, assign_data_shard=joined.assign_data_shard)
        response.upload_header_ack = True  # see UploadFragment: initial metadata once the header passed
        response.epoch = self.epoch
        response.upload_pipeline_bytes = self._pipeline_bytes
        self._core.count_bytes(joined.member, inbound=request.ByteSize(), outbound=response.ByteSize())
        return response

    async def ReportProgress(self, request, context):
        try:
            security.require_learner(request.learner_id)
            self._core.report_progress(wire_views.progress(request), wire_bytes=request.ByteSize())
            return wire_views.progress_response(self._core.versions(), budget_reached=self._core.budget_reached())
        except errors.ServiceError as exc:
            await self._abort(context, "ReportProgress", exc)

    async def UploadFragment(self, request_iterator, context):
        # Bound memory: at most max_concurrent_uploads payloads are buffered at once, and at most
        # max_concurrent_uploads_per_learner of them from one learner. Uploads beyond the first
        # bound wait for a slot, their header unread and unacknowledged, which holds the learner
        # at its pipeline window (back-pressure: nothing is refused for load alone).
        self._gauge.start()
        iterator = request_iterator.__aiter__()
        scope = _UploadScope()
        if self._upload_slots.locked():
            self._core.count_upload("waited_for_slot")
            remaining_s = context.time_remaining()
            wait_s = None if remaining_s is None else max(0.0, remaining_s - _DEADLINE_MARGIN_S)
            try:
                await asyncio.wait_for(self._upload_slots.acquire(), wait_s)
            except asyncio.TimeoutError:
                # Only the learner's own deadline ends the wait: it hears why before the deadline.
                self._core.record_rejection("busy")
                await self._drain_window(iterator, scope, _BUSY_HEADER_WAIT_S)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"no upload slot within the call's deadline ({self._max_uploads} uploads in "
                                    "flight); retry with backoff")
        else:
            await self._upload_slots.acquire()
        self._uploads_running += 1
        try:
            return await self._upload(iterator, scope, context)
        except errors.ServiceError as exc:
            if isinstance(exc, (errors.PermissionDenied, errors.Unauthenticated)) and exc.reason != "quarantined":
                self._record_auth_failure("UploadFragment", exc)
            else:
                self._core.record_rejection(exc.reason, scope.learner_id, exc)
            await self._drain_window(iterator, scope, _BUSY_HEADER_WAIT_S)
            await self._abort(context, "UploadFragment", exc)
        except Exception as exc:  # a bug, not bad input: still one status and one counter
            _LOG.exception("[Syncer.UploadFragment] internal error")
            self._core.record_rejection("internal", scope.learner_id, exc)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error while handling the upload")
        finally:
            self._upload_slots.release()
            self._uploads_running -= 1
            self._core.close_payload(scope.incoming)
            if scope.counted:
                self._in_flight[scope.learner_id] -= 1
                if not self._in_flight[scope.learner_id]:
                    del self._in_flight[scope.learner_id]

    async def _drain_window(self, iterator, scope: _UploadScope, timeout_s: float) -> None:
        """Before refusing an upload whose header was not acknowledged: reads the header, if still
        unread, and the chunks the learner may send ahead of the acknowledgement (those starting
        within upload_pipeline_bytes), so that the refusal's status reaches a learner waiting for
        the acknowledgement, not one writing (grpc/grpc#36066 turns that into INTERNAL). At most
        `timeout_s` in all, and never past the window: bytes wasted on a refusal stay bounded."""
        if scope.acknowledged or scope.drained:
            return
        scope.drained = True
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(Exception):  # whatever the stream does now, the refusal goes out
            if not scope.header_read:
                first = await asyncio.wait_for(iterator.__anext__(), timeout_s)
                scope.header_read = True
                scope.window_bytes = first.header.pipeline_bytes if first.WhichOneof("kind") == "header" else 0
            # Chunks that start within the learner's window, then the stream's end if the last one did.
            window_bytes = min(scope.window_bytes, self._pipeline_bytes)
            while scope.offset_bytes < window_bytes or (scope.last_seen and window_bytes):
                msg = await asyncio.wait_for(iterator.__anext__(), max(0.0, deadline - time.monotonic()))
                if msg.WhichOneof("kind") != "chunk" or scope.last_seen:
                    return
                scope.offset_bytes += len(msg.chunk.data)
                scope.last_seen = msg.chunk.last

    async def _upload(self, iterator, scope: _UploadScope, context) -> syncer_pb2.UploadFragmentResponse:
        try:
            first = await _next_request(iterator, self._upload_idle_timeout_s)
        except StopAsyncIteration:
            raise errors.InvalidArgument("empty upload stream: expected a header", reason="header") from None
        except asyncio.TimeoutError:
            raise errors.InvalidArgument("no header within the idle timeout", reason="header") from None
        scope.header_read = True
        scope.window_bytes = first.header.pipeline_bytes
        if first.WhichOneof("kind") != "header":
            raise errors.InvalidArgument("the first message of an upload must be the header", reason="header")
        header = first.header
        security.require_learner(header.learner_id)
        scope.learner_id = header.learner_id
        if self._in_flight.get(header.learner_id, 0) >= self._max_per_learner:
            raise errors.ResourceExhausted(
                f"learner {header.learner_id!r} already has {self._max_per_learner} uploads in flight; "
                "retry with backoff", reason="busy_learner")
        self._in_flight[header.learner_id] = self._in_flight.get(header.learner_id, 0) + 1
        scope.counted = True
        ticket = self._core.validate_upload_header(wire_views.upload_header(header))
        scope.incoming = incoming = None if ticket.duplicate else await self._core.open_payload(ticket.header)
        # Acknowledge the header (the learner sends past its pipeline window only after it). Every
        # refusal so far reached a learner that was not writing: it sent at most its window, which
        # _drain_window reads before the status goes out.
        await context.send_initial_metadata((serde.UPLOAD_HEADER_ACK,))
        scope.acknowledged = True
        wire_bytes = first.ByteSize()
        assembler = serde.ChunkAssembler(header.payload.payload_size_bytes,
                                         max_chunk_bytes=self._core.run.chunk_size_bytes, keep=incoming is None)
        while not assembler.done:
            try:
                msg = await _next_request(iterator, self._upload_idle_timeout_s)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise errors.InvalidArgument("upload stalled: no chunk within the idle timeout", reason="chunks") from None
            if msg.WhichOneof("kind") != "chunk":
                raise errors.InvalidArgument("a second header arrived inside one upload", reason="chunks")
            # Each read of a bytes field copies it, and ByteSize() serializes the message: the
            # chunk's bytes are read once, and its wire size computed from their length.
            chunk = msg.chunk
            data = chunk.data
            wire_bytes += serde.chunk_message_bytes(chunk.seq, len(data), chunk.last)
            try:
                assembler.add(chunk, data)
            except ValueError as exc:
                raise errors.InvalidArgument(str(exc), reason="chunks") from None
            if incoming is not None:
                incoming.feed(data)  # hashed and, when it can be, decoded now
        try:
            payload = assembler.payload()
        except ValueError as exc:
            raise errors.InvalidArgument(str(exc), reason="chunks") from None
        # The stream must end with the last chunk: anything after it is refused, not ignored.
        try:
            extra = await _next_request(iterator, self._upload_idle_timeout_s)
        except StopAsyncIteration:
            extra = None
        except asyncio.TimeoutError:
            raise errors.InvalidArgument("upload stalled: the stream did not end after its last chunk",
                                         reason="chunks") from None
        if extra is not None:
            raise errors.InvalidArgument("a message arrived after the last chunk", reason="chunks")
        # A contribution may wait to be judged (direction check); never past the learner's deadline.
        remaining_s = context.time_remaining()
        budget_s = None if remaining_s is None else max(0.0, remaining_s - _DEADLINE_MARGIN_S)
        accepted = await self._core.accept_upload(ticket, payload if incoming is None else incoming, wire_bytes,
                                                  wait_budget_s=budget_s)
        response = wire_views.upload_response(**accepted._asdict())
        period_s = self._core.plan.sync_period_steps * self._core.step_time_s()
        response.next_upload_after_s = self._gauge.next_upload_after_s(period_s)
        if response.next_upload_after_s:
            self._core.count_upload("slowed")
            self._core.note_hold(ticket.header, response.next_upload_after_s)
        return response

    async def WatchFragments(self, request, context):
        core = self._core
        observer = not request.learner_id  # evaluators and tools watch without joining
        try:
            if observer:  # the stream carries the model's weights: not for state readers
                security.require_kind(*sorted(security.MODEL_READ_KINDS))
            else:
                security.require_learner(request.learner_id)
            core.check_protocol(request.protocol_version)
            if not observer:
                core.require_member(request.learner_id, request.incarnation)
            self._fragment_streams.open(security.current_identity(), context)
        except errors.ServiceError as exc:
            await self._abort(context, "WatchFragments", exc)
        held = serde.versions_from_proto(request.held) if request.syncer_instance == core.instance else {}
        # A shard streams (and calls learners to) only the fragments it owns.
        sent = {fid: held.get(fid, -1) for fid in core.owned_fragment_ids()}
        chunk_size = min(core.run.chunk_size_bytes, WATCH_CHUNK_BYTES)
        member = core.member(request.learner_id)
        called = dict.fromkeys(sent, 0)  # the last round this learner was called to
        seen = -1
        while True:
            await self._end_if_shutting_down(context)
            if not observer and not core.is_current(request.learner_id, request.incarnation):
                # A newer life of this learner joined (or it left): end this stream.
                return
            seen = core.change_counter
            if not observer:
                for fid in sent:
                    call = core.round_call(fid, request.learner_id)
                    if call is not None and call.round > called[call.fragment_id]:
                        called[call.fragment_id] = call.round
                        yield syncer_pb2.WatchFragmentsResponse(round_call=wire_views.round_call(call))
            for fid in sent:
                download = await core.download(fid, sent[fid], accept_delta=request.accept_delta)
                if download is None:
                    continue
                version, encoded, is_delta = download
                messages, out_bytes = self._watch_messages.get(core.instance, fid, version, encoded,
                                                                is_delta, chunk_size, self.epoch)
                if not observer:  # which of this learner's work the version holds (rebase on arrival)
                    receipt = wire_views.merge_receipt(
                        fid, version, core.merged_through_step(request.learner_id, request.incarnation, fid, version))
                    yield syncer_pb2.WatchFragmentsResponse(receipt=receipt)
                    out_bytes += receipt.ByteSize()
                for msg in messages:
                    yield msg
                core.count_bytes(member, outbound=out_bytes, codec=encoded.codec)
                messages = encoded = download = None  # not held while this stream waits (_WatchMessages)
                sent[fid] = version
                if not observer:
                    core.broadcast_sent(request.learner_id, fid, version)
            await core.wait_for_change(seen, _WATCH_POLL_S)

    async def ReportEval(self, request, context):
        try:
            self._core.report_eval(wire_views.eval_report(request))
        except errors.ServiceError as exc:
            await self._abort(context, "ReportEval", exc)
        return syncer_pb2.ReportEvalResponse()

    async def Leave(self, request, context):
        try:
            security.require_learner(request.learner_id)
            self._core.leave(**wire_views.leave_args(request))
        except errors.ServiceError as exc:
            await self._abort(context, "Leave", exc)
        return syncer_pb2.LeaveResponse()

    def _training_state(self, recent_merges: int) -> syncer_pb2.TrainingState:
        state = wire_views.training_state(self._core, recent_merges)
        state.epoch, state.leader_address = self.epoch, self.leader_address
        return state

    async def GetTrainingState(self, request, context):
        return syncer_pb2.GetTrainingStateResponse(state=self._training_state(request.recent_merges))

    async def WatchTrainingState(self, request, context):
        try:
            self._state_streams.open(security.current_identity(), context)
        except errors.ServiceError as exc:
            await self._abort(context, "WatchTrainingState", exc)
        interval_s = max(request.min_interval_s, 0.1)
        while True:
            await self._end_if_shutting_down(context)
            yield syncer_pb2.WatchTrainingStateResponse(state=self._training_state(request.recent_merges))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._ending_streams.wait(), interval_s)
