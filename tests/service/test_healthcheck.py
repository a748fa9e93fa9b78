"""`python -m ddiloco.healthcheck` (the containers' HEALTHCHECK) against a real grpc.aio server
started with the project's own factory on 127.0.0.1:0."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import pytest

from ddiloco import healthcheck
from ddiloco.rpc import server as server_lib
from ddiloco.v1 import checkpoint_pb2

pytestmark = pytest.mark.timeout(60)

SERVICE = checkpoint_pb2.DESCRIPTOR.services_by_name["CheckpointStore"].full_name


def _probe(*args: str) -> int:
    """Runs the probe's main() in a worker thread (the server lives on the test's event loop)."""
    return healthcheck.main(["--quiet", *args])


async def _started() -> server_lib.ServerHandle:
    # No servicer is needed: health (and reflection) are registered by start_server itself.
    return await server_lib.start_server("127.0.0.1:0", [SERVICE], [])


def _free_port() -> int:
    """A port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serving_exits_zero() -> None:
    async def body() -> None:
        handle = await _started()
        try:
            target = f"127.0.0.1:{handle.port}"
            assert await asyncio.to_thread(_probe, "--target", target) == 0
            assert await asyncio.to_thread(_probe, "--target", target, "--service", SERVICE) == 0
            # A service the server does not have is not "serving".
            assert await asyncio.to_thread(_probe, "--target", target, "--service", "no.Such") != 0
        finally:
            await handle.server.stop(None)

    asyncio.run(body())


def test_unreachable_fails_quickly() -> None:
    started = time.monotonic()
    assert _probe("--target", f"127.0.0.1:{_free_port()}", "--timeout-s", "2") == healthcheck.EXIT_UNREACHABLE
    assert time.monotonic() - started < 3.0


def test_after_graceful_shutdown_is_not_serving() -> None:
    async def body() -> None:
        handle = await _started()
        try:
            target = f"127.0.0.1:{handle.port}"
            assert await asyncio.to_thread(_probe, "--target", target) == 0
            # What every service does on SIGTERM before draining (ServerHandle.stop).
            await handle.health.enter_graceful_shutdown()
            assert await asyncio.to_thread(_probe, "--target", target) == healthcheck.EXIT_NOT_SERVING
            assert await asyncio.to_thread(_probe, "--target", target, "--service", SERVICE) != 0
        finally:
            await handle.server.stop(None)

    asyncio.run(body())


def test_module_entry_point_exit_status() -> None:
    """The exact command the image's HEALTHCHECK runs, as a separate process."""

    async def body() -> None:
        handle = await _started()
        try:
            cmd = [sys.executable, "-m", "ddiloco.healthcheck", "--target", f"127.0.0.1:{handle.port}"]
            done = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, timeout=30)
            assert done.returncode == 0, done.stderr
            assert "SERVING" in done.stdout
        finally:
            await handle.server.stop(None)
        cmd = [sys.executable, "-m", "ddiloco.healthcheck", "--target", f"127.0.0.1:{_free_port()}", "--timeout-s", "1"]
        done = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, timeout=30)
        assert done.returncode == healthcheck.EXIT_UNREACHABLE
        assert "UNAVAILABLE" in done.stderr or "DEADLINE_EXCEEDED" in done.stderr

    asyncio.run(body())
