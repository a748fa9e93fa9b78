"""A container health probe: `python -m ddiloco.healthcheck --target 127.0.0.1:50051`.

Calls the standard gRPC health service (grpc.health.v1.Health/Check) that every ddiloco server
registers (ddiloco/rpc/server.py) and exits 0 only when the answer is SERVING. It is what the
image's HEALTHCHECK and the compose file run, so no extra binary (grpc_health_probe) is needed.

Exit status: 0 SERVING; 1 any other status (NOT_SERVING after a graceful shutdown began,
SERVICE_UNKNOWN, ...); 2 the call failed (unreachable, deadline exceeded, ...). Usage errors
exit 2 too (argparse). Only grpc and the generated health stubs are imported, so a probe costs
a fraction of a second of CPU.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

EXIT_SERVING = 0
EXIT_NOT_SERVING = 1
EXIT_UNREACHABLE = 2


def check(target: str, service: str = "", timeout_s: float = 3.0) -> tuple[int, str]:
    """One Health/Check call with a deadline; returns (exit status, one-line description)."""
    channel = grpc.insecure_channel(target)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.RpcError as exc:
        return EXIT_UNREACHABLE, f"{target}: {exc.code().name} {exc.details() or ''}".rstrip()
    finally:
        channel.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    code = EXIT_SERVING if response.status == health_pb2.HealthCheckResponse.SERVING else EXIT_NOT_SERVING
    return code, f"{target} {service or '(server)'}: {status}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddiloco.healthcheck",
        description="Exit 0 if the gRPC server at --target reports SERVING (grpc.health.v1), else non-zero.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--target", default="127.0.0.1:50051", help="host:port of the server to probe")
    parser.add_argument("--service", default="",
                        help="service name to ask about, e.g. ddiloco.v1.Syncer (empty: the whole server)")
    parser.add_argument("--timeout-s", type=float, default=3.0, help="deadline of the call in seconds")
    parser.add_argument("--quiet", action="store_true", help="print nothing")
    args = parser.parse_args(argv)
    if args.timeout_s <= 0:
        parser.error("--timeout-s must be > 0")
    code, message = check(args.target, args.service, args.timeout_s)
    if not args.quiet:
        print(message, file=sys.stdout if code == EXIT_SERVING else sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
