"""`ddiloco up --syncer-replicas 2 --tls` (issue 23): failover over an etcd behind TLS, with real
processes (etcd from scripts/etcd_env.sh, a store, two syncers, learners, the evaluator).

1. The command as a user runs it trains to the end: the etcd it starts serves its clients and its
   peer URL over TLS with certificate checks (its own log says so), one of the two syncer
   instances is elected (the other logs it as the leader it stands by for, with its epoch), the
   learners and the evaluator follow the leader, the summary counts merges, and nothing is left
   running (etcd included). On a loaded machine a leader may lose its lease: then every later
   election has a new epoch, after the deposed leader said it lost its leadership.
2. The same cluster from LocalCluster, as `up` builds it: one instance leads and the other stands
   by naming it; a third syncer given etcd's CA but no client certificate cannot join the
   election: it exits with EXIT_LOST_LEADERSHIP, its log naming EtcdTLSError; neither a
   plaintext etcd client nor the main CA's syncer certificate opens etcd; at etcd's peer port the
   syncers' client certificate (same etcd CA) is refused and only the peer certificate admitted.

Before this change `up` had no --syncer-replicas (usage error) and LocalCluster no etcd: both
failed at their first line.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import sys
import urllib.request

import pytest

from ddiloco.cli import certs
from ddiloco.cli import cluster as cluster_lib
from ddiloco.cli import run_view
from ddiloco.coord import etcd as etcd_lib
from ddiloco.rpc import security
from services.syncer import leadership as leadership_lib
from tests import etcd as etcd_helper
from tests.integration.conftest import TINY, wait_until
from tests.integration.test_cli import _pid_alive

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

_DDILOCO = [sys.executable, "-m", "ddiloco.cli.main"]


def _leader_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "leading with epoch" in line]


def test_up_with_two_syncers_over_tls_etcd_trains_and_one_leads(tmp_path, learner_compilation_cache):
    workdir = tmp_path / "run"
    etcd_helper.etcd_binary()  # a missing etcd fails here, saying so
    result = subprocess.run(
        [*_DDILOCO, "up", "--tls", "--syncer-replicas", "2", "--preset", "tiny", "--learners", "2", "--steps", "60",
         "--sync-period-steps", "4", "--no-live", "--eval-interval-s", "3", "--workdir", str(workdir),
         "--summary-json", str(tmp_path / "s.json"), "--compilation-cache-dir", str(learner_compilation_cache)],
        capture_output=True, text=True, timeout=380,
    )
    out = result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == 0, out
    assert "etcd on https://127.0.0.1:" in result.stdout and "2 syncer instances" in result.stdout, out
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["merges"] > 0 and summary["tokens_merged"] > 0, summary
    assert summary["heldout_loss_end"] < summary["heldout_loss_start"], summary
    assert [ls["steps"] for ls in summary["learners"]] == [60, 60]
    logs = {name: (workdir / "logs" / f"{name}.log").read_text(errors="replace") for name in ("syncer", "syncer-b")}
    ready = {name: json.loads((workdir / f"{name}.ready.json").read_text())["address"] for name in logs}
    leads = sorted((line[:12], name, int(line.rsplit(" ", 1)[1])) for name, log in logs.items()
                   for line in _leader_lines(log))
    assert leads, {n: log[-2000:] for n, log in logs.items()}
    # The first election: one instance leads, the other stands by naming it and its epoch.
    _, first, epoch = leads[0]
    standby = next(name for name in logs if name != first)
    assert f"leader is {ready[first]} (epoch {epoch})" in logs[standby], logs[standby][-2000:]
    # Later elections (a leader starved of CPU past its lease on a loaded machine: seen here at load
    # average 30) each take a new epoch, after the previous leader lost its leadership. (`up`
    # restarts a deposed instance as a standby while learners run: tests/unit/test_up_syncer_replicas.py.)
    assert len({e for _, _, e in leads}) == len(leads), leads
    lost = sum(log.count("lost leadership") for log in logs.values())
    assert lost >= len(leads) - 1, (leads, lost)
    assert cluster_lib.EXIT_LOST_LEADERSHIP == leadership_lib.EXIT_LOST_LEADERSHIP
    # etcd ran with client and peer TLS, each checking certificates (etcd logs its TLS settings).
    etcd_log = (workdir / "etcd" / "logs" / "etcd-0.log").read_text()
    assert "starting with client TLS" in etcd_log and "starting with peer TLS" in etcd_log, etcd_log[-2000:]
    assert etcd_log.count("client-cert-auth = true") >= 2, etcd_log[-2000:]
    pids = json.loads((workdir / "pids.json").read_text())
    assert {"etcd", "syncer", "syncer-b", "checkpoint", "evaluator"} <= set(pids)
    assert not [p for ps in pids.values() for p in ps if _pid_alive(p)], "up left processes behind"


def _epochs(cluster: cluster_lib.LocalCluster, names) -> dict[str, tuple[int, str]]:
    """{name: (epoch, leader address it names)} over mutual TLS (the operator's credential)."""
    reader = run_view.RunReader(cluster.syncer_target(), cluster.client_security(), timeout_s=3.0, recent_merges=0)
    try:
        out = {}
        for name in names:
            state = reader.fetch(cluster.services[name].address)
            out[name] = (state.epoch, state.leader_address)
        return out
    finally:
        reader.close()


def _https_status(url: str, ca: str, cert: str, key: str) -> str:
    context = ssl.create_default_context(cafile=ca)
    context.load_cert_chain(cert, key)
    try:
        with urllib.request.urlopen(url, timeout=5, context=context) as response:
            return str(response.status)
    except (OSError, ssl.SSLError) as exc:
        return f"refused: {exc}"


def test_a_syncer_without_the_etcd_client_certificate_cannot_join_the_election(tmp_path):
    etcd_helper.etcd_binary()  # a missing etcd fails here, saying so
    cluster = cluster_lib.LocalCluster(tmp_path / "cluster", tls=True)
    try:
        etcd = cluster.start_etcd()
        assert etcd.tls and etcd.peer_tls
        cluster.start_store()
        cluster.start_syncer_replicas(2, run_id="up-tls", extra=TINY)

        def one_leads() -> bool:
            cluster.revive_syncer_replicas()  # as `up` does: a leader starved past its lease comes back
            epochs = _epochs(cluster, ("syncer", "syncer-b"))
            leading = [n for n, (epoch, _) in epochs.items() if epoch > 0]
            if len(leading) != 1:
                return False
            standby = next(n for n in epochs if n not in leading)
            return epochs[standby] == (0, cluster.services[leading[0]].address)

        wait_until(one_leads, timeout_s=90, what="one syncer leads, the other names it")

        coord = cluster.coord_args(client_certificate=False)
        assert "--coord-tls-ca" in coord and "--coord-tls-cert" not in coord
        intruder = cluster.add("syncer-no-cert", "services.syncer", [
            "--bind", "127.0.0.1:0", "--run-id", "up-tls", "--ready-file", str(cluster.workdir / "intruder.ready.json"),
            *coord, *cluster.tls_args("syncer"), *TINY])
        intruder.start()
        status = intruder.wait(90)
        log = intruder.log_path.read_text(errors="replace")
        assert status == leadership_lib.EXIT_LOST_LEADERSHIP, (status, log[-3000:])
        assert "EtcdTLSError" in log and "TLS with etcd failed" in log, log[-3000:]
        wait_until(one_leads, timeout_s=60, what="one syncer still leads, the other names it")

        async def refused(sec: security.ClientSecurity | None) -> type[Exception]:
            client = etcd_lib.Etcd([etcd.endpoint], call_timeout_s=1.0,
                                   credentials=sec.credentials() if sec else None,
                                   channel_options=sec.channel_options() if sec else ())
            try:
                await client.get(b"/ddiloco/leader/up-tls")
            except etcd_lib.EtcdUnavailable as exc:
                return type(exc)
            finally:
                await client.close()
            return type(None)

        certs_dir = cluster.tls_dir
        main_ca_syncer = security.ClientSecurity(tls_ca=str(certs_dir / "etcd-ca.pem"),
                                                 tls_cert=str(certs_dir / "syncer.pem"),
                                                 tls_key=str(certs_dir / "syncer.key"))
        assert asyncio.run(asyncio.wait_for(refused(None), 30)) is etcd_lib.EtcdUnavailable
        assert asyncio.run(asyncio.wait_for(refused(main_ca_syncer), 30)) is etcd_lib.EtcdTLSError

        # The peer port: TLS with etcd's CA, and only the peer certificate's common name is a member.
        ca = str(certs_dir / "etcd-ca.pem")
        members = f"https://127.0.0.1:{etcd.peer_port}/members"

        def pair(stem: str) -> tuple[str, str]:
            return str(certs_dir / f"{stem}.pem"), str(certs_dir / f"{stem}.key")

        assert _https_status(members, ca, *pair(certs.ETCD_PEER)) == "200"
        assert _https_status(members, ca, *pair(certs.ETCD_CLIENT)).startswith("refused")
    finally:
        cluster.stop_all(timeout_s=10.0)
    assert not cluster.etcd.alive() and not any(s.alive() for s in cluster.services.values())

