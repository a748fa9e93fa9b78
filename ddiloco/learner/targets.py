"""Which syncer a learner talks to: the addresses of --syncer, and the leader a standby names.

With leader election (docs/failover.md) a run has several syncers; one leads. A standby refuses a
learner with UNAVAILABLE, reason `not_leader` and the leader's address in trailing metadata; the
client's next session goes there at once. Without a named leader (a dead syncer, a standby that
knows none yet) the next session tries the next address of the list, with the client's usual
backoff. One address (one syncer, or a DNS name with several records, whose standbys name the
leader) keeps today's behaviour: every session goes to it.

With several addresses and no leader named, the client first asks every syncer of the list at once
for its health (leader_watch.first_serving) and the session goes to the one that answers SERVING,
the leader, rather than to the next address in turn: a syncer frozen at the head of the list (TCP
accepts, nothing answers) would otherwise hold a fresh learner for the Join's whole deadline.
"""

from __future__ import annotations

import grpc

from ddiloco.rpc import errors as errors_lib

# Redirects in a row without a session that worked: two syncers naming each other (a stale
# observation while the election moves on) then back off like any failure instead of ping-ponging.
MAX_REDIRECTS = 3


class NotLeader(Exception):
    """The syncer reached is not the leader (a standby, or a deposed leader): try `leader`, if
    known, or the next address."""

    def __init__(self, message: str, leader: str = "") -> None:
        super().__init__(message)
        self.leader = leader


def parse_targets(text: str) -> list[str]:
    """--syncer: one host:port or a comma-separated list; ValueError when empty."""
    targets = [t.strip() for t in text.split(",") if t.strip()]
    if not targets:
        raise ValueError("no syncer address given")
    return targets


class SyncerTargets:
    """See the module docstring. Used from the client's event loop only."""

    def __init__(self, text: str) -> None:
        self.targets = parse_targets(text)
        self.current = ""
        self._index = 0
        self._hint = ""
        self._redirects = 0

    @property
    def probing(self) -> bool:
        """Whether the next session should ask the list who leads first: several addresses and no
        leader named by a refusal (a named leader is tried at once, without asking)."""
        return len(self.targets) > 1 and not self._hint

    def next(self, serving: str = "") -> str:
        """The address of the next session: a named leader, else `serving` (an address of the list
        that answered SERVING just now), else the head of the list or, after a failure, the next
        address."""
        if self._hint:
            target, self._hint = self._hint, ""
            if target in self.targets:  # a later rotation goes on from the leader's place
                self._index = self.targets.index(target)
        elif serving in self.targets:
            target = serving
            self._index = self.targets.index(target)
        elif self.current and len(self.targets) > 1:
            self._index = (self._index + 1) % len(self.targets)
            target = self.targets[self._index]
        else:  # one address: always it again (after a named leader failed too: a load balancer or
            # a DNS name may lead elsewhere on a new connection)
            target = self.targets[self._index]
        self.current = target
        return target

    def joined(self) -> None:
        self._redirects = 0

    def redirected(self, cause: BaseException) -> str:
        """The leader named by a refusal, when the next session should go there without backoff ("")."""
        leader = ""
        if isinstance(cause, NotLeader):
            leader = cause.leader
        elif isinstance(cause, grpc.aio.AioRpcError) and errors_lib.reason_of(cause) == errors_lib.REASON_NOT_LEADER:
            leader = errors_lib.metadata_value(cause, errors_lib.LEADER_KEY)
        if not leader or leader == self.current or self._redirects >= MAX_REDIRECTS:
            return ""
        self._redirects += 1
        self._hint = leader
        return leader

    def not_leader(self, exc: grpc.aio.AioRpcError) -> NotLeader | None:
        """A standby's refusal as NotLeader (None for any other failure)."""
        if errors_lib.reason_of(exc) != errors_lib.REASON_NOT_LEADER:
            return None
        return NotLeader(exc.details() or "not the leader", errors_lib.metadata_value(exc, errors_lib.LEADER_KEY))
