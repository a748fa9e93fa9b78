"""Who a caller is: the identity kinds, `Identity` and how a verified client certificate names one
(split out of ddiloco.rpc.security, which re-exports every name here; docs/security.md)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from ddiloco.rpc import errors

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
