"""A bare gRPC stream of bytes: a grpc.aio server whose one method reads an upload's chunks and
does nothing else, with no protobuf (the transport section's limit).

`python -m ddiloco.bench.perf_workers.bare READY_FILE`: serves on 127.0.0.1 until stopped."""

from __future__ import annotations

import asyncio
import sys

import grpc

from ddiloco.rpc import server as server_lib


async def _sink(request_iterator, context) -> bytes:
    n = 0
    async for chunk in request_iterator:
        n += len(chunk)
    return n.to_bytes(8, "little")


async def serve(ready_file: str) -> None:
    handler = grpc.method_handlers_generic_handler("bench.Bare", {
        "Upload": grpc.stream_unary_rpc_method_handler(_sink)})
    server = grpc.aio.server(options=server_lib.SERVER_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    server_lib.write_ready_file(ready_file, address=f"127.0.0.1:{port}")
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1]))
