"""Upload refusals reach the learner with their own status, through a real syncer servicer on 127.0.0.1:0.

The syncer acknowledges an accepted upload header with initial metadata and the learner sends
chunks only after it (`services.learner.client.send_upload`). Without that handshake a refusal of
the header races the learner's chunk writes, and the grpc asyncio client reports a write that
fails after the status arrived as INTERNAL (grpc/grpc#36066): the learner then cannot tell a
refusal worth resending from a bug. Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import numpy as np
import pytest

from ddiloco.algo import fragments as fragments_lib
from ddiloco.rpc import channel as channel_lib
from ddiloco.rpc import security
from ddiloco.rpc import server as server_lib
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde
from services.learner import client as client_lib
from services.syncer import config as config_lib
from services.syncer import core as core_lib
from services.syncer import servicer as servicer_lib

pytestmark = pytest.mark.timeout(120)

NUMEL = 1 << 20  # 4 MiB of fp32: 64 chunks of 64 KiB, so a refused upload has many writes left
CHUNK_BYTES = 64 * 1024


def _core() -> core_lib.SyncerCore:
    plan = fragments_lib.plan_fragments([fragments_lib.TensorSpec("w", (1024, 1024))], 1, 1)
    # A quorum of 2 that one learner never reaches: an accepted upload is folded in, never merged.
    cfg = config_lib.SyncerConfig(num_fragments=1, sync_period_steps=1, upload_codec="fp32", chunk_size_bytes=CHUNK_BYTES,
                                  min_quorum=2)
    run_config = core_lib.make_run_config(cfg=cfg, plan=plan, model_name="test", model_config_json="{}",
                                          fingerprint="f" * 64)
    initial = {0: np.zeros(NUMEL, np.float32)}
    return core_lib.SyncerCore(
        run_config=run_config, plan=plan, initial_params=initial, outer_lr=0.7, outer_momentum=0.9,
        grace_gamma=0.0, max_grace_s=0.0, liveness_timeout_s=30.0, merge_history=16,
        clock=time.monotonic, wall_clock=time.time, round_trigger="upload")


def _messages(core, *, base_version: int, instance: str | None = None, seed: int = 0) -> list:
    values = np.random.default_rng(seed).standard_normal(NUMEL).astype(np.float32) * np.float32(1e-3)
    enc = codec_lib.encode(values, "fp32")
    header = syncer_pb2.UploadHeader(
        protocol_version=serde.PROTOCOL_VERSION, learner_id="learner-0", incarnation=1, fragment_id=0,
        base_version=base_version, syncer_instance=core.instance if instance is None else instance,
        steps=2, tokens=200, payload=serde.payload_info_to_proto(enc))
    return [syncer_pb2.UploadFragmentRequest(header=header)] + [
        syncer_pb2.UploadFragmentRequest(chunk=c) for c in serde.payload_chunks(enc.payload, CHUNK_BYTES)]


@contextlib.asynccontextmanager
async def _syncer(core, *, max_concurrent_uploads: int = 4):
    servicer = servicer_lib.SyncerServicer(core, max_concurrent_uploads=max_concurrent_uploads)
    sec = security.ServerSecurity(insecure=True)
    auth = security.AuthInterceptor(sec.authenticator(), security.SYNCER_POLICY,
                                    on_reject=servicer.record_interceptor_refusal)
    handle = await server_lib.start_server(
        "127.0.0.1:0", ["ddiloco.v1.Syncer"], [lambda s: syncer_pb2_grpc.add_SyncerServicer_to_server(servicer, s)],
        interceptors=[auth])
    channel = channel_lib.aio_channel(handle.address, security.ClientSecurity(insecure=True))
    try:
        yield syncer_pb2_grpc.SyncerStub(channel)
    finally:
        await channel.close()
        await handle.stop(grace_s=0)


async def _join(stub) -> syncer_pb2.JoinResponse:
    return await stub.Join(syncer_pb2.JoinRequest(protocol_version=serde.PROTOCOL_VERSION, learner_id="learner-0",
                                                  incarnation=1), timeout=10)


def test_refused_headers_keep_their_status_and_accepted_uploads_go_through():
    async def run():
        core = _core()
        async with _syncer(core) as stub:
            joined = await _join(stub)
            assert joined.upload_header_ack
            stale = _messages(core, base_version=0, instance="another-syncer-life")
            codes = []
            for _ in range(40):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await asyncio.wait_for(client_lib.send_upload(stub, stale, 10.0), 15)
                codes.append((info.value.code(), info.value.details()))
            assert {code for code, _ in codes} == {grpc.StatusCode.FAILED_PRECONDITION}, codes[:3]
            assert all("instance" in details for _, details in codes), codes[0]

            chunks_written, good = [], _messages(core, base_version=0)
            response = await asyncio.wait_for(client_lib.send_upload(
                stub, good, 10.0, after_chunk=lambda: chunks_written.append(1)), 15)
            assert response.result == syncer_pb2.UploadFragmentResponse.RESULT_ACCEPTED
            assert len(chunks_written) == len(good) - 1 > 30
            assert core.members["learner-0"].uploads_accepted == 1

    asyncio.run(run())


def test_a_full_syncer_refuses_with_resource_exhausted():
    async def run():
        core = _core()
        async with _syncer(core, max_concurrent_uploads=1) as stub:
            await _join(stub)
            # Hold the only upload slot: a header that is accepted, then no chunk.
            holder = stub.UploadFragment(timeout=20)
            await holder.write(_messages(core, base_version=0)[0])
            await asyncio.wait_for(holder.initial_metadata(), 10)
            try:
                for seed in range(5):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await asyncio.wait_for(
                            client_lib.send_upload(stub, _messages(core, base_version=0, seed=seed + 1), 10.0), 15)
                    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
            finally:
                holder.cancel()

    asyncio.run(run())
