"""Helpers of the service tests: a syncer servicer on a real gRPC server in the test's event loop."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence

import grpc

from ddiloco.rpc import channel as channel_lib
from ddiloco.rpc import security
from ddiloco.rpc import server as server_lib
from ddiloco.v1 import syncer_pb2_grpc
from services.syncer import core as core_lib
from services.syncer import servicer as servicer_lib


@dataclasses.dataclass
class ServedSyncer:
    servicer: servicer_lib.SyncerServicer
    handle: server_lib.ServerHandle  # .address
    stub: syncer_pb2_grpc.SyncerStub  # a plaintext asyncio client of it


@contextlib.asynccontextmanager
async def serve_syncer(core: core_lib.SyncerCore | None, *, servicer: servicer_lib.SyncerServicer | None = None,
                       max_concurrent_uploads: int = 4, auth: bool = True,
                       interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> AsyncIterator[ServedSyncer]:
    """Serves `servicer` (by default a SyncerServicer of `core`) in plaintext on 127.0.0.1:0, with a
    client stub; at the end closes the client and stops the server without grace.

    auth: the syncer's AuthInterceptor (anonymous plaintext identities) after `interceptors`, as
    the syncer chains them; False serves the servicer alone.
    """
    if servicer is None:  # a test's own servicer brings its core
        servicer = servicer_lib.SyncerServicer(core, max_concurrent_uploads=max_concurrent_uploads)
    chain = list(interceptors)
    if auth:
        sec = security.ServerSecurity(insecure=True)
        chain.append(security.AuthInterceptor(sec.authenticator(), security.SYNCER_POLICY,
                                              on_reject=servicer.record_interceptor_refusal))
    handle = await server_lib.start_server(
        "127.0.0.1:0", ["ddiloco.v1.Syncer"], [lambda s: syncer_pb2_grpc.add_SyncerServicer_to_server(servicer, s)],
        interceptors=chain)
    try:
        channel = channel_lib.aio_channel(handle.address, security.ClientSecurity(insecure=True))
        try:
            yield ServedSyncer(servicer, handle, syncer_pb2_grpc.SyncerStub(channel))
        finally:
            await channel.close()
    finally:
        await handle.stop(grace_s=0)
