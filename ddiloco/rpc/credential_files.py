"""Credential files a server reads and re-reads while it runs: the bearer token table (`TokenTable`)
and the certificate deny list (`DenyList`), with certificate serial parsing (split out of
ddiloco.rpc.security, which re-exports the public names)."""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
import os
import re
import threading
import time
from collections.abc import Mapping
from typing import Any

from ddiloco import extras
from ddiloco.rpc import errors
from ddiloco.rpc.identity import Identity

_LOG = logging.getLogger("ddiloco.security")


def read_credential(path: str, what: str) -> bytes:
    """The bytes of a credential file; ValueError naming `what` and the path when it cannot be read."""
    try:
        return open(path, "rb").read()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path!r}: {exc.strerror or exc}") from None


_DIGEST_PREFIX = "sha256:"
_HEX_DIGEST_RE = re.compile(r"[0-9a-f]{64}")


def _presented_key(token: str) -> bytes:
    """The table key of a token a client presents: always the sha256 of the token as a raw secret.

    A presented credential is never read as a digest, even when it looks like `sha256:<hex>`:
    otherwise the digests stored in the token file would themselves be credentials (pass-the-hash),
    and anyone who can read the file could act as anyone in it.
    """
    return hashlib.sha256(token.encode()).digest()


def _file_key(entry: str) -> bytes:
    """The table key of a token file entry: a plaintext token is hashed, a `sha256:<hex>` entry is
    already the digest of the token its holder presents (ValueError if it is not 64 hex digits)."""
    if entry.startswith(_DIGEST_PREFIX):
        digest = entry[len(_DIGEST_PREFIX):].strip().lower()
        if not _HEX_DIGEST_RE.fullmatch(digest):
            raise ValueError("a token entry starting with sha256: must be followed by 64 hex digits")
        return bytes.fromhex(digest)
    return _presented_key(entry)


class _WatchedFile:
    """A credential file parsed at start and re-parsed, at most every `reload_interval_s`, when it
    changes (modification time, size or inode: an atomic replace counts), so revocations take
    effect without a restart. A file that cannot be read or parsed at start is a ValueError; on a
    re-read it is logged and the previous contents stay in force (a half-written or deleted file
    neither opens the door nor locks everyone out)."""

    what = "file"

    def __init__(self, path: str, *, reload_interval_s: float = 1.0) -> None:
        self.path = path
        self._interval_s = reload_interval_s
        self._lock = threading.Lock()
        self._checked_at = time.monotonic()
        self._signature: tuple[int, int, int] | None = None
        self._load(initial=True)

    def _parse(self, data: bytes) -> None:
        """Parses `data` and installs it (raises ValueError/TypeError/... without installing)."""
        raise NotImplementedError

    def _load(self, *, initial: bool) -> None:
        try:
            st = os.stat(self.path)
            signature = (st.st_mtime_ns, st.st_size, st.st_ino)
            if signature == self._signature:
                return
            self._parse(read_credential(self.path, self.what))
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            if initial:
                raise ValueError(f"{self.what} {self.path!r}: {exc}") from None
            _LOG.error(f"{self.what} {self.path!r} not reloaded, keeping the previous contents: {exc}")
            return
        self._signature = signature
        if not initial:
            _LOG.info(f"{self.what} {self.path!r} reloaded: {self._summary()}")

    def _summary(self) -> str:
        return ""

    def _refresh(self) -> None:
        """Re-reads the file if it changed and the interval has passed (call under self._lock)."""
        now = time.monotonic()
        if now - self._checked_at >= self._interval_s:
            self._checked_at = now
            self._load(initial=False)


class TokenTable(_WatchedFile):
    """Bearer tokens -> identities, with a revocation list; re-read when the file changes.

    File: `{"tokens": {"<token or sha256:hex>": "learner/learner-0", ...}, "revoked": [...]}`.
    A `sha256:<hex>` entry is the digest of the token its holder presents; a client always presents
    the token itself, which is hashed (a presented `sha256:...` string is just an unknown token).
    Only sha256 digests of tokens are kept in memory, and a presented token's digest is compared
    with every stored one in constant time (`hmac.compare_digest`, no early exit), so the time a
    lookup takes does not depend on how much of a stored digest a guess matches.
    """

    what = "token file"

    def __init__(self, path: str, *, reload_interval_s: float = 1.0) -> None:
        self._tokens: tuple[tuple[bytes, Identity], ...] = ()
        self._revoked: tuple[bytes, ...] = ()
        super().__init__(path, reload_interval_s=reload_interval_s)

    def _parse(self, data: bytes) -> None:
        table = json.loads(data)
        tokens = tuple((_file_key(t), Identity.parse(i)) for t, i in dict(table.get("tokens", {})).items())
        revoked = tuple(_file_key(t) for t in table.get("revoked", []))
        self._tokens, self._revoked = tokens, revoked

    def _summary(self) -> str:
        return f"{len(self._tokens)} tokens, {len(self._revoked)} revoked"

    def lookup(self, token: str) -> Identity:
        """The identity of `token`; Unauthenticated if unknown or revoked."""
        key = _presented_key(token)  # hashed as a raw secret, never taken as a digest
        with self._lock:
            self._refresh()
            tokens, revoked_keys = self._tokens, self._revoked
        revoked = False
        for stored in revoked_keys:
            revoked |= hmac.compare_digest(stored, key)
        identity = None
        for stored, candidate in tokens:
            if hmac.compare_digest(stored, key):
                identity = candidate
        if revoked:
            raise errors.Unauthenticated("bearer token has been revoked", reason="revoked_token")
        if identity is None:
            raise errors.Unauthenticated("bearer token is not valid", reason="invalid_token")
        return identity


# ------------------------------------------------------------------------- certificate deny list

# RFC 5280: a serial number is a positive integer of at most 20 octets.
_SERIAL_RE = re.compile(r"(?:0x)?([0-9a-f]{1,40})")


def parse_serial(text: str) -> int:
    """A certificate serial number written in hex (`0x` and `:` separators, as openssl prints
    them, allowed); ValueError otherwise."""
    match = _SERIAL_RE.fullmatch(text.strip().lower().replace(":", ""))
    if match is None:
        raise ValueError(f"{text!r} is not a certificate serial number (hex, at most 20 octets)")
    return int(match.group(1), 16)


def format_serial(serial: int) -> str:
    """The deny list's spelling of a serial number: lower-case hex, `0x` prefix."""
    return f"0x{serial:x}"


def parse_deny_list(text: str) -> tuple[frozenset[int], frozenset[Identity]]:
    """(serials, identities) of a deny list: one entry a line, a certificate serial in hex or an
    identity (`kind/name` or `spiffe://ddiloco/kind/name`); `#` starts a comment. ValueError
    names the first bad line."""
    serials: set[int] = set()
    identities: set[Identity] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        entry = raw.split("#", 1)[0].strip()
        if not entry:
            continue
        try:
            if "/" in entry:
                identities.add(Identity.parse(entry))
            else:
                serials.add(parse_serial(entry))
        except ValueError as exc:
            raise ValueError(f"line {number}: {exc}") from None
    return frozenset(serials), frozenset(identities)


@functools.lru_cache(maxsize=1024)
def _serial_of_pem(pem: bytes) -> int | None:
    # Imported here: only servers with a deny list parse peer certificates (DenyList checks at start
    # that the certificates extra is there).
    x509 = extras.require("cryptography.x509", "certificates")

    try:
        return x509.load_pem_x509_certificate(pem).serial_number
    except ValueError:
        return None


def peer_certificate_serial(auth_context: Mapping[str, Any]) -> int | None:
    """The serial number of the verified client certificate in a call's auth context (grpc-core
    puts the peer's PEM there as `x509_pem_cert`), or None without one."""
    for value in auth_context.get("x509_pem_cert", ()) or ():
        return _serial_of_pem(value if isinstance(value, bytes) else str(value).encode())
    return None


class DenyList(_WatchedFile):
    """Revoked client certificates, by serial number or by identity (`--tls-deny-list`).

    Checked on every call after the TLS handshake: the handshake itself cannot consult it (grpcio
    offers no certificate-verification callback or CRL option), so a revoked certificate still
    connects, and every call it makes is UNAUTHENTICATED. Re-read when the file changes.
    """

    what = "deny list"

    def __init__(self, path: str, *, reload_interval_s: float = 1.0) -> None:
        extras.require("cryptography.x509", "certificates")  # a server with a deny list fails at start without it
        self._serials: frozenset[int] = frozenset()
        self._identities: frozenset[Identity] = frozenset()
        super().__init__(path, reload_interval_s=reload_interval_s)

    def _parse(self, data: bytes) -> None:
        self._serials, self._identities = parse_deny_list(data.decode())

    def _summary(self) -> str:
        return f"{len(self._serials)} serials, {len(self._identities)} identities"

    def check(self, *, serial: int | None = None, identity: Identity | None = None) -> None:
        """Unauthenticated if the certificate `serial` or `identity` is denied."""
        with self._lock:
            self._refresh()
            serials, identities = self._serials, self._identities
        if serial is not None and serial in serials:
            raise errors.Unauthenticated(
                f"client certificate {format_serial(serial)} has been revoked (deny list); ask for a new one",
                reason="revoked_certificate")
        if identity is not None and identity in identities:
            raise errors.Unauthenticated(f"identity {identity} has been revoked (deny list)",
                                         reason="revoked_identity")
