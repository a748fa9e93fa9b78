"""The checkpoint store over real gRPC: a grpc.aio server on 127.0.0.1:0 in the test's event loop,
driven through `CheckpointClient` (and the raw stub for malformed streams)."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import hashlib
import os
import pathlib
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddiloco import checkpoint_client
from ddiloco.rpc import channel as channel_lib
from ddiloco.rpc import server as server_lib
from ddiloco.v1 import checkpoint_pb2, checkpoint_pb2_grpc
from services.checkpoint import servicer as servicer_lib
from services.checkpoint import store as store_lib
from tests.waits import wait_until_async

pytestmark = pytest.mark.timeout(30)

SERVICE_NAME = checkpoint_pb2.DESCRIPTOR.services_by_name["CheckpointStore"].full_name
_TEST_TIMEOUT_S = 20.0


@dataclasses.dataclass
class Env:
    root: pathlib.Path
    store: store_lib.BlobStore
    channel: grpc.aio.Channel
    stub: checkpoint_pb2_grpc.CheckpointStoreStub
    client: checkpoint_client.CheckpointClient


Body = Callable[[Env], Awaitable[None]]


@pytest.fixture
def run(tmp_path: pathlib.Path) -> Callable[[Body], None]:
    """Runs `body(env)` against a fresh server in a fresh event loop; tears everything down."""

    async def main(body: Body) -> None:
        store = store_lib.BlobStore(tmp_path / "root")
        servicer = servicer_lib.CheckpointStoreServicer(store, chunk_size_bytes=64 * 1024)
        handle = await server_lib.start_server(
            "127.0.0.1:0",
            [SERVICE_NAME],
            [lambda s: checkpoint_pb2_grpc.add_CheckpointStoreServicer_to_server(servicer, s)],
        )
        channel = channel_lib.aio_channel(handle.address)
        try:
            client = checkpoint_client.CheckpointClient(
                channel,
                timeout=datetime.timedelta(seconds=5),
                blob_timeout=datetime.timedelta(seconds=10),
                retry_timeout=datetime.timedelta(seconds=5),
                chunk_size_bytes=64 * 1024,
            )
            stub = checkpoint_pb2_grpc.CheckpointStoreStub(channel)
            await asyncio.wait_for(
                body(Env(store.root, store, channel, stub, client)), _TEST_TIMEOUT_S
            )
        finally:
            await channel.close()
            await handle.server.stop(None)

    return lambda body: asyncio.run(main(body))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tmp_files(root: pathlib.Path) -> list[pathlib.Path]:
    return [p for p in root.rglob("*") if ".tmp-" in p.name]


async def _put_raw(env: Env, messages: list[checkpoint_pb2.PutBlobRequest]):
    async def stream() -> AsyncIterator[checkpoint_pb2.PutBlobRequest]:
        for m in messages:
            yield m

    return await env.stub.PutBlob(stream(), timeout=5)


def _header(digest: str, size_bytes: int) -> checkpoint_pb2.PutBlobRequest:
    return checkpoint_pb2.PutBlobRequest(
        header=checkpoint_pb2.BlobHeader(digest=digest, size_bytes=size_bytes)
    )


def _chunk(seq: int, data: bytes) -> checkpoint_pb2.PutBlobRequest:
    return checkpoint_pb2.PutBlobRequest(chunk=checkpoint_pb2.BlobChunk(seq=seq, data=data))


def test_put_get_stat_commit_latest_list(run) -> None:
    async def body(env: Env) -> None:
        params, opt = os.urandom(300_000), os.urandom(1000)
        p_digest = await env.client.put_blob(params)
        o_digest = await env.client.put_blob(opt)
        assert await env.client.put_blob(params) == p_digest == _sha(params)  # skipped via stat
        assert await env.client.get_blob(p_digest) == params
        assert await env.client.stat_blobs([p_digest, _sha(b"nope")]) == {p_digest}
        assert await env.client.latest_manifest("run-a") is None

        blobs = {"params": (p_digest, len(params)), "opt": (o_digest, len(opt))}
        assert await env.client.commit_manifest("run-a", 1, blobs, {"model": "tiny"}) == 1
        # Idempotent: a retried commit of the same content succeeds.
        assert await env.client.commit_manifest("run-a", 1, blobs, {"model": "tiny"}) == 1
        refs = [checkpoint_client.BlobRef("params", p_digest, len(params))]
        assert await env.client.commit_manifest("run-a", 2, refs) == 2

        latest = await env.client.latest_manifest("run-a")
        assert latest is not None and latest.step == 2 and latest.run_id == "run-a"
        assert latest.blob("params").digest == p_digest and latest.metadata == {}
        listed = await env.client.list_manifests("run-a")
        assert [m.step for m in listed] == [1, 2]
        assert listed[0].metadata == {"model": "tiny"}
        assert listed[0].blob("opt") == checkpoint_client.BlobRef("opt", o_digest, len(opt))
        assert await env.client.list_manifests("run-b") == []

    run(body)


def test_raw_put_reports_already_existed(run) -> None:
    async def body(env: Env) -> None:
        data = b"x" * 100
        first = await _put_raw(env, [_header(_sha(data), 100), _chunk(0, data)])
        again = await _put_raw(
            env, [_header(_sha(data), 100), _chunk(0, data[:40]), _chunk(1, data[40:])]
        )
        assert (first.already_existed, again.already_existed) == (False, True)
        assert again.digest == _sha(data) and again.size_bytes == 100

    run(body)


@pytest.mark.parametrize(
    "messages",
    [
        pytest.param([_header("NOT-HEX", 3), _chunk(0, b"abc")], id="bad-digest"),
        pytest.param([_header(_sha(b"abc"), 4), _chunk(0, b"abc")], id="too-few-bytes"),
        pytest.param([_header(_sha(b"abc"), 2), _chunk(0, b"abc")], id="too-many-bytes"),
        pytest.param([_header(_sha(b"abc"), 3), _chunk(0, b"abd")], id="digest-mismatch"),
        pytest.param([_header(_sha(b"abc"), 3), _chunk(1, b"abc")], id="first-seq-not-0"),
        pytest.param(
            [_header(_sha(b"abc"), 3), _chunk(0, b"a"), _chunk(2, b"b"), _chunk(3, b"c")],
            id="seq-gap",
        ),
        pytest.param([_chunk(0, b"abc"), _header(_sha(b"abc"), 3)], id="chunk-before-header"),
        pytest.param([_header(_sha(b"abc"), 3), _header(_sha(b"abc"), 3)], id="two-headers"),
        pytest.param([], id="empty-stream"),
    ],
)
def test_malformed_put_is_invalid_argument_and_leaves_nothing(run, messages) -> None:
    async def body(env: Env) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _put_raw(env, messages)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert _tmp_files(env.root) == []
        assert list((env.root / "blobs").glob("??/*")) == []

    run(body)


def test_bad_digest_on_get_and_stat_is_invalid_argument(run) -> None:
    async def body(env: Env) -> None:
        for call in (env.client.get_blob("../../etc/passwd"), env.client.stat_blobs(["A" * 64])):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    run(body)


def test_missing_blob_is_not_found(run) -> None:
    async def body(env: Env) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await env.client.get_blob(_sha(b"never stored"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND

    run(body)


def test_commit_preconditions(run) -> None:
    async def body(env: Env) -> None:
        digest = await env.client.put_blob(b"v")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await env.client.commit_manifest("run", 1, {"p": (_sha(b"missing"), 7)})
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        await env.client.commit_manifest("run", 5, {"p": (digest, 1)})
        for step, blobs in [(5, {"q": (digest, 1)}), (4, {"p": (digest, 1)})]:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await env.client.commit_manifest("run", step, blobs)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        with pytest.raises(grpc.aio.AioRpcError) as info:
            await env.client.commit_manifest("../escape", 6, {"p": (digest, 1)})
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (await env.client.latest_manifest("run")).step == 5

    run(body)


def test_corrupted_blob_is_data_loss(run) -> None:
    async def body(env: Env) -> None:
        data = os.urandom(200_000)
        digest = await env.client.put_blob(data)
        path = env.root / "blobs" / digest[:2] / digest
        path.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])

        call = env.stub.GetBlob(checkpoint_pb2.GetBlobRequest(digest=digest), timeout=5)
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for response in call:
                received.append(response)
        assert info.value.code() == grpc.StatusCode.DATA_LOSS
        assert received == []  # not one unverified byte was sent

        # The corrupt copy was quarantined: the store reports it absent, so a replica's repair
        # (or the next upload) stores the right bytes instead of hearing "already exists".
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await env.client.get_blob(digest)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert await env.client.stat_blobs([digest]) == set()
        assert [p.name.split(".")[0] for p in (env.root / "quarantine").iterdir()] == [digest]
        assert await env.client.put_blob(data) == digest
        assert await env.client.get_blob(digest) == data

    run(body)


def test_client_cancelling_mid_upload_leaves_no_temp_file(run) -> None:
    async def body(env: Env) -> None:
        data = os.urandom(100_000)
        hold = asyncio.Event()

        async def stream() -> AsyncIterator[checkpoint_pb2.PutBlobRequest]:
            yield _header(_sha(data), len(data))
            yield _chunk(0, data[:50_000])
            await hold.wait()  # never set: the client stalls mid-upload

        call = env.stub.PutBlob(stream(), timeout=10)
        await wait_until_async(lambda: len(_tmp_files(env.root)) == 1, timeout_s=5, what="the upload's temp file")
        call.cancel()
        await wait_until_async(lambda: _tmp_files(env.root) == [], timeout_s=5, what="the temp file to be removed")
        assert await env.client.stat_blobs([_sha(data)]) == set()
        assert await env.client.put_blob(data) == _sha(data)  # the store still works

    run(body)


def test_health_reports_serving(run) -> None:
    async def body(env: Env) -> None:
        health = health_pb2_grpc.HealthStub(env.channel)
        for service in ["", SERVICE_NAME]:
            response = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert response.status == health_pb2.HealthCheckResponse.SERVING

    run(body)


class _TamperingServicer(checkpoint_pb2_grpc.CheckpointStoreServicer):
    """Serves a blob whose bytes do not match the digest it claims."""

    async def GetBlob(self, request, context):
        yield checkpoint_pb2.GetBlobResponse(
            header=checkpoint_pb2.BlobHeader(digest=request.digest, size_bytes=3)
        )
        yield checkpoint_pb2.GetBlobResponse(chunk=checkpoint_pb2.BlobChunk(seq=0, data=b"bad"))


def test_client_verifies_downloaded_blobs() -> None:
    async def main() -> None:
        def add(server) -> None:
            checkpoint_pb2_grpc.add_CheckpointStoreServicer_to_server(_TamperingServicer(), server)

        handle = await server_lib.start_server("127.0.0.1:0", [SERVICE_NAME], [add])
        channel = channel_lib.aio_channel(handle.address)
        try:
            client = checkpoint_client.CheckpointClient(channel)
            with pytest.raises(checkpoint_client.BlobVerificationError, match="hash to"):
                await asyncio.wait_for(client.get_blob(_sha(b"good")), _TEST_TIMEOUT_S)
        finally:
            await channel.close()
            await handle.server.stop(None)

    asyncio.run(main())
