"""Transport security and caller identity, shared by every service and client.

What this module decides (docs/security.md explains why):

* **Transport.** A server either serves mutual TLS (`--tls-ca`, `--tls-cert`, `--tls-key`: file
  paths, so Kubernetes secret mounts and compose volumes work) or plaintext, and plaintext only
  when `--insecure` is given explicitly; with neither a service refuses to start. Under mTLS every
  client must present a certificate signed by the CA, or the TLS handshake fails before any RPC.
* **Identity.** `Identity(kind, name)`, carried by a certificate as the URI SAN
  `spiffe://ddiloco/<kind>/<name>` (written by `ddiloco certs`), or by a bearer token listed in a
  token file (`{"tokens": {token: "kind/name"}, "revoked": [token, ...]}`, tokens may be given as
  `sha256:<hex>`, the digest of the token, which clients still present in full: a digest is never
  itself a credential; the file is re-read when it changes, so revoking takes effect without a
  restart). Kinds: `learner`, `evaluator`, `reader` (the training state only), `model-reader`
  (the state and the model's weights), `syncer` (the store's only writer), `checkpoint`. With
  neither mTLS nor a token file, every caller is `ANONYMOUS`, which may do anything (local runs).
* **Revocation.** `--tls-deny-list FILE` (`DenyList`): certificate serials and identities, one a
  line, re-read when the file changes; a listed certificate still completes the handshake (grpcio
  cannot consult a list there) and every call it makes is UNAUTHENTICATED.
* **Authorization.** `AuthInterceptor` authenticates each ddiloco.v1 call before its handler
  runs (no credential or an invalid/revoked one: UNAUTHENTICATED) and checks the method against a
  per-service policy of allowed kinds (PERMISSION_DENIED). Handlers then check request fields
  against `current_identity()`: a learner may only act as itself (`require_learner`). Health and
  reflection are not intercepted; with TLS on they are also served on a separate plaintext port
  for probes (`ddiloco.rpc.server.start_server(health_bind=...)`).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import hashlib
import hmac
import inspect
import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from ddiloco.rpc import errors
from ddiloco.rpc import interceptors as interceptors_lib

_LOG = logging.getLogger("ddiloco.security")

# Every reason an AuthInterceptor refusal carries. The services export each at 0 before the first
# refusal: a counter series that appears only with its first increment is invisible to rate() and
# to dashboards until then. Only refusals after a completed TLS handshake exist here: a failed
# handshake (no client certificate, another CA, expired, plaintext) never reaches Python (grpcio
# runs the handshake in its core and offers no callback for it; docs/security.md).
AUTH_FAILURE_REASONS = ("no_credentials", "invalid_token", "revoked_token", "no_identity", "unknown_identity",
                        "revoked_certificate", "revoked_identity", "wrong_role", "wrong_learner")

KIND_LEARNER = "learner"
KIND_EVALUATOR = "evaluator"
KIND_READER = "reader"  # the training state only (operators, dashboards)
KIND_MODEL_READER = "model-reader"  # the training state and the model's weights (exporters)
KIND_SYNCER = "syncer"
KIND_CHECKPOINT = "checkpoint"
KINDS = (KIND_LEARNER, KIND_EVALUATOR, KIND_READER, KIND_MODEL_READER, KIND_SYNCER, KIND_CHECKPOINT)
# Who may observe without taking part: the training state, and the model itself (weights).
STATE_READ_KINDS = frozenset({KIND_EVALUATOR, KIND_READER, KIND_MODEL_READER})
MODEL_READ_KINDS = frozenset({KIND_EVALUATOR, KIND_MODEL_READER})

URI_PREFIX = "spiffe://ddiloco/"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Shared switch for every service of a local run (LocalCluster sets it); a service's own
# DDILOCO_<SERVICE>_INSECURE or --insecure takes precedence.
SHARED_INSECURE_ENV = "DDILOCO_INSECURE"
AUTHORIZATION_HEADER = "authorization"


@dataclasses.dataclass(frozen=True)
class Identity:
    """Who a caller is: a kind (what it may do) and a name (which learner, which service)."""

    kind: str
    name: str

    def __post_init__(self) -> None:
        if self.kind != "anonymous" and self.kind not in KINDS:
            raise ValueError(f"identity kind {self.kind!r} is not one of {KINDS}")
        if self.kind != "anonymous" and not _NAME_RE.fullmatch(self.name):
            raise ValueError(f"identity name {self.name!r} must match {_NAME_RE.pattern}")

    @property
    def anonymous(self) -> bool:
        return self.kind == "anonymous"

    @property
    def uri(self) -> str:
        return f"{URI_PREFIX}{self.kind}/{self.name}"

    def __str__(self) -> str:
        return f"{self.kind}/{self.name}"

    @classmethod
    def parse(cls, text: str) -> Identity:
        """`kind/name` or `spiffe://ddiloco/kind/name`; ValueError otherwise."""
        body = text[len(URI_PREFIX):] if text.startswith(URI_PREFIX) else text
        kind, sep, name = body.partition("/")
        if not sep:
            raise ValueError(f"identity {text!r} is not kind/name")
        return cls(kind, name)


ANONYMOUS = Identity("anonymous", "")

# ------------------------------------------------------------------------------------ config


def check_server_choice(*, tls_ca: str, tls_cert: str, tls_key: str, insecure: bool) -> None:
    """A server must be configured for mutual TLS (all three paths) or be explicitly insecure."""
    paths = {"tls_ca": tls_ca, "tls_cert": tls_cert, "tls_key": tls_key}
    given = [k for k, v in paths.items() if v]
    if insecure and given:
        raise ValueError(f"insecure=True contradicts {', '.join(given)}: choose mutual TLS or plaintext")
    if insecure:
        return
    if not given:
        raise ValueError(
            "no transport security configured: pass --tls-ca, --tls-cert and --tls-key for mutual TLS "
            "(`ddiloco certs` makes development certificates), or --insecure for plaintext on a trusted "
            f"network (local runs; {SHARED_INSECURE_ENV}=1 sets it for every service)"
        )
    missing = [k for k, v in paths.items() if not v]
    if missing:
        raise ValueError(f"mutual TLS needs tls_ca, tls_cert and tls_key; missing {', '.join(missing)}")


def check_client_choice(*, tls_ca: str, tls_cert: str, tls_key: str, insecure: bool) -> None:
    """A client needs a CA to verify the server (plus an optional cert/key pair), or --insecure."""
    given = [k for k, v in {"tls_ca": tls_ca, "tls_cert": tls_cert, "tls_key": tls_key}.items() if v]
    if insecure and given:
        raise ValueError(f"insecure=True contradicts {', '.join(given)}: choose TLS or plaintext")
    if insecure:
        return
    if not tls_ca:
        raise ValueError(
            "no transport security configured: pass --tls-ca (and --tls-cert/--tls-key for mutual TLS) "
            f"or --insecure for plaintext (local runs; {SHARED_INSECURE_ENV}=1 sets it for every service)"
        )
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("tls_cert and tls_key go together: give both (mutual TLS) or neither (token auth)")


def with_shared_insecure(environ: Mapping[str, str], env_prefix: str) -> dict[str, str]:
    """`environ` with `<env_prefix>INSECURE` defaulted from DDILOCO_INSECURE when only that is set."""
    env = dict(environ)
    if SHARED_INSECURE_ENV in env and env_prefix + "INSECURE" not in env:
        env[env_prefix + "INSECURE"] = env[SHARED_INSECURE_ENV]
    return env


def require_choice(prog: str, build: Callable[[], ServerSecurity | ClientSecurity]) -> None:
    """Builds a config's security settings and reads every file they name; on ValueError (no
    explicit choice, missing or unreadable files) prints it and exits 2, like a usage error."""
    try:
        build().check_files()
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _read(path: str, what: str) -> bytes:
    try:
        return open(path, "rb").read()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path!r}: {exc.strerror or exc}") from None


@dataclasses.dataclass(frozen=True)
class ServerSecurity:
    """A server's transport and authentication settings (paths are read at start)."""

    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    insecure: bool = False
    auth_tokens_file: str = ""  # token -> identity table; enables bearer tokens
    tls_deny_list: str = ""  # revoked client certificates (serials or identities), re-read on change

    def __post_init__(self) -> None:
        check_server_choice(tls_ca=self.tls_ca, tls_cert=self.tls_cert, tls_key=self.tls_key, insecure=self.insecure)
        if self.tls_deny_list and self.insecure:
            raise ValueError("tls_deny_list revokes client certificates and needs mutual TLS; with insecure=True "
                             "revoke bearer tokens in the token file's \"revoked\" list instead")

    @property
    def tls(self) -> bool:
        return not self.insecure

    def credentials(self) -> grpc.ServerCredentials | None:
        """mTLS server credentials (client certificates required and verified), or None for plaintext."""
        if self.insecure:
            return None
        return grpc.ssl_server_credentials(
            [(_read(self.tls_key, "TLS key"), _read(self.tls_cert, "TLS certificate"))],
            root_certificates=_read(self.tls_ca, "CA bundle"),
            require_client_auth=True,
        )

    def authenticator(self) -> Authenticator:
        tokens = TokenTable(self.auth_tokens_file) if self.auth_tokens_file else None
        deny_list = DenyList(self.tls_deny_list) if self.tls_deny_list else None
        return Authenticator(mtls=self.tls, tokens=tokens, deny_list=deny_list)

    def check_files(self) -> None:
        """Reads every configured file once (ValueError naming the first problem)."""
        self.credentials()
        self.authenticator()


@dataclasses.dataclass(frozen=True)
class ClientSecurity:
    """A client's transport and credential settings."""

    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""  # expected server name when it differs from the target's host
    insecure: bool = False
    auth_token_file: str = ""  # file holding a bearer token (sent as `authorization: Bearer ...`)

    def __post_init__(self) -> None:
        check_client_choice(tls_ca=self.tls_ca, tls_cert=self.tls_cert, tls_key=self.tls_key, insecure=self.insecure)

    @classmethod
    def plaintext(cls) -> ClientSecurity:
        return cls(insecure=True)

    def credentials(self) -> grpc.ChannelCredentials | None:
        if self.insecure:
            return None
        key = _read(self.tls_key, "TLS key") if self.tls_key else None
        chain = _read(self.tls_cert, "TLS certificate") if self.tls_cert else None
        return grpc.ssl_channel_credentials(_read(self.tls_ca, "CA bundle"), key, chain)

    def channel_options(self) -> tuple[tuple[str, Any], ...]:
        return (("grpc.ssl_target_name_override", self.tls_server_name),) if self.tls_server_name else ()

    def check_files(self) -> None:
        """Reads every configured file once (ValueError naming the first problem)."""
        self.credentials()
        self.token()

    def token(self) -> str | None:
        if not self.auth_token_file:
            return None
        token = _read(self.auth_token_file, "token file").decode().strip()
        if not token:
            raise ValueError(f"token file {self.auth_token_file!r} is empty")
        return token


# ------------------------------------------------------------------------------------ tokens


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
            self._parse(_read(self.path, self.what))
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
    # Imported here: only servers with a deny list parse peer certificates.
    from cryptography import x509

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


# ---------------------------------------------------------------------------- authentication


def _auth_values(auth_context: Mapping[str, Any], key: str) -> list[str]:
    out = []
    for value in auth_context.get(key, ()) or ():
        out.append(value.decode(errors="replace") if isinstance(value, bytes) else str(value))
    return out


def identity_from_auth_context(auth_context: Mapping[str, Any]) -> Identity | None:
    """The ddiloco identity in a verified peer certificate's URI SANs, if any.

    Unauthenticated ("unknown_identity") for a URI in the ddiloco namespace that names no valid
    identity (an unknown kind, a malformed name): a certificate issued for something this server
    does not know, not one without an identity."""
    candidates = _auth_values(auth_context, "x509_subject_alternative_name")
    candidates += _auth_values(auth_context, "x509_uri_subject_alternative_name")
    unknown = ""
    for value in candidates:
        if value.startswith(URI_PREFIX):
            try:
                return Identity.parse(value)
            except ValueError as exc:
                unknown = unknown or f"{value}: {exc}"
    if unknown:
        raise errors.Unauthenticated(f"the client certificate names an unknown ddiloco identity ({unknown})",
                                     reason="unknown_identity")
    return None


def bearer_token(metadata) -> str | None:
    for key, value in metadata or ():
        if key.lower() == AUTHORIZATION_HEADER:
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return ""
    return None


class Authenticator:
    """Turns a call's transport context and metadata into an Identity (or Unauthenticated)."""

    def __init__(self, *, mtls: bool, tokens: TokenTable | None, deny_list: DenyList | None = None) -> None:
        self.mtls = mtls
        self.tokens = tokens
        self.deny_list = deny_list

    @property
    def enabled(self) -> bool:
        return self.mtls or self.tokens is not None

    def authenticate(self, context: grpc.aio.ServicerContext) -> Identity:
        if not self.enabled:
            return ANONYMOUS
        identity = None
        if self.mtls:
            auth_context = context.auth_context() or {}
            if self.deny_list is not None:
                # By serial first: a revoked certificate is refused whatever identity it carries.
                self.deny_list.check(serial=peer_certificate_serial(auth_context))
            identity = identity_from_auth_context(auth_context)
        if identity is None:
            identity = self._from_token(context)
        if self.deny_list is not None:
            self.deny_list.check(identity=identity)
        return identity

    def _from_token(self, context: grpc.aio.ServicerContext) -> Identity:
        if self.tokens is not None:
            token = bearer_token(context.invocation_metadata())
            if token is None:
                raise errors.Unauthenticated("no credentials: present a client certificate or a bearer token",
                                             reason="no_credentials")
            if not token:
                raise errors.Unauthenticated("authorization metadata must be `Bearer <token>`",
                                             reason="invalid_token")
            return self.tokens.lookup(token)
        raise errors.Unauthenticated(
            f"the client certificate carries no ddiloco identity (a URI SAN {URI_PREFIX}<kind>/<name>)",
            reason="no_identity",
        )


_CURRENT: contextvars.ContextVar[Identity] = contextvars.ContextVar("ddiloco_identity", default=ANONYMOUS)


def current_identity() -> Identity:
    """The identity of the RPC being handled (ANONYMOUS when authentication is off)."""
    return _CURRENT.get()


def require_learner(learner_id: str) -> None:
    """PermissionDenied unless the caller is learner `learner_id` (or authentication is off)."""
    identity = _CURRENT.get()
    if identity.anonymous:
        return
    if identity.kind != KIND_LEARNER or identity.name != learner_id:
        raise errors.PermissionDenied(
            f"{identity} may not act as learner {learner_id!r}: a learner can only act as itself",
            reason="wrong_learner",
        )


def require_kind(*kinds: str) -> None:
    identity = _CURRENT.get()
    if not identity.anonymous and identity.kind not in kinds:
        raise errors.PermissionDenied(f"{identity} may not do this (needs {' or '.join(kinds)})", reason="wrong_role")


# ----------------------------------------------------------------------------- authorization

_LEARNER = frozenset({KIND_LEARNER})

# Method -> kinds allowed to call it. Methods of a guarded service that are missing here are
# refused (default deny). Request-level checks (a learner acting as itself) are in the servicers.
SYNCER_POLICY: Mapping[str, frozenset[str]] = {
    "/ddiloco.v1.Syncer/Join": _LEARNER,
    "/ddiloco.v1.Syncer/ReportProgress": _LEARNER,
    "/ddiloco.v1.Syncer/UploadFragment": _LEARNER,
    "/ddiloco.v1.Syncer/Leave": _LEARNER,
    # Learners watch as themselves; evaluators and model readers as observers (empty learner_id).
    # The stream carries the model's weights: a state reader may not open it.
    "/ddiloco.v1.Syncer/WatchFragments": _LEARNER | MODEL_READ_KINDS,
    "/ddiloco.v1.Syncer/ReportEval": frozenset({KIND_EVALUATOR}),
    "/ddiloco.v1.Syncer/GetTrainingState": STATE_READ_KINDS,
    "/ddiloco.v1.Syncer/WatchTrainingState": STATE_READ_KINDS,
}

# Blobs hold the checkpointed weights and optimizer state: the syncer and model readers only.
# Manifests and blob stats (names, digests, sizes, steps) are state: readers too.
_STORE_METADATA = frozenset({KIND_SYNCER, KIND_READER, KIND_MODEL_READER})
CHECKPOINT_POLICY: Mapping[str, frozenset[str]] = {
    "/ddiloco.v1.CheckpointStore/PutBlob": frozenset({KIND_SYNCER}),
    "/ddiloco.v1.CheckpointStore/CommitManifest": frozenset({KIND_SYNCER}),
    "/ddiloco.v1.CheckpointStore/GetBlob": frozenset({KIND_SYNCER, KIND_MODEL_READER}),
    "/ddiloco.v1.CheckpointStore/StatBlobs": _STORE_METADATA,
    "/ddiloco.v1.CheckpointStore/GetLatestManifest": _STORE_METADATA,
    "/ddiloco.v1.CheckpointStore/ListManifests": _STORE_METADATA,
    # Repair of a replica writes manifests: the syncer (or `ddiloco store repair` as the syncer).
    "/ddiloco.v1.CheckpointStore/RestoreManifest": frozenset({KIND_SYNCER}),
}

GUARDED_PREFIX = "/ddiloco.v1."


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates and authorizes every ddiloco.v1 call before its handler reads a message.

    The caller's identity is available to the handler as `current_identity()`. Refusals are
    reported to `on_reject(method, reason)` (counters) before the call is aborted.
    """

    def __init__(
        self,
        authenticator: Authenticator,
        policy: Mapping[str, frozenset[str]],
        *,
        on_reject: Callable[[str, str], None] | None = None,
    ) -> None:
        self._authn = authenticator
        self._policy = dict(policy)
        self.on_reject = on_reject

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(GUARDED_PREFIX):
            return handler
        return _wrap_handler(handler, lambda context: self._admit(method, context))

    async def _admit(self, method: str, context: grpc.aio.ServicerContext) -> Identity:
        try:
            identity = self._authn.authenticate(context)
            allowed = self._policy.get(method, frozenset())
            if not identity.anonymous and identity.kind not in allowed:
                raise errors.PermissionDenied(
                    f"{identity} may not call {method.rsplit('/', 1)[-1]}", reason="wrong_role"
                )
        except errors.ServiceError as exc:
            if self.on_reject is not None:
                self.on_reject(method, exc.reason)
            _LOG.info(f"[{method.rsplit('/', 1)[-1]}] {exc.code.name}: {exc} (peer {context.peer()})")
            await context.abort(exc.code, str(exc))
            raise AssertionError("unreachable: context.abort raises") from None
        return identity


# A response stream re-admits its caller at most this often, before its next message: a token
# or certificate revoked while a WatchFragments or GetBlob stream is open stops the download
# within a second of the credential files being re-read, instead of when the stream ends.
STREAM_RECHECK_S = 1.0


def _wrap_handler(handler: grpc.RpcMethodHandler, admit) -> grpc.RpcMethodHandler:
    """The same handler, with `admit(context)` run (and the identity bound) before the behavior,
    and for a response stream again before a message once STREAM_RECHECK_S has passed."""

    def wrap(behavior):
        if inspect.isasyncgenfunction(behavior):
            async def stream_behavior(request, context):
                token = _CURRENT.set(await admit(context))
                admitted_at = time.monotonic()
                responses = behavior(request, context)
                try:
                    async for response in responses:
                        if time.monotonic() - admitted_at >= STREAM_RECHECK_S:
                            await admit(context)  # aborts the call if the credential was revoked meanwhile
                            admitted_at = time.monotonic()
                        yield response
                finally:
                    await responses.aclose()
                    _CURRENT.reset(token)

            return stream_behavior

        async def behavior_wrapper(request, context):
            token = _CURRENT.set(await admit(context))
            try:
                result = behavior(request, context)
                return await result if inspect.isawaitable(result) else result
            finally:
                _CURRENT.reset(token)

        return behavior_wrapper

    return interceptors_lib.rewrap_handler(handler, wrap)


# ------------------------------------------------------------------------- client tokens


def _with_token(details, token: str):
    metadata = [(k, v) for k, v in (details.metadata or ())]
    metadata.append((AUTHORIZATION_HEADER, f"Bearer {token}"))
    return grpc.aio.ClientCallDetails(details.method, details.timeout, grpc.aio.Metadata(*metadata),
                                      details.credentials, details.wait_for_ready)


class _TokenUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_token(client_call_details, self._token), request)


class _TokenUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_token(client_call_details, self._token), request)


class _TokenStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_token(client_call_details, self._token), request_iterator)


class _TokenStreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_token(client_call_details, self._token), request_iterator)


def aio_token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors adding `authorization: Bearer <token>` to every call (one per RPC kind:
    grpc.aio files each interceptor under the first kind it implements)."""
    return [_TokenUnaryUnary(token), _TokenUnaryStream(token), _TokenStreamUnary(token), _TokenStreamStream(token)]


class _SyncDetails(grpc.ClientCallDetails):
    def __init__(self, base, metadata) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


class SyncTokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                           grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """The blocking-channel counterpart of `aio_token_interceptors`."""

    def __init__(self, token: str) -> None:
        self._token = token

    def _details(self, details):
        metadata = list(details.metadata or ()) + [(AUTHORIZATION_HEADER, f"Bearer {self._token}")]
        return _SyncDetails(details, metadata)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)
