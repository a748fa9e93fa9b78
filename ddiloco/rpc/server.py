"""The one factory for grpc.aio servers: message limits, keepalive, health and reflection.

Every service builds its server here, so options, health and shutdown behave the same
everywhere. The bound port is returned, which lets tests and `ddiloco up` bind `127.0.0.1:0`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# Payloads travel in chunks of at most 1 MiB; 8 MiB leaves room for headers and a misconfigured
# chunk size while still refusing anything that looks like an attempt to exhaust memory.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024

SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Learners ping every 30 s across the WAN (see channel.py); accept pings that often, with or
    # without calls in flight, so the server never answers GOAWAY "too_many_pings".
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 20_000),
    ("grpc.http2.max_ping_strikes", 0),
    # The server pings idle clients too, so half-open connections are found and freed.
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
)


@dataclasses.dataclass
class ServerHandle:
    """A started server with its health servicer and bound address.

    `health_server`/`health_address`: the separate plaintext health-only server, when one was
    requested (`health_bind`), so probes without client certificates reach a TLS service.
    """

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    address: str
    port: int
    health_server: grpc.aio.Server | None = None
    health_address: str = ""

    async def stop(self, grace_s: float) -> None:
        """Marks every service NOT_SERVING for good, then stops, letting RPCs finish for grace_s."""
        await self.health.enter_graceful_shutdown()
        await self.close(grace_s)

    async def close(self, grace_s: float) -> None:
        """Stops the server (and the health server), letting RPCs finish for grace_s."""
        await self.server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(0)


async def start_server(
    bind: str,
    service_names: Sequence[str],
    add_servicers: Sequence,
    *,
    maximum_concurrent_rpcs: int | None = None,
    reflection_enabled: bool = True,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
    health_bind: str = "",
) -> ServerHandle:
    """Creates, configures and starts a grpc.aio server.

    Args:
      bind: host:port to listen on; port 0 picks a free port.
      service_names: full names of the services added (for health and reflection).
      add_servicers: callables `f(server)` that register the servicers.
      maximum_concurrent_rpcs: refuse RPCs above this many in flight (RESOURCE_EXHAUSTED).
      reflection_enabled: register server reflection (for grpcurl and friends).
      interceptors: server interceptors (e.g. rpc.interceptors.MetricsInterceptor, then
        rpc.security.AuthInterceptor, so refusals are counted too).
      credentials: TLS server credentials (rpc.security.ServerSecurity); None serves plaintext.
      health_bind: if set, also serve the health service alone, in plaintext, on this host:port
        (for probes that carry no client certificate; bind it to a pod-local address).

    Returns:
      The started server with its health servicer (every service SERVING) and bound port.
    """
    server = grpc.aio.server(
        options=SERVER_OPTIONS, maximum_concurrent_rpcs=maximum_concurrent_rpcs, interceptors=list(interceptors)
    )
    for add in add_servicers:
        add(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    if reflection_enabled:
        reflection.enable_server_reflection(
            [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            server,
        )
    port = server.add_insecure_port(bind) if credentials is None else server.add_secure_port(bind, credentials)
    if port == 0:
        raise OSError(f"could not bind {bind!r}: address in use or not available")
    health_server, health_address = None, ""
    if health_bind:
        health_server = grpc.aio.server(options=SERVER_OPTIONS, maximum_concurrent_rpcs=16)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        health_port = health_server.add_insecure_port(health_bind)
        if health_port == 0:
            raise OSError(f"could not bind the health port {health_bind!r}: address in use or not available")
        health_address = f"{health_bind.rsplit(':', 1)[0] or '127.0.0.1'}:{health_port}"
    await server.start()
    if health_server is not None:
        await health_server.start()
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    host = bind.rsplit(":", 1)[0] or "127.0.0.1"
    return ServerHandle(server=server, health=health_servicer, address=f"{host}:{port}", port=port,
                        health_server=health_server, health_address=health_address)


def write_ready_file(path: str | os.PathLike, **fields: object) -> None:
    """Atomically writes a JSON file announcing that a service is serving (address, pid, ...).

    `ddiloco up` and the tests start services on port 0 and read the bound address from here.
    """
    target = pathlib.Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), **fields}))
    os.replace(tmp, target)
