"""The learner's jitted codec (ddiloco.wire.jax_codec) gives codec.py's bytes, values and errors."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import zstandard
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ddiloco.wire import codec as codec_lib
from ddiloco.wire import jax_codec
from tests import fakes

_TINY = float(np.finfo(np.float32).tiny)
_F32_MAX = float(np.finfo(np.float32).max)



def _structured_vectors() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out = []
    for numel in (1, 5, 129, 1000, 70_001):  # few sizes: one compilation each
        for scale in (1e-30, 1e-6, 1.0, 1e30, 1e38):
            out.append(np.clip(rng.standard_normal(numel) * scale, -3e38, 3e38).astype(np.float32))
    mixed = rng.standard_normal(1000).astype(np.float32)
    mixed[:128] = 0.0  # a zero block
    mixed[130] = -0.0
    mixed[200] = 1e-45  # subnormals inside normal blocks
    mixed[201] = -1e-40
    mixed[300:310] = np.float32(2.0**-130)  # a block of subnormals only (with block 7 or 1)
    out.append(mixed)
    tiny = (rng.standard_normal(512) * 2.0**-120).astype(np.float32)  # blocks with tiny scales
    tiny[::3] = np.float32(-2.0**-127)
    out.append(tiny)
    out.append((np.sign(rng.standard_normal(512)) * _F32_MAX).astype(np.float32))
    out.append((rng.integers(-7, 8, 4096) * 0.25).astype(np.float32))  # exact ties
    return out


@pytest.mark.parametrize("codec", codec_lib.QUANTIZED_CODECS)
@pytest.mark.parametrize("block_size", [1, 7, 128, 1000])
def test_bytes_equal_codec_py_on_structured_inputs(codec, block_size):
    for values in _structured_vectors():
        expected = codec_lib.encode(values, codec, block_size=block_size)
        got = jax_codec.encode(values, codec, block_size=block_size)
        assert got == expected, (codec, block_size, values.size)


@settings(max_examples=30, deadline=None)
@given(
    # A few sizes (each one is a compilation); any finite values, subnormals included.
    hnp.arrays(np.float32, st.sampled_from([1, 6, 257, 700]),
               elements=st.floats(width=32, allow_nan=False, allow_infinity=False)),
    st.sampled_from(codec_lib.QUANTIZED_CODECS),
    st.sampled_from([1, 7, 128]),
)
# Found by CI: a tiny block (scale at the float32 minimum) with -0.0 beside it; int2 has no
# zero level, so the sign of a flushed zero picks the level.
@example(np.array([np.finfo(np.float32).tiny, -0.0, -0.0, -1e-45, 0.0, -0.0], np.float32), "int2", 7)
@example(np.array([np.finfo(np.float32).tiny, -1e-45, 1e-45], np.float32), "int4", 7)
def test_bytes_equal_codec_py_on_any_finite_input(values, codec, block_size):
    assert jax_codec.encode(values, codec, block_size=block_size) == codec_lib.encode(
        values, codec, block_size=block_size
    )


@pytest.mark.parametrize("codec", codec_lib.CODECS)
def test_decoded_values_equal_codec_py(codec):
    values = (np.random.default_rng(1).standard_normal(70_001) * 1e-3).astype(np.float32)
    enc = codec_lib.encode(values, codec, block_size=128)
    kwargs = dict(codec=codec, numel=enc.numel, raw_size_bytes=enc.raw_size_bytes, checksum=enc.checksum,
                  block_size=enc.block_size)

    got = jax_codec.decode(enc.payload, **kwargs)

    assert got.tobytes() == codec_lib.decode(enc.payload, **kwargs).tobytes()
    assert got.flags.writeable


@pytest.mark.parametrize("codec", codec_lib.QUANTIZED_CODECS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused_alike(codec, bad):
    values = np.ones(300, np.float32)
    values[200] = bad
    with pytest.raises(codec_lib.NonFiniteError, match="first at index 200"):
        jax_codec.encode(values, codec)


@pytest.mark.parametrize(("codec", "level_byte"), [("int8", 0x80), ("int4", 0x10)])
def test_invalid_levels_are_refused_alike(codec, level_byte):
    enc = codec_lib.encode(np.ones(2, np.float32), codec)
    raw = bytearray(fakes.serialized(enc))
    raw[4] = level_byte
    payload = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(raw))

    with pytest.raises(codec_lib.CorruptPayloadError, match="levels outside"):
        jax_codec.decode(payload, codec=codec, numel=2, raw_size_bytes=len(raw),
                         checksum=hashlib.sha256(payload).digest())


def test_int2_extreme_blocks_stay_within_the_bound():
    values = np.array([_F32_MAX, -_F32_MAX, 1e38, -2.6e38, 0.0, 1.0], np.float32)
    enc = jax_codec.encode(values, "int2", block_size=8)
    decoded = codec_lib.decode(enc.payload, codec="int2", numel=6, raw_size_bytes=enc.raw_size_bytes,
                               checksum=enc.checksum, block_size=8)
    raw = fakes.serialized(enc)
    assert struct.unpack_from("<f", raw)[0] == 2.0**126  # the capped scale
    assert np.isfinite(decoded).all()
    assert np.abs(decoded.astype(np.float64) - values).max() <= codec_lib.max_abs_error_bound("int2", _F32_MAX)


def test_unaligned_inputs_give_the_same_bytes():
    base = np.random.default_rng(2).standard_normal(4097).astype(np.float32)
    unaligned = base[1:]  # 4 bytes past an allocation's alignment
    assert jax_codec.encode(unaligned, "int4") == codec_lib.encode(np.ascontiguousarray(unaligned), "int4")


def test_fp32_and_bf16_fall_back_to_codec_py():
    values = np.linspace(-1, 1, 33, dtype=np.float32)
    for codec in ("fp32", "bf16"):
        assert jax_codec.encode(values, codec) == codec_lib.encode(values, codec)
