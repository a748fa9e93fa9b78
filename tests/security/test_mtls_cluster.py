"""Mutual TLS across real processes: store, syncer, evaluator and learners each with their own
certificate (LocalCluster(tls=True), the same code path as `ddiloco up --tls`). Training merges,
checkpoints commit and the evaluator reports; `ddiloco status` reads with the read-only
credential; plaintext clients and a learner using another learner's certificate are refused; the
health ports answer probes without certificates."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddiloco.cli import cluster as cluster_lib
from ddiloco.rpc import channel as channel_lib
from ddiloco.v1 import checkpoint_pb2, checkpoint_pb2_grpc, syncer_pb2, syncer_pb2_grpc
from tests.integration.conftest import LEARNER_PACE, TINY, wait_until
from tests.waits import TEARDOWN_CLIENTS_S

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_a_run_under_mutual_tls(tmp_path):
    cluster = cluster_lib.LocalCluster(tmp_path / "cluster", tls=True)
    try:
        store = cluster.start_store(extra=["--health-bind", "127.0.0.1:0"])
        syncer = cluster.start_syncer(run_id="mtls", extra=[*TINY, "--health-bind", "127.0.0.1:0",
                                                             "--checkpoint-every-merges", "8"])
        cluster.start_evaluator(extra=["--interval-s", "2", "--num-shards", "2"])
        for i in range(2):
            cluster.start_learner(i, region="r", extra=["--steps", "40", "--num-shards", "2", *LEARNER_PACE])
        operator = cluster.client_security("operator")
        stub = syncer_pb2_grpc.SyncerStub(channel_lib.sync_channel(syncer.address, operator))
        for svc in cluster.learners():
            assert svc.wait(300) == 0, svc.log_tail()
        wait_until(lambda: stub.GetTrainingState(syncer_pb2.GetTrainingStateRequest(), timeout=5).state.evals,
                   timeout_s=120, what="an evaluation under mTLS")
        state = stub.GetTrainingState(syncer_pb2.GetTrainingStateRequest(), timeout=5).state
        assert state.outer_steps > 0 and all(m.uploads_accepted > 0 for m in state.members)
        assert not state.auth_failures and "rejected_wrong_learner" not in state.uploads
        # The syncer's certificate wrote checkpoints; the read-only credential can list them.
        wait_until(lambda: state.last_checkpoint_outer_step > 0 or stub.GetTrainingState(
            syncer_pb2.GetTrainingStateRequest(), timeout=5).state.last_checkpoint_outer_step > 0,
            timeout_s=60, what="a committed checkpoint")
        store_stub = checkpoint_pb2_grpc.CheckpointStoreStub(channel_lib.sync_channel(store.address, operator))
        assert store_stub.ListManifests(checkpoint_pb2.ListManifestsRequest(run_id="mtls"), timeout=5).manifests

        # ddiloco status with the operator's certificate; and without one.
        certs = cluster.tls_dir
        ddiloco = [sys.executable, "-m", "ddiloco.cli.main", "status", "--json", "--target", syncer.address]
        ok = subprocess.run([*ddiloco, "--tls-ca", str(certs / "ca.pem"), "--tls-cert", str(certs / "operator.pem"),
                             "--tls-key", str(certs / "operator.key")],
                            capture_output=True, text=True, timeout=60, env=cluster.env)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert json.loads(ok.stdout.splitlines()[-1])["run_id"] == "mtls"
        plain = subprocess.run([*ddiloco, "--timeout-s", "3"], capture_output=True, text=True, timeout=60,
                               env=cluster.env)
        assert plain.returncode == 2 and "unavailable" in plain.stdout

        # A learner presenting learner-0's certificate as learner-1: refused at once (exit 4).
        args = cluster.tls_args("learner-0")
        impostor = subprocess.run(
            [sys.executable, "-m", "services.learner", "--syncer", syncer.address, "--learner-id", "learner-1",
             "--steps", "1", "--join-timeout-s", "60", "--health-bind", "127.0.0.1:0", *args],
            capture_output=True, text=True, timeout=120, env=cluster.env)
        assert impostor.returncode == 4, impostor.stdout[-2000:] + impostor.stderr[-2000:]
        assert "PERMISSION_DENIED" in impostor.stdout + impostor.stderr
        state = stub.GetTrainingState(syncer_pb2.GetTrainingStateRequest(), timeout=5).state
        assert state.auth_failures["wrong_learner"] >= 1

        # Health probes need no certificate on the health ports; the main ports refuse plaintext.
        for svc in (syncer, store):
            ready = json.loads(svc.ready_file.read_text())
            health = health_pb2_grpc.HealthStub(grpc.insecure_channel(ready["health_address"]))
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
            plain_health = health_pb2_grpc.HealthStub(grpc.insecure_channel(svc.address))
            with pytest.raises(grpc.RpcError) as err:
                plain_health.Check(health_pb2.HealthCheckRequest(), timeout=3)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        cluster.stop_all(timeout_s=10.0, clients_timeout_s=TEARDOWN_CLIENTS_S)
