"""A dp round that needs every learner completes after one learner's upload gave up (the dp hang).

In `ddiloco bench quality --sync-mode dp` on a starved machine, learner-2's upload ended with
DEADLINE_EXCEEDED after its only attempt, its session broke ("uploads keep failing"), it re-joined
and never sent that gradient again: the round (K = every learner) never merged and every learner
waited forever, the barrier's resends included. Real syncer servicer and SyncClients on
127.0.0.1:0; the servicer stalls the slow learner's first upload past the call's deadline without
taking it. Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from ddiloco.algo import fragments as fragments_lib
from ddiloco.rpc import errors
from ddiloco.rpc import security
from ddiloco.learner import client as client_lib
from services.syncer import config as config_lib
from services.syncer import servicer as servicer_lib
from tests import fakes
from tests.service.conftest import serve_syncer

pytestmark = pytest.mark.timeout(120)

SHAPE = (16, 16)
SLOW = "learner-1"


class _Replay:
    """The request stream with its first message (already read) put back in front."""

    def __init__(self, first, rest) -> None:
        self._first, self._rest = first, rest

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self._rest.__anext__()


class _StallingServicer(servicer_lib.SyncerServicer):
    """Holds SLOW's first upload, unread, past its deadline: the learner hears DEADLINE_EXCEEDED."""

    stalled = False

    async def _upload(self, iterator, scope, context):
        first = await asyncio.wait_for(iterator.__anext__(), 10)
        if first.header.learner_id == SLOW and not self.stalled:
            self.stalled = True
            await asyncio.sleep(3.0)  # the call's deadline (about 1 s) passes meanwhile: not taken
            raise errors.Unavailable("stalled upload (test)", reason="test")
        return await super()._upload(_Replay(first, iterator), scope, context)


def _client(address: str, learner_id: str) -> client_lib.SyncClient:
    # The upload deadline is about call_timeout_s; a retry bound below it: "gave up after 1 attempts".
    return client_lib.SyncClient(client_lib.ClientConfig(
        target=address, learner_id=learner_id, incarnation=1, region="r", tokens_per_step=0,
        call_timeout_s=1.0, retry_bound_s=0.5, reconnect_max_backoff_s=0.5,
        security=security.ClientSecurity(insecure=True)))


def test_a_dp_round_completes_after_a_given_up_upload_and_counts_it_once():
    # Fails before the fix: the slow learner never sends again, version stays 0 (timed out).
    config = config_lib.apply_sync_mode(config_lib.SyncerConfig(
        **{**fakes.CONFIG_DEFAULTS, "sync_mode": "dp", "min_quorum": 2}))
    core = fakes.make_core(config=config, specs=[fragments_lib.TensorSpec("w", SHAPE)], initial_std=0.0)
    servicer = _StallingServicer(core, max_concurrent_uploads=4)

    async def scenario() -> None:
        async with serve_syncer(None, servicer=servicer, auth=False) as served:
            address = served.handle.address
            clients = [_client(address, f"learner-{i}") for i in range(2)]
            try:
                for c in clients:
                    await asyncio.wait_for(asyncio.to_thread(c.start, 30.0), 40)
                jobs = [client_lib.UploadJob(fragment_id=0, base_version=0, syncer_instance=c.instance, steps=1,
                                             tokens=10, delta=np.full(SHAPE[0] * SHAPE[1], 1e-3 * (i + 1), np.float32),
                                             local_step=1) for i, c in enumerate(clients)]
                for c, job in zip(clients, jobs):
                    c.submit_upload(job)
                deadline = time.monotonic() + 30.0
                last_send = time.monotonic()
                while core.versions()[0] == 0:
                    assert time.monotonic() < deadline, "the dp round never merged"
                    if time.monotonic() - last_send >= 2.0:  # the barrier's resends (LearnerLoop)
                        for c, job in zip(clients, jobs):
                            c.submit_upload(job)
                        last_send = time.monotonic()
                    await asyncio.sleep(0.05)
                assert servicer.stalled
                assert clients[1].stats.uploads_failed >= 1 and clients[1].stats.sessions >= 2
                record = core.rounds.merges[-1]
                assert sorted(c.learner_id for c in record.contributors) == ["learner-0", "learner-1"]
                assert core.member(SLOW).uploads_accepted == 1  # applied once
            finally:
                for c in clients:
                    await asyncio.to_thread(c.close, leave=False)

    asyncio.run(scenario())
