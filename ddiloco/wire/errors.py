"""The codec's errors: every one is a ``CodecError`` (a ``ValueError``), raised by ``layout`` and
``codec`` and re-exported by ``codec``."""


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
