"""The upload half of the learner's SyncClient (client.py): one upload in flight per fragment.

Owns: the upload queue the training loop feeds (`submit_upload`: the latest job per fragment
wins), the uploader task of a session (`Uploader._upload_loop`), each upload's encoding, deadline,
bounded retries and verdict (`UploadOutcome`), the syncer's back-pressure holds, and the wire
form of one upload (`upload_messages`, `send_upload`). `Uploader` is a mixin of `SyncClient`: it
reads the session state the client keeps (run_config, instance, stub, the lock and the queues it
creates in its `__init__`).
Must not: join, watch or report progress (client.py does), nor decide what to upload (the loop).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import functools
import logging
import time

import grpc
import numpy as np

from ddiloco.rpc import errors as errors_lib
from ddiloco.rpc import retry as retry_lib
from ddiloco.v1 import syncer_pb2
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde

_LOG = logging.getLogger("ddiloco.learner")

# Upload endings that are not the syncer's verdict: the upload may or may not have been taken.
OUTCOME_UNKNOWN = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                             grpc.StatusCode.CANCELLED})
_UNKNOWN_OUTCOME_PAUSE_S = 0.2
# The status the grpc asyncio client gives a call whose write failed in the core because the call
# had already ended (grpc/aio/_call.py: set_internal_error), replacing the status that ended it
# (grpc/grpc#36066): a broken link, a deadline, or a refusal while chunks were still being written.
_WRITE_FAILED_DETAILS = "Internal error from Core"
# The longest back-pressure hold honoured: a syncer's hint is advice, not a reason to stall a fragment.
_MAX_UPLOAD_HOLD_S = 60.0
# ... and at most this many of the fragment's periods (H steps at this learner's step time): the
# hint asks for up to 31 periods (backpressure.MAX_FACTOR), and the syncer's gauge gets there within
# a few seconds of load, e.g. 16 learners starting on 2 cores; holds issued at that peak silenced
# learners for the whole minute, most of a short run (issue 20).
_MAX_HOLD_PERIODS = 8
# Refusals (ServiceError.reason, sent as trailing metadata) that end the session: this life of the
# learner is not (or no longer) a member, so the next step is a re-join.
_REJOIN_REASONS = frozenset({errors_lib.REASON_FENCED, errors_lib.REASON_NOT_JOINED})
# Refusals after which the same base may be sent again (the contribution was not taken, and a later
# try can succeed); INVALID_ARGUMENT, PERMISSION_DENIED, ALREADY_EXISTS and the like are final.
_RESENDABLE = frozenset({grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED,
                         grpc.StatusCode.CANCELLED})


def honoured_hold_s(hint_s: float, sync_period_steps: int, step_time_s: float) -> float:
    """The hold a learner honours for a back-pressure hint (`next_upload_after_s`): at most
    _MAX_HOLD_PERIODS of the fragment's periods at its step time and _MAX_UPLOAD_HOLD_S; none
    without a step time. Public so that load generators hold as learners do."""
    if step_time_s <= 0 or sync_period_steps <= 0:
        return 0.0
    return max(0.0, min(hint_s, _MAX_UPLOAD_HOLD_S, _MAX_HOLD_PERIODS * sync_period_steps * step_time_s))


@dataclasses.dataclass
class UploadJob:
    fragment_id: int
    base_version: int
    syncer_instance: str
    steps: int
    tokens: int
    delta: np.ndarray  # flat float32: global base - local
    local_step: int = 0  # the learner's step when the delta was taken (UploadHeader.local_step)
    final: bool = False  # the learner's last contribution of this fragment
    # Set by the client once encoded: the values the syncer will decode (the delta through a lossy
    # upload codec), which is what a merge adds to the global model (ddiloco.algo.arrival).
    sent_values: np.ndarray | None = None


# UploadOutcome.result values.
OUTCOME_ACCEPTED = "accepted"  # in the fragment's next merge (unless that round is dropped)
OUTCOME_DUPLICATE = "duplicate"  # accepted before (a retry)
OUTCOME_NOT_TAKEN = "not_taken"  # refused, failed, superseded or for another syncer life: never merged


@dataclasses.dataclass(frozen=True)
class UploadOutcome:
    fragment_id: int
    local_step: int
    result: str
    current_version: int = 0  # the fragment's version when the syncer accepted it


class SessionBroken(Exception):
    """The session must be re-established (re-join, new watch stream)."""


class Uploader:
    """SyncClient's uploads (see the module docstring)."""

    def submit_upload(self, job: UploadJob) -> None:
        """Queues an upload; a queued, not yet started upload of the same fragment is replaced."""
        with self._lock:
            replaced = self._uploads.get(job.fragment_id)
            self._uploads[job.fragment_id] = job
            if replaced is not None and replaced is not job:
                self._outcomes.append(UploadOutcome(replaced.fragment_id, replaced.local_step, OUTCOME_NOT_TAKEN))
        if self._upload_wakeup is not None:
            self._loop.call_soon_threadsafe(self._upload_wakeup.set)

    def take_refused(self) -> set[tuple[int, str, int]]:
        """(fragment, syncer instance, base version) of uploads refused since the last call, for a
        reason a later upload on the same base can get past (an open round, admission, a lost
        connection). The loop sends once per base version; without this, a refused upload would
        leave the fragment without this learner's contribution until a new version arrives, and
        a round that needs it to reach quorum would never merge (the fragment stalls)."""
        with self._lock:
            out, self._refused = self._refused, set()
        return out

    def take_outcomes(self) -> list[UploadOutcome]:
        """What became of submitted uploads since the last call, in order."""
        with self._lock:
            out, self._outcomes = self._outcomes, []
        return out

    def _requeue(self, job: UploadJob) -> None:
        """Queues a job whose fate is unknown again, unless a newer one of its fragment waits."""
        with self._lock:
            self._uploads.setdefault(job.fragment_id, job)

    def _outcome(self, job: UploadJob, result: str, current_version: int = 0) -> None:
        with self._lock:
            self._outcomes.append(UploadOutcome(job.fragment_id, job.local_step, result, current_version))

    # ---------------------------------------------------------------- client-loop internals

    async def _upload_loop(self) -> None:
        # One upload in flight per fragment, fragments side by side. Sent one after another, an
        # upload the syncer holds (a fragment's first contributions wait for each other's to be
        # judged against, robust.DirectionPolicy.judge_wait_s) held back this learner's other
        # fragments, which other learners' held uploads were waiting for in turn: 4 learners
        # split 2/2 over two fragments all waited the full judge window.
        with self._lock:
            # The previous session's task group ended every upload it started (_sent ran for each).
            self._sending.clear()
        self._upload_wakeup.set()  # what was queued while the session was down goes out now
        loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as group:  # a broken session ends every upload
            while True:
                await self._upload_wakeup.wait()
                self._upload_wakeup.clear()
                now = loop.time()
                with self._lock:
                    waiting = [fid for fid in self._uploads if fid not in self._sending]
                    # A learner's last contribution of a fragment is never held: it is leaving.
                    ready = sorted(fid for fid in waiting
                                   if self._uploads[fid].final or self._hold_until.get(fid, 0.0) <= now)
                    held = [self._hold_until[fid] for fid in waiting if fid not in ready]
                    for fid in ready[:max(0, self.cfg.max_concurrent_uploads - len(self._sending))]:
                        self._sending.add(fid)
                        job = self._uploads.pop(fid)
                        task = group.create_task(self._upload(job))
                        task.add_done_callback(functools.partial(self._sent, job))
                if held:  # look again when the first hold ends
                    loop.call_at(min(held), self._upload_wakeup.set)

    def _sent(self, job: UploadJob, task: asyncio.Task) -> None:
        """An upload task ended. A done callback, not a `finally` in the task: a task the session's
        group cancels before it first ran never enters its body, and its job was already off the
        queue. That happened when an upload gave up (the job requeued, the session breaking): the
        loop started the requeued job in the dying group, the group cancelled it unstarted, and the
        fragment stayed in `_sending` with its job lost, so no later upload of it (the barrier's
        resends included) ever went out again, and a round that needs every learner (dp, diloco)
        never merged."""
        if task.cancelled():
            # The session broke mid-upload (or before it began): the syncer may or may not have
            # taken it. The same job goes again once re-joined (idempotent on its key: a duplicate
            # if it was taken), never a new contribution carrying the same work (counted twice).
            self._requeue(job)
        with self._lock:
            self._sending.discard(job.fragment_id)
        self._upload_wakeup.set()  # a newer upload of this fragment, or one over the limit, may wait

    async def _upload(self, job: UploadJob) -> None:
        if job.syncer_instance != self.instance:
            # Based on another syncer life: worthless now. Whether that life merged it (and
            # checkpointed the merge) is for the new life's MergeReceipt to say, not this client.
            self.stats.uploads_refused += 1
            return
        messages = await self._encode(job)
        if messages is None:
            return
        # The chunks' size without their ByteSize(): upb serializes a message to size it.
        wire_bytes = messages[0].ByteSize() + serde.payload_chunks_bytes(
            messages[0].header.payload.payload_size_bytes, self.run_config.chunk_size_bytes)
        timeout_s = self.cfg.call_timeout_s + wire_bytes / self.cfg.upload_min_bandwidth_bytes_per_s
        sent_at = time.time()
        try:
            response = await self._send_attempts(job, messages, timeout_s, wire_bytes)
        except retry_lib.RetriesExhausted as exc:
            # An attempt may have been taken before the link failed: send the same job again later.
            self.stats.uploads_failed += 1
            self._requeue(job)
            self._record("failed", job, sent_at)
            _LOG.warning(str(exc))
            raise SessionBroken("uploads keep failing") from None
        except grpc.aio.AioRpcError as exc:
            await self._not_accepted(job, exc, sent_at)
            return
        if response is not None:
            self._accepted(job, response, sent_at)

    async def _encode(self, job: UploadJob) -> list | None:
        """The job's UploadFragment messages (None: a non-finite delta, never sent); sets
        `job.sent_values` to what the syncer will decode when the codec is lossy."""
        cfg = self.run_config
        codec = serde.codec_from_proto(cfg.upload_codec)
        try:
            encoded = await asyncio.to_thread(
                self.cfg.encode, job.delta, codec, block_size=cfg.upload_block_size, zstd_level=cfg.zstd_level
            )
        except codec_lib.NonFiniteError as exc:
            self.stats.uploads_refused += 1
            self._outcome(job, OUTCOME_NOT_TAKEN)
            _LOG.error(f"fragment {job.fragment_id} not sent: {exc}")
            return None
        if encoded.codec != "fp32":
            job.sent_values = await asyncio.to_thread(serde.decode_payload, serde.payload_info_to_proto(encoded),
                                                      encoded.payload)
        header = syncer_pb2.UploadHeader(
            protocol_version=serde.PROTOCOL_VERSION, learner_id=self.cfg.learner_id, incarnation=self.cfg.incarnation,
            fragment_id=job.fragment_id, base_version=job.base_version, syncer_instance=job.syncer_instance,
            steps=job.steps, tokens=job.tokens, payload=serde.payload_info_to_proto(encoded),
            local_step=job.local_step, final=job.final,
        )
        return upload_messages(header, encoded.payload, cfg.chunk_size_bytes)

    async def _send_attempts(self, job: UploadJob, messages: list, timeout_s: float, wire_bytes: int):
        """Sends the upload with bounded retries; the syncer's response, or None when a newer job of
        the fragment superseded it. Raises RetriesExhausted, or AioRpcError with a final status."""
        async for attempt in retry_lib.async_retrying(
            what=f"upload fragment {job.fragment_id}", timeout=datetime.timedelta(seconds=self.cfg.retry_bound_s),
            idempotent=True,  # keyed on (learner, incarnation, fragment, base): never applied twice
        ):
            with attempt:
                with self._lock:
                    superseded = job.fragment_id in self._uploads
                if superseded:
                    self._outcome(job, OUTCOME_NOT_TAKEN)
                    return None  # a newer pseudo-gradient of this fragment is queued; send that one
                self.stats.bytes_sent += wire_bytes
                if self._header_ack:
                    after_chunk = (lambda: self._failpoints.hit("learner.after_chunk")) if self._failpoints else None
                    return await send_upload(self._stub, messages, timeout_s, after_chunk=after_chunk,
                                             pipeline_bytes=self._pipeline_bytes)
                return await self._stub.UploadFragment(self._request_stream(messages), timeout=timeout_s)
        return None  # not reached: the retrying iterator either yields an attempt or raises

    async def _not_accepted(self, job: UploadJob, exc: grpc.aio.AioRpcError, sent_at: float) -> None:
        """An upload that ended with a status: sent again when its fate is unknown, else recorded
        as not taken (resendable on the same base when the refusal allows)."""
        code = exc.code()
        if code == grpc.StatusCode.INTERNAL and exc.details() == _WRITE_FAILED_DETAILS:
            # Not the syncer's verdict but the client's own: the call ended while this upload was
            # still being written, so the stream's end never went out and the syncer, which
            # takes an upload only at its end, did not take it. Whatever ended the call (a broken
            # link, most often), it is sent again like any upload whose call broke.
            _LOG.info(f"fragment {job.fragment_id} base {job.base_version}: the call ended while the "
                      "upload was being written (grpc reports INTERNAL, grpc/grpc#36066); sending it again")
            code = grpc.StatusCode.UNAVAILABLE
        if code in OUTCOME_UNKNOWN:
            # Not the syncer's verdict (a reset stream, a cancelled call): the upload may have been
            # taken. The same job goes again after a short pause (idempotent on its key).
            self.stats.uploads_failed += 1
            self._record("failed", job, sent_at, code=code.name)
            await asyncio.sleep(_UNKNOWN_OUTCOME_PAUSE_S)
            self._requeue(job)
            return
        self.stats.uploads_refused += 1
        self._outcome(job, OUTCOME_NOT_TAKEN)
        _LOG.info(f"fragment {job.fragment_id} base {job.base_version} refused: {code.name}: {exc.details()}")
        self._record("refused", job, sent_at, code=code.name)
        if code == grpc.StatusCode.FAILED_PRECONDITION and errors_lib.reason_of(exc) in _REJOIN_REASONS:
            # The syncer's typed reason, not its wording: fenced off by a newer life (the re-join
            # is refused and sets `fenced`), or forgotten by a restarted syncer (the re-join works).
            raise SessionBroken("the syncer no longer knows this learner") from None
        if code in _RESENDABLE:
            with self._lock:
                self._refused.add((job.fragment_id, job.syncer_instance, job.base_version))

    def _accepted(self, job: UploadJob, response: syncer_pb2.UploadFragmentResponse, sent_at: float) -> None:
        duplicate = response.result == syncer_pb2.UploadFragmentResponse.RESULT_DUPLICATE
        if response.next_upload_after_s > 0:  # back-pressure: the syncer is saturated
            hold_s = self._hold_s(response.next_upload_after_s)
            if hold_s > 0:
                with self._lock:  # take_calls reads it from the training thread
                    self._hold_until[job.fragment_id] = asyncio.get_running_loop().time() + hold_s
            self.stats.uploads_slowed += 1
            self.stats.last_upload_hold_s = hold_s
        self._outcome(job, OUTCOME_DUPLICATE if duplicate else OUTCOME_ACCEPTED, response.current_version)
        self._record("ack", job, sent_at, result="duplicate" if duplicate else "accepted")
        if duplicate:
            self.stats.uploads_duplicate += 1
        else:
            self.stats.uploads_accepted += 1

    def _hold_s(self, hint_s: float) -> float:
        """The hold honoured for a back-pressure hint: at most _MAX_HOLD_PERIODS of the fragment's
        periods at this learner's measured step time, never over _MAX_UPLOAD_HOLD_S; none before a
        step time is measured (a life's first step, which compiles, is not one: LearnerLoop). A
        hold folds periods together, and there is no period to fold yet: at a run's start, 16
        learners compiling on 2 cores saturated the syncer, and holds of the 60 s cap silenced
        learners for a minute, whose work a kill then lost whole (issue 20, goodput at 9a8ef93)."""
        with self._lock:
            progress = self._progress
        cfg = self.run_config
        if progress is None or cfg is None or progress.step_time_s <= 0 or cfg.sync_period_steps <= 0:
            return 0.0
        return honoured_hold_s(hint_s, cfg.sync_period_steps, progress.step_time_s)

    def _request_stream(self, messages: list):
        """The upload's messages; with the `learner.after_chunk` failpoint armed, a generator that
        may crash the process after a chunk went out (before the stream ends: a partial upload)."""
        if not self._failpoints:
            return iter(messages)

        def stream():
            for msg in messages:
                yield msg
                if msg.WhichOneof("kind") == "chunk":
                    self._failpoints.hit("learner.after_chunk")

        return stream()

    def _record(self, event: str, job: UploadJob, sent_at: float, **fields) -> None:
        """Appends to the fault-test history (`--history-file`), if any."""
        if self._history is not None:
            self._history.write(event, learner=self.cfg.learner_id, incarnation=self.cfg.incarnation,
                                instance=job.syncer_instance, fragment=job.fragment_id,
                                base_version=job.base_version, tokens=job.tokens, sent_at=sent_at, **fields)



def upload_messages(header: syncer_pb2.UploadHeader, payload: bytes, chunk_size_bytes: int) -> list:
    """The UploadFragment request messages of one upload: the header, then the payload's chunks."""
    return [syncer_pb2.UploadFragmentRequest(header=header)] + [
        syncer_pb2.UploadFragmentRequest(chunk=c) for c in serde.payload_chunks(payload, chunk_size_bytes)]


async def send_upload(stub, messages: list, timeout_s: float, *, after_chunk=None, pipeline_bytes: int = 0):
    """One UploadFragment call to a syncer that acknowledges headers (JoinResponse.upload_header_ack):
    sends the header and the chunks that start within `pipeline_bytes` of the payload
    (JoinResponse.upload_pipeline_bytes) at once, and the rest only after the syncer accepted the
    header (initial metadata). The header's round trip thus overlaps the transfer.

    A refusal of the header still arrives while nothing is being written: the syncer reads the
    pipelined chunks (and, when they were the whole payload, the end of the stream) before it
    sends the status. The grpc asyncio client replaces the status of a call whose write fails
    after the status came in with INTERNAL (grpc/grpc#36066), which would hide refusals worth
    resending (_RESENDABLE).

    Args:
        stub: a SyncerStub on an aio channel.
        messages: the header message, then the chunk messages.
        timeout_s: the call's deadline.
        after_chunk: called after each chunk is written (the `learner.after_chunk` failpoint).
        pipeline_bytes: the syncer's pipeline window (0: no chunk before the acknowledgement).

    Returns:
        The UploadFragmentResponse. Raises grpc.aio.AioRpcError with the syncer's status.
    """
    call = stub.UploadFragment(timeout=timeout_s)
    ack = None
    first = messages[0]
    if pipeline_bytes:  # the syncer reads that much before refusing the header (a copy: messages are reused)
        first = syncer_pb2.UploadFragmentRequest()
        first.CopyFrom(messages[0])
        first.header.pipeline_bytes = pipeline_bytes
    try:
        await call.write(first)
        # Resolves once the header is accepted (the syncer's acknowledgement), or empty when the
        # call is ending: the status may not have been processed yet, so done() is no test here.
        ack = asyncio.ensure_future(call.initial_metadata())
        offset_bytes = 0
        acknowledged = False
        for msg in messages[1:]:
            if not acknowledged and offset_bytes >= pipeline_bytes:
                metadata = await ack
                if tuple(serde.UPLOAD_HEADER_ACK) not in [tuple(item) for item in (metadata or ())]:
                    return await call  # raises the refusal's status
                acknowledged = True
            if call.done():
                break  # refused mid-stream: awaiting the call raises its status
            await call.write(msg)
            if not acknowledged:  # each read of a bytes field copies it: only while the window counts
                offset_bytes += len(msg.chunk.data)
            if after_chunk is not None:
                after_chunk()
        else:
            await call.done_writing()
    except asyncio.InvalidStateError:
        pass  # the call ended between the check and the write: its status is raised below
    finally:
        if ack is not None and not ack.done():
            ack.cancel()
    return await call
