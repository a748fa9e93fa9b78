"""The evaluator's channel to the leading syncer of a run with leader election (docs/failover.md).

The evaluator takes the learners' --syncer list and picks the syncer to call the way the learners
do (ddiloco.learner.targets.SyncerTargets): a standby's refusal (UNAVAILABLE, reason `not_leader`,
the leader's address) points the next call at the leader at once; any other failure moves to the
next address after a pause. A standby still answers GetTrainingState (epoch 0 and the leader's
address); the evaluator takes that answer as a refusal too, so it never reads the run from a
standby, and a syncer whose epoch is older than one already seen (a deposed leader) likewise.
Every call is bounded: each attempt by the call timeout, all attempts by the caller's deadline.

A syncer that went silent (SIGSTOP, a vanished host: TCP accepts, nothing answers) is left the
way the learners leave it (ddiloco.learner.leader_watch): with several addresses and no leader
named, a move first asks every syncer of the list for its health at once and goes to the one
that answers SERVING, so a frozen head of the list costs one health round trip, not a call's
deadline; and every call and watch stream runs beside a LeaderWatch that cancels it once the
current syncer stops answering health checks while another syncer of the list leads (about
interval + timeout of the check, 1 + 2 s, instead of the call's 10 s or the watch stream's 600 s).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable

import grpc

from ddiloco.learner import leader_watch as leader_watch_lib
from ddiloco.learner import targets as targets_lib
from ddiloco.rpc import channel as channel_lib
from ddiloco.rpc import security as security_lib
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc

_LOG = logging.getLogger("ddiloco.evaluator")


class LeaderLink:
    """One channel at a time, to the syncer SyncerTargets picks. Used from one event loop; the
    watch stream and the evaluation loop share it (`generation` keeps one failure seen by both
    from moving it twice; `_moving` makes callers wait for a move under way)."""

    def __init__(self, targets: str, security: security_lib.ClientSecurity, *, call_timeout_s: float,
                 retry_pause_s: float = 0.5, leader_check_interval_s: float = 1.0,
                 leader_check_timeout_s: float = 2.0) -> None:
        self._targets = targets_lib.SyncerTargets(targets)
        self._security = security
        # The learners' defaults (ddiloco.learner.client.ClientConfig): a silent syncer is left
        # about interval + timeout after a standby leads; a slow one that still leads never is.
        self._watch = leader_watch_lib.LeaderWatch(self._targets.targets, interval_s=leader_check_interval_s,
                                                   timeout_s=leader_check_timeout_s, security=security)
        self.call_timeout_s = call_timeout_s
        self.retry_pause_s = retry_pause_s
        self._channel: grpc.aio.Channel | None = None
        self.stub: syncer_pb2_grpc.SyncerStub | None = None
        self.generation = 0  # bumped by every move to another syncer
        # A move asks the list who leads first (an await): callers wait for it instead of moving twice.
        self._moving = asyncio.Lock()
        self.epoch = 0  # the newest leader epoch seen: older ones are deposed leaders

    @property
    def current(self) -> str:
        return self._targets.current

    async def ensure(self) -> int:
        """Opens the first channel if none is open; the generation the caller's calls belong to."""
        async with self._moving:
            if self.stub is None:
                await self._move()
            return self.generation

    async def _move(self) -> None:
        previous = self._targets.current
        serving = await self._watch.first_serving(self._targets.targets) if self._targets.probing else ""
        target = self._targets.next(serving)
        self.generation += 1
        if target == previous and self._channel is not None:
            return  # one address: the same channel reconnects by itself
        if self._channel is not None:
            await self._channel.close()
        self._channel = channel_lib.aio_channel(target, self._security)
        self.stub = syncer_pb2_grpc.SyncerStub(self._channel)

    async def failed(self, exc: BaseException, generation: int) -> bool:
        """A call of `generation` failed: moves to the leader a refusal names, else to the next address.
        True when the caller may retry at once (redirected, or another caller moved already)."""
        async with self._moving:
            if generation != self.generation:
                return True
            leader = self._targets.redirected(exc)
            if leader:
                _LOG.info(f"{self._targets.current} is not the leader; going to {leader}")
            await self._move()
            return bool(leader)

    def joined(self) -> None:
        """A call on the current syncer worked: it leads (redirect counting starts again)."""
        self._targets.joined()

    def check_state(self, state: syncer_pb2.TrainingState) -> None:
        """Raises NotLeader for a standby's (or a deposed leader's) training state."""
        if state.epoch == 0 and state.leader_address:
            raise targets_lib.NotLeader(f"{self.current} is a standby", state.leader_address)
        if state.epoch < self.epoch:
            raise targets_lib.NotLeader(f"{self.current} leads with epoch {state.epoch}, older than {self.epoch}")
        self.epoch = state.epoch

    def check_epoch(self, epoch: int) -> bool:
        """Whether a fragment of leader `epoch` may be kept (False: a deposed leader's version)."""
        if epoch < self.epoch:
            return False
        self.epoch = epoch
        return True

    async def guarded(self, call: Awaitable):
        """Awaits `call` (on the current syncer) while the leader watch checks that syncer: raises
        LeaderMoved, `call` cancelled, once it is silent and another syncer of the list leads."""
        task = asyncio.ensure_future(call)
        watch = asyncio.ensure_future(self._watch.watch(self._channel, self.current))
        try:
            done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if task not in done:
                watch.result()  # LeaderMoved; None when the list is one address (nothing to watch)
            return await task
        finally:
            task.cancel()
            watch.cancel()

    async def call(self, method: str, request, *, deadline_s: float):
        """One unary call on the leader (`method` of the Syncer stub), retried on another syncer
        until `deadline_s` (time.monotonic()); TimeoutError once it has passed."""
        while True:
            generation = await self.ensure()
            remaining_s = deadline_s - time.monotonic()
            try:
                timeout_s = max(0.05, min(self.call_timeout_s, remaining_s))
                response = await self.guarded(getattr(self.stub, method)(request, timeout=timeout_s))
                if method == "GetTrainingState":
                    self.check_state(response.state)
                self.joined()
                return response
            except (grpc.aio.AioRpcError, targets_lib.NotLeader) as exc:
                detail = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                retry_now = await self.failed(exc, generation)
                remaining_s = deadline_s - time.monotonic()
                if remaining_s <= 0:
                    raise TimeoutError(f"no leading syncer among {','.join(self._targets.targets)} answered "
                                       f"{method} in time (last: {detail})") from None
                if not retry_now:
                    await asyncio.sleep(min(self.retry_pause_s, remaining_s))

    async def close(self) -> None:
        await self._watch.close()
        if self._channel is not None:
            await self._channel.close()
