"""jax_codec's host-side split of large vectors with a tail (whole blocks as a zero-copy view,
the rest padded): the bytes must stay those of codec.py, for numpy and jax.Array inputs."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from ddiloco.wire import codec as codec_lib
from ddiloco.wire import jax_codec


@pytest.mark.parametrize("codec", ["int4", "int8", "int2"])
@pytest.mark.parametrize("numel", [(1 << 20) + 1, (1 << 20) + 127, 3 * (1 << 20) + 200])
@pytest.mark.parametrize("block_size", [128, 100])
def test_split_path_gives_codec_bytes(codec, numel, block_size):
    assert numel >= jax_codec._MIN_SPLIT_VALUES
    rng = np.random.default_rng(numel + block_size)
    values = (rng.standard_normal(numel) * 1e-3).astype(np.float32)
    values[-3:] = [5.0, -0.0, 1e-40]  # the tail's own absmax, a signed zero and a subnormal
    # numpy, a jax.Array, and an unaligned view (copied into an aligned buffer first).
    for given in (values, jax.device_put(values), values[1:-1]):
        expected = codec_lib.encode(np.ascontiguousarray(given), codec, block_size=block_size)
        got = jax_codec.encode(given, codec, block_size=block_size)
        assert got.payload == expected.payload and got.raw_size_bytes == expected.raw_size_bytes


def test_split_path_refuses_non_finite_in_the_tail():
    values = np.zeros((1 << 20) + 5, np.float32)
    values[-1] = np.nan
    with pytest.raises(codec_lib.NonFiniteError):
        jax_codec.encode(values, "int4")
