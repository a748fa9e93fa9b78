"""WatchFragments through a real in-process syncer servicer on 127.0.0.1:0.

A version is built into messages once and shared by every watcher, and download chunks are at
most `servicer.WATCH_CHUNK_BYTES` whatever the run's (upload) chunk size: gRPC buffers a chunk
per watcher, so this bounds the syncer's memory per learner. Every wait has a timeout.
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
from ddiloco.wire import serde
from services.syncer import config as config_lib
from services.syncer import core as core_lib
from services.syncer import servicer as servicer_lib

pytestmark = pytest.mark.timeout(120)

# One fragment of 96k random float32 values: ~384 KB of zstd frame (random floats barely compress).
SPECS = [fragments_lib.TensorSpec("w", (384, 256))]


def _core() -> core_lib.SyncerCore:
    plan = fragments_lib.plan_fragments(SPECS, 1, 1)
    cfg = config_lib.SyncerConfig(num_fragments=1, sync_period_steps=1, upload_codec="fp32",
                                  chunk_size_bytes=1024 * 1024)
    run_config = core_lib.make_run_config(cfg=cfg, plan=plan, model_name="test", model_config_json="{}",
                                          fingerprint="f" * 64)
    initial = {0: np.random.default_rng(0).standard_normal(plan.fragments[0].numel).astype(np.float32)}
    return core_lib.SyncerCore(
        run_config=run_config, plan=plan, initial_params=initial, outer_lr=0.7, outer_momentum=0.9,
        grace_gamma=0.0, max_grace_s=0.0, liveness_timeout_s=30.0, merge_history=16,
        clock=time.monotonic, wall_clock=time.time, round_trigger="upload")


async def _first_fragment(stub, learner_id: str, core) -> tuple[np.ndarray, list[int]]:
    await stub.Join(syncer_pb2.JoinRequest(protocol_version=serde.PROTOCOL_VERSION, learner_id=learner_id,
                                           incarnation=1), timeout=10)
    call = stub.WatchFragments(syncer_pb2.WatchFragmentsRequest(
        protocol_version=serde.PROTOCOL_VERSION, learner_id=learner_id, incarnation=1), timeout=20)
    header, assembler, sizes = None, None, []
    try:
        async for msg in call:
            if msg.WhichOneof("kind") in ("receipt", "round_call"):
                continue
            if msg.WhichOneof("kind") == "header":
                header = msg.header
                assembler = serde.ChunkAssembler(header.payload.payload_size_bytes)
                continue
            sizes.append(len(msg.chunk.data))
            assembler.add(msg.chunk)
            if assembler.done:
                return serde.decode_payload(header.payload, assembler.payload()), sizes
    finally:
        call.cancel()
    raise AssertionError("the stream ended before the fragment arrived")


async def _serve(core):
    """The servicer of `core` on a real plaintext server at 127.0.0.1:0, and a channel to it."""
    servicer = servicer_lib.SyncerServicer(core, max_concurrent_uploads=4)
    sec = security.ServerSecurity(insecure=True)
    auth = security.AuthInterceptor(sec.authenticator(), security.SYNCER_POLICY,
                                    on_reject=servicer.record_interceptor_refusal)
    handle = await server_lib.start_server(
        "127.0.0.1:0", ["ddiloco.v1.Syncer"], [lambda s: syncer_pb2_grpc.add_SyncerServicer_to_server(servicer, s)],
        interceptors=[auth])
    return servicer, handle, channel_lib.aio_channel(handle.address, security.ClientSecurity(insecure=True))


def test_every_watcher_gets_the_fragment_in_bounded_chunks():
    async def run():
        core = _core()
        servicer, handle, channel = await _serve(core)
        try:
            stub = syncer_pb2_grpc.SyncerStub(channel)
            results = await asyncio.wait_for(asyncio.gather(
                *(_first_fragment(stub, f"learner-{i}", core) for i in range(3))), 60)
        finally:
            await channel.close()
            await handle.stop(0)
        for values, sizes in results:
            np.testing.assert_array_equal(values, core.slots[0].published)
            assert len(sizes) > 1 and max(sizes) <= servicer_lib.WATCH_CHUNK_BYTES  # the run's chunk is 1 MiB
        assert sum(results[0][1]) > core.config.chunk_size_bytes // 4

    asyncio.run(run())


def test_the_messages_of_a_version_are_built_once():
    async def run():
        core = _core()
        slot = core.slots[0]
        cache = servicer_lib._WatchMessages()
        version, encoded = await core.encoded_payload(slot)
        first, wire_bytes = cache.get(core.instance, 0, version, encoded, False, servicer_lib.WATCH_CHUNK_BYTES)
        again, _ = cache.get(core.instance, 0, version, encoded, False, servicer_lib.WATCH_CHUNK_BYTES)
        assert again is first
        assert wire_bytes == sum(m.ByteSize() for m in first) and wire_bytes > len(encoded.payload)
        assert first[0].header.version == version and not first[0].header.delta
        assert b"".join(m.chunk.data for m in first[1:]) == encoded.payload
        # A newer version replaces it; a slow watcher asking for the older one gets it built, not kept.
        newer, _ = cache.get(core.instance, 0, version + 1, encoded, False, servicer_lib.WATCH_CHUNK_BYTES)
        older, _ = cache.get(core.instance, 0, version, encoded, False, servicer_lib.WATCH_CHUNK_BYTES)
        assert older is not first and cache.get(core.instance, 0, version + 1, encoded, False,
                                                servicer_lib.WATCH_CHUNK_BYTES)[0] is newer

    asyncio.run(run())


def test_shutdown_ends_the_watch_streams_instead_of_waiting_out_the_grace_period():
    # A rolling restart used to hold the server's whole grace period open for the watch streams
    # (they never end on their own) while uploads were refused: 7 s down instead of 2, longer than
    # a chaos learner's retry bound. The streams now end with UNAVAILABLE as soon as no upload is
    # in flight; a grace period of 60 s would otherwise be waited out in full.
    from services.syncer.__main__ import stop_serving

    async def drain(call) -> grpc.StatusCode:
        with contextlib.suppress(grpc.aio.AioRpcError):
            while await call.read() is not grpc.aio.EOF:
                pass
        return await call.code()

    async def run():
        core = _core()
        servicer, handle, channel = await _serve(core)
        try:
            stub = syncer_pb2_grpc.SyncerStub(channel)
            await stub.Join(syncer_pb2.JoinRequest(protocol_version=serde.PROTOCOL_VERSION, learner_id="learner-0",
                                                   incarnation=1), timeout=10)
            learner = stub.WatchFragments(syncer_pb2.WatchFragmentsRequest(
                protocol_version=serde.PROTOCOL_VERSION, learner_id="learner-0", incarnation=1), timeout=90)
            observer = stub.WatchTrainingState(syncer_pb2.WatchTrainingStateRequest(min_interval_s=30.0), timeout=90)
            await asyncio.wait_for(learner.read(), 30)  # both streams are open and serving
            await asyncio.wait_for(observer.read(), 30)
            started = time.monotonic()
            await asyncio.wait_for(stop_serving(handle, servicer, grace_s=60.0), 90)
            stopped_s = time.monotonic() - started
            codes = await asyncio.wait_for(asyncio.gather(drain(learner), drain(observer)), 30)
        finally:
            await channel.close()
            await handle.stop(0)
        assert codes == [grpc.StatusCode.UNAVAILABLE] * 2
        assert stopped_s < 30, stopped_s  # not the 60 s grace period

    asyncio.run(run())
