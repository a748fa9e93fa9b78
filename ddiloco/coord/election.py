"""Leader election on etcd: one leader per key, held through a lease, with an epoch that fences.

A candidate holds a lease of `lease_ttl_s` and tries, every `poll_interval_s`, to create the
leader key attached to it (a transaction: create only if the key does not exist). The one that
creates it leads; the key's create revision is its **epoch**, unique and increasing across leaders,
so everything it writes can be fenced on "the leader key still has create revision == epoch"
(ddiloco.coord.commit). When the leader dies its lease expires and etcd deletes the key; a
standby then creates it with a newer epoch.

A leader stops acting on its own before etcd could give the key to anyone else: it keeps the
lease alive every third of its TTL, and counts its leadership valid only until the moment its last
successful keep-alive was *sent* plus the TTL, less a safety margin (`fence_margin_s`). etcd's
expiry is measured from when it received that keep-alive, so the local deadline comes first (clock
rates, not clocks, must agree). `hold()` returns when the deadline passes without a refresh.

What a candidate writes in the key is its `address` (learners are pointed at the leader with it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable

from ddiloco.coord import etcd as etcd_lib

_LOG = logging.getLogger("ddiloco.coord")

KEEPALIVES_PER_TTL = 6  # keep-alives per lease TTL: several may be lost or late before the lease is at risk
FENCE_MARGIN_FRACTION = 0.2  # of the TTL: leadership ends locally this long before etcd's expiry


@dataclasses.dataclass(frozen=True)
class Leader:
    """Who leads: the address it serves on, its instance id, and its epoch (the key's create revision)."""

    address: str
    epoch: int
    instance: str = ""


def leader_key(prefix: str, name: str) -> bytes:
    """The election key of `name` (a run, or a run's shard) under the deployment's prefix."""
    return f"{prefix.rstrip('/')}/leader/{name}".encode()


def decode_leader(kv: etcd_lib.KeyValue) -> Leader:
    try:
        fields = json.loads(kv.value)
        return Leader(address=str(fields["address"]), epoch=kv.create_revision, instance=str(fields.get("instance", "")))
    except (ValueError, KeyError, TypeError):  # a key another tool wrote: its leader has no address
        return Leader(address="", epoch=kv.create_revision)


class Election:
    """Campaign for, hold and resign one leader key. See the module docstring."""

    def __init__(self, etcd: etcd_lib.Etcd, key: bytes, *, address: str, instance: str = "",
                 lease_ttl_s: int = 3, poll_interval_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if lease_ttl_s < 1:
            raise ValueError(f"lease_ttl_s must be >= 1, got {lease_ttl_s}")
        self._etcd = etcd
        self.key = key
        self._value = json.dumps({"address": address, "instance": instance}, sort_keys=True).encode()
        self.lease_ttl_s = int(lease_ttl_s)
        self.poll_interval_s = poll_interval_s if poll_interval_s is not None else min(0.5, lease_ttl_s / 6)
        self._clock = clock
        self.lease_id = 0
        self._ttl_s = self.lease_ttl_s  # as granted
        self._lease_valid_until_s = -1.0  # clock(): send time of the last refresh + TTL
        self._next_refresh_s = 0.0
        self.epoch = 0  # while leading
        self.leader: Leader | None = None  # the last leader observed (self when leading)

    @property
    def fence_margin_s(self) -> float:
        return max(0.2, FENCE_MARGIN_FRACTION * self._ttl_s)

    def valid_until_s(self) -> float:
        """clock() time until which this candidate may act as leader (-1 when it does not lead)."""
        return self._lease_valid_until_s - self.fence_margin_s if self.epoch else -1.0

    def is_leader(self) -> bool:
        return bool(self.epoch) and self._clock() < self.valid_until_s()

    async def observe(self) -> Leader | None:
        """The current leader as etcd sees it (None: no leader); raises EtcdUnavailable."""
        kv = await self._etcd.get(self.key)
        return None if kv is None else decode_leader(kv)

    async def _refresh_lease(self) -> None:
        """Keeps this candidate's lease alive, or grants a new one when it is missing or expired."""
        now = self._clock()
        if self.lease_id and now < self._lease_valid_until_s:
            if now < self._next_refresh_s:
                return
            ttl_s = await self._etcd.keepalive(self.lease_id, timeout_s=self._lease_valid_until_s - now)
            if ttl_s > 0:
                self._renewed(now, ttl_s)
                return
            _LOG.info(f"lease {self.lease_id:x} expired; granting a new one")
        self.lease_id, ttl_s = await self._etcd.grant(self.lease_ttl_s)
        self._renewed(now, ttl_s)

    def _renewed(self, sent_at_s: float, ttl_s: int) -> None:
        self._ttl_s = ttl_s
        self._lease_valid_until_s = sent_at_s + ttl_s
        self._next_refresh_s = sent_at_s + ttl_s / KEEPALIVES_PER_TTL

    async def try_acquire(self) -> bool:
        """One attempt: True when this candidate leads (then `epoch` is set); raises EtcdUnavailable."""
        await self._refresh_lease()
        result = await self._etcd.txn([etcd_lib.create_equals(self.key, 0)],
                                      put=(self.key, self._value, self.lease_id), read_key=self.key)
        if result.succeeded:
            epoch = result.revision
        elif result.read is not None and result.read.lease == self.lease_id:
            epoch = result.read.create_revision  # an earlier attempt whose answer was lost created it
        else:
            self.leader = decode_leader(result.read) if result.read is not None else None
            return False
        self.epoch = epoch
        self.leader = Leader(address=json.loads(self._value)["address"], epoch=epoch,
                             instance=json.loads(self._value)["instance"])
        _LOG.info("elected leader", extra={"fields": {"key": self.key.decode(), "epoch": epoch,
                                                       "lease": f"{self.lease_id:x}", "ttl_s": self._ttl_s}})
        return True

    async def campaign(self, on_observed: Callable[[Leader | None], None] | None = None) -> int:
        """Tries until this candidate leads; returns its epoch. Every attempt is bounded; etcd being
        unreachable is logged and tried again (a standby waits for as long as it runs). A TLS
        refusal (EtcdTLSError) is raised: the same certificates would be refused forever."""
        unreachable_since = None
        while True:
            try:
                if await self.try_acquire():
                    return self.epoch
                unreachable_since = None
            except etcd_lib.EtcdTLSError:
                raise
            except etcd_lib.EtcdUnavailable as exc:
                if unreachable_since is None:
                    unreachable_since = self._clock()
                    _LOG.warning(f"campaign: {exc}")
            except etcd_lib.EtcdError as exc:  # e.g. a lease etcd no longer knows: start with a new one
                _LOG.warning(f"campaign: {exc}; granting a new lease")
                self.lease_id = 0
            if on_observed is not None:
                on_observed(self.leader)
            await asyncio.sleep(self.poll_interval_s)

    async def hold(self, etcd: etcd_lib.Etcd | None = None) -> str:
        """While leading: keeps the lease alive; returns why leadership ended (lease expired, or
        not refreshed before the local deadline, or step_down). `etcd`: another client of the
        same cluster, when this runs on another event loop than the campaign (LeaseKeeper)."""
        etcd = etcd or self._etcd
        while True:
            now = self._clock()
            deadline_s = self.valid_until_s()
            if not self.epoch:
                return "stepped down"
            if now >= deadline_s:
                return f"lease not refreshed for {self._ttl_s - self.fence_margin_s:.1f} s (etcd unreachable)"
            await asyncio.sleep(max(0.0, min(self._next_refresh_s, deadline_s) - now))
            if self._clock() >= self.valid_until_s():
                continue
            sent_at = self._clock()
            try:
                ttl_s = await etcd.keepalive(self.lease_id, timeout_s=self.valid_until_s() - sent_at)
            except etcd_lib.EtcdError as exc:  # unreachable, or refused: try again until the deadline
                _LOG.warning(f"leader lease keep-alive: {exc}")
                self._next_refresh_s = self._clock() + min(0.2, self._ttl_s / 10)
                continue
            if ttl_s <= 0:
                self.epoch = 0
                return "lease expired in etcd"
            self._renewed(sent_at, ttl_s)

    def step_down(self) -> None:
        """Stops counting as leader here (no etcd call): whatever happens next, this one is fenced."""
        self.epoch = 0

    async def resign(self) -> None:
        """Gives leadership up now (a clean shutdown): revokes the lease, so the key goes at once
        and a standby takes over without waiting for the TTL."""
        self.epoch = 0
        if self.lease_id:
            try:
                await self._etcd.revoke(self.lease_id)
            except etcd_lib.EtcdUnavailable as exc:
                _LOG.warning(f"resign: {exc}; the lease expires on its own")
            self.lease_id = 0


class LeaseKeeper:
    """Runs a leader's `Election.hold()` on a thread of its own, with its own event loop and etcd
    client: a busy or stalled event loop of the service (a long merge, a loaded machine) then
    cannot delay the keep-alives and cost the leadership. `on_lost(reason)` is called from that
    thread once leadership is gone; the service's own checks (`is_leader`) need no thread: they
    compare the clock with the deadline the keeper moves forward."""

    def __init__(self, election: Election, etcd: etcd_lib.Etcd, *, on_lost: Callable[[str], None]) -> None:
        self._election = election
        self._etcd = etcd  # the campaign's client: the keeper's own is a sibling (same endpoints and TLS)
        self._on_lost = on_lost
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        async def hold() -> str:
            etcd = self._etcd.sibling()
            try:
                return await self._election.hold(etcd)
            finally:
                await etcd.close()

        try:
            reason = asyncio.run(hold())
        except Exception as exc:  # noqa: BLE001 - whatever broke the keeper, the lease is no longer kept
            reason = f"lease keeper failed: {exc!r}"
        self._election.step_down()
        try:
            self._on_lost(reason)
        except RuntimeError as exc:  # the service's event loop is already closed: it is stopping anyway
            _LOG.info(f"leadership ended ({reason}) while stopping: {exc}")

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
