"""What the syncer publishes is compressed whenever zstd saves WAN bytes (services/syncer/publishing.py).

An upload's int4 levels shrink only ~1.19x under zstd, so the learner sends them raw (the syncer
then dequantizes them as they arrive); a published version's error-fed int4 delta is encoded once
and sent to every learner, so it is compressed at that ratio (codec.FANOUT_MIN_ZSTD_RATIO), and a
learner reads back exactly what the syncer computed it would hold.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ddiloco.wire import codec as codec_lib
from ddiloco.algo import fragments as fragments_lib
from ddiloco.wire import serde
from services.syncer import publishing


def _params(numel: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(numel) * 1e-2).astype(np.float32)


def test_an_int4_upload_goes_raw_but_the_same_bytes_published_to_every_learner_are_compressed():
    delta = _params(1 << 20, 0) - _params(1 << 20, 1) * 0.5
    upload = codec_lib.encode(delta, "int4")
    published = codec_lib.encode(delta, "int4", min_zstd_ratio=codec_lib.FANOUT_MIN_ZSTD_RATIO)
    assert upload.compression == "none"
    assert published.compression == "zstd"
    ratio = published.raw_size_bytes / len(published.payload)
    assert codec_lib.FANOUT_MIN_ZSTD_RATIO <= ratio < codec_lib.MIN_ZSTD_RATIO


def test_the_error_fed_delta_is_compressed_and_decodes_to_what_the_learners_are_said_to_hold():
    publisher = publishing.Publisher(download_codec="int4", block_size=128, zstd_level=3)
    old, new = _params(300_001, 2), _params(300_001, 3)
    held, encoded = publisher.error_fed_delta(old, new)
    assert encoded.compression == "zstd" and len(encoded.payload) < encoded.raw_size_bytes
    info = serde.payload_info_to_proto(encoded)
    step = codec_lib.decode(encoded.payload, codec="int4", numel=encoded.numel,
                            raw_size_bytes=encoded.raw_size_bytes, checksum=encoded.checksum,
                            block_size=encoded.block_size, compression="zstd",
                            checksum_kind=encoded.checksum_kind)
    assert info.payload_size_bytes == len(encoded.payload)
    np.testing.assert_array_equal(fragments_lib.apply_delta(old, step), held)
    # int4 with an error bound of half a level per block: close to the target, not equal.
    assert np.abs(held - new).max() < np.abs(new - old).max() / 7


def test_a_compression_threshold_below_one_is_refused():
    with pytest.raises(codec_lib.CodecError, match="min_zstd_ratio"):
        codec_lib.encode(_params(16, 4), "int4", min_zstd_ratio=0.5)


def test_whole_versions_are_published_through_the_fanout_threshold():
    # Gaussian fp32 weights shrink ~1.08x (their exponent bytes): raw as an upload, compressed
    # as a published version.
    publisher = publishing.Publisher(download_codec="int4", block_size=128, zstd_level=3)

    class Slot:
        encoded = None
        encoding = None
        version = 3
        published = _params(200_000, 5)

    assert codec_lib.encode(Slot.published, "fp32").compression == "none"
    version, encoded = asyncio.run(publisher.encoded_payload(Slot()))
    assert version == 3 and encoded.codec == "fp32" and encoded.compression == "zstd"
    assert len(encoded.payload) < encoded.raw_size_bytes
