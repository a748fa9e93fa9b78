"""Checking and decoding a payload chunk by chunk, as its chunks arrive.

Owns `PayloadStream`: the receiver's side of an upload, fed each chunk's bytes in order. Each
chunk is hashed on arrival; an uncompressed payload (``compression="none"``, what ``codec.encode``
sends when zstd would not pay) is also dequantized on arrival, whole blocks at a time, and each
decoded piece goes to ``on_chunk`` while it is in cache. When the last byte is in, `finish` checks
the checksum, the levels and the values and returns them: the work left after the transfer is a
digest comparison and the tail, not a pass over the whole payload. A zstd payload is hashed
chunk by chunk but decompressed only after its checksum matched (a frame's decompression is not
bounded chunk by chunk: one small chunk can expand to gigabytes), exactly as ``codec.decode`` does.

The same checks and errors as ``codec.decode`` (sizes before anything is stored, then checksum,
levels, values), in the same order for what the sender declared; values decoded from bytes whose
checksum later fails are discarded (whatever ``on_chunk`` gathered must be discarded too).
`BufferPool` (the receiver's arrays for payloads and values, reused across uploads once nothing
references them) is owned here too.
Must not: import gRPC or protobuf (``serde.payload_stream`` builds one from a PayloadInfo).
"""

from __future__ import annotations

import sys
import threading

import numpy as np

from ddiloco.wire import codec as codec_lib
from ddiloco.wire import layout


# The pool trusts CPython's reference counts; a free-threaded build could race them.
_POOL_SAFE = sys.implementation.name == "cpython" and getattr(sys, "_is_gil_enabled", lambda: True)()


# Bytes of free arrays of one size a BufferPool keeps at most (see BufferPool). Below a 100M-parameter
# model's fragments (25M values, 100 MB): at 100M x 4 shards the pool held three free 100 MB value
# arrays at a shard's peak (12 bytes per owned parameter), since free arrays leave only at a take.
MAX_FREE_BYTES = 64 * 2**20


class BufferPool:
    """Arrays for payload streams (their bytes and decoded values), reused once nothing else
    references them, so that a receiver taking uploads of the same fragments allocates each
    buffer once. A fresh array above glibc's largest mmap threshold (32 MiB) is mapped anew and
    faulted in page by page as the payload is decoded into it: at a 100M-parameter model's
    fragments (25M values, 100 MB) that cost ~20 ms per upload on an idle 2-core VM, more under
    load, against ~10 ms for writing an array already mapped; arrays that large are no longer
    pooled (`max_free_bytes`): memory went first.

    An array is free when only the pool references it (CPython's reference count: a caller, a
    view or a buffer export all count). A `take` keeps at most `max_free` free arrays of its size
    besides the one it returns (the others go back to the allocator), and at most `max_tracked`
    arrays of a size are tracked at all (more at once are plain arrays). What the pool holds
    beyond the arrays in use is therefore at most what the uploads in flight at once used.
    Bounded by bytes too: at most `max_free_bytes` of free arrays of a size are kept, and an array
    larger than that is never tracked (freed as soon as its upload is done): a fragment shard of a
    1B-parameter model decodes ~1 GB fragments, whose idle copies would outweigh its values."""

    def __init__(self, max_free: int = 1, max_tracked: int = 32, max_free_bytes: int = MAX_FREE_BYTES) -> None:
        self._enabled = _POOL_SAFE and max_tracked > 0
        self._max_free = max_free
        self._max_free_bytes = max_free_bytes
        self._max_tracked = max_tracked
        self._arrays: dict[tuple[int, str], list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def take(self, size: int, dtype) -> np.ndarray:
        """A one-dimensional array of `size` elements of `dtype`, contents undefined."""
        dtype = np.dtype(dtype)
        # Free arrays kept besides the one returned, within the byte bound.
        keep_free = min(1 + self._max_free, self._max_free_bytes // max(1, size * dtype.itemsize)) - 1
        if not self._enabled or keep_free < 0:
            return np.empty(size, dtype)
        with self._lock:
            arrays = self._arrays.setdefault((size, dtype.str), [])
            # References of a free array: the pool's list and getrefcount's argument.
            free = [i for i in range(len(arrays)) if sys.getrefcount(arrays[i]) == 2]
            if free:
                array = arrays[free[0]]
                for i in reversed(free[1 + keep_free:]):
                    del arrays[i]  # more than the next uploads need: let it go
                return array
            array = np.empty(size, dtype)
            if len(arrays) < self._max_tracked:
                arrays.append(array)
            return array


class PayloadStream:
    """One payload, fed in order with `feed`, checked and decoded by `finish`.

    Memory: the payload's declared size (checked against what codec and numel allow before
    anything is allocated) plus, when decoded on arrival, the float32 values.
    """

    def __init__(self, *, codec: str, numel: int, raw_size_bytes: int, payload_size_bytes: int, checksum: bytes,
                 compression: str, checksum_kind: str, block_size: int = codec_lib.DEFAULT_BLOCK_SIZE,
                 on_chunk: codec_lib.ChunkVisitor | None = None, decode_on_arrival: bool = True,
                 buffers: BufferPool | None = None) -> None:
        """`decode_on_arrival`: dequantize an uncompressed payload as it arrives (False: keep only
        its bytes until `finish`, for a receiver short of memory for the values). `buffers`: where
        the payload's bytes and values are allocated (None: fresh arrays). Raises CodecError (SizeError, ChecksumError for a digest of the wrong length) when the
        declared sizes and format cannot describe a valid payload."""
        layout._check_codec(codec, block_size)
        codec_lib._check_wire_format(compression, checksum_kind)
        codec_lib.check_sizes(codec, numel, raw_size_bytes, payload_size_bytes, block_size, compression)
        if len(checksum) != codec_lib.CHECKSUM_BYTES[checksum_kind]:
            raise codec_lib.ChecksumError(
                f"checksum is {len(checksum)} bytes; a {checksum_kind} digest is {codec_lib.CHECKSUM_BYTES[checksum_kind]}")
        self.codec, self.numel, self.block_size = codec, numel, block_size
        self.raw_size_bytes, self.payload_size_bytes = raw_size_bytes, payload_size_bytes
        self.checksum, self.compression, self.checksum_kind = bytes(checksum), compression, checksum_kind
        self._on_chunk = on_chunk
        self._hasher = codec_lib.new_hasher(checksum_kind)
        self._buffer = bytearray(payload_size_bytes) if buffers is None else buffers.take(payload_size_bytes, np.uint8)
        self._view = memoryview(self._buffer)
        self.received_bytes = 0
        self._on_arrival = decode_on_arrival and compression == "none"
        if self._on_arrival:
            self._values = np.empty(numel, np.float32) if buffers is None else buffers.take(numel, np.float32)
        else:
            self._values = None
        quantized = codec in codec_lib.QUANTIZED_CODECS
        self._n_blocks = -(-numel // block_size) if quantized else 0
        self._per_byte = layout._LEVELS_PER_BYTE.get(codec, 1)
        self._main = layout.main_blocks(numel, block_size, self._per_byte) if quantized else 0
        self._scales: np.ndarray | None = None
        self._body: np.ndarray | None = None
        self._done = 0  # blocks (quantized) or values (fp32, bf16) decoded so far
        self._smallest = 127 if codec == "int8" else 8

    @property
    def decodes_on_arrival(self) -> bool:
        """Whether `finish` is cheap (the values are decoded as the bytes arrive)."""
        return self._on_arrival

    @property
    def complete(self) -> bool:
        return self.received_bytes == self.payload_size_bytes

    def feed(self, data: bytes) -> None:
        """The next bytes of the payload. SizeError past the declared size; with an uncompressed
        quantized payload, NonFiniteError as soon as its scales are in and one is invalid."""
        end = self.received_bytes + len(data)
        if end > self.payload_size_bytes:
            raise codec_lib.SizeError(f"payload exceeds its declared size of {self.payload_size_bytes} bytes")
        self._view[self.received_bytes:end] = data
        self._hasher.update(data)
        self.received_bytes = end
        if self._on_arrival:
            with np.errstate(over="ignore", invalid="ignore"):  # a forged scale: the final check reports it
                self._decode_ready()

    def _decode_ready(self) -> None:
        if self._n_blocks == 0:  # fp32, bf16: every whole value in
            ready = min(self.numel, self.received_bytes // (4 if self.codec == "fp32" else 2))
            if ready > self._done:
                layout.copy_values(self._view, self.codec, self._values, self._done, ready, self._on_chunk)
                self._done = ready
            return
        scale_bytes = 4 * self._n_blocks
        if self._scales is None:
            if self.received_bytes < scale_bytes:
                return
            self._scales = layout.read_scales(self._view, self._n_blocks)
            self._body = np.frombuffer(self._buffer, np.uint8, offset=scale_bytes)
        # Whole blocks in groups of 4, so that every group ends on a byte of levels.
        blocks_in = (self.received_bytes - scale_bytes) * self._per_byte // self.block_size
        ready = min(self._main, blocks_in // 4 * 4)
        if ready > self._done:
            self._smallest = min(self._smallest, layout.dequantize_blocks(
                self._body, self._scales, self.codec, self.block_size, self._values, self._done, ready,
                self._on_chunk))
            self._done = ready

    def digest(self) -> bytes:
        return self._hasher.digest()

    def finish(self) -> np.ndarray:
        """The decoded values (fresh, writable, finite), once every byte is in and checked.
        Raises what ``codec.decode`` raises."""
        if not self.complete:
            raise codec_lib.SizeError(
                f"payload has {self.received_bytes} bytes, header declared {self.payload_size_bytes}")
        codec_lib.check_digest(self.digest(), self.checksum, self.checksum_kind, self.payload_size_bytes)
        if not self._on_arrival:
            return codec_lib.decode(
                bytes(self._buffer), codec=self.codec, numel=self.numel, raw_size_bytes=self.raw_size_bytes,
                checksum=self.checksum, block_size=self.block_size, on_chunk=self._on_chunk,
                compression=self.compression, checksum_kind=self.checksum_kind, digest=self.digest())
        with np.errstate(over="ignore", invalid="ignore"):
            if self._n_blocks == 0:
                layout.check_finite(self._values)
                return self._values
            if self._scales is None:  # fewer values than one group of blocks: nothing decoded yet
                self._scales = layout.read_scales(self._view, self._n_blocks)
                self._body = np.frombuffer(self._buffer, np.uint8, offset=4 * self._n_blocks)
            if self._main > self._done:
                self._smallest = min(self._smallest, layout.dequantize_blocks(
                    self._body, self._scales, self.codec, self.block_size, self._values, self._done, self._main,
                    self._on_chunk))
                self._done = self._main
            return layout.finish_dequantized(self._body, self._scales, self.codec, self.block_size,
                                                self._values, self._smallest, self._on_chunk)
