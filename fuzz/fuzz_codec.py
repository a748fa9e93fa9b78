"""Coverage-guided fuzz target (atheris / libFuzzer) for the fragment decoder.

What must hold for every input: decoding a payload (and the protobuf description around it, and
the chunk stream that carries it) either succeeds with `numel` finite float32 values or raises the
decoder's own typed errors (`CodecError`, protobuf `DecodeError`, `ValueError` from chunk
reassembly). Anything else (another exception, a crash, a hang, runaway memory) is a finding.

Input layout (so seeds are easy to write): byte 0 selects the mode, the rest is mode-specific:
  0  codec.decode of arbitrary payload bytes under a fuzzed description (checksum made to match,
     so the zstd frame and codec layouts are reached)
  1  the raw (pre-zstd) serialization is fuzzed: it is zstd-compressed here, so the codec's
     scale/level parsing sees arbitrary bytes
  2  serde.decode_payload of a fuzzed protobuf PayloadInfo plus payload
  3  a fuzzed UploadFragmentRequest stream (length-prefixed messages) through parsing and
     ChunkAssembler reassembly, then decode, and the same chunks through the syncer's
     chunk-by-chunk decoder (ddiloco.wire.stream), which must agree with it

Run it:
  python fuzz/fuzz_codec.py -max_total_time=10            # the CI smoke run (tests/security/test_fuzz.py)
  make fuzz FUZZ_SECONDS=3600                             # a longer run, corpus kept in fuzz/corpus/
  python fuzz/fuzz_codec.py --make-seeds DIR              # write seed inputs (valid encodings)
  python fuzz/fuzz_codec.py crash-<sha>                   # replay a finding
The decoder's memory is bounded by numel, which the syncer checks against its fragment plan
before decoding; the harness caps numel accordingly (`_MAX_NUMEL`).
"""

from __future__ import annotations

import hashlib
import pathlib
import struct
import sys

import numpy as np
import zstandard
from google.protobuf import message as pb_message

_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

try:
    import atheris
except ImportError:  # seeds and replays work without it
    atheris = None

# numba compiles the kernels from their Python bytecode, which must stay as written: atheris's
# branch probes inside them fail numba's typing (they run as machine code, unseen by coverage anyway).
_COMPILED = ["ddiloco._jit", "ddiloco.wire._kernels", "ddiloco.algo._kernels"]

if atheris is not None:
    with atheris.instrument_imports(include=["ddiloco"], exclude=_COMPILED):
        from ddiloco.v1 import common_pb2, syncer_pb2
        from ddiloco.wire import codec, serde
else:
    from ddiloco.v1 import common_pb2, syncer_pb2
    from ddiloco.wire import codec, serde

_MAX_NUMEL = 1 << 16  # what a fragment plan would allow; the syncer checks numel before decoding
_HEAD = struct.Struct("<BBIHi")  # mode, codec index, numel, block size, raw size adjustment


def _check(values: np.ndarray, numel: int) -> None:
    if values.dtype != np.float32 or values.shape != (numel,) or not np.isfinite(values).all():
        raise AssertionError(f"decode returned {values.dtype}{values.shape} (numel {numel}) or non-finite values")


def _decode(payload: bytes, name: str, numel: int, raw_size: int, block: int) -> None:
    try:
        values = codec.decode(payload, codec=name, numel=numel, raw_size_bytes=raw_size,
                              checksum=hashlib.sha256(payload).digest(), block_size=block)
    except codec.CodecError:
        return
    _check(values, numel)


def _fix_checksum(info, payload: bytes) -> None:
    """The declared checksum made to match (under the declared kind), so the checks past it are reached."""
    kind = "xxh3_128" if info.checksum_kind == common_pb2.CHECKSUM_XXH3_128 else "sha256"
    info.checksum = codec.payload_digest(payload, kind)


def _decode_streamed(info, chunks: list[bytes]):
    """The syncer's chunk-by-chunk decoder on the same chunks: values, or the CodecError it raises."""
    try:
        stream = serde.payload_stream(info)
        for chunk in chunks:
            stream.feed(chunk)
        return stream.finish()
    except codec.CodecError as exc:
        return exc


def test_one_input(data: bytes) -> None:
    if len(data) < _HEAD.size:
        return
    mode, codec_index, numel, block, raw_adjust = _HEAD.unpack_from(data)
    body = data[_HEAD.size:]
    name = codec.CODECS[codec_index % len(codec.CODECS)]
    numel %= _MAX_NUMEL + 1
    mode %= 4
    if mode in (0, 1):
        try:
            expected = codec.expected_raw_size_bytes(name, numel, block)
        except codec.CodecError:
            expected = 0
        if mode == 0:
            _decode(body, name, numel, max(0, expected + raw_adjust % 9 - 4), block)
        else:
            raw = body
            payload = zstandard.ZstdCompressor(level=1).compress(raw)
            _decode(payload, name, numel, len(raw), block)
        return
    if mode == 2:
        split = min(len(body), raw_adjust & 0xFF)
        try:
            info = common_pb2.PayloadInfo.FromString(body[:split])
        except pb_message.DecodeError:
            return
        if info.numel > _MAX_NUMEL:
            return
        payload = body[split:]
        _fix_checksum(info, payload)
        try:
            values = serde.decode_payload(info, payload)
        except (codec.CodecError, ValueError):
            return
        _check(values, info.numel)
        return
    # mode 3: a stream of length-prefixed UploadFragmentRequest messages.
    messages, offset = [], 0
    while offset + 2 <= len(body) and len(messages) < 64:
        (size,) = struct.unpack_from("<H", body, offset)
        offset += 2
        try:
            messages.append(syncer_pb2.UploadFragmentRequest.FromString(body[offset:offset + size]))
        except pb_message.DecodeError:
            return
        offset += size
    if not messages or messages[0].WhichOneof("kind") != "header":
        return
    info = messages[0].header.payload
    if info.numel > _MAX_NUMEL or info.payload_size_bytes > 1 << 20:
        return
    assembler = serde.ChunkAssembler(info.payload_size_bytes, max_chunk_bytes=1 << 16)
    try:
        for msg in messages[1:]:
            if msg.WhichOneof("kind") != "chunk":
                return
            assembler.add(msg.chunk)
        payload = assembler.payload()
    except ValueError:
        return
    _fix_checksum(info, payload)
    streamed = _decode_streamed(info, [msg.chunk.data for msg in messages[1:]])
    try:
        values = serde.decode_payload(info, payload)
    except (codec.CodecError, ValueError):
        if not isinstance(streamed, codec.CodecError):
            raise AssertionError("the chunk-by-chunk decoder accepted a payload codec.decode refuses") from None
        return
    _check(values, info.numel)
    if isinstance(streamed, Exception) or streamed.tobytes() != values.tobytes():
        raise AssertionError(f"the chunk-by-chunk decoder disagrees with codec.decode: {streamed!r}")


def seed_inputs() -> list[bytes]:
    """Valid encodings in every mode, so fuzzing starts past the cheap checks."""
    seeds = []
    rng = np.random.default_rng(0)
    for index, name in enumerate(codec.CODECS):
        for numel, block in ((1, 1), (37, 8), (300, 128)):
            values = rng.standard_normal(numel).astype(np.float32)
            framed_enc = codec.encode(values, name, block_size=block, compression="zstd", checksum_kind="sha256")
            seeds.append(_HEAD.pack(0, index, numel, block, 4) + framed_enc.payload)
            raw = zstandard.ZstdDecompressor().decompress(framed_enc.payload)
            seeds.append(_HEAD.pack(1, index, numel, block, 0) + raw)
            for enc in (framed_enc, codec.encode(values, name, block_size=block, compression="none")):
                info = serde.payload_info_to_proto(enc).SerializeToString()
                seeds.append(_HEAD.pack(2, index, numel, block, len(info)) + info + enc.payload)
                stream = [syncer_pb2.UploadFragmentRequest(header=syncer_pb2.UploadHeader(
                    protocol_version=1, learner_id="l", payload=serde.payload_info_to_proto(enc)))]
                stream += [syncer_pb2.UploadFragmentRequest(chunk=c) for c in serde.payload_chunks(enc.payload, 64)]
                framed = b"".join(struct.pack("<H", m.ByteSize()) + m.SerializeToString() for m in stream)
                seeds.append(_HEAD.pack(3, index, numel, block, 0) + framed)
    return seeds


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[1] == "--make-seeds":
        out = pathlib.Path(argv[2])
        out.mkdir(parents=True, exist_ok=True)
        for i, seed in enumerate(seed_inputs()):
            (out / f"seed-{i:03d}").write_bytes(seed)
        return 0
    if atheris is None:
        # Without atheris: replay the given files (or the seeds) once, as a plain regression check.
        files = [pathlib.Path(a) for a in argv[1:] if not a.startswith("-")]
        inputs = [f.read_bytes() for f in files] if files else seed_inputs()
        for data in inputs:
            test_one_input(data)
        print(f"atheris is not installed: replayed {len(inputs)} inputs without fuzzing")
        return 0
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
