"""Delay lines for the upload section: one `ddiloco.chaos.proxy.FaultProxy` per upstream, each
adding the same latency per direction.

`python -m ddiloco.bench.perf_workers.proxies SPEC_JSON READY_FILE`, the spec
{"upstreams": ["host:port", ...], "latency_s": s}: the ready file lists the proxies' ports in
the order of the upstreams (its address is the first one's)."""

from __future__ import annotations

import asyncio
import json
import sys

from ddiloco.chaos import proxy as proxy_lib
from ddiloco.rpc import server as server_lib


async def serve(spec: dict, ready_file: str) -> None:
    ports = []
    for upstream in spec["upstreams"]:
        host, port = upstream.rsplit(":", 1)
        proxy = proxy_lib.FaultProxy("127.0.0.1", host, int(port))
        ports.append(await proxy.start())
        proxy.set(latency_s=spec["latency_s"])
    server_lib.write_ready_file(ready_file, address=f"127.0.0.1:{ports[0]}", ports=ports)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(serve(json.loads(sys.argv[1]), sys.argv[2]))
