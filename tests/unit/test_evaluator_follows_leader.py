"""The evaluator follows the leading syncer (services/learner/leader_link.py): two fake syncers on
127.0.0.1:0, leadership moves from one to the other, and the evaluator's watch stream and reports
go to the new leader. Before the leader link the evaluator took one address and kept calling it."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np

from ddiloco.rpc import errors
from ddiloco.rpc import security as security_lib
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde
from services.learner import config as config_lib
from services.learner import evaluator as evaluator_lib
from services.learner import leader_link

_NUM_FRAGMENTS = 2
_WAIT_S = 20.0


class _FakeSyncer(syncer_pb2_grpc.SyncerServicer):
    """Leads (epoch > 0) or stands by naming `leader_address`, as services/syncer/leadership.py does."""

    def __init__(self) -> None:
        self.epoch = 0
        self.leader_address = ""
        self.address = ""
        self.version = 0  # of every fragment this syncer broadcasts
        self.reports: list[syncer_pb2.ReportEvalRequest] = []
        self.deposed = asyncio.Event()  # ends this syncer's open watch streams with not_leader

    def leads(self) -> bool:
        return self.epoch > 0

    async def _refuse(self, context) -> None:
        metadata = ((errors.REASON_KEY, errors.REASON_NOT_LEADER), (errors.LEADER_KEY, self.leader_address))
        await context.abort(grpc.StatusCode.UNAVAILABLE, "this syncer is a standby", trailing_metadata=metadata)

    async def GetTrainingState(self, request, context):
        state = syncer_pb2.TrainingState(epoch=self.epoch, tokens_merged=self.version,
                                         leader_address=self.address if self.leads() else self.leader_address)
        return syncer_pb2.GetTrainingStateResponse(state=state)

    async def ReportEval(self, request, context):
        if not self.leads():
            await self._refuse(context)
        self.reports.append(request)
        return syncer_pb2.ReportEvalResponse()

    async def WatchFragments(self, request, context):
        if not self.leads():
            await self._refuse(context)
        for fid in range(_NUM_FRAGMENTS):
            encoded = codec_lib.encode(np.full(4, float(self.version), np.float32), "fp32")
            yield syncer_pb2.WatchFragmentsResponse(header=syncer_pb2.GlobalFragmentHeader(
                fragment_id=fid, version=self.version, syncer_instance=self.address,
                payload=serde.payload_info_to_proto(encoded), epoch=self.epoch))
            for chunk in serde.payload_chunks(encoded.payload, 1 << 16):
                yield syncer_pb2.WatchFragmentsResponse(chunk=chunk)
        await self.deposed.wait()
        await self._refuse(context)


async def _serve(fake: _FakeSyncer) -> grpc.aio.Server:
    server = grpc.aio.server()
    syncer_pb2_grpc.add_SyncerServicer_to_server(fake, server)
    fake.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    return server


async def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def _leadership_moves() -> None:
    first, second = _FakeSyncer(), _FakeSyncer()
    servers = [await _serve(first), await _serve(second)]
    first.epoch, first.version = 1, 5
    second.leader_address = first.address
    cfg = config_lib.EvaluatorConfig(syncer=f"{second.address},{first.address}", insecure=True, timeout_s=_WAIT_S,
                                     call_timeout_s=2.0)
    link = leader_link.LeaderLink(cfg.syncer, security_lib.ClientSecurity(insecure=True),
                                  call_timeout_s=cfg.call_timeout_s, retry_pause_s=0.05)
    stop = asyncio.Event()
    try:
        # The list starts with the standby: its training state names the leader, and the link goes there.
        state = await evaluator_lib.fetch_state(link, time.monotonic() + _WAIT_S)
        assert (state.epoch, link.current) == (1, first.address)
        watcher = evaluator_lib.GlobalModelWatcher(link, _NUM_FRAGMENTS)
        watch = asyncio.create_task(watcher.keep_watching(stop, pause_s=0.05))
        await asyncio.wait_for(watcher.complete.wait(), _WAIT_S)
        assert watcher.versions == {0: 5, 1: 5}
        await evaluator_lib.report(link, cfg, dict(watcher.versions), 1.5, heldout_tokens=64)
        assert [r.heldout_loss for r in first.reports] == [1.5] and not second.reports

        # Leadership moves: the second syncer leads with a newer epoch and other versions; the first
        # stands by naming it, and its open watch stream ends with not_leader.
        second.epoch, second.version, second.leader_address = 2, 7, ""
        first.epoch, first.leader_address = 0, second.address
        first.deposed.set()
        await _until(lambda: watcher.versions == {0: 7, 1: 7}, "the new leader's fragments")
        assert watcher.values[0].tolist() == [7.0] * 4 and watcher.instance == second.address
        result = await evaluator_lib.report(link, cfg, dict(watcher.versions), 1.25, heldout_tokens=64)
        assert result["tokens_merged"] == 7 and link.current == second.address and link.epoch == 2
        assert [r.heldout_loss for r in second.reports] == [1.25]
        assert serde.versions_from_proto(second.reports[0].evaluated) == {0: 7, 1: 7}
        assert len(first.reports) == 1  # nothing more went to the deposed leader
        stop.set()
        watch.cancel()
    finally:
        await link.close()
        for server in servers:
            await server.stop(None)


def test_the_evaluator_follows_leadership_from_one_syncer_to_the_other():
    asyncio.run(asyncio.wait_for(_leadership_moves(), 60.0))


async def _no_leader() -> None:
    fake = _FakeSyncer()
    server = await _serve(fake)
    link = leader_link.LeaderLink(fake.address, security_lib.ClientSecurity(insecure=True), call_timeout_s=0.5,
                                  retry_pause_s=0.05)
    try:
        started = time.monotonic()
        try:
            await link.call("ReportEval", syncer_pb2.ReportEvalRequest(), deadline_s=started + 1.0)
        except TimeoutError as exc:
            # The last attempt's own timeout is cut to what is left, so under load it may end as
            # DEADLINE_EXCEEDED rather than the standby's UNAVAILABLE.
            assert "ReportEval" in str(exc) and fake.address in str(exc)
        else:
            raise AssertionError("a standby with no leader answered ReportEval")
        assert time.monotonic() - started < 6.0  # the caller's deadline bounds the retries
    finally:
        await link.close()
        await server.stop(None)


def test_a_call_with_no_leader_anywhere_fails_at_its_deadline():
    asyncio.run(asyncio.wait_for(_no_leader(), 30.0))
