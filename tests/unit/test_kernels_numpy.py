"""The numpy twins of the numba kernels (an install without the `numba` extra) against the compiled
kernels: the same bytes from the codec's kernels, the same params, momentum and Δ bits from the
outer step and the merge's fold-in, and float64 sums equal up to their last bits."""

from __future__ import annotations

import numpy as np
import pytest

from ddiloco.algo import _kernels as algo_compiled
from ddiloco.algo import _kernels_numpy as algo_numpy
from ddiloco.wire import _kernels as wire_compiled
from ddiloco.wire import _kernels_numpy as wire_numpy

QMAX = {"int4": np.float32(7), "int8": np.float32(127)}
MIN_SCALE, MAX_SCALE = np.float32(2.0**-126), np.float32(3.0e38)


def _values(rng, n: int, block_size: int) -> np.ndarray:
    """Blocks of very different magnitudes, an all-zero block and a block of subnormals."""
    values = rng.standard_normal(n).astype(np.float32)
    values *= np.repeat(10.0 ** rng.uniform(-8, 3, -(-n // block_size)), block_size)[:n].astype(np.float32)
    values[:block_size] = 0
    values[block_size : 2 * block_size] = np.float32(1e-40)
    return values


@pytest.mark.parametrize("n, block_size", [(4096, 64), (1000, 32), (70_001, 256), (130, 128)])
def test_codec_kernels_give_the_compiled_bytes(n, block_size):
    rng = np.random.default_rng(n)
    values = _values(rng, n, block_size)
    blocks = -(-n // block_size)
    absmax = {}
    for name, k in (("compiled", wire_compiled), ("numpy", wire_numpy)):
        absmax[name] = np.empty(blocks, np.float32)
        k.block_absmax(values, block_size, absmax[name])
    assert absmax["compiled"].tobytes() == absmax["numpy"].tobytes()
    full = n // block_size
    for codec in ("int4", "int8"):
        out = {}
        for name, k in (("compiled", wire_compiled), ("numpy", wire_numpy)):
            scales, inv = np.empty(blocks, np.float32), np.empty(blocks, np.float32)
            k.scales_from_absmax(absmax[name], QMAX[codec], MIN_SCALE, MAX_SCALE, scales, inv)
            if codec == "int4":
                body = np.zeros(full * block_size // 2, np.uint8)
                k.quantize_int4(values, inv[:full], block_size, body)
                decoded = np.empty(full * block_size, np.float32)
                least = k.dequantize_int4(body, scales[:full], block_size, decoded)
            else:
                body = np.zeros(full * block_size, np.int8)
                k.quantize_int8(values, inv[:full], block_size, body)
                decoded = np.empty(full * block_size, np.float32)
                least = k.dequantize_int8(body, scales[:full], block_size, decoded)
            out[name] = (scales.tobytes(), inv.tobytes(), body.tobytes(), decoded.tobytes(), int(least))
        assert out["compiled"] == out["numpy"], codec
        assert np.abs(np.frombuffer(out["numpy"][3], np.float32) - values[: full * block_size]).max() < \
            np.abs(values).max() / 6  # and it is a quantization, not some other bytes


def test_codec_kernels_on_no_blocks_and_a_non_finite_block():
    empty = np.empty(0, np.float32)
    for k in (wire_compiled, wire_numpy):
        assert k.dequantize_int4(np.empty(0, np.uint8), empty, 8, empty) == 15
        assert k.dequantize_int8(np.empty(0, np.int8), empty, 8, empty) == 127
    values = np.ones(16, np.float32)
    values[9] = np.nan
    out = {}
    for name, k in (("compiled", wire_compiled), ("numpy", wire_numpy)):
        out[name] = np.empty(2, np.float32)
        k.block_absmax(values, 8, out[name])
    assert out["compiled"][0] == out["numpy"][0] == 1 and np.isnan(out["numpy"][1]) and np.isnan(out["compiled"][1])


def _segments(rng, n: int) -> np.ndarray:
    cuts = np.sort(rng.choice(np.arange(1, n), size=3, replace=False))
    return np.concatenate([[0], cuts, [n]]).astype(np.int64)


@pytest.mark.parametrize("nesterov, carry, into", [(True, 0.9, 1.0), (False, 1.0, 1.0), (False, 0.5, 0.25),
                                                   (True, 0.3, 0.5)])
@pytest.mark.parametrize("scratch, want_grad_sq", [(False, True), (True, False), (True, True)])
def test_outer_step_gives_the_compiled_bits(nesterov, carry, into, scratch, want_grad_sq):
    rng = np.random.default_rng(7)
    n = 150_000  # several numpy chunks and many compiled blocks
    bounds = _segments(rng, n)
    sums, params, buf = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    scales = rng.uniform(0.1, 2, bounds.size - 1).astype(np.float32)
    rule = (np.float32(0.9), np.float32(-0.7), np.float32(carry), np.float32(into))
    out = {}
    for name, k in (("compiled", algo_compiled), ("numpy", algo_numpy)):
        grad = np.full(algo_compiled.BLOCK if scratch else n, np.nan, np.float32)
        params_out, buf_out = np.empty(n, np.float32), np.empty(n, np.float32)
        result = k.scaled_sgd_step(sums, bounds, scales, (params, buf), (grad, params_out, buf_out), rule, nesterov,
                                   want_grad_sq)
        out[name] = (params_out, buf_out, None if scratch else grad, result)
    for a, b in zip(out["compiled"][:3], out["numpy"][:3]):
        assert (a is None and b is None) or a.tobytes() == b.tobytes()
    np.testing.assert_allclose(out["numpy"][3], out["compiled"][3], rtol=1e-9)
    if not want_grad_sq:
        assert out["numpy"][3] == (0.0, 0.0)
    params[5] = np.inf  # a non-finite new parameter shows in the second result either way
    grad = np.empty(algo_compiled.BLOCK if scratch else n, np.float32)
    _, params_sum = algo_numpy.scaled_sgd_step(sums, bounds, scales, (params, buf),
                                               (grad, np.empty(n, np.float32), np.empty(n, np.float32)), rule,
                                               nesterov, want_grad_sq)
    assert not np.isfinite(params_sum)


def test_fold_in_and_square_sums_give_the_compiled_bits():
    rng = np.random.default_rng(3)
    n = 100_000
    bounds = _segments(rng, n)
    values = rng.standard_normal(n).astype(np.float32)
    coefs = np.array([0.5, 0.0, -1.25, 3.0], np.float32)  # a zero coefficient leaves its segment alone
    out = {}
    for name, k in (("compiled", algo_compiled), ("numpy", algo_numpy)):
        sums = np.arange(n, dtype=np.float32) / n
        squares = np.full(4, -1.0)
        k.fold_segments(values, bounds, coefs, sums, squares)
        norms = np.empty(4)
        k.segment_square_sums(values, bounds, norms)
        out[name] = (sums, squares, norms)
    assert out["compiled"][0].tobytes() == out["numpy"][0].tobytes()
    assert out["numpy"][1][1] == -1.0  # untouched, as compiled
    np.testing.assert_allclose(out["numpy"][1], out["compiled"][1], rtol=1e-12)
    np.testing.assert_allclose(out["numpy"][2], out["compiled"][2], rtol=1e-12)


def test_piece_stats_twin_agrees_with_the_compiled_kernel():
    rng = np.random.default_rng(5)
    values = rng.standard_normal(70_000).astype(np.float32)
    reference = rng.standard_normal(200_000).astype(np.float32)
    tensors = np.array([[0, 50_000], [50_000, 50_003], [50_003, 200_000]], np.int64)
    parts = np.array([[0, 120_000], [120_000, 200_000]], np.int64)
    index = np.sort(rng.choice(200_000, 3_000, replace=False)).astype(np.int64)
    out = {}
    for name, k in (("compiled", algo_compiled), ("numpy", algo_numpy)):
        sample, squares, dots = np.full(index.size, np.nan, np.float32), np.empty(3), np.empty(2)
        got = k.piece_stats(values, 40_000, tensors, reference, parts, index, sample, squares, dots)
        out[name] = (got, sample, squares, dots)
    inside = (index >= 40_000) & (index < 110_000)
    for name, (got, sample, squares, dots) in out.items():
        assert got == inside.sum(), name
        assert sample[inside].tobytes() == values[index[inside] - 40_000].tobytes() and np.isnan(sample[~inside]).all()
        x = values.astype(np.float64)
        np.testing.assert_allclose(squares, [np.dot(x[:10_000], x[:10_000]), np.dot(x[10_000:10_003], x[10_000:10_003]),
                                             np.dot(x[10_003:], x[10_003:])], rtol=1e-5)
        np.testing.assert_allclose(dots, [np.dot(x, reference[40_000:110_000]), 0.0], rtol=1e-5, atol=0.05)
