"""codec.decode's fused paths: per-piece visitor, two-thread split, and robust.DecodedStats.

The syncer gathers norms and the cosine with the last merge while decoding (one pass) and shares
each large decode with a second thread; these must give the same values and the same errors as
the plain decode followed by robust.tensor_norms / robust.cosine.
"""

from __future__ import annotations

import concurrent.futures
import hashlib

import numpy as np
import pytest
import zstandard

from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import merge as merge_lib
from ddiloco.algo import robust as robust_lib
from ddiloco.wire import codec as codec_lib

SIZES = [0, 1, 7, 127, 128, 129, 1000, (1 << 18) + 77, (1 << 19) + 3]


@pytest.fixture(scope="module")
def executor():
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        yield pool


def _kwargs(enc: codec_lib.EncodedPayload) -> dict:
    return dict(codec=enc.codec, numel=enc.numel, raw_size_bytes=enc.raw_size_bytes, checksum=enc.checksum,
                block_size=enc.block_size)


def _frame(raw: bytes) -> tuple[bytes, bytes]:
    payload = zstandard.ZstdCompressor(write_content_size=True).compress(raw)
    return payload, hashlib.sha256(payload).digest()


@pytest.mark.parametrize("codec", codec_lib.CODECS)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("block_size", [128, 100])
@pytest.mark.parametrize("threaded", [False, True])
def test_visitor_pieces_tile_the_result_and_values_match_plain_decode(codec, numel, block_size, threaded, executor):
    values = (np.random.default_rng(numel).standard_normal(numel) * 1e-3).astype(np.float32)
    enc = codec_lib.encode(values, codec, block_size=block_size)
    plain = codec_lib.decode(enc.payload, **_kwargs(enc))
    pieces: dict[int, np.ndarray] = {}
    got = codec_lib.decode(enc.payload, **_kwargs(enc), on_chunk=lambda start, v: pieces.setdefault(start, v.copy()),
                           executor=executor if threaded else None)
    assert got.tobytes() == plain.tobytes()
    covered = 0
    for start in sorted(pieces):
        assert start == covered, "pieces must be disjoint and leave no gap"
        assert pieces[start].tobytes() == got[start : start + pieces[start].size].tobytes()
        covered += pieces[start].size
    assert covered == numel


@pytest.mark.parametrize("numel", [129, 4096 + 5, (1 << 19) + 3])
def test_int4_dequantize_is_bit_exact_on_random_bytes(numel, executor):
    """Every stored byte (nibbles 1..15) and random scales, against (code - 8) · scale in float32."""
    rng = np.random.default_rng(numel)
    n_blocks = -(-numel // 128)
    scales = (rng.random(n_blocks) * 10.0 ** rng.integers(-30, 30, n_blocks)).astype(np.float32)
    codes = rng.integers(1, 16, 2 * (-(-numel // 2))).astype(np.uint8)
    body = codes[0::2] | (codes[1::2] << 4)
    raw = scales.astype("<f4").tobytes() + body.tobytes()
    payload, checksum = _frame(raw)
    expected = (codes[:numel].astype(np.float32) - np.float32(8)) * np.repeat(scales, 128)[:numel]
    for threaded in (False, True):
        got = codec_lib.decode(payload, codec="int4", numel=numel, raw_size_bytes=len(raw), checksum=checksum,
                               executor=executor if threaded else None)
        assert got.tobytes() == expected.tobytes()


@pytest.mark.parametrize("codec", ["int4", "int8"])
def test_invalid_level_in_the_helpers_half_is_still_refused(codec, executor):
    numel = (1 << 19) + 3
    enc = codec_lib.encode(np.ones(numel, np.float32), codec)
    raw = bytearray(codec_lib.check_and_decompress(enc.payload, **_kwargs(enc)))
    raw[-1000] = 0x80 if codec == "int8" else 0x08  # -128, or nibble 0 (low), late in the body
    payload, checksum = _frame(bytes(raw))
    with pytest.raises(codec_lib.CorruptPayloadError):
        codec_lib.decode(payload, codec=codec, numel=numel, raw_size_bytes=len(raw), checksum=checksum,
                         executor=executor)


def test_a_busy_helper_does_not_stall_the_decode():
    """The helper's half runs in the caller when the helper thread is taken."""
    values = np.linspace(-1, 1, (1 << 19) + 3, dtype=np.float32)
    enc = codec_lib.encode(values, "int4")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        import threading
        gate = threading.Event()
        blocker = pool.submit(gate.wait, 30)
        try:
            got = codec_lib.decode(enc.payload, **_kwargs(enc), executor=pool)
        finally:
            gate.set()
            blocker.result()
    assert got.tobytes() == codec_lib.decode(enc.payload, **_kwargs(enc)).tobytes()


def _fragment(sizes: list[int]) -> fragments_lib.Fragment:
    return fragments_lib.Fragment(
        fragment_id=0, offset_steps=0,
        tensors=tuple(fragments_lib.TensorSpec(f"t{i}", (n,)) for i, n in enumerate(sizes)),
    )


@pytest.mark.parametrize("sizes", [[1], [5, 70_000, 3], [200_000, 100_000, 300_001], [(1 << 19) + 3]])
@pytest.mark.parametrize("codec", ["int4", "fp32", "int2"])
@pytest.mark.parametrize("threaded", [False, True])
def test_decoded_stats_match_the_separate_passes(sizes, codec, threaded, executor):
    """Tolerance: 1e-6 relative on norms, 1e-6 absolute on the cosine (float32 products per
    piece, float64 totals, as merge.vector_norm)."""
    fragment = _fragment(sizes)
    rng = np.random.default_rng(sum(sizes))
    values = (rng.standard_normal(fragment.numel) * 1e-3).astype(np.float32)
    reference = (values * 0.5 + rng.standard_normal(fragment.numel).astype(np.float32) * 1e-3).astype(np.float32)
    enc = codec_lib.encode(values, codec)
    # The syncer's form of the reference: its last merge's sums times one scale per tensor.
    cuts = np.array([0, fragment.numel // 3, fragment.numel], np.int64)
    factor = np.array([0.5, 4.0], np.float32)
    factored = merge_lib.ScaledResult((reference / np.repeat(factor, np.diff(cuts))).astype(np.float32), cuts, factor)
    for ref, ref_norm in ((reference, None), (reference, float(np.linalg.norm(reference.astype(np.float64)))),
                          (factored, None), (None, None)):
        stats = robust_lib.DecodedStats(fragment, ref, ref_norm)
        decoded = codec_lib.decode(enc.payload, **_kwargs(enc), on_chunk=stats.update,
                                   executor=executor if threaded else None)
        norms = stats.tensor_norms(decoded)
        np.testing.assert_allclose(norms, robust_lib.tensor_norms(decoded, fragment), rtol=1e-6)
        exact = np.array([np.linalg.norm(decoded[w].astype(np.float64)) for w in fragment.slices().values()])
        np.testing.assert_allclose(norms, exact, rtol=1e-6)
        cos = stats.cosine(decoded, norms)
        if ref is None:
            assert cos is None
        else:
            written = ref.materialize() if isinstance(ref, merge_lib.ScaledResult) else ref
            assert cos == pytest.approx(robust_lib.cosine(decoded, written), abs=1e-6)


def test_decoded_stats_extreme_magnitudes_and_zero_vectors():
    fragment = _fragment([4, 4, 4])
    values = np.array([3e30, -4e30, 0, 0, 1e-30, 1e-30, 0, 0, 0, 0, 0, 0], np.float32)  # squares overflow / underflow
    stats = robust_lib.DecodedStats(fragment, values.copy())
    stats.update(0, values)
    norms = stats.tensor_norms(values)
    np.testing.assert_allclose(norms, robust_lib.tensor_norms(values, fragment), rtol=1e-6)
    assert norms[0] == pytest.approx(5e30, rel=1e-6) and norms[2] == 0.0
    assert stats.cosine(values, norms) == pytest.approx(1.0, abs=1e-6)
    zero = np.zeros(12, np.float32)
    stats = robust_lib.DecodedStats(fragment, values)
    stats.update(0, zero)
    assert stats.cosine(zero, stats.tensor_norms(zero)) is None


@pytest.mark.parametrize("codec", ["int4", "fp32"])
@pytest.mark.parametrize("threaded", [False, True])
def test_decoded_stats_gather_the_direction_sample_while_decoding(codec, threaded, executor):
    """The direction check's sample is copied out of each decoded piece; the direction it gives
    is the one of a gather from the whole decoded contribution, bit for bit."""
    fragment = _fragment([70_000, 3, (1 << 18) + 77])
    policy = robust_lib.DirectionPolicy(sample_size=5_000)
    guard = robust_lib.DirectionGuard(policy, [fragment])
    index = guard.sample_index(0)
    assert index is not None and index.size == 5_000
    values = (np.random.default_rng(3).standard_normal(fragment.numel) * 1e-3).astype(np.float32)
    enc = codec_lib.encode(values, codec)
    stats = robust_lib.DecodedStats(fragment, sample_index=index)
    decoded = codec_lib.decode(enc.payload, **_kwargs(enc), on_chunk=stats.update,
                               executor=executor if threaded else None)
    assert stats.sample is not None and stats.sample.tobytes() == decoded[index].tobytes()
    assert guard.direction(0, decoded, stats.sample).tobytes() == guard.direction(0, decoded).tobytes()
    partial = robust_lib.DecodedStats(fragment, sample_index=index)
    partial.update(0, decoded[:1000])  # not every piece seen: no sample to use
    assert partial.sample is None
    assert robust_lib.DecodedStats(fragment).sample is None
    assert robust_lib.DirectionGuard(robust_lib.DirectionPolicy(mode="off"), [fragment]).sample_index(0) is None
