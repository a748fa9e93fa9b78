"""The learner's codec: jitted JAX quantize+pack and unpack+dequantize, byte-identical to codec.py.

Owns: one fused XLA kernel per (codec, numel, block size) that turns a flat float32 vector into
``layout.py``'s raw layout (block absmax, scale, levels, packing), and the inverse kernel.
zstd, sha256 and every check of a received payload stay in ``codec.py`` (shared code), so the
bytes on the wire and the errors raised are the same whichever side encoded.
Must not: do I/O, or be imported by processes that have no JAX (the checkpoint store).

Why the formulas look the way they do (they must give codec.py's bits, and XLA on CPU
rewrites ``x / broadcast(s)`` and ``x / constant`` into multiplications by a reciprocal):
  * scale = absmax / qmax is divided by a runtime vector of qmax (never rewritten), then
    stepped down with ``nextafter`` where qmax·scale > absmax, exactly as codec.py does;
  * levels use x · fl(1/scale), a multiplication in both implementations.
XLA on CPU flushes subnormals to zero; layout.py's layout is defined with the same flush, so
tests compare the raw bytes with codec.py's over random, structured, extreme and subnormal
inputs.

On CPU a 64-byte-aligned numpy input is handed to XLA without a copy (``device_put`` with
``may_alias``); other inputs are first copied once into an aligned buffer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ddiloco.wire import codec as codec_lib
from ddiloco.wire import layout

_ALIGN = 64
_MIN_SCALE = np.float32(np.finfo(np.float32).tiny)
_ZERO_CODE = {"int8": 0, "int4": 8, "int2": 2}
# XLA:CPU compiles for 256-bit vectors by default, also where the CPU has 512-bit ones (LLVM's
# preference for AVX-512 machines, against clock throttling in compute-heavy code). These kernels
# are memory-bound: 512-bit vectors took the int4 encode of 131,072 values from 65 to 54 us on the
# 2-core Xeon VM (one core, interleaved micro-benchmark). A preference only: CPUs without them, and other
# backends, ignore it. It changes no result (tests/unit/test_jax_codec*.py hold the bytes equal).
_KERNEL_OPTIONS = {"xla_cpu_prefer_vector_width": 512}
# Vectors with a tail at least this long are split into whole blocks and tail on the host
# (zero-copy views) before the kernel; below it the host-side split costs more than it saves.
_MIN_SPLIT_VALUES = 1 << 20


def _per_byte(codec: str) -> int:
    return layout._LEVELS_PER_BYTE[codec]


def _qmax(codec: str) -> int:
    return layout._QMAX[codec]


def to_device(values: np.ndarray) -> jax.Array:
    """A numpy array as a JAX array: zero-copy when 64-byte aligned (CPU), else one copy."""
    values = np.ascontiguousarray(values)
    if values.ctypes.data % _ALIGN:
        buffer = np.empty(values.nbytes + _ALIGN, np.uint8)
        offset = -buffer.ctypes.data % _ALIGN
        aligned = buffer[offset : offset + values.nbytes].view(values.dtype).reshape(values.shape)
        np.copyto(aligned, values)
        values = aligned
    return jax.device_put(values, may_alias=True)


@functools.lru_cache(maxsize=64)
def _qmax_vector(n_blocks: int, qmax: int) -> jax.Array:
    # A runtime operand (not a constant), so XLA keeps the division exact.
    return jax.device_put(np.full(n_blocks, qmax, np.float32))


def _main_blocks(numel: int, block_size: int, per_byte: int) -> int:
    """Whole blocks handled as one 2-D array (layout.main_blocks); the small rest is padded on
    its own: padding the whole vector made XLA copy it twice."""
    return layout.main_blocks(numel, block_size, per_byte)


def _scales(blocks: jax.Array, qvec: jax.Array, codec: str):
    # max(max x, -min x) is max |x| (NaN propagates), and XLA reduces it ~2x faster on CPU.
    absmax = jnp.maximum(jnp.max(blocks, axis=1), -jnp.min(blocks, axis=1))
    scales = absmax / qvec
    scales = jnp.where(scales * qvec > absmax, jnp.nextafter(scales, jnp.float32(0)), scales)
    scales = jnp.maximum(scales, _MIN_SCALE)
    if codec == "int2":
        scales = jnp.minimum(scales, jnp.float32(2.0**126))
    return absmax, jnp.where(absmax >= _MIN_SCALE, scales, jnp.float32(0))


def _codes(blocks: jax.Array, scales: jax.Array, codec: str) -> jax.Array:
    positive = scales > 0
    inv = jnp.where(positive, 1 / jnp.where(positive, scales, jnp.float32(1)), jnp.float32(0))
    u = blocks * inv[:, None]
    if codec == "int2":
        magnitude = jnp.minimum(jnp.floor(jnp.abs(u) * jnp.float32(0.5)), jnp.float32(1))
        codes = (jnp.copysign(magnitude + jnp.float32(0.5), u) + jnp.float32(1.5)).astype(jnp.uint8)
    elif codec == "int4":
        codes = (jnp.round(u) + 8).astype(jnp.uint8)
    else:
        codes = jax.lax.bitcast_convert_type(jnp.round(u).astype(jnp.int8), jnp.uint8)
    return codes.reshape(-1)


def _pack(codes: jax.Array, codec: str) -> jax.Array:
    per_byte = _per_byte(codec)
    n_codes = -(-codes.shape[0] // per_byte) * per_byte
    if n_codes > codes.shape[0]:
        codes = jnp.pad(codes, (0, n_codes - codes.shape[0]), constant_values=_ZERO_CODE[codec])
    if codec == "int4":
        w = jax.lax.bitcast_convert_type(codes.reshape(-1, 2), jnp.uint16)
        return (w | (w >> 4)).astype(jnp.uint8)  # low byte: c0 | c1 << 4
    if codec == "int2":
        w = jax.lax.bitcast_convert_type(codes.reshape(-1, 4), jnp.uint32)
        return (w | (w >> 6) | (w >> 12) | (w >> 18)).astype(jnp.uint8)
    return codes


@functools.partial(jax.jit, static_argnames=("codec", "block_size"), compiler_options=_KERNEL_OPTIONS)
def _quantize_kernel(main: jax.Array, tail: jax.Array, qvec: jax.Array, *, codec: str, block_size: int):
    # main: the whole blocks (layout.main_blocks), tail: the rest zero-padded to whole blocks.
    # They arrive as separate arguments: slicing one vector inside the kernel made XLA copy the
    # main part first whenever a tail existed (measured: 3x slower at 25M values).
    main_blocks = main.shape[0] // block_size
    outputs = []
    for part, qpart in ((main, qvec[:main_blocks]), (tail, qvec[main_blocks:])):
        if part.shape[0]:
            blocks = part.reshape(-1, block_size)
            absmax, scales = _scales(blocks, qpart, codec)
            outputs.append((absmax, scales, _pack(_codes(blocks, scales, codec), codec)))
    # Only whether every block absmax is finite leaves the kernel (NaN and inf propagate through
    # it): one flag instead of an n_blocks vector is one output buffer less per call.
    finite = functools.reduce(jnp.logical_and, [jnp.all(jnp.isfinite(o[0])) for o in outputs])
    scales = jnp.concatenate([o[1] for o in outputs]) if len(outputs) > 1 else outputs[0][1]
    return finite, scales, tuple(o[2] for o in outputs)


@functools.partial(jax.jit, static_argnames=("codec", "block_size"), compiler_options=_KERNEL_OPTIONS)
def _quantize_whole(x: jax.Array, qvec: jax.Array, *, codec: str, block_size: int):
    """The kernel on one vector, split into whole blocks and tail inside: for vectors without a
    tail (no copy then) and small ones (a host-side split costs more than XLA's copy)."""
    main = _main_blocks(x.shape[0], block_size, _per_byte(codec)) * block_size
    rest = x[main:]
    tail = jnp.pad(rest, (0, qvec.shape[0] * block_size - x.shape[0]))
    return _quantize_kernel.__wrapped__(x[:main], tail, qvec, codec=codec, block_size=block_size)


def _split_blocks(values: np.ndarray | jax.Array, codec: str, block_size: int) -> tuple[jax.Array, jax.Array]:
    """(whole blocks, the rest zero-padded to whole blocks) as device arrays. On CPU the whole
    blocks are a zero-copy view of the input (host numpy, or a CPU jax.Array's buffer); zeros do
    not change a block's absmax and take the code of +0.0, as codec.py pads."""
    numel = values.shape[0]
    n_blocks = -(-numel // block_size)
    main = _main_blocks(numel, block_size, _per_byte(codec)) * block_size
    on_cpu = not isinstance(values, jax.Array) or all(d.platform == "cpu" for d in values.devices())
    if not on_cpu:  # keep the data on its device
        rest = values[main:]
        return values[:main], jnp.pad(rest, (0, n_blocks * block_size - numel))
    host = np.asarray(values, np.float32)
    tail = np.zeros(n_blocks * block_size - main, np.float32)
    tail[: numel - main] = host[main:]
    return to_device(host[:main]), to_device(tail)


def quantize(values: np.ndarray | jax.Array, codec: str, block_size: int = codec_lib.DEFAULT_BLOCK_SIZE):
    """Runs the quantize+pack kernel; returns device arrays (whether every block absmax is
    finite, scales, packed parts).

    The raw layout is ``scales`` then the packed parts concatenated, cut to the payload's level
    bytes (the last part may carry padding codes). The caller raises on a non-finite input.
    """
    if not isinstance(values, jax.Array):
        values = np.asarray(values, np.float32)
    numel = values.shape[0]
    n_blocks = -(-numel // block_size)
    qvec = _qmax_vector(n_blocks, _qmax(codec))
    if numel < _MIN_SPLIT_VALUES or _main_blocks(numel, block_size, _per_byte(codec)) * block_size == numel:
        x = values if isinstance(values, jax.Array) else to_device(values)
        return _quantize_whole(x, qvec, codec=codec, block_size=block_size)
    main, tail = _split_blocks(values, codec, block_size)
    return _quantize_kernel(main, tail, qvec, codec=codec, block_size=block_size)


def encode(
    values: np.ndarray,
    codec: str,
    *,
    block_size: int = codec_lib.DEFAULT_BLOCK_SIZE,
    zstd_level: int = 3,
) -> codec_lib.EncodedPayload:
    """``codec.encode`` with the quantization jitted: same arguments, errors and bytes.

    fp32 and bf16 (no quantization) and empty vectors go through ``codec.encode`` itself.
    """
    values_np = np.asarray(values) if not isinstance(values, jax.Array) else None
    if codec not in codec_lib.QUANTIZED_CODECS or (values_np is not None and values_np.size == 0):
        return codec_lib.encode(np.asarray(values), codec, block_size=block_size, zstd_level=zstd_level)
    layout._check_codec(codec, block_size)
    if zstd_level > codec_lib.zstandard.MAX_COMPRESSION_LEVEL:
        # Same message as codec.encode.
        return codec_lib.encode(np.zeros(0, np.float32), codec, block_size=block_size, zstd_level=zstd_level)
    shape, dtype = (values_np.shape, values_np.dtype) if values_np is not None else (values.shape, values.dtype)
    if len(shape) != 1 or dtype != np.float32:
        raise codec_lib.CodecError(f"values is {dtype}{list(shape)}: pass a 1-D float32 vector")
    finite, scales, parts = quantize(values if values_np is None else values_np, codec, block_size)
    if not bool(finite):
        layout.raise_non_finite(np.asarray(values))
    numel = shape[0]
    level_bytes = -(-numel // _per_byte(codec))
    pieces = [np.asarray(scales).astype("<f4", copy=False).tobytes()]
    remaining = level_bytes
    for part in parts:
        chunk = np.asarray(part)[:remaining]
        pieces.append(chunk.tobytes())
        remaining -= chunk.size
    return codec_lib.finish_encoding(b"".join(pieces), codec, numel, block_size, zstd_level)


def _levels(body: jax.Array, codec: str):
    """Float levels of packed bytes, and whether any stored level is invalid."""
    if codec == "int8":
        signed = jax.lax.bitcast_convert_type(body, jnp.int8)
        return signed.astype(jnp.float32), jnp.any(signed == -128)
    if codec == "int4":
        w = body.astype(jnp.uint16)
        w = (w & 0x0F) | ((w & 0xF0) << 4)
        codes = jax.lax.bitcast_convert_type(w, jnp.uint8).reshape(-1)
        return codes.astype(jnp.float32) - 8, jnp.any(codes == 0)
    w = body.astype(jnp.uint32)
    w = (w & 0x03) | ((w & 0x0C) << 6) | ((w & 0x30) << 12) | ((w & 0xC0) << 18)
    codes = jax.lax.bitcast_convert_type(w, jnp.uint8).reshape(-1)
    return codes.astype(jnp.float32) * 2 - 3, jnp.bool_(False)


@functools.partial(jax.jit, static_argnames=("codec", "numel", "block_size"), compiler_options=_KERNEL_OPTIONS)
def _dequantize_kernel(scales: jax.Array, body: jax.Array, *, codec: str, numel: int, block_size: int):
    n_blocks = scales.shape[0]
    per_byte = _per_byte(codec)
    main = _main_blocks(numel, block_size, per_byte)
    parts, invalid = [], jnp.bool_(False)
    if main:
        levels, bad = _levels(body[: main * block_size // per_byte], codec)
        parts.append((levels.reshape(main, block_size) * scales[:main, None]).reshape(-1))
        invalid = invalid | bad
    if n_blocks > main:
        levels, _ = _levels(body[main * block_size // per_byte :], codec)
        levels = levels[: numel - main * block_size]  # padding codes past the end are not checked
        if codec == "int4":
            invalid = invalid | jnp.any(levels == -8)
        elif codec == "int8":
            invalid = invalid | jnp.any(levels == -128)
        padded = jnp.pad(levels, (0, (n_blocks - main) * block_size - levels.shape[0]))
        tail = (padded.reshape(n_blocks - main, block_size) * scales[main:, None]).reshape(-1)
        parts.append(tail[: numel - main * block_size])
    return tuple(parts), invalid


def dequantize(raw: bytes, codec: str, numel: int, block_size: int = codec_lib.DEFAULT_BLOCK_SIZE):
    """Runs the unpack+dequantize kernel on a raw layout whose size was checked; returns
    (the values as device arrays in consecutive parts, whether any stored level was invalid).
    Scales are not checked here."""
    n_blocks = -(-numel // block_size)
    scales = np.frombuffer(raw, "<f4", count=n_blocks).astype(np.float32)
    body = np.frombuffer(raw, np.uint8, offset=4 * n_blocks)
    return _dequantize_kernel(to_device(scales), to_device(body), codec=codec, numel=numel, block_size=block_size)


def decode(payload: bytes, **declared) -> np.ndarray:
    """``codec.decode`` with the dequantization jitted: same checks, errors and values.
    ``declared``: the fields of ``codec.Declared`` as keywords (``codec.decode``'s arguments)."""
    d = codec_lib.Declared(**declared)
    if d.codec not in codec_lib.QUANTIZED_CODECS or d.numel == 0:
        return codec_lib.decode(payload, **declared)
    raw = codec_lib.check_and_decompress(payload, **declared)
    n_blocks = -(-d.numel // d.block_size)
    scales = np.frombuffer(raw, "<f4", count=n_blocks)
    if not (np.isfinite(scales) & (scales >= 0)).all():
        # codec.py's own path raises the detailed NonFiniteError.
        return codec_lib.decode(payload, **declared)
    parts, invalid = dequantize(raw, d.codec, d.numel, d.block_size)
    values = np.concatenate([np.asarray(p) for p in parts])  # fresh and writable, as codec.decode returns
    if bool(invalid) or (scales.size and float(scales.max()) * _qmax(d.codec) > layout._F32_MAX
                         and not np.isfinite(values).all()):
        return codec_lib.decode(payload, **declared)
    return values
