"""Server interceptors shared by every service.

`MetricsInterceptor` counts every RPC by method and final status code and times it
(`ddiloco_grpc_server_handled_total`, `ddiloco_grpc_server_handling_seconds`), for unary and
streaming handlers alike, without the servicers knowing.
"""

from __future__ import annotations

import time

import grpc
import prometheus_client

from ddiloco import metrics as metrics_lib


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, registry: prometheus_client.CollectorRegistry) -> None:
        self._handled = prometheus_client.Counter(
            "ddiloco_grpc_server_handled", "RPCs completed, by method and status code", ["method", "code"],
            registry=registry)
        self._seconds = prometheus_client.Histogram(
            "ddiloco_grpc_server_handling_seconds", "RPC duration, by method", ["method"], registry=registry,
            buckets=metrics_lib.SECONDS_BUCKETS)

    def _record(self, method: str, context, started: float, exc: BaseException | None) -> None:
        if exc is None:
            code = grpc.StatusCode.OK
        else:
            code = context.code() if isinstance(context.code(), grpc.StatusCode) else None
            if code is None:
                code = grpc.StatusCode.CANCELLED if isinstance(exc, (GeneratorExit,)) else grpc.StatusCode.UNKNOWN
        self._handled.labels(method=method, code=code.name).inc()
        self._seconds.labels(method=method).observe(time.monotonic() - started)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        record = self._record

        if handler.unary_unary or handler.stream_unary:
            inner = handler.unary_unary or handler.stream_unary

            async def unary_response(request_or_iterator, context):
                started = time.monotonic()
                try:
                    response = await inner(request_or_iterator, context)
                except BaseException as exc:
                    record(method, context, started, exc)
                    raise
                record(method, context, started, None)
                return response

            factory = (grpc.unary_unary_rpc_method_handler if handler.unary_unary
                       else grpc.stream_unary_rpc_method_handler)
        else:
            inner = handler.unary_stream or handler.stream_stream

            async def unary_response(request_or_iterator, context):  # a streaming response
                started = time.monotonic()
                try:
                    async for item in inner(request_or_iterator, context):
                        yield item
                except BaseException as exc:
                    record(method, context, started, exc)
                    raise
                record(method, context, started, None)

            factory = (grpc.unary_stream_rpc_method_handler if handler.unary_stream
                       else grpc.stream_stream_rpc_method_handler)
        return factory(unary_response, request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)
