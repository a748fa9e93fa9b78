"""Compiled loops (numba) for the codec's hot passes: block absmax, scales, and int8/int4
quantize-and-pack and unpack-and-dequantize of whole blocks.

Owns: only arithmetic on arrays the caller allocated and validated.
Must not: choose scales, handle tails or tiny blocks, or raise (``layout`` does all that).

Why compiled: in numpy, the int4 encode is about ten passes over each chunk (abs, max per
block, multiply, rint, add, cast, pack) and reached 8-11 % of memory-copy bandwidth on a
2-core VM for the default fragment size (``ddiloco bench perf``). Here each value is read
once per pass and the packed bytes are written once.

Bytes: identical to the numpy path. The absmax compares float bit patterns as integers
(for |x| the order of the bits is the order of the values, and a NaN's bits are above
inf's, so a non-finite block still has a non-finite absmax); quantizing is float32 x·(1/s),
round half to even, + 8 for int4, the same float32 operations numpy does (no fast-math).
"""

from __future__ import annotations

import numpy as np

from ddiloco._jit import COMPILED, njit

_ABS_MASK = np.uint32(0x7FFFFFFF)


@njit()
def block_absmax(values: np.ndarray, block_size: int, out: np.ndarray) -> None:
    """out[b] = max |x| over block b of ``values`` (float32; the last block may be partial)."""
    bits = values.view(np.uint32)
    out_bits = out.view(np.uint32)
    numel = bits.size
    for b in range(out.size):
        block = bits[b * block_size : min((b + 1) * block_size, numel)]
        largest = np.uint32(0)
        for i in range(block.size):
            largest = max(largest, block[i] & _ABS_MASK)
        out_bits[b] = largest


@njit()
def scales_from_absmax(
    absmax: np.ndarray, qmax: np.float32, min_scale: np.float32, max_scale: np.float32,
    scales: np.ndarray, inverse: np.ndarray,
) -> None:
    """``layout.scales_from_absmax`` and ``layout.inverse_scales`` in one loop, per block:
    s = absmax / qmax, one float32 step lower if s·qmax > absmax, clamped to
    [min_scale, max_scale], 0 for absmax < min_scale; inverse = 1/s (0 where s = 0)."""
    zero = np.float32(0)
    for b in range(absmax.size):
        a = absmax[b]
        s = a / qmax
        if s * qmax > a:
            s = np.nextafter(s, zero)
        s = min(max(s, min_scale), max_scale)
        if not a >= min_scale:
            s = zero
        scales[b] = s
        inverse[b] = np.float32(1) / s if s > zero else zero


@njit()
def quantize_int4(values: np.ndarray, inv: np.ndarray, block_size: int, out: np.ndarray) -> None:
    """Packs whole blocks of ``values`` (``inv.size`` x ``block_size``, an even count) into
    ``out``: code = rint(x·inv[b]) + 8, two per byte, first value in the low nibble."""
    for b in range(inv.size):
        scale = inv[b]
        block = values[b * block_size : (b + 1) * block_size]
        packed = out[b * block_size // 2 : (b + 1) * block_size // 2]
        for j in range(packed.size):
            low = np.rint(block[2 * j] * scale) + np.float32(8)
            high = np.rint(block[2 * j + 1] * scale) + np.float32(8)
            packed[j] = np.uint8(np.int32(low) | (np.int32(high) << 4))


@njit()
def quantize_int8(values: np.ndarray, inv: np.ndarray, block_size: int, out: np.ndarray) -> None:
    """Quantizes whole blocks of ``values`` into ``out`` as int8 levels rint(x·inv[b])."""
    for b in range(inv.size):
        scale = inv[b]
        block = values[b * block_size : (b + 1) * block_size]
        levels = out[b * block_size : (b + 1) * block_size]
        for i in range(block.size):
            levels[i] = np.int8(np.int32(np.rint(block[i] * scale)))


@njit()
def dequantize_int4(packed: np.ndarray, scales: np.ndarray, block_size: int, out: np.ndarray) -> int:
    """Writes (code - 8)·scales[b] of whole blocks (two codes per byte, low nibble first) into
    ``out``; returns the smallest code seen (15 for no blocks).

    Two loops per block, codes to a small uint8 scratch and then codes to floats: fused into
    one, the interleaved stores and int64 arithmetic kept LLVM from vectorizing (5x slower).
    """
    mask, shift = np.uint8(15), np.uint8(4)
    least = np.uint8(15)
    codes = np.empty(block_size, np.uint8)
    for b in range(scales.size):
        scale = scales[b]
        src = packed[b * block_size // 2 : (b + 1) * block_size // 2]
        dst = out[b * block_size : (b + 1) * block_size]
        for j in range(src.size):
            codes[2 * j] = src[j] & mask
            codes[2 * j + 1] = src[j] >> shift
        for i in range(block_size):
            code = codes[i]
            least = min(least, code)
            dst[i] = (np.float32(code) - np.float32(8)) * scale
    return int(least)


@njit()
def dequantize_int8(levels: np.ndarray, scales: np.ndarray, block_size: int, out: np.ndarray) -> int:
    """Writes level·scales[b] of whole blocks of int8 levels into ``out``; returns the smallest
    level seen (127 for no blocks)."""
    least = 127
    for b in range(scales.size):
        scale = scales[b]
        src = levels[b * block_size : (b + 1) * block_size]
        dst = out[b * block_size : (b + 1) * block_size]
        for i in range(src.size):
            least = min(least, src[i])
            dst[i] = np.float32(src[i]) * scale
    return least


def warm_up() -> None:
    """Compiles the kernels for the argument types the codec uses."""
    values = np.zeros(4, np.float32)
    inv = np.ones(2, np.float32)
    block_absmax(values, 2, np.empty(2, np.float32))
    one = np.float32(1)
    scales_from_absmax(inv, one, one, one, np.empty(2, np.float32), np.empty(2, np.float32))
    quantize_int4(values, inv, 2, np.empty(2, np.uint8))
    quantize_int8(values, inv, 2, np.empty(4, np.int8))


if not COMPILED:  # no numba (its extra is not installed): the same kernels in numpy, byte for byte
    from ddiloco.wire._kernels_numpy import (  # noqa: F401, F811 (re-exported in place of the loops above)
        block_absmax, dequantize_int4, dequantize_int8, quantize_int4, quantize_int8, scales_from_absmax, warm_up,
    )
