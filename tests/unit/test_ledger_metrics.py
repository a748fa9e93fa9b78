"""The merge ledger sink's counters as the syncer's metrics (services/syncer/metrics.py over
services/syncer/ledger_sink.StoreLedger, with an in-memory store): absent without a ledger; records
dropped when the queue is full, contributions kept by hash only past its byte bound, failed appends
while the store refuses, then records and their bytes once it takes them. Scraped from another
thread, as Prometheus does. Every wait has a timeout."""

from __future__ import annotations

import asyncio
import hashlib
import json

import prometheus_client

from services.syncer import ledger_sink
from services.syncer import metrics as syncer_metrics
from tests.fakes import make_core
from tests.waits import wait_until_async

GENESIS = "0" * 64


class FlakyStore:
    """The ledger calls of a checkpoint store, in memory; refuses appends while `down`."""

    def __init__(self) -> None:
        self.down = True
        self.lines: list[str] = []
        self.blobs: dict[str, bytes] = {}

    async def put_blob(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        self.blobs[digest] = bytes(data)
        return digest

    async def ledger_head(self, run_id: str) -> tuple[int, str]:
        return len(self.lines), hashlib.sha256(self.lines[-1].encode()).hexdigest() if self.lines else GENESIS

    async def append_ledger(self, run_id: str, lines) -> tuple[int, str]:
        if self.down:
            raise RuntimeError("store refuses appends")  # not transient: no retry inside the attempt
        for line in lines:
            assert json.loads(line)["prev"] == (await self.ledger_head(run_id))[1]
            self.lines.append(line)
        return await self.ledger_head(run_id)


_NAMES = ("records_total", "record_bytes_total", "records_dropped_total", "blobs_dropped_total",
          "blob_bytes_dropped_total", "write_failures_total", "pending_records", "pending_blob_bytes")


async def _scrape(registry) -> dict[str, float | None]:
    return await asyncio.to_thread(lambda: {
        name: registry.get_sample_value(f"ddiloco_syncer_ledger_{name}") for name in _NAMES})


def test_the_ledger_counters_are_exported_and_move(clock):
    async def run():
        registry = prometheus_client.CollectorRegistry()
        metrics = syncer_metrics.SyncerMetrics(make_core(clock), registry)
        assert set((await _scrape(registry)).values()) == {None}  # no ledger configured: no ledger metrics
        store = FlakyStore()
        sink = ledger_sink.StoreLedger(store, "run-1", attempts=1, max_pending=3, max_pending_bytes=100)
        metrics.watch_ledger(sink)
        assert await _scrape(registry) == dict.fromkeys(_NAMES, 0.0)  # exported at 0 from the start

        sink.append({"fragment": 0, "version": 1, "blobs": ["x"]}, {"x": b"a" * 80})
        sink.append({"fragment": 0, "version": 2, "blobs": ["y"]}, {"y": b"b" * 70})  # past 100 bytes: hash only
        sink.append({"fragment": 0, "version": 3})
        sink.append({"fragment": 0, "version": 4})  # the queue holds 3: dropped
        queued = await _scrape(registry)
        assert queued == {**dict.fromkeys(_NAMES, 0.0), "pending_records": 3, "pending_blob_bytes": 80,
                          "records_dropped_total": 1, "blobs_dropped_total": 1, "blob_bytes_dropped_total": 70}

        sink.start()
        try:
            await wait_until_async(lambda: sink.failures >= 1, timeout_s=10.0, what="a failed append")
            failing = await _scrape(registry)
            assert failing["write_failures_total"] >= 1
            assert failing["records_total"] == 0 and failing["pending_records"] == 3
            store.down = False
            assert await sink.drain(30.0)
        finally:
            await sink.close()
        shipped = await _scrape(registry)
        assert len(store.lines) == 3 and list(store.blobs) == [hashlib.sha256(b"a" * 80).hexdigest()]
        assert shipped["records_total"] == 3
        assert shipped["record_bytes_total"] == sum(len(line.encode()) for line in store.lines) > 0
        assert shipped["pending_records"] == 0 and shipped["pending_blob_bytes"] == 0
        assert shipped["write_failures_total"] >= failing["write_failures_total"]
        assert shipped["records_dropped_total"] == 1 and shipped["blob_bytes_dropped_total"] == 70

    asyncio.run(run())
