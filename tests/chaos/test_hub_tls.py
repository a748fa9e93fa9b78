"""The hub under fire with its etcd behind TLS (`hub-tls`, ddiloco/chaos/hub.py with
Scenario.hub_tls): a 3-member etcd serving clients over https to client certificates and its peers
over https to peer certificates (etcd's own CA, `ddiloco certs --etcd-names`), two syncers with
--coord-tls-*, two stores, 3 learners.

The leading region is killed whole (its syncer, store and etcd member) and restarted, then another
etcd member: the standby leads over client TLS (a failover: two leader epochs), the killed members
rejoin their cluster over peer TLS, and every invariant holds (I1-I4 and I6, as in hub-soak-short).
Before Scenario.hub_tls the harness's etcd was plain HTTP only: the members' logs had no TLS.
"""

from __future__ import annotations

import pytest

from ddiloco.chaos import harness
from tests.chaos.conftest import build

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.timeout(480)]


def test_hub_with_client_and_peer_tls_etcd_fails_over_and_keeps_every_invariant(tmp_path, jax_cache,
                                                                              learner_compilation_cache, capsys):
    scenario, events = build("hub-tls", learner_compilation_cache)
    assert scenario.hub_tls
    result = harness.run_scenario(scenario, events, tmp_path / "hub", jax_cache_dir=jax_cache)
    with capsys.disabled():
        print(f"\n{result.report_line}")
    assert result.ok, "\n".join([result.report_line, *result.violations()])
    assert {f.kind for f in result.faults if f.scheduled} == {"region", "kill"}, result.report_line
    i1 = result.check("I1").figures
    assert i1["lost"] == 0 and i1["double_applied"] == 0 and i1["acked"] > 0, i1
    assert result.check("I6").figures["epochs"] >= 2, result.check("I6")  # the standby led over client TLS
    logs = tmp_path / "hub" / "cluster" / "logs"
    restarted = 0
    for member in ("etcd-0", "etcd-1", "etcd-2"):
        log = (logs / f"{member}.log").read_text(errors="replace")
        starts = log.count("starting with peer TLS")
        # Every start of every member served clients and peers over TLS, checking certificates.
        assert starts >= 1 and log.count("starting with client TLS") == starts, (member, log[-2000:])
        assert log.count("client-cert-auth = true") == 2 * starts, (member, log[-2000:])
        assert '"listen-peer-urls":["https://127.0.0.1:' in log, (member, log[-2000:])
        restarted += starts > 1
    assert restarted >= 2, "the region's member and etcd-2 were killed and restarted"
    for syncer in ("syncer-a", "syncer-b"):
        log = (logs / f"{syncer}.log").read_text(errors="replace")
        assert "EtcdTLSError" not in log, log[-2000:]
