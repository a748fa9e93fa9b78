"""ddiloco/learner/leader_watch.py against real gRPC health servers on loopback: a silent syncer is
left once another one leads, and never while no other one does (a slow leader keeps its session)."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ddiloco.learner import leader_watch as watch_lib
from ddiloco.learner import targets as targets_lib
from ddiloco.rpc import channel as channel_lib

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _SlowHealth(health.aio.HealthServicer):
    """Answers every check after `delay_s` (a huge delay: a syncer that went silent)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.checks = 0

    async def Check(self, request, context):  # noqa: N802 - the gRPC method's name
        self.checks += 1
        await asyncio.sleep(self.delay_s)
        return await super().Check(request, context)


async def _syncer(status, delay_s: float = 0.0):
    """A server whose Syncer service has `status`, answering after delay_s; (server, address, servicer)."""
    server = grpc.aio.server()
    servicer = _SlowHealth(delay_s)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.set(watch_lib.SYNCER_SERVICE, status)
    return server, f"127.0.0.1:{port}", servicer


async def _stop(*servers) -> None:
    for server in servers:
        await server.stop(0)


@contextlib.asynccontextmanager
async def _watching(targets, current: str, *, interval_s: float, timeout_s: float):
    """LeaderWatch.watch of `current` (over a channel of its own) as a task: (watch, task); on exit
    the task is cancelled and the channels closed."""
    watch = watch_lib.LeaderWatch(targets, interval_s=interval_s, timeout_s=timeout_s)
    channel = channel_lib.aio_channel(current)
    task = asyncio.ensure_future(watch.watch(channel, current))
    try:
        yield watch, task
    finally:
        task.cancel()
        await channel.close()
        await watch.close()


def test_a_silent_syncer_is_left_once_another_leads():
    async def scenario():
        silent, silent_at, _ = await _syncer(SERVING, delay_s=3600)
        standby, standby_at, standby_health = await _syncer(NOT_SERVING)
        try:
            async with _watching([silent_at, standby_at], silent_at, interval_s=0.2, timeout_s=0.4) as (watch, task):
                await asyncio.sleep(1.5)  # the standby is asked while the leader is silent, but does not lead
                assert not task.done()
                assert watch.checks_of_others >= 3 and standby_health.checks >= 3
                await standby_health.set(watch_lib.SYNCER_SERVICE, SERVING)  # elected
                elected_at = asyncio.get_running_loop().time()
                with pytest.raises(watch_lib.LeaderMoved) as moved:
                    await asyncio.wait_for(task, 5)
                moved_s = asyncio.get_running_loop().time() - elected_at
        finally:
            await _stop(silent, standby)
        assert moved.value.leader == standby_at
        assert isinstance(moved.value, targets_lib.NotLeader)  # the supervisor goes there without backoff
        assert moved_s < 0.2 + 0.4 + 0.5, moved_s  # within a tick (and a check) of the election

    asyncio.run(scenario())


def test_a_slow_leader_keeps_its_session_while_no_other_syncer_leads():
    """Checks of the leader time out (it answers after 0.6 s, the deadline is 0.3 s): the other
    syncers are asked, but none leads, so the watch ends nothing."""
    async def scenario():
        slow, slow_at, _ = await _syncer(SERVING, delay_s=0.6)
        standby, standby_at, _ = await _syncer(NOT_SERVING)
        try:
            async with _watching([slow_at, standby_at], slow_at, interval_s=0.1, timeout_s=0.3) as (watch, task):
                await asyncio.sleep(2.0)
                assert not task.done(), task
                assert watch.checks_of_others >= 2
        finally:
            await _stop(slow, standby)

    asyncio.run(scenario())


def test_a_healthy_leader_keeps_the_other_syncers_out_of_it():
    async def scenario():
        leader, leader_at, leader_health = await _syncer(SERVING)
        standby, standby_at, standby_health = await _syncer(NOT_SERVING)
        # (a generous deadline: the checks must succeed even on a loaded test machine)
        try:
            async with _watching([standby_at, leader_at], leader_at, interval_s=0.1, timeout_s=5.0) as (watch, task):
                for _ in range(200):  # until the leader was checked 3 times (at most 20 s)
                    if leader_health.checks >= 3:
                        break
                    await asyncio.sleep(0.1)
                assert not task.done()
        finally:
            await _stop(leader, standby)
        assert leader_health.checks >= 3
        assert watch.checks_of_others == 0 and standby_health.checks == 0

    asyncio.run(scenario())


def test_one_address_has_nobody_else_to_follow():
    async def scenario():
        watch = watch_lib.LeaderWatch(["syncers.example:50051"])
        channel = channel_lib.aio_channel("syncers.example:50051")
        try:
            await asyncio.wait_for(watch.watch(channel, "syncers.example:50051"), 1)  # returns at once
            # ... also once a standby behind that name named the leader's own address
            await asyncio.wait_for(watch.watch(channel, "10.1.2.3:50051"), 1)
        finally:
            await channel.close()

    asyncio.run(scenario())
