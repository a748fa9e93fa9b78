"""Conversions between the ddiloco.v1 messages and domain objects, in one place.

Symmetric names (`x_to_proto` / `x_from_proto`); no grpc import, no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from concurrent.futures import Executor

import numpy as np

from ddiloco.algo import fragments as fragments_lib
from ddiloco.v1 import common_pb2
from ddiloco.wire import codec as codec_lib

PROTOCOL_VERSION = 1
# Initial metadata with which a syncer acknowledges an accepted UploadFragment header
# (JoinResponse.upload_header_ack): the learner sends chunks only after it.
UPLOAD_HEADER_ACK = ("ddiloco-upload", "header-accepted")

_CODEC_TO_PROTO = {
    "fp32": common_pb2.CODEC_FP32,
    "bf16": common_pb2.CODEC_BF16,
    "int8": common_pb2.CODEC_INT8,
    "int4": common_pb2.CODEC_INT4,
    "int2": common_pb2.CODEC_INT2,
}
_CODEC_FROM_PROTO = {v: k for k, v in _CODEC_TO_PROTO.items()}
_COMPRESSION_TO_PROTO = {"zstd": common_pb2.COMPRESSION_ZSTD, "none": common_pb2.COMPRESSION_NONE}
_COMPRESSION_FROM_PROTO = {v: k for k, v in _COMPRESSION_TO_PROTO.items()}
_CHECKSUM_TO_PROTO = {"sha256": common_pb2.CHECKSUM_SHA256, "xxh3_128": common_pb2.CHECKSUM_XXH3_128}
_CHECKSUM_FROM_PROTO = {v: k for k, v in _CHECKSUM_TO_PROTO.items()}


def codec_to_proto(name: str) -> int:
    """Codec name ("fp32", "bf16", "int8", "int4", "int2") to the proto enum value."""
    try:
        return _CODEC_TO_PROTO[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; expected one of {sorted(_CODEC_TO_PROTO)}") from None


def codec_from_proto(value: int) -> str:
    """Proto enum value to codec name; ValueError for unspecified or unknown values."""
    try:
        return _CODEC_FROM_PROTO[value]
    except KeyError:
        raise ValueError(f"unknown or unspecified codec enum value {value}") from None


def wire_format_from_proto(info: common_pb2.PayloadInfo) -> tuple[str, str]:
    """(compression, checksum_kind) of a PayloadInfo; ValueError for values this build does not know."""
    try:
        return _COMPRESSION_FROM_PROTO[info.compression], _CHECKSUM_FROM_PROTO[info.checksum_kind]
    except KeyError:
        raise ValueError(f"unknown compression {info.compression} or checksum kind {info.checksum_kind}") from None


def payload_info_to_proto(encoded: codec_lib.EncodedPayload) -> common_pb2.PayloadInfo:
    return common_pb2.PayloadInfo(
        codec=codec_to_proto(encoded.codec),
        numel=encoded.numel,
        block_size=encoded.block_size,
        raw_size_bytes=encoded.raw_size_bytes,
        payload_size_bytes=len(encoded.payload),
        checksum=encoded.checksum,
        compression=_COMPRESSION_TO_PROTO[encoded.compression],
        checksum_kind=_CHECKSUM_TO_PROTO[encoded.checksum_kind],
    )


def payload_chunks(payload: bytes, chunk_size_bytes: int) -> Iterator[common_pb2.PayloadChunk]:
    """Splits a payload into numbered PayloadChunk messages, the last one flagged: the chunks of
    codec.chunk_payload, each copied when its message is built (a fragment of a 1B-parameter
    model is ~1 GB: all its pieces at once were one more copy of it)."""
    if chunk_size_bytes < 1:
        codec_lib.chunk_payload(payload, chunk_size_bytes)  # raises its CodecError
    view = memoryview(payload).cast("B")
    count = max(1, -(-len(view) // chunk_size_bytes))
    for seq in range(count):
        piece = view[seq * chunk_size_bytes:(seq + 1) * chunk_size_bytes]
        yield common_pb2.PayloadChunk(seq=seq, data=piece.tobytes(), last=seq == count - 1)


class ChunkAssembler:
    """Reassembles PayloadChunk messages, enforcing order and the declared total size.

    Raises ValueError on a gap, a repeat, data past the declared size, a chunk larger than
    `max_chunk_bytes` (when given), an empty chunk that is not the last, or chunks after `last`.
    Never holds more than the declared size (one growing buffer), and the number of chunks is
    bounded by the declared size.
    """

    def __init__(self, declared_size_bytes: int, *, max_chunk_bytes: int | None = None, keep: bool = True) -> None:
        """`keep`: hold the bytes for `payload` (False: a stream.PayloadStream holds them; only
        the order and sizes are checked here, and `payload` returns b"")."""
        self._declared = declared_size_bytes
        self._max_chunk = max_chunk_bytes
        self._keep = keep
        self._size = 0
        self._buffer = bytearray()
        self._next_seq = 0
        self.done = False

    def add(self, chunk: common_pb2.PayloadChunk, data: bytes | None = None) -> None:
        """`data`: chunk.data, when the caller read it already (each read of a bytes field copies it)."""
        if data is None:
            data = chunk.data
        if self.done:
            raise ValueError(f"chunk seq {chunk.seq} arrived after the last chunk")
        if chunk.seq != self._next_seq:
            raise ValueError(f"chunk out of order: expected seq {self._next_seq}, got {chunk.seq}")
        size = len(data)
        if self._max_chunk is not None and size > self._max_chunk:
            raise ValueError(f"chunk seq {chunk.seq} has {size} bytes, more than the run's chunk size {self._max_chunk}")
        if size == 0 and not chunk.last:
            raise ValueError(f"chunk seq {chunk.seq} is empty but not the last one")
        if self._size + size > self._declared:
            raise ValueError(f"payload exceeds its declared size of {self._declared} bytes")
        if self._keep:
            self._buffer += data
        self._size += size
        self._next_seq += 1
        self.done = chunk.last

    def payload(self) -> bytes:
        if not self.done:
            raise ValueError(f"stream ended before the last chunk (got {self._next_seq} chunks)")
        if self._size != self._declared:
            raise ValueError(f"payload has {self._size} bytes, header declared {self._declared}")
        return bytes(self._buffer)


def _varint_bytes(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def chunk_message_bytes(seq: int, size_bytes: int, last: bool) -> int:
    """ByteSize() of a message whose field 2 is PayloadChunk(seq, `size_bytes` of data, last)
    (UploadFragmentRequest.chunk, WatchFragmentsResponse.chunk), without computing it from the
    message: protobuf's upb ByteSize() serializes the message, a copy of the whole chunk."""
    inner = ((1 + _varint_bytes(seq)) if seq else 0) + ((1 + _varint_bytes(size_bytes) + size_bytes) if size_bytes else 0)
    inner += 2 if last else 0
    return 1 + _varint_bytes(inner) + inner


def payload_chunks_bytes(payload_size_bytes: int, chunk_size_bytes: int) -> int:
    """The summed ByteSize() of payload_chunks' messages (as chunk_message_bytes) for a payload of
    `payload_size_bytes`, without building them."""
    full, rest = divmod(payload_size_bytes, chunk_size_bytes)
    sizes = [chunk_size_bytes] * full + ([rest] if rest or not full else [])
    return sum(chunk_message_bytes(seq, size, seq == len(sizes) - 1) for seq, size in enumerate(sizes))


def plan_to_proto(plan: fragments_lib.FragmentPlan) -> list[common_pb2.FragmentInfo]:
    return [
        common_pb2.FragmentInfo(
            fragment_id=f.fragment_id,
            offset_steps=f.offset_steps,
            numel=f.numel,
            tensors=[
                common_pb2.TensorInfo(name=t.name, shape=list(t.shape), is_embedding=t.is_embedding)
                for t in f.tensors
            ],
        )
        for f in plan.fragments
    ]


def plan_from_proto(infos, sync_period_steps: int) -> fragments_lib.FragmentPlan:
    """Rebuilds the syncer's fragment plan on a learner, exactly as the syncer made it."""
    frags = tuple(
        fragments_lib.Fragment(
            fragment_id=info.fragment_id,
            offset_steps=info.offset_steps,
            tensors=tuple(
                fragments_lib.TensorSpec(name=t.name, shape=tuple(t.shape), is_embedding=t.is_embedding)
                for t in info.tensors
            ),
        )
        for info in infos
    )
    if [f.fragment_id for f in frags] != list(range(len(frags))):
        raise ValueError("fragment ids in the run config must be 0..P-1 in order")
    return fragments_lib.FragmentPlan(fragments=frags, sync_period_steps=sync_period_steps)


# The fragment digest is fragment math (ddiloco.algo.fragments); kept here under its old name.
params_sha256 = fragments_lib.fragment_sha256


def versions_to_proto(versions: Mapping[int, int]) -> list[common_pb2.FragmentVersion]:
    return [common_pb2.FragmentVersion(fragment_id=f, version=v) for f, v in sorted(versions.items())]


def versions_from_proto(items) -> dict[int, int]:
    return {int(x.fragment_id): int(x.version) for x in items}


def decode_payload(info: common_pb2.PayloadInfo, payload: bytes, *,
                   on_chunk: codec_lib.ChunkVisitor | None = None, executor: Executor | None = None) -> np.ndarray:
    """Decodes a payload described by `info` (all of codec.decode's checks apply; `on_chunk`
    and `executor` as codec.decode takes them)."""
    try:
        compression, checksum_kind = wire_format_from_proto(info)
    except ValueError as exc:
        raise codec_lib.CodecError(str(exc)) from None
    described = _described(info, codec_from_proto(info.codec), compression, checksum_kind)
    return decode_described(described, payload, on_chunk=on_chunk, executor=executor)


def payload_stream(info: common_pb2.PayloadInfo, *, on_chunk: codec_lib.ChunkVisitor | None = None,
                   decode_on_arrival: bool = True, buffers=None):
    """A stream.PayloadStream for the payload `info` describes (CodecError when it cannot be one);
    `buffers`: a stream.BufferPool for its arrays."""
    try:
        compression, checksum_kind = wire_format_from_proto(info)
        codec = codec_from_proto(info.codec)
    except ValueError as exc:
        raise codec_lib.CodecError(str(exc)) from None
    return described_payload_stream(_described(info, codec, compression, checksum_kind), on_chunk=on_chunk,
                                    decode_on_arrival=decode_on_arrival, buffers=buffers)


@dataclasses.dataclass(frozen=True)
class PayloadDescription:
    """A PayloadInfo in plain values, enum values as names, for code that must not read protobuf
    (the syncer's admission). Enum values this build does not know stay visible: their name is ""
    and `codec_error` / `format_error` hold the error the *_from_proto conversion raised, so that a
    receiver refuses them in its own order, with the same message."""

    codec: str  # one of codec.CODECS, or "" (codec_error)
    numel: int
    block_size: int  # 0: unset (codec.DEFAULT_BLOCK_SIZE applies)
    raw_size_bytes: int
    payload_size_bytes: int
    checksum: bytes
    compression: str  # "zstd" or "none", or "" (format_error)
    checksum_kind: str  # "sha256" or "xxh3_128", or "" (format_error)
    codec_error: str = ""
    format_error: str = ""


def _described(info: common_pb2.PayloadInfo, codec: str, compression: str, checksum_kind: str, *,
               codec_error: str = "", format_error: str = "") -> PayloadDescription:
    return PayloadDescription(
        codec=codec, numel=int(info.numel), block_size=int(info.block_size), raw_size_bytes=int(info.raw_size_bytes),
        payload_size_bytes=int(info.payload_size_bytes), checksum=bytes(info.checksum), compression=compression,
        checksum_kind=checksum_kind, codec_error=codec_error, format_error=format_error)


def payload_description_from_proto(info: common_pb2.PayloadInfo) -> PayloadDescription:
    """The plain form of `info`; never raises (unknown enum values: see PayloadDescription)."""
    codec = compression = checksum_kind = codec_error = format_error = ""
    try:
        codec = codec_from_proto(info.codec)
    except ValueError as exc:
        codec_error = str(exc)
    try:
        compression, checksum_kind = wire_format_from_proto(info)
    except ValueError as exc:
        format_error = str(exc)
    return _described(info, codec, compression, checksum_kind, codec_error=codec_error, format_error=format_error)


def _check_described(described: PayloadDescription) -> None:
    """CodecError for a description with unknown enum values, the wire format's error first."""
    if described.format_error or described.codec_error:
        raise codec_lib.CodecError(described.format_error or described.codec_error)


def decode_described(described: PayloadDescription, payload: bytes, *,
                     on_chunk: codec_lib.ChunkVisitor | None = None, executor: Executor | None = None) -> np.ndarray:
    """decode_payload for a PayloadDescription (CodecError, too, for its unknown enum values)."""
    _check_described(described)
    return codec_lib.decode(
        payload,
        codec=described.codec,
        numel=described.numel,
        raw_size_bytes=described.raw_size_bytes,
        checksum=described.checksum,
        block_size=described.block_size or codec_lib.DEFAULT_BLOCK_SIZE,
        on_chunk=on_chunk,
        executor=executor,
        compression=described.compression,
        checksum_kind=described.checksum_kind,
    )


def described_payload_stream(described: PayloadDescription, *, on_chunk: codec_lib.ChunkVisitor | None = None,
                             decode_on_arrival: bool = True, buffers=None):
    """payload_stream for a PayloadDescription (CodecError when it cannot be one); `buffers`: a
    stream.BufferPool for its arrays."""
    from ddiloco.wire import stream as stream_lib

    _check_described(described)
    return stream_lib.PayloadStream(
        codec=described.codec, numel=described.numel, raw_size_bytes=described.raw_size_bytes,
        payload_size_bytes=described.payload_size_bytes, checksum=described.checksum,
        compression=described.compression, checksum_kind=described.checksum_kind,
        block_size=described.block_size or codec_lib.DEFAULT_BLOCK_SIZE, on_chunk=on_chunk,
        decode_on_arrival=decode_on_arrival, buffers=buffers)
