"""Server interceptors shared by every service.

`MetricsInterceptor` exports the standard gRPC server metrics under the names and labels that
go-grpc-prometheus defines (and py-grpc-prometheus and java-grpc-prometheus copy), so the gRPC
ecosystem's dashboards and alerts work on our services unchanged:

- `grpc_server_started_total{grpc_type, grpc_service, grpc_method}`: RPCs started;
- `grpc_server_handled_total{grpc_type, grpc_service, grpc_method, grpc_code}`: RPCs completed,
  by final status (Go's spelling of the codes: OK, InvalidArgument, ResourceExhausted, ...);
- `grpc_server_msg_received_total` and `grpc_server_msg_sent_total`: stream messages, by method;
- `grpc_server_handling_seconds{grpc_type, grpc_service, grpc_method}`: RPC duration histogram.

`grpc_type` is unary, client_stream, server_stream or bidi_stream. The servicers know nothing of it.
We keep our own ~80 lines rather than depend on py-grpc-prometheus: it instruments the synchronous
server only, and its asyncio fork never completes the metrics of streaming responses.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import prometheus_client

from ddiloco import metrics as metrics_lib

# grpc_code values as go-grpc-prometheus writes them (Go's codes.Code.String()): the spelling the
# ecosystem's dashboards and alerting mixins match on (e.g. grpc_code=~"Unknown|Internal|...").
GRPC_CODE_NAMES = {
    grpc.StatusCode.OK: "OK",
    grpc.StatusCode.CANCELLED: "Canceled",
    grpc.StatusCode.UNKNOWN: "Unknown",
    grpc.StatusCode.INVALID_ARGUMENT: "InvalidArgument",
    grpc.StatusCode.DEADLINE_EXCEEDED: "DeadlineExceeded",
    grpc.StatusCode.NOT_FOUND: "NotFound",
    grpc.StatusCode.ALREADY_EXISTS: "AlreadyExists",
    grpc.StatusCode.PERMISSION_DENIED: "PermissionDenied",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "ResourceExhausted",
    grpc.StatusCode.FAILED_PRECONDITION: "FailedPrecondition",
    grpc.StatusCode.ABORTED: "Aborted",
    grpc.StatusCode.OUT_OF_RANGE: "OutOfRange",
    grpc.StatusCode.UNIMPLEMENTED: "Unimplemented",
    grpc.StatusCode.INTERNAL: "Internal",
    grpc.StatusCode.UNAVAILABLE: "Unavailable",
    grpc.StatusCode.DATA_LOSS: "DataLoss",
    grpc.StatusCode.UNAUTHENTICATED: "Unauthenticated",
}


class _CountingIterator:
    """A request stream that counts the messages read from it. A plain delegate rather than an
    async generator: a servicer that cancels a read (asyncio.wait_for) must see exactly what the
    underlying stream does."""

    def __init__(self, inner, counter) -> None:
        self._inner = inner.__aiter__()
        self._counter = counter

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self._inner.__anext__()
        self._counter.inc()
        return item


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, registry: prometheus_client.CollectorRegistry) -> None:
        labels = ["grpc_type", "grpc_service", "grpc_method"]
        self._started = prometheus_client.Counter(
            "grpc_server_started_total", "Total number of RPCs started on the server.", labels, registry=registry)
        self._handled = prometheus_client.Counter(
            "grpc_server_handled_total", "Total number of RPCs completed on the server, regardless of success or "
            "failure.", [*labels, "grpc_code"], registry=registry)
        self._received = prometheus_client.Counter(
            "grpc_server_msg_received_total", "Total number of RPC stream messages received on the server.", labels,
            registry=registry)
        self._sent = prometheus_client.Counter(
            "grpc_server_msg_sent_total", "Total number of gRPC stream messages sent by the server.", labels,
            registry=registry)
        self._seconds = prometheus_client.Histogram(
            "grpc_server_handling_seconds", "Histogram of response latency (seconds) of gRPC that had been "
            "application-level handled by the server.", labels, registry=registry,
            buckets=metrics_lib.SECONDS_BUCKETS)

    def _record(self, labels: tuple[str, str, str], context, started: float, exc: BaseException | None) -> None:
        code = context.code() if isinstance(context.code(), grpc.StatusCode) else None
        if code is None:
            if exc is None:
                code = grpc.StatusCode.OK
            else:
                # The client went away (the stream's generator closed, or the handler's task was
                # cancelled): Canceled, as a Go server reports a handler ended by its context.
                cancelled = isinstance(exc, (GeneratorExit, asyncio.CancelledError))
                code = grpc.StatusCode.CANCELLED if cancelled else grpc.StatusCode.UNKNOWN
        self._handled.labels(*labels, GRPC_CODE_NAMES[code]).inc()
        self._seconds.labels(*labels).observe(time.monotonic() - started)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
        grpc_type = {(False, False): "unary", (True, False): "client_stream", (False, True): "server_stream",
                     (True, True): "bidi_stream"}[(bool(handler.request_streaming), bool(handler.response_streaming))]
        labels = (grpc_type, service, method)
        record, started_total = self._record, self._started.labels(*labels)
        received, sent = self._received.labels(*labels), self._sent.labels(*labels)

        def requests(request_or_iterator):
            if handler.request_streaming:
                return _CountingIterator(request_or_iterator, received)
            received.inc()
            return request_or_iterator

        if handler.unary_unary or handler.stream_unary:
            inner = handler.unary_unary or handler.stream_unary

            async def unary_response(request_or_iterator, context):
                started = time.monotonic()
                started_total.inc()
                try:
                    response = await inner(requests(request_or_iterator), context)
                except BaseException as exc:
                    record(labels, context, started, exc)
                    raise
                sent.inc()
                record(labels, context, started, None)
                return response

            factory = (grpc.unary_unary_rpc_method_handler if handler.unary_unary
                       else grpc.stream_unary_rpc_method_handler)
        else:
            inner = handler.unary_stream or handler.stream_stream

            async def unary_response(request_or_iterator, context):  # a streaming response
                started = time.monotonic()
                started_total.inc()
                try:
                    async for item in inner(requests(request_or_iterator), context):
                        yield item
                        sent.inc()
                except BaseException as exc:
                    record(labels, context, started, exc)
                    raise
                record(labels, context, started, None)

            factory = (grpc.unary_stream_rpc_method_handler if handler.unary_stream
                       else grpc.stream_stream_rpc_method_handler)
        return factory(unary_response, request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)


def rewrap_handler(handler: grpc.RpcMethodHandler, wrap) -> grpc.RpcMethodHandler:
    """The same RPC method handler (kind, (de)serializers) with its behavior replaced by `wrap(behavior)`.

    For server interceptors that run checks around a call (authentication, leader gating): grpc.aio
    has no hook between the handler lookup and the behavior, so each wraps the behavior itself.
    """
    common = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary), **common)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream), **common)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary), **common)
    return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream), **common)
