"""A learner (re)starting while the syncer at the head of its --syncer list is frozen (SIGSTOP, or a
host gone silent: TCP accepts, nothing answers) joins the leader of the list within a second or
two, not when its Join at the frozen syncer reaches its deadline (call_timeout_s, 10 s).

The frozen syncer here is a socket that listens but never accepts: the kernel completes the TCP
handshake and nothing ever answers, as with a stopped process. The leader is a gRPC server on
loopback with the health service and a Syncer that answers Join. Before the fix (the client's
`_connect` asking the list who leads, and the leader watch running beside the Join) both client
tests failed: `start` timed out, the Join hanging at the frozen head for its 10 s deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ddiloco.learner import client as client_lib
from ddiloco.learner import leader_watch as watch_lib
from ddiloco.learner import targets as targets_lib
from ddiloco.rpc import errors
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc
from tests import ports

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_the_session_goes_to_the_syncer_that_answered_serving_unless_a_leader_was_named():
    t = targets_lib.SyncerTargets("a:1,b:2,c:3")
    assert t.probing
    assert t.next(serving="b:2") == "b:2"  # not the head of the list
    assert t.next() == "c:3"  # a failure later rotates on from there
    assert t.next(serving="x:9") == "a:1"  # an address outside the list is never used
    assert t.redirected(targets_lib.NotLeader("standby", leader="c:3")) == "c:3"
    assert not t.probing  # a named leader is tried at once, without asking
    assert t.next(serving="b:2") == "c:3"
    assert not targets_lib.SyncerTargets("syncers.example:50051").probing  # one address: as before



class _Syncer(syncer_pb2_grpc.SyncerServicer):
    """Join and an idle watch stream; a standby (not `leading`) refuses Join naming no leader."""

    def __init__(self, health_servicer: health.HealthServicer, leading: bool) -> None:
        self._health = health_servicer
        self.closing = threading.Event()
        self.joins = 0
        self.set_leading(leading)

    def set_leading(self, leading: bool) -> None:
        self.leading = leading
        self._health.set(watch_lib.SYNCER_SERVICE, SERVING if leading else NOT_SERVING)

    def Join(self, request, context):  # noqa: N802 - the gRPC method's name
        self.joins += 1
        if not self.leading:
            context.set_trailing_metadata(((errors.REASON_KEY, errors.REASON_NOT_LEADER),))
            context.abort(grpc.StatusCode.UNAVAILABLE, "this syncer is a standby: no leader is known yet")
        return syncer_pb2.JoinResponse(config=syncer_pb2.RunConfig(num_fragments=0), syncer_instance="live", epoch=2)

    def WatchFragments(self, request, context):  # noqa: N802
        self.closing.wait(60)  # nothing to send: the session just stays open
        return iter(())


@contextlib.contextmanager
def _live_syncer(*, leading: bool):
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=8))
    health_servicer = health.HealthServicer()
    syncer = _Syncer(health_servicer, leading)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    syncer_pb2_grpc.add_SyncerServicer_to_server(syncer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", syncer
    finally:
        syncer.closing.set()
        server.stop(0)


def _client(targets: str, **overrides) -> client_lib.SyncClient:
    return client_lib.SyncClient(client_lib.ClientConfig(
        target=targets, learner_id="l0", incarnation=1, region="r", tokens_per_step=1, **overrides))


def test_a_fresh_learner_skips_a_frozen_head_of_its_list_and_joins_the_leader_at_once():
    with ports.frozen_address() as frozen, _live_syncer(leading=True) as (live, syncer):
        client = _client(f"{frozen},{live}")  # the shipped deadlines: Join 10 s, health check 2 s
        started = time.monotonic()
        try:
            client.start(timeout_s=5.0)
            joined_s = time.monotonic() - started
            assert client._targets.current == live and syncer.joins == 1
        finally:
            client.close(leave=False)
    # Within one health round trip: not the Join's deadline (10 s), nor the 2 s a health check of
    # the frozen syncer takes to fail (the leader watch beside the Join alone would take that).
    assert joined_s < 1.5, joined_s


def test_a_learner_waiting_at_a_frozen_syncer_joins_the_standby_once_it_is_elected():
    """No syncer leads when the learner starts (the head is frozen, the other one is a standby that
    knows no leader yet): its Join hangs at the frozen head, and is abandoned for the new leader
    within a health check's deadline of the election, not when it reaches its own deadline."""
    with ports.frozen_address() as frozen, _live_syncer(leading=False) as (live, syncer):
        client = _client(f"{frozen},{live}", leader_check_interval_s=0.2, leader_check_timeout_s=0.5)
        elected_at = []

        def elect() -> None:
            elected_at.append(time.monotonic())
            syncer.set_leading(True)

        timer = threading.Timer(1.5, elect)
        timer.start()
        try:
            client.start(timeout_s=8.0)
            joined_at = time.monotonic()
            assert client._targets.current == live
        finally:
            timer.cancel()
            client.close(leave=False)
    assert elected_at
    joined_s = joined_at - elected_at[0]
    assert joined_s < 0.2 + 0.5 + 1.0, joined_s  # a tick, a check's deadline, and slack for a loaded machine


def test_first_serving_answers_at_the_first_serving_syncer_and_is_bounded_when_none_leads():
    async def scenario():
        with ports.frozen_address() as frozen, _live_syncer(leading=False) as (standby, syncer):
            watch = watch_lib.LeaderWatch([frozen, standby], timeout_s=0.5)
            loop = asyncio.get_running_loop()
            try:
                started = loop.time()
                assert await asyncio.wait_for(watch.first_serving([frozen, standby]), 5) == ""
                none_s = loop.time() - started
                await asyncio.to_thread(syncer.set_leading, True)
                started = loop.time()
                assert await asyncio.wait_for(watch.first_serving([frozen, standby]), 5) == standby
                found_s = loop.time() - started
            finally:
                await watch.close()
        assert 0.4 < none_s < 2.0, none_s  # the frozen syncer's check ran to its deadline, no longer
        assert found_s < 0.4, found_s  # the leader's answer, without waiting for the frozen one

    asyncio.run(scenario())
