"""FaultProxy: a small asyncio TCP proxy with toxiproxy-style faults ("toxics"), changeable at runtime.

Put it between a learner and the syncer (plaintext gRPC: learner -> proxy -> syncer) to inject
network faults on loopback, where netem is not available:

    latency_s, jitter_s      each chunk is delayed by latency +- uniform jitter (order is kept;
                             throughput is not limited by the delay: a delay line, not stop-and-wait)
    bandwidth_bytes_per_s    a token bucket per direction, shared by all of the proxy's connections
    blackhole                nothing is forwarded (connections stay open, new ones are accepted,
                             bytes wait in the "network"); when it ends, forwarding resumes, as
                             TCP would after retransmitting
    partition                the link is cut: every connection is reset and new ones are reset
                             at once, until it ends (fast failure, like ICMP unreachable)
    reset_after_bytes        toxiproxy's limit_data: a connection is reset once it has carried
                             this many bytes upstream (a reset mid-stream)
    slice_bytes, slice_delay_s   toxiproxy's slicer: forward tiny segments with a pause between
    flap_down_s, flap_up_s   a flapping link: partitioned for down_s, up for up_s, repeatedly
and `reset_peer()` resets every open connection once (toxiproxy's reset_peer).

Use from asyncio:

    proxy = FaultProxy("127.0.0.1", "127.0.0.1", syncer_port)
    port = await proxy.start()
    proxy.set(latency_s=0.2, jitter_s=0.05, bandwidth_bytes_per_s=2.5e6)
    ...
    await proxy.stop()

or from synchronous code (tests, the chaos harness, benchmarks), on a background thread:

    proxy = FaultProxy("127.0.0.1", "127.0.0.1", syncer_port)
    port = proxy.start_in_thread()
    proxy.set(partition=True); ...; proxy.clear()
    proxy.close()

`set()`, `clear()` and `reset_peer()` may be called from any thread; from another thread they
return once the change is in effect. `stats` counts connections, bytes and resets.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import socket
import struct
import threading
import time

_LOG = logging.getLogger("ddiloco.chaos.proxy")

_READ_BYTES = 64 * 1024
_QUEUE_CHUNKS = 64  # per direction and connection: at most ~4 MiB "in the network"
_MAX_BUCKET_PIECE = 16 * 1024


@dataclasses.dataclass(frozen=True)
class Toxics:
    """The faults in effect (all off by default). See the module docstring."""

    latency_s: float = 0.0
    jitter_s: float = 0.0
    bandwidth_bytes_per_s: float = 0.0  # 0: unlimited
    blackhole: bool = False
    partition: bool = False
    reset_after_bytes: int = 0  # 0: off
    slice_bytes: int = 0  # 0: off
    slice_delay_s: float = 0.0
    flap_down_s: float = 0.0  # both > 0: flapping
    flap_up_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("latency_s", "jitter_s", "bandwidth_bytes_per_s", "reset_after_bytes", "slice_bytes",
                     "slice_delay_s", "flap_down_s", "flap_up_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"Toxics.{name}={getattr(self, name)!r}: must be >= 0")

    @property
    def flapping(self) -> bool:
        return self.flap_down_s > 0 and self.flap_up_s > 0


@dataclasses.dataclass
class ProxyStats:
    connections: int = 0  # accepted in total
    active: int = 0
    bytes_up: int = 0  # client -> upstream, forwarded
    bytes_down: int = 0  # upstream -> client, forwarded
    resets: int = 0  # connections reset by a toxic or reset_peer()
    refused: int = 0  # connections reset on arrival (partition)
    upstream_errors: int = 0  # the upstream could not be reached
    flaps: int = 0  # down periods of a flapping link


class _Bucket:
    """A token bucket that may go into debt: the caller sleeps off what it took beyond the tokens."""

    def __init__(self) -> None:
        self.tokens = 0.0
        self.last = time.monotonic()

    async def take(self, n: int, rate: float) -> None:
        now = time.monotonic()
        burst = max(rate * 0.02, 1024.0)
        self.tokens = min(burst, self.tokens + (now - self.last) * rate) - n
        self.last = now
        if self.tokens < 0:
            await asyncio.sleep(-self.tokens / rate)


def _rst(writer: asyncio.StreamWriter) -> None:
    """Closes a connection with a TCP RST (SO_LINGER 0), not a FIN."""
    try:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    writer.transport.abort()


class _Conn:
    def __init__(self, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream = upstream
        self.sent_up = 0
        self.closed = False
        self.closed_event = asyncio.Event()

    def reset(self) -> None:
        if not self.closed:
            self.closed = True
            self.closed_event.set()
            _rst(self.client)
            _rst(self.upstream)


class FaultProxy:
    """A TCP proxy from (listen_host, listen_port) to (upstream_host, upstream_port) with toxics."""

    def __init__(self, listen_host: str = "127.0.0.1", upstream_host: str = "127.0.0.1", upstream_port: int = 0, *,
                 listen_port: int = 0, name: str = "", seed: int | None = None) -> None:
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.name = name or f"proxy->{upstream_host}:{upstream_port}"
        self.toxics = Toxics()
        self.stats = ProxyStats()
        self._rng = random.Random(seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[_Conn] = set()
        self._tasks: set[asyncio.Task] = set()
        self._flowing: asyncio.Event | None = None  # set unless blackholed
        self._flap_task: asyncio.Task | None = None
        self._flap_down = False
        self._buckets = {"up": _Bucket(), "down": _Bucket()}
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------ lifecycle

    @property
    def port(self) -> int:
        return self.listen_port

    @property
    def address(self) -> str:
        return f"{self.listen_host}:{self.listen_port}"

    async def start(self) -> int:
        """Starts listening; returns the port (a free one if listen_port was 0)."""
        self._loop = asyncio.get_running_loop()
        self._flowing = asyncio.Event()
        self._apply(self.toxics, force=True)
        self._server = await asyncio.start_server(self._accept, self.listen_host, self.listen_port)
        self.listen_port = self._server.sockets[0].getsockname()[1]
        _LOG.info(f"{self.name} listening on {self.address}")
        return self.listen_port

    async def stop(self) -> None:
        """Stops listening and resets every connection."""
        if self._server is not None:
            self._server.close()
        if self._flap_task is not None:
            self._flap_task.cancel()
        for conn in list(self._conns):
            conn.reset()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            except asyncio.TimeoutError:
                pass
            self._server = None

    def start_in_thread(self, timeout_s: float = 10.0) -> int:
        """Runs the proxy on its own event loop in a daemon thread; returns the port."""
        loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name=f"fault-proxy-{self.name}", daemon=True)
        self._thread.start()
        return asyncio.run_coroutine_threadsafe(self.start(), loop).result(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stops a proxy started with start_in_thread (and its thread)."""
        loop = self._loop
        if loop is None or self._thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self.stop(), loop).result(timeout_s)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout_s)
            self._thread = None

    # ------------------------------------------------------------------------------ control

    def set(self, **changes) -> Toxics:
        """Changes some toxics (the others stay); returns the toxics now in effect."""
        new = dataclasses.replace(self.toxics, **changes)
        self._call(self._apply, new)
        return new

    def clear(self) -> None:
        """Removes every toxic."""
        self._call(self._apply, Toxics())

    def reset_peer(self) -> int:
        """Resets every open connection now (toxiproxy's reset_peer); returns how many."""
        box = []
        self._call(lambda: box.append(self._reset_all()))
        return box[0] if box else 0

    def _call(self, fn, *args) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            fn(*args)
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            fn(*args)
            return

        async def run() -> None:
            fn(*args)

        asyncio.run_coroutine_threadsafe(run(), loop).result(10.0)

    def _apply(self, new: Toxics, force: bool = False) -> None:
        old, self.toxics = self.toxics, new
        if self._flowing is not None:
            if new.blackhole:
                self._flowing.clear()
            else:
                self._flowing.set()
        if new.partition and (force or not old.partition):
            self._reset_all()
        if force or (new.flap_down_s, new.flap_up_s) != (old.flap_down_s, old.flap_up_s):
            if self._flap_task is not None:
                self._flap_task.cancel()
                self._flap_task = None
            self._flap_down = False
            if new.flapping and self._loop is not None:
                self._flap_task = self._loop.create_task(self._flap(new.flap_down_s, new.flap_up_s))

    def _reset_all(self) -> int:
        conns = [c for c in self._conns if not c.closed]
        for conn in conns:
            conn.reset()
        self.stats.resets += len(conns)
        return len(conns)

    @property
    def cut(self) -> bool:
        """True while the link is partitioned (by `partition` or a flap's down period)."""
        return self.toxics.partition or self._flap_down

    async def _flap(self, down_s: float, up_s: float) -> None:
        try:
            while True:
                self._flap_down = True
                self.stats.flaps += 1
                self._reset_all()
                await asyncio.sleep(down_s)
                self._flap_down = False
                await asyncio.sleep(up_s)
        finally:
            self._flap_down = False

    # ------------------------------------------------------------------------------ data path

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        if self.cut:
            self.stats.refused += 1
            _rst(client_writer)
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(self.upstream_host, self.upstream_port), 10.0)
        except (OSError, asyncio.TimeoutError):
            self.stats.upstream_errors += 1
            _rst(client_writer)
            return
        if self.cut:  # partitioned while connecting
            self.stats.refused += 1
            _rst(client_writer)
            _rst(up_writer)
            return
        for w in (client_writer, up_writer):
            sock = w.get_extra_info("socket")
            if sock is not None:
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:
                    pass
        conn = _Conn(client_writer, up_writer)
        self._conns.add(conn)
        self.stats.active += 1
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            await asyncio.gather(self._direction(conn, client_reader, up_writer, "up"),
                                 self._direction(conn, up_reader, client_writer, "down"))
        except asyncio.CancelledError:
            conn.reset()
        finally:
            self._conns.discard(conn)
            self._tasks.discard(task)
            self.stats.active -= 1
            if not conn.closed:
                conn.closed = True
                for w in (client_writer, up_writer):
                    w.close()

    async def _direction(self, conn: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         direction: str) -> None:
        """One direction: a reader filling a delay line and a writer draining it at the toxics' pace."""
        queue: asyncio.Queue = asyncio.Queue(_QUEUE_CHUNKS)

        async def read() -> None:
            release = 0.0
            try:
                while True:
                    data = await reader.read(_READ_BYTES)
                    if not data:
                        break
                    t = self.toxics
                    delay = t.latency_s + (self._rng.uniform(-t.jitter_s, t.jitter_s) if t.jitter_s else 0.0)
                    release = max(release, time.monotonic() + max(delay, 0.0))
                    await queue.put((release, data))
            except (ConnectionError, OSError):
                pass
            finally:
                await queue.put((0.0, None))

        async def write() -> None:
            while True:
                release, data = await queue.get()
                if data is None:
                    if not conn.closed and writer.can_write_eof():
                        try:
                            writer.write_eof()
                        except (ConnectionError, OSError, RuntimeError):
                            pass
                    return
                wait = release - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self._forward(conn, writer, data, direction)
                if conn.closed:
                    return

        reader_task = asyncio.create_task(read())
        try:
            await write()
        except (ConnectionError, OSError):
            conn.reset()
        finally:
            if conn.closed:
                reader_task.cancel()
            try:
                await reader_task
            except asyncio.CancelledError:
                pass

    async def _forward(self, conn: _Conn, writer: asyncio.StreamWriter, data: bytes, direction: str) -> None:
        view = memoryview(data)
        while view and not conn.closed:
            if not self._flowing.is_set():  # blackhole: hold (the bytes stay "in the network")
                waits = [asyncio.ensure_future(self._flowing.wait()), asyncio.ensure_future(conn.closed_event.wait())]
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits:
                        w.cancel()
                continue
            t = self.toxics
            piece = len(view)
            if t.slice_bytes:
                piece = min(piece, t.slice_bytes)
            if t.bandwidth_bytes_per_s:
                piece = min(piece, _MAX_BUCKET_PIECE)
            if direction == "up" and t.reset_after_bytes:
                piece = min(piece, max(t.reset_after_bytes - conn.sent_up, 0))
                if piece == 0:
                    self.stats.resets += 1
                    conn.reset()
                    return
            if t.bandwidth_bytes_per_s:
                await self._buckets[direction].take(piece, t.bandwidth_bytes_per_s)
            if conn.closed:
                return
            writer.write(view[:piece])
            await writer.drain()
            if direction == "up":
                conn.sent_up += piece
                self.stats.bytes_up += piece
            else:
                self.stats.bytes_down += piece
            view = view[piece:]
            if t.slice_bytes and t.slice_delay_s and view:
                await asyncio.sleep(t.slice_delay_s)


class ProxyGroup:
    """Several proxies acting as one link (a learner's links to each of several syncers): a toxic
    set on the group is set on each, and its stats are their sums."""

    def __init__(self, proxies: list[FaultProxy]) -> None:
        self.proxies = proxies

    @property
    def address(self) -> str:
        return ",".join(p.address for p in self.proxies)

    @property
    def stats(self) -> ProxyStats:
        fields = [f.name for f in dataclasses.fields(ProxyStats)]
        return ProxyStats(**{k: sum(getattr(p.stats, k) for p in self.proxies) for k in fields})

    def set(self, **changes) -> Toxics:
        return [p.set(**changes) for p in self.proxies][-1]

    def reset_peer(self) -> int:
        return sum(p.reset_peer() for p in self.proxies)

    def close(self, timeout_s: float = 10.0) -> None:
        for p in self.proxies:
            p.close(timeout_s)
