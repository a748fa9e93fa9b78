"""WatchFragments through a real in-process syncer servicer on 127.0.0.1:0.

A version is built into messages once and shared by every watcher, and download chunks are at
most `servicer.WATCH_CHUNK_BYTES` whatever the run's (upload) chunk size: gRPC buffers a chunk
per watcher, so this bounds the syncer's memory per learner. Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref

import grpc
import numpy as np
import pytest

from ddiloco.algo import fragments as fragments_lib
from ddiloco.v1 import syncer_pb2
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde
from services.syncer import config as config_lib
from services.syncer import core as core_lib
from services.syncer import servicer as servicer_lib
from tests.fakes import make_core
from tests.service.conftest import serve_syncer

pytestmark = pytest.mark.timeout(120)

# One fragment of 96k random float32 values: ~384 KB of zstd frame (random floats barely compress).
SPECS = [fragments_lib.TensorSpec("w", (384, 256))]


def _core() -> core_lib.SyncerCore:
    cfg = config_lib.SyncerConfig(num_fragments=1, sync_period_steps=1, upload_codec="fp32",
                                  chunk_size_bytes=1024 * 1024)
    return make_core(config=cfg, specs=SPECS, grace_gamma=0.0, max_grace_s=0.0)


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


def test_every_watcher_gets_the_fragment_in_bounded_chunks():
    async def run():
        core = _core()
        async with serve_syncer(core) as served:
            results = await asyncio.wait_for(asyncio.gather(
                *(_first_fragment(served.stub, f"learner-{i}", core) for i in range(3))), 60)
        for values, sizes in results:
            np.testing.assert_array_equal(values, core.slots[0].published)
            assert len(sizes) > 1 and max(sizes) <= servicer_lib.WATCH_CHUNK_BYTES  # the run's chunk is 1 MiB
        assert sum(results[0][1]) > core.run.chunk_size_bytes // 4

    asyncio.run(run())


def test_the_messages_of_a_version_are_built_once():
    async def run():
        core = _core()
        slot = core.slots[0]
        cache = servicer_lib._WatchMessages()
        version, encoded = await core.publisher.encoded_payload(slot)
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


def test_a_whole_version_is_kept_only_while_a_stream_sends_it():
    # Kept until the next whole download, a whole version's messages held a copy of the fragment
    # and pinned its values (version 0's, from the joins at start, for the whole run).
    cache = servicer_lib._WatchMessages()
    values = np.linspace(-1, 1, 50_000).astype(np.float32)
    whole = codec_lib.encode(values, "fp32", compression="none")
    messages, _ = cache.get("i", 0, 1, whole, False, 4096)
    assert cache.get("i", 0, 1, whole, False, 4096)[0] is messages  # shared while sent
    whole_ref = weakref.ref(whole)
    del messages, whole
    assert whole_ref() is None
    delta = codec_lib.encode(values, "int4")
    delta_ref = weakref.ref(delta)
    messages, _ = cache.get("i", 0, 2, delta, True, 4096)
    del messages, delta
    assert delta_ref() is not None  # deltas (every learner, every version) stay cached


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
        async with serve_syncer(core) as served:
            await served.stub.Join(syncer_pb2.JoinRequest(protocol_version=serde.PROTOCOL_VERSION,
                                                          learner_id="learner-0", incarnation=1), timeout=10)
            learner = served.stub.WatchFragments(syncer_pb2.WatchFragmentsRequest(
                protocol_version=serde.PROTOCOL_VERSION, learner_id="learner-0", incarnation=1), timeout=90)
            observer = served.stub.WatchTrainingState(syncer_pb2.WatchTrainingStateRequest(min_interval_s=30.0),
                                                      timeout=90)
            await asyncio.wait_for(learner.read(), 30)  # both streams are open and serving
            await asyncio.wait_for(observer.read(), 30)
            started = time.monotonic()
            await asyncio.wait_for(stop_serving(served.handle, served.servicer, grace_s=60.0), 90)
            stopped_s = time.monotonic() - started
            codes = await asyncio.wait_for(asyncio.gather(drain(learner), drain(observer)), 30)
        assert codes == [grpc.StatusCode.UNAVAILABLE] * 2
        assert stopped_s < 30, stopped_s  # not the 60 s grace period

    asyncio.run(run())
