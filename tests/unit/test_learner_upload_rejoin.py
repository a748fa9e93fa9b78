"""An upload that gave up breaks the session; after the re-join the same contribution goes out again.

The data-parallel benchmark hung for good on a starved machine: one learner's upload ended with
DEADLINE_EXCEEDED after its only attempt (RetriesExhausted), the session broke ("uploads keep
failing") and the learner re-joined, but it never sent that contribution again, and the round,
which needs all four learners in dp mode, never merged. The client requeued the job and woke its
upload loop before the session's task group ended; the loop started the job in the dying group,
which cancelled that task before it ran, so the job was lost and the fragment stayed marked as in
flight: every later upload of it, the barrier's resends included, waited forever.

The real SyncClient (never started: no thread, no network) runs its upload loop for two sessions on
a fake stub that keys contributions the way the syncer does (at most once per key).
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from ddiloco.learner import client as client_lib
from ddiloco.v1 import common_pb2, syncer_pb2

_INSTANCE = "inst"
_WAIT_S = 10.0


class _KeyedStub:
    """UploadFragment of a syncer that applies a contribution once per (fragment, base, local step).

    While `broken`, every call ends with DEADLINE_EXCEEDED; with `taken_before_deadline`, the first
    of them was applied before the deadline hit (the learner cannot tell which happened)."""

    def __init__(self, *, taken_before_deadline: bool) -> None:
        self.broken = True
        self.taken_before_deadline = taken_before_deadline
        self.calls = 0
        self.applied: dict[tuple[int, int, int], int] = {}

    async def UploadFragment(self, request_iterator, timeout=None):  # noqa: N802 - the gRPC method name
        self.calls += 1
        header = next(iter(request_iterator)).header
        key = (header.fragment_id, header.base_version, header.local_step)
        seen = key in self.applied
        if self.broken:
            if self.taken_before_deadline and not seen:
                self.applied[key] = 1
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="Stream removed (Deadline Exceeded)")
        if seen:
            return syncer_pb2.UploadFragmentResponse(result=syncer_pb2.UploadFragmentResponse.RESULT_DUPLICATE,
                                                     current_version=header.base_version)
        self.applied[key] = 1
        return syncer_pb2.UploadFragmentResponse(result=syncer_pb2.UploadFragmentResponse.RESULT_ACCEPTED,
                                                 current_version=header.base_version)


def _client(stub: _KeyedStub) -> client_lib.SyncClient:
    # A retry bound shorter than the first backoff: one attempt, then "gave up after 1 attempts".
    client = client_lib.SyncClient(client_lib.ClientConfig(
        target="127.0.0.1:1", learner_id="learner-2", incarnation=1, region="r", tokens_per_step=64,
        retry_bound_s=0.01))
    client.instance = _INSTANCE
    client.run_config = syncer_pb2.RunConfig(num_fragments=1, sync_period_steps=1, upload_codec=common_pb2.CODEC_FP32,
                                             upload_block_size=128, chunk_size_bytes=1 << 19, zstd_level=3)
    client._stub = stub
    return client


def _job() -> client_lib.UploadJob:
    return client_lib.UploadJob(fragment_id=0, base_version=731, syncer_instance=_INSTANCE, steps=1, tokens=2048,
                                delta=np.full(64, 0.5, np.float32), local_step=732)


async def _two_sessions(client: client_lib.SyncClient, stub: _KeyedStub) -> list:
    """The first session breaks on the given-up upload; the second (after the re-join) runs until
    the syncer has answered the contribution, or `_WAIT_S`."""
    client._upload_wakeup = asyncio.Event()
    client.submit_upload(_job())
    with pytest.raises(BaseExceptionGroup) as broke:
        await asyncio.wait_for(client._upload_loop(), _WAIT_S)
    assert broke.group_contains(client_lib.uploads_lib.SessionBroken)
    assert stub.calls >= 1  # one attempt, or two when the retry's first backoff fits in its bound
    stub.calls = 0
    outcomes = client.take_outcomes()
    stub.broken = False  # re-joined: the link works again
    session = asyncio.ensure_future(client._upload_loop())
    try:
        deadline = asyncio.get_running_loop().time() + _WAIT_S
        while not outcomes and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
            outcomes += client.take_outcomes()
    finally:
        session.cancel()
        with pytest.raises(asyncio.CancelledError):
            await session
    return outcomes


@pytest.mark.parametrize("taken_before_deadline", [False, True], ids=["lost", "taken"])
def test_a_given_up_upload_is_sent_again_after_the_rejoin_and_applied_once(taken_before_deadline):
    # Fails before the fix: the second session sent nothing (no call, no outcome).
    stub = _KeyedStub(taken_before_deadline=taken_before_deadline)
    client = _client(stub)
    outcomes = asyncio.run(_two_sessions(client, stub))
    expected = client_lib.OUTCOME_DUPLICATE if taken_before_deadline else client_lib.OUTCOME_ACCEPTED
    assert [(o.fragment_id, o.local_step, o.result) for o in outcomes] == [(0, 732, expected)]
    assert stub.calls == 1  # sent again once, in the second session
    assert stub.applied == {(0, 731, 732): 1}  # at most once: the syncer's key
    assert client.stats.uploads_failed == 1
    assert not client._sending and not client._uploads

