"""The syncer's Prometheus metrics.

Two sources: collectors that read SyncerCore's state at scrape time (versions, members,
counters; nothing to keep in sync) and, when one is configured, the checkpoint store's merge
ledger sink (services/syncer/ledger_sink.py) and the replicated stores' repair passes
(ddiloco.checkpoint_replicas.RepairTotals), and an observer that records per-event distributions
(quorum size, grace used vs window, staleness, compression ratio, rejoin times) and the bytes of
each fragment transfer by the codec it used, as they happen.

Work merged (ddiloco_work_merged_ratio) is tokens merged / (P x tokens processed), the share of the
learners' work that reached the global model (ddiloco.training_state); ddiloco_goodput_ratio is
its former, deprecated name (the paper's goodput is a share of wall time, not of tokens).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ddiloco import metrics as metrics_lib
from ddiloco import training_state as status_derived
from ddiloco.rpc import security as security_lib
from . import membership as membership_lib

# Upload results exported at 0 before their first occurrence (a series that appears only with its
# first increment is invisible to rate() until then): the common outcomes and every refusal that
# counts towards quarantine, which the dashboard's security panel and the alerts watch.
KNOWN_UPLOAD_RESULTS = frozenset({"accepted", "duplicate", "rejected_quarantined"}
                                 | {f"rejected_{reason}" for reason in membership_lib.STRIKE_REASONS})

_STATUSES = ("active", "silent", "left")  # membership.member_status


@dataclasses.dataclass(frozen=True)
class LearnerRow:
    """One learner as a scrape reads it (the TrainingState's MemberState, in plain values)."""

    learner_id: str
    region: str
    status: str  # membership.member_status
    quarantined: bool
    local_step: int
    tokens_total: int
    inner_loss: float
    last_seen_unix_s: float


@dataclasses.dataclass(frozen=True)
class ScrapeState:
    """What a scrape reads of the core, copied on its loop (`scrape_state`); the same values as
    the TrainingState's fields of these names (services/syncer/wire_views.training_state)."""

    outer_steps: int
    min_quorum: int
    num_fragments: int
    fragments: tuple[tuple[int, int, int], ...]  # (fragment id, version, pending contributions)
    tokens_merged: int
    tokens_processed: int
    bytes_in: int
    bytes_out: int
    uploads: dict
    auth_failures: dict
    quarantines: int
    direction_judgments: dict
    members: tuple[LearnerRow, ...]  # by learner id
    grace_window_s: float
    step_time_s: float
    quorum_time_s: float
    sync_time_s: float
    heldout_loss: float | None  # the last evaluation's (None: none yet)
    last_checkpoint_outer_step: int


def scrape_state(core) -> ScrapeState:
    """The core's state for a scrape (from SyncerCore.status, as the TrainingState); call on the core's loop."""
    status = core.status(0)
    members = tuple(
        LearnerRow(learner_id=m.learner_id, region=m.region, quarantined=status.now_s < m.quarantined_until_s,
                   status=membership_lib.member_status(m, now_s=status.now_s,
                                                       liveness_timeout_s=status.liveness_timeout_s),
                   local_step=m.local_step, tokens_total=m.tokens_total, inner_loss=m.inner_loss,
                   last_seen_unix_s=m.last_seen_unix_s)
        for m in status.members)
    return ScrapeState(
        outer_steps=status.outer_steps, min_quorum=status.run.min_quorum,
        num_fragments=status.plan.num_fragments or len(status.fragments) or 1,
        fragments=tuple((f.fragment_id, f.version, f.pending_contributions) for f in status.fragments),
        tokens_merged=status.tokens_merged, tokens_processed=status.tokens_processed,
        bytes_in=status.bytes_in, bytes_out=status.bytes_out, uploads=status.uploads,
        auth_failures=status.auth_failures, quarantines=status.quarantines,
        direction_judgments=status.direction_judgments, members=members,
        grace_window_s=status.grace_window_s, step_time_s=status.step_time_s,
        quorum_time_s=status.quorum_time_s, sync_time_s=status.sync_time_s,
        heldout_loss=status.evals[-1].heldout_loss if status.evals else None,
        last_checkpoint_outer_step=status.last_checkpoint_outer_step)


class SyncerMetrics:
    """Registers the syncer's metrics on `registry` and observes `core` (core.observers)."""

    def __init__(self, core, registry: prometheus_client.CollectorRegistry) -> None:
        self._core = core
        self._registry = registry
        buckets = metrics_lib.SECONDS_BUCKETS
        self.merges = prometheus_client.Counter(
            "ddiloco_syncer_merges", "Merges (outer steps) by fragment", ["fragment"], registry=registry)
        self.quorum_size = prometheus_client.Histogram(
            "ddiloco_syncer_merge_contributors", "Contributions per merge", registry=registry,
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64))
        self.quorum_wait = prometheus_client.Histogram(
            "ddiloco_syncer_quorum_wait_seconds", "From a round's opening (the syncer's call) to quorum", registry=registry,
            buckets=buckets)
        self.contributors_ratio = prometheus_client.Histogram(
            "ddiloco_syncer_merge_contributors_expected_ratio",
            "Contributors / live learners the round waited for (expected_contributors), per merge", registry=registry,
            buckets=(0.25, 0.5, 0.75, 0.9, 1.0, 1.25, 1.5, 2.0))
        self.last_contributors = prometheus_client.Gauge(
            "ddiloco_syncer_last_merge_contributors", "Contributors of each fragment's last merge", ["fragment"],
            registry=registry)
        self.last_expected = prometheus_client.Gauge(
            "ddiloco_syncer_last_merge_expected_contributors",
            "Live learners the round of each fragment's last merge waited for", ["fragment"], registry=registry)
        self.grace_used = prometheus_client.Histogram(
            "ddiloco_syncer_grace_used_seconds", "Time waited after quorum before merging", registry=registry,
            buckets=buckets)
        self.grace_window = prometheus_client.Histogram(
            "ddiloco_syncer_grace_window_seconds", "Adaptive grace window granted (gamma x slack)", registry=registry,
            buckets=buckets)
        self.staleness = prometheus_client.Histogram(
            "ddiloco_syncer_contribution_staleness_versions",
            "Versions between a contribution's base and the version it was merged into, minus one",
            registry=registry, buckets=(0, 1, 2, 3, 4, 8, 16))
        self.compression = prometheus_client.Histogram(
            "ddiloco_syncer_upload_compression_ratio", "fp32 bytes / payload bytes of accepted uploads",
            ["codec"], registry=registry, buckets=(1, 2, 4, 6, 7, 8, 10, 16, 32))
        self.rejoin = prometheus_client.Histogram(
            "ddiloco_syncer_rejoin_seconds", "From a learner's last sign of life to its next incarnation joining",
            registry=registry, buckets=buckets)
        self.checkpoint_write = prometheus_client.Histogram(
            "ddiloco_syncer_checkpoint_write_seconds", "Checkpoint snapshot + upload + commit", registry=registry,
            buckets=buckets)
        self.checkpoint_failures = prometheus_client.Counter(
            "ddiloco_syncer_checkpoint_failures", "Checkpoint attempts that failed", registry=registry)
        self.fragment_wire_bytes = prometheus_client.Counter(
            "ddiloco_syncer_fragment_wire_bytes",
            "Serialized gRPC bytes of fragment transfers (checked uploads in, versions sent out), by the codec each "
            "transfer used", ["direction", "codec"], registry=registry)
        self.restore_seconds = prometheus_client.Gauge(
            "ddiloco_syncer_restore_seconds", "Time the last restore from the checkpoint store took",
            registry=registry)
        self.watch_refusals = prometheus_client.Counter(
            "ddiloco_syncer_watch_refusals",
            "Watch streams refused with RESOURCE_EXHAUSTED by a stream cap (limit: total or per_identity)",
            ["rpc", "limit"], registry=registry)
        for rpc in ("WatchTrainingState", "WatchFragments"):
            for limit in ("total", "per_identity"):
                self.watch_refusals.labels(rpc=rpc, limit=limit)  # exported at 0 from the start
        registry.register(_StateCollector(core, asyncio.get_running_loop()))
        self._repair_watched = False
        core.observe(self)

    def watch_ledger(self, ledger) -> None:
        """Exports the counters of `ledger` (a ledger_sink.StoreLedger); called once it is configured."""
        self._registry.register(_LedgerCollector(ledger, asyncio.get_running_loop()))

    def watch_repair(self, client) -> None:
        """Exports the repair passes of `client` (a ReplicatedCheckpointClient); called once, when
        it starts repairing (again: ignored)."""
        if self._repair_watched:
            return
        self._repair_watched = True
        self._registry.register(_RepairCollector(client, asyncio.get_running_loop()))

    # Observer interface (called by SyncerCore on its event loop).
    def merged(self, record) -> None:
        """`record`: merging.MergeRecord."""
        self.merges.labels(fragment=str(record.fragment_id)).inc()
        self.quorum_size.observe(len(record.contributors))
        fragment = str(record.fragment_id)
        self.last_contributors.labels(fragment=fragment).set(len(record.contributors))
        self.last_expected.labels(fragment=fragment).set(record.expected_contributors)
        if record.expected_contributors:
            self.contributors_ratio.observe(len(record.contributors) / record.expected_contributors)
        self.quorum_wait.observe(record.quorum_wait_s)
        self.grace_used.observe(record.grace_used_s)
        self.grace_window.observe(record.grace_window_s)
        for c in record.contributors:
            self.staleness.observe(max(0, record.version - c.base_version - 1))

    def upload_accepted(self, header) -> None:
        """An accepted upload's compression ratio; `header` is admission.UploadHeader (plain values)."""
        info = header.payload
        if info.payload_size_bytes:
            self.compression.labels(codec=info.codec).observe(
                info.numel * 4 / info.payload_size_bytes)

    def rejoined(self, learner_id: str, gap_s: float) -> None:
        self.rejoin.observe(gap_s)

    def watch_refused(self, rpc: str, limit: str) -> None:
        self.watch_refusals.labels(rpc=rpc, limit=limit).inc()

    def fragment_bytes(self, direction: str, codec: str, wire_bytes: int) -> None:
        # The codec of this transfer: an upload's own (a learner may send another than the run's
        # upload codec), and for downloads fp32 for whole versions, the download codec for deltas.
        self.fragment_wire_bytes.labels(direction=direction, codec=codec).inc(wire_bytes)


# Scrapes arrive on the HTTP server's thread; what they read is read on the event loop that
# mutates it (the only thread that does), bounded: a stalled loop fails the scrape, never hangs it.
_SCRAPE_TIMEOUT_S = 5.0


def _read_on_loop(loop: asyncio.AbstractEventLoop, read):
    """``read()`` run on ``loop``, from the scraping thread."""
    async def run():
        return read()

    return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout=_SCRAPE_TIMEOUT_S)


def _scalar_families(values: dict, table) -> list:
    """One family per (attribute, metric name, help, family class) row of ``table``."""
    return [family(name, doc, value=values[attr]) for attr, name, doc, family in table]


def _labeled_family(family, name: str, doc: str, label: str, samples):
    """A ``family`` (Counter/GaugeMetricFamily) with one sample per (label value, value) pair of
    ``samples``, in their order."""
    result = family(name, doc, labels=[label])
    for key, value in samples:
        result.add_metric([key], value)
    return result


class _StateCollector:
    """Reads gauges and monotonic counters from the core at scrape time, on the core's loop."""

    def __init__(self, core, loop: asyncio.AbstractEventLoop) -> None:
        self._core = core
        self._loop = loop

    def collect(self):
        state, influence = _read_on_loop(self._loop, lambda: (scrape_state(self._core),
                                                              self._core.influence_counts()))
        yield from _influence_families(influence)
        yield from _progress_families(state)
        yield from _traffic_families(state)
        yield from _security_families(state)
        yield from _timing_families(state)
        yield from _learner_families(state)
        yield from _outcome_families(state)


class _LedgerCollector:
    """Reads the merge ledger sink's counters at scrape time, on the event loop that ships the
    records (as _StateCollector reads the core)."""

    _FAMILIES = (
        ("acknowledged", "ddiloco_syncer_ledger_records",
         "Merge records the checkpoint store's ledger acknowledged", CounterMetricFamily),
        ("record_bytes", "ddiloco_syncer_ledger_record_bytes",
         "Bytes of the merge records appended to the checkpoint store's ledger", CounterMetricFamily),
        ("dropped", "ddiloco_syncer_ledger_records_dropped",
         "Merge records dropped unsent: the ledger queue was full", CounterMetricFamily),
        ("blobs_dropped", "ddiloco_syncer_ledger_blobs_dropped",
         "Retained contributions not kept for replay (only their hashes recorded): past the queue's byte bound",
         CounterMetricFamily),
        ("blob_bytes_dropped", "ddiloco_syncer_ledger_blob_bytes_dropped",
         "Bytes of the retained contributions not kept for replay", CounterMetricFamily),
        ("failures", "ddiloco_syncer_ledger_write_failures",
         "Ledger shipping attempts that failed after their retries (the records stay queued)", CounterMetricFamily),
        ("pending", "ddiloco_syncer_ledger_pending_records",
         "Merge records queued for the checkpoint store's ledger", GaugeMetricFamily),
        ("pending_bytes", "ddiloco_syncer_ledger_pending_blob_bytes",
         "Bytes of the retained contributions queued with them", GaugeMetricFamily),
    )

    def __init__(self, ledger, loop: asyncio.AbstractEventLoop) -> None:
        self._ledger = ledger
        self._loop = loop

    def collect(self):
        values = _read_on_loop(self._loop, lambda: {attr: getattr(self._ledger, attr)
                                                    for attr, *_ in self._FAMILIES})
        yield from _scalar_families(values, self._FAMILIES)


class _RepairCollector:
    """Reads the replicated stores' repair totals at scrape time, on the event loop that repairs."""

    _FAMILIES = (
        ("passes", "ddiloco_syncer_checkpoint_repair_passes",
         "Repair passes over the replicated checkpoint stores that reported", CounterMetricFamily),
        ("passes_failed", "ddiloco_syncer_checkpoint_repair_passes_failed",
         "Repair passes that raised before reporting (retried at the next interval)", CounterMetricFamily),
        ("last_pass_unix_s", "ddiloco_syncer_checkpoint_repair_last_pass_timestamp_seconds",
         "Unix time the last repair pass ended (0: none yet)", GaugeMetricFamily),
        ("last_pass_duration_s", "ddiloco_syncer_checkpoint_repair_last_pass_duration_seconds",
         "Seconds the last repair pass took", GaugeMetricFamily),
    )
    _PER_STORE = (
        ("blobs_copied", "Blobs a repair pass copied to this store from its peers"),
        ("bytes_copied", "Bytes of the blobs a repair pass copied to this store"),
        ("manifests_restored", "Checkpoint manifests a repair pass restored on this store"),
        ("failures", "Repair passes that left this store with an error (unreachable, a failed copy)"),
        ("incomplete", "Repair passes that left this store behind (an error, or the pass's byte bound)"),
    )

    def __init__(self, client, loop: asyncio.AbstractEventLoop) -> None:
        self._client = client
        self._loop = loop

    def collect(self):
        def snapshot():
            t = self._client.repair_totals
            per_store = {name: {store: getattr(t, name).get(store, 0) for store in self._client.store_names}
                         for name, _ in self._PER_STORE}
            return {attr: getattr(t, attr) for attr, *_ in self._FAMILIES}, per_store

        values, per_store = _read_on_loop(self._loop, snapshot)
        yield from _scalar_families(values, self._FAMILIES)
        for name, doc in self._PER_STORE:
            yield _labeled_family(CounterMetricFamily, f"ddiloco_syncer_checkpoint_repair_{name}", doc, "store",
                                  per_store[name].items())


def _progress_families(state: ScrapeState):
    """Outer steps, the quorum, fragment versions and open rounds, tokens merged and processed."""
    # Counters read from the core's state include what was restored from the checkpoint (outer
    # steps, tokens, bytes, quarantines): a restarted syncer starts them at the restored amount,
    # as a prometheus_client Counter inc'd by it at start would. rate() stays right across a
    # restart, except one that lost merges made since the last checkpoint: the counter then goes
    # down, Prometheus takes that for a reset, and rate() sees one spike of the restored amount.
    yield CounterMetricFamily("ddiloco_syncer_outer_steps", "Merges since the run began (restored included)",
                              value=state.outer_steps)
    yield GaugeMetricFamily("ddiloco_syncer_min_quorum", "Contributions a merge needs (K, --min-quorum)",
                            value=state.min_quorum)
    versions = GaugeMetricFamily("ddiloco_syncer_fragment_version", "Global version of each fragment",
                                 labels=["fragment"])
    pending = GaugeMetricFamily("ddiloco_syncer_fragment_pending_contributions",
                                "Contributions in each fragment's open round", labels=["fragment"])
    for fragment_id, version, pending_contributions in state.fragments:
        versions.add_metric([str(fragment_id)], version)
        pending.add_metric([str(fragment_id)], pending_contributions)
    yield versions
    yield pending
    yield CounterMetricFamily("ddiloco_syncer_tokens_merged", "Tokens of all merged contributions",
                              value=state.tokens_merged)
    yield CounterMetricFamily(
        "ddiloco_syncer_tokens_processed",
        "Tokens processed by every life of every learner of the run (restored across syncer restarts)",
        value=state.tokens_processed)


def _traffic_families(state: ScrapeState):
    """Bytes in and out and uploads by result."""
    # Every RPC's bytes; fragment transfers by the codec each used: ddiloco_syncer_fragment_wire_bytes.
    wire = CounterMetricFamily("ddiloco_wire_bytes", "Serialized gRPC payload bytes at the syncer (restored included)",
                               labels=["direction"])
    wire.add_metric(["in"], state.bytes_in)
    wire.add_metric(["out"], state.bytes_out)
    yield wire
    yield _labeled_family(CounterMetricFamily, "ddiloco_syncer_uploads",
                          "Uploads by result (accepted, duplicate, rejected_<reason>)", "result",
                          ((r, state.uploads.get(r, 0)) for r in sorted(KNOWN_UPLOAD_RESULTS | set(state.uploads))))


def _security_families(state: ScrapeState):
    """Refused callers, quarantines and the direction check's judgments."""
    # Security, kept apart from the upload results above: refused callers and quarantines.
    # TLS handshake failures never reach the process (grpc-core drops the connection before
    # any call exists) and so are not counted here; see docs/security.md.
    reasons = sorted(set(security_lib.AUTH_FAILURE_REASONS) | set(state.auth_failures))
    yield _labeled_family(
        CounterMetricFamily, "ddiloco_syncer_auth_failures",
        "Calls refused as UNAUTHENTICATED or PERMISSION_DENIED after a completed TLS handshake, by reason "
        f"({', '.join(security_lib.AUTH_FAILURE_REASONS)})",
        "reason", ((reason, state.auth_failures.get(reason, 0)) for reason in reasons))
    yield CounterMetricFamily("ddiloco_syncer_quarantines",
                              "Learners quarantined since this syncer started (restored quarantines included)",
                              value=state.quarantines)
    yield _labeled_family(
        CounterMetricFamily, "ddiloco_syncer_direction_judgments",
        "Contributions that had fewer than two others to compare with at the direction check: waited "
        "(others arrived within --direction-judge-wait-s) or unjudged (went on without a comparison)",
        "how", sorted(state.direction_judgments.items()))
    yield GaugeMetricFamily("ddiloco_syncer_learners_quarantined", "Learners whose uploads are refused right now",
                            value=sum(1 for m in state.members if m.quarantined))


def _timing_families(state: ScrapeState):
    """The adaptive grace window and the smoothed times it is derived from."""
    for name, doc, value in (
            ("ddiloco_syncer_current_grace_window_seconds", "Current adaptive grace window (gamma x slack)",
             state.grace_window_s),
            ("ddiloco_syncer_smoothed_step_time_seconds",
             "Mean of the live learners' smoothed inner step times", state.step_time_s),
            ("ddiloco_syncer_smoothed_quorum_time_seconds", "Smoothed time from a round's opening to quorum",
             state.quorum_time_s),
            ("ddiloco_syncer_smoothed_sync_time_seconds",
             "Smoothed time from a merge's start until every learner has the new version",
             state.sync_time_s)):
        yield GaugeMetricFamily(name, doc, value=value)


def _learner_families(state: ScrapeState):
    """Learners by status and each learner's last reported steps, tokens, loss and age."""
    members = GaugeMetricFamily("ddiloco_learners", "Learners by status", labels=["status"])
    counts = {name: 0 for name in _STATUSES}
    # The same names as the learners' own metrics (services/learner/metrics.py), as last reported
    # to the syncer: counters of the learner's current life (a new life starts from 0, a reset).
    steps = CounterMetricFamily("ddiloco_learner_inner_steps", "Inner steps reported by each learner (this life)",
                                labels=["learner", "region"])
    tokens = CounterMetricFamily("ddiloco_learner_tokens", "Tokens processed by each learner (this life)",
                                 labels=["learner", "region"])
    loss = GaugeMetricFamily("ddiloco_learner_inner_loss", "Smoothed inner training loss (nats/token)",
                             labels=["learner", "region"])
    last_seen = GaugeMetricFamily("ddiloco_learner_last_seen_age_seconds", "Seconds since a learner was heard from",
                                  labels=["learner", "region"])
    for m in state.members:
        counts[m.status] += 1
        labels = [m.learner_id, m.region]
        steps.add_metric(labels, m.local_step)
        tokens.add_metric(labels, m.tokens_total)
        loss.add_metric(labels, m.inner_loss)
        last_seen.add_metric(labels, max(0.0, time.time() - m.last_seen_unix_s) if m.last_seen_unix_s else 0.0)
    for status, count in counts.items():
        members.add_metric([status], count)
    yield from (members, steps, tokens, loss, last_seen)


def _outcome_families(state: ScrapeState):
    """Held-out loss, the share of work merged and the last checkpoint's outer step."""
    if state.heldout_loss is not None:
        yield GaugeMetricFamily("ddiloco_heldout_loss", "Held-out loss of the global parameters (nats/token)",
                                value=state.heldout_loss)
    # Work merged: the share of the learners' work that made it into a merge. Each of the P
    # fragments' contributions carries that fragment's tokens, so fully merged work sums to
    # P x tokens processed. Absent until a token is processed.
    processed, _ = status_derived.tokens_processed(state)
    share = status_derived.work_merged(state.tokens_merged, state.num_fragments, processed)
    if share is not None:
        yield GaugeMetricFamily("ddiloco_work_merged_ratio",
                                "Tokens merged / (fragments x tokens processed): share of the learners' work merged",
                                value=share)
        yield GaugeMetricFamily("ddiloco_goodput_ratio",
                                "Deprecated name of ddiloco_work_merged_ratio (same value)", value=share)
    yield GaugeMetricFamily("ddiloco_syncer_last_checkpoint_outer_step", "Outer step of the last committed checkpoint",
                            value=state.last_checkpoint_outer_step)


def _influence_families(snap: dict):
    """Bounded influence, per identity: weight shares, capped shares, clipped claims, refusals."""
    share = GaugeMetricFamily("ddiloco_syncer_merge_weight_share",
                              "Each learner's share of the total weight of the last merge it contributed to",
                              labels=["learner"])
    top = GaugeMetricFamily("ddiloco_syncer_merge_weight_share_max",
                            "Each learner's largest share of a merge's weight since this syncer started",
                            labels=["learner"])
    for learner in sorted(snap["share"]):
        share.add_metric([learner], snap["share"][learner])
        top.add_metric([learner], snap["max_share"].get(learner, 0.0))
    yield from (share, top)
    yield _labeled_family(CounterMetricFamily, "ddiloco_syncer_merge_share_capped",
                          "Merges in which a learner's weight was lowered to --max-merge-share", "learner",
                          sorted(snap["capped"].items()))
    clipped = sorted({"steps", "step_rate", "batch", "norm"} | set(snap["clipped"]))
    yield _labeled_family(
        CounterMetricFamily, "ddiloco_syncer_clipped_claims",
        "Contributions accepted with a claim or norm clipped: steps (beyond the last merged mark), step_rate "
        "(beyond the measured step rate), batch (--max-batch-ratio), norm (--norm-clip-factor)", "what",
        ((what, snap["clipped"].get(what, 0)) for what in clipped))
    yield _labeled_family(CounterMetricFamily, "ddiloco_syncer_refused_contributions",
                          "Contributions refused, per learner (any reason but load)", "learner",
                          sorted(snap["refused"].items()))
    yield _labeled_family(
        GaugeMetricFamily, "ddiloco_syncer_residual_persistent_share",
        "Each learner's share of its residual against the other learners that keeps its direction across "
        "rounds (median over fragments; ddiloco.algo.coherence): a bias added every round raises it", "learner",
        sorted(snap.get("persistent", {}).items()))
