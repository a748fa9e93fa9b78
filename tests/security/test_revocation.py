"""Certificate revocation (issue 24): `--tls-deny-list` and `ddiloco certs revoke`.

A deny list holds certificate serial numbers and identities, one a line. The syncer and the
checkpoint store re-read it while they run: a revoked learner certificate is refused
(UNAUTHENTICATED, "revoked") on its next call while another learner goes on; a revoked identity
is refused whichever certificate it shows; a broken edit leaves the previous list in force. Every
refusal is counted by reason under the auth-failure metrics, which export every known reason
(security.AUTH_FAILURE_REASONS) at 0. The main test runs the real store and syncer processes under
mutual TLS and revokes with the real CLI.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from prometheus_client.parser import text_string_to_metric_families

from ddiloco.cli import certs as certs_lib
from ddiloco.cli import cluster as cluster_lib
from ddiloco.cli import main as cli_main
from ddiloco.rpc import channel as channel_lib
from ddiloco.rpc import security
from ddiloco.v1 import checkpoint_pb2, checkpoint_pb2_grpc, syncer_pb2, syncer_pb2_grpc
from ddiloco.wire import serde
from tests.integration.conftest import TINY
from tests.security.conftest import Harness, client_security, code_of, error_of
from tests.waits import TEARDOWN_CLIENTS_S

pytestmark = pytest.mark.timeout(300)

UNAUTH = grpc.StatusCode.UNAUTHENTICATED
_RELOAD_TIMEOUT_S = 10.0  # servers re-read the list within a second of a change
_CALL_TIMEOUT_S = 5.0


# ------------------------------------------------------------------------------ the file


def test_deny_list_format():
    serials, identities = security.parse_deny_list(
        "# revoked 2026-11-26\n"
        "0x1351FA3407af  # learner/learner-0's old certificate\n"
        "  3f:9a:00:01\n"
        "abc\n"
        "learner/learner-3\n"
        "spiffe://ddiloco/reader/operator   # the whole identity\n"
        "\n")
    assert serials == {0x1351FA3407AF, 0x3F9A0001, 0xABC}
    assert identities == {security.Identity("learner", "learner-3"), security.Identity("reader", "operator")}
    assert security.parse_serial(security.format_serial(0x3F9A0001)) == 0x3F9A0001
    for bad, line in (("0x12\nnot-hex\n", 2), ("learner/bad name\n", 1), ("nobody/x\n", 1), ("0x" + "f" * 41, 1)):
        with pytest.raises(ValueError, match=f"line {line}"):
            security.parse_deny_list(bad)


def test_deny_list_needs_mutual_tls_and_a_readable_file(tmp_path, pki):
    deny = tmp_path / "deny.txt"
    deny.write_text("")
    with pytest.raises(ValueError, match="needs mutual TLS"):
        security.ServerSecurity(insecure=True, tls_deny_list=str(deny))
    sec = security.ServerSecurity(tls_ca=str(pki / "ca.pem"), tls_cert=str(pki / "syncer.pem"),
                                  tls_key=str(pki / "syncer.key"), tls_deny_list=str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="deny list .*missing.txt"):
        sec.check_files()
    deny.write_text("learner/learner-0\nnonsense entry\n")
    with pytest.raises(ValueError, match="line 2"):
        security.DenyList(str(deny))


def test_certs_revoke_appends_once_and_refuses_a_broken_list(tmp_path, pki, capsys):
    deny = tmp_path / "deny.txt"
    cert = x509.load_pem_x509_certificate((pki / "learner-2.pem").read_bytes())

    def revoke(*args: str) -> int:
        return cli_main.main(["certs", "revoke", "--deny-list", str(deny), *args])

    assert revoke("--cert", str(pki / "learner-2.pem")) == 0
    assert "revoked 0x" in capsys.readouterr().out
    assert revoke("--cert", str(pki / "learner-2.pem")) == 0  # already there: not added twice
    assert "already" in capsys.readouterr().out
    assert revoke("--serial", "0A:BC") == 0 and revoke("--identity", "spiffe://ddiloco/evaluator/evaluator") == 0
    text = deny.read_text()
    assert f"{security.format_serial(cert.serial_number)}  # learner/learner-2, revoked " in text
    assert security.parse_deny_list(text) == ({cert.serial_number, 0xABC}, {security.Identity("evaluator", "evaluator")})
    for bad in (["--serial", "xyz"], ["--identity", "admin/root"], ["--cert", str(tmp_path / "missing.pem")]):
        assert revoke(*bad) == 2, bad
    # A list the servers cannot parse is not appended to (the servers keep their previous list
    # while it is broken, so the new entry would not take effect).
    deny.write_text(text + "garbage line\n")
    assert revoke("--identity", "learner/learner-1") == 2
    assert "fix it first" in capsys.readouterr().out
    assert "learner-1" not in deny.read_text()


# ---------------------------------------------------------------- identities not ours


def _cert_with_uri(pki: pathlib.Path, uri: str, stem: str) -> None:
    """A certificate signed by the run's CA whose only URI SAN is `uri` (for kinds `ddiloco certs`
    would never write)."""
    ca = x509.load_pem_x509_certificate((pki / "ca.pem").read_bytes())
    signer = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, stem)]))
        .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri), x509.DNSName("localhost")]),
                       critical=False)
        .sign(signer, hashes.SHA256())
    )
    (pki / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (pki / f"{stem}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))


def test_an_unknown_ddiloco_identity_is_counted_apart_from_none(tmp_path, pki):
    keys = tmp_path / "pki"
    keys.mkdir()
    for name in ("ca.pem", "ca.key", "syncer.pem", "syncer.key", "checkpoint.pem", "checkpoint.key", "nobody.pem",
                 "nobody.key"):
        (keys / name).write_bytes((pki / name).read_bytes())
    _cert_with_uri(keys, "spiffe://ddiloco/admin/root", "admin")
    with Harness(tmp_path / "h", mode="mtls", pki=keys) as h:
        for stem, reason in (("admin", "unknown_identity"), ("nobody", "no_identity")):
            stub = syncer_pb2_grpc.SyncerStub(channel_lib.sync_channel(h.address, client_security(keys, stem)))
            error = error_of(lambda s=stub: s.GetTrainingState(syncer_pb2.GetTrainingStateRequest(), timeout=5))
            assert error.code() == UNAUTH, stem
            assert h.state().auth_failures[reason] == 1, (stem, dict(h.state().auth_failures))
        assert "unknown ddiloco identity (spiffe://ddiloco/admin/root" in error_of(
            lambda: syncer_pb2_grpc.SyncerStub(channel_lib.sync_channel(h.address, client_security(keys, "admin")))
            .GetTrainingState(syncer_pb2.GetTrainingStateRequest(), timeout=5)).details()


# ----------------------------------------------------------------- real processes


def _scrape(address: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _auth_failures(samples, name: str, reason: str) -> float:
    """The sum of `name`'s samples with `reason` (over methods, for the store); fails if none is exported."""
    values = [v for (n, labels), v in samples.items() if n == name and ("reason", reason) in labels]
    assert values, f"{name}{{reason={reason!r}}} is not exported"
    return sum(values)


def _until_refused(call, what: str) -> grpc.RpcError:
    """Repeats `call` until it fails (the server re-reads the list within a second); returns the error."""
    deadline = time.monotonic() + _RELOAD_TIMEOUT_S
    while True:
        try:
            call()
        except grpc.RpcError as exc:
            return exc
        assert time.monotonic() < deadline, f"{what} was still admitted after {_RELOAD_TIMEOUT_S} s"
        time.sleep(0.1)


class _LearnerClient:
    """A learner's calls over mutual TLS with its own certificate (the wire protocol, blocking)."""

    def __init__(self, cluster: cluster_lib.LocalCluster, address: str, name: str) -> None:
        self.name = name
        self.channel = channel_lib.sync_channel(address, cluster.client_security(name))
        self.stub = syncer_pb2_grpc.SyncerStub(self.channel)

    def join(self) -> str:
        return self.stub.Join(syncer_pb2.JoinRequest(protocol_version=serde.PROTOCOL_VERSION, learner_id=self.name,
                                                     incarnation=1, region="test"), timeout=_CALL_TIMEOUT_S).syncer_instance

    def report(self, step: int) -> syncer_pb2.ReportProgressResponse:
        return self.stub.ReportProgress(syncer_pb2.ReportProgressRequest(
            protocol_version=serde.PROTOCOL_VERSION, learner_id=self.name, incarnation=1, local_step=step),
            timeout=_CALL_TIMEOUT_S)


def test_revoked_certificates_are_refused_by_running_servers(tmp_path):
    cluster = cluster_lib.LocalCluster(tmp_path / "cluster", tls=True)
    certs = cluster.tls_dir
    certs_lib.write_dev_certs(certs, learners=("learner-0", "learner-1"), services=())
    deny = tmp_path / "deny.txt"
    deny.write_text("# nothing revoked yet\n")

    def revoke(*args: str) -> None:
        done = subprocess.run([sys.executable, "-m", "ddiloco.cli.main", "certs", "revoke", "--deny-list", str(deny),
                               *args], capture_output=True, text=True, timeout=60, env=cluster.env)
        assert done.returncode == 0 and "revoked" in done.stdout, done.stdout + done.stderr

    try:
        store = cluster.start_store(extra=["--tls-deny-list", str(deny)])
        syncer = cluster.start_syncer(run_id="revoke", extra=[*TINY, "--tls-deny-list", str(deny)])
        syncer_metrics = json.loads(syncer.ready_file.read_text())["metrics_address"]
        store_metrics = json.loads(store.ready_file.read_text())["metrics_address"]
        # Every known reason is exported at 0 before any refusal.
        for reason in security.AUTH_FAILURE_REASONS:
            assert _auth_failures(_scrape(syncer_metrics), "ddiloco_syncer_auth_failures_total", reason) == 0
            assert _auth_failures(_scrape(store_metrics), "ddiloco_checkpoint_auth_failures_total", reason) == 0

        stolen, honest = (_LearnerClient(cluster, syncer.address, f"learner-{i}") for i in range(2))
        assert stolen.join() and honest.join()
        stolen.report(1)
        honest.report(1)
        operator = cluster.client_security("operator")
        state = syncer_pb2_grpc.SyncerStub(channel_lib.sync_channel(syncer.address, operator))
        manifests = checkpoint_pb2_grpc.CheckpointStoreStub(channel_lib.sync_channel(store.address, operator))
        latest = checkpoint_pb2.GetLatestManifestRequest(run_id="revoke")
        assert not manifests.GetLatestManifest(latest, timeout=_CALL_TIMEOUT_S).found

        # learner-0's certificate is revoked while both servers run: its next calls are refused.
        revoke("--cert", str(certs / "learner-0.pem"))
        error = _until_refused(lambda: stolen.report(2), "the revoked learner-0 certificate")
        assert error.code() == UNAUTH, error
        serial = x509.load_pem_x509_certificate((certs / "learner-0.pem").read_bytes()).serial_number
        assert f"client certificate {security.format_serial(serial)} has been revoked" in error.details()
        assert code_of(stolen.join) == UNAUTH
        # ... and only it: learner-1 goes on, the operator still reads.
        assert honest.report(2) is not None and honest.join()
        assert state.GetTrainingState(syncer_pb2.GetTrainingStateRequest(), timeout=_CALL_TIMEOUT_S).state.members

        # A whole identity: the operator's certificate at the store and at the syncer, including a
        # stream it opened before (re-admitted before its next message).
        watch = state.WatchTrainingState(syncer_pb2.WatchTrainingStateRequest(min_interval_s=0.2), timeout=60)
        assert next(watch).state.run_id == "revoke"
        revoke("--identity", "reader/operator")
        error = _until_refused(lambda: manifests.GetLatestManifest(latest, timeout=_CALL_TIMEOUT_S), "reader/operator")
        assert error.code() == UNAUTH and "identity reader/operator has been revoked" in error.details(), error
        error = _until_refused(lambda: state.GetTrainingState(syncer_pb2.GetTrainingStateRequest(),
                                                              timeout=_CALL_TIMEOUT_S), "reader/operator")
        assert error.code() == UNAUTH and "revoked" in error.details(), error
        error = _until_refused(lambda: next(watch), "the operator's open WatchTrainingState stream")
        assert error.code() == UNAUTH and "identity reader/operator has been revoked" in error.details(), error

        # A broken edit (a half-written line) is not loaded: the previous list stays in force.
        deny.write_text(deny.read_text() + "0xzz-not-a-serial\n")
        time.sleep(2.5)  # past the servers' re-read interval
        assert code_of(lambda: stolen.report(3)) == UNAUTH
        assert honest.report(3) is not None

        # Each refusal counted by its reason.
        s = _scrape(syncer_metrics)
        assert _auth_failures(s, "ddiloco_syncer_auth_failures_total", "revoked_certificate") >= 3
        assert _auth_failures(s, "ddiloco_syncer_auth_failures_total", "revoked_identity") >= 2
        st = _scrape(store_metrics)
        assert _auth_failures(st, "ddiloco_checkpoint_auth_failures_total", "revoked_identity") >= 1
        assert _auth_failures(st, "ddiloco_checkpoint_auth_failures_total", "revoked_certificate") == 0
        for client in (stolen, honest):
            client.channel.close()
        assert "not reloaded" in (cluster.workdir / "logs" / "syncer.log").read_text()
    finally:
        cluster.stop_all(timeout_s=10.0, clients_timeout_s=TEARDOWN_CLIENTS_S)

