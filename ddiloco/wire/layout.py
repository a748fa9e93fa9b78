"""The raw (pre-zstd) byte layout of each fragment codec: serialize float32 values, deserialize
them, and the documented per-element error bounds.

Owns: the block scales, quantize-and-pack, unpack-and-dequantize, the sizes a codec's raw bytes
have, and the checks of what the raw bytes hold (levels in range, finite scales and values).
Must not: compress, checksum, chunk (``codec`` does, around these bytes), import gRPC, protobuf
or JAX, or do I/O. ``codec`` re-exports the public names; callers use ``codec.encode`` / ``decode``.

Codecs (raw layout before zstd, all little-endian):
  * ``fp32``: the float32 values; bit-exact.
  * ``bf16``: bfloat16 values, rounded to nearest even (values beyond bfloat16's range are
    clipped to its maximum first, so no finite input becomes inf).
  * ``int8`` / ``int4`` / ``int2``: ``[float32 scale × n_blocks][levels]``, one absmax scale
    per block of ``block_size`` values:
      - int8: symmetric levels -127..127, one byte each;
      - int4: symmetric levels -7..7 stored as level + 8, two per byte, low nibble first;
      - int2: four levels {-3, -1, +1, +3} × scale, a symmetric uniform "mid-rise" quantizer
        (steps of 2·scale, no exact zero), stored as codes 0..3 (level = 2·code - 3), four per
        byte, first value in the lowest two bits. Scale = absmax / 3, so the outer levels reach
        ±absmax and the worst-case error is absmax / 3 (half a step), where a ternary
        {-1, 0, +1} scheme would waste a code and err by up to absmax / 2. On Gaussian-like
        blocks of 128 its relative squared error is about half the ternary one (0.30 vs 0.59).
        The sign of x picks the side (+0.0 gives +1, -0.0 gives -1), |x| the magnitude.
    A tail that does not fill its last byte is padded with the code of +0.0 (int4: nibble 8,
    int2: code 2). Scales: s = absmax / qmax in float32, one float32 step lower if qmax·s
    would exceed absmax (so decoding never overflows), at least 2**-126 (the smallest normal
    float32) so that 1/s is finite, and for int2 at most 2**126 so that 1/s is normal (blocks
    with absmax above 2.55e38 then clip to the outer level, still within absmax / 3). Levels:
    round-half-even(x · fl(1/s)); int2: min(floor(|x| · fl(1/s) / 2), 1) picks ±1 or ±3.
    Flush to zero, as XLA on CPU computes: a block whose absmax is below 2**-126 (zeros and
    subnormals only) has scale 0 and decodes to zeros, and subnormal inputs count as zeros of
    the same sign. The error this adds is below 2**-126, inside the bounds' slack, and it keeps
    the bytes identical to the learner's jitted encoder for every input.

Speed: the block absmax, the scales, int8/int4 quantize-and-pack and unpack-and-dequantize
are compiled loops (``_kernels``, numba; same bytes and values), imported on first use: numba's
import and kernel loading take ~0.5 CPU-s, which a learner encoding with ``jax_codec`` never
pays at a restart. int2 runs as numpy. Decoding
goes over cache-sized chunks of whole blocks. A non-finite input is found from the block absmax (NaN
and inf propagate through it), not by a separate pass. `ddiloco bench perf` measures them against the machine's memory bandwidth.

Every error raised here is a ``CodecError`` (a ``ValueError``, ``ddiloco.wire.errors``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Executor

import ml_dtypes
import numpy as np

from ddiloco.wire.errors import CodecError, CorruptPayloadError, NonFiniteError

CODECS: tuple[str, ...] = ("fp32", "bf16", "int8", "int4", "int2")
QUANTIZED_CODECS: tuple[str, ...] = ("int8", "int4", "int2")
DEFAULT_BLOCK_SIZE = 128
# Largest block a quantized payload may declare (the syncer refuses larger ones too).
MAX_BLOCK_SIZE = 1 << 20

# Largest level of each quantized codec in units of the scale (levels are symmetric).
_QMAX = {"int8": 127, "int4": 7, "int2": 3}
_LEVELS_PER_BYTE = {"int8": 1, "int4": 2, "int2": 4}
# Worst-case error of a quantized codec as a fraction of the block absmax: half a step.
_HALF_STEP = {"int8": 1.0 / 254, "int4": 1.0 / 14, "int2": 1.0 / 3}
# Scales are at least the smallest normal float32, so that 1/scale is finite.
_MIN_SCALE = np.float32(np.finfo(np.float32).tiny)
# Values per chunk of the block-wise loops: a few hundred KiB of float32 stays in L2 cache.
_CHUNK_VALUES = 1 << 16
# int2 scales stay at or below 2**126 so that 1/scale is a normal float32 (see above).
_INT2_MAX_SCALE = np.float32(2.0**126)
# Blocks with a nonzero scale below this can hold subnormals that quantize to a nonzero level;
# the encoder flushes those to zero first (rare: only blocks with absmax below ~2**-118).
_TINY_SCALE = np.float32(2.0**-124)
_SCALE_BYTES = 4
_BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
# Subnormal scales and values have less than float32's relative precision; this absolute
# slack (the smallest normal float32, 2**-126) covers their rounding in the error bounds.
_SUBNORMAL_SLACK = float(np.finfo(np.float32).tiny)


# decode's per-piece callback: (index of the piece's first value, the decoded piece).
ChunkVisitor = Callable[[int, np.ndarray], None]
# Smallest payload (values) split between two threads by decode(executor=...): below it the
# hand-over costs more than the second core saves.
_MIN_PARALLEL_VALUES = 1 << 18


def expected_raw_size_bytes(codec: str, numel: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Returns the size of a codec's serialization of ``numel`` values before zstd.

    Args:
        codec: one of ``CODECS``.
        numel: number of values, >= 0.
        block_size: values per quantization block, >= 1 (ignored by fp32/bf16).

    Returns:
        The size in bytes; at block 128, int4 is 4.25 and int2 2.25 bits per value.

    Raises:
        CodecError: on an unknown codec, a negative numel or a bad block size.
    """
    _check_codec(codec, block_size)
    if numel < 0:
        raise CodecError(f"numel={numel} is negative: must be >= 0")
    if codec == "fp32":
        return 4 * numel
    if codec == "bf16":
        return 2 * numel
    n_blocks = -(-numel // block_size)
    return _SCALE_BYTES * n_blocks + -(-numel // _LEVELS_PER_BYTE[codec])


def _compiled():
    """The compiled kernels (``_kernels``), imported on the first call: see the module docstring."""
    from ddiloco.wire import _kernels

    return _kernels


def raise_non_finite(values: np.ndarray) -> None:
    """Raises the NonFiniteError of an encoder that found non-finite values (slow path)."""
    bad = ~np.isfinite(np.asarray(values))
    raise NonFiniteError(
        f"values has {int(bad.sum())} non-finite entries (first at index "
        f"{int(bad.argmax())}): refuse to send; the learner's state has diverged"
    )


def max_abs_error_bound(codec: str, block_absmax: float) -> float:
    """Returns the largest |x - decode(encode(x))| for any value in a block.

    * fp32: 0 (bit-exact).
    * bf16: ``absmax · 2**-8`` (round to nearest even keeps 8 significant bits, so the
      error is at most 2**-8 relative; clipping to bfloat16's maximum stays within it).
    * int8 / int4 / int2: half a quantization step, ``absmax / 254``, ``absmax / 14`` or
      ``absmax / 3``, plus float32 rounding slack of ``absmax · 2**-20``.
    Lossy codecs add ``2**-126`` absolute slack for subnormal values and scales.

    Args:
        codec: one of ``CODECS``.
        block_absmax: largest |x| in the block (for bf16, |x| of the element itself gives
            a tighter, still valid bound).

    Returns:
        The bound, >= 0.

    Raises:
        CodecError: on an unknown codec, or a negative or non-finite ``block_absmax``.
    """
    _check_codec(codec, DEFAULT_BLOCK_SIZE)
    block_absmax = float(block_absmax)
    if not (math.isfinite(block_absmax) and block_absmax >= 0):
        raise CodecError(f"block_absmax={block_absmax} is invalid: must be finite and >= 0")
    if codec == "fp32":
        return 0.0
    if codec == "bf16":
        return block_absmax * 2.0**-8 + _SUBNORMAL_SLACK
    return block_absmax * (_HALF_STEP[codec] + 2.0**-20) + _SUBNORMAL_SLACK


def _check_codec(codec: str, block_size: int) -> None:
    if codec not in CODECS:
        raise CodecError(f"codec={codec!r} is unknown: use one of {list(CODECS)}")
    if codec in _QMAX and not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise CodecError(
            f"block_size={block_size} is invalid for codec={codec!r}: must be in [1, {MAX_BLOCK_SIZE}]"
        )


def block_absmax(values: np.ndarray, block_size: int) -> np.ndarray:
    """Returns max |x| of each block of a 1-D float32 vector (the last block may be partial).

    NaN and inf propagate: a block's absmax is finite exactly when all its values are.
    One compiled pass (``_kernels.block_absmax``).
    """
    out = np.empty(-(-values.size // block_size), np.float32)
    _compiled().block_absmax(np.ascontiguousarray(values, dtype=np.float32), block_size, out)
    return out


def scales_from_absmax(absmax: np.ndarray, codec: str) -> np.ndarray:
    """Returns each block's float32 scale (see the module docstring) from its absmax."""
    return _scales_and_inverse(absmax, codec)[0]


def inverse_scales(scales: np.ndarray) -> np.ndarray:
    """1/scale per block in float32, 0 for a zero block (levels are rint(x · this))."""
    inv = np.zeros_like(scales)
    np.divide(np.float32(1), scales, out=inv, where=scales > 0)
    return inv


def _scales_and_inverse(absmax: np.ndarray, codec: str) -> tuple[np.ndarray, np.ndarray]:
    """(scales, inverse_scales(scales)) in one compiled loop."""
    absmax = np.ascontiguousarray(absmax, dtype=np.float32)
    scales, inverse = np.empty_like(absmax), np.empty_like(absmax)
    max_scale = _INT2_MAX_SCALE if codec == "int2" else np.float32(np.finfo(np.float32).max)
    _compiled().scales_from_absmax(absmax, np.float32(_QMAX[codec]), _MIN_SCALE, max_scale, scales, inverse)
    return scales, inverse


def main_blocks(numel: int, block_size: int, per_byte: int) -> int:
    """Whole blocks quantized in the chunked loop: as many as fit, ending on a byte boundary.

    The rest (a partial block, and up to 3 whole ones when block_size is not a multiple of
    the levels per byte) is a small zero-padded tail.
    """
    main = numel // block_size
    while main and (main * block_size) % per_byte:
        main -= 1
    return main


def _rows_per_chunk(block_size: int) -> int:
    # Whole blocks per chunk, a multiple of 4 so that every chunk of levels ends on a byte.
    return max(4, (_CHUNK_VALUES // block_size) // 4 * 4)


def serialize(values: np.ndarray, codec: str, block_size: int, absmax: np.ndarray | None = None) -> bytes:
    """Returns the raw (pre-zstd) bytes of finite float32 ``values``."""
    if codec == "fp32":
        return values.astype("<f4", copy=False).tobytes()
    if codec == "bf16":
        # Clip first: float32 values above bfloat16's max would round to inf.
        clipped = np.clip(values, -_BF16_MAX, _BF16_MAX)
        bits = clipped.astype(ml_dtypes.bfloat16).view(np.uint16)
        return bits.astype("<u2", copy=False).tobytes()
    if absmax is None:
        absmax = block_absmax(values, block_size)
    scales, inv = _scales_and_inverse(absmax, codec)
    tiny_blocks = np.flatnonzero((scales > 0) & (scales < _TINY_SCALE))
    if tiny_blocks.size:  # rare: flush their subnormals to zero, as the jitted encoder does
        values = values.copy()
        for b in tiny_blocks:
            block = values[b * block_size : (b + 1) * block_size]
            # Signed zeros: the jitted encoder flushes -subnormals (and keeps -0) as -0.0,
            # which int2 stores as level -1 (it has no zero level).
            tiny = np.abs(block) < _MIN_SCALE
            block[tiny] = np.copysign(np.float32(0), block[tiny])
    clip_int2 = codec == "int2" and bool((scales >= _INT2_MAX_SCALE).any())
    numel = values.size
    n_blocks = scales.size
    per_byte = _LEVELS_PER_BYTE[codec]
    raw = np.empty(expected_raw_size_bytes(codec, numel, block_size), np.uint8)
    raw[: _SCALE_BYTES * n_blocks].view("<f4")[:] = scales
    body = raw[_SCALE_BYTES * n_blocks :]

    rows = _rows_per_chunk(block_size)
    n_main = main_blocks(numel, block_size, per_byte)
    if n_main and codec == "int4" and block_size % 2 == 0:
        _compiled().quantize_int4(values, inv[:n_main], block_size, body[: n_main * block_size // 2])
    elif n_main and codec == "int8":
        _compiled().quantize_int8(values, inv[:n_main], block_size, body[: n_main * block_size].view(np.int8))
    elif n_main:
        work = np.empty(min(rows, n_main) * block_size, np.float32)
        codes = np.empty(min(rows, n_main) * block_size, np.uint8)
        for b0 in range(0, n_main, rows):
            b1 = min(b0 + rows, n_main)
            v = values[b0 * block_size : b1 * block_size].reshape(b1 - b0, block_size)
            _levels_to_codes(v, inv[b0:b1], codec, work, codes, clip_int2)
            _pack(codes, codec, body[b0 * block_size // per_byte : b1 * block_size // per_byte])
    tail = values[n_main * block_size :]
    if tail.size:
        # The rest (less than one chunk): zero-padded to whole blocks and bytes. Zeros do not
        # change a block's absmax and take the code of 0.0, which is also the padding.
        tail_blocks = n_blocks - n_main
        padded_size = -(-tail_blocks * block_size // per_byte) * per_byte
        padded = np.zeros(max(padded_size, tail_blocks * block_size), np.float32)
        padded[: tail.size] = tail
        v = padded[: tail_blocks * block_size].reshape(tail_blocks, block_size)
        work = np.zeros(padded.size, np.float32)
        codes = np.empty(padded.size, np.uint8)
        _levels_to_codes(v, inv[n_main:], codec, work, codes, clip_int2)
        if padded.size > v.size:  # the odd tail past the last block: the code of 0.0
            codes[v.size :] = _zero_code(codec)
        packed = np.empty(padded.size // per_byte, np.uint8)
        _pack(codes, codec, packed)
        body[n_main * block_size // per_byte :] = packed[: body.size - n_main * block_size // per_byte]
    return raw.tobytes()


def _zero_code(codec: str) -> int:
    return {"int8": 0, "int4": 8, "int2": 2}[codec]


def _levels_to_codes(
    v: np.ndarray, inv: np.ndarray, codec: str, work: np.ndarray, codes: np.ndarray, clip_int2: bool = False
) -> None:
    """Quantizes blocks ``v`` (rows × block_size) into one stored code per value (uint8)."""
    t = work[: v.size].reshape(v.shape)
    np.multiply(v, inv[:, None], out=t)
    flat = work[: v.size]
    if codec == "int2":
        # code = 1.5 + copysign(m + 0.5, u) with m = min(floor(|u| / 2), 1): 2 + m or 1 - m.
        magnitude = np.abs(flat)
        np.multiply(magnitude, np.float32(0.5), out=magnitude)
        np.floor(magnitude, out=magnitude)
        if clip_int2:
            np.minimum(magnitude, np.float32(1), out=magnitude)
        np.add(magnitude, np.float32(0.5), out=magnitude)
        np.copysign(magnitude, flat, out=flat)
        np.add(flat, np.float32(1.5), out=flat)
    else:
        np.rint(flat, out=flat)
        if codec == "int4":
            np.add(flat, np.float32(8), out=flat)
    target = codes[: v.size]
    if codec == "int8":
        np.copyto(target.view(np.int8), flat, casting="unsafe")
    else:
        np.copyto(target, flat, casting="unsafe")


def _pack(codes: np.ndarray, codec: str, out: np.ndarray) -> None:
    """Packs codes (a multiple of the levels per byte) into ``out``, first value lowest."""
    if codec == "int8":
        out[:] = codes[: out.size]
        return
    if codec == "int4":
        w = codes[: 2 * out.size].view("<u2")
        np.copyto(out, w | (w >> 4), casting="unsafe")  # the low byte: c0 | c1 << 4
        return
    w = codes[: 4 * out.size].view("<u4")
    packed = w >> 6
    packed |= w
    packed |= w >> 12
    packed |= w >> 18
    np.copyto(out, packed, casting="unsafe")  # the low byte: c0 | c1 << 2 | c2 << 4 | c3 << 6


def _unpack_levels(body: np.ndarray, codec: str, out: np.ndarray) -> int:
    """Writes the float levels of the packed bytes ``body`` into ``out`` (len(body)·per_byte
    values); returns the smallest stored code (int8: as a signed byte)."""
    if codec == "int8":
        levels = body.view(np.int8)
        np.copyto(out, levels)
        return int(levels.min()) if levels.size else 0
    if codec == "int4":
        w = body.astype("<u2")
        hi = w & 0xF0
        hi <<= 4
        w &= 0x0F
        w |= hi
        codes = w.view(np.uint8)  # c0, c1, ... interleaved
        # Cast, then subtract in float32: exact, and faster than a subtract whose uint8 input
        # numpy casts in its buffered loop.
        np.copyto(out, codes[: out.size])
        np.subtract(out, np.float32(8), out=out)
        return int(codes[: out.size].min()) if out.size else 8
    w = body.astype("<u4")
    spread = w & 0x03
    for shift in (2, 4, 6):
        part = w & (0x03 << shift)
        part <<= 8 * (shift // 2) - shift
        spread |= part
    codes = spread.view(np.uint8)
    np.multiply(codes, np.float32(2), out=out)
    np.subtract(out, np.float32(3), out=out)
    return 0


def deserialize(raw: bytes, codec: str, numel: int, block_size: int,
                 on_chunk: ChunkVisitor | None = None, executor: Executor | None = None) -> np.ndarray:
    """Returns fresh, finite float32 values from raw bytes whose length was already checked."""
    if codec in ("fp32", "bf16"):
        values = np.empty(numel, np.float32)
        copy_values(raw, codec, values, 0, numel, on_chunk)
        check_finite(values)
        return values

    n_blocks = -(-numel // block_size)
    scales = read_scales(raw, n_blocks)
    body = np.frombuffer(raw, dtype=np.uint8, offset=_SCALE_BYTES * n_blocks)
    out = np.empty(numel, np.float32)
    n_main = main_blocks(numel, block_size, _LEVELS_PER_BYTE[codec])
    rows = _rows_per_chunk(block_size)

    def blocks(first: int, stop: int) -> int:
        return dequantize_blocks(body, scales, codec, block_size, out, first, stop, on_chunk)

    if executor is not None and n_main * block_size >= _MIN_PARALLEL_VALUES:
        # Two contiguous halves, split on a chunk boundary (so each thread's chunks stay whole);
        # errstate is thread-local: the worker sets its own.
        half = -(-(n_main // 2) // rows) * rows

        def second_half() -> int:
            with np.errstate(over="ignore", invalid="ignore"):
                return blocks(half, n_main)

        future = executor.submit(second_half)
        try:
            smallest = blocks(0, half)
        finally:
            # Not started yet (the executor's threads are busy with other uploads): do it here
            # rather than wait for them.
            smallest = min(smallest, second_half() if future.cancel() else future.result())
    else:
        smallest = blocks(0, n_main)
    return finish_dequantized(body, scales, codec, block_size, out, smallest, on_chunk)


def copy_values(raw, codec: str, out: np.ndarray, first: int, stop: int,
                on_chunk: ChunkVisitor | None = None) -> None:
    """Values [first, stop) of an fp32 or bf16 serialization ``raw`` (holding at least those)
    into ``out``, chunked, so that on_chunk sees each piece while it is in cache."""
    stored = np.frombuffer(raw, dtype="<f4" if codec == "fp32" else "<u2", count=stop)
    for start in range(first, stop, _CHUNK_VALUES):
        seg = out[start : min(start + _CHUNK_VALUES, stop)]
        piece = stored[start : start + seg.size]
        if codec == "fp32":
            np.copyto(seg, piece)
        else:
            np.copyto(seg, piece.astype(np.uint16, copy=False).view(ml_dtypes.bfloat16), casting="unsafe")
        if on_chunk is not None:
            on_chunk(start, seg)


def check_finite(values: np.ndarray) -> None:
    """NonFiniteError if decoded values hold a NaN or an infinity."""
    if values.size and not (np.isfinite(values.max()) and np.isfinite(values.min())):
        _raise_non_finite_decoded(values)


def read_scales(raw, n_blocks: int) -> np.ndarray:
    """The block scales at the start of a quantized serialization, checked finite and >= 0."""
    scales = np.frombuffer(raw, dtype="<f4", count=n_blocks).astype(np.float32)
    bad_scales = ~(np.isfinite(scales) & (scales >= 0))
    if bad_scales.any():
        raise NonFiniteError(
            f"payload has {int(bad_scales.sum())} non-finite or negative block scales (first "
            f"in block {int(bad_scales.argmax())}): the sender encoded invalid data"
        )
    return scales


def dequantize_blocks(body: np.ndarray, scales: np.ndarray, codec: str, block_size: int, out: np.ndarray,
                      first: int, stop: int, on_chunk: ChunkVisitor | None = None) -> int:
    """Dequantizes (and visits) whole blocks [first, stop) of a quantized serialization's levels
    ``body`` into ``out``, chunk by chunk; returns the smallest stored code seen (int8: signed).
    ``first`` and ``stop`` must end whole bytes of levels (multiples of 4 blocks do, and
    ``main_blocks``)."""
    per_byte = _LEVELS_PER_BYTE[codec]
    rows = _rows_per_chunk(block_size)
    kernels = _compiled()
    least = 127 if codec == "int8" else 8
    for b0 in range(first, stop, rows):
        b1 = min(b0 + rows, stop)
        seg = out[b0 * block_size : b1 * block_size]
        packed = body[b0 * block_size // per_byte : b1 * block_size // per_byte]
        if codec == "int4" and block_size % 2 == 0:
            least = min(least, kernels.dequantize_int4(packed, scales[b0:b1], block_size, seg))
        elif codec == "int8":
            least = min(least, kernels.dequantize_int8(packed.view(np.int8), scales[b0:b1], block_size, seg))
        else:
            least = min(least, _unpack_levels(packed, codec, seg))
            seg2d = seg.reshape(b1 - b0, block_size)
            np.multiply(seg2d, scales[b0:b1, None], out=seg2d)
        if on_chunk is not None:
            on_chunk(b0 * block_size, seg)
    return least


def finish_dequantized(body: np.ndarray, scales: np.ndarray, codec: str, block_size: int, out: np.ndarray,
                       smallest: int, on_chunk: ChunkVisitor | None = None) -> np.ndarray:
    """Dequantizes the tail past ``main_blocks`` (and visits it), then checks the levels seen
    (``smallest``, from ``dequantize_blocks``) and, when a scale could overflow, the values."""
    numel = out.size
    n_blocks = scales.size
    per_byte = _LEVELS_PER_BYTE[codec]
    qmax = _QMAX[codec]
    n_main = main_blocks(numel, block_size, per_byte)
    tail_start = n_main * block_size
    if numel > tail_start:
        tail_bytes = body[tail_start // per_byte :]
        levels = np.empty(tail_bytes.size * per_byte, np.float32)
        _unpack_levels(tail_bytes, codec, levels)
        levels = levels[: numel - tail_start]  # drop the padding past the last value
        if codec != "int2" and levels.size:
            smallest = min(smallest, int(levels.min()) + (0 if codec == "int8" else 8))
        tail_blocks = n_blocks - n_main
        padded = np.zeros(tail_blocks * block_size, np.float32)
        padded[: levels.size] = levels
        padded = padded.reshape(tail_blocks, block_size) * scales[n_main:, None]
        out[tail_start:] = padded.ravel()[: levels.size]
        if on_chunk is not None:
            on_chunk(tail_start, out[tail_start:])
    # Only one level below the range can be represented: -128 (int8) or nibble 0 (int4).
    if (codec == "int8" and smallest < -qmax) or (codec == "int4" and smallest < 1):
        raise CorruptPayloadError(
            f"payload holds levels outside [-{qmax}, {qmax}] for codec={codec!r}: "
            "the sender encoded invalid data"
        )
    # Levels are within ±qmax and scales finite and >= 0: only a scale above FLT_MAX / qmax
    # can overflow. Check the values only then.
    if scales.size and float(scales.max()) * qmax > _F32_MAX and not np.isfinite(out).all():
        _raise_non_finite_decoded(out)
    return out


_F32_MAX = float(np.finfo(np.float32).max)


def _raise_non_finite_decoded(values: np.ndarray) -> None:
    bad = ~np.isfinite(values)
    raise NonFiniteError(
        f"decoded values have {int(bad.sum())} non-finite entries (first at index "
        f"{int(bad.argmax())}): the sender encoded invalid data"
    )
