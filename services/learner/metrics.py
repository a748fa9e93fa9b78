"""The learner's Prometheus metrics, read at scrape time from its loop and sync-client counters.

Plain integer and float reads from another thread are safe here (no dict iteration of live data
beyond a copy), so scrapes never touch the training thread.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class LearnerCollector:
    def __init__(self, learner_id: str, region: str, client) -> None:
        self._labels = [learner_id, region]
        self._client = client
        self.loop = None  # set once the training loop exists

    def collect(self):
        labels = ["learner", "region"]

        def family(kind, name, doc, value):
            metric = kind(name, doc, labels=labels)
            metric.add_metric(self._labels, value)
            return metric

        stats = self._client.stats
        loop = self.loop
        if loop is not None:
            yield family(CounterMetricFamily, "ddiloco_learner_inner_steps", "Inner steps taken (this life)",
                         loop.stats.steps)
            yield family(CounterMetricFamily, "ddiloco_learner_tokens", "Tokens processed (this life)",
                         loop.stats.tokens)
            yield family(GaugeMetricFamily, "ddiloco_learner_inner_loss", "Smoothed inner training loss (nats/token)",
                         loop.stats.loss_ema.value or 0.0)
            yield family(GaugeMetricFamily, "ddiloco_learner_step_seconds", "Smoothed wall time of one inner step",
                         loop.stats.step_time_ema.value or 0.0)
            yield family(CounterMetricFamily, "ddiloco_learner_fragments_applied",
                         "Global fragments folded into the local model", loop.stats.fragments_applied)
        uploads = CounterMetricFamily("ddiloco_learner_uploads", "Uploads by result", labels=[*labels, "result"])
        for result in ("accepted", "duplicate", "failed", "refused"):
            uploads.add_metric([*self._labels, result], getattr(stats, f"uploads_{result}"))
        yield uploads
        wire = CounterMetricFamily("ddiloco_wire_bytes", "Serialized gRPC payload bytes at this learner",
                                   labels=[*labels, "direction"])
        wire.add_metric([*self._labels, "out"], stats.bytes_sent)
        wire.add_metric([*self._labels, "in"], stats.bytes_received)
        yield wire
        yield family(CounterMetricFamily, "ddiloco_learner_sessions", "Sessions with the syncer (joins and re-joins)",
                     stats.sessions)
