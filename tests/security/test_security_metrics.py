"""Security events as Prometheus metrics, apart from the upload results: refused callers by reason
(syncer and store) and quarantines. TLS handshake failures are not among them: grpc-core drops
those connections before any call exists, so the process never sees them (README, security model)."""

from __future__ import annotations

import grpc
import prometheus_client
import pytest

from ddiloco import metrics as metrics_lib
from ddiloco.rpc import channel as channel_lib
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc
from services.checkpoint import metrics as store_metrics
from services.syncer import metrics as syncer_metrics
from tests.security.conftest import Harness, Learner, client_security, code_of

pytestmark = pytest.mark.timeout(120)


def _sample(registry, name: str, **labels) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_auth_failures_and_quarantines_are_separate_metrics(tmp_path, pki):
    with Harness(tmp_path, mode="mtls", pki=pki) as harness:
        registry = metrics_lib.new_registry("syncer")

        async def attach():
            syncer_metrics.SyncerMetrics(harness.core, registry)

        harness.call(attach)

        def read(stub):
            return stub.GetTrainingState(syncer_pb2.GetTrainingStateRequest(), timeout=5)

        learner = syncer_pb2_grpc.SyncerStub(channel_lib.sync_channel(harness.address, client_security(pki, "learner-0")))
        assert code_of(lambda: read(learner)) == grpc.StatusCode.PERMISSION_DENIED  # a learner may not read
        # No client certificate: the handshake fails, no call exists, nothing is counted.
        anonymous = syncer_pb2_grpc.SyncerStub(channel_lib.sync_channel(harness.address, client_security(pki, None)))
        assert code_of(lambda: read(anonymous)) == grpc.StatusCode.UNAVAILABLE
        assert _sample(registry, "ddiloco_syncer_auth_failures_total", reason="wrong_role") == 1
        assert sum(s.value for m in registry.collect() if m.name == "ddiloco_syncer_auth_failures"
                   for s in m.samples) == 1
        assert _sample(registry, "ddiloco_syncer_quarantines_total") == 0
        # A quarantine (here directly; the hostile tests reach it through strikes).
        operator = syncer_pb2_grpc.SyncerStub(channel_lib.sync_channel(harness.address, client_security(pki, "operator")))
        Learner(harness.address, "learner-1", sec=client_security(pki, "learner-1")).close()
        harness.call(lambda: harness.core.membership.quarantine(harness.core.membership.members["learner-1"], reason="test"))
        assert read(operator).state.quarantines == 1
        assert _sample(registry, "ddiloco_syncer_quarantines_total") == 1
        assert _sample(registry, "ddiloco_syncer_learners_quarantined") == 1
        # Upload results stay where they were: no auth reason leaks into them for a read call.
        assert not [s for m in registry.collect() if m.name == "ddiloco_syncer_uploads" for s in m.samples
                    if "wrong_role" in s.labels.get("result", "")]


def test_store_counts_refused_calls_by_reason_and_method():
    registry = prometheus_client.CollectorRegistry()
    on_reject = store_metrics.auth_failure_counter(registry)
    on_reject("/ddiloco.v1.CheckpointStore/PutBlob", "wrong_role")
    on_reject("/ddiloco.v1.CheckpointStore/PutBlob", "wrong_role")
    on_reject("/ddiloco.v1.CheckpointStore/ListManifests", "no_credentials")
    assert _sample(registry, "ddiloco_checkpoint_auth_failures_total", reason="wrong_role", method="PutBlob") == 2
    assert _sample(registry, "ddiloco_checkpoint_auth_failures_total", reason="no_credentials",
                   method="ListManifests") == 1
