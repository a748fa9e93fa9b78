"""Fencing reaches the learner as a typed signal, not as wording (issue 22).

The syncer sends a refusal's reason (ServiceError.reason) as trailing metadata
(`ddiloco.rpc.errors.status_metadata`); the learner's client ends its session on an upload refused
with reason `fenced` or `not_joined` (then the re-join is refused and the learner stops, or works),
whatever the details say, and treats every other FAILED_PRECONDITION as a refusal it may resend,
even when its details contain "fenced" or "Join" (as a learner id may). Real servers on
127.0.0.1:0; every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest

from ddiloco.algo import fragments as fragments_lib
from ddiloco.rpc import errors
from ddiloco.rpc import security
from ddiloco.learner import client as client_lib
from services.syncer import core as core_lib
from services.syncer import servicer as servicer_lib
from tests import fakes
from tests.service.conftest import serve_syncer

pytestmark = pytest.mark.timeout(120)

SHAPE = (32, 32)
LEARNER = "learner-0"


def _core() -> core_lib.SyncerCore:
    # One fragment; a quorum of 2 that one learner never reaches (nothing merges meanwhile).
    return fakes.make_core(specs=[fragments_lib.TensorSpec("w", SHAPE)], num_fragments=1, sync_period_steps=1,
                           min_quorum=2, initial_std=0.0)


class _RefusingServicer(servicer_lib.SyncerServicer):
    """Refuses each upload, after its header, with the next scripted ServiceError."""

    def __init__(self, *args, refusals: list[errors.ServiceError], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.refusals = refusals

    async def _upload(self, request_iterator, scope, context):
        await asyncio.wait_for(request_iterator.__aiter__().__anext__(), 10)  # the header
        raise self.refusals.pop(0)


def _client(address: str, incarnation: int = 1) -> client_lib.SyncClient:
    return client_lib.SyncClient(client_lib.ClientConfig(
        target=address, learner_id=LEARNER, incarnation=incarnation, region="r", tokens_per_step=0,
        call_timeout_s=5.0, retry_bound_s=5.0, security=security.ClientSecurity(insecure=True)))


def _job(client: client_lib.SyncClient) -> client_lib.UploadJob:
    delta = np.full(SHAPE[0] * SHAPE[1], 1e-3, np.float32)
    return client_lib.UploadJob(fragment_id=0, base_version=0, syncer_instance=client.instance, steps=1,
                                tokens=10, delta=delta, local_step=1)


async def _until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _with_client(servicer, scenario, incarnation: int = 1):
    async with serve_syncer(None, servicer=servicer, auth=False) as served:
        address = served.handle.address
        client = _client(address, incarnation)
        try:
            await asyncio.wait_for(asyncio.to_thread(client.start, 30.0), 40)
            await scenario(client, address)
        finally:
            await asyncio.to_thread(client.close, leave=False)


def test_the_reason_travels_as_trailing_metadata():
    fenced = errors.FailedPrecondition("the wording is for people", reason=errors.REASON_FENCED)
    metadata = errors.status_metadata(fenced)
    assert metadata == ((errors.REASON_KEY, "fenced"),)
    rpc_error = grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(),
                                     grpc.aio.Metadata(*metadata), details=str(fenced))
    assert errors.reason_of(rpc_error) == errors.REASON_FENCED
    worded = grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                  details="learner 'fenced-1' is fenced off: call Join first")
    assert errors.reason_of(worded) == ""
    assert errors.status_metadata(errors.FailedPrecondition("x", reason="caf\u00e9")) == ()  # not a metadata value


def test_a_refusal_worded_like_fencing_but_typed_otherwise_is_resendable():
    refusal = errors.FailedPrecondition(
        "learner 'fenced-joiner' base 0 is stale: not fenced off, no need to call Join first", reason="stale")
    servicer = _RefusingServicer(_core(), max_concurrent_uploads=4, refusals=[refusal])

    async def scenario(client, _):
        client.submit_upload(_job(client))
        refused: set = set()

        def taken() -> bool:
            refused.update(client.take_refused())
            return bool(refused)

        await _until(taken)  # recorded as resendable: the session was not ended
        assert refused == {(0, client.instance, 0)}
        assert client.stats.sessions == 1 and client.fenced is None and client.stats.uploads_refused == 1

    asyncio.run(_with_client(servicer, scenario))


def test_a_refusal_typed_fenced_ends_the_session_whatever_its_wording():
    refusal = errors.FailedPrecondition("upload refused (test)", reason=errors.REASON_FENCED)
    servicer = _RefusingServicer(_core(), max_concurrent_uploads=4, refusals=[refusal])

    async def scenario(client, _):
        client.submit_upload(_job(client))
        await _until(lambda: client.stats.sessions == 2)  # re-joined (this syncer still knows the learner)
        assert client.take_refused() == set() and client.stats.uploads_refused == 1 and client.fenced is None

    asyncio.run(_with_client(servicer, scenario))


def test_a_learner_fenced_off_by_its_next_life_stops():
    core = _core()
    servicer = servicer_lib.SyncerServicer(core, max_concurrent_uploads=4)

    async def scenario(old, address):
        new = _client(address, incarnation=2)
        try:
            await asyncio.wait_for(asyncio.to_thread(new.start, 30.0), 40)
            old.submit_upload(_job(old))
            await _until(lambda: old.fenced is not None)
            assert isinstance(old.fenced, client_lib.FencedError) and "FAILED_PRECONDITION" in str(old.fenced)
            assert new.fenced is None and core.membership.members[LEARNER].incarnation == 2
        finally:
            await asyncio.to_thread(new.close, leave=False)

    asyncio.run(_with_client(servicer, scenario))
