"""Prometheus plumbing shared by the services: a registry per service and its HTTP endpoint.

Conventions (https://prometheus.io/docs/practices/naming, checked by `promtool check metrics` in
tests/service/test_metrics_exposition.py): every metric of ours starts with `ddiloco_`, one
quantity per metric with its base unit in the name (`_seconds`, `_bytes`), monotonic counts are
counters (exposed with `_total`), one name per quantity whichever service exports it, and labels
stay low-cardinality (learner ids are bounded by the number of learners; versions and steps are
values, never labels). Metrics with names of their own ecosystem keep them: `grpc_server_*`
(rpc/interceptors.py) and the standard `process_*` (process_start_time_seconds tells restarts).
Services build their metrics on their own `CollectorRegistry` (no global state, so tests can run
several services in one process) and serve it with `serve`.
"""

from __future__ import annotations

import dataclasses

import prometheus_client
from prometheus_client import CollectorRegistry

from ddiloco import __version__

# Buckets for durations from a millisecond to a few minutes (merges, checkpoints, rejoins).
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 180)


@dataclasses.dataclass
class MetricsServer:
    address: str
    port: int
    _server: object

    def stop(self) -> None:
        self._server.shutdown()


def new_registry(component: str) -> CollectorRegistry:
    """A registry pre-loaded with `ddiloco_build_info{version, component}` and the standard
    process metrics (CPU, memory, open files, `process_start_time_seconds`; Linux only)."""
    registry = CollectorRegistry()
    prometheus_client.ProcessCollector(registry=registry)
    info = prometheus_client.Info("ddiloco_build", "Build information", registry=registry)
    info.info({"version": __version__, "component": component})
    return registry


def serve(bind: str, registry: CollectorRegistry) -> MetricsServer:
    """Serves `/metrics` on host:port (port 0 picks a free one) in a daemon thread."""
    host, _, port = bind.rpartition(":")
    server, _thread = prometheus_client.start_http_server(int(port), addr=host or "0.0.0.0", registry=registry)
    bound = server.server_port
    return MetricsServer(address=f"{host or '0.0.0.0'}:{bound}", port=bound, _server=server)
