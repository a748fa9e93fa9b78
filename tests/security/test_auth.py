"""Fault-matrix row 22 (reliability.md §5): authentication and authorization failures.

Mutual TLS: no certificate, a certificate from another CA, an expired one and plaintext all fail
the TLS handshake (UNAVAILABLE on the client; nothing reaches the service); a valid certificate
without a ddiloco identity is UNAUTHENTICATED; a valid learner certificate acting as another
learner, or any credential calling beyond its role, is PERMISSION_DENIED. Bearer tokens: missing,
unknown and revoked tokens are UNAUTHENTICATED, also when replayed after revocation. Every case
leaves the global model and the committed checkpoints unchanged; refusals are counted.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddiloco.cli import main as cli_main
from ddiloco.rpc import channel as channel_lib
from ddiloco.rpc import security
from ddiloco.v1 import checkpoint_pb2, checkpoint_pb2_grpc, syncer_pb2, syncer_pb2_grpc
from ddiloco.wire import serde
from services.syncer import membership as membership_lib
from tests.security.conftest import Harness, Learner, client_security, code_of, encoded, honest_delta, merge_once
from tests.waits import wait_until

pytestmark = pytest.mark.timeout(120)

DENIED = grpc.StatusCode.PERMISSION_DENIED
UNAUTH = grpc.StatusCode.UNAUTHENTICATED


def _prime(h: Harness, sec) -> Learner:
    """learner-0 contributes once (fragment 0 -> version 1) and a checkpoint is committed."""
    honest = Learner(h.address, "learner-0", sec=sec)
    merge_once(h, honest)
    return honest


def _syncer_stub(address: str, sec) -> syncer_pb2_grpc.SyncerStub:
    return syncer_pb2_grpc.SyncerStub(channel_lib.sync_channel(address, sec))


def _state_call(stub, timeout_s: float = 5.0):
    return stub.GetTrainingState(syncer_pb2.GetTrainingStateRequest(), timeout=timeout_s)


def _observe(stub) -> int:
    """Reads the first global fragment header as an observer; returns its fragment id."""
    call = stub.WatchFragments(syncer_pb2.WatchFragmentsRequest(protocol_version=serde.PROTOCOL_VERSION), timeout=5)
    for msg in call:
        call.cancel()
        return msg.header.fragment_id
    raise AssertionError("empty watch stream")


def test_mutual_tls_identities_roles_and_handshake_failures(tmp_path, pki):
    with Harness(tmp_path, mode="mtls", pki=pki) as h:
        honest = _prime(h, client_security(pki, "learner-0"))
        frozen = h.frozen()
        me = Learner(h.address, "learner-1", sec=client_security(pki, "learner-1"))  # acts as itself: fine
        payload, info = encoded(honest_delta(h.numel(1), 1))
        impostor = _assert_impersonation_denied(h, pki, me, payload, info)
        operator = _assert_reader_and_evaluator_roles(h, pki, me, payload, info)
        _assert_no_identity_is_unauthenticated(h, pki)
        _assert_handshake_failures(h, pki, tmp_path)
        _assert_health_open_on_its_port_only(h)

        # Nothing of the above touched the model or the checkpoints.
        assert h.frozen() == frozen and h.checkpoint() is False
        for learner in (honest, me, impostor, operator):
            learner.close()


def _assert_impersonation_denied(h: Harness, pki, me: Learner, payload, info) -> Learner:
    """A valid learner certificate (learner-0) acting as learner-1: PERMISSION_DENIED on every call,
    counted, and only the impersonator flagged. Returns the impersonator's (open) learner."""
    impostor = Learner(h.address, "learner-1", sec=client_security(pki, "learner-0"), join=False)
    impostor.instance = me.instance
    assert code_of(lambda: impostor.join()) == DENIED
    assert code_of(lambda: impostor.upload(1, 0, payload, info)) == DENIED
    assert code_of(lambda: impostor.stub.ReportProgress(syncer_pb2.ReportProgressRequest(
        protocol_version=serde.PROTOCOL_VERSION, learner_id="learner-1", incarnation=1), timeout=5)) == DENIED
    assert code_of(lambda: list(impostor.stub.WatchFragments(syncer_pb2.WatchFragmentsRequest(
        protocol_version=serde.PROTOCOL_VERSION, learner_id="learner-1", incarnation=1), timeout=5))) == DENIED
    assert code_of(lambda: impostor.stub.Leave(syncer_pb2.LeaveRequest(
        protocol_version=serde.PROTOCOL_VERSION, learner_id="learner-1", incarnation=1), timeout=5)) == DENIED
    # A learner may not read the training state, report evals or watch as an observer.
    assert code_of(lambda: _state_call(impostor.stub)) == DENIED
    assert code_of(lambda: impostor.stub.ReportEval(syncer_pb2.ReportEvalRequest(
        protocol_version=serde.PROTOCOL_VERSION, heldout_loss=0.1), timeout=5)) == DENIED
    assert code_of(lambda: _observe(impostor.stub)) == DENIED
    state = h.state()
    assert state.auth_failures["wrong_learner"] == 5 and state.auth_failures["wrong_role"] == 3
    assert state.uploads["rejected_wrong_learner"] == 1
    member = next(m for m in state.members if m.learner_id == "learner-0")
    assert member.flags & membership_lib.FLAG_IMPERSONATION and member.rejections["wrong_learner"] == 5
    assert next(m for m in state.members if m.learner_id == "learner-1").flags == 0  # the victim is not flagged
    return impostor


def _assert_reader_and_evaluator_roles(h: Harness, pki, me: Learner, payload, info) -> Learner:
    """The operator's credential reads the state only; the evaluator reports. Returns the
    operator's (open) learner. Not the model either: that takes a model-reader
    (tests/security/test_model_reader.py)."""
    reader = _syncer_stub(h.address, client_security(pki, "operator"))
    assert _state_call(reader).state.outer_steps == 1
    assert next(iter(reader.WatchTrainingState(syncer_pb2.WatchTrainingStateRequest(), timeout=5))).state.run_id
    assert code_of(lambda: _observe(reader)) == DENIED
    operator = Learner(h.address, "operator", sec=client_security(pki, "operator"), join=False)
    operator.instance = me.instance
    assert code_of(lambda: operator.join()) == DENIED
    assert code_of(lambda: operator.upload(1, 0, payload, info)) == DENIED
    assert code_of(lambda: reader.ReportEval(syncer_pb2.ReportEvalRequest(
        protocol_version=serde.PROTOCOL_VERSION, heldout_loss=0.1), timeout=5)) == DENIED
    evaluator = _syncer_stub(h.address, client_security(pki, "evaluator"))
    evaluator.ReportEval(syncer_pb2.ReportEvalRequest(protocol_version=serde.PROTOCOL_VERSION, heldout_loss=2.5),
                         timeout=5)
    assert _state_call(evaluator).state.evals[-1].heldout_loss == 2.5
    return operator


def _assert_no_identity_is_unauthenticated(h: Harness, pki) -> None:
    """A certificate from our CA that carries no ddiloco identity: UNAUTHENTICATED."""
    nobody = _syncer_stub(h.address, client_security(pki, "nobody"))
    assert code_of(lambda: _state_call(nobody)) == UNAUTH
    assert h.state().auth_failures["no_identity"] == 1


def _assert_handshake_failures(h: Harness, pki, tmp_path) -> None:
    """Handshake failures: nothing reaches the service (UNAVAILABLE on the client)."""
    for name, sec in {
        "no client certificate": client_security(pki, None),
        "another CA": client_security(pki, "rogue"),
        "expired": client_security(pki, "expired"),
        "plaintext": security.ClientSecurity(insecure=True),
    }.items():
        stub = _syncer_stub(h.address, sec)
        assert code_of(lambda s=stub: s.Join(syncer_pb2.JoinRequest(
            protocol_version=serde.PROTOCOL_VERSION, learner_id="learner-0", incarnation=9), timeout=3)) \
            == grpc.StatusCode.UNAVAILABLE, name
    # A client that does not trust the server's CA refuses it too.
    shutil.copy(pki / "rogue.pem", tmp_path / "wrong-ca.pem")
    distrust = security.ClientSecurity(tls_ca=str(tmp_path / "wrong-ca.pem"), tls_cert=str(pki / "learner-0.pem"),
                                       tls_key=str(pki / "learner-0.key"))
    assert code_of(lambda: _state_call(_syncer_stub(h.address, distrust), 3)) == grpc.StatusCode.UNAVAILABLE
    # learner-0's life is still incarnation 1 (the handshake-failed Join with 9 never arrived).
    assert next(m for m in h.state().members if m.learner_id == "learner-0").incarnation == 1


def _assert_health_open_on_its_port_only(h: Harness) -> None:
    """Health: on the main port only with a certificate; on the health port for anyone."""
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(h.handle.health_address))
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    assert health.Check(health_pb2.HealthCheckRequest(service="ddiloco.v1.Syncer"), timeout=5).status \
        == health_pb2.HealthCheckResponse.SERVING
    plain_health = health_pb2_grpc.HealthStub(grpc.insecure_channel(h.address))
    assert code_of(lambda: plain_health.Check(health_pb2.HealthCheckRequest(), timeout=3)) \
        == grpc.StatusCode.UNAVAILABLE


def test_checkpoint_store_only_lets_the_syncer_write(tmp_path, pki):
    with Harness(tmp_path, mode="mtls", pki=pki) as h:
        _prime(h, client_security(pki, "learner-0")).close()  # the syncer's own certificate writes
        committed = h.committed()
        assert len(committed) == 1

        def store(name):
            return checkpoint_pb2_grpc.CheckpointStoreStub(
                channel_lib.sync_channel(h.store_address, client_security(pki, name)))

        put = [checkpoint_pb2.PutBlobRequest(header=checkpoint_pb2.BlobHeader(
            digest="0" * 64, size_bytes=1)), checkpoint_pb2.PutBlobRequest(chunk=checkpoint_pb2.BlobChunk(data=b"x"))]
        latest = checkpoint_pb2.GetLatestManifestRequest(run_id="security")
        learner, operator = store("learner-0"), store("operator")
        assert code_of(lambda: learner.GetLatestManifest(latest, timeout=5)) == DENIED
        assert code_of(lambda: learner.PutBlob(iter(put), timeout=5)) == DENIED
        assert code_of(lambda: operator.PutBlob(iter(put), timeout=5)) == DENIED
        assert code_of(lambda: operator.CommitManifest(checkpoint_pb2.CommitManifestRequest(
            manifest=checkpoint_pb2.Manifest(run_id="security", step=99)), timeout=5)) == DENIED
        restore = checkpoint_pb2.RestoreManifestRequest(manifest=checkpoint_pb2.Manifest(run_id="security", step=0))
        assert code_of(lambda: operator.RestoreManifest(restore, timeout=5)) == DENIED  # repair writes too
        assert code_of(lambda: learner.RestoreManifest(restore, timeout=5)) == DENIED
        held = operator.GetLatestManifest(latest, timeout=5).manifest
        again = store("syncer").RestoreManifest(checkpoint_pb2.RestoreManifestRequest(manifest=held), timeout=5)
        assert (again.restored, again.retained) == (False, True)  # the syncer may; it held it already
        assert operator.GetLatestManifest(latest, timeout=5).manifest.step == committed[0][0]  # readers read
        # The merge ledger: only the syncer appends; readers read it, learners do not.
        append = checkpoint_pb2.AppendLedgerRequest(run_id="security", lines=['{"prev":"' + "0" * 64 + '"}'])
        head = checkpoint_pb2.GetLedgerHeadRequest(run_id="security")
        assert code_of(lambda: operator.AppendLedger(append, timeout=5)) == DENIED
        assert code_of(lambda: learner.GetLedgerHead(head, timeout=5)) == DENIED
        assert operator.GetLedgerHead(head, timeout=5).head == store("syncer").GetLedgerHead(head, timeout=5).head
        assert code_of(lambda: store("rogue").GetLatestManifest(latest, timeout=3)) == grpc.StatusCode.UNAVAILABLE
        assert h.committed() == committed
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(h.store_handle.health_address))
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING


def test_bearer_tokens_unknown_missing_and_revoked(tmp_path, pki):
    keys = tmp_path / "keys"
    shutil.copytree(pki, keys)  # this test rewrites tokens.json
    with Harness(tmp_path, mode="tokens", pki=keys) as h:
        honest = _prime(h, client_security(keys, None, token="learner-0", tls=False))  # the syncer's token writes
        frozen = h.frozen()
        payload, info = encoded(honest_delta(h.numel(1), 1))
        join = syncer_pb2.JoinRequest(protocol_version=serde.PROTOCOL_VERSION, learner_id="learner-1", incarnation=1)

        nobody = _syncer_stub(h.address, security.ClientSecurity(insecure=True))
        assert code_of(lambda: nobody.Join(join, timeout=5)) == UNAUTH
        (tmp_path / "bad.token").write_text("not-a-token")
        forged = _syncer_stub(h.address, security.ClientSecurity(insecure=True,
                                                                 auth_token_file=str(tmp_path / "bad.token")))
        assert code_of(lambda: forged.Join(join, timeout=5)) == UNAUTH
        basic = nobody.Join.with_call  # a malformed authorization header
        assert code_of(lambda: basic(join, metadata=[("authorization", "Basic bGVhcm5lcg==")], timeout=5)) == UNAUTH
        # learner-0's token acting as learner-1; a reader token reading and not writing.
        impostor = Learner(h.address, "learner-1", sec=client_security(keys, None, token="learner-0", tls=False),
                           join=False)
        assert code_of(lambda: impostor.join()) == DENIED
        reader = _syncer_stub(h.address, client_security(keys, None, token="operator", tls=False))
        assert _state_call(reader).state.outer_steps == 1
        assert code_of(lambda: reader.Join(join, timeout=5)) == DENIED
        # learner-1 with its own token works ...
        me = Learner(h.address, "learner-1", sec=client_security(keys, None, token="learner-1", tls=False))
        # ... until its token is revoked: the file is re-read, and the same token replayed fails.
        table = json.loads((keys / "tokens.json").read_text())
        table["revoked"].append((keys / "learner-1.token").read_text().strip())
        (keys / "tokens.json").write_text(json.dumps(table))
        os.utime(keys / "tokens.json")
        wait_until(lambda: _code_or_none(lambda: me.join()) == UNAUTH, timeout_s=10,
                   what="the revocation to take effect")
        assert code_of(lambda: me.upload(1, 0, payload, info)) == UNAUTH
        # A half-written (unparseable) token file keeps the previous table in force.
        (keys / "tokens.json").write_text("{not json")
        time.sleep(1.2)
        assert code_of(lambda: me.join()) == UNAUTH
        assert _state_call(reader).state.run_id == "security"
        state = h.state()
        assert state.auth_failures["no_credentials"] == 1 and state.auth_failures["invalid_token"] == 2
        assert state.auth_failures["revoked_token"] >= 3 and state.uploads["rejected_revoked_token"] == 1
        assert state.auth_failures["wrong_learner"] == 1 and state.auth_failures["wrong_role"] == 1
        assert h.frozen() == frozen and h.checkpoint() is False
        for learner in (honest, impostor, me):
            learner.close()


def _code_or_none(fn):
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()
    return None


@pytest.mark.parametrize("argv", [
    ["checkpoint", "--root", "ROOT", "--bind", "127.0.0.1:0"],
    ["syncer", "--bind", "127.0.0.1:0"],
    ["learner", "--syncer", "127.0.0.1:1"],
    ["evaluate", "--syncer", "127.0.0.1:1"],
    ["syncer", "--tls-ca", "ca.pem"],
    ["syncer", "--insecure", "--tls-cert", "x.pem"],
    ["learner", "--tls-ca", "ca.pem", "--tls-cert", "x.pem"],
])
def test_services_refuse_to_start_without_an_explicit_transport_choice(argv, tmp_path, monkeypatch, capsys):
    for var in [k for k in os.environ if k.startswith("DDILOCO_")]:
        monkeypatch.delenv(var)
    argv = [str(tmp_path) if a == "ROOT" else a for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        cli_main.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--insecure" in err or "tls" in err, err


def test_missing_certificate_files_are_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("DDILOCO_INSECURE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        cli_main.main(["checkpoint", "--root", str(tmp_path), "--tls-ca", str(tmp_path / "nope.pem"),
                       "--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "k.pem")])
    assert exit_info.value.code == 2 and "cannot read" in capsys.readouterr().err


def test_ddiloco_certs_writes_a_reusable_pki(tmp_path, capsys):
    from cryptography import x509

    out = tmp_path / "certs"
    assert cli_main.main(["certs", "--out", str(out), "--learners", "learner-0,learner-1",
                          "--services", "syncer,checkpoint,evaluator,operator", "--dns-names", "syncer.ns.svc",
                          "--tokens"]) == 0
    ca = (out / "ca.pem").read_bytes()
    for stem, uri in {"learner-1": "spiffe://ddiloco/learner/learner-1", "syncer": "spiffe://ddiloco/syncer/syncer",
                      "operator": "spiffe://ddiloco/reader/operator"}.items():
        cert = x509.load_pem_x509_certificate((out / f"{stem}.pem").read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert uri in san.get_values_for_type(x509.UniformResourceIdentifier)
        assert "localhost" in san.get_values_for_type(x509.DNSName)
        assert str(san.get_values_for_type(x509.IPAddress)[0]) == "127.0.0.1"
        assert (os.stat(out / f"{stem}.key").st_mode & 0o777) == 0o600
    syncer_dns = x509.load_pem_x509_certificate((out / "syncer.pem").read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert "syncer.ns.svc" in syncer_dns and "syncer" in syncer_dns
    tokens = json.loads((out / "tokens.json").read_text())
    assert tokens["tokens"][(out / "learner-0.token").read_text().strip()] == "learner/learner-0"
    # A second run adds a learner, signed by the same CA.
    assert cli_main.main(["certs", "--out", str(out), "--learners", "learner-2", "--services", ""]) == 0
    assert (out / "ca.pem").read_bytes() == ca
    new = x509.load_pem_x509_certificate((out / "learner-2.pem").read_bytes())
    assert new.issuer == x509.load_pem_x509_certificate(ca).subject
    assert security.identity_from_auth_context(
        {"x509_subject_alternative_name": [b"localhost", b"spiffe://ddiloco/learner/learner-2"]}
    ) == security.Identity("learner", "learner-2")
