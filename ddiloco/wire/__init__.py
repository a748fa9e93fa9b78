"""Bytes on the wire: the fragment codec (``codec``; the codecs' raw byte layouts in ``layout``) and
proto conversions (``serde``).

Imports ``ddiloco.v1`` messages at most, never ``grpc``; no I/O.
"""
