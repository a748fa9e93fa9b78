"""Bytes on the wire: the fragment codec (``codec``) and proto conversions (``serde``).

Imports ``ddiloco.v1`` messages at most, never ``grpc``; no I/O.
"""
