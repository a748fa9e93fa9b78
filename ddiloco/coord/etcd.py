"""A bounded client of etcd's v3 API (through aetcd): the only module that talks to etcd.

Owns the endpoint list, a deadline on every call and a bound on every retry: a call tries each
endpoint at most once, starting with the one that answered last, each attempt under
`call_timeout_s`; when none answers it raises `EtcdUnavailable`. Callers (election, commit pointer)
decide what a failure means; nothing here retries forever.

Only what leader election and fenced commits need: leases (grant, keep alive, revoke), reading one
key, and transactions whose comparisons are on a key's create or mod revision.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING

from ddiloco import extras

if TYPE_CHECKING:  # annotations only; imported for real by _aetcd()
    import aetcd

_LOG = logging.getLogger("ddiloco.coord")


class EtcdError(Exception):
    """etcd refused a call (e.g. a lease it no longer knows)."""


class EtcdUnavailable(EtcdError):
    """No endpoint answered within its deadline (the outcome of a write is then unknown)."""


@dataclasses.dataclass(frozen=True)
class KeyValue:
    """One key as etcd holds it: its value, the revisions of its creation and last change, its lease."""

    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclasses.dataclass(frozen=True)
class TxnResult:
    """A transaction's outcome: whether the comparisons held, the revision it ran at, and the key
    read by its `read_key` (None when absent)."""

    succeeded: bool
    revision: int
    read: KeyValue | None


def _aetcd():
    """(aetcd, aetcd.exceptions), imported on first use: etcd is optional (the `etcd` extra), and a
    syncer without --coord-etcd never needs it."""
    aetcd = extras.require("aetcd", "etcd")
    return aetcd, extras.require("aetcd.exceptions", "etcd")


def parse_endpoints(text: str) -> list[str]:
    """`host:port[,host:port...]` -> the list; ValueError with the offending entry."""
    endpoints = [e.strip() for e in text.split(",") if e.strip()]
    if not endpoints:
        raise ValueError("no etcd endpoint given (host:port[,host:port...])")
    for e in endpoints:
        host, sep, port = e.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd endpoint {e!r} is not host:port")
    return endpoints


class Etcd:
    """See the module docstring. One aetcd client per endpoint, connected on first use."""

    def __init__(self, endpoints: list[str], *, call_timeout_s: float = 2.0) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        if call_timeout_s <= 0:
            raise ValueError(f"call_timeout_s must be > 0, got {call_timeout_s}")
        self._aetcd, self._errors = _aetcd()  # here, so a syncer without the extra fails at start
        self.endpoints = list(endpoints)
        self.call_timeout_s = call_timeout_s
        self._clients: dict[str, aetcd.Client] = {}
        self._preferred = 0  # index of the endpoint that answered last

    def _client(self, endpoint: str) -> aetcd.Client:
        client = self._clients.get(endpoint)
        if client is None:
            host, _, port = endpoint.rpartition(":")
            client = self._aetcd.Client(host=host.strip("[]"), port=int(port), timeout=self.call_timeout_s,
                                  connect_wait_timeout=max(1, int(self.call_timeout_s)))
            self._clients[endpoint] = client
        return client

    async def _call(self, what: str, fn, timeout_s: float | None = None):
        """fn(client) on each endpoint at most once; the first answer wins."""
        bound_s = self.call_timeout_s if timeout_s is None else max(0.05, min(timeout_s, self.call_timeout_s))
        n = len(self.endpoints)
        failures = []
        for i in range(n):
            index = (self._preferred + i) % n
            endpoint = self.endpoints[index]
            try:
                result = await asyncio.wait_for(fn(self._client(endpoint)), bound_s)
            except (asyncio.TimeoutError, self._errors.ConnectionFailedError,
                    self._errors.ConnectionTimeoutError, self._errors.InternalError) as exc:
                failures.append(f"{endpoint}: {type(exc).__name__}")
                continue
            except self._errors.ClientError as exc:  # etcd's answer: another endpoint would say the same
                raise EtcdError(f"etcd {what}: {exc}") from exc
            self._preferred = index
            return result
        raise EtcdUnavailable(f"etcd {what}: no endpoint answered within {bound_s:.1f} s ({'; '.join(failures)})")

    async def grant(self, ttl_s: int, timeout_s: float | None = None) -> tuple[int, int]:
        """A new lease: (its id, the TTL etcd granted in seconds; etcd may raise a too-small TTL)."""
        lease = await self._call("lease grant", lambda c: c.lease(int(ttl_s)), timeout_s)
        return int(lease.id), int(lease.ttl)

    async def keepalive(self, lease_id: int, timeout_s: float | None = None) -> int:
        """Refreshes the lease; its TTL from now in seconds (0 or less: it has expired)."""
        reply = await self._call("lease keep-alive", lambda c: c.refresh_lease(lease_id), timeout_s)
        return int(reply.TTL) if reply is not None else 0

    async def revoke(self, lease_id: int, timeout_s: float | None = None) -> None:
        """Ends the lease now: the keys attached to it are deleted (a resigning leader)."""
        try:
            await self._call("lease revoke", lambda c: c.revoke_lease(lease_id), timeout_s)
        except EtcdError as exc:  # already expired: nothing left to end
            if isinstance(exc, EtcdUnavailable):
                raise
            _LOG.info(f"lease {lease_id:x} revoke: {exc}")

    async def get(self, key: bytes, timeout_s: float | None = None) -> KeyValue | None:
        """The key (a linearizable read), None when absent."""
        got = await self._call("get", lambda c: c.get(key), timeout_s)
        return None if got is None else _kv(got)

    async def txn(self, compare: list, *, put: tuple[bytes, bytes, int] | None = None,
                  read_key: bytes | None = None, timeout_s: float | None = None) -> TxnResult:
        """If every comparison holds, puts (key, value, lease id or 0) when given; otherwise reads
        read_key when given. Comparisons are built with `create_equals` / `mod_equals`."""
        async def run(client: aetcd.Client):
            ops = client.transactions
            success = [ops.put(put[0], put[1], lease=put[2] or None)] if put is not None else []
            failure = [ops.get(read_key)] if read_key is not None else []
            return await client.transaction(compare=[c(ops) for c in compare], success=success, failure=failure)

        succeeded, responses = await self._call("txn", run, timeout_s)
        revision = 0
        read = None
        for response in responses:
            if isinstance(response, list):  # a range's [(value, Get)]
                if response:
                    read = _kv(response[0][1])
                    revision = read_revision(response[0][1])
            elif response.WhichOneof("response") == "response_put":
                revision = int(response.response_put.header.revision)
        return TxnResult(bool(succeeded), revision, read)

    async def close(self) -> None:
        for client in self._clients.values():
            try:
                await asyncio.wait_for(client.close(), self.call_timeout_s)
            except Exception as exc:  # noqa: BLE001 - closing: report and carry on
                _LOG.info(f"etcd client close: {exc!r}")
        self._clients.clear()


def create_equals(key: bytes, revision: int):
    """The comparison `key's create revision == revision` (0: the key does not exist)."""
    return lambda ops: ops.create(key) == revision


def mod_equals(key: bytes, revision: int):
    """The comparison `key's mod revision == revision` (0: the key does not exist)."""
    return lambda ops: ops.mod(key) == revision


def read_revision(got) -> int:
    return int(got.header.revision)


def _kv(got) -> KeyValue:
    return KeyValue(value=bytes(got.value), create_revision=int(got.create_revision),
                    mod_revision=int(got.mod_revision), lease=int(got.lease))
