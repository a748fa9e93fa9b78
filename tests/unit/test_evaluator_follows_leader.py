"""The evaluator follows the leading syncer (services/learner/leader_link.py): two fake syncers on
127.0.0.1:0, leadership moves from one to the other, and the evaluator's watch stream and reports
go to the new leader. Before the leader link the evaluator took one address and kept calling it.

A silent syncer (SIGSTOP, a vanished host: TCP accepts, nothing answers) is left within a health
check or two, far below the call deadline (30 s here) and the watch stream's (600 s): at the head
of the list when the evaluator starts (a socket that listens and never accepts), and when the
leader freezes mid-run (every handler of the fake, health included, stops answering). Before the
link asked the list who leads and watched its syncer's health (ddiloco.learner.leader_watch), both
tests failed: the first call waited at the frozen head for its deadline, and the watch stream kept
waiting at the frozen leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddiloco.rpc import errors
from ddiloco.rpc import security as security_lib
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde
from services.learner import config as config_lib
from services.learner import evaluator as evaluator_lib
from services.learner import leader_link
from tests import ports

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
        self.thawed = asyncio.Event()  # cleared: every handler hangs, as in a stopped process
        self.thawed.set()

    def leads(self) -> bool:
        return self.epoch > 0

    async def _refuse(self, context) -> None:
        metadata = ((errors.REASON_KEY, errors.REASON_NOT_LEADER), (errors.LEADER_KEY, self.leader_address))
        await context.abort(grpc.StatusCode.UNAVAILABLE, "this syncer is a standby", trailing_metadata=metadata)

    async def GetTrainingState(self, request, context):
        await self.thawed.wait()
        state = syncer_pb2.TrainingState(epoch=self.epoch, tokens_merged=self.version,
                                         leader_address=self.address if self.leads() else self.leader_address)
        return syncer_pb2.GetTrainingStateResponse(state=state)

    async def ReportEval(self, request, context):
        await self.thawed.wait()
        if not self.leads():
            await self._refuse(context)
        self.reports.append(request)
        return syncer_pb2.ReportEvalResponse()

    async def WatchFragments(self, request, context):
        await self.thawed.wait()
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


class _FakeHealth(health_pb2_grpc.HealthServicer):
    """The Syncer service's health as the syncer reports it: SERVING while it leads."""

    def __init__(self, fake: _FakeSyncer) -> None:
        self._fake = fake

    async def Check(self, request, context):  # noqa: N802 - the gRPC method's name
        await self._fake.thawed.wait()
        serving = health_pb2.HealthCheckResponse.SERVING
        return health_pb2.HealthCheckResponse(status=serving if self._fake.leads() else
                                              health_pb2.HealthCheckResponse.NOT_SERVING)


async def _serve(fake: _FakeSyncer) -> grpc.aio.Server:
    server = grpc.aio.server()
    syncer_pb2_grpc.add_SyncerServicer_to_server(fake, server)
    health_pb2_grpc.add_HealthServicer_to_server(_FakeHealth(fake), server)
    fake.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    return server


async def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def _leader_and_standby():
    """Two fake syncers serving: `first` leads (epoch 1, version 5), `second` stands by naming it."""
    first, second = _FakeSyncer(), _FakeSyncer()
    servers = [await _serve(first), await _serve(second)]
    first.epoch, first.version = 1, 5
    second.leader_address = first.address
    try:
        yield first, second
    finally:
        for fake in (first, second):
            fake.thawed.set()  # let the handlers of a frozen fake end, so its server stops
        for server in servers:
            await server.stop(None)


async def _leadership_moves() -> None:
    async with _leader_and_standby() as (first, second):
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



_CALL_TIMEOUT_S = 30.0  # each call's deadline: the old behaviour waited this long at a frozen syncer
_SILENT_BOUND_S = 5.0  # leaving a silent syncer: a 0.5 s health check every 0.2 s, plus slack for a loaded host


def _link(targets: str, *, check_interval_s: float = 0.2, check_timeout_s: float = 0.5) -> leader_link.LeaderLink:
    return leader_link.LeaderLink(targets, security_lib.ClientSecurity(insecure=True), call_timeout_s=_CALL_TIMEOUT_S,
                                  retry_pause_s=0.05, leader_check_interval_s=check_interval_s,
                                  leader_check_timeout_s=check_timeout_s)


async def _frozen_head() -> tuple[float, float]:
    leader = _FakeSyncer()
    server = await _serve(leader)
    leader.epoch, leader.version = 1, 3
    with ports.frozen_address() as frozen:
        # The shipped health-check deadlines (1 s interval, 2 s timeout): the leader answers at once.
        link = _link(f"{frozen},{leader.address}", check_interval_s=1.0, check_timeout_s=2.0)
        cfg = config_lib.EvaluatorConfig(syncer=f"{frozen},{leader.address}", insecure=True, timeout_s=_WAIT_S,
                                         call_timeout_s=_CALL_TIMEOUT_S)
        stop = asyncio.Event()
        try:
            started = time.monotonic()
            state = await evaluator_lib.fetch_state(link, started + _WAIT_S)
            state_s = time.monotonic() - started
            assert (state.epoch, link.current) == (1, leader.address)
            watcher = evaluator_lib.GlobalModelWatcher(link, _NUM_FRAGMENTS)
            watch = asyncio.create_task(watcher.keep_watching(stop, pause_s=0.05))
            await asyncio.wait_for(watcher.complete.wait(), _WAIT_S)
            await evaluator_lib.report(link, cfg, dict(watcher.versions), 2.5, heldout_tokens=64)
            reported_s = time.monotonic() - started
            assert [r.heldout_loss for r in leader.reports] == [2.5]
            stop.set()
            watch.cancel()
        finally:
            await link.close()
            await server.stop(None)
    return state_s, reported_s


def test_a_fresh_evaluator_skips_a_frozen_head_of_its_list():
    state_s, reported_s = asyncio.run(asyncio.wait_for(_frozen_head(), 60.0))
    print(f"frozen head: training state from the leader after {state_s:.3f} s, first report after {reported_s:.3f} s")
    # One health round trip to the leader, not the first call's deadline at the frozen head (30 s),
    # nor the 2 s the frozen syncer's own health check takes to fail.
    assert state_s < 1.5, state_s
    assert reported_s < _SILENT_BOUND_S, reported_s


async def _leader_freezes() -> float:
    async with _leader_and_standby() as (first, second):
        cfg = config_lib.EvaluatorConfig(syncer=f"{first.address},{second.address}", insecure=True, timeout_s=_WAIT_S,
                                         call_timeout_s=_CALL_TIMEOUT_S)
        link = _link(cfg.syncer)
        stop = asyncio.Event()
        try:
            watcher = evaluator_lib.GlobalModelWatcher(link, _NUM_FRAGMENTS)
            watch = asyncio.create_task(watcher.keep_watching(stop, pause_s=0.05))  # the shipped 600 s stream deadline
            await asyncio.wait_for(watcher.complete.wait(), _WAIT_S)
            assert watcher.versions == {0: 5, 1: 5} and link.current == first.address

            # The leader goes silent with its watch stream open; the standby is elected (epoch 2).
            first.thawed.clear()
            second.epoch, second.version, second.leader_address = 2, 7, ""
            elected = time.monotonic()
            await _until(lambda: watcher.versions == {0: 7, 1: 7}, "the new leader's fragments")
            followed_s = time.monotonic() - elected
            result = await asyncio.wait_for(evaluator_lib.report(link, cfg, dict(watcher.versions), 1.0, heldout_tokens=64),
                                            _SILENT_BOUND_S)
            assert result["tokens_merged"] == 7 and link.current == second.address and link.epoch == 2
            assert [r.heldout_loss for r in second.reports] == [1.0] and not first.reports
            stop.set()
            watch.cancel()
        finally:
            first.thawed.set()  # let the hanging handlers end before the link closes
            await link.close()
        return followed_s


def test_the_evaluator_leaves_a_leader_that_froze_mid_run():
    followed_s = asyncio.run(asyncio.wait_for(_leader_freezes(), 60.0))
    print(f"leader froze mid-run: the new leader's fragments {followed_s:.3f} s after its election")
    assert followed_s < _SILENT_BOUND_S, followed_s  # not the watch stream's 600 s, nor HTTP/2 keepalive's 40 s
