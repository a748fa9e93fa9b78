"""Client TLS towards etcd, against a real etcd that serves https only and requires client
certificates (`--client-cert-auth --trusted-ca-file --cert-file --key-file`, as
docker-compose.failover-tls.yml runs its members), with the PKI `ddiloco certs --etcd-names` writes.

- A client with etcd's CA and the etcd client certificate elects a leader, keeps its lease from a
  sibling client (what the syncer's lease keeper uses) and commits under its epoch.
- A client without a client certificate, with one from another CA, or not trusting etcd's CA is
  refused with EtcdTLSError (naming etcd and TLS) within the call's deadline, and a campaign stops
  on it instead of waiting forever; a plaintext client gets EtcdUnavailable saying that etcd may
  serve TLS.
- The syncer process: with --coord-etcd https://... and --coord-tls-* it leads; with a client
  certificate from another CA it exits, its log naming etcd and TLS.

Before this change the etcd client had no TLS settings: every case here failed (no client could
reach this etcd at all).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from ddiloco.chaos import etcd as etcd_lib_chaos
from ddiloco.checkpoint_commit import CommitRecord
from ddiloco.coord import commit as commit_lib
from ddiloco.coord import election as election_lib
from ddiloco.coord import etcd as etcd_lib
from ddiloco.rpc import security
from services.syncer import config as config_lib
from services.syncer import leadership as leadership_lib
from tests import etcd as etcd_helper
from tests.integration.conftest import TINY, SyncerProbe, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CALL_TIMEOUT_S = 1.0
# A refusal must come from the handshake, not from waiting the deadline out: well within it.
REFUSAL_BOUND_S = 5.0


def _run(coro, timeout_s: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


@pytest.fixture
def tls_etcd(tmp_path):
    """(etcd member serving https with --client-cert-auth, its PKI, another CA's PKI)."""
    pki = etcd_helper.etcd_pki(tmp_path / "pki")
    other = etcd_helper.etcd_pki(tmp_path / "other-pki")  # a second, unrelated etcd CA
    with etcd_helper.running_tls_etcd(tmp_path / "etcd", pki) as member:
        yield member, pki, other


def _client(endpoint: str, *, ca: str, cert: str = "", key: str = "") -> etcd_lib.Etcd:
    """An etcd client from certificate files, the way the syncer builds one (ClientSecurity)."""
    sec = security.ClientSecurity(tls_ca=ca, tls_cert=cert, tls_key=key)
    return etcd_lib.Etcd([endpoint], call_timeout_s=CALL_TIMEOUT_S, credentials=sec.credentials(),
                         channel_options=sec.channel_options())


def test_a_client_with_the_etcd_client_certificate_elects_keeps_and_commits(tls_etcd):
    member, pki, _ = tls_etcd

    async def scenario():
        client = _client(member.endpoint, ca=pki.ca, cert=pki.client_cert, key=pki.client_key)
        key = election_lib.leader_key("/t", "run")
        election = election_lib.Election(client, key, address="a:1", instance="A", lease_ttl_s=2)
        epoch = await asyncio.wait_for(election.campaign(), 10)
        assert epoch > 0 and election.is_leader()
        assert await election.observe() == election_lib.Leader("a:1", epoch, "A")
        keeper = client.sibling()  # the lease keeper's own client: same endpoints, same TLS
        assert keeper.tls and await keeper.keepalive(election.lease_id) > 0
        pointer = commit_lib.EtcdCommitPointer(client, prefix="/t", leader_key=key)
        await pointer.commit(CommitRecord("run", 3, epoch))
        assert await pointer.latest("run") == CommitRecord("run", 3, epoch)
        await election.resign()
        await keeper.close()
        await client.close()

    _run(scenario())


@pytest.mark.parametrize("case", ["no client certificate", "client certificate of another CA",
                                  "etcd's certificate not trusted"])
def test_a_client_etcd_does_not_trust_is_refused_naming_etcd_and_tls(tls_etcd, case):
    member, pki, other = tls_etcd
    ca, cert, key = {
        "no client certificate": (pki.ca, "", ""),
        "client certificate of another CA": (pki.ca, other.client_cert, other.client_key),
        "etcd's certificate not trusted": (other.ca, other.client_cert, other.client_key),
    }[case]

    async def scenario():
        client = _client(member.endpoint, ca=ca, cert=cert, key=key)
        election = election_lib.Election(client, election_lib.leader_key("/t", "run"), address="b:1", lease_ttl_s=2)
        started = time.monotonic()
        with pytest.raises(etcd_lib.EtcdTLSError) as refused:
            await election.try_acquire()
        elapsed_s = time.monotonic() - started
        # A campaign gives up on it at once (the same certificates are refused forever), not a hang.
        with pytest.raises(etcd_lib.EtcdTLSError):
            await asyncio.wait_for(election.campaign(), REFUSAL_BOUND_S)
        await client.close()
        return str(refused.value), elapsed_s

    message, elapsed_s = _run(scenario())
    assert "etcd" in message and "TLS" in message and member.endpoint in message, message
    assert elapsed_s < REFUSAL_BOUND_S, elapsed_s


def test_a_plaintext_client_is_told_that_etcd_may_serve_tls(tls_etcd):
    member, _, _ = tls_etcd

    async def scenario():
        client = etcd_lib.Etcd([member.endpoint], call_timeout_s=CALL_TIMEOUT_S)
        started = time.monotonic()
        with pytest.raises(etcd_lib.EtcdUnavailable) as refused:
            await client.get(b"/t/x")
        await client.close()
        # Unavailable, not a TLS refusal: this client has no TLS to refuse (a campaign waits it out).
        assert refused.type is etcd_lib.EtcdUnavailable
        return str(refused.value), time.monotonic() - started

    message, elapsed_s = _run(scenario())
    assert "etcd" in message and "TLS" in message and "plaintext" in message, message
    assert elapsed_s < REFUSAL_BOUND_S, elapsed_s


def test_the_syncers_own_etcd_client_from_its_flags_elects(tls_etcd):
    """services/syncer/leadership.elect from a SyncerConfig parsed from flags: https endpoint and --coord-tls-*."""
    member, pki, _ = tls_etcd
    cfg = config_lib.parse_config([
        "--insecure", "--coord-etcd", f"https://{member.endpoint}", "--coord-tls-ca", pki.ca,
        "--coord-tls-cert", pki.client_cert, "--coord-tls-key", pki.client_key], {})

    async def scenario():
        leadership = leadership_lib.Leadership(coordinated=True)
        pointer, etcd = leadership_lib.elect(cfg, leadership, "127.0.0.1:5", "instance-a")
        assert etcd.tls and leadership.etcd is etcd
        assert await leadership.election.try_acquire()
        epoch = leadership.election.epoch
        await pointer.commit(CommitRecord(cfg.store_run_id, 1, epoch))
        await leadership.election.resign()
        await etcd.close()
        return epoch

    assert _run(scenario()) > 0


def test_syncer_processes_lead_with_the_etcd_client_certificate_and_stop_without_it(tls_etcd, cluster):
    member, pki, other = tls_etcd
    endpoint = f"https://{member.endpoint}"

    def syncer(name: str, cert_pki: etcd_helper.EtcdPKI):
        svc = cluster.add(name, "services.syncer", [
            "--bind", "127.0.0.1:0", "--run-id", "tls-run", "--ready-file", str(cluster.workdir / f"{name}.ready.json"),
            "--coord-etcd", endpoint, "--coord-tls-ca", pki.ca, "--coord-tls-cert", cert_pki.client_cert,
            "--coord-tls-key", cert_pki.client_key, *TINY])
        svc.start()
        svc.wait_ready(120)
        return svc

    good = syncer("syncer-good", pki)

    def epoch() -> int:
        probe = SyncerProbe(good.address)
        try:
            return probe.state(0).epoch
        finally:
            probe.close()

    wait_until(lambda: epoch() > 0, timeout_s=60, what="the syncer with the etcd client certificate leads")
    bad = syncer("syncer-foreign-cert", other)
    status = bad.wait(60)
    log = bad.log_path.read_text(errors="replace")
    assert status == leadership_lib.EXIT_LOST_LEADERSHIP, (status, log[-3000:])
    assert "EtcdTLSError" in log and "TLS with etcd failed" in log, log[-3000:]
    assert good.alive() and epoch() > 0


def test_the_compose_files_pki_and_paths_work_with_a_real_etcd(tmp_path):
    """docker-compose.failover-tls.yml without containers: its `certs-failover` script writes the
    volumes (as directories here), a real etcd runs with the TLS files at the paths an etcd member
    is given, and a syncer's etcd client from the paths and endpoints a syncer is given elects,
    verifying etcd's certificate by the member's compose name (etcd-a). The member's peer URL is
    https with the compose file's peer certificate settings. The main CA's syncer certificate (what
    every other ddiloco service trusts) does not open etcd."""
    from tests.unit import test_compose_failover_tls_wiring as wiring

    wiring.certs_failover_runner(tmp_path)()
    member_env, syncer_env = wiring.merged("etcd-a")["environment"], wiring.merged("syncer")["environment"]
    volumes = {**wiring.merged("etcd-a")["volumes"], **wiring.merged("syncer")["volumes"]}
    # The volume mounted at a path's directory, as the script's directory for that volume.
    sources = {source: tmp_path / target.lstrip("/") for target, (source, _) in
               wiring.merged("certs-failover")["volumes"].items()}

    def local(path: str) -> str:
        directory, _, name = path.rpartition("/")
        return str(sources[volumes[directory][0]] / name)

    assert member_env["ETCD_CLIENT_CERT_AUTH"] == "true"  # what ServerTLS.args() passes as --client-cert-auth
    server_tls = etcd_lib_chaos.ServerTLS(
        ca_file=local(member_env["ETCD_TRUSTED_CA_FILE"]), cert_file=local(member_env["ETCD_CERT_FILE"]),
        key_file=local(member_env["ETCD_KEY_FILE"]), probe_cert_file=local(syncer_env["DDILOCO_SYNCER_COORD_TLS_CERT"]),
        probe_key_file=local(syncer_env["DDILOCO_SYNCER_COORD_TLS_KEY"]))
    host = etcd_lib.parse_endpoints(syncer_env["DDILOCO_SYNCER_COORD_ETCD"])[0].split(":")[0]
    assert host == "etcd-a"
    # Peers as the members run them: https, etcd's CA, the peer certificate, its common name required.
    assert member_env["ETCD_PEER_CLIENT_CERT_AUTH"] == "true"
    peer_tls = etcd_lib_chaos.PeerTLS(
        ca_file=local(member_env["ETCD_PEER_TRUSTED_CA_FILE"]), cert_file=local(member_env["ETCD_PEER_CERT_FILE"]),
        key_file=local(member_env["ETCD_PEER_KEY_FILE"]), allowed_cn=member_env["ETCD_PEER_CERT_ALLOWED_CN"])
    with etcd_lib_chaos.running_etcd(tmp_path / "etcd", etcd_helper.etcd_binary(), tls=server_tls,
                                     peer_tls=peer_tls) as member:
        def client(cert: str, key: str) -> etcd_lib.Etcd:
            sec = security.ClientSecurity(tls_ca=local(syncer_env["DDILOCO_SYNCER_COORD_TLS_CA"]), tls_cert=cert,
                                          tls_key=key, tls_server_name=host)
            return etcd_lib.Etcd([member.endpoint], call_timeout_s=CALL_TIMEOUT_S, credentials=sec.credentials(),
                                 channel_options=sec.channel_options())

        async def scenario():
            syncer = client(local(syncer_env["DDILOCO_SYNCER_COORD_TLS_CERT"]),
                            local(syncer_env["DDILOCO_SYNCER_COORD_TLS_KEY"]))
            election = election_lib.Election(syncer, election_lib.leader_key("/ddiloco", "compose"),
                                             address="syncer:50051", lease_ttl_s=2)
            assert await asyncio.wait_for(election.campaign(), 10) > 0
            await election.resign()
            await syncer.close()
            main_ca_cert = client(str(tmp_path / "tls" / "syncer" / "tls.pem"),
                                  str(tmp_path / "tls" / "syncer" / "tls.key"))
            with pytest.raises(etcd_lib.EtcdTLSError):
                await main_ca_cert.get(b"/ddiloco/leader/compose")
            await main_ca_cert.close()

        _run(scenario())
