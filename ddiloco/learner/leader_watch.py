"""Noticing, within about a second, that another syncer of the list took over from a silent leader.

A leader whose host vanished sends no TCP reset: the learner's calls to it just hang until their
deadlines (about 10 s for a unary call, retried; 600 s for the watch stream), and HTTP/2 keepalive
finds the dead connection after 30 + 10 s at the earliest (about 60 s measured against a frozen
syncer, docs/failover.md). Meanwhile a standby is elected within the lease (3 s).

`LeaderWatch` runs beside a session (client.py) when --syncer lists several syncers. Every
`interval_s` it asks the session's syncer, over the session's own channel, for the health of
the Syncer service (grpc.health.v1; a leader answers SERVING, a standby NOT_SERVING) with a
short deadline (`timeout_s`). Only while that check fails (no answer in time, an error, or
NOT_SERVING) does it ask the other syncers of the list the same question, once per `interval_s`,
and only when one of them answers SERVING does it end the session (`LeaderMoved`, naming that
syncer), which cancels the calls still hanging at the silent one. A failed check alone never ends
anything: a healthy leader that is slow to answer (a loaded host, a saturated WAN link whose
buffers hold megabytes of upload ahead of the check) keeps its session and its calls, because
while it leads no other syncer can (election.py: it stops before etcd could elect another).

`first_serving` asks the same question of every syncer of the list at once before a session
starts (client.py), so that a learner (re)starting while the head of its list is frozen goes to
the leader within one round trip instead of waiting for its Join's deadline at the frozen one.

The health service is not behind the syncer's authorization (rpc/security.py), so this works with
any learner credential; the channels to the other syncers carry the session's security settings.
Every check has a deadline; nothing is retried except by the next tick.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddiloco.learner import targets as targets_lib
from ddiloco.learner import uploads as uploads_lib
from ddiloco.rpc import channel as channel_lib
from ddiloco.rpc import security as security_lib
from ddiloco.v1 import syncer_pb2

_LOG = logging.getLogger("ddiloco.learner")

SYNCER_SERVICE = syncer_pb2.DESCRIPTOR.services_by_name["Syncer"].full_name


class LeaderMoved(targets_lib.NotLeader, uploads_lib.SessionBroken):
    """The session's syncer stopped answering and another syncer of the list leads (`leader`)."""


async def serving(channel: grpc.aio.Channel, timeout_s: float) -> bool:
    """True when the syncer behind `channel` answers, within timeout_s, that its Syncer service is
    SERVING (it leads, or runs without election); False on any other answer or failure."""
    try:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SYNCER_SERVICE), timeout=timeout_s)
    except grpc.RpcError:
        return False
    return response.status == health_pb2.HealthCheckResponse.SERVING


class LeaderWatch:
    """See the module docstring. One per client; `watch` runs once per session, `close` at the end."""

    def __init__(self, targets: Sequence[str], *, interval_s: float = 1.0, timeout_s: float = 2.0,
                 security: security_lib.ClientSecurity | None = None) -> None:
        self.targets = list(targets)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._security = security
        self._channels: dict[str, grpc.aio.Channel] = {}  # the other syncers', kept across ticks and sessions
        self.checks_of_others = 0  # rounds of questions to the other syncers (tests, logs)

    def _channel(self, target: str) -> grpc.aio.Channel:
        if target not in self._channels:
            self._channels[target] = channel_lib.aio_channel(target, self._security)
        return self._channels[target]

    async def leader_among(self, others: Sequence[str]) -> str:
        """The first of `others` (in list order) whose Syncer service is SERVING, asked all at once; ""."""
        self.checks_of_others += 1
        answers = await asyncio.gather(*(serving(self._channel(t), self.timeout_s) for t in others))
        return next((t for t, ok in zip(others, answers) if ok), "")

    async def first_serving(self, candidates: Sequence[str]) -> str:
        """The first of `candidates` to answer SERVING, asked all at once (each check within
        timeout_s); "" when none does. It returns at the first SERVING answer: a frozen syncer
        costs nothing while another one leads, and at most timeout_s when none does."""
        checks = {asyncio.ensure_future(serving(self._channel(t), self.timeout_s)): t for t in candidates}
        pending = set(checks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                leader = next((t for c, t in checks.items() if c in done and c.result()), "")  # list order
                if leader:
                    return leader
            return ""
        finally:
            for check in pending:
                check.cancel()

    async def watch(self, channel: grpc.aio.Channel, current: str) -> None:
        """Checks `current` (over the session's `channel`) until another syncer leads while it is
        silent: then raises LeaderMoved. Returns at once when --syncer is one address: a DNS name or
        a load balancer may well lead back to the same syncer, and a move would only cancel calls."""
        others = [t for t in self.targets if t != current] if len(self.targets) > 1 else []
        if not others:
            return
        suspect = False  # the last check of `current` failed
        loop = asyncio.get_running_loop()
        while True:
            probe = asyncio.ensure_future(serving(channel, self.timeout_s))
            started = loop.time()
            try:
                while not probe.done():
                    await asyncio.wait({probe}, timeout=self.interval_s)
                    if suspect and not probe.done():  # still silent: ask the others meanwhile, every tick
                        await self._follow(others, current, loop.time() - started)
            finally:
                probe.cancel()
            suspect = not probe.result()
            if suspect:  # ask at once, then check `current` again without pause
                await self._follow(others, current, loop.time() - started)
            else:
                await asyncio.sleep(self.interval_s)

    async def _follow(self, others: Sequence[str], current: str, silent_s: float) -> None:
        leader = await self.leader_among(others)
        if leader:
            _LOG.warning(f"the syncer at {current} did not answer a health check within {self.timeout_s:.1f} s "
                         f"and {leader} leads: moving there (calls in flight to {current} are cancelled)")
            raise LeaderMoved(f"{current} silent for {silent_s:.1f} s; {leader} leads", leader)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
