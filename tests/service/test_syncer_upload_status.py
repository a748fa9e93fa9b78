"""Upload refusals reach the learner with their own status, through a real syncer servicer on 127.0.0.1:0.

The syncer acknowledges an accepted upload header with initial metadata and the learner sends
chunks only after it (`ddiloco.learner.client.send_upload`). Without that handshake a refusal of
the header races the learner's chunk writes, and the grpc asyncio client reports a write that
fails after the status arrived as INTERNAL (grpc/grpc#36066): the learner then cannot tell a
refusal worth resending from a bug. Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest

from ddiloco.algo import fragments as fragments_lib
from ddiloco.rpc import channel as channel_lib
from ddiloco.rpc import errors
from ddiloco.rpc import security
from ddiloco.v1 import common_pb2, syncer_pb2
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde
from ddiloco.learner import client as client_lib
from services.syncer import config as config_lib
from services.syncer import core as core_lib
from services.syncer import membership as membership_lib
from services.syncer import servicer as servicer_lib
from services.syncer import wire_views
from tests.fakes import make_core, settle_until
from tests.service.conftest import serve_syncer

pytestmark = pytest.mark.timeout(120)

NUMEL = 1 << 20  # 4 MiB of fp32: 64 chunks of 64 KiB, so a refused upload has many writes left
CHUNK_BYTES = 64 * 1024


def _core() -> core_lib.SyncerCore:
    # A quorum of 2 that one learner never reaches: an accepted upload is folded in, never merged.
    cfg = config_lib.SyncerConfig(num_fragments=1, sync_period_steps=1, upload_codec="fp32", chunk_size_bytes=CHUNK_BYTES,
                                  min_quorum=2)
    return make_core(config=cfg, specs=[fragments_lib.TensorSpec("w", (1024, 1024))], initial_std=0.0,
                     grace_gamma=0.0, max_grace_s=0.0)


def _messages(core, *, base_version: int, instance: str | None = None, seed: int = 0) -> list:
    values = np.random.default_rng(seed).standard_normal(NUMEL).astype(np.float32) * np.float32(1e-3)
    enc = codec_lib.encode(values, "fp32")
    header = syncer_pb2.UploadHeader(
        protocol_version=serde.PROTOCOL_VERSION, learner_id="learner-0", incarnation=1, fragment_id=0,
        base_version=base_version, syncer_instance=core.instance if instance is None else instance,
        steps=2, tokens=200, payload=serde.payload_info_to_proto(enc))
    return [syncer_pb2.UploadFragmentRequest(header=header)] + [
        syncer_pb2.UploadFragmentRequest(chunk=c) for c in serde.payload_chunks(enc.payload, CHUNK_BYTES)]


async def _join(stub) -> syncer_pb2.JoinResponse:
    return await stub.Join(syncer_pb2.JoinRequest(protocol_version=serde.PROTOCOL_VERSION, learner_id="learner-0",
                                                  incarnation=1), timeout=10)


def test_refused_headers_keep_their_status_and_accepted_uploads_go_through():
    async def run():
        core = _core()
        async with serve_syncer(core) as served:
            joined = await _join(served.stub)
            assert joined.upload_header_ack
            stale = _messages(core, base_version=0, instance="another-syncer-life")
            codes = []
            for _ in range(40):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await asyncio.wait_for(client_lib.send_upload(served.stub, stale, 10.0), 15)
                codes.append((info.value.code(), info.value.details()))
            assert {code for code, _ in codes} == {grpc.StatusCode.FAILED_PRECONDITION}, codes[:3]
            assert all("instance" in details for _, details in codes), codes[0]

            chunks_written, good = [], _messages(core, base_version=0)
            response = await asyncio.wait_for(client_lib.send_upload(
                served.stub, good, 10.0, after_chunk=lambda: chunks_written.append(1)), 15)
            assert response.result == syncer_pb2.UploadFragmentResponse.RESULT_ACCEPTED
            assert len(chunks_written) == len(good) - 1 > 30
            assert core.membership.members["learner-0"].uploads_accepted == 1

    asyncio.run(run())


def test_a_full_syncer_holds_an_upload_until_a_slot_frees_and_refuses_only_at_its_deadline():
    """Back-pressure, not refusal: an upload beyond max_concurrent_uploads waits for a slot (its
    header unacknowledged) and goes through once one frees; only an upload whose deadline comes
    first is refused, with RESOURCE_EXHAUSTED (not INTERNAL) before that deadline."""
    async def run():
        core = _core()
        async with serve_syncer(core, max_concurrent_uploads=1) as served:
            await _join(served.stub)
            # Hold the only upload slot: a header that is accepted, then no chunk.
            holder = served.stub.UploadFragment(timeout=30)
            await holder.write(_messages(core, base_version=0)[0])
            await asyncio.wait_for(holder.initial_metadata(), 10)
            try:
                # A 3 s deadline: the slot wait ends 2 s (the servicer's margin) before it.
                started = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await asyncio.wait_for(client_lib.send_upload(
                        served.stub, _messages(core, base_version=0, seed=1), 3.0, pipeline_bytes=1 << 20), 15)
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
                assert time.monotonic() - started < 3.0
                assert core.membership.members["learner-0"].uploads_accepted == 0
                waiting = asyncio.ensure_future(client_lib.send_upload(
                    served.stub, _messages(core, base_version=0, seed=2), 20.0, pipeline_bytes=1 << 20))
                await asyncio.sleep(1.0)
                assert not waiting.done()  # held, not refused
            finally:
                holder.cancel()
            response = await asyncio.wait_for(waiting, 15)
            assert response.result == syncer_pb2.UploadFragmentResponse.RESULT_ACCEPTED
            assert core.membership.members["learner-0"].uploads_accepted == 1
            assert core.uploads["waited_for_slot"] >= 2

    asyncio.run(run())


def test_refused_pipelined_headers_keep_their_status():
    """With chunks sent ahead of the acknowledgement (JoinResponse.upload_pipeline_bytes), a refused
    header still comes back with its own status, whether the window covers part of the payload or
    all of it (then the stream's end is pipelined too); an accepted upload goes through."""
    async def run():
        core = _core()
        async with serve_syncer(core) as served:
            joined = await _join(served.stub)
            assert joined.upload_pipeline_bytes > 0
            stale = _messages(core, base_version=0, instance="another-syncer-life")
            codes = []
            for window in (CHUNK_BYTES * 3, joined.upload_pipeline_bytes, NUMEL * 4 + 1) * 10:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await asyncio.wait_for(client_lib.send_upload(served.stub, stale, 10.0, pipeline_bytes=window), 15)
                codes.append((info.value.code(), info.value.details()))
            assert {code for code, _ in codes} == {grpc.StatusCode.FAILED_PRECONDITION}, codes[:3]
            response = await asyncio.wait_for(client_lib.send_upload(
                served.stub, _messages(core, base_version=0), 10.0, pipeline_bytes=joined.upload_pipeline_bytes), 15)
            assert response.result == syncer_pb2.UploadFragmentResponse.RESULT_ACCEPTED
            assert core.membership.members["learner-0"].uploads_accepted == 1

    asyncio.run(run())


def test_a_corrupted_chunk_is_refused_as_a_checksum_error_and_nothing_of_it_is_merged():
    """Chunks are hashed and decoded as they arrive (admission.open_payload): a chunk corrupted
    in transit is refused with INVALID_ARGUMENT, reason "checksum", once the last byte is in;
    nothing of it enters a round, its decoding permit is given back, and the same upload sent
    intact afterwards is accepted."""
    async def run():
        core = _core()
        async with serve_syncer(core) as served:
            joined = await _join(served.stub)
            good = _messages(core, base_version=0, seed=7)
            assert good[0].header.payload.compression == common_pb2.COMPRESSION_NONE  # decoded on arrival
            bad = [syncer_pb2.UploadFragmentRequest() for _ in good]
            for copy, msg in zip(bad, good, strict=True):
                copy.CopyFrom(msg)
            data = bytearray(bad[5].chunk.data)
            data[1000] ^= 0x40
            bad[5].chunk.data = bytes(data)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await asyncio.wait_for(client_lib.send_upload(
                    served.stub, bad, 10.0, pipeline_bytes=joined.upload_pipeline_bytes), 15)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
            assert errors.reason_of(info.value) == "checksum", info.value.details()
            assert core.uploads["rejected_checksum"] == 1
            assert core.membership.members["learner-0"].uploads_accepted == 0
            slot = core.slots[0]
            assert slot.round is None or "learner-0" not in slot.round.learners
            # The status reaches the client before the handler's cleanup gives the permit back.
            def permits_back() -> bool:
                return not core.admission.decoding.locked() and core.admission.decoding._value == core.admission.max_decoding
            await settle_until(permits_back, timeout_s=10)
            assert permits_back(), (core.admission.decoding._value, core.admission.max_decoding)
            response = await asyncio.wait_for(client_lib.send_upload(
                served.stub, good, 10.0, pipeline_bytes=joined.upload_pipeline_bytes), 15)
            assert response.result == syncer_pb2.UploadFragmentResponse.RESULT_ACCEPTED
            assert core.membership.members["learner-0"].uploads_accepted == 1

    asyncio.run(run())


# Frames that are not UploadFragmentRequest messages: a length-delimited field 1 (the header) whose
# length runs past the end of the frame, and a field number 0 (never valid).
_GARBAGE_FRAMES = (b"\x0a\xff\xff\xff\x0f", b"\x00\x01\x02\x03")


def _send_raw_frames(address: str, frames: list[bytes]) -> grpc.RpcError:
    """Sends `frames` as the request messages of one UploadFragment call, unserialized, with the
    blocking client: it sends every frame and half-closes, then reads the status (the asyncio client
    can replace a status that arrives while it still writes with INTERNAL, grpc/grpc#36066)."""
    channel = channel_lib.sync_channel(address)
    try:
        upload = channel.stream_unary("/ddiloco.v1.Syncer/UploadFragment", request_serializer=None,
                                      response_deserializer=syncer_pb2.UploadFragmentResponse.FromString)
        with pytest.raises(grpc.RpcError) as info:
            upload(iter(frames), timeout=10)
        return info.value
    finally:
        channel.close()


def test_frames_that_are_not_messages_are_refused_as_malformed_not_internal():
    """A frame the server cannot parse as an UploadFragmentRequest is bad input: INVALID_ARGUMENT,
    counted as rejected_malformed (on the learner too once its header was read), never INTERNAL,
    and the syncer's state is untouched (a valid upload is accepted afterwards)."""
    async def run():
        core = _core()
        async with serve_syncer(core) as served:
            for frame in _GARBAGE_FRAMES:  # in place of the header
                error = await asyncio.to_thread(_send_raw_frames, served.handle.address, [frame])
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
                assert "not a valid UploadFragmentRequest" in error.details(), error.details()
            await _join(served.stub)
            good = _messages(core, base_version=0)
            # A valid header, then a garbage frame in place of a chunk: refused and counted on the learner.
            frames = [good[0].SerializeToString(), _GARBAGE_FRAMES[0]]
            error = await asyncio.to_thread(_send_raw_frames, served.handle.address, frames)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
            state = wire_views.training_state(core, 0)
            assert state.uploads["rejected_malformed"] == len(_GARBAGE_FRAMES) + 1, dict(state.uploads)
            assert "rejected_internal" not in state.uploads, dict(state.uploads)
            member = core.membership.members["learner-0"]
            assert member.rejections["malformed"] == 1 and member.flags & membership_lib.FLAG_MALFORMED
            assert [f.pending_contributions for f in state.fragments] == [0] and core.slots[0].version == 0
            response = await asyncio.wait_for(client_lib.send_upload(served.stub, good, 10.0), 15)
            assert response.result == syncer_pb2.UploadFragmentResponse.RESULT_ACCEPTED

    asyncio.run(run())


class _InterruptingServicer(servicer_lib.SyncerServicer):
    """Ends the first `interruptions` uploads after their first chunk, as a link that breaks while
    the learner is still writing (a crashed proxy, a network cut): the real status is UNAVAILABLE."""

    interruptions = 5

    async def _upload(self, request_iterator, scope, context):
        if self.interruptions <= 0:
            return await super()._upload(request_iterator, scope, context)
        self.interruptions -= 1
        iterator = request_iterator.__aiter__()
        await asyncio.wait_for(iterator.__anext__(), 10)  # the header
        await context.send_initial_metadata((serde.UPLOAD_HEADER_ACK,))
        await asyncio.wait_for(iterator.__anext__(), 10)  # one chunk of 64; the learner writes on
        raise errors.Unavailable("the link broke mid-upload (test)", reason="test_interrupted")


def test_an_upload_interrupted_while_writing_is_sent_again_not_taken_as_a_refusal():
    """The grpc asyncio client reports a call that ended while it was still writing as INTERNAL
    "Internal error from Core" (grpc/grpc#36066), hiding the real status (here UNAVAILABLE). The
    syncer cannot have taken such an upload (it takes one only after the stream's end, never sent),
    so the learner's client sends the same job again instead of dropping it as refused."""
    async def run():
        core = _core()
        async with serve_syncer(core, servicer=_InterruptingServicer(core, max_concurrent_uploads=4),
                                auth=False) as served:
            client = client_lib.SyncClient(client_lib.ClientConfig(
                target=served.handle.address, learner_id="learner-0", incarnation=1, region="r",
                tokens_per_step=0, call_timeout_s=10.0, retry_bound_s=10.0,
                security=security.ClientSecurity(insecure=True)))
            try:
                await asyncio.wait_for(asyncio.to_thread(client.start, 30.0), 40)
                delta = np.random.default_rng(0).standard_normal(NUMEL).astype(np.float32) * np.float32(1e-3)
                client.submit_upload(client_lib.UploadJob(fragment_id=0, base_version=0,
                                                          syncer_instance=client.instance, steps=2, tokens=200,
                                                          delta=delta, local_step=2))
                outcomes = []
                deadline = time.monotonic() + 60
                while not outcomes and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                    outcomes = client.take_outcomes()
                assert [o.result for o in outcomes] == [client_lib.OUTCOME_ACCEPTED], (outcomes, vars(client.stats))
                assert served.servicer.interruptions == 0 and client.stats.uploads_refused == 0, vars(client.stats)
                assert core.membership.members["learner-0"].uploads_accepted == 1
            finally:
                await asyncio.to_thread(client.close, leave=True)

    asyncio.run(run())
