"""The one factory for client channels, with options mirroring server.py."""

from __future__ import annotations

import grpc

from ddiloco.rpc import security as security_lib
from ddiloco.rpc import server as server_lib

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", server_lib.MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", server_lib.MAX_MESSAGE_BYTES),
    # 30 s / 10 s keepalive: finds a dead WAN path within ~40 s and stays above the 30 s floor
    # that cloud front ends enforce; the server allows pings this often (server.py).
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Reconnect quickly after a syncer restart instead of gRPC's default up-to-120 s backoff.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 5_000),
    # Application-level retries (tenacity) own retrying; never stack gRPC's on top.
    ("grpc.enable_retries", 0),
)

_PLAINTEXT = security_lib.ClientSecurity(insecure=True)


def aio_channel(target: str, security: security_lib.ClientSecurity | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to `target` (host:port) with the project's options.

    `security` None means plaintext without credentials (tests, local tools); otherwise TLS (mutual
    when it has a cert and key) and/or a bearer token on every call, as configured.
    """
    security = security or _PLAINTEXT
    token = security.token()
    interceptors = security_lib.aio_token_interceptors(token) if token else None
    credentials = security.credentials()
    options = CHANNEL_OPTIONS + security.channel_options()
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(target, credentials, options=options, interceptors=interceptors)


def sync_channel(target: str, security: security_lib.ClientSecurity | None = None) -> grpc.Channel:
    """A blocking channel with the same options and security choices, for CLIs and tests."""
    security = security or _PLAINTEXT
    credentials = security.credentials()
    options = CHANNEL_OPTIONS + security.channel_options()
    if credentials is None:
        channel = grpc.insecure_channel(target, options=options)
    else:
        channel = grpc.secure_channel(target, credentials, options=options)
    token = security.token()
    return grpc.intercept_channel(channel, security_lib.SyncTokenInterceptor(token)) if token else channel
