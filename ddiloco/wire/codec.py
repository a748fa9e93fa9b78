"""Wire codec for flat float32 fragment vectors: quantize, zstd-compress, checksum, chunk.

Owns: the byte layout of every codec, the payload checks done before any byte is trusted
(sizes, sha256, zstd frame header) and the documented per-element error bounds.
Must not: import gRPC or protobuf, do I/O, or know what the vector means.

Codecs (raw layout before zstd, all little-endian):
  * ``fp32``: the float32 values; bit-exact.
  * ``bf16``: bfloat16 values, rounded to nearest even (values beyond bfloat16's range are
    clipped to its maximum first, so no finite input becomes inf).
  * ``int8`` / ``int4``: ``[float32 scale × n_blocks][levels]``, one absmax scale per block of
    ``block_size`` values, symmetric levels -127..127 (int8, one byte each) or -7..7 (int4,
    stored as level + 8, two per byte, low nibble first, an odd length padded with level 0).
    A block of zeros has scale 0 and decodes to zeros.
The raw bytes travel as one zstd frame with its content size in the header, so a receiver
can reject a decompression bomb from the header alone.

Every error raised here is a ``CodecError`` (a ``ValueError``).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import zstandard

CODECS: tuple[str, ...] = ("fp32", "bf16", "int8", "int4")
DEFAULT_BLOCK_SIZE = 128

# Largest level of each quantized codec (levels are symmetric: -qmax..qmax).
_QMAX = {"int8": 127, "int4": 7}
_SCALE_BYTES = 4
_BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
# ZSTD_COMPRESSBOUND adds a margin for inputs below this size (zstd.h).
_ZSTD_SMALL_INPUT_BYTES = 128 << 10
# Frame header (<= 18 bytes) and optional 4-byte checksum, with room to spare.
_FRAME_OVERHEAD_BYTES = 32
# Subnormal scales and values have less than float32's relative precision; this absolute
# slack (the smallest normal float32, 2**-126) covers their rounding in the error bounds.
_SUBNORMAL_SLACK = float(np.finfo(np.float32).tiny)


class CodecError(ValueError):
    """A payload, or the description of one, is invalid."""


class NonFiniteError(CodecError):
    """Values are NaN or infinite, or a quantization scale is non-finite or negative."""


class SizeError(CodecError):
    """A declared or actual size does not match what the codec and numel imply."""


class ChecksumError(CodecError):
    """The payload's sha256 does not match the declared checksum."""


class CorruptPayloadError(CodecError):
    """The payload passed its checksum but is not a valid zstd frame or codec layout."""


@dataclass(frozen=True)
class EncodedPayload:
    """An encoded vector and everything a receiver needs to check and decode it.

    Attributes:
        codec: one of ``CODECS``.
        numel: number of float32 values encoded.
        block_size: values per quantization block (unused by fp32/bf16).
        raw_size_bytes: size of the codec serialization before zstd.
        payload: one zstd frame with its content size written in the header.
        checksum: sha256 digest (32 bytes) of ``payload``.
    """

    codec: str
    numel: int
    block_size: int
    raw_size_bytes: int
    payload: bytes
    checksum: bytes


def expected_raw_size_bytes(codec: str, numel: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Returns the size of a codec's serialization of ``numel`` values before zstd.

    Args:
        codec: one of ``CODECS``.
        numel: number of values, >= 0.
        block_size: values per quantization block, >= 1 (ignored by fp32/bf16).

    Returns:
        The size in bytes; int4 at block 128 is 4.25 bits per value.

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
    level_bytes = numel if codec == "int8" else (numel + 1) // 2
    return _SCALE_BYTES * n_blocks + level_bytes


def max_payload_size_bytes(raw_size_bytes: int) -> int:
    """Returns the largest zstd frame ``raw_size_bytes`` of input can compress to.

    zstd's worst-case bound (ZSTD_COMPRESSBOUND) plus frame overhead. Receivers use it to
    reject an oversized upload from its declared size, before reading it.

    Raises:
        CodecError: if ``raw_size_bytes`` is negative.
    """
    if raw_size_bytes < 0:
        raise CodecError(f"raw_size_bytes={raw_size_bytes} is negative: must be >= 0")
    small_input_margin = max(0, _ZSTD_SMALL_INPUT_BYTES - raw_size_bytes) >> 11
    return raw_size_bytes + (raw_size_bytes >> 8) + small_input_margin + _FRAME_OVERHEAD_BYTES


def encode(
    values: np.ndarray,
    codec: str,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    zstd_level: int = 3,
) -> EncodedPayload:
    """Encodes a flat float32 vector.

    Args:
        values: 1-D float32 array, all finite.
        codec: one of ``CODECS``.
        block_size: values per quantization block, >= 1 (ignored by fp32/bf16).
        zstd_level: zstd compression level, at most 22 (negative levels are faster).

    Returns:
        The encoded payload.

    Raises:
        NonFiniteError: if any value is NaN or infinite (checked before quantizing).
        CodecError: on an unknown codec, a bad block size or level, or values that are not
            a 1-D float32 array.
    """
    _check_codec(codec, block_size)
    if zstd_level > zstandard.MAX_COMPRESSION_LEVEL:
        raise CodecError(
            f"zstd_level={zstd_level} is invalid: must be <= {zstandard.MAX_COMPRESSION_LEVEL}"
        )
    values = np.asarray(values)
    if values.ndim != 1 or values.dtype != np.float32:
        raise CodecError(f"values is {values.dtype}{list(values.shape)}: pass a 1-D float32 vector")
    bad = ~np.isfinite(values)
    if bad.any():
        raise NonFiniteError(
            f"values has {int(bad.sum())} non-finite entries (first at index "
            f"{int(bad.argmax())}): refuse to send; the learner's state has diverged"
        )

    raw = _serialize(values, codec, block_size)
    # One compressor per call: instances are not thread-safe.
    compressor = zstandard.ZstdCompressor(level=zstd_level, write_content_size=True)
    payload = compressor.compress(raw)
    return EncodedPayload(
        codec=codec,
        numel=values.size,
        block_size=block_size,
        raw_size_bytes=len(raw),
        payload=payload,
        checksum=hashlib.sha256(payload).digest(),
    )


def decode(
    payload: bytes,
    *,
    codec: str,
    numel: int,
    raw_size_bytes: int,
    checksum: bytes,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> np.ndarray:
    """Checks and decodes a payload, cheapest checks first.

    Nothing is decompressed until the declared sizes, the checksum and the zstd frame's own
    content size all agree, so a decompression bomb allocates nothing.

    NOTE: memory is bounded by ``raw_size_bytes``, which follows from ``numel``: the caller
    must check ``numel`` against the fragment it expects before calling.

    Args:
        payload: one zstd frame, as produced by ``encode``.
        codec: one of ``CODECS``.
        numel: number of values declared by the sender.
        raw_size_bytes: raw size declared by the sender.
        checksum: sha256 digest declared by the sender.
        block_size: values per quantization block (ignored by fp32/bf16).

    Returns:
        A fresh, writable 1-D float32 array of ``numel`` finite values.

    Raises:
        SizeError: if ``raw_size_bytes`` does not match codec and numel, the payload is
            larger than zstd could produce from it, or the frame declares another (or no)
            content size.
        ChecksumError: if the payload's sha256 differs from ``checksum``.
        CorruptPayloadError: if the frame does not decompress or holds invalid levels.
        NonFiniteError: if a scale is non-finite or negative, or a decoded value is not
            finite.
        CodecError: on an unknown codec, a negative numel or a bad block size.
    """
    expected_bytes = expected_raw_size_bytes(codec, numel, block_size)
    if raw_size_bytes != expected_bytes:
        raise SizeError(
            f"raw_size_bytes={raw_size_bytes} but codec={codec!r} with numel={numel} and "
            f"block_size={block_size} serializes to {expected_bytes}: the sender's header is wrong"
        )
    limit_bytes = max_payload_size_bytes(raw_size_bytes)
    if len(payload) > limit_bytes:
        raise SizeError(
            f"payload is {len(payload)} bytes but {raw_size_bytes} raw bytes compress to at "
            f"most {limit_bytes}: refusing it"
        )
    if hashlib.sha256(payload).digest() != bytes(checksum):
        raise ChecksumError(
            f"sha256 of the {len(payload)}-byte payload does not match the declared checksum: "
            "the payload was corrupted or truncated in transit; resend it"
        )
    try:
        content_bytes = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as err:
        raise CorruptPayloadError(f"payload is not a zstd frame: {err}") from err
    if content_bytes != raw_size_bytes:
        declared = "unknown" if content_bytes == -1 else content_bytes
        raise SizeError(
            f"zstd frame declares content size {declared} but raw_size_bytes={raw_size_bytes}: "
            "encode with write_content_size=True and matching sizes"
        )
    try:
        raw = zstandard.ZstdDecompressor().decompress(
            payload, max_output_size=raw_size_bytes, allow_extra_data=False
        )
    except zstandard.ZstdError as err:
        raise CorruptPayloadError(f"payload does not decompress: {err}") from err
    if len(raw) != raw_size_bytes:
        raise CorruptPayloadError(
            f"payload decompressed to {len(raw)} bytes, not raw_size_bytes={raw_size_bytes}"
        )

    # errstate: a forged scale can overflow q·scale; the finiteness check below reports it.
    with np.errstate(over="ignore", invalid="ignore"):
        values = _deserialize(raw, codec, numel, block_size)
    bad = ~np.isfinite(values)
    if bad.any():
        raise NonFiniteError(
            f"decoded values have {int(bad.sum())} non-finite entries (first at index "
            f"{int(bad.argmax())}): the sender encoded invalid data"
        )
    return values


def chunk_payload(payload: bytes, chunk_size_bytes: int) -> list[bytes]:
    """Splits a payload into chunks of at most ``chunk_size_bytes`` for streaming.

    An empty payload gives one empty chunk, so a stream always has a (last) message. A
    payload that fits in one chunk is returned as is; otherwise each chunk is one copy of
    its slice (protobuf needs ``bytes``).

    Args:
        payload: the bytes to split.
        chunk_size_bytes: largest chunk, >= 1.

    Returns:
        The chunks, in order; ``b"".join(chunks) == payload``.

    Raises:
        CodecError: if ``chunk_size_bytes < 1``.
    """
    if chunk_size_bytes < 1:
        raise CodecError(f"chunk_size_bytes={chunk_size_bytes} is invalid: must be >= 1")
    if len(payload) <= chunk_size_bytes:
        return [bytes(payload)]
    view = memoryview(payload)
    return [view[i : i + chunk_size_bytes].tobytes() for i in range(0, len(view), chunk_size_bytes)]


def max_abs_error_bound(codec: str, block_absmax: float) -> float:
    """Returns the largest |x - decode(encode(x))| for any value in a block.

    * fp32: 0 (bit-exact).
    * bf16: ``absmax · 2**-8`` (round to nearest even keeps 8 significant bits, so the
      error is at most 2**-8 relative; clipping to bfloat16's maximum stays within it).
    * int8 / int4: half a quantization step, ``absmax / 254`` or ``absmax / 14``, plus
      float32 rounding slack of ``absmax · 2**-20``.
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
    return block_absmax * (1.0 / (2 * _QMAX[codec]) + 2.0**-20) + _SUBNORMAL_SLACK


def _check_codec(codec: str, block_size: int) -> None:
    if codec not in CODECS:
        raise CodecError(f"codec={codec!r} is unknown: use one of {list(CODECS)}")
    if codec in _QMAX and block_size < 1:
        raise CodecError(f"block_size={block_size} is invalid for codec={codec!r}: must be >= 1")


def _serialize(values: np.ndarray, codec: str, block_size: int) -> bytes:
    """Returns the raw (pre-zstd) bytes of finite float32 ``values``."""
    if codec == "fp32":
        return values.astype("<f4", copy=False).tobytes()
    if codec == "bf16":
        # Clip first: float32 values above bfloat16's max would round to inf.
        clipped = np.clip(values, -_BF16_MAX, _BF16_MAX)
        bits = clipped.astype(ml_dtypes.bfloat16).view(np.uint16)
        return bits.astype("<u2", copy=False).tobytes()
    scales, levels = _quantize(values, block_size, _QMAX[codec])
    if codec == "int4":
        nibbles = (levels + 8).astype(np.uint8)  # 1..15; 0 never occurs
        if nibbles.size % 2:
            nibbles = np.append(nibbles, np.uint8(8))  # pad with level 0
        levels = nibbles[0::2] | (nibbles[1::2] << 4)
    return scales.astype("<f4", copy=False).tobytes() + levels.tobytes()


def _quantize(values: np.ndarray, block_size: int, qmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Absmax block quantization; returns (float32 scale per block, int8 level per value)."""
    n_blocks = -(-values.size // block_size)
    blocks = np.zeros(n_blocks * block_size, dtype=np.float32)
    blocks[: values.size] = values  # zero padding leaves every block's absmax unchanged
    blocks = blocks.reshape(n_blocks, block_size)
    absmax = np.abs(blocks).max(axis=1).astype(np.float64)
    scales = _round_down_to_float32(absmax / qmax)
    # Rounding the scale down keeps qmax·scale <= absmax, so decoding never overflows;
    # the floor at the smallest subnormal keeps tiny nonzero blocks exact instead of 0.
    smallest = np.finfo(np.float32).smallest_subnormal
    scales = np.where(absmax > 0, np.maximum(scales, smallest), np.float32(0))
    divisor = np.where(scales > 0, scales, np.float32(1))
    levels = np.clip(np.rint(blocks / divisor[:, None]), -qmax, qmax).astype(np.int8)
    return scales, levels.ravel()[: values.size]


def _round_down_to_float32(x: np.ndarray) -> np.ndarray:
    """Rounds float64 values >= 0 to the largest float32 not above them."""
    rounded = x.astype(np.float32)
    return np.where(rounded > x, np.nextafter(rounded, np.float32(0)), rounded)


def _deserialize(raw: bytes, codec: str, numel: int, block_size: int) -> np.ndarray:
    """Returns fresh float32 values from raw bytes whose length was already checked."""
    if codec == "fp32":
        return np.frombuffer(raw, dtype="<f4").astype(np.float32)
    if codec == "bf16":
        bits = np.frombuffer(raw, dtype="<u2").astype(np.uint16, copy=False)
        return bits.view(ml_dtypes.bfloat16).astype(np.float32)

    n_blocks = -(-numel // block_size)
    scales = np.frombuffer(raw, dtype="<f4", count=n_blocks).astype(np.float32)
    bad_scales = ~(np.isfinite(scales) & (scales >= 0))
    if bad_scales.any():
        raise NonFiniteError(
            f"payload has {int(bad_scales.sum())} non-finite or negative block scales (first "
            f"in block {int(bad_scales.argmax())}): the sender encoded invalid data"
        )
    body = np.frombuffer(raw, dtype=np.uint8, offset=_SCALE_BYTES * n_blocks)
    qmax = _QMAX[codec]
    if codec == "int8":
        levels = body.view(np.int8)
    else:
        nibbles = np.empty(2 * body.size, dtype=np.uint8)
        nibbles[0::2] = body & 0x0F
        nibbles[1::2] = body >> 4
        levels = nibbles[:numel].astype(np.int8) - 8
    # Only one level below the range can be represented: -128 (int8) or nibble 0 (int4).
    if levels.size and levels.min() < -qmax:
        raise CorruptPayloadError(
            f"payload holds levels outside [-{qmax}, {qmax}] for codec={codec!r}: "
            "the sender encoded invalid data"
        )
    return levels.astype(np.float32) * np.repeat(scales, block_size)[:numel]
