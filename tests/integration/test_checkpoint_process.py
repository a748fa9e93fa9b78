"""The checkpoint store as a real process: committed checkpoints survive SIGKILL, and a crash in
the middle of a write (failpoint) leaves no temp files and the previous checkpoint readable."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import grpc
import pytest

from ddiloco import checkpoint_client
from ddiloco.rpc import channel as channel_lib
from ddiloco.rpc import retry as retry_lib

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
_READY_TIMEOUT_S = 20.0
_EXIT_TIMEOUT_S = 10.0


@contextlib.contextmanager
def _checkpoint_process(tmp_path: pathlib.Path, root: pathlib.Path, *, failpoints: str = ""):
    """Starts `python -m services.checkpoint` on a free port; yields (process, address).

    The process is SIGKILLed (by its PID) on exit if it is still running.
    """
    ready = tmp_path / "ready.json"
    env = {**os.environ, "PYTHONPATH": str(_REPO_ROOT), "DDILOCO_FAILPOINTS": failpoints}
    log_path = tmp_path / f"checkpoint-{time.monotonic_ns()}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.checkpoint", "--bind", "127.0.0.1:0", "--insecure",
             "--root", str(root), "--ready-file", str(ready)],
            cwd=_REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        yield proc, _wait_ready(proc, ready, log_path)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=_EXIT_TIMEOUT_S)


def _wait_ready(proc: subprocess.Popen, ready: pathlib.Path, log_path: pathlib.Path) -> str:
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = log_path.read_text()
            raise AssertionError(f"checkpoint store exited {proc.returncode}:\n{log}")
        with contextlib.suppress(FileNotFoundError, ValueError):
            info = json.loads(ready.read_text())
            if info["pid"] == proc.pid:  # not a ready file left by an earlier process
                return info["address"]
        time.sleep(0.05)
    raise AssertionError(f"no ready file after {_READY_TIMEOUT_S} s:\n{log_path.read_text()}")


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


def test_committed_checkpoint_survives_sigkill(tmp_path: pathlib.Path) -> None:
    root, data = tmp_path / "store", os.urandom(1_500_000)
    with _checkpoint_process(tmp_path, root) as (proc, address):
        _commit_step_1(address, data)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=_EXIT_TIMEOUT_S) == -signal.SIGKILL

    with _checkpoint_process(tmp_path, root) as (proc, address):
        _assert_step_1_loads(address, data)
        proc.send_signal(signal.SIGTERM)  # graceful shutdown exits 0
        assert proc.wait(timeout=_EXIT_TIMEOUT_S) == 0


def test_crash_mid_write_leaves_no_temp_files_and_previous_checkpoint(tmp_path) -> None:
    root, data = tmp_path / "store", os.urandom(300_000)
    with _checkpoint_process(tmp_path, root) as (proc, address):
        _commit_step_1(address, data)

    new_data = os.urandom(300_000)
    with _checkpoint_process(tmp_path, root, failpoints="store.after_tmp_write=crash") as (
        proc,
        address,
    ):

        async def put_until_crash() -> None:
            async with _client(address, retry_timeout_s=1.0) as client:
                with pytest.raises((grpc.aio.AioRpcError, retry_lib.RetriesExhausted)):
                    await client.put_blob(new_data)

        asyncio.run(asyncio.wait_for(put_until_crash(), 20))
        assert proc.wait(timeout=_EXIT_TIMEOUT_S) == 137
    assert len(_tmp_files(root)) == 1  # it really died mid-write, temp file complete

    with _checkpoint_process(tmp_path, root) as (proc, address):
        assert _tmp_files(root) == []
        _assert_step_1_loads(address, data)

        async def new_blob_absent() -> None:
            async with _client(address) as client:
                assert await client.stat_blobs([hashlib.sha256(new_data).hexdigest()]) == set()

        asyncio.run(asyncio.wait_for(new_blob_absent(), 20))
