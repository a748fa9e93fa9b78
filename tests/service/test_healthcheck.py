"""`python -m ddiloco.healthcheck` (the containers' HEALTHCHECK) against a real grpc.aio server
started with the project's own factory on 127.0.0.1:0."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest

from ddiloco import healthcheck
from ddiloco.rpc import server as server_lib
from ddiloco.v1 import checkpoint_pb2
from tests import ports

pytestmark = pytest.mark.timeout(60)

SERVICE = checkpoint_pb2.DESCRIPTOR.services_by_name["CheckpointStore"].full_name


def _probe(*args: str) -> int:
    """Runs the probe's main() in a worker thread (the server lives on the test's event loop)."""
    return healthcheck.main(["--quiet", *args])


@contextlib.asynccontextmanager
async def _serving() -> AsyncIterator[tuple[server_lib.ServerHandle, str]]:
    """A server on 127.0.0.1:0 and its host:port, stopped at the end."""
    # No servicer is needed: health (and reflection) are registered by start_server itself.
    handle = await server_lib.start_server("127.0.0.1:0", [SERVICE], [])
    try:
        yield handle, f"127.0.0.1:{handle.port}"
    finally:
        await handle.server.stop(None)


def test_serving_exits_zero() -> None:
    async def body() -> None:
        async with _serving() as (_, target):
            assert await asyncio.to_thread(_probe, "--target", target) == 0
            assert await asyncio.to_thread(_probe, "--target", target, "--service", SERVICE) == 0
            # A service the server does not have is not "serving".
            assert await asyncio.to_thread(_probe, "--target", target, "--service", "no.Such") != 0

    asyncio.run(body())


def test_unreachable_fails_quickly() -> None:
    with ports.refused_address() as nobody:
        started = time.monotonic()
        assert _probe("--target", nobody, "--timeout-s", "2") == healthcheck.EXIT_UNREACHABLE
        assert time.monotonic() - started < 3.0


def test_after_graceful_shutdown_is_not_serving() -> None:
    async def body() -> None:
        async with _serving() as (handle, target):
            assert await asyncio.to_thread(_probe, "--target", target) == 0
            # What every service does on SIGTERM before draining (ServerHandle.stop).
            await handle.health.enter_graceful_shutdown()
            assert await asyncio.to_thread(_probe, "--target", target) == healthcheck.EXIT_NOT_SERVING
            assert await asyncio.to_thread(_probe, "--target", target, "--service", SERVICE) != 0

    asyncio.run(body())


def test_module_entry_point_exit_status() -> None:
    """The exact command the image's HEALTHCHECK runs, as a separate process."""

    async def body() -> None:
        async with _serving() as (_, target):
            cmd = [sys.executable, "-m", "ddiloco.healthcheck", "--target", target]
            done = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, timeout=30)
            assert done.returncode == 0, done.stderr
            assert "SERVING" in done.stdout
        with ports.refused_address() as nobody:
            cmd = [sys.executable, "-m", "ddiloco.healthcheck", "--target", nobody, "--timeout-s", "1"]
            done = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, timeout=30)
        assert done.returncode == healthcheck.EXIT_UNREACHABLE
        assert "UNAVAILABLE" in done.stderr or "DEADLINE_EXCEEDED" in done.stderr

    asyncio.run(body())
