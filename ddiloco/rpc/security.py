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

The jobs live in sibling modules, and every name of theirs that other code uses is re-exported
here, so callers keep writing `security.X`: `ddiloco.rpc.identity` (kinds, `Identity`, certificate
identities), `ddiloco.rpc.credential_files` (`TokenTable`, `DenyList`, serials),
`ddiloco.rpc.auth` (`Authenticator`, policies, `AuthInterceptor`, `current_identity`) and
`ddiloco.rpc.client_tokens` (bearer-token client interceptors). This module keeps the transport
settings: the explicit mTLS-or-insecure choice, `ServerSecurity` and `ClientSecurity`.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from ddiloco.rpc.auth import (
    CHECKPOINT_POLICY,
    GUARDED_PREFIX,
    STREAM_RECHECK_S,
    SYNCER_POLICY,
    AuthInterceptor,
    Authenticator,
    bearer_token,
    current_identity,
    require_kind,
    require_learner,
)
from ddiloco.rpc.client_tokens import SyncTokenInterceptor, aio_token_interceptors
from ddiloco.rpc.credential_files import (
    DenyList,
    TokenTable,
    format_serial,
    parse_deny_list,
    parse_serial,
    peer_certificate_serial,
)
from ddiloco.rpc.credential_files import read_credential as _read
from ddiloco.rpc.identity import (
    ANONYMOUS,
    AUTH_FAILURE_REASONS,
    AUTHORIZATION_HEADER,
    KIND_CHECKPOINT,
    KIND_EVALUATOR,
    KIND_LEARNER,
    KIND_MODEL_READER,
    KIND_READER,
    KIND_SYNCER,
    KINDS,
    MODEL_READ_KINDS,
    STATE_READ_KINDS,
    URI_PREFIX,
    Identity,
    identity_from_auth_context,
)

__all__ = [
    "ANONYMOUS", "AUTHORIZATION_HEADER", "AUTH_FAILURE_REASONS", "CHECKPOINT_POLICY", "GUARDED_PREFIX",
    "KINDS", "KIND_CHECKPOINT", "KIND_EVALUATOR", "KIND_LEARNER", "KIND_MODEL_READER", "KIND_READER",
    "KIND_SYNCER", "MODEL_READ_KINDS", "SHARED_INSECURE_ENV", "STATE_READ_KINDS", "STREAM_RECHECK_S",
    "SYNCER_POLICY", "URI_PREFIX", "AuthInterceptor", "Authenticator", "ClientSecurity", "DenyList", "Identity",
    "ServerSecurity", "SyncTokenInterceptor", "TokenTable", "aio_token_interceptors", "bearer_token",
    "check_client_choice", "check_server_choice", "current_identity", "format_serial", "identity_from_auth_context",
    "parse_deny_list", "parse_serial", "peer_certificate_serial", "require_choice", "require_kind",
    "require_learner", "with_shared_insecure",
]

# Shared switch for every service of a local run (LocalCluster sets it); a service's own
# DDILOCO_<SERVICE>_INSECURE or --insecure takes precedence.
SHARED_INSECURE_ENV = "DDILOCO_INSECURE"

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
