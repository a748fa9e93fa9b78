"""Tests for ddiloco.wire.codec: round trips within the documented bounds, exact layouts, and
every way a received payload can be wrong (flips, truncation, bombs, forged headers)."""

from __future__ import annotations

import hashlib
import io
import struct
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ddiloco.wire import codec as codec_lib
from tests import fakes

_LOSSY = ("bf16", "int8", "int4", "int2")
_BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)



def _finite_vectors(max_size: int = 600, max_abs: float | None = None):
    elements = st.floats(
        width=32,
        allow_nan=False,
        allow_infinity=False,
        min_value=None if max_abs is None else -max_abs,
        max_value=max_abs,
    )
    return hnp.arrays(np.float32, st.integers(0, max_size), elements=elements)


def _decode(encoded: codec_lib.EncodedPayload, **overrides) -> np.ndarray:
    kwargs = {
        "codec": encoded.codec,
        "numel": encoded.numel,
        "raw_size_bytes": encoded.raw_size_bytes,
        "checksum": encoded.checksum,
        "block_size": encoded.block_size,
    }
    return codec_lib.decode(overrides.pop("payload", encoded.payload), **(kwargs | overrides))


def _frame(raw: bytes, **compressor_options) -> tuple[bytes, bytes]:
    """Compresses crafted raw bytes; returns (payload, its correct sha256)."""
    options = {"write_content_size": True} | compressor_options
    payload = zstandard.ZstdCompressor(**options).compress(raw)
    return payload, hashlib.sha256(payload).digest()


def _assert_within_bound(values, decoded, codec: str, block_size: int) -> None:
    x, y = values.astype(np.float64), decoded.astype(np.float64)
    if codec in ("fp32", "bf16"):  # bounds relative to each element are tighter and valid
        bounds = np.array([codec_lib.max_abs_error_bound(codec, abs(v)) for v in x])
    else:
        n_blocks = -(-x.size // block_size)
        padded = np.zeros(n_blocks * block_size)
        padded[: x.size] = np.abs(x)
        absmax = padded.reshape(n_blocks, block_size).max(axis=1)
        per_block = [codec_lib.max_abs_error_bound(codec, a) for a in absmax]
        bounds = np.repeat(per_block, block_size)[: x.size]
    assert (np.abs(x - y) <= bounds).all(), np.max(np.abs(x - y) - bounds)


@settings(max_examples=50, deadline=None)
@given(_finite_vectors(), st.sampled_from(codec_lib.CODECS), st.sampled_from([1, 7, 128]))
def test_round_trip_is_within_the_documented_bound(values, codec, block_size):
    encoded = codec_lib.encode(values, codec, block_size=block_size)

    decoded = _decode(encoded)

    assert decoded.dtype == np.float32 and decoded.shape == values.shape
    assert decoded.flags.writeable
    assert encoded.raw_size_bytes == codec_lib.expected_raw_size_bytes(
        codec, values.size, block_size
    )
    assert len(encoded.payload) <= codec_lib.max_payload_size_bytes(encoded.raw_size_bytes)
    _assert_within_bound(values, decoded, codec, block_size)


@settings(max_examples=50, deadline=None)
@given(hnp.arrays(np.float32, st.integers(0, 300), elements=st.floats(-1e3, 1e3, width=32)))
def test_round_trip_of_ordinary_values(values):
    # The full-range property above rarely mixes magnitudes inside a block; this one does.
    scaled = (values * 10.0 ** (np.arange(values.size) % 7 - 3)).astype(np.float32)
    for codec in codec_lib.CODECS:
        _assert_within_bound(scaled, _decode(codec_lib.encode(scaled, codec)), codec, 128)


@settings(max_examples=50, deadline=None)
@given(_finite_vectors())
def test_fp32_is_bit_exact(values):
    decoded = _decode(codec_lib.encode(values, "fp32"))
    assert decoded.tobytes() == values.tobytes()


@settings(max_examples=50, deadline=None)
@given(_finite_vectors(max_abs=_BF16_MAX))
def test_bf16_rounds_to_nearest_even(values):
    decoded = _decode(codec_lib.encode(values, "bf16"))
    expected = values.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert decoded.tobytes() == expected.tobytes()


@pytest.mark.parametrize("codec", _LOSSY)
def test_extreme_values_stay_finite(codec):
    biggest = np.finfo(np.float32).max
    values = np.array([biggest, -biggest, 1e-45, 0.0, 3.0e38], dtype=np.float32)

    decoded = _decode(codec_lib.encode(values, codec))

    assert np.isfinite(decoded).all()
    _assert_within_bound(values, decoded, codec, codec_lib.DEFAULT_BLOCK_SIZE)


def test_int8_raw_layout():
    values = np.array([127.0, -64.0, 0.0, 0.0], dtype=np.float32)

    encoded = codec_lib.encode(values, "int8", block_size=2)
    raw = fakes.serialized(encoded)

    assert raw == struct.pack("<2f", 1.0, 0.0) + bytes([127, 0xC0, 0, 0])
    np.testing.assert_array_equal(_decode(encoded), values)


def test_int4_packs_two_levels_per_byte_low_nibble_first():
    values = np.array([7.0, -7.0, 3.0], dtype=np.float32)

    encoded = codec_lib.encode(values, "int4")
    raw = fakes.serialized(encoded)

    # levels 7, -7, 3 stored +8 -> nibbles 15, 1, 11, and the odd length padded with 8.
    assert raw == struct.pack("<f", 1.0) + bytes([0x1F, 0x8B])
    np.testing.assert_array_equal(_decode(encoded), values)


def test_int2_packs_four_levels_per_byte_lowest_bits_first():
    # Scale 1: levels -3, -1, 1, 3 are codes 0..3; 0.0 takes code 2 (level +1), 2.0 is a tie
    # between the steps and goes up (floor of x / 2 plus 2).
    values = np.array([3.0, -3.0, -1.0, 1.0, 0.4, -0.6, 2.0], dtype=np.float32)

    encoded = codec_lib.encode(values, "int2")
    raw = fakes.serialized(encoded)

    first = 3 | 0 << 2 | 1 << 4 | 2 << 6
    second = 2 | 1 << 2 | 3 << 4 | 2 << 6  # the tail is padded with the code of 0.0
    assert raw == struct.pack("<f", 1.0) + bytes([first, second])
    np.testing.assert_array_equal(_decode(encoded), [3.0, -3.0, -1.0, 1.0, 1.0, -1.0, 3.0])


def test_int2_error_is_at_most_a_third_of_the_block_absmax():
    values = np.random.default_rng(5).standard_normal(1 << 14).astype(np.float32)

    decoded = _decode(codec_lib.encode(values, "int2"))

    absmax = np.abs(values.reshape(-1, 128)).max(axis=1)
    err = np.abs(decoded - values).reshape(-1, 128).max(axis=1)
    assert (err <= absmax / 3 * (1 + 1e-6)).all()
    # ... and the bound is nearly reached: it is the real worst case, not a loose one.
    assert (err / absmax).max() > 0.3
    assert set(np.unique(np.rint(decoded.reshape(-1, 128) / (absmax[:, None] / 3)))) == {-3, -1, 1, 3}


@pytest.mark.parametrize("block_size", [0, codec_lib.MAX_BLOCK_SIZE + 1])
def test_block_sizes_outside_the_range_are_refused(block_size):
    with pytest.raises(codec_lib.CodecError, match="block_size"):
        codec_lib.encode(np.ones(4, np.float32), "int2", block_size=block_size)


@pytest.mark.parametrize("codec", codec_lib.QUANTIZED_CODECS)
@pytest.mark.parametrize("numel", [1, 3, 5, 127, 129, 255, 257, 70001])
@pytest.mark.parametrize("block_size", [1, 3, 7, 128, 1000])
def test_quantized_codecs_round_trip_any_length(codec, numel, block_size):
    # Lengths and block sizes that do and do not fill whole chunks, blocks and bytes.
    values = np.random.default_rng(numel).standard_normal(numel).astype(np.float32)

    encoded = codec_lib.encode(values, codec, block_size=block_size)

    assert encoded.raw_size_bytes == codec_lib.expected_raw_size_bytes(codec, numel, block_size)
    _assert_within_bound(values, _decode(encoded), codec, block_size)


@pytest.mark.parametrize("numel", [1, 3, 127, 129, 255, 257])
@pytest.mark.parametrize("block_size", [1, 3, 128])
def test_int4_odd_and_even_lengths_round_trip(numel, block_size):
    values = np.random.default_rng(numel).standard_normal(numel).astype(np.float32)

    encoded = codec_lib.encode(values, "int4", block_size=block_size)

    assert encoded.raw_size_bytes == 4 * -(-numel // block_size) + (numel + 1) // 2
    _assert_within_bound(values, _decode(encoded), "int4", block_size)


@pytest.mark.parametrize("codec", codec_lib.QUANTIZED_CODECS)
def test_a_block_of_zeros_has_scale_zero(codec):
    values = np.concatenate([np.zeros(4), np.ones(4)]).astype(np.float32)

    encoded = codec_lib.encode(values, codec, block_size=4)
    raw = fakes.serialized(encoded)

    zero_scale, ones_scale = struct.unpack_from("<2f", raw)
    assert zero_scale == 0.0
    assert ones_scale == pytest.approx(1.0 / {"int8": 127, "int4": 7, "int2": 3}[codec], rel=1e-6)
    decoded = _decode(encoded)
    np.testing.assert_array_equal(decoded[:4], 0.0)
    np.testing.assert_allclose(decoded[4:], 1.0, rtol=1e-6)


def test_empty_vectors_round_trip():
    for codec in codec_lib.CODECS:
        encoded = codec_lib.encode(np.zeros(0, np.float32), codec)
        assert encoded.raw_size_bytes == 0
        assert _decode(encoded).shape == (0,)


@pytest.mark.parametrize("codec", codec_lib.CODECS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused_before_quantizing(codec, bad, monkeypatch):
    def must_not_run(*args):
        raise AssertionError("quantized a vector with non-finite values")

    monkeypatch.setattr(codec_lib, "_serialize", must_not_run)
    values = np.array([1.0, bad, 2.0], dtype=np.float32)

    with pytest.raises(codec_lib.NonFiniteError, match="first at index 1"):
        codec_lib.encode(values, codec)


@pytest.mark.parametrize(
    ("values", "codec", "options", "match"),
    [
        (np.zeros(3, np.float32), "fp16", {}, "codec='fp16'"),
        (np.zeros(3, np.float32), "int8", {"block_size": 0}, "block_size=0"),
        (np.zeros(3, np.float64), "fp32", {}, r"float64\[3\]"),
        (np.zeros((2, 2), np.float32), "fp32", {}, r"float32\[2, 2\]"),
        (np.zeros(3, np.float32), "fp32", {"zstd_level": 23}, "zstd_level=23"),
    ],
)
def test_encode_rejects_bad_arguments(values, codec, options, match):
    with pytest.raises(codec_lib.CodecError, match=match):
        codec_lib.encode(values, codec, **options)


def test_block_size_is_ignored_by_unquantized_codecs():
    encoded = codec_lib.encode(np.ones(5, np.float32), "bf16", block_size=0)
    np.testing.assert_array_equal(_decode(encoded), 1.0)


def _each_byte_flipped(payload: bytes):
    """`payload` once per byte, with that byte flipped (xor 0x5A)."""
    for index in range(len(payload)):
        flipped = bytearray(payload)
        flipped[index] ^= 0x5A
        yield bytes(flipped)


@pytest.mark.parametrize("codec", codec_lib.CODECS)
def test_every_single_byte_flip_is_caught_by_the_checksum(codec):
    values = np.random.default_rng(0).standard_normal(100).astype(np.float32)
    encoded = codec_lib.encode(values, codec)

    for flipped in _each_byte_flipped(encoded.payload):
        with pytest.raises(codec_lib.ChecksumError):
            _decode(encoded, payload=flipped)


@pytest.mark.parametrize("codec", codec_lib.CODECS)
def test_flipped_payloads_with_a_matching_checksum_never_crash(codec):
    # A sender that checksums garbage: decode must reject it or return sane values.
    values = np.random.default_rng(1).standard_normal(100).astype(np.float32)
    encoded = codec_lib.encode(values, codec)

    for flipped in _each_byte_flipped(encoded.payload):
        checksum = hashlib.sha256(flipped).digest()
        try:
            decoded = _decode(encoded, payload=flipped, checksum=checksum)
        except codec_lib.CodecError:
            continue
        assert decoded.shape == (100,) and np.isfinite(decoded).all()


@pytest.mark.parametrize("codec", codec_lib.CODECS)
def test_truncated_payloads_raise_codec_errors(codec):
    values = np.random.default_rng(2).standard_normal(100).astype(np.float32)
    encoded = codec_lib.encode(values, codec)

    for length in range(len(encoded.payload)):
        truncated = encoded.payload[:length]
        with pytest.raises(codec_lib.ChecksumError):
            _decode(encoded, payload=truncated)
        with pytest.raises(codec_lib.CodecError):
            _decode(encoded, payload=truncated, checksum=hashlib.sha256(truncated).digest())


@pytest.fixture(scope="module")
def zstd_bomb() -> bytes:
    """An ~8 KiB zstd frame whose header (truthfully) declares 256 MiB of zeros."""
    out = io.BytesIO()
    writer = zstandard.ZstdCompressor(write_content_size=True).stream_writer(
        out, size=256 << 20, closefd=False
    )
    zeros = bytes(1 << 20)
    for _ in range(256):
        writer.write(zeros)
    writer.close()
    return out.getvalue()


def test_a_zstd_bomb_is_rejected_before_decompressing(zstd_bomb):
    numel = 4096  # 16 KiB of fp32: the bomb is small enough to pass the payload size check
    assert zstandard.frame_content_size(zstd_bomb) == 256 << 20
    assert len(zstd_bomb) <= codec_lib.max_payload_size_bytes(4 * numel)

    tracemalloc.start()
    try:
        with pytest.raises(codec_lib.SizeError, match="declares content size 268435456"):
            codec_lib.decode(
                zstd_bomb,
                codec="fp32",
                numel=numel,
                raw_size_bytes=4 * numel,
                checksum=hashlib.sha256(zstd_bomb).digest(),
            )
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < 1 << 20


def test_a_frame_without_content_size_is_rejected():
    raw = np.ones(64, np.float32).tobytes()
    payload, checksum = _frame(raw, write_content_size=False)

    with pytest.raises(codec_lib.SizeError, match="content size unknown"):
        codec_lib.decode(
            payload, codec="fp32", numel=64, raw_size_bytes=len(raw), checksum=checksum
        )


def test_size_mismatches_are_rejected():
    encoded = codec_lib.encode(np.ones(64, np.float32), "int8")

    with pytest.raises(codec_lib.SizeError, match="raw_size_bytes=65"):
        _decode(encoded, raw_size_bytes=encoded.raw_size_bytes - 3)
    with pytest.raises(codec_lib.SizeError, match="raw_size_bytes="):
        _decode(encoded, numel=63)
    oversized = encoded.payload + bytes(codec_lib.max_payload_size_bytes(encoded.raw_size_bytes))
    with pytest.raises(codec_lib.SizeError, match="compress to at most"):
        _decode(encoded, payload=oversized)


def test_a_frame_declaring_another_size_is_rejected():
    raw = np.ones(64, np.float32).tobytes()
    payload, checksum = _frame(raw + bytes(4))

    with pytest.raises(codec_lib.SizeError, match="declares content size 260"):
        codec_lib.decode(
            payload, codec="fp32", numel=64, raw_size_bytes=len(raw), checksum=checksum
        )


@pytest.mark.parametrize(
    "payload",
    [b"not a zstd frame at all", b"", None],
    ids=["garbage", "empty", "trailing-data"],
)
def test_undecodable_payloads_are_corrupt(payload):
    raw = np.ones(8, np.float32).tobytes()
    if payload is None:
        payload = _frame(raw)[0] + b"extra"
    checksum = hashlib.sha256(payload).digest()

    with pytest.raises(codec_lib.CorruptPayloadError):
        codec_lib.decode(payload, codec="fp32", numel=8, raw_size_bytes=len(raw), checksum=checksum)


@pytest.mark.parametrize("codec", codec_lib.QUANTIZED_CODECS)
@pytest.mark.parametrize("bad_scale", [np.nan, np.inf, -1.0])
def test_invalid_scales_in_a_crafted_payload_are_rejected(codec, bad_scale):
    encoded = codec_lib.encode(np.ones(300, np.float32), codec)
    raw = bytearray(fakes.serialized(encoded))
    struct.pack_into("<f", raw, 4, bad_scale)  # the second block's scale
    payload, checksum = _frame(bytes(raw))

    with pytest.raises(codec_lib.NonFiniteError, match="first in block 1"):
        _decode(encoded, payload=payload, checksum=checksum)


@pytest.mark.parametrize("codec", codec_lib.QUANTIZED_CODECS)
def test_a_scale_that_overflows_on_decoding_is_rejected(codec):
    encoded = codec_lib.encode(np.ones(10, np.float32), codec)
    raw = bytearray(fakes.serialized(encoded))
    struct.pack_into("<f", raw, 0, 3e38)  # level 127 (or 7) times 3e38 is inf in float32
    payload, checksum = _frame(bytes(raw))

    with pytest.raises(codec_lib.NonFiniteError, match="decoded values have"):
        _decode(encoded, payload=payload, checksum=checksum)


@pytest.mark.parametrize(("codec", "level_byte"), [("int8", 0x80), ("int4", 0x10)])
def test_levels_outside_the_codec_range_are_corrupt(codec, level_byte):
    encoded = codec_lib.encode(np.ones(2, np.float32), codec)
    raw = bytearray(fakes.serialized(encoded))
    raw[4] = level_byte  # int8: -128; int4: low nibble 0, i.e. level -8
    payload, checksum = _frame(bytes(raw))

    with pytest.raises(codec_lib.CorruptPayloadError, match="levels outside"):
        _decode(encoded, payload=payload, checksum=checksum)


@pytest.mark.parametrize("codec", ("fp32", "bf16"))
def test_non_finite_floats_in_a_crafted_payload_are_rejected(codec):
    dtype = np.dtype("<f4") if codec == "fp32" else np.dtype(ml_dtypes.bfloat16)
    raw = np.array([1.0, np.inf], dtype=dtype).tobytes()
    payload, checksum = _frame(raw)

    with pytest.raises(codec_lib.NonFiniteError, match="first at index 1"):
        codec_lib.decode(payload, codec=codec, numel=2, raw_size_bytes=len(raw), checksum=checksum)


def test_decode_rejects_unknown_codecs():
    with pytest.raises(codec_lib.CodecError, match="codec='fp8' is unknown"):
        codec_lib.decode(b"", codec="fp8", numel=1, raw_size_bytes=1, checksum=b"")


def test_int4_compresses_well_relative_to_fp32():
    values = np.random.default_rng(3).standard_normal(1 << 14).astype(np.float32)

    fp32 = codec_lib.encode(values, "fp32")
    int4 = codec_lib.encode(values, "int4")

    assert int4.raw_size_bytes * 8 / values.size == 4.25
    assert len(int4.payload) * 6 < len(fp32.payload)


def test_expected_raw_sizes():
    assert codec_lib.expected_raw_size_bytes("fp32", 10) == 40
    assert codec_lib.expected_raw_size_bytes("bf16", 10) == 20
    assert codec_lib.expected_raw_size_bytes("int8", 300) == 4 * 3 + 300
    assert codec_lib.expected_raw_size_bytes("int4", 301, block_size=100) == 4 * 4 + 151
    assert codec_lib.expected_raw_size_bytes("int2", 301, block_size=100) == 4 * 4 + 76
    assert codec_lib.expected_raw_size_bytes("int2", 128) * 8 / 128 == 2.25
    with pytest.raises(codec_lib.CodecError, match="numel=-1"):
        codec_lib.expected_raw_size_bytes("fp32", -1)


def test_error_bounds():
    assert codec_lib.max_abs_error_bound("fp32", 5.0) == 0.0
    assert codec_lib.max_abs_error_bound("bf16", 256.0) == pytest.approx(1.0)
    # half a step plus 2**-20 of absmax for float32 rounding
    assert codec_lib.max_abs_error_bound("int8", 254.0) == pytest.approx(1.0 + 254 * 2**-20)
    assert codec_lib.max_abs_error_bound("int4", 14.0) == pytest.approx(1.0 + 14 * 2**-20)
    # int2: half of a step of 2·absmax/3
    assert codec_lib.max_abs_error_bound("int2", 3.0) == pytest.approx(1.0 + 3 * 2**-20)
    with pytest.raises(codec_lib.CodecError, match=r"block_absmax=-1\.0"):
        codec_lib.max_abs_error_bound("int8", -1.0)


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=2000), st.integers(1, 300))
def test_chunks_join_back_to_the_payload(payload, chunk_size_bytes):
    chunks = codec_lib.chunk_payload(payload, chunk_size_bytes)

    assert b"".join(chunks) == payload
    assert all(isinstance(c, bytes) and len(c) <= chunk_size_bytes for c in chunks)
    assert all(chunks[:-1]) and len(chunks) == max(1, -(-len(payload) // chunk_size_bytes))


def test_chunk_payload_edge_cases():
    assert codec_lib.chunk_payload(b"", 4) == [b""]
    assert codec_lib.chunk_payload(b"abc", 3) == [b"abc"]
    with pytest.raises(codec_lib.CodecError, match="chunk_size_bytes=0"):
        codec_lib.chunk_payload(b"abc", 0)
