"""The `model-reader` role (issue 24): the read-only state credential no longer downloads the model.

A `reader` (an operator, a dashboard) reads the training state, checkpoint manifests and blob
stats, and nothing that carries weights: an observer WatchFragments and the store's GetBlob are
PERMISSION_DENIED. A `model-reader` (`ddiloco certs --model-readers exporter`) may download both,
and gets exactly the published model and the committed bytes; it may not take part in training or
write. Checked with mutual TLS and with bearer tokens, on real gRPC servers (the security harness).
"""

from __future__ import annotations

import hashlib
import shutil

import grpc
import pytest

from ddiloco.cli import certs as certs_lib
from ddiloco.rpc import channel as channel_lib
from ddiloco.v1 import checkpoint_pb2, checkpoint_pb2_grpc, syncer_pb2, syncer_pb2_grpc
from ddiloco.wire import serde
from tests.security.conftest import Harness, Learner, client_security, code_of, merge_once

pytestmark = pytest.mark.timeout(120)

DENIED = grpc.StatusCode.PERMISSION_DENIED
RUN_ID = "security"  # the harness's run


@pytest.fixture(scope="module")
def keys(tmp_path_factory, pki):
    """The session PKI plus a model reader, `exporter` (certificate and token), from `ddiloco certs`."""
    d = tmp_path_factory.mktemp("model-reader") / "pki"
    shutil.copytree(pki, d)
    identities = certs_lib.write_dev_certs(d, learners=(), services=(), model_readers=("exporter",), tokens=True)
    assert str(identities["exporter"]) == "model-reader/exporter"
    return d


def _merged(h: Harness, sec) -> None:
    """learner-0 contributes to fragment 0 (version 1) and the syncer commits a checkpoint."""
    learner = Learner(h.address, "learner-0", sec=sec)
    merge_once(h, learner)
    learner.close()


def _download_model(stub: syncer_pb2_grpc.SyncerStub, fragments: int) -> dict[int, tuple[int, str]]:
    """Observes WatchFragments until every fragment arrived: {fragment: (version, sha256 of values)}."""
    call = stub.WatchFragments(syncer_pb2.WatchFragmentsRequest(protocol_version=serde.PROTOCOL_VERSION), timeout=10)
    got: dict[int, tuple[int, str]] = {}
    header, assembler = None, None
    for msg in call:
        kind = msg.WhichOneof("kind")
        if kind == "header":
            header = msg.header
            assembler = serde.ChunkAssembler(header.payload.payload_size_bytes)
        elif kind == "chunk":
            assembler.add(msg.chunk)
            if assembler.done:
                values = serde.decode_payload(header.payload, assembler.payload())
                got[header.fragment_id] = (header.version, serde.params_sha256(values))
                if len(got) == fragments:
                    call.cancel()
                    break
    return got


def _store(h: Harness, sec) -> checkpoint_pb2_grpc.CheckpointStoreStub:
    return checkpoint_pb2_grpc.CheckpointStoreStub(channel_lib.sync_channel(h.store_address, sec))


def _get_blob(store: checkpoint_pb2_grpc.CheckpointStoreStub, digest: str) -> bytes:
    data = b"".join(m.chunk.data for m in store.GetBlob(checkpoint_pb2.GetBlobRequest(digest=digest), timeout=10)
                    if m.WhichOneof("kind") == "chunk")
    assert hashlib.sha256(data).hexdigest() == digest
    return data


def _check_roles(h: Harness, reader_sec, model_reader_sec) -> None:
    committed = h.committed()
    assert len(committed) == 1
    digests = [digest for _name, digest in committed[0][1]]
    published = h.published()

    # The state reader: the training state, manifests and blob stats; not the weights.
    reader = syncer_pb2_grpc.SyncerStub(channel_lib.sync_channel(h.address, reader_sec))
    assert reader.GetTrainingState(syncer_pb2.GetTrainingStateRequest(), timeout=5).state.outer_steps == 1
    state_stream = reader.WatchTrainingState(syncer_pb2.WatchTrainingStateRequest(), timeout=5)
    assert next(iter(state_stream)).state.run_id
    state_stream.cancel()
    assert code_of(lambda: _download_model(reader, 2)) == DENIED
    reader_store = _store(h, reader_sec)
    latest = reader_store.GetLatestManifest(checkpoint_pb2.GetLatestManifestRequest(run_id=RUN_ID), timeout=5)
    assert latest.found and sorted(b.digest for b in latest.manifest.blobs) == sorted(digests)
    assert reader_store.ListManifests(checkpoint_pb2.ListManifestsRequest(run_id=RUN_ID), timeout=5).manifests
    assert sorted(reader_store.StatBlobs(checkpoint_pb2.StatBlobsRequest(digests=digests), timeout=5).present) \
        == sorted(digests)
    for digest in digests:
        error = pytest.raises(grpc.RpcError, _get_blob, reader_store, digest).value
        assert error.code() == DENIED and "GetBlob" in error.details(), error.details()

    # The model reader: everything the reader may, plus the model itself, bit for bit.
    model_reader = syncer_pb2_grpc.SyncerStub(channel_lib.sync_channel(h.address, model_reader_sec))
    assert model_reader.GetTrainingState(syncer_pb2.GetTrainingStateRequest(), timeout=5).state.outer_steps == 1
    assert _download_model(model_reader, 2) == published
    model_store = _store(h, model_reader_sec)
    assert model_store.GetLatestManifest(checkpoint_pb2.GetLatestManifestRequest(run_id=RUN_ID), timeout=5).found
    assert sum(len(_get_blob(model_store, d)) for d in digests) > 4 * h.numel(0)  # fragment 0's float32 values
    # ... and nothing that takes part in training or writes.
    as_learner = Learner(h.address, "exporter", sec=model_reader_sec, join=False)
    assert code_of(lambda: as_learner.join()) == DENIED
    assert code_of(lambda: model_reader.ReportEval(syncer_pb2.ReportEvalRequest(
        protocol_version=serde.PROTOCOL_VERSION, heldout_loss=0.1), timeout=5)) == DENIED
    put = [checkpoint_pb2.PutBlobRequest(header=checkpoint_pb2.BlobHeader(digest="0" * 64, size_bytes=1))]
    assert code_of(lambda: model_store.PutBlob(iter(put), timeout=5)) == DENIED
    assert code_of(lambda: model_store.CommitManifest(checkpoint_pb2.CommitManifestRequest(
        manifest=checkpoint_pb2.Manifest(run_id=RUN_ID, step=99)), timeout=5)) == DENIED
    as_learner.close()
    assert h.committed() == committed


def test_only_model_readers_download_the_model_under_mutual_tls(tmp_path, keys):
    with Harness(tmp_path, mode="mtls", pki=keys) as h:
        _merged(h, client_security(keys, "learner-0"))
        before = h.state().auth_failures["wrong_role"]
        _check_roles(h, client_security(keys, "operator"), client_security(keys, "exporter"))
        # The reader's observer WatchFragments, the model reader's Join and ReportEval (syncer).
        assert h.state().auth_failures["wrong_role"] - before == 3
        # The evaluator still downloads the model it evaluates.
        evaluator = syncer_pb2_grpc.SyncerStub(channel_lib.sync_channel(h.address, client_security(keys, "evaluator")))
        assert _download_model(evaluator, 2) == h.published()


def test_only_model_readers_download_the_model_with_tokens(tmp_path, keys):
    with Harness(tmp_path, mode="tokens", pki=keys) as h:
        _merged(h, client_security(keys, None, token="learner-0", tls=False))
        _check_roles(h, client_security(keys, None, token="operator", tls=False),
                     client_security(keys, None, token="exporter", tls=False))
