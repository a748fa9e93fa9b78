"""Domain errors raised by service cores, and the one mapping from them to gRPC status codes.

Cores (syncer, checkpoint store) raise these without importing grpc; servicers catch
`ServiceError` and abort with `error.code`, so every error path has exactly one status code.
The error's `reason` travels with the status as trailing metadata (`status_metadata`), so that a
client branches on `reason_of(rpc_error)`, never on the wording of the details.
"""

from __future__ import annotations

import grpc

# The trailing-metadata key of a refusal's machine-readable reason (ServiceError.reason).
REASON_KEY = "ddiloco-reason"
# Reasons clients act on (the syncer's membership checks).
REASON_FENCED = "fenced"  # a newer incarnation of this learner joined: this one must stop
REASON_NOT_JOINED = "not_joined"  # no such member (never joined, or the syncer restarted): join again
REASON_NOT_LEADER = "not_leader"  # a standby syncer (leader election): go to the leader
# The trailing-metadata key with which a standby names the leader's address (host:port; absent
# while it knows of none).
LEADER_KEY = "ddiloco-leader"


class ServiceError(Exception):
    """An error a servicer turns into a gRPC status. `reason` is a short label for counters."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or type(self).__name__


def status_metadata(error: ServiceError) -> tuple[tuple[str, str], ...]:
    """The trailing metadata a servicer sends with `error`'s status: its reason, when it is one
    a metadata value can carry (printable ASCII)."""
    reason = error.reason
    return ((REASON_KEY, reason),) if reason.isascii() and reason.isprintable() else ()


def metadata_value(error: grpc.RpcError, key: str) -> str:
    """The trailing-metadata value `key` of a failed call ("" when absent)."""
    if not isinstance(error, (grpc.Call, grpc.aio.AioRpcError)):
        return ""
    for k, value in error.trailing_metadata() or ():
        if k == key:
            return value.decode() if isinstance(value, bytes) else value
    return ""


def reason_of(error: grpc.RpcError) -> str:
    """The reason a ddiloco server attached to a failed call ("" when none: another server, a
    transport failure, a deadline)."""
    if not isinstance(error, (grpc.Call, grpc.aio.AioRpcError)):
        return ""
    for key, value in error.trailing_metadata() or ():
        if key == REASON_KEY:
            return value.decode() if isinstance(value, bytes) else value
    return ""


class InvalidArgument(ServiceError):
    """Malformed input: wrong sizes, checksum, non-finite values, chunk order."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(ServiceError):
    """Valid input the current state refuses: stale base, fenced incarnation, wrong protocol."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class AlreadyExists(ServiceError):
    """The same idempotency key arrived with a different payload."""

    code = grpc.StatusCode.ALREADY_EXISTS


class Unauthenticated(ServiceError):
    """No credential, or one that is invalid or revoked."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ServiceError):
    """An authenticated caller acting beyond its identity (another learner, a read-only
    credential writing) or a quarantined learner."""

    code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(ServiceError):
    """Too many concurrent requests, or no space left."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DataLoss(ServiceError):
    """Stored bytes no longer match their digest."""

    code = grpc.StatusCode.DATA_LOSS


class Unavailable(ServiceError):
    """A dependency is temporarily unreachable; the caller may retry."""

    code = grpc.StatusCode.UNAVAILABLE
