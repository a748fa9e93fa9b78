"""Property tests (hypothesis): truncated, bit-flipped and reordered fragments and protocol messages
always end in a clean, typed error (or a valid result), never a crash or a hang.

Layers: the codec (`decode`), the chunk reassembly (`ChunkAssembler`), protobuf parsing plus the
syncer core's header validation, and the whole gRPC path of a running syncer.
"""

from __future__ import annotations

import hashlib

import grpc
import numpy as np
import pytest
from google.protobuf import message as pb_message
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ddiloco.rpc import errors
from ddiloco.v1 import common_pb2, syncer_pb2
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde
from services.syncer import wire_views
from tests.fakes import FakeClock, join, join_request, progress_request
from tests.security.conftest import CHUNK, Harness, Learner, encoded, honest_delta, hostile_core

pytestmark = pytest.mark.timeout(300)

# Generous per-example deadline: the machine is shared; a hang would still be caught.
SETTINGS = settings(max_examples=60, deadline=5000, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def encoded_vectors(draw):
    codec = draw(st.sampled_from(codec_lib.CODECS))
    numel = draw(st.integers(1, 600))
    block = draw(st.sampled_from([1, 7, 32, 128]))
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from([1e-6, 1e-3, 1.0, 1e4]))
    values = (scale * np.random.default_rng(seed).standard_normal(numel)).astype(np.float32)
    return codec_lib.encode(values, codec, block_size=block, zstd_level=1)


def _decode(enc: codec_lib.EncodedPayload, payload: bytes, *, checksum: bytes | None = None, **overrides):
    fields = dict(codec=enc.codec, numel=enc.numel, raw_size_bytes=enc.raw_size_bytes, block_size=enc.block_size)
    fields.update(overrides)
    return codec_lib.decode(payload, checksum=enc.checksum if checksum is None else checksum, **fields)


def _clean(fn, numel: int) -> None:
    """fn() raises CodecError, or returns `numel` finite float32 values."""
    try:
        values = fn()
    except codec_lib.CodecError:
        return
    assert values.dtype == np.float32 and values.shape == (numel,) and np.isfinite(values).all()


@SETTINGS
@given(enc=encoded_vectors(), data=st.data())
def test_truncated_payloads_fail_cleanly(enc, data):
    cut = data.draw(st.integers(0, len(enc.payload) - 1))
    truncated = enc.payload[:cut]
    with pytest.raises(codec_lib.ChecksumError):
        _decode(enc, truncated)
    # An attacker who also recomputes the checksum still only gets a clean error.
    with pytest.raises(codec_lib.CodecError):
        _decode(enc, truncated, checksum=hashlib.sha256(truncated).digest())


@SETTINGS
@given(enc=encoded_vectors(), data=st.data())
def test_bit_flips_fail_cleanly(enc, data):
    flips = data.draw(st.lists(st.integers(0, 8 * len(enc.payload) - 1), min_size=1, max_size=4, unique=True))
    mutated = bytearray(enc.payload)
    for bit in flips:
        mutated[bit // 8] ^= 1 << (bit % 8)
    mutated = bytes(mutated)
    assume(mutated != enc.payload)
    with pytest.raises(codec_lib.ChecksumError):
        _decode(enc, mutated)
    _clean(lambda: _decode(enc, mutated, checksum=hashlib.sha256(mutated).digest()), enc.numel)


@SETTINGS
@given(enc=encoded_vectors(), data=st.data())
def test_forged_descriptions_and_arbitrary_bytes_fail_cleanly(enc, data):
    overrides = data.draw(st.fixed_dictionaries({}, optional={
        "codec": st.sampled_from([*codec_lib.CODECS, "fp8", ""]),
        "numel": st.integers(-2, 2 * enc.numel + 2),
        "raw_size_bytes": st.integers(-2, 4 * enc.numel + 64),
        "block_size": st.integers(-1, 300),
    }))
    _clean(lambda: _decode(enc, enc.payload, **overrides), overrides.get("numel", enc.numel))
    junk = data.draw(st.binary(max_size=2048))
    _clean(lambda: _decode(enc, junk, checksum=hashlib.sha256(junk).digest(), **overrides),
           overrides.get("numel", enc.numel))


@SETTINGS
@given(payload=st.binary(min_size=1, max_size=5000), chunk=st.integers(1, 700), data=st.data())
def test_reordered_duplicated_and_dropped_chunks_never_assemble_wrong_bytes(payload, chunk, data):
    chunks = list(serde.payload_chunks(payload, chunk))
    order = data.draw(st.lists(st.integers(0, len(chunks) - 1), max_size=len(chunks) + 3))
    assembler = serde.ChunkAssembler(len(payload), max_chunk_bytes=chunk)
    try:
        for i in order:
            assembler.add(chunks[i])
        result = assembler.payload()
    except ValueError:
        return
    assert result == payload and order == list(range(len(chunks)))  # only the exact order assembles


def _core():
    core = hostile_core(FakeClock())
    join(core, "learner-0")
    return core


_CORE = None


def _shared_core():
    global _CORE
    if _CORE is None:
        _CORE = _core()
    return _CORE


def _valid_header(core) -> syncer_pb2.UploadFragmentRequest:
    enc = codec_lib.encode(honest_delta(core.plan.fragments[1].numel, 1), "int4")
    return syncer_pb2.UploadFragmentRequest(header=syncer_pb2.UploadHeader(
        protocol_version=serde.PROTOCOL_VERSION, learner_id="learner-0", incarnation=1, fragment_id=1, base_version=0,
        syncer_instance=core.instance, steps=2, tokens=1024, payload=serde.payload_info_to_proto(enc)))


def _mutate(blob: bytes, data) -> bytes:
    kind = data.draw(st.sampled_from(["truncate", "flip", "splice", "random"]))
    if kind == "truncate":
        return blob[: data.draw(st.integers(0, max(0, len(blob) - 1)))]
    if kind == "flip":
        out = bytearray(blob)
        for _ in range(data.draw(st.integers(1, 6))):
            i = data.draw(st.integers(0, len(out) - 1))
            out[i] ^= data.draw(st.integers(1, 255))
        return bytes(out)
    if kind == "splice":
        i = data.draw(st.integers(0, len(blob)))
        return blob[:i] + data.draw(st.binary(max_size=64)) + blob[i:]
    return data.draw(st.binary(max_size=512))


@settings(max_examples=150, deadline=5000, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_protocol_messages_parse_or_fail_and_validate_cleanly(data):
    core = _shared_core()
    for template, check in (
        (_valid_header(core),
         lambda m: m.WhichOneof("kind") == "header"
         and core.validate_upload_header(wire_views.upload_header(m.header))),
        (syncer_pb2.JoinRequest(protocol_version=1, learner_id="learner-0", incarnation=1, region="r"),
         lambda m: join_request(core, m)),
        (syncer_pb2.ReportProgressRequest(protocol_version=1, learner_id="learner-0", incarnation=1, local_step=3,
                                          step_time_s=0.1, inner_loss=2.0),
         lambda m: progress_request(core, m)),
    ):
        blob = _mutate(template.SerializeToString(), data)
        try:
            message = type(template).FromString(blob)
        except pb_message.DecodeError:
            continue
        try:
            check(message)
        except errors.ServiceError:
            pass
    # Whatever was thrown at it, the state is still sane.
    assert all(np.isfinite(s.params).all() for s in core.slots)
    assert all(math_ok(m.step_time_s) for m in core.membership.members.values())


def math_ok(x: float) -> bool:
    return np.isfinite(x) and x >= 0


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with Harness(tmp_path_factory.mktemp("live"), core_kwargs={"quarantine_after": 0}) as h:
        learner = Learner(h.address, "learner-0")
        yield h, learner
        learner.close()


_ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS,
            grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED}


@settings(max_examples=40, deadline=10000, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_upload_streams_against_a_running_syncer(live, data):
    h, learner = live
    fid = data.draw(st.sampled_from([0, 1]))
    version = h.model()[fid][0]
    payload, info = encoded(honest_delta(h.numel(fid), data.draw(st.integers(0, 10**6))),
                            data.draw(st.sampled_from(["fp32", "int8", "int4", "int2"])))
    header = learner.header(fid, version, info)
    messages = [syncer_pb2.UploadFragmentRequest(header=header)] + [
        syncer_pb2.UploadFragmentRequest(chunk=c) for c in serde.payload_chunks(payload, CHUNK)]
    mutation = data.draw(st.sampled_from(["reorder", "drop", "duplicate", "bytes", "header", "chunk_data"]))
    if mutation == "reorder" and len(messages) > 2:
        body = messages[1:]
        messages = [messages[0], *data.draw(st.permutations(body))]
    elif mutation == "drop":
        del messages[data.draw(st.integers(0, len(messages) - 1))]
    elif mutation == "duplicate":
        i = data.draw(st.integers(0, len(messages) - 1))
        messages.insert(i, messages[i])
    elif mutation == "bytes":  # a re-parsed, mutated message anywhere in the stream
        i = data.draw(st.integers(0, len(messages) - 1))
        try:
            messages[i] = syncer_pb2.UploadFragmentRequest.FromString(_mutate(messages[i].SerializeToString(), data))
        except pb_message.DecodeError:
            messages[i] = syncer_pb2.UploadFragmentRequest()
    elif mutation == "header":
        forged = common_pb2.PayloadInfo()
        forged.CopyFrom(info)
        forged.numel = data.draw(st.integers(0, 2**40))
        forged.raw_size_bytes = data.draw(st.integers(0, 2**40))
        forged.payload_size_bytes = data.draw(st.integers(0, 2**40))
        messages[0] = syncer_pb2.UploadFragmentRequest(header=learner.header(fid, version, forged))
    else:  # chunk data changed under a recomputed, consistent checksum
        mutated = _mutate(payload, data)
        forged = common_pb2.PayloadInfo()
        forged.CopyFrom(info)
        forged.payload_size_bytes = len(mutated)
        forged.checksum = hashlib.sha256(mutated).digest()
        messages = [syncer_pb2.UploadFragmentRequest(header=learner.header(fid, version, forged))] + [
            syncer_pb2.UploadFragmentRequest(chunk=c) for c in serde.payload_chunks(mutated, CHUNK)]
    try:
        learner.upload_messages(messages, timeout_s=20)
    except grpc.RpcError as exc:
        assert exc.code() in _ALLOWED, (mutation, exc.code(), exc.details())
    state = h.state()
    assert "rejected_internal" not in state.uploads
    assert h.frozen()[2]  # the global parameters are finite whatever was accepted
