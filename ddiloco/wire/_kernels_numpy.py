"""The kernels of ``ddiloco.wire._kernels`` in numpy, for an install without the `numba` extra.

Owns: the same names with the same arguments and outputs; ``_kernels`` swaps them in when numba
cannot be imported. Why: numba is an optional dependency (pyproject.toml); without it the compiled
loops would run as plain Python, about a thousand times slower. Here each kernel is a few numpy
passes over row chunks of whole blocks.
Must not: choose scales, handle tails, or raise (as ``_kernels``).

Bytes: identical to the compiled kernels' (tests/unit/test_kernels_numpy.py): the absmax
compares the float bits as integers, and quantizing is the same float32 x·(1/s), round half to
even, + 8 for int4.
"""

from __future__ import annotations

import numpy as np

_ABS_MASK = np.uint32(0x7FFFFFFF)
# Values per numpy pass (whole blocks): temporaries stay small.
_CHUNK = 1 << 16


def _rows(block_size: int) -> int:
    return max(1, _CHUNK // max(1, block_size))


def block_absmax(values: np.ndarray, block_size: int, out: np.ndarray) -> None:
    """out[b] = max |x| over block b of ``values`` (float32; the last block may be partial)."""
    bits = values.view(np.uint32)
    out_bits = out.view(np.uint32)
    full = min(bits.size // block_size, out.size)
    rows = _rows(block_size)
    for r0 in range(0, full, rows):
        r1 = min(r0 + rows, full)
        block = bits[r0 * block_size : r1 * block_size].reshape(r1 - r0, block_size)
        out_bits[r0:r1] = (block & _ABS_MASK).max(axis=1)
    for b in range(full, out.size):
        tail = bits[b * block_size : min((b + 1) * block_size, bits.size)]
        out_bits[b] = (tail & _ABS_MASK).max() if tail.size else 0


def scales_from_absmax(
    absmax: np.ndarray, qmax: np.float32, min_scale: np.float32, max_scale: np.float32,
    scales: np.ndarray, inverse: np.ndarray,
) -> None:
    """Per block: s = absmax / qmax, one float32 step lower if s·qmax > absmax, clamped to
    [min_scale, max_scale], 0 for absmax < min_scale (or NaN); inverse = 1/s (0 where s = 0)."""
    zero = np.float32(0)
    with np.errstate(invalid="ignore", over="ignore"):
        s = absmax / qmax
        s = np.where(s * qmax > absmax, np.nextafter(s, zero), s)
        s = np.minimum(np.maximum(s, min_scale), max_scale)
    s = np.where(absmax >= min_scale, s, zero).astype(np.float32)
    scales[:] = s
    inverse[:] = 0
    np.divide(np.float32(1), s, out=inverse, where=s > zero)


def quantize_int4(values: np.ndarray, inv: np.ndarray, block_size: int, out: np.ndarray) -> None:
    """Packs whole blocks: code = rint(x·inv[b]) + 8, two per byte, first value in the low nibble."""
    rows = _rows(block_size)
    for r0 in range(0, inv.size, rows):
        r1 = min(r0 + rows, inv.size)
        block = values[r0 * block_size : r1 * block_size].reshape(r1 - r0, block_size)
        codes = (np.rint(block * inv[r0:r1, None]) + np.float32(8)).astype(np.int32)
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
        out[r0 * block_size // 2 : r1 * block_size // 2] = packed.reshape(-1)


def quantize_int8(values: np.ndarray, inv: np.ndarray, block_size: int, out: np.ndarray) -> None:
    """Quantizes whole blocks into int8 levels rint(x·inv[b])."""
    rows = _rows(block_size)
    for r0 in range(0, inv.size, rows):
        r1 = min(r0 + rows, inv.size)
        block = values[r0 * block_size : r1 * block_size].reshape(r1 - r0, block_size)
        levels = np.rint(block * inv[r0:r1, None]).astype(np.int32).astype(np.int8)
        out[r0 * block_size : r1 * block_size] = levels.reshape(-1)


def dequantize_int4(packed: np.ndarray, scales: np.ndarray, block_size: int, out: np.ndarray) -> int:
    """Writes (code - 8)·scales[b] of whole blocks (low nibble first) into ``out``; returns the
    smallest code seen (15 for no blocks)."""
    least = 15
    rows = _rows(block_size)
    for r0 in range(0, scales.size, rows):
        r1 = min(r0 + rows, scales.size)
        src = packed[r0 * block_size // 2 : r1 * block_size // 2].reshape(r1 - r0, block_size // 2)
        codes = np.empty((r1 - r0, block_size), np.uint8)
        codes[:, 0::2] = src & np.uint8(15)
        codes[:, 1::2] = src >> np.uint8(4)
        least = min(least, int(codes.min()))
        values = (codes.astype(np.float32) - np.float32(8)) * scales[r0:r1, None]
        out[r0 * block_size : r1 * block_size] = values.reshape(-1)
    return least


def dequantize_int8(levels: np.ndarray, scales: np.ndarray, block_size: int, out: np.ndarray) -> int:
    """Writes level·scales[b] of whole blocks into ``out``; returns the smallest level seen (127
    for no blocks)."""
    least = 127
    rows = _rows(block_size)
    for r0 in range(0, scales.size, rows):
        r1 = min(r0 + rows, scales.size)
        src = levels[r0 * block_size : r1 * block_size].reshape(r1 - r0, block_size)
        least = min(least, int(src.min()))
        out[r0 * block_size : r1 * block_size] = (src.astype(np.float32) * scales[r0:r1, None]).reshape(-1)
    return least


def warm_up() -> None:
    """Nothing to compile."""
