"""Bounded waiting: poll a condition until it holds or a deadline passes, then fail the test with
what was awaited. Every wait in the tests goes through here, so none can hang.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

# How long learners and the evaluator get after SIGTERM at a test's teardown before SIGKILL
# (LocalCluster.stop_all's clients_timeout_s; the syncers and stores keep the full timeout). Their
# graceful finish (their last work merged, up to their finish timeout) is not what a test asserts
# at its teardown, and there it often cannot complete: the test stopped or killed their syncer, or
# the rounds of their final contributions wait for learners that are stopping too. Given the 10 s
# of the other services, those waits were most of many tests' teardowns.
TEARDOWN_CLIENTS_S = 3.0


def wait_until(predicate: Callable[[], object], *, timeout_s: float, what: str,
               not_yet: tuple[type[BaseException], ...] = (), interval_s: float = 0.05,
               describe: Callable[[], str] | None = None):
    """Polls predicate() until truthy and returns its value. The exceptions in `not_yet` (a service
    not answering yet) count as "not yet"; any other fails the wait at once. On timeout fails with
    `what`, the last such exception and `describe()` (e.g. logs)."""
    deadline = time.monotonic() + timeout_s
    last_exc: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except not_yet as exc:
            last_exc = exc
        time.sleep(interval_s)
    detail = f"\n{describe()}" if describe else ""
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what} (last error: {last_exc}){detail}")


def wait_for_rpc(predicate: Callable[[], object], *, timeout_s: float, what: str, interval_s: float = 0.2):
    """wait_until for a predicate that calls a service: gRPC errors (not serving yet, restarting)
    count as "not yet"."""
    return wait_until(predicate, timeout_s=timeout_s, what=what, not_yet=(grpc.RpcError,), interval_s=interval_s)


async def wait_until_async(predicate: Callable[[], object], *, timeout_s: float, what: str,
                           interval_s: float = 0.01) -> None:
    """wait_until on the running event loop: sleeps without blocking it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(interval_s)
