"""Client interceptors that present a bearer token on every call, for grpc.aio and blocking
channels (split out of ddiloco.rpc.security, which re-exports the public names)."""

from __future__ import annotations

import grpc

from ddiloco.rpc.identity import AUTHORIZATION_HEADER


def _with_token(details, token: str):
    metadata = [(k, v) for k, v in (details.metadata or ())]
    metadata.append((AUTHORIZATION_HEADER, f"Bearer {token}"))
    return grpc.aio.ClientCallDetails(details.method, details.timeout, grpc.aio.Metadata(*metadata),
                                      details.credentials, details.wait_for_ready)


class _WithToken:
    """Adds the bearer token to a call's metadata. grpc.aio files an interceptor under the first
    RPC kind it implements, so each kind gets a subclass below, all with this one method."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def _intercept(self, continuation, client_call_details, request_or_iterator):
        return await continuation(_with_token(client_call_details, self._token), request_or_iterator)


class _TokenUnaryUnary(_WithToken, grpc.aio.UnaryUnaryClientInterceptor):
    intercept_unary_unary = _WithToken._intercept


class _TokenUnaryStream(_WithToken, grpc.aio.UnaryStreamClientInterceptor):
    intercept_unary_stream = _WithToken._intercept


class _TokenStreamUnary(_WithToken, grpc.aio.StreamUnaryClientInterceptor):
    intercept_stream_unary = _WithToken._intercept


class _TokenStreamStream(_WithToken, grpc.aio.StreamStreamClientInterceptor):
    intercept_stream_stream = _WithToken._intercept


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
