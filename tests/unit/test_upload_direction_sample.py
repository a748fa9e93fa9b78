"""The direction check's sample of an upload, gathered while its chunks are decoded
(services/syncer/admission._SampleGatherer): the same direction, bit for bit, as the sample taken
from the whole decoded fragment afterwards, and nothing when a piece was missed."""

from __future__ import annotations

import numpy as np
import pytest

from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import robust as robust_lib
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde
from services.syncer import admission as admission_lib

NUMEL = 300_001


def _guard(sample_size: int) -> robust_lib.DirectionGuard:
    fragment = fragments_lib.Fragment(fragment_id=0, offset_steps=0, tensors=(
        fragments_lib.TensorSpec("a", (1000,)), fragments_lib.TensorSpec("b", (NUMEL - 1000,))))
    return robust_lib.DirectionGuard(robust_lib.DirectionPolicy(sample_size=sample_size), [fragment])


@pytest.mark.parametrize("codec", ["int4", "int8", "fp32"])
def test_the_sample_gathered_on_arrival_gives_the_same_direction(codec):
    guard = _guard(sample_size=4096)
    values = (np.random.default_rng(3).standard_normal(NUMEL) * 1e-3).astype(np.float32)
    encoded = codec_lib.encode(values, codec, compression="none")
    gatherer = admission_lib._SampleGatherer(guard.sample_index(0))
    stream = serde.payload_stream(serde.payload_info_to_proto(encoded), on_chunk=gatherer.update)
    for chunk in codec_lib.chunk_payload(encoded.payload, 16 * 1024):
        stream.feed(chunk)
    decoded = stream.finish()
    sampled = gatherer.sample()
    assert sampled is not None and sampled.size == 4096
    assert guard.direction(0, decoded, sampled).tobytes() == guard.direction(0, decoded).tobytes()


def test_a_sample_with_a_piece_missing_is_not_used_and_small_fragments_need_none():
    guard = _guard(sample_size=4096)
    values = np.ones(NUMEL, np.float32)
    gatherer = admission_lib._SampleGatherer(guard.sample_index(0))
    gatherer.update(0, values[: NUMEL // 2])  # the second half never visited
    assert gatherer.sample() is None
    assert _guard(sample_size=NUMEL).sample_index(0) is None  # the whole fragment is the sample
    off = robust_lib.DirectionGuard(robust_lib.DirectionPolicy(mode="off", sample_size=16), [
        fragments_lib.Fragment(fragment_id=0, offset_steps=0, tensors=(fragments_lib.TensorSpec("a", (100,)),))])
    assert off.sample_index(0) is None
