"""Bearer tokens stored as digests (issue 24, pass-the-hash).

A token file may list a token as `sha256:<hex>` instead of the token itself, so that reading the
file does not reveal the credential. A client must still present the token: the `sha256:<hex>`
string from the file, presented as a bearer token, is an unknown token (UNAUTHENTICATED), whether
the file stores that token as a digest or in plain text. The real token works with either entry.
Checked on the table itself, on an in-process syncer + store (the security harness), and on a
checkpoint store started as its own process with `--auth-tokens-file`, where a token revoked by its
digest while the process runs is refused once the file is re-read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import secrets
import shutil
import time

import grpc
import pytest

from ddiloco.cli import cluster as cluster_lib
from ddiloco.rpc import channel as channel_lib
from ddiloco.rpc import errors, security
from ddiloco.v1 import checkpoint_pb2, checkpoint_pb2_grpc, syncer_pb2, syncer_pb2_grpc
from ddiloco.wire import serde
from tests.security.conftest import Harness, Learner, client_security, code_of, merge_once

pytestmark = pytest.mark.timeout(120)

UNAUTH = grpc.StatusCode.UNAUTHENTICATED


def _digest(token: str) -> str:
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


def _token(keys: pathlib.Path, name: str) -> str:
    return (keys / f"{name}.token").read_text().strip()


def _store_as_digests(keys: pathlib.Path, names: tuple[str, ...]) -> None:
    """Rewrites keys/tokens.json so the tokens of `names` are kept only as `sha256:<hex>`."""
    table = json.loads((keys / "tokens.json").read_text())
    for name in names:
        token = _token(keys, name)
        table["tokens"][_digest(token)] = table["tokens"].pop(token)
    (keys / "tokens.json").write_text(json.dumps(table))


def _stub_with_token(address: str, tmp_path: pathlib.Path, name: str, token: str) -> syncer_pb2_grpc.SyncerStub:
    """A plaintext stub that sends `token` (from a token file, as a real client does)."""
    path = tmp_path / f"{name}.presented"
    path.write_text(token + "\n")
    sec = security.ClientSecurity(insecure=True, auth_token_file=str(path))
    return syncer_pb2_grpc.SyncerStub(channel_lib.sync_channel(address, sec))


def _join(learner_id: str) -> syncer_pb2.JoinRequest:
    return syncer_pb2.JoinRequest(protocol_version=serde.PROTOCOL_VERSION, learner_id=learner_id, incarnation=1,
                                  region="test")


def test_stored_digest_is_not_a_credential_on_a_real_server(tmp_path, pki):
    keys = tmp_path / "keys"
    shutil.copytree(pki, keys)
    # learner-1, the operator (a reader) and the syncer (which writes checkpoints to the store with
    # its token) are stored as digests only; learner-0 stays in plain text.
    _store_as_digests(keys, ("learner-1", "operator", "syncer"))
    table = json.loads((keys / "tokens.json").read_text())
    assert _token(keys, "learner-1") not in table["tokens"] and _digest(_token(keys, "learner-1")) in table["tokens"]
    assert _token(keys, "learner-0") in table["tokens"]

    with Harness(tmp_path, mode="tokens", pki=keys) as h:
        frozen = h.frozen()
        # (a) The digest string, exactly as the file stores it, presented as the bearer token.
        for name in ("learner-1", "operator"):
            stolen = _stub_with_token(h.address, tmp_path, f"{name}-digest", _digest(_token(keys, name)))
            assert code_of(lambda s=stolen: s.Join(_join("learner-1"), timeout=5)) == UNAUTH
            assert code_of(lambda s=stolen: s.GetTrainingState(syncer_pb2.GetTrainingStateRequest(), timeout=5)) == UNAUTH
        # ... in upper case, and for a token the file stores in plain text (whose digest anyone
        # can compute from the file), it is just as unknown.
        upper = "sha256:" + _digest(_token(keys, "learner-1"))[len("sha256:"):].upper()
        stolen = _stub_with_token(h.address, tmp_path, "learner-1-upper", upper)
        assert code_of(lambda: stolen.Join(_join("learner-1"), timeout=5)) == UNAUTH
        stolen = _stub_with_token(h.address, tmp_path, "learner-0-digest", _digest(_token(keys, "learner-0")))
        assert code_of(lambda: stolen.Join(_join("learner-0"), timeout=5)) == UNAUTH
        state = h.state()
        assert state.auth_failures["invalid_token"] == 6
        assert h.frozen() == frozen

        # (b) The real tokens of digest-only entries work: learner-1 joins, the operator reads, and
        # the syncer's own token (digest-only) commits a checkpoint to the store.
        me = Learner(h.address, "learner-1", sec=client_security(keys, None, token="learner-1", tls=False))
        merge_once(h, me)
        assert len(h.committed()) == 1
        reader = syncer_pb2_grpc.SyncerStub(
            channel_lib.sync_channel(h.address, client_security(keys, None, token="operator", tls=False)))
        assert reader.GetTrainingState(syncer_pb2.GetTrainingStateRequest(), timeout=5).state.outer_steps == 1
        # (c) A plain-text entry still works.
        plain = Learner(h.address, "learner-0", sec=client_security(keys, None, token="learner-0", tls=False))
        assert plain.instance
        assert h.state().auth_failures["invalid_token"] == 6
        for learner in (me, plain):
            learner.close()


def test_token_table_hashes_every_presented_credential(tmp_path):
    raw_plain, raw_hashed = "plain-secret-token", "hashed-secret-token"
    revoked_raw = "revoked-secret-token"
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({
        "tokens": {raw_plain: "learner/learner-0", _digest(raw_hashed).upper().replace("SHA256:", "sha256:"):
                   "learner/learner-1", _digest(revoked_raw): "reader/operator"},
        "revoked": [_digest(revoked_raw)],
    }))
    table = security.TokenTable(str(path))
    assert table.lookup(raw_plain) == security.Identity("learner", "learner-0")
    assert table.lookup(raw_hashed) == security.Identity("learner", "learner-1")
    with pytest.raises(errors.Unauthenticated) as info:
        table.lookup(revoked_raw)
    assert info.value.reason == "revoked_token"
    # Every stored or derivable digest, in any case, is refused as a credential.
    for presented in (_digest(raw_plain), _digest(raw_hashed), _digest(raw_hashed).upper(),
                      _digest(raw_hashed)[len("sha256:"):], _digest(revoked_raw)):
        with pytest.raises(errors.Unauthenticated) as info:
            table.lookup(presented)
        assert info.value.reason == "invalid_token"


@pytest.mark.parametrize("entry", ["sha256:", "sha256:abc", "sha256:" + "g" * 64, "sha256:" + "0" * 65])
def test_malformed_digest_entries_are_refused_at_load(tmp_path, entry):
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"tokens": {entry: "learner/learner-0"}, "revoked": []}))
    with pytest.raises(ValueError, match="64 hex digits"):
        security.TokenTable(str(path))
    path.write_text(json.dumps({"tokens": {}, "revoked": [entry]}))
    with pytest.raises(ValueError, match="64 hex digits"):
        security.TokenTable(str(path))


# ------------------------------------------------------------------ a real server process

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
_READY_TIMEOUT_S = 30.0
_EXIT_TIMEOUT_S = 10.0
_RELOAD_TIMEOUT_S = 10.0  # the table re-reads its file within a second of a change


@contextlib.contextmanager
def _store_process(tmp_path: pathlib.Path, tokens_file: pathlib.Path):
    """`python -m services.checkpoint --auth-tokens-file ...` on 127.0.0.1:0; yields its address.

    Started, awaited and stopped by the launcher `ddiloco up` uses (ddiloco.cli.cluster): the ready
    file is this process's own, and the process is stopped by its own PID (SIGTERM, then SIGKILL).
    """
    store = cluster_lib.ServiceProcess(
        name="store", module="services.checkpoint", workdir=tmp_path, env={**os.environ, "PYTHONPATH": str(_REPO_ROOT)},
        args=["--bind", "127.0.0.1:0", "--insecure", "--root", str(tmp_path / "store"),
              "--auth-tokens-file", str(tokens_file), "--ready-file", str(tmp_path / "store.ready.json")])
    store.start()
    try:
        yield store.wait_ready(_READY_TIMEOUT_S)
    finally:
        store.stop(_EXIT_TIMEOUT_S)


def _store_reader(address: str, tmp_path: pathlib.Path, label: str, token: str):
    """A blocking call `() -> GetLatestManifestResponse` on the store, presenting `token`."""
    path = tmp_path / f"{label}.presented"
    path.write_text(token + "\n")
    channel = channel_lib.sync_channel(address, security.ClientSecurity(insecure=True, auth_token_file=str(path)))
    stub = checkpoint_pb2_grpc.CheckpointStoreStub(channel)
    return lambda: stub.GetLatestManifest(checkpoint_pb2.GetLatestManifestRequest(run_id="run"), timeout=5)


def _write_atomically(path: pathlib.Path, table: dict) -> None:
    """Replaces the token file in one step, as an operator's tooling should (no half-written file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(table))
    os.replace(tmp, path)


def test_stored_digest_is_not_a_credential_on_a_store_process(tmp_path):
    """The store started as its own process from the command line (`--auth-tokens-file`): the
    digest strings of its token file are refused, the real tokens read, and revoking a token by its
    digest in the running process's file refuses the real token too."""
    plain, hashed = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    tokens_file = tmp_path / "tokens.json"
    table = {"tokens": {plain: "reader/operator", _digest(hashed): "syncer/syncer"}, "revoked": []}
    _write_atomically(tokens_file, table)

    with _store_process(tmp_path, tokens_file) as address:
        # The digest of either token (the file's own string for `hashed`; computable from the file
        # for `plain`) is an unknown bearer token.
        for label, presented in (("hashed-digest", _digest(hashed)), ("plain-digest", _digest(plain))):
            assert code_of(_store_reader(address, tmp_path, label, presented)) == UNAUTH, label
        # The real tokens work, whichever way the file stores them.
        assert not _store_reader(address, tmp_path, "plain", plain)().found
        real = _store_reader(address, tmp_path, "hashed", hashed)
        assert not real().found

        # Revoked by its digest while the process runs: the re-read file refuses the real token.
        _write_atomically(tokens_file, {**table, "revoked": [_digest(hashed)]})
        deadline = time.monotonic() + _RELOAD_TIMEOUT_S
        while True:
            try:
                real()
            except grpc.RpcError as exc:
                assert exc.code() == UNAUTH and "revoked" in (exc.details() or ""), exc
                break
            assert time.monotonic() < deadline, f"token not revoked within {_RELOAD_TIMEOUT_S} s"
            time.sleep(0.1)
        assert code_of(_store_reader(address, tmp_path, "hashed-digest-2", _digest(hashed))) == UNAUTH
        assert not _store_reader(address, tmp_path, "plain-2", plain)().found
