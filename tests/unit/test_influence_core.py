"""Bounded influence through SyncerCore (no gRPC): a learner claiming a 20x batch in a merge with
three honest ones gets the batch clipped, at most half the merge's weight, a ledger record naming
it, and the influence metrics show it."""

from __future__ import annotations

import asyncio

import numpy as np
import prometheus_client
import pytest

from ddiloco.cli import audit as audit_lib
from ddiloco.v1 import syncer_pb2
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde
from services.syncer import influence as influence_lib
from services.syncer import metrics as syncer_metrics
from tests.fakes import accept, join, make_core, settle_until


async def _upload(core, learner_id: str, fid: int, base: int, delta: np.ndarray, *, tokens_per_step: int = 100,
                  steps: int = 2) -> None:
    enc = codec_lib.encode(delta.astype(np.float32), "fp32")
    header = syncer_pb2.UploadHeader(
        protocol_version=serde.PROTOCOL_VERSION, learner_id=learner_id, incarnation=1, fragment_id=fid,
        base_version=base, syncer_instance=core.instance, steps=steps, tokens=steps * tokens_per_step,
        payload=serde.payload_info_to_proto(enc))
    await accept(core, header, enc.payload, wire_bytes=len(enc.payload))


def _sample(registry, name: str, **labels) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_an_inflated_batch_is_clipped_capped_at_half_recorded_and_exported(clock, tmp_path):
    learners = ("a", "b", "c", "x")

    async def run():
        core = make_core(clock, min_quorum=4)
        ledger_path = tmp_path / "merges.jsonl"
        core.influence.ledger = influence_lib.MergeLedger(str(ledger_path))
        registry = prometheus_client.CollectorRegistry()
        syncer_metrics.SyncerMetrics(core, registry)
        for lid in learners:
            join(core, lid)
        n = core.plan.fragments[0].numel
        rng = np.random.default_rng(1)
        common = rng.normal(size=n)
        for version in (0, 1):  # the first round builds the other learners' history; the second is judged by it
            for lid in learners:
                delta = 0.01 * (common + 0.3 * rng.normal(size=n))
                await _upload(core, lid, 0, version, delta, tokens_per_step=2000 if lid == "x" else 100)
            await settle_until(lambda want=version + 1: core.slots[0].version == want)  # a merge hops to a worker thread
            assert core.slots[0].version == version + 1
        records = audit_lib.read_ledger(str(ledger_path))
        assert [r["version"] for r in records] == [1, 2]
        second = {c["learner"]: c for c in records[1]["contributors"]}
        x = second["x"]
        assert "batch" in x["clipped"] and x["claimed_weight"] / x["weight"] > 1
        # The norm clip's reference is recorded: the others' median norm per step and their steps.
        per_step, ref_steps = x["norm_reference"]
        assert ref_steps == 2 and x["norm_ratio"] == pytest.approx(x["norm"] / (per_step * 2), rel=1e-4)
        assert {c["learner"]: c for c in records[0]["contributors"]}["a"]["norm_reference"] is None  # the first: no history
        assert x["share"] == pytest.approx(0.5) and x["share_uncapped"] > 0.5 and "share" in x["clipped"]
        assert all(second[lid]["share"] == pytest.approx(1 / 6, abs=1e-5) for lid in "abc"), {k: (v["share"], v["weight"], v["clipped"]) for k, v in second.items()}
        # The first round: the share cap holds as well.
        assert {c["learner"]: c for c in records[0]["contributors"]}["x"]["share"] == pytest.approx(0.5)
        assert all(c["cosine"] is None for c in records[1]["contributors"])  # direction check off here
        flagged = {lid for lid, e in audit_lib.influence(records).items() if e["flags"]}
        assert flagged == {"x"}
        # Scraped from another thread, as Prometheus does (the collector reads the core on its loop).
        samples = await asyncio.to_thread(lambda: {
            "x": _sample(registry, "ddiloco_syncer_merge_weight_share", learner="x"),
            "a": _sample(registry, "ddiloco_syncer_merge_weight_share", learner="a"),
            "capped": _sample(registry, "ddiloco_syncer_merge_share_capped_total", learner="x"),
            "batch": _sample(registry, "ddiloco_syncer_clipped_claims_total", what="batch")})
        assert samples["x"] == pytest.approx(0.5) and samples["a"] == pytest.approx(1 / 6, abs=1e-5)
        assert samples["capped"] == 2 and samples["batch"] == 2  # x uploads last: a, b and c are its history
        # The merge record the training state shows carries the capped weight too.
        record = core.rounds.merges[-1]
        weights = {c.learner_id: c.weight for c in record.contributors}
        assert weights["x"] == pytest.approx(sum(w for lid, w in weights.items() if lid != "x"))

    asyncio.run(run())
