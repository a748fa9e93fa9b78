"""The evaluator's channel to the leading syncer of a run with leader election (docs/failover.md).

The evaluator takes the learners' --syncer list and picks the syncer to call the way the learners
do (ddiloco.learner.targets.SyncerTargets): a standby's refusal (UNAVAILABLE, reason `not_leader`,
the leader's address) points the next call at the leader at once; any other failure moves to the
next address after a pause. A standby still answers GetTrainingState (epoch 0 and the leader's
address); the evaluator takes that answer as a refusal too, so it never reads the run from a
standby, and a syncer whose epoch is older than one already seen (a deposed leader) likewise.
Every call is bounded: each attempt by the call timeout, all attempts by the caller's deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from ddiloco.learner import targets as targets_lib
from ddiloco.rpc import channel as channel_lib
from ddiloco.rpc import security as security_lib
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc

_LOG = logging.getLogger("ddiloco.evaluator")


class LeaderLink:
    """One channel at a time, to the syncer SyncerTargets picks. Used from one event loop; the
    watch stream and the evaluation loop share it (`generation` keeps one failure seen by both
    from moving it twice)."""

    def __init__(self, targets: str, security: security_lib.ClientSecurity, *, call_timeout_s: float,
                 retry_pause_s: float = 0.5) -> None:
        self._targets = targets_lib.SyncerTargets(targets)
        self._security = security
        self.call_timeout_s = call_timeout_s
        self.retry_pause_s = retry_pause_s
        self._channel: grpc.aio.Channel | None = None
        self.stub: syncer_pb2_grpc.SyncerStub | None = None
        self.generation = 0  # bumped by every move to another syncer
        self.epoch = 0  # the newest leader epoch seen: older ones are deposed leaders

    @property
    def current(self) -> str:
        return self._targets.current

    async def ensure(self) -> int:
        """Opens the first channel if none is open; the generation the caller's calls belong to."""
        if self.stub is None:
            await self._move()
        return self.generation

    async def _move(self) -> None:
        previous = self._targets.current
        target = self._targets.next()
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

    async def call(self, method: str, request, *, deadline_s: float):
        """One unary call on the leader (`method` of the Syncer stub), retried on another syncer
        until `deadline_s` (time.monotonic()); TimeoutError once it has passed."""
        while True:
            generation = await self.ensure()
            remaining_s = deadline_s - time.monotonic()
            try:
                response = await getattr(self.stub, method)(request, timeout=max(0.05, min(self.call_timeout_s, remaining_s)))
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
        if self._channel is not None:
            await self._channel.close()
