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
