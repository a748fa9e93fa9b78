"""The checkpoint store's Prometheus metrics, read from disk at scrape time.

RPC counts and latencies (puts, gets, commits, errors by status code) come from the shared
MetricsInterceptor; this collector adds what is stored: blobs and bytes, and per run the number
of retained checkpoints and the latest committed step.
"""

from __future__ import annotations

import os

import prometheus_client
from prometheus_client.core import GaugeMetricFamily

from ddiloco.rpc import security as security_lib
from ddiloco.v1 import checkpoint_pb2


def auth_failure_counter(registry: prometheus_client.CollectorRegistry):
    """`on_reject` for the store's AuthInterceptor: counts refused calls by reason and method.

    Calls that never complete a TLS handshake are not seen by the process (docs/security.md)."""
    counter = prometheus_client.Counter(
        "ddiloco_checkpoint_auth_failures",
        "Calls refused as UNAUTHENTICATED or PERMISSION_DENIED after a completed TLS handshake, by reason and method",
        ["reason", "method"], registry=registry)
    # Every reason and method at 0 before the first refusal, so rate() and dashboards see the series.
    for method in checkpoint_pb2.DESCRIPTOR.services_by_name["CheckpointStore"].methods_by_name:
        for reason in security_lib.AUTH_FAILURE_REASONS:
            counter.labels(reason=reason, method=method)
    return lambda method, reason: counter.labels(reason=reason or "unknown", method=method.rsplit("/", 1)[-1]).inc()


class StoreCollector:
    def __init__(self, store) -> None:
        self._store = store

    def collect(self):
        blobs, size = 0, 0
        for dirpath, _dirs, files in os.walk(self._store.root / "blobs"):
            for name in files:
                if ".tmp-" in name:
                    continue
                blobs += 1
                size += os.stat(os.path.join(dirpath, name)).st_size
        yield GaugeMetricFamily("ddiloco_checkpoint_blobs", "Blobs stored", value=blobs)
        yield GaugeMetricFamily("ddiloco_checkpoint_blob_bytes", "Bytes of stored blobs", value=size)
        retained = GaugeMetricFamily("ddiloco_checkpoint_manifests", "Committed checkpoints retained, by run",
                                     labels=["run"])
        latest = GaugeMetricFamily("ddiloco_checkpoint_latest_step", "Latest committed step, by run", labels=["run"])
        manifests_root = self._store.root / "manifests"
        for run in sorted(p.name for p in manifests_root.iterdir()) if manifests_root.exists() else []:
            steps = sorted(int(p.stem) for p in (manifests_root / run).glob("*.json") if p.stem.isdigit())
            retained.add_metric([run], len(steps))
            if steps:
                latest.add_metric([run], steps[-1])
        yield retained
        yield latest


