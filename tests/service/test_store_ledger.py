"""The checkpoint store's merge ledger over real gRPC (a server on 127.0.0.1:0 in the test's loop):
the chain checks on append, reading back, blobs kept alive, and the syncer's shipping side
(services/syncer/ledger_sink.StoreLedger) against it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import hashlib
import json
import pathlib
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest

from ddiloco import checkpoint_client
from ddiloco.cli import audit as audit_lib
from ddiloco.rpc import channel as channel_lib
from ddiloco.rpc import server as server_lib
from ddiloco.v1 import checkpoint_pb2, checkpoint_pb2_grpc
from services.checkpoint import ledger as ledger_lib
from services.checkpoint import servicer as servicer_lib
from services.checkpoint import store as store_lib
from services.syncer import ledger_sink as sink_lib
from tests.waits import wait_until_async

pytestmark = pytest.mark.timeout(60)

SERVICE_NAME = checkpoint_pb2.DESCRIPTOR.services_by_name["CheckpointStore"].full_name
GENESIS = "0" * 64
RUN = "ledger-run"


@dataclasses.dataclass
class Env:
    root: pathlib.Path
    store: store_lib.BlobStore
    client: checkpoint_client.CheckpointClient


@contextlib.asynccontextmanager
async def _served_store(root: pathlib.Path, *, gc_grace_s: float = 3600.0,
                        retry_timeout_s: float = 5.0) -> AsyncIterator[Env]:
    """A checkpoint store under `root`, served on 127.0.0.1:0 in this loop, and a client of it."""
    store = store_lib.BlobStore(root, gc_grace_s=gc_grace_s)
    servicer = servicer_lib.CheckpointStoreServicer(store, chunk_size_bytes=64 * 1024)
    handle = await server_lib.start_server(
        "127.0.0.1:0", [SERVICE_NAME],
        [lambda s: checkpoint_pb2_grpc.add_CheckpointStoreServicer_to_server(servicer, s)])
    channel = channel_lib.aio_channel(handle.address)
    try:
        yield Env(store.root, store, checkpoint_client.CheckpointClient(
            channel, timeout=datetime.timedelta(seconds=5), retry_timeout=datetime.timedelta(seconds=retry_timeout_s)))
    finally:
        await channel.close()
        await handle.server.stop(None)


def _serve(tmp_path: pathlib.Path, body: Callable[[Env], Awaitable[None]], *, gc_grace_s: float = 3600.0) -> None:
    async def main() -> None:
        async with _served_store(tmp_path / "root", gc_grace_s=gc_grace_s) as env:
            await asyncio.wait_for(body(env), 40.0)

    asyncio.run(main())


def _line(prev: str, **fields) -> str:
    return json.dumps({"format": "ddiloco.ledger/1", **fields, "prev": prev}, sort_keys=True, separators=(",", ":"))


def _chain(n: int, prev: str = GENESIS, **extra) -> list[str]:
    lines = []
    for version in range(1, n + 1):
        lines.append(_line(prev, fragment=0, version=version, **extra))
        prev = hashlib.sha256(lines[-1].encode()).hexdigest()
    return lines


def _code(exc_info) -> grpc.StatusCode:
    return exc_info.value.code()


def test_chain_checked_on_append_and_read_back_in_order(tmp_path):
    async def body(env: Env) -> None:
        assert await env.client.ledger_head(RUN) == (0, GENESIS)
        lines = _chain(5)
        length, head = await env.client.append_ledger(RUN, lines[:3])
        assert (length, head) == (3, hashlib.sha256(lines[2].encode()).hexdigest())
        # prev not the head: refused, nothing written.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await env.client.append_ledger(RUN, [_line(GENESIS, fragment=0, version=9)])
        assert _code(refused) == grpc.StatusCode.FAILED_PRECONDITION
        assert "not to the head" in refused.value.details()
        # Skipping a record (line 5 after line 3) is refused too.
        with pytest.raises(grpc.aio.AioRpcError) as gap:
            await env.client.append_ledger(RUN, lines[4:])
        assert _code(gap) == grpc.StatusCode.FAILED_PRECONDITION
        # A duplicate of the head (a retry whose answer was lost) is a no-op success.
        assert await env.client.append_ledger(RUN, [lines[2]]) == (length, head)
        # A retried batch that overlaps what is held appends only the new lines.
        length, head = await env.client.append_ledger(RUN, lines[1:])
        assert length == 5
        read = await env.client.read_ledger(RUN)
        assert read == lines
        assert await env.client.read_ledger(RUN, 3) == lines[3:]
        assert [r["version"] for r in audit_lib.verify_lines([x.encode() for x in read], from_genesis=True)] == [
            1, 2, 3, 4, 5]
        assert (env.root / "ledger" / f"{RUN}.jsonl").read_text().splitlines() == lines
        # Not JSON, or no prev: INVALID_ARGUMENT.
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await env.client.append_ledger(RUN, ["{not json"])
        assert _code(bad) == grpc.StatusCode.INVALID_ARGUMENT

    _serve(tmp_path, body)


def test_an_older_leader_epoch_cannot_extend_the_chain(tmp_path):
    async def body(env: Env) -> None:
        first = _chain(1, epoch=7)
        await env.client.append_ledger(RUN, first)
        head = hashlib.sha256(first[0].encode()).hexdigest()
        with pytest.raises(grpc.aio.AioRpcError) as deposed:
            await env.client.append_ledger(RUN, [_line(head, fragment=0, version=2, epoch=6)])
        assert _code(deposed) == grpc.StatusCode.FAILED_PRECONDITION
        assert "deposed" in deposed.value.details()
        assert (await env.client.append_ledger(RUN, [_line(head, fragment=0, version=2, epoch=8)]))[0] == 2

    _serve(tmp_path, body)


def test_ledger_blobs_must_exist_and_outlive_garbage_collection(tmp_path):
    async def body(env: Env) -> None:
        data = b"retained contribution" * 100
        digest = hashlib.sha256(data).hexdigest()
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await env.client.append_ledger(RUN, [_line(GENESIS, fragment=0, version=1, blobs=[digest])])
        assert _code(missing) == grpc.StatusCode.FAILED_PRECONDITION
        await env.client.put_blob(data)
        orphan = await env.client.put_blob(b"referenced by nothing")
        await env.client.append_ledger(RUN, [_line(GENESIS, fragment=0, version=1, blobs=[digest])])
        # A manifest commit runs GC (grace 0 here): the ledger's blob stays, the orphan goes.
        await env.client.commit_manifest("other-run", 1, {})
        assert await env.client.stat_blobs([digest, orphan]) == {digest}
        assert await env.client.get_blob(digest) == data

    _serve(tmp_path, body, gc_grace_s=0.0)


def test_a_reopened_store_continues_the_chain_and_cuts_a_torn_line(tmp_path):
    root = tmp_path / "root"
    held = lambda digests: set(digests)  # noqa: E731 (every blob held)
    ledger = ledger_lib.LedgerStore(root, held)
    lines = _chain(3)
    ledger.append(RUN, lines)
    with open(root / "ledger" / f"{RUN}.jsonl", "ab") as f:
        f.write(b'{"prev":"torn')  # a crash in the middle of an unacknowledged append
    reopened = ledger_lib.LedgerStore(root, held)
    assert reopened.head(RUN) == (3, hashlib.sha256(lines[-1].encode()).hexdigest())
    assert [line for _, line in reopened.read(RUN, 0)] == lines
    more = _chain(1, prev=reopened.head(RUN)[1])
    assert reopened.append(RUN, more)[0] == 4


class _Flaky:
    """A store client whose first `failures` appends fail with UNAVAILABLE (the store is down)."""

    def __init__(self, client, failures: int) -> None:
        self._client = client
        self.failures = failures
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self._client, name)

    async def append_ledger(self, run_id, lines):
        self.calls += 1
        if self.failures > 0:
            self.failures -= 1
            raise _Unavailable()
        return await self._client.append_ledger(run_id, lines)


class _Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE


def test_the_syncer_ships_records_in_order_through_failures_and_a_restart_resumes_the_chain(tmp_path):
    async def body(env: Env) -> None:
        flaky = _Flaky(env.client, failures=6)  # more than one call's retries: the loop keeps them queued
        sink = sink_lib.StoreLedger(flaky, RUN, call_timeout_s=5.0, attempts=2)
        await sink.resume()
        sink.start()
        data = b"\x00\x00\x80\x3f" * 16
        for version in range(1, 4):
            blobs = {hashlib.sha256(data).hexdigest(): data} if version == 2 else None
            record = {"fragment": 0, "version": version, "syncer_instance": "a"}
            if blobs:
                record["blobs"] = sorted(blobs)
            sink.append(record, blobs)  # returns at once, whatever the store does
        assert sink.pending == 3
        assert await sink.drain(30.0)
        assert sink.failures >= 1 and flaky.failures == 0
        await sink.close()
        # A restarted syncer (a new sink) continues the store's chain.
        again = sink_lib.StoreLedger(env.client, RUN)
        await again.resume()
        again.start()
        again.append({"fragment": 0, "version": 4, "syncer_instance": "b"})
        await wait_until_async(lambda: again.pending == 0, timeout_s=20.0, what="the record shipped")
        await again.close()
        records = audit_lib.verify_lines([x.encode() for x in await env.client.read_ledger(RUN)], from_genesis=True)
        assert [(r["version"], r["syncer_instance"]) for r in records] == [(1, "a"), (2, "a"), (3, "a"), (4, "b")]
        assert records[1]["blobs"] == [hashlib.sha256(data).hexdigest()]

    _serve(tmp_path, body)


def test_a_sink_whose_chain_is_refused_rechains_onto_the_stores_head(tmp_path):
    async def body(env: Env) -> None:
        sink = sink_lib.StoreLedger(env.client, RUN, call_timeout_s=5.0)
        await sink.resume()  # head: genesis
        await env.client.append_ledger(RUN, _chain(1))  # another writer moves the head meanwhile
        sink.start()
        sink.append({"fragment": 1, "version": 1})
        await wait_until_async(lambda: sink.pending == 0, timeout_s=20.0, what="the record re-chained and shipped")
        await sink.close()
        lines = await env.client.read_ledger(RUN)
        assert len(audit_lib.verify_lines([x.encode() for x in lines], from_genesis=True)) == 2

    _serve(tmp_path, body)


class _Switchable:
    """A store client that can be cut off (UNAVAILABLE on every call) and brought back."""

    def __init__(self, client) -> None:
        self._client = client
        self.down = False

    def __getattr__(self, name):
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        async def call(*args, **kwargs):
            if self.down:
                raise _Unavailable()
            return await attr(*args, **kwargs)

        return call


def test_replicas_each_get_every_record_and_one_that_missed_some_catches_up(tmp_path):
    from ddiloco import checkpoint_replicas as replicas_lib

    async def body(env: Env) -> None:
        async with _served_store(tmp_path / "other", retry_timeout_s=1.0) as other_env:
            other = _Switchable(other_env.client)
            client = replicas_lib.ReplicatedCheckpointClient({"a": env.client, "b": other}, write_quorum=1,
                                                             down_backoff_s=0.0, quorum_wait_s=2.0)
            sink = sink_lib.StoreLedger(client, RUN, call_timeout_s=5.0)
            await sink.resume()
            sink.start()
            data = b"\x01\x02\x03\x04" * 8
            digest = hashlib.sha256(data).hexdigest()
            sink.append({"fragment": 0, "version": 1})
            await wait_until_async(lambda: sink.pending == 0, timeout_s=20.0, what="record 1 on both stores")
            other.down = True  # b misses record 2 and the blob it names
            sink.append({"fragment": 0, "version": 2, "blobs": [digest]}, {digest: data})
            await wait_until_async(lambda: sink.pending == 0, timeout_s=20.0, what="record 2 on a alone")
            assert (await other._client.ledger_head(RUN))[0] == 1
            other.down = False  # b is back: the next append gives it what it missed first
            sink.append({"fragment": 0, "version": 3})
            await wait_until_async(lambda: sink.pending == 0, timeout_s=20.0, what="record 3")
            await sink.close()
            assert await other._client.read_ledger(RUN) == await env.client.read_ledger(RUN)
            assert len(await env.client.read_ledger(RUN)) == 3
            assert await other._client.get_blob(digest) == data

    _serve(tmp_path, body)
