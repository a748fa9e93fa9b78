"""The one factory for client channels, with options mirroring server.py."""

from __future__ import annotations

import grpc

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


def aio_channel(target: str) -> grpc.aio.Channel:
    """An insecure grpc.aio channel to `target` (host:port) with the project's options."""
    return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)


def sync_channel(target: str) -> grpc.Channel:
    """A blocking channel with the same options, for CLIs and tests."""
    return grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
