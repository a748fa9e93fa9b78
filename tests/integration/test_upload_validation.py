"""Scenario 5 against a real syncer process: duplicates, stale bases and malformed fragments.

A duplicate upload is acknowledged and not applied twice; the same key with another payload is
ALREADY_EXISTS; a stale base is FAILED_PRECONDITION; NaN, a wrong size or a bad checksum is
INVALID_ARGUMENT; and the global model stays finite throughout.
"""

from __future__ import annotations

import hashlib
import json
import time

import grpc
import numpy as np
import pytest
import zstandard

from ddiloco.v1 import common_pb2, syncer_pb2, syncer_pb2_grpc
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde
from tests.integration.conftest import TINY, SyncerProbe, wait_until
from tests.integration.test_metrics import scrape, value

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


class _Prober:
    """Speaks the wire protocol directly, so tests can send what a real learner never would."""

    def __init__(self, stub: syncer_pb2_grpc.SyncerStub, learner_id: str) -> None:
        self.stub = stub
        self.learner_id = learner_id
        response = stub.Join(
            syncer_pb2.JoinRequest(protocol_version=serde.PROTOCOL_VERSION, learner_id=learner_id, incarnation=1,
                                   region="test"),
            timeout=10,
        )
        self.config = response.config
        self.instance = response.syncer_instance

    def numel(self, fid: int) -> int:
        return int(self.config.fragments[fid].numel)

    def upload(self, fid: int, base: int, payload: bytes, info: common_pb2.PayloadInfo, *, steps: int = 4,
               protocol_version: int = serde.PROTOCOL_VERSION, instance: str | None = None):
        header = syncer_pb2.UploadHeader(
            protocol_version=protocol_version, learner_id=self.learner_id, incarnation=1, fragment_id=fid,
            base_version=base, syncer_instance=self.instance if instance is None else instance,
            steps=steps, tokens=steps * 512, payload=info,
        )
        messages = [syncer_pb2.UploadFragmentRequest(header=header)] + [
            syncer_pb2.UploadFragmentRequest(chunk=c) for c in serde.payload_chunks(payload, 4096)
        ]
        return self.stub.UploadFragment(iter(messages), timeout=10)

    def encoded(self, values: np.ndarray) -> tuple[bytes, common_pb2.PayloadInfo]:
        enc = codec_lib.encode(values.astype(np.float32), "fp32")
        return enc.payload, serde.payload_info_to_proto(enc)


def _raw_fp32_payload(values: np.ndarray) -> tuple[bytes, common_pb2.PayloadInfo]:
    """An fp32 payload built by hand, bypassing the learner-side NaN check."""
    raw = values.astype("<f4").tobytes()
    payload = zstandard.ZstdCompressor().compress(raw)
    info = common_pb2.PayloadInfo(codec=common_pb2.CODEC_FP32, numel=values.size, raw_size_bytes=len(raw),
                                  payload_size_bytes=len(payload), checksum=hashlib.sha256(payload).digest())
    return payload, info


def _global_fragments(stub, num: int) -> dict[int, np.ndarray]:
    call = stub.WatchFragments(syncer_pb2.WatchFragmentsRequest(protocol_version=serde.PROTOCOL_VERSION), timeout=10)
    out, header, assembler = {}, None, None
    for msg in call:
        if msg.WhichOneof("kind") == "header":
            header, assembler = msg.header, serde.ChunkAssembler(msg.header.payload.payload_size_bytes)
            continue
        assembler.add(msg.chunk)
        if assembler.done:
            out[header.fragment_id] = serde.decode_payload(header.payload, assembler.payload())
            if len(out) == num:
                call.cancel()
                break
    return out


def _code(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code()


def test_duplicates_stale_bases_and_malformed_fragments(cluster):
    # Quarantine off: one prober sends every kind of malformed upload here (tests/security covers it).
    # Rounds open with their first contribution (--round-trigger upload): the prober reports no
    # progress, so the syncer's schedule would never open one; this test is about validation.
    syncer = cluster.start_syncer(run_id="e2e-validation", extra=[*TINY, "--max-staleness-versions", "0",
                                                                   "--quarantine-after", "0",
                                                                   "--round-trigger", "upload"])
    probe = SyncerProbe(syncer.address)
    try:
        a = _Prober(probe.stub, "probe-a")
        rng = np.random.default_rng(0)
        delta = rng.normal(0, 1e-3, a.numel(0))
        payload, info = a.encoded(delta)

        first = a.upload(0, 0, payload, info)
        assert first.result == syncer_pb2.UploadFragmentResponse.RESULT_ACCEPTED
        # K = 1 and probe-a is the only member: the round merges at once into version 1.
        wait_until(lambda: probe.state(0).fragments[0].version == 1, timeout_s=20, what="merge of fragment 0")
        sha_after_first = probe.state(0).fragments[0].params_sha256

        again = a.upload(0, 0, payload, info)  # a retry: acknowledged, never applied twice
        assert again.result == syncer_pb2.UploadFragmentResponse.RESULT_DUPLICATE
        time.sleep(1.0)
        state = probe.state(0)
        assert state.fragments[0].version == 1 and state.fragments[0].params_sha256 == sha_after_first
        assert state.outer_steps == 1 and state.uploads["duplicate"] == 1

        other_payload, other_info = a.encoded(delta * 2)  # same key, different payload
        assert _code(lambda: a.upload(0, 0, other_payload, other_info)) == grpc.StatusCode.ALREADY_EXISTS

        b = _Prober(probe.stub, "probe-b")
        # Fragment 0 is at version 1 and the syncer keeps no older versions: base 0 is stale.
        assert _code(lambda: b.upload(0, 0, payload, info)) == grpc.StatusCode.FAILED_PRECONDITION
        # A base from another syncer life, and an unknown protocol version.
        p1, i1 = b.encoded(rng.normal(0, 1e-3, b.numel(1)))
        assert _code(lambda: b.upload(1, 0, p1, i1, instance="0" * 32)) == grpc.StatusCode.FAILED_PRECONDITION
        assert _code(lambda: b.upload(1, 0, p1, i1, protocol_version=99)) == grpc.StatusCode.FAILED_PRECONDITION

        nan_values = rng.normal(0, 1e-3, b.numel(1))
        nan_values[7] = np.nan
        assert _code(lambda: b.upload(1, 0, *_raw_fp32_payload(nan_values))) == grpc.StatusCode.INVALID_ARGUMENT
        inf_values = rng.normal(0, 1e-3, b.numel(1))
        inf_values[-1] = np.inf
        assert _code(lambda: b.upload(1, 0, *_raw_fp32_payload(inf_values))) == grpc.StatusCode.INVALID_ARGUMENT

        wrong_size = common_pb2.PayloadInfo()
        wrong_size.CopyFrom(i1)
        wrong_size.raw_size_bytes -= 4
        assert _code(lambda: b.upload(1, 0, p1, wrong_size)) == grpc.StatusCode.INVALID_ARGUMENT
        wrong_numel = common_pb2.PayloadInfo()
        wrong_numel.CopyFrom(i1)
        wrong_numel.numel += 1
        assert _code(lambda: b.upload(1, 0, p1, wrong_numel)) == grpc.StatusCode.INVALID_ARGUMENT
        bad_checksum = common_pb2.PayloadInfo()
        bad_checksum.CopyFrom(i1)
        bad_checksum.checksum = hashlib.sha256(b"something else").digest()
        assert _code(lambda: b.upload(1, 0, p1, bad_checksum)) == grpc.StatusCode.INVALID_ARGUMENT
        truncated = p1[: len(p1) // 2]
        assert _code(lambda: b.upload(1, 0, truncated, i1)) == grpc.StatusCode.INVALID_ARGUMENT

        # None of the refused uploads touched the model; a valid one still goes through.
        state = probe.state(0)
        assert state.fragments[1].version == 0 and state.outer_steps == 1
        ok = b.upload(1, 0, p1, i1)
        assert ok.result == syncer_pb2.UploadFragmentResponse.RESULT_ACCEPTED
        wait_until(lambda: probe.state(0).fragments[1].version == 1, timeout_s=20, what="merge of fragment 1")
        rejected = {k: v for k, v in probe.state(0).uploads.items() if k.startswith("rejected_")}
        assert sum(rejected.values()) >= 8, rejected
        for fid, values in _global_fragments(probe.stub, len(a.config.fragments)).items():
            assert np.all(np.isfinite(values)), fid
        # Every refusal is counted by status code (the metrics interceptor) and by reason.
        metrics = scrape(json.loads(syncer.ready_file.read_text())["metrics_address"])
        assert value(metrics, "grpc_server_handled_total", grpc_method="UploadFragment",
                     grpc_code="InvalidArgument") >= 6
        assert value(metrics, "grpc_server_handled_total", grpc_method="UploadFragment", grpc_code="AlreadyExists") == 1
        assert value(metrics, "ddiloco_syncer_uploads_total", result="rejected_nonfinite") >= 2
    finally:
        probe.close()
