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

    def __init_subclass__(cls, *, code: grpc.StatusCode | None = None, **kwargs: object) -> None:
        # The status is a class keyword (one line a subclass) rather than a class attribute
        # each subclass body repeats; a subclass without one keeps its parent's.
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code

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
    return metadata_value(error, REASON_KEY)


class InvalidArgument(ServiceError, code=grpc.StatusCode.INVALID_ARGUMENT):
    """Malformed input: wrong sizes, checksum, non-finite values, chunk order."""


class FailedPrecondition(ServiceError, code=grpc.StatusCode.FAILED_PRECONDITION):
    """Valid input the current state refuses: stale base, fenced incarnation, wrong protocol."""


class AlreadyExists(ServiceError, code=grpc.StatusCode.ALREADY_EXISTS):
    """The same idempotency key arrived with a different payload."""


class Unauthenticated(ServiceError, code=grpc.StatusCode.UNAUTHENTICATED):
    """No credential, or one that is invalid or revoked."""


class PermissionDenied(ServiceError, code=grpc.StatusCode.PERMISSION_DENIED):
    """An authenticated caller acting beyond its identity (another learner, a read-only
    credential writing) or a quarantined learner."""


class NotFound(ServiceError, code=grpc.StatusCode.NOT_FOUND):
    """No such blob or manifest."""


class ResourceExhausted(ServiceError, code=grpc.StatusCode.RESOURCE_EXHAUSTED):
    """Too many concurrent requests, or no space left."""


class DataLoss(ServiceError, code=grpc.StatusCode.DATA_LOSS):
    """Stored bytes no longer match their digest."""


class Unavailable(ServiceError, code=grpc.StatusCode.UNAVAILABLE):
    """A dependency is temporarily unreachable; the caller may retry."""
