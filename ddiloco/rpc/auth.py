"""Server-side authentication and authorization: the `Authenticator` (certificate, deny list, bearer
token -> Identity), the per-service method policies, `AuthInterceptor` and the identity of the call
being handled (`current_identity`, `require_learner`, `require_kind`). Split out of
ddiloco.rpc.security, which re-exports the public names."""

from __future__ import annotations

import contextvars
import inspect
import logging
import time
from collections.abc import Callable, Mapping

import grpc

from ddiloco.rpc import errors
from ddiloco.rpc import interceptors as interceptors_lib
from ddiloco.rpc.credential_files import DenyList, TokenTable, peer_certificate_serial
from ddiloco.rpc.identity import (
    ANONYMOUS,
    AUTHORIZATION_HEADER,
    KIND_EVALUATOR,
    KIND_LEARNER,
    KIND_MODEL_READER,
    KIND_READER,
    KIND_SYNCER,
    MODEL_READ_KINDS,
    STATE_READ_KINDS,
    URI_PREFIX,
    Identity,
    identity_from_auth_context,
)

_LOG = logging.getLogger("ddiloco.security")


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
    # The merge ledger: the syncer appends; who influenced which merge is state (`ddiloco audit`).
    "/ddiloco.v1.CheckpointStore/AppendLedger": frozenset({KIND_SYNCER}),
    "/ddiloco.v1.CheckpointStore/ReadLedger": _STORE_METADATA,
    "/ddiloco.v1.CheckpointStore/GetLedgerHead": _STORE_METADATA,
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
