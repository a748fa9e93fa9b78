"""The replicated stores' repair passes as the syncer's metrics (services/syncer/metrics.py over
ddiloco.checkpoint_replicas.RepairTotals, with in-memory stores): absent until repair is watched,
then exported at 0 per store; a pass that rebuilds a store moves blobs, bytes and manifests; a pass
with the store down counts a failure and an incomplete pass; a background pass that raises counts
as failed. Scraped from another thread, as Prometheus does. Every wait has a timeout."""

from __future__ import annotations

import asyncio

import prometheus_client

from ddiloco import checkpoint_replicas as replicas
from services.syncer import __main__ as syncer_main
from services.syncer import config as config_lib
from services.syncer import metrics as syncer_metrics
from tests.fakes import make_core
from tests.unit.test_checkpoint_replicas import FakeStore
from tests.waits import wait_until_async

_PREFIX = "ddiloco_syncer_checkpoint_repair_"
_PER_STORE = ("blobs_copied_total", "bytes_copied_total", "manifests_restored_total", "failures_total",
              "incomplete_total")


async def _scrape(registry) -> dict[str, float | None]:
    def read() -> dict[str, float | None]:
        values = {name: registry.get_sample_value(_PREFIX + name)
                  for name in ("passes_total", "passes_failed_total", "last_pass_timestamp_seconds",
                               "last_pass_duration_seconds")}
        for name in _PER_STORE:
            for store in ("s0", "s1"):
                values[f"{name}{{{store}}}"] = registry.get_sample_value(_PREFIX + name, {"store": store})
        return values
    return await asyncio.to_thread(read)


async def _checkpoint(client, step: int, payload: bytes) -> None:
    digest = await client.put_blob(payload)
    await client.commit_manifest("run", step, {"params": (digest, len(payload))})


def test_the_repair_counters_are_exported_and_move(clock):
    async def run():
        registry = prometheus_client.CollectorRegistry()
        metrics = syncer_metrics.SyncerMetrics(make_core(clock), registry)
        assert set((await _scrape(registry)).values()) == {None}  # no replicated stores: no repair metrics
        stores = {"s0": FakeStore(), "s1": FakeStore()}
        client = replicas.ReplicatedCheckpointClient(stores, write_quorum=1, quorum_wait_s=0.0)
        metrics.watch_repair(client)
        metrics.watch_repair(client)  # a second leader term in the same process: no duplicate collector
        assert set((await _scrape(registry)).values()) == {0.0}  # exported at 0 from the start, per store

        stores["s1"].down = True
        await _checkpoint(client, 1, b"a" * 10)
        await _checkpoint(client, 2, b"b" * 20)  # s1 missed both
        stores["s1"].down = False
        await client.repair(["run"])
        rebuilt = await _scrape(registry)
        assert rebuilt["passes_total"] == 1 and rebuilt["last_pass_timestamp_seconds"] > 0
        assert rebuilt["blobs_copied_total{s1}"] == 2 and rebuilt["bytes_copied_total{s1}"] == 30
        assert rebuilt["manifests_restored_total{s1}"] == 2 and rebuilt["blobs_copied_total{s0}"] == 0
        assert rebuilt["failures_total{s1}"] == 0 and rebuilt["incomplete_total{s1}"] == 0

        stores["s1"].down = True
        await client.repair(["run"])
        down = await _scrape(registry)
        assert down["passes_total"] == 2 and down["failures_total{s1}"] == 1 and down["incomplete_total{s1}"] == 1
        assert down["failures_total{s0}"] == 0 and down["blobs_copied_total{s1}"] == 2
        assert down["last_pass_timestamp_seconds"] >= rebuilt["last_pass_timestamp_seconds"]

        async def broken(_runs, **_kwargs):
            raise RuntimeError("a pass that raises")

        client.repair = broken
        client.start_repair(["run"], interval_s=0.01)
        try:
            await wait_until_async(lambda: client.repair_totals.passes_failed >= 1, timeout_s=10.0,
                                   what="a failed background pass")
        finally:
            await client.close()
        assert (await _scrape(registry))["passes_failed_total"] >= 1

    asyncio.run(run())


def test_the_syncer_repairs_and_exports_only_with_two_or_more_stores(clock):
    """services/syncer/__main__._start_repair, called at start without election and by the elected
    leader with it (before, an elected leader never started background repair)."""
    async def run():
        cfg = config_lib.SyncerConfig(insecure=True, checkpoint_repair_interval_s=0.01)
        for names, repairs in ((("s0",), False), (("s0", "s1"), True)):
            registry = prometheus_client.CollectorRegistry()
            metrics = syncer_metrics.SyncerMetrics(make_core(clock), registry)
            client = replicas.ReplicatedCheckpointClient({n: FakeStore() for n in names}, write_quorum=1)
            syncer_main._start_repair(cfg, client, metrics)
            try:
                if repairs:
                    await wait_until_async(lambda c=client: c.repair_totals.passes >= 1, timeout_s=10.0,
                                           what="a background repair pass")
                    assert (await _scrape(registry))["passes_total"] >= 1
                else:
                    await asyncio.sleep(0.05)
                    assert client.repair_totals.passes == 0
                    assert (await _scrape(registry))["passes_total"] is None
            finally:
                await client.close()

    asyncio.run(run())
