"""The checkpoint store as a real process: committed checkpoints survive SIGKILL, and a crash in
the middle of a write (failpoint) leaves no temp files and the previous checkpoint readable.

The store is started, restarted and signalled through the project's one launcher (the `cluster`
fixture's LocalCluster / ServiceProcess), by its PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import os
import pathlib
import signal

import grpc
import pytest

from ddiloco import checkpoint_client
from ddiloco.rpc import channel as channel_lib
from ddiloco.rpc import retry as retry_lib

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

_READY_TIMEOUT_S = 20.0
_EXIT_TIMEOUT_S = 10.0
_CRASH_MID_WRITE = ["--failpoints", "store.after_tmp_write=crash"]


def _restart(store, extra_args=()) -> str:
    """Starts the stopped store again (same root, same port, `extra_args` for this start only)."""
    assert not store.alive()
    store.start(extra_args)
    return store.wait_ready(_READY_TIMEOUT_S)


@contextlib.asynccontextmanager
async def _client(address: str, *, retry_timeout_s: float = 10.0):
    channel = channel_lib.aio_channel(address)
    try:
        yield checkpoint_client.CheckpointClient(
            channel,
            timeout=datetime.timedelta(seconds=5),
            blob_timeout=datetime.timedelta(seconds=10),
            retry_timeout=datetime.timedelta(seconds=retry_timeout_s),
        )
    finally:
        await channel.close()


def _tmp_files(root: pathlib.Path) -> list[pathlib.Path]:
    return [p for p in root.rglob("*") if ".tmp-" in p.name]


def _commit_step_1(address: str, data: bytes) -> None:
    async def go() -> None:
        async with _client(address) as client:
            digest = await client.put_blob(data)
            assert await client.commit_manifest("run", 1, {"params": (digest, len(data))}) == 1

    asyncio.run(asyncio.wait_for(go(), 20))


def _assert_step_1_loads(address: str, data: bytes) -> None:
    async def go() -> None:
        async with _client(address) as client:
            latest = await client.latest_manifest("run")
            assert latest is not None and latest.step == 1
            ref = latest.blob("params")
            assert await client.get_blob(ref.digest) == data

    asyncio.run(asyncio.wait_for(go(), 20))


def test_committed_checkpoint_survives_sigkill(cluster) -> None:
    data = os.urandom(1_500_000)
    store = cluster.start_store(timeout_s=_READY_TIMEOUT_S)
    _commit_step_1(store.address, data)
    store.signal(signal.SIGKILL)
    assert store.wait(_EXIT_TIMEOUT_S) == -signal.SIGKILL

    _assert_step_1_loads(_restart(store), data)
    store.signal(signal.SIGTERM)  # graceful shutdown exits 0
    assert store.wait(_EXIT_TIMEOUT_S) == 0


def test_crash_mid_write_leaves_no_temp_files_and_previous_checkpoint(cluster) -> None:
    data = os.urandom(300_000)
    store = cluster.start_store(timeout_s=_READY_TIMEOUT_S)
    root = cluster.workdir / "store"
    _commit_step_1(store.address, data)
    assert store.kill(_EXIT_TIMEOUT_S) == -signal.SIGKILL

    new_data = os.urandom(300_000)
    address = _restart(store, _CRASH_MID_WRITE)

    async def put_until_crash() -> None:
        async with _client(address, retry_timeout_s=1.0) as client:
            with pytest.raises((grpc.aio.AioRpcError, retry_lib.RetriesExhausted)):
                await client.put_blob(new_data)

    asyncio.run(asyncio.wait_for(put_until_crash(), 20))
    assert store.wait(_EXIT_TIMEOUT_S) == 137
    assert len(_tmp_files(root)) == 1  # it really died mid-write, temp file complete

    address = _restart(store)  # without the failpoint
    assert _tmp_files(root) == []
    _assert_step_1_loads(address, data)

    async def new_blob_absent() -> None:
        async with _client(address) as client:
            assert await client.stat_blobs([hashlib.sha256(new_data).hexdigest()]) == set()

    asyncio.run(asyncio.wait_for(new_blob_absent(), 20))
