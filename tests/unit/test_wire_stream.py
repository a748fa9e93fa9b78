"""The payload formats and the chunk-by-chunk decoder (ddiloco.wire.stream).

Raw payloads where zstd would not pay, xxh3-128 checksums, the original format (zstd + sha256)
still read, and a payload checked and dequantized as its chunks arrive: the same values as
`codec.decode`, each piece decoded before the last chunk, and a corrupted chunk refused with
nothing returned.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import zstandard

from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import robust as robust_lib
from ddiloco.v1 import common_pb2, syncer_pb2
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde
from ddiloco.wire import stream as stream_lib

CHUNK_BYTES = 64 * 1024


def _values(numel: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(numel) * 1e-3).astype(np.float32)


def _stream(encoded: codec_lib.EncodedPayload, **kwargs):
    return serde.payload_stream(serde.payload_info_to_proto(encoded), **kwargs)


def _feed_all(stream, payload: bytes) -> None:
    for chunk in codec_lib.chunk_payload(payload, CHUNK_BYTES):
        stream.feed(chunk)


def test_int4_levels_go_raw_with_an_xxh3_checksum_and_compressible_bytes_keep_zstd():
    # Quantized pseudo-gradients hardly compress (int4: ~1.19x, bench/results/perf.md): sent raw.
    int4 = codec_lib.encode(_values(1 << 20), "int4")
    assert int4.compression == "none" and len(int4.payload) == int4.raw_size_bytes
    assert int4.checksum_kind == "xxh3_128" and len(int4.checksum) == 16
    # Values on a coarse grid compress well: zstd stays.
    coarse = np.round(_values(1 << 20) * 1e3).astype(np.float32)
    fp32 = codec_lib.encode(coarse, "fp32")
    assert fp32.compression == "zstd" and len(fp32.payload) * codec_lib.MIN_ZSTD_RATIO <= fp32.raw_size_bytes
    info = serde.payload_info_to_proto(int4)
    assert info.compression == common_pb2.COMPRESSION_NONE and info.checksum_kind == common_pb2.CHECKSUM_XXH3_128


@pytest.mark.parametrize("codec", codec_lib.CODECS)
@pytest.mark.parametrize("numel", [1, 1000, 300_001])
def test_the_skipped_compression_path_round_trips_exactly(codec, numel):
    values = _values(numel)
    raw = codec_lib.encode(values, codec, compression="none")
    framed = codec_lib.encode(values, codec, compression="zstd", checksum_kind="sha256")  # the original format
    assert raw.compression == "none" and framed.compression == "zstd"
    expected = codec_lib.decode(framed.payload, codec=codec, numel=numel, raw_size_bytes=framed.raw_size_bytes,
                                checksum=framed.checksum, compression="zstd", checksum_kind="sha256")
    got = serde.decode_payload(serde.payload_info_to_proto(raw), raw.payload)
    assert got.tobytes() == expected.tobytes()
    for encoded in (raw, framed):  # streamed, both formats give the same values
        stream = _stream(encoded)
        _feed_all(stream, encoded.payload)
        assert stream.finish().tobytes() == expected.tobytes()


def test_the_original_format_is_still_read_from_a_payload_info_without_the_new_fields():
    values = _values(50_000)
    framed = codec_lib.encode(values, "int4", compression="zstd", checksum_kind="sha256")
    info = serde.payload_info_to_proto(framed)
    old = common_pb2.PayloadInfo(codec=info.codec, numel=info.numel, block_size=info.block_size,
                                 raw_size_bytes=info.raw_size_bytes, payload_size_bytes=info.payload_size_bytes,
                                 checksum=hashlib.sha256(framed.payload).digest())  # fields 7 and 8 unset
    assert serde.wire_format_from_proto(old) == ("zstd", "sha256")
    got = serde.decode_payload(old, framed.payload)
    stream = serde.payload_stream(old)
    _feed_all(stream, framed.payload)
    assert stream.finish().tobytes() == got.tobytes()
    assert zstandard.frame_content_size(framed.payload) == framed.raw_size_bytes


def test_chunks_are_dequantized_as_they_arrive_with_the_same_statistics():
    numel = 1 << 20
    values = _values(numel)
    encoded = codec_lib.encode(values, "int4")
    fragment = fragments_lib.Fragment(fragment_id=0, offset_steps=0, tensors=(
        fragments_lib.TensorSpec("a", (numel // 4,)), fragments_lib.TensorSpec("b", (numel - numel // 4,))))
    reference = _values(numel, seed=1)
    stats = robust_lib.DecodedStats(fragment, reference)
    seen = []

    def visit(start: int, piece: np.ndarray) -> None:
        seen.append((start, piece.size))
        stats.update(start, piece)

    stream = _stream(encoded, on_chunk=visit)
    chunks = codec_lib.chunk_payload(encoded.payload, CHUNK_BYTES)
    for chunk in chunks[:-1]:
        stream.feed(chunk)
    decoded_before_last = sum(n for _, n in seen)
    assert decoded_before_last >= numel - 2 * CHUNK_BYTES * 2  # all but the last chunk's blocks
    stream.feed(chunks[-1])
    got = stream.finish()
    expected = codec_lib.decode(encoded.payload, codec="int4", numel=numel, raw_size_bytes=encoded.raw_size_bytes,
                                checksum=encoded.checksum)
    assert got.tobytes() == expected.tobytes()
    assert sorted(seen) == sorted(set(seen)) and sum(n for _, n in seen) == numel  # each value once
    one_pass = robust_lib.DecodedStats(fragment, reference)
    one_pass.update(0, expected)
    np.testing.assert_allclose(stats.tensor_norms(got), one_pass.tensor_norms(expected), rtol=1e-6)
    assert stats.cosine(got, stats.tensor_norms(got)) == pytest.approx(
        one_pass.cosine(expected, one_pass.tensor_norms(expected)), abs=1e-6)


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_corrupted_chunk_is_refused_and_no_values_come_out(compression):
    encoded = codec_lib.encode(_values(300_000), "int4", compression=compression)
    chunks = codec_lib.chunk_payload(encoded.payload, CHUNK_BYTES)
    corrupt = bytearray(chunks[1])
    corrupt[100] ^= 0x01  # a level nibble flipped: still decodable, only the checksum tells
    stream = _stream(encoded)
    for i, chunk in enumerate(chunks):
        stream.feed(bytes(corrupt) if i == 1 else chunk)
    with pytest.raises(codec_lib.ChecksumError, match="xxh3_128"):
        stream.finish()


def test_declared_sizes_that_cannot_describe_the_payload_are_refused_before_anything_is_stored():
    encoded = codec_lib.encode(_values(10_000), "int4")
    info = serde.payload_info_to_proto(encoded)
    info.payload_size_bytes = info.raw_size_bytes + 1  # a raw payload is exactly its raw bytes
    with pytest.raises(codec_lib.SizeError):
        serde.payload_stream(info)
    info = serde.payload_info_to_proto(encoded)
    info.checksum = b"\x00" * 32  # an xxh3-128 digest is 16 bytes
    with pytest.raises(codec_lib.ChecksumError):
        serde.payload_stream(info)
    stream = _stream(encoded)
    with pytest.raises(codec_lib.SizeError):
        stream.feed(encoded.payload + b"x")


@pytest.mark.parametrize(("size", "chunk_bytes"), [
    (0, 1), (1, 1), (300, 1), (127, 7), (128, 128), (129, 128), (16_383, 128), (16_385, 16_384),
    (300_001, 16_384), (300_001, 512 * 1024), (2**21 + 5, 512 * 1024), (2**21, 2**21)])
def test_chunk_message_sizes_are_the_messages_byte_size(size, chunk_bytes):
    # The servicer and the learner count wire bytes from these (ByteSize() serializes the chunk).
    messages = [syncer_pb2.UploadFragmentRequest(chunk=c) for c in serde.payload_chunks(bytes(size), chunk_bytes)]
    for m in messages:
        assert serde.chunk_message_bytes(m.chunk.seq, len(m.chunk.data), m.chunk.last) == m.ByteSize()
    assert serde.payload_chunks_bytes(size, chunk_bytes) == sum(m.ByteSize() for m in messages)


def test_a_buffer_pool_hands_out_again_only_arrays_nobody_references():
    pool = stream_lib.BufferPool(max_free=1)
    first = pool.take(1000, np.float32)
    first_id = id(first)
    assert id(pool.take(1000, np.float32)) != first_id  # first is referenced here
    view = first[10:20]
    del first
    held = pool.take(1000, np.float32)
    assert id(held) != first_id  # a view keeps it taken
    del view
    assert id(pool.take(1000, np.float32)) == first_id  # nobody references it now
    assert pool.take(1000, np.uint8).dtype == np.uint8  # sizes and dtypes have pools of their own


def test_buffer_pool_keeps_no_array_above_its_byte_bound():
    # Arrays larger than the pool's byte bound are plain arrays, freed once their upload is done
    # (a 1B-parameter shard's ~1 GB fragments must not linger); smaller ones are still reused.
    import weakref

    pool = stream_lib.BufferPool(max_free=1, max_free_bytes=3999)
    big = pool.take(1000, np.float32)  # 4000 bytes
    ref = weakref.ref(big)
    del big
    assert ref() is None
    small = pool.take(999, np.float32)
    small_id = id(small)
    del small
    assert id(pool.take(999, np.float32)) == small_id


def test_streams_sharing_a_buffer_pool_never_write_into_values_still_held():
    pool = stream_lib.BufferPool()
    encoded = [codec_lib.encode(_values(300_000, seed=s), "int4") for s in range(3)]
    expected = [codec_lib.decode(e.payload, codec="int4", numel=e.numel, raw_size_bytes=e.raw_size_bytes,
                                 checksum=e.checksum).tobytes() for e in encoded]
    held = []
    for e in encoded:  # each stream's values are still held when the next one decodes
        stream = _stream(e, buffers=pool)
        _feed_all(stream, e.payload)
        held.append(stream.finish())
        del stream
    assert [v.tobytes() for v in held] == expected
    assert len({id(v) for v in held}) == 3
    # Released values are reused, and a corrupted payload decoded into them leaves nothing behind.
    reused_id = id(held[0])
    held = []
    bad = bytearray(encoded[1].payload)
    bad[len(bad) // 2] ^= 0x01
    stream = _stream(encoded[1], buffers=pool)
    _feed_all(stream, bytes(bad))
    with pytest.raises(codec_lib.ChecksumError):
        stream.finish()
    del stream
    stream = _stream(encoded[2], buffers=pool)
    _feed_all(stream, encoded[2].payload)
    values = stream.finish()
    assert values.tobytes() == expected[2] and id(values) == reused_id
