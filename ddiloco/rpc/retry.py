"""Bounded, jittered retries of transient gRPC failures, built on tenacity.

Only UNAVAILABLE is retried for every call; DEADLINE_EXCEEDED only for calls the caller marks
idempotent. Every policy has an overall time bound, and the final error names the call, the
attempts made and the last status.
"""

from __future__ import annotations

import datetime
import logging

import grpc
import tenacity

_LOG = logging.getLogger(__name__)

_ALWAYS_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE})
_IDEMPOTENT_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class RetriesExhausted(Exception):
    """A call kept failing with transient errors until its overall time bound ran out."""

    def __init__(self, what: str, attempts: int, last: BaseException | None) -> None:
        code = last.code().name if isinstance(last, grpc.RpcError) else type(last).__name__
        super().__init__(f"{what}: gave up after {attempts} attempts; last error {code}: {last}")
        self.attempts = attempts
        self.last = last


def is_transient(exc: BaseException, *, idempotent: bool) -> bool:
    """True for gRPC errors worth retrying."""
    if not isinstance(exc, grpc.RpcError):
        return False
    codes = _IDEMPOTENT_RETRYABLE if idempotent else _ALWAYS_RETRYABLE
    return exc.code() in codes


def async_retrying(
    *,
    what: str,
    timeout: datetime.timedelta,
    idempotent: bool,
    wait_initial: datetime.timedelta = datetime.timedelta(milliseconds=100),
    wait_max: datetime.timedelta = datetime.timedelta(seconds=5),
) -> tenacity.AsyncRetrying:
    """An AsyncRetrying policy: exponential backoff with jitter, stopping after `timeout`.

    Use as `async for attempt in async_retrying(...): with attempt: await call()`.
    On exhaustion raises RetriesExhausted; non-transient errors propagate at once.
    """

    def _give_up(state: tenacity.RetryCallState) -> None:
        last = state.outcome.exception() if state.outcome else None
        raise RetriesExhausted(what, state.attempt_number, last) from last

    return tenacity.AsyncRetrying(
        retry=tenacity.retry_if_exception(lambda e: is_transient(e, idempotent=idempotent)),
        wait=tenacity.wait_exponential_jitter(
            multiplier=wait_initial.total_seconds(), max=wait_max.total_seconds()
        ),
        stop=tenacity.stop_after_delay(timeout.total_seconds()),
        before_sleep=tenacity.before_sleep_log(_LOG, logging.DEBUG),
        retry_error_callback=_give_up,
    )
