"""Liveness of a training loop, served as the standard gRPC health service.

Owns: `LoopLiveness`, the pure rule (with an injected clock) that says whether a loop is alive:
it is while no more than `timeout_s` has passed since its last sign of progress (its start counts
as one, so the bound also covers start-up: joining, loading data, compiling the first step); and
`HealthServer`, a small plaintext gRPC server with nothing but grpc.health.v1.Health, whose
whole-server status ("") is SERVING while the loop is alive and NOT_SERVING once it is not.

Why a learner needs it: a learner only dials out, so a learner whose loop hangs (a wedged device,
a deadlocked collective, a stuck host call) keeps its process, and its sync client's connection,
alive forever while contributing nothing. The Helm chart's livenessProbe (a kubelet gRPC probe)
asks this server and restarts such a learner; the compose healthcheck and `python -m
ddiloco.healthcheck` ask it too.

The loop calls `beat()` after each completed step, from its own thread; the server's threads only
read. A float assignment is atomic in CPython, so no lock is needed on that path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

# A probe's call is tiny; a few workers answer overlapping probes (kubelet plus an operator).
_HEALTH_WORKERS = 2
_HEALTH_MAX_RPCS = 8


class LoopLiveness:
    """Alive while at most `timeout_s` has passed since the last `beat()` (or the creation).

    `timeout_s == 0` disables the bound: always alive. `clock` returns seconds (monotonic); tests
    inject a fake one.
    """

    def __init__(self, timeout_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not timeout_s >= 0:
            raise ValueError(f"liveness timeout_s={timeout_s!r}: must be >= 0 (0 disables the bound)")
        self.timeout_s = float(timeout_s)
        self._clock = clock
        self._last_beat_s = clock()
        self.beats = 0

    def beat(self) -> None:
        """A sign of progress: the loop completed a step (or a start-up stage)."""
        self._last_beat_s = self._clock()
        self.beats += 1

    def since_beat_s(self) -> float:
        """Seconds since the last sign of progress."""
        return max(0.0, self._clock() - self._last_beat_s)

    def alive(self) -> bool:
        return self.timeout_s == 0 or self.since_beat_s() <= self.timeout_s

    def status(self) -> int:
        """The grpc.health.v1 serving status this liveness maps to."""
        return health_pb2.HealthCheckResponse.SERVING if self.alive() else health_pb2.HealthCheckResponse.NOT_SERVING


class _LivenessServicer(health.HealthServicer):
    """The standard servicer, with the whole-server status ("") evaluated from a liveness at each Check."""

    def __init__(self, liveness: LoopLiveness) -> None:
        super().__init__()
        self._liveness = liveness
        self.set("", liveness.status())

    def Check(self, request, context):  # noqa: N802 (gRPC method name)
        self.set("", self._liveness.status())  # ignored once a graceful shutdown began
        return super().Check(request, context)

    def Watch(self, request, context, send_response_callback=None):  # noqa: N802
        # A sync server runs each Watch stream on a worker thread for as long as the client stays;
        # a couple of them would starve the probes' Checks. Probes (kubelet, grpc_health_probe,
        # ddiloco.healthcheck) use Check.
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "this health server answers Check only")


class HealthServer:
    """A plaintext gRPC server with only the health service (Check), reporting a `LoopLiveness`."""

    def __init__(self, bind: str, liveness: LoopLiveness) -> None:
        """Binds and starts; `bind` is host:port (port 0 picks a free one). OSError if it cannot bind."""
        self.liveness = liveness
        self._servicer = _LivenessServicer(liveness)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=_HEALTH_WORKERS, thread_name_prefix="health"),
            maximum_concurrent_rpcs=_HEALTH_MAX_RPCS,
            # gRPC binds with SO_REUSEPORT by default: a second learner on the same port would
            # share it silently, and probes would reach either of them. Refuse instead.
            options=[("grpc.so_reuseport", 0)],
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, self._server)
        try:
            port = self._server.add_insecure_port(bind)
        except RuntimeError:  # newer grpcio raises where older ones returned 0
            port = 0
        if port == 0:
            raise OSError(f"could not bind the health port {bind!r}: address in use or not available")
        self.port = port
        self.address = f"{bind.rsplit(':', 1)[0] or '0.0.0.0'}:{port}"
        self._server.start()

    def stop(self, grace_s: float = 0.0) -> None:
        """Reports NOT_SERVING for good, then stops the server."""
        self._servicer.enter_graceful_shutdown()
        self._server.stop(grace_s).wait(timeout=grace_s + 5.0)
