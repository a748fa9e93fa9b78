"""Watch streams refused by a cap (RESOURCE_EXHAUSTED) are counted in
ddiloco_syncer_watch_refusals_total{rpc,limit}, exported at 0 from the start (a real gRPC server,
mutual TLS, the security harness; small caps so the test stays fast)."""

from __future__ import annotations

import grpc
import pytest

from ddiloco import metrics as metrics_lib
from ddiloco.rpc import channel as channel_lib
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc
from services.syncer import metrics as syncer_metrics
from services.syncer import servicer as servicer_lib
from tests.security.conftest import Harness, client_security

pytestmark = pytest.mark.timeout(120)


def _count(registry, rpc: str, limit: str) -> float:
    return registry.get_sample_value("ddiloco_syncer_watch_refusals_total", {"rpc": rpc, "limit": limit})


def test_watch_refusals_are_counted_by_rpc_and_limit(tmp_path, pki):
    caps = {"state_watch_cap": servicer_lib.StreamCap(2, 1, "--max-state-watchers"),
            "fragment_watch_cap": servicer_lib.StreamCap(2, 1, "--max-fragment-watchers")}
    with Harness(tmp_path, mode="mtls", pki=pki, servicer_kwargs=caps) as h:
        registry = metrics_lib.new_registry("syncer")

        async def attach():
            syncer_metrics.SyncerMetrics(h.core, registry)

        h.call(attach)
        for rpc in ("WatchTrainingState", "WatchFragments"):
            for limit in ("total", "per_identity"):
                assert _count(registry, rpc, limit) == 0, (rpc, limit)
        channels = [channel_lib.sync_channel(h.address, client_security(pki, name))
                    for name in ("operator", "evaluator", "learner-0")]
        operator, evaluator, learner = (syncer_pb2_grpc.SyncerStub(c) for c in channels)
        opened = []
        try:
            def watch(stub):
                call = stub.WatchTrainingState(syncer_pb2.WatchTrainingStateRequest(min_interval_s=0.5), timeout=60)
                assert next(call).state.run_id
                opened.append(call)

            watch(operator)
            with pytest.raises(grpc.RpcError) as refused:
                watch(operator)  # a second stream of the same identity
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert _count(registry, "WatchTrainingState", "per_identity") == 1
            watch(evaluator)
            with pytest.raises(grpc.RpcError) as refused:
                watch(learner)  # a learner may not read the state: refused before any cap
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert _count(registry, "WatchTrainingState", "total") == 0
        finally:
            for call in opened:
                call.cancel()
            for c in channels:
                c.close()
