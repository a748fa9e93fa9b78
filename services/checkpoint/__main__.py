"""Wiring only: config → logging → BlobStore → gRPC server → ready file → wait for a signal.

`python -m services.checkpoint --root DIR` and the `ddiloco checkpoint` CLI both call `main`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import signal
import sys
from collections.abc import Sequence

from ddiloco import logs
from ddiloco import metrics as metrics_lib
from ddiloco.rpc import interceptors as rpc_interceptors
from ddiloco.rpc import security as security_lib
from ddiloco.rpc import server as server_lib
from ddiloco.v1 import checkpoint_pb2, checkpoint_pb2_grpc
from . import config as config_lib
from . import servicer as servicer_lib
from . import metrics as store_metrics
from . import store as store_lib

SERVICE_NAME = checkpoint_pb2.DESCRIPTOR.services_by_name["CheckpointStore"].full_name
_LOG = logging.getLogger("services.checkpoint")


async def serve(cfg: config_lib.CheckpointConfig) -> int:
    """Serves until SIGTERM/SIGINT, then stops gracefully. Returns the exit status."""
    if cfg.ready_file is not None:
        # A ready file from an earlier (killed) process must not announce this one early.
        pathlib.Path(cfg.ready_file).unlink(missing_ok=True)
    try:
        server_security = cfg.server_security()
        credentials = server_security.credentials()
        authenticator = server_security.authenticator()
    except ValueError as exc:
        _LOG.error("security configuration: %s", exc)
        return 2
    store = store_lib.BlobStore(  # removes temp files left by a crash
        cfg.root,
        retention=store_lib.LatestN(cfg.keep_latest),
        max_blob_bytes=cfg.max_blob_bytes,
        gc_grace_s=cfg.gc_grace_s,
        failpoints=cfg.failpoints,
    )
    servicer = servicer_lib.CheckpointStoreServicer(store, chunk_size_bytes=cfg.chunk_size_bytes,
                                                    ledger_retain_merges=cfg.ledger_retain_merges)
    def add_servicer(server) -> None:
        checkpoint_pb2_grpc.add_CheckpointStoreServicer_to_server(servicer, server)

    registry = metrics_lib.new_registry("checkpoint")
    registry.register(store_metrics.StoreCollector(store))
    auth = security_lib.AuthInterceptor(authenticator, security_lib.CHECKPOINT_POLICY,
                                        on_reject=store_metrics.auth_failure_counter(registry))
    interceptors = [rpc_interceptors.MetricsInterceptor(registry), auth]
    handle = await server_lib.start_server(cfg.bind, [SERVICE_NAME], [add_servicer], interceptors=interceptors,
                                           credentials=credentials, health_bind=cfg.health_bind)
    metrics_address = metrics_lib.serve(cfg.metrics_bind, registry).address if cfg.metrics_bind else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if cfg.ready_file is not None:
        server_lib.write_ready_file(cfg.ready_file, address=handle.address, service="checkpoint",
                                    metrics_address=metrics_address, health_address=handle.health_address)
    _LOG.info("checkpoint store serving on %s root=%s transport=%s", handle.address, cfg.root,
              "mtls" if server_security.tls else "plaintext")
    await stop.wait()
    _LOG.info("signal received; stopping (grace %.1f s)", cfg.grace_s)
    await handle.stop(cfg.grace_s)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    cfg = config_lib.parse_config(sys.argv[1:] if argv is None else argv, os.environ)
    # Plaintext must be asked for: refuse to start with neither certificates nor --insecure.
    security_lib.require_choice("ddiloco checkpoint", cfg.server_security)
    logs.setup_logging(cfg.log_level, json_lines=cfg.json_logs, component="services.checkpoint")
    return asyncio.run(serve(cfg))


if __name__ == "__main__":
    sys.exit(main())
