"""The Syncer gRPC servicer: decode -> SyncerCore -> encode. No state and no policy here.

Every `ServiceError` from the core becomes `context.abort(error.code, message)`; log lines carry
the `[Syncer.<Rpc>]` prefix.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from ddiloco.rpc import errors
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc
from ddiloco.wire import serde
from services.syncer import core as core_lib

_LOG = logging.getLogger("ddiloco.syncer")

# A WatchFragments stream re-checks fencing at least this often even when nothing changes.
_WATCH_POLL_S = 2.0


class SyncerServicer(syncer_pb2_grpc.SyncerServicer):
    def __init__(self, core: core_lib.SyncerCore, *, max_concurrent_uploads: int, upload_idle_timeout_s: float = 60.0) -> None:
        self._core = core
        self._upload_slots = asyncio.Semaphore(max_concurrent_uploads)
        self._max_uploads = max_concurrent_uploads
        self._upload_idle_timeout_s = upload_idle_timeout_s

    async def _abort(self, context: grpc.aio.ServicerContext, rpc: str, exc: errors.ServiceError) -> None:
        _LOG.info(f"[Syncer.{rpc}] {exc.code.name}: {exc}")
        await context.abort(exc.code, str(exc))

    async def Join(self, request, context):
        try:
            response = self._core.join(request)
        except errors.ServiceError as exc:
            await self._abort(context, "Join", exc)
        member = self._core.members.get(request.learner_id)
        self._core.count_bytes(member, inbound=request.ByteSize(), outbound=response.ByteSize())
        return response

    async def ReportProgress(self, request, context):
        try:
            return self._core.report_progress(request, wire_bytes=request.ByteSize())
        except errors.ServiceError as exc:
            await self._abort(context, "ReportProgress", exc)

    async def UploadFragment(self, request_iterator, context):
        # Bound memory: at most max_concurrent_uploads payloads are buffered at once.
        if self._upload_slots.locked():
            self._core.record_rejection("busy")
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._max_uploads} uploads already in flight; retry with backoff",
            )
        async with self._upload_slots:
            try:
                return await self._upload(request_iterator)
            except errors.ServiceError as exc:
                self._core.record_rejection(exc.reason)
                await self._abort(context, "UploadFragment", exc)

    async def _upload(self, request_iterator) -> syncer_pb2.UploadFragmentResponse:
        iterator = request_iterator.__aiter__()
        try:
            first = await asyncio.wait_for(iterator.__anext__(), self._upload_idle_timeout_s)
        except StopAsyncIteration:
            raise errors.InvalidArgument("empty upload stream: expected a header", reason="header") from None
        except asyncio.TimeoutError:
            raise errors.InvalidArgument("no header within the idle timeout", reason="header") from None
        if first.WhichOneof("kind") != "header":
            raise errors.InvalidArgument("the first message of an upload must be the header", reason="header")
        header = first.header
        ticket = self._core.validate_upload_header(header)
        wire_bytes = first.ByteSize()
        assembler = serde.ChunkAssembler(header.payload.payload_size_bytes)
        while not assembler.done:
            try:
                msg = await asyncio.wait_for(iterator.__anext__(), self._upload_idle_timeout_s)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise errors.InvalidArgument("upload stalled: no chunk within the idle timeout", reason="chunks") from None
            wire_bytes += msg.ByteSize()
            if msg.WhichOneof("kind") != "chunk":
                raise errors.InvalidArgument("a second header arrived inside one upload", reason="chunks")
            try:
                assembler.add(msg.chunk)
            except ValueError as exc:
                raise errors.InvalidArgument(str(exc), reason="chunks") from None
        try:
            payload = assembler.payload()
        except ValueError as exc:
            raise errors.InvalidArgument(str(exc), reason="chunks") from None
        return await self._core.accept_upload(ticket, payload, wire_bytes)

    async def WatchFragments(self, request, context):
        core = self._core
        observer = not request.learner_id  # evaluators and tools watch without joining
        try:
            core.check_protocol(request.protocol_version)
            if not observer:
                core.require_member(request.learner_id, request.incarnation)
        except errors.ServiceError as exc:
            await self._abort(context, "WatchFragments", exc)
        held = serde.versions_from_proto(request.held) if request.syncer_instance == core.instance else {}
        sent = {s.fragment.fragment_id: held.get(s.fragment.fragment_id, -1) for s in core.slots}
        chunk_size = core.config.chunk_size_bytes
        member = core.members.get(request.learner_id)
        seen = -1
        while True:
            if not observer and not core.is_current(request.learner_id, request.incarnation):
                # A newer life of this learner joined (or it left): end this stream.
                return
            seen = core.change_counter
            for slot in core.slots:
                fid = slot.fragment.fragment_id
                if slot.version <= sent[fid]:
                    continue
                version, encoded = await core.encoded_payload(slot)
                header = syncer_pb2.WatchFragmentsResponse(
                    header=syncer_pb2.GlobalFragmentHeader(
                        fragment_id=fid, version=version, syncer_instance=core.instance,
                        payload=serde.payload_info_to_proto(encoded),
                    )
                )
                out_bytes = header.ByteSize()
                yield header
                for chunk in serde.payload_chunks(encoded.payload, chunk_size):
                    msg = syncer_pb2.WatchFragmentsResponse(chunk=chunk)
                    out_bytes += msg.ByteSize()
                    yield msg
                core.count_bytes(member, outbound=out_bytes)
                sent[fid] = version
            await core.wait_for_change(seen, _WATCH_POLL_S)

    async def ReportEval(self, request, context):
        try:
            self._core.report_eval(request)
        except errors.ServiceError as exc:
            await self._abort(context, "ReportEval", exc)
        return syncer_pb2.ReportEvalResponse()

    async def Leave(self, request, context):
        try:
            self._core.leave(request)
        except errors.ServiceError as exc:
            await self._abort(context, "Leave", exc)
        return syncer_pb2.LeaveResponse()

    async def GetTrainingState(self, request, context):
        return syncer_pb2.GetTrainingStateResponse(state=self._core.training_state(request.recent_merges))

    async def WatchTrainingState(self, request, context):
        interval_s = max(request.min_interval_s, 0.1)
        while True:
            yield syncer_pb2.WatchTrainingStateResponse(state=self._core.training_state(request.recent_merges))
            await asyncio.sleep(interval_s)
