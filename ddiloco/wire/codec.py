"""Wire codec for flat float32 fragment vectors: quantize, zstd-compress, checksum, chunk.

Owns: the payload around a codec's raw bytes (``layout``): zstd or raw, the checksum, the checks
done before any byte is trusted (sizes, digest, zstd frame header) and chunking for streams.
Must not: import gRPC, protobuf or JAX, do I/O, or know what the vector means. (The learner's
jitted encoder, ``ddiloco.wire.jax_codec``, produces the same bytes; tests hold them equal.)

The codecs' raw layouts and error bounds are ``ddiloco.wire.layout``'s (its docstring); their
public names are re-exported here.

The raw bytes travel as one zstd frame with its content size in the header, so a receiver
can reject a decompression bomb from the header alone, or, when zstd would not pay, as they are
(``compression="none"``): ``encode`` compresses a sample first and sends the raw bytes when the
sample compresses less than ``min_zstd_ratio`` (by default ``MIN_ZSTD_RATIO``: int4 levels shrink
~1.19x, measured in bench/results/perf.md, for ~1.3 ms per default upload on each side, so uploads
go raw; a payload encoded once and sent to every learner passes ``FANOUT_MIN_ZSTD_RATIO``). The checksum is sha256 (the
original format, still read) or xxh3-128 (``checksum_kind="xxh3_128"``, what ``encode`` writes):
a payload's digest only guards against corruption in transit and keys idempotent retries, it
addresses no stored content, and xxh3 runs ~20x faster than sha256 on this machine.

Every error raised here is a ``CodecError`` (a ``ValueError``, ``ddiloco.wire.errors``).
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np
import xxhash
import zstandard

from ddiloco.wire.errors import (  # noqa: F401 (re-exported: callers catch codec.CodecError and its kinds)
    ChecksumError,
    CodecError,
    CorruptPayloadError,
    NonFiniteError,
    SizeError,
)
from ddiloco.wire.layout import (  # noqa: F401 (public names re-exported; the rest encode uses)
    _QMAX,
    CODECS,
    DEFAULT_BLOCK_SIZE,
    MAX_BLOCK_SIZE,
    QUANTIZED_CODECS,
    ChunkVisitor,
    _check_codec,
    block_absmax,
    expected_raw_size_bytes,
    max_abs_error_bound,
    raise_non_finite,
)
from ddiloco.wire.layout import deserialize as _deserialize
from ddiloco.wire.layout import serialize as _serialize

COMPRESSIONS: tuple[str, ...] = ("zstd", "none")
CHECKSUM_KINDS: tuple[str, ...] = ("sha256", "xxh3_128")
CHECKSUM_BYTES = {"sha256": 32, "xxh3_128": 16}
# encode sends raw bytes when a sample of them compresses less than this (zstd then costs CPU on
# both sides for few WAN bytes); the sample is _ZSTD_SAMPLE_BYTES from the middle of the levels.
MIN_ZSTD_RATIO = 1.25
# The threshold for a payload encoded once and sent to many receivers (the syncer's published
# versions and their error-fed deltas): its compression costs the sender once per version, not
# once per transfer, and each receiver decompresses off the syncer (~0.3 ms per million int4
# values), so any saving of WAN bytes beyond a few percent pays (int4 deltas: ~1.19x fewer bytes).
FANOUT_MIN_ZSTD_RATIO = 1.05
_ZSTD_SAMPLE_BYTES = 64 * 1024
# ZSTD_COMPRESSBOUND adds a margin for inputs below this size (zstd.h).
_ZSTD_SMALL_INPUT_BYTES = 128 << 10
# Frame header (<= 18 bytes) and optional 4-byte checksum, with room to spare.
_FRAME_OVERHEAD_BYTES = 32


@dataclass(frozen=True)
class EncodedPayload:
    """An encoded vector and everything a receiver needs to check and decode it.

    Attributes:
        codec: one of ``CODECS``.
        numel: number of float32 values encoded.
        block_size: values per quantization block (unused by fp32/bf16).
        raw_size_bytes: size of the codec serialization before zstd.
        payload: one zstd frame with its content size written in the header, or (compression
            "none") the raw serialization itself.
        checksum: digest of ``payload`` (``checksum_kind``: sha256, 32 bytes; xxh3_128, 16).
        compression: "zstd" or "none".
        checksum_kind: "sha256" or "xxh3_128".
    """

    codec: str
    numel: int
    block_size: int
    raw_size_bytes: int
    payload: bytes
    checksum: bytes
    compression: str = "zstd"
    checksum_kind: str = "sha256"


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
    compression: str = "auto",
    checksum_kind: str = "xxh3_128",
    min_zstd_ratio: float = MIN_ZSTD_RATIO,
) -> EncodedPayload:
    """Encodes a flat float32 vector.

    Args:
        values: 1-D float32 array, all finite.
        codec: one of ``CODECS``.
        block_size: values per quantization block, >= 1 (ignored by fp32/bf16).
        zstd_level: zstd compression level, at most 22 (negative levels are faster).
        compression: "zstd", "none" or "auto" (see ``finish_encoding``).
        checksum_kind: "xxh3_128" or "sha256" (the original format).
        min_zstd_ratio: with "auto", the least shrink factor for which zstd is used.

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
    values = np.ascontiguousarray(values)
    absmax = None
    if codec in _QMAX:
        # A block's absmax is NaN or inf exactly when the block holds a non-finite value.
        absmax = block_absmax(values, block_size)
        finite = bool(np.isfinite(absmax).all())
    else:
        # max and min propagate NaN, and an inf is the max or the min: two read-only passes.
        finite = values.size == 0 or bool(np.isfinite(values.max()) and np.isfinite(values.min()))
    if not finite:
        raise_non_finite(values)

    raw = _serialize(values, codec, block_size, absmax)
    return finish_encoding(raw, codec, values.size, block_size, zstd_level, compression=compression,
                           checksum_kind=checksum_kind, min_zstd_ratio=min_zstd_ratio)


def warm_up() -> None:
    """Compiles (or loads from numba's cache) the encoder's kernels for the array types
    callers pass, writable and read-only (numpy views of JAX arrays are read-only). The first
    encode in a process otherwise waits ~0.6 s for it, with the GIL held: a service calls
    this in a background thread at start-up."""
    values = np.zeros(256, np.float32)
    frozen = values.copy()
    frozen.flags.writeable = False
    for codec in ("int4", "int8"):
        for array in (values, frozen):
            encoded = encode(array, codec)
        decode(encoded.payload, codec=codec, numel=values.size, raw_size_bytes=encoded.raw_size_bytes,
               checksum=encoded.checksum, compression=encoded.compression, checksum_kind=encoded.checksum_kind)


def finish_encoding(raw: bytes, codec: str, numel: int, block_size: int, zstd_level: int, *,
                    compression: str = "auto", checksum_kind: str = "xxh3_128",
                    min_zstd_ratio: float = MIN_ZSTD_RATIO) -> EncodedPayload:
    """Compresses a codec's raw serialization and checksums it (shared with jax_codec).

    ``compression``: "zstd", "none", or "auto": zstd when it shrinks ``raw`` at least
    ``min_zstd_ratio`` times (judged on a sample of large payloads, ``_worth_compressing``)."""
    if not min_zstd_ratio >= 1.0:
        raise CodecError(f"min_zstd_ratio={min_zstd_ratio} is invalid: must be >= 1")
    if zstd_level > zstandard.MAX_COMPRESSION_LEVEL:
        raise CodecError(
            f"zstd_level={zstd_level} is invalid: must be <= {zstandard.MAX_COMPRESSION_LEVEL}"
        )
    _check_wire_format("zstd" if compression == "auto" else compression, checksum_kind)
    payload = None
    if compression != "none":
        small = len(raw) <= 2 * _ZSTD_SAMPLE_BYTES  # judged on the whole frame, not a sample
        if compression == "zstd" or small or _worth_compressing(raw, zstd_level, min_zstd_ratio):
            # One compressor per call: instances are not thread-safe.
            payload = zstandard.ZstdCompressor(level=zstd_level, write_content_size=True).compress(raw)
        if compression == "auto" and small and len(raw) < min_zstd_ratio * len(payload):
            payload = None
        # Raw bytes never start with zstd's magic number (see infer_format).
        if payload is None and bytes(raw[:4]) == _ZSTD_MAGIC:
            payload = zstandard.ZstdCompressor(level=zstd_level, write_content_size=True).compress(raw)
    compression = "none" if payload is None else "zstd"
    if payload is None:
        payload = bytes(raw)
    return EncodedPayload(
        codec=codec,
        numel=numel,
        block_size=block_size,
        raw_size_bytes=len(raw),
        payload=payload,
        checksum=payload_digest(payload, checksum_kind),
        compression=compression,
        checksum_kind=checksum_kind,
    )


def _worth_compressing(raw: bytes, zstd_level: int, min_ratio: float) -> bool:
    """Whether zstd at ``zstd_level`` shrinks a sample of ``raw`` (its middle
    ``_ZSTD_SAMPLE_BYTES``, past the block scales) by at least ``min_ratio``. Deterministic:
    the same bytes always get the same answer."""
    start = (len(raw) - _ZSTD_SAMPLE_BYTES) // 2
    sample = bytes(memoryview(raw)[start:start + _ZSTD_SAMPLE_BYTES])
    compressed = zstandard.ZstdCompressor(level=zstd_level).compress(sample)
    return len(sample) >= min_ratio * len(compressed)


def payload_digest(payload, checksum_kind: str) -> bytes:
    """The checksum of a payload (bytes-like) under ``checksum_kind``."""
    hasher = new_hasher(checksum_kind)
    hasher.update(payload)
    return hasher.digest()


def new_hasher(checksum_kind: str):
    """An incremental hasher (``update``, ``digest``) for ``checksum_kind``."""
    if checksum_kind == "sha256":
        return hashlib.sha256()
    if checksum_kind == "xxh3_128":
        return xxhash.xxh3_128()
    raise CodecError(f"checksum_kind={checksum_kind!r} is unknown: use one of {list(CHECKSUM_KINDS)}")


def _check_wire_format(compression: str, checksum_kind: str) -> None:
    if compression not in COMPRESSIONS:
        raise CodecError(f"compression={compression!r} is unknown: use one of {list(COMPRESSIONS)}")
    if checksum_kind not in CHECKSUM_KINDS:
        raise CodecError(f"checksum_kind={checksum_kind!r} is unknown: use one of {list(CHECKSUM_KINDS)}")


def decode(
    payload: bytes,
    *,
    codec: str,
    numel: int,
    raw_size_bytes: int,
    checksum: bytes,
    block_size: int = DEFAULT_BLOCK_SIZE,
    on_chunk: ChunkVisitor | None = None,
    executor: Executor | None = None,
    compression: str | None = None,
    checksum_kind: str | None = None,
    digest: bytes | None = None,
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
        on_chunk: called as ``on_chunk(start, values)`` for consecutive, disjoint pieces of the
            result that together cover it, right after each piece is decoded (while it is in
            cache), so the caller's statistics cost no extra pass over memory. Pieces may come
            out of order and, with ``executor``, from two threads at once. Called before the
            final checks: discard what it gathered if ``decode`` raises.
        executor: when given, the second half of a large quantized payload is dequantized
            (and visited) in one of its threads while the calling thread does the first half;
            numpy releases the GIL in the work itself, so two cores share one decode.
        compression: "zstd" (a frame) or "none" (the raw serialization); None: as
            ``infer_format`` reads it from the payload (pass it for bytes from the wire).
        checksum_kind: "sha256" or "xxh3_128"; None: from the checksum's length.
        digest: the payload's digest when the caller computed it already (``stream``).

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
    raw = check_and_decompress(
        payload, codec=codec, numel=numel, raw_size_bytes=raw_size_bytes, checksum=checksum,
        block_size=block_size, compression=compression, checksum_kind=checksum_kind, digest=digest,
    )
    # errstate: a forged scale can overflow level·scale; the finiteness check reports it.
    with np.errstate(over="ignore", invalid="ignore"):
        return _deserialize(raw, codec, numel, block_size, on_chunk, executor)


@dataclass(frozen=True)
class Declared:
    """What a sender declares of a payload: ``decode``'s arguments for the checks, one definition
    for every decoder that takes them as keywords (``Declared(**keywords)`` refuses a missing or
    unknown name with the TypeError a signature would raise)."""

    codec: str
    numel: int
    raw_size_bytes: int
    checksum: bytes
    block_size: int = DEFAULT_BLOCK_SIZE
    compression: str | None = None
    checksum_kind: str | None = None


def check_and_decompress(payload: bytes, *, digest: bytes | None = None, **declared) -> bytes:
    """Every check ``decode`` makes before looking at values, then zstd: returns the raw bytes.

    ``declared``: the fields of ``Declared`` as keywords. Shared by the numpy and JAX decoders
    (``decode`` passes on the ``digest`` the streaming decoder computed chunk by chunk); raises
    what ``decode`` raises for sizes, checksum and frame.
    """
    d = Declared(**declared)
    checksum_kind = infer_format(payload, d.checksum, "zstd", d.checksum_kind)[1]
    check_sizes(d.codec, d.numel, d.raw_size_bytes, len(payload), d.block_size, None)
    check_digest(payload_digest(payload, checksum_kind) if digest is None else digest, d.checksum,
                 checksum_kind, len(payload))
    # Inferred only from bytes that passed their checksum.
    compression, _ = infer_format(payload, d.checksum, d.compression, checksum_kind)
    if compression == "none":
        check_sizes(d.codec, d.numel, d.raw_size_bytes, len(payload), d.block_size, compression)
        return payload
    try:
        content_bytes = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as err:
        raise CorruptPayloadError(f"payload is not a zstd frame: {err}") from err
    if content_bytes != d.raw_size_bytes:
        in_frame = "unknown" if content_bytes == -1 else content_bytes
        raise SizeError(
            f"zstd frame declares content size {in_frame} but raw_size_bytes={d.raw_size_bytes}: "
            "encode with write_content_size=True and matching sizes"
        )
    try:
        raw = zstandard.ZstdDecompressor().decompress(
            payload, max_output_size=d.raw_size_bytes, allow_extra_data=False
        )
    except zstandard.ZstdError as err:
        raise CorruptPayloadError(f"payload does not decompress: {err}") from err
    if len(raw) != d.raw_size_bytes:
        raise CorruptPayloadError(
            f"payload decompressed to {len(raw)} bytes, not raw_size_bytes={d.raw_size_bytes}"
        )
    return raw


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def infer_format(payload, checksum: bytes, compression: str | None = None,
                 checksum_kind: str | None = None) -> tuple[str, str]:
    """(compression, checksum_kind), each as given or, when None, read from the payload (for
    callers holding an EncodedPayload's bytes; the wire states both, PayloadInfo): the
    checksum's length tells sha256 (32 bytes) from xxh3-128 (16); the original format (sha256)
    is always a zstd frame; otherwise a zstd frame starts with zstd's magic number and raw
    bytes never do (a quantized payload starts with a scale, which cannot be that negative
    float, and ``finish_encoding`` compresses any other raw bytes that start with it)."""
    if checksum_kind is None:
        checksum_kind = "xxh3_128" if len(checksum) == CHECKSUM_BYTES["xxh3_128"] else "sha256"
    if compression is None:
        compression = "zstd" if checksum_kind == "sha256" or bytes(payload[:4]) == _ZSTD_MAGIC else "none"
    return compression, checksum_kind


def check_sizes(codec: str, numel: int, raw_size_bytes: int, payload_size_bytes: int, block_size: int,
                compression: str | None) -> None:
    """SizeError unless the declared sizes fit the codec, numel and compression (None: either)."""
    if compression is not None:
        _check_wire_format(compression, "sha256")
    expected_bytes = expected_raw_size_bytes(codec, numel, block_size)
    if raw_size_bytes != expected_bytes:
        raise SizeError(
            f"raw_size_bytes={raw_size_bytes} but codec={codec!r} with numel={numel} and "
            f"block_size={block_size} serializes to {expected_bytes}: the sender's header is wrong"
        )
    if compression == "none" and payload_size_bytes != raw_size_bytes:
        raise SizeError(f"payload is {payload_size_bytes} bytes but an uncompressed payload is its "
                        f"{raw_size_bytes} raw bytes: refusing it")
    limit_bytes = max_payload_size_bytes(raw_size_bytes)
    if payload_size_bytes > limit_bytes:
        raise SizeError(
            f"payload is {payload_size_bytes} bytes but {raw_size_bytes} raw bytes compress to at "
            f"most {limit_bytes}: refusing it"
        )


def check_digest(digest: bytes, checksum: bytes, checksum_kind: str, payload_size_bytes: int) -> None:
    """ChecksumError unless a payload's computed digest is the declared checksum."""
    if digest != bytes(checksum):
        raise ChecksumError(
            f"{checksum_kind} of the {payload_size_bytes}-byte payload does not match the declared "
            "checksum: the payload was corrupted or truncated in transit; resend it"
        )


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
