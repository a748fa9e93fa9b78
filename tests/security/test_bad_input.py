"""Fault-matrix rows 15-20 (reliability.md §5): bad input, oversize, protocol, replays, staleness.

Each test sends what an honest learner never would to a real syncer (gRPC on 127.0.0.1:0, with a
real checkpoint store) and asserts the status code, the per-reason counter, and that the global
model and the committed checkpoints are unchanged (`Harness.frozen()`).
"""

from __future__ import annotations

import socket
import threading
import time
import tracemalloc

import grpc
import numpy as np
import pytest
import zstandard

from ddiloco.algo import fragments as fragments_lib
from ddiloco.v1 import common_pb2, syncer_pb2
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde
from services.syncer import membership as membership_lib
from tests.security.conftest import (
    CHUNK, Harness, Learner, code_of, encoded, error_of, honest_delta, merge_once, raw_payload, upload_stream,
)
from tests.waits import wait_until

pytestmark = pytest.mark.timeout(120)

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
def primed(tmp_path):
    """A syncer whose fragment 0 merged once (version 1) and was checkpointed; learner-1 attacks.

    Quarantine is off here (test_hostile covers it) so every attack reaches its own check.
    """
    with Harness(tmp_path, core_kwargs={"quarantine_after": 0}) as h:
        honest = Learner(h.address, "learner-0")
        merge_once(h, honest)
        assert len(h.committed()) == 1
        attacker = Learner(h.address, "learner-1")
        try:
            yield h, honest, attacker
        finally:
            honest.close()
            attacker.close()


def _unchanged(h: Harness, before) -> None:
    """The global model and the committed checkpoints are exactly as before; params finite."""
    time.sleep(0.05)  # a wrongly scheduled merge would have started by now
    assert h.frozen() == before
    assert h.checkpoint() is False  # nothing merged since: no new checkpoint to write
    assert h.frozen() == before


def _rejected(h: Harness) -> dict[str, int]:
    return {k: v for k, v in h.state().uploads.items() if k.startswith("rejected_")}


def _member(h: Harness, learner_id: str) -> syncer_pb2.MemberState:
    return next(m for m in h.state().members if m.learner_id == learner_id)


# ----------------------------------------------------------------------------------- row 15


def test_row15_nan_inf_and_bad_scales_are_invalid_argument(primed):
    h, _, a = primed
    before = h.frozen()
    n = h.numel(1)
    cases = []
    for bad in (np.nan, np.inf, -np.inf):
        values = honest_delta(n, 1)
        values[n // 2] = bad
        cases.append(raw_payload(values.astype("<f4").tobytes(), numel=n))
    # int8 with a NaN, an infinite and a negative block scale; and a finite scale so large that
    # level x scale overflows to inf on decoding.
    blocks = -(-n // 128)
    levels = np.full(n, 5, dtype=np.int8).tobytes()
    for scale in (np.nan, np.inf, -1.0, 3e38):
        scales = np.full(blocks, 1e-3, dtype="<f4")
        scales[blocks - 1] = scale
        cases.append(raw_payload(scales.tobytes() + levels, codec=common_pb2.CODEC_INT8, numel=n, block_size=128))
    # bf16 NaN bits.
    bits = np.zeros(n, dtype="<u2")
    bits[3] = 0x7FC0
    cases.append(raw_payload(bits.tobytes(), codec=common_pb2.CODEC_BF16, numel=n))
    for payload, info in cases:
        error = error_of(lambda p=payload, i=info: a.upload(1, 0, p, i))
        assert error.code() == INVALID and "non-finite" in error.details(), error.details()
    assert _rejected(h)["rejected_nonfinite"] == len(cases)
    member = _member(h, "learner-1")
    assert member.rejections["nonfinite"] == len(cases) and member.flags & membership_lib.FLAG_MALFORMED
    _unchanged(h, before)


# ----------------------------------------------------------------------------------- row 16


def test_row16_forged_headers_are_refused_before_any_decompression(primed, monkeypatch):
    h, _, a = primed
    before = h.frozen()
    decoded = []
    real_decode = serde.decode_payload
    monkeypatch.setattr(serde, "decode_payload", lambda *args: decoded.append(1) or real_decode(*args))
    payload, info = encoded(honest_delta(h.numel(1), 1))

    def forged(**fields) -> common_pb2.PayloadInfo:
        out = common_pb2.PayloadInfo()
        out.CopyFrom(info)
        for k, v in fields.items():
            setattr(out, k, v)
        return out

    cases = {
        "numel + 1": (1, forged(numel=info.numel + 1), {}, "size"),
        "numel of the other fragment": (1, forged(numel=h.numel(0), raw_size_bytes=4 * h.numel(0)), {}, "size"),
        "raw size": (1, forged(raw_size_bytes=info.raw_size_bytes - 4), {}, "size"),
        "codec unspecified": (1, forged(codec=common_pb2.CODEC_UNSPECIFIED), {}, "codec"),
        "codec unknown": (1, forged(codec=77), {}, "codec"),
        "int8 block size 0": (1, forged(codec=common_pb2.CODEC_INT8, block_size=0), {}, "size"),
        "int8 block size 2^21": (1, forged(codec=common_pb2.CODEC_INT8, block_size=1 << 21), {}, "size"),
        "payload size 0": (1, forged(payload_size_bytes=0), {}, "size"),
        "short checksum": (1, forged(checksum=b"x" * 31), {}, "checksum"),
        "fragment id P": (2, info, {}, "fragment_id"),
        "fragment id 2^31": (1 << 31, info, {}, "fragment_id"),
        "zero steps": (1, info, {"steps": 0}, "steps"),
    }
    for name, (fid, forged_info, overrides, _reason) in cases.items():
        assert code_of(lambda f=fid, i=forged_info, o=overrides: a.upload(f, 0, payload, i, **o)) == INVALID, name
    assert decoded == []  # every one refused from its header: not a byte decoded or decompressed
    rejected = _rejected(h)
    for reason in ("size", "codec", "checksum", "fragment_id", "steps"):
        assert rejected[f"rejected_{reason}"] == sum(1 for c in cases.values() if c[3] == reason), reason
    _unchanged(h, before)


# ----------------------------------------------------------------------------------- row 17


def _bomb(content_bytes: int) -> bytes:
    """A small zstd frame of zeros that declares `content_bytes` of content (built in pieces)."""
    cobj = zstandard.ZstdCompressor(level=19).compressobj(size=content_bytes)
    piece = bytes(1 << 20)
    out = [cobj.compress(piece) for _ in range(content_bytes >> 20)]
    return b"".join(out) + cobj.flush()


def test_row17_oversized_chunks_extra_bytes_and_zstd_bombs(primed, monkeypatch):
    h, _, a = primed
    before = h.frozen()
    n = h.numel(0)
    good_payload, good_info = encoded(honest_delta(n, 3))
    # A chunk above the 8 MiB message limit: gRPC refuses it (the client's own limit raised).
    big = grpc.insecure_channel(h.address, options=[("grpc.max_send_message_length", 64 << 20)])
    try:
        fat = Learner(h.address, "learner-1", channel=big, join=False)
        fat.instance = a.instance
        msgs = [syncer_pb2.UploadFragmentRequest(header=fat.header(0, 1, good_info)),
                syncer_pb2.UploadFragmentRequest(chunk=common_pb2.PayloadChunk(seq=0, data=bytes(9 << 20), last=True))]
        assert code_of(lambda: fat.upload_messages(msgs)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        big.close()
    # A chunk above the run's chunk size; more bytes than declared; a chunk after the last one.
    assert code_of(lambda: a.upload(0, 1, good_payload, good_info, chunk=CHUNK * 2)) == INVALID
    padded = good_payload + b"\0" * 100
    assert code_of(lambda: a.upload(0, 1, padded, good_info)) == INVALID
    stream = upload_stream(a.header(0, 1, good_info), good_payload)
    stream.append(syncer_pb2.UploadFragmentRequest(chunk=common_pb2.PayloadChunk(seq=len(stream) - 1, data=b"x")))
    assert code_of(lambda: a.upload_messages(stream)) == INVALID
    # A header that declares a payload larger than zstd could ever produce from the fragment.
    oversize = common_pb2.PayloadInfo()
    oversize.CopyFrom(good_info)
    oversize.payload_size_bytes = codec_lib.max_payload_size_bytes(good_info.raw_size_bytes) + 1
    assert code_of(lambda: a.upload(0, 1, good_payload, oversize)) == INVALID
    # zstd bombs: a 256 MiB frame in a few KiB under honest-looking sizes, and a frame without a
    # declared content size. Both are refused from the frame header: nothing is decompressed.
    decompressions = []

    class CountingDecompressor:
        def __init__(self, *args, **kwargs):
            self._inner = zstandard.ZstdDecompressor(*args, **kwargs)

        def decompress(self, *args, **kwargs):
            decompressions.append(1)
            return self._inner.decompress(*args, **kwargs)

    monkeypatch.setattr(codec_lib.zstandard, "ZstdDecompressor", CountingDecompressor)
    bomb = _bomb(256 << 20)
    assert len(bomb) < 64 * 1024
    bomb_info = common_pb2.PayloadInfo(codec=common_pb2.CODEC_FP32, numel=n, raw_size_bytes=4 * n,
                                       payload_size_bytes=len(bomb), checksum=__import__("hashlib").sha256(bomb).digest())
    bomb_stream = upload_stream(a.header(0, 1, bomb_info), bomb)
    tracemalloc.start()  # Python allocations in this process (client and syncer) while refusing it
    try:
        started = time.monotonic()
        error = error_of(lambda: a.upload_messages(bomb_stream))
        elapsed_s = time.monotonic() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert error.code() == INVALID and "content size 268435456" in error.details(), error.details()
    assert peak < 2 * 4 * n, f"peak Python allocations {peak} B while refusing a bomb (fragment {4 * n} B)"
    assert elapsed_s < 5.0
    no_size, no_size_info = raw_payload(honest_delta(n, 4).tobytes(), numel=n, content_size=False)
    error = error_of(lambda: a.upload(0, 1, no_size, no_size_info))
    assert error.code() == INVALID and "content size unknown" in error.details(), error.details()
    assert decompressions == []
    assert _rejected(h)["rejected_size"] >= 3
    _unchanged(h, before)


def test_row17_concurrent_and_stalled_uploads_are_bounded(tmp_path):
    """Per-learner concurrency limit (RESOURCE_EXHAUSTED), the total limit (an upload beyond it
    waits for a slot and is refused with RESOURCE_EXHAUSTED only when its deadline comes first:
    back-pressure, not refusal for load), and a stream that never sends its last chunk is cut by
    the idle timeout: memory stays bounded."""
    with Harness(tmp_path, servicer_kwargs={"max_concurrent_uploads": 3, "max_concurrent_uploads_per_learner": 2,
                                            "upload_idle_timeout_s": 4.0}) as h:
        learners = [Learner(h.address, f"learner-{i}") for i in range(3)]
        before = h.frozen()
        payload, info = encoded(honest_delta(h.numel(0), 5))
        release = threading.Event()

        def half_open(learner):
            header = learner.header(0, 0, info)

            def requests():
                yield syncer_pb2.UploadFragmentRequest(header=header)
                yield syncer_pb2.UploadFragmentRequest(chunk=common_pb2.PayloadChunk(seq=0, data=payload[:100]))
                release.wait(10)  # never sends the rest

            return learner.stub.UploadFragment.future(requests(), timeout=20)

        held = [half_open(learners[0]), half_open(learners[0])]
        wait_until(lambda: h.call(lambda: dict(h.servicer._in_flight)).get("learner-0") == 2, timeout_s=10,
                   what="two uploads in flight", interval_s=0.02)
        # learner-0 is at its own limit; learner-1 can still upload, but then the total is at 3.
        assert code_of(lambda: learners[0].upload(0, 0, payload, info)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        held.append(half_open(learners[1]))
        wait_until(lambda: sum(h.call(lambda: dict(h.servicer._in_flight)).values()) == 3, timeout_s=10,
                   what="three uploads in flight", interval_s=0.02)
        # A 3 s deadline: the slot wait ends 2 s before it (the servicer's margin), long before the
        # held streams' idle timeout would free a slot.
        waited = time.monotonic()
        assert code_of(lambda: learners[2].upload_messages(upload_stream(learners[2].header(0, 0, info), payload),
                                                           timeout_s=3.0)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert time.monotonic() - waited < 3.0
        # Nobody sends anything more: the idle timeout ends every held stream.
        started = time.monotonic()
        for future in held:
            with pytest.raises(grpc.RpcError) as err:
                future.result(timeout=10)
            assert err.value.code() == INVALID and "stalled" in err.value.details()
        assert time.monotonic() - started < 10.0
        release.set()
        rejected = _rejected(h)
        assert rejected["rejected_busy"] == 1 and rejected["rejected_busy_learner"] == 1
        assert h.call(lambda: dict(h.servicer._in_flight)) == {}  # nothing left buffered
        assert h.frozen() == before
        # The slots are free again.
        assert learners[2].upload(0, 0, payload, info).result == syncer_pb2.UploadFragmentResponse.RESULT_ACCEPTED
        for learner in learners:
            learner.close()


def test_row17_http2_garbage_on_the_port_does_not_hurt_the_syncer(primed):
    h, _, a = primed
    before = h.frozen()
    host, port = h.address.rsplit(":", 1)
    for garbage in (b"\x00" * 64, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(range(256)) * 8, b"GET / HTTP/1.1\r\n\r\n"):
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(garbage)
            sock.settimeout(2)
            try:
                sock.recv(4096)
            except (socket.timeout, ConnectionError):
                pass
    assert h.frozen() == before
    payload, info = encoded(honest_delta(h.numel(1), 6))
    assert a.upload(1, 0, payload, info).result == syncer_pb2.UploadFragmentResponse.RESULT_ACCEPTED


# ----------------------------------------------------------------------------------- row 18


def test_row18_unknown_protocol_version_is_failed_precondition_with_supported_versions(primed):
    h, _, a = primed
    before = h.frozen()
    payload, info = encoded(honest_delta(h.numel(1), 7))
    calls = {
        "Join": lambda: a.join(protocol_version=999),
        "ReportProgress": lambda: a.stub.ReportProgress(syncer_pb2.ReportProgressRequest(
            protocol_version=999, learner_id="learner-1", incarnation=1), timeout=5),
        "UploadFragment": lambda: a.upload(1, 0, payload, info, protocol_version=999),
        "WatchFragments": lambda: list(a.stub.WatchFragments(syncer_pb2.WatchFragmentsRequest(
            protocol_version=999, learner_id="learner-1", incarnation=1), timeout=5)),
        "ReportEval": lambda: a.stub.ReportEval(syncer_pb2.ReportEvalRequest(protocol_version=999, heldout_loss=1.0),
                                                timeout=5),
        "Leave": lambda: a.stub.Leave(syncer_pb2.LeaveRequest(protocol_version=999, learner_id="learner-1",
                                                              incarnation=1), timeout=5),
    }
    for name, call in calls.items():
        error = error_of(call)
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, name
        assert f"[{serde.PROTOCOL_VERSION}]" in error.details(), (name, error.details())
    assert _rejected(h)["rejected_protocol_version"] == 1
    assert _member(h, "learner-1").status == syncer_pb2.MemberState.STATUS_ACTIVE  # the bad Leave did nothing
    _unchanged(h, before)


# ----------------------------------------------------------------------------------- row 19


def test_row19_replays_duplicates_and_chunk_order(primed):
    h, honest, a = primed
    # The honest learner retries its (already merged) upload: acknowledged, never applied twice.
    payload, info = encoded(honest_delta(h.numel(0), 0))
    before = h.frozen()
    again = honest.upload(0, 0, payload, info)
    assert again.result == syncer_pb2.UploadFragmentResponse.RESULT_DUPLICATE
    assert h.state().uploads["duplicate"] == 1
    _unchanged(h, before)
    # The same key with another payload: ALREADY_EXISTS, and the learner is flagged.
    other_payload, other_info = encoded(honest_delta(h.numel(0), 99))
    assert code_of(lambda: honest.upload(0, 0, other_payload, other_info)) == grpc.StatusCode.ALREADY_EXISTS
    member = _member(h, "learner-0")
    assert member.flags & membership_lib.FLAG_REPLAY_MISMATCH and member.rejections["replay_mismatch"] == 1
    assert _rejected(h)["rejected_replay_mismatch"] == 1
    # Another learner replaying learner-0's upload under its own name is just a new contribution;
    # under learner-0's name (no credentials here) it is learner-0's duplicate: never applied twice.
    replay = Learner(h.address, "learner-0", join=False)
    replay.instance = honest.instance
    assert replay.upload(0, 0, payload, info).result == syncer_pb2.UploadFragmentResponse.RESULT_DUPLICATE
    replay.close()
    _unchanged(h, before)
    # Chunk order: a repeated seq, a gap, a reordering, an empty middle chunk.
    p1, i1 = encoded(honest_delta(h.numel(0), 8))
    chunks = list(serde.payload_chunks(p1, CHUNK))
    assert len(chunks) >= 3
    header = syncer_pb2.UploadFragmentRequest(header=a.header(0, 1, i1))
    bad_orders = {
        "repeat": [chunks[0], chunks[0], *chunks[1:]],
        "gap": [chunks[0], *chunks[2:]],
        "reorder": [chunks[1], chunks[0], *chunks[2:]],
        "empty": [chunks[0], common_pb2.PayloadChunk(seq=1, data=b""), *chunks[1:]],
        "truncated": chunks[:-1],
        "second header": None,
    }
    for name, order in bad_orders.items():
        if order is None:
            msgs = [header, header]
        else:
            msgs = [header] + [syncer_pb2.UploadFragmentRequest(chunk=c) for c in order]
        assert code_of(lambda m=msgs: a.upload_messages(m)) == INVALID, name
    assert _rejected(h)["rejected_chunks"] == len(bad_orders)
    _unchanged(h, before)
    # The well-ordered stream still goes through afterwards.
    assert a.upload(0, 1, p1, i1).result == syncer_pb2.UploadFragmentResponse.RESULT_ACCEPTED


# ----------------------------------------------------------------------------------- row 20


def test_row20_fenced_stale_and_foreign_bases_then_the_learner_resyncs(tmp_path):
    with Harness(tmp_path, max_staleness=0, core_kwargs={"quarantine_after": 0}) as h:
        honest = Learner(h.address, "learner-0")
        merge_once(h, honest)
        before = h.frozen()
        old = Learner(h.address, "learner-1", incarnation=5)
        new = Learner(h.address, "learner-1", incarnation=6)  # a restart fences incarnation 5
        p1, i1 = encoded(honest_delta(h.numel(1), 1))
        error = error_of(lambda: old.upload(1, 0, p1, i1))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "fenced" in error.details()
        assert code_of(lambda: old.join(incarnation=4)) == grpc.StatusCode.FAILED_PRECONDITION
        # Fragment 0 is at version 1 and no older versions are kept: base 0 is too stale.
        p0, i0 = encoded(honest_delta(h.numel(0), 2))
        error = error_of(lambda: new.upload(0, 0, p0, i0))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "stale" in error.details()
        # A base from another syncer life, and a learner that never joined.
        assert code_of(lambda: new.upload(1, 0, p1, i1, syncer_instance="0" * 32)) == grpc.StatusCode.FAILED_PRECONDITION
        stranger = Learner(h.address, "learner-9", join=False)
        stranger.instance = new.instance
        assert code_of(lambda: stranger.upload(1, 0, p1, i1)) == grpc.StatusCode.FAILED_PRECONDITION
        rejected = _rejected(h)
        assert rejected["rejected_fenced"] == 1 and rejected["rejected_stale"] == 2
        assert rejected["rejected_not_joined"] == 1
        _unchanged(h, before)
        # The refused learner pulls the fresh parameters and contributes against them.
        call = new.stub.WatchFragments(syncer_pb2.WatchFragmentsRequest(
            protocol_version=serde.PROTOCOL_VERSION, learner_id="learner-1", incarnation=6), timeout=10)
        got, header, assembler = {}, None, None
        for msg in call:
            if msg.WhichOneof("kind") in ("receipt", "round_call"):
                continue
            if msg.WhichOneof("kind") == "header":
                header, assembler = msg.header, serde.ChunkAssembler(msg.header.payload.payload_size_bytes)
                continue
            assembler.add(msg.chunk)
            if assembler.done:
                got[header.fragment_id] = (header.version, fragments_lib.fragment_sha256(
                    serde.decode_payload(header.payload, assembler.payload())))
                if len(got) == 2:
                    call.cancel()
                    break
        assert got == h.published()
        assert new.upload(0, 1, p0, i0).result == syncer_pb2.UploadFragmentResponse.RESULT_ACCEPTED
        for learner in (honest, old, new, stranger):
            learner.close()


# ------------------------------------------------------------------------ checkpoint store


def test_checkpoint_store_refuses_mismatched_writes_and_never_serves_corrupt_bytes(primed):
    """Writes must hash to their declared digest; every read is verified (DATA_LOSS otherwise)."""
    import hashlib

    from ddiloco.rpc import channel as channel_lib
    from ddiloco.v1 import checkpoint_pb2, checkpoint_pb2_grpc

    h, _, _ = primed
    committed = h.committed()
    stub = checkpoint_pb2_grpc.CheckpointStoreStub(channel_lib.sync_channel(h.store_address))
    data = b"not what the header says"

    def put(digest: str, size: int, body: bytes):
        return stub.PutBlob(iter([
            checkpoint_pb2.PutBlobRequest(header=checkpoint_pb2.BlobHeader(digest=digest, size_bytes=size)),
            checkpoint_pb2.PutBlobRequest(chunk=checkpoint_pb2.BlobChunk(seq=0, data=body)),
        ]), timeout=5)

    lie = hashlib.sha256(b"something else").hexdigest()
    assert code_of(lambda: put(lie, len(data), data)) == INVALID
    assert code_of(lambda: put(hashlib.sha256(data).hexdigest(), len(data) - 1, data)) == INVALID
    assert lie not in h.store.stat([lie])
    # Flip one byte of a committed blob on disk: reading it is DATA_LOSS, never the bytes.
    _, blobs = committed[-1]
    digest = dict(blobs)["fragment/0"]
    path = next(p for p in (h.root / "store").rglob(digest) if p.is_file())
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.chmod(0o644)
    path.write_bytes(bytes(raw))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.GetBlob(checkpoint_pb2.GetBlobRequest(digest=digest), timeout=5))
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert h.committed() == committed
