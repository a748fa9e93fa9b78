"""The asyncio fault proxy on its own: each toxic against an echo server on 127.0.0.1 (seconds)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import pytest

from ddiloco.chaos.proxy import FaultProxy, Toxics

pytestmark = pytest.mark.timeout(60)


async def _echo_server():
    async def handle(reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _sink_server(received: list):
    async def handle(reader, writer):
        try:
            while data := await reader.read(65536):
                received.append((time.monotonic(), len(data)))
        except ConnectionError:
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@contextlib.asynccontextmanager
async def _proxied(server=None, **proxy_options):
    """A FaultProxy in front of `server` (awaited: (server, port); an echo server by default);
    yields the proxy and its port, and stops both at the end."""
    server, port = await (server if server is not None else _echo_server())
    proxy = FaultProxy("127.0.0.1", "127.0.0.1", port, **proxy_options)
    try:
        yield proxy, await proxy.start()
    finally:
        await proxy.stop()
        server.close()


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _roundtrip(port: int, payload: bytes) -> tuple[bytes, float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    writer.write(payload)
    await writer.drain()
    got = await reader.readexactly(len(payload))
    elapsed = time.monotonic() - started
    writer.close()
    return got, elapsed


def test_passthrough_and_latency_keep_bytes_and_order():
    async def main():
        async with _proxied(seed=1) as (proxy, pport):
            payload = bytes(range(256)) * 4096  # 1 MiB
            got, fast = await _roundtrip(pport, payload)
            assert got == payload
            proxy.set(latency_s=0.2, jitter_s=0.05)
            got, slow = await _roundtrip(pport, payload)
            assert got == payload  # jitter never reorders
            # Each direction is delayed 0.15-0.25 s; a delay line, not stop-and-wait per chunk.
            assert 0.3 <= slow < 0.3 + 1.5, slow
            assert proxy.stats.bytes_up == proxy.stats.bytes_down == 2 * len(payload)

    _run(main())


def test_bandwidth_cap_bounds_throughput():
    async def main():
        received: list = []
        async with _proxied(_sink_server(received)) as (proxy, pport):
            proxy.set(bandwidth_bytes_per_s=1_000_000)
            reader, writer = await asyncio.open_connection("127.0.0.1", pport)
            started = time.monotonic()
            writer.write(b"x" * 1_500_000)
            await writer.drain()
            while sum(n for _, n in received) < 1_500_000:
                await asyncio.sleep(0.01)
            elapsed = time.monotonic() - started
            assert 1.3 <= elapsed <= 3.0, elapsed  # 1.5 MB at 1 MB/s
            writer.close()

    _run(main())


def test_partition_resets_and_refuses_then_heals():
    async def main():
        async with _proxied() as (proxy, pport):
            reader, writer = await asyncio.open_connection("127.0.0.1", pport)
            writer.write(b"hello")
            assert await reader.readexactly(5) == b"hello"
            proxy.set(partition=True)
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
                writer.write(b"more")
                await writer.drain()
                await reader.readexactly(4)
            # New connections are reset on arrival.
            r2, w2 = await asyncio.open_connection("127.0.0.1", pport)
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
                w2.write(b"x")
                await w2.drain()
                await r2.readexactly(1)
            assert proxy.stats.resets >= 1 and proxy.stats.refused >= 1
            proxy.set(partition=False)
            got, _ = await _roundtrip(pport, b"after heal")
            assert got == b"after heal"

    _run(main())


def test_blackhole_holds_bytes_and_releases_them_on_heal():
    async def main():
        async with _proxied() as (proxy, pport):
            reader, writer = await asyncio.open_connection("127.0.0.1", pport)
            proxy.set(blackhole=True)
            writer.write(b"held")
            await writer.drain()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(reader.readexactly(4), 0.5)
            proxy.set(blackhole=False)
            assert await asyncio.wait_for(reader.readexactly(4), 5) == b"held"
            writer.close()

    _run(main())


def test_reset_after_bytes_and_reset_peer():
    async def main():
        async with _proxied() as (proxy, pport):
            proxy.set(reset_after_bytes=1000)
            reader, writer = await asyncio.open_connection("127.0.0.1", pport)
            writer.write(b"y" * 5000)
            data = b""
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
                while True:
                    chunk = await reader.read(65536)
                    if not chunk:
                        raise asyncio.IncompleteReadError(data, None)
                    data += chunk
            assert len(data) <= 1000
            proxy.clear()
            reader, writer = await asyncio.open_connection("127.0.0.1", pport)
            writer.write(b"z")
            assert await reader.readexactly(1) == b"z"
            assert proxy.reset_peer() == 1
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
                writer.write(b"z")
                await writer.drain()
                await reader.readexactly(1)

    _run(main())


def test_flapping_link_alternates_down_and_up():
    async def main():
        async with _proxied() as (proxy, pport):
            proxy.set(flap_down_s=0.3, flap_up_s=0.3)
            ok = failed = 0
            deadline = time.monotonic() + 2.5
            while time.monotonic() < deadline:
                try:
                    got, _ = await asyncio.wait_for(_roundtrip(pport, b"ping"), 1.0)
                    ok += got == b"ping"
                except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
                    failed += 1
                await asyncio.sleep(0.05)
            assert ok > 0 and failed > 0, (ok, failed)
            assert proxy.stats.flaps >= 3
            proxy.clear()
            assert not proxy.cut

    _run(main())


def test_slicer_reassembles_and_thread_helper():
    # The synchronous helper (for tests, the harness and benchmarks): a proxy on its own thread.
    done = []

    def echo_thread(srv: socket.socket):
        conn, _ = srv.accept()
        with conn:
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
            except OSError:  # the proxy resets its connections when it closes
                pass
        done.append(True)

    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    t = threading.Thread(target=echo_thread, args=(srv,), daemon=True)
    t.start()
    proxy = FaultProxy("127.0.0.1", "127.0.0.1", srv.getsockname()[1])
    port = proxy.start_in_thread()
    try:
        proxy.set(slice_bytes=7, slice_delay_s=0.0005)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            payload = bytes(range(256)) * 8
            c.sendall(payload)
            got = b""
            while len(got) < len(payload):
                got += c.recv(65536)
            assert got == payload
        assert proxy.toxics == Toxics(slice_bytes=7, slice_delay_s=0.0005)
    finally:
        proxy.close()
        srv.close()
    with pytest.raises(ValueError):
        Toxics(latency_s=-1)
