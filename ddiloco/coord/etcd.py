"""A bounded client of etcd's v3 API (through aetcd): the only module that talks to etcd.

Owns the endpoint list, a deadline on every call and a bound on every retry: a call tries each
endpoint at most once, starting with the one that answered last, each attempt under
`call_timeout_s`; when none answers it raises `EtcdUnavailable`. Callers (election, commit pointer)
decide what a failure means; nothing here retries forever.

Only what leader election and fenced commits need: leases (grant, keep alive, revoke), reading one
key, and transactions whose comparisons are on a key's create or mod revision.

Transport: plaintext, or TLS when given gRPC channel credentials (the caller builds them from its
certificate files, e.g. ddiloco.rpc.security.ClientSecurity; with a client certificate this is what
an etcd started with `--client-cert-auth` requires). A handshake etcd refuses, or a server
certificate this client cannot verify, is `EtcdTLSError`: a configuration error, on which a
campaign gives up instead of waiting for etcd to come back (ddiloco.coord.election).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from typing import TYPE_CHECKING, Any

from ddiloco import extras

if TYPE_CHECKING:  # annotations only; imported for real by _aetcd()
    import aetcd

_LOG = logging.getLogger("ddiloco.coord")


class EtcdError(Exception):
    """etcd refused a call (e.g. a lease it no longer knows)."""


class EtcdUnavailable(EtcdError):
    """No endpoint answered within its deadline (the outcome of a write is then unknown)."""


class EtcdTLSError(EtcdUnavailable):
    """No endpoint answered, and at least one refused this client's TLS (no or an untrusted client
    certificate) or presented a certificate this client does not trust: another attempt with the
    same certificates fails the same way. An EtcdUnavailable, so a caller that only waits etcd out
    (a leader's keep-alives until its deadline, a resign) treats it as one; a campaign does not."""


# How grpc-core words a failed TLS handshake, or the alert a server sends after it (etcd with
# --client-cert-auth refusing a missing or foreign client certificate: TSI_DATA_CORRUPTED).
_TLS_FAILURE_MARKS = ("handshake failed", "tsi_", "ssl_error", "certificate")


def _is_tls_failure(details: str) -> bool:
    details = details.lower()
    return any(mark in details for mark in _TLS_FAILURE_MARKS)


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


_SCHEMES = ("https://", "http://")


def endpoints_scheme(text: str) -> str:
    """The scheme the endpoints are written with: "https", "http", or "" (bare host:port);
    ValueError when they mix (one client speaks TLS to every endpoint, or to none)."""
    schemes = {next((s[:-3] for s in _SCHEMES if e.strip().startswith(s)), "") for e in text.split(",") if e.strip()}
    if len(schemes) > 1:
        raise ValueError(f"etcd endpoints mix schemes ({', '.join(sorted(s or 'none' for s in schemes))}): "
                         "give all of them as https:// (TLS) or none")
    return schemes.pop() if schemes else ""


def parse_endpoints(text: str) -> list[str]:
    """`[scheme://]host:port[,...]` -> the list of host:port (the scheme stripped: whether to speak
    TLS is the client's credentials, see `endpoints_scheme`); ValueError with the offending entry."""
    endpoints = [e.strip() for e in text.split(",") if e.strip()]
    if not endpoints:
        raise ValueError("no etcd endpoint given (host:port[,host:port...])")
    out = []
    for e in endpoints:
        bare = next((e[len(s):] for s in _SCHEMES if e.startswith(s)), e).rstrip("/")
        host, sep, port = bare.rpartition(":")
        if not sep or not host or "/" in bare or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd endpoint {e!r} is not [https://]host:port")
        out.append(bare)
    return out


@functools.cache
def _tls_client_class():
    """aetcd.Client over a TLS channel. aetcd 1.0 opens plaintext channels only (its connect()
    calls grpc.aio.insecure_channel), so connect() is replaced with the same steps on a secure
    channel; everything else (the calls, their error mapping) is aetcd's own."""
    import grpc  # a dependency of ddiloco itself (and of aetcd)

    aetcd, _ = _aetcd()
    rpc, watcher = extras.require("aetcd.rpc", "etcd"), extras.require("aetcd.watcher", "etcd")

    class TLSClient(aetcd.Client):
        def __init__(self, *, credentials: Any, **kwargs) -> None:
            super().__init__(**kwargs)
            self._credentials = credentials

        async def connect(self) -> None:
            if self._connected.is_set():
                return
            # Nothing here awaits: no other task can interleave, so no connecting state is needed.
            channel = grpc.aio.secure_channel(f"{self._host}:{self._port}", self._credentials,
                                              options=tuple(self._options.items()))
            self.channel = channel
            self.kvstub = rpc.KVStub(channel)
            self.clusterstub = rpc.ClusterStub(channel)
            self.leasestub = rpc.LeaseStub(channel)
            self.maintenancestub = rpc.MaintenanceStub(channel)
            self._watcher = watcher.Watcher(rpc.WatchStub(channel), timeout=self._timeout, metadata=self.metadata)
            self._connected.set()

    return TLSClient


class Etcd:
    """See the module docstring. One aetcd client per endpoint, connected on first use.

    `credentials`: gRPC channel credentials (grpc.ssl_channel_credentials: etcd's CA, and this
    client's certificate and key for an etcd that requires client certificates); None: plaintext.
    `channel_options`: e.g. ("grpc.ssl_target_name_override", name) when etcd's certificate does
    not name the host dialled."""

    def __init__(self, endpoints: list[str], *, call_timeout_s: float = 2.0, credentials: Any = None,
                 channel_options: tuple[tuple[str, Any], ...] = ()) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        if call_timeout_s <= 0:
            raise ValueError(f"call_timeout_s must be > 0, got {call_timeout_s}")
        self._aetcd, self._errors = _aetcd()  # here, so a syncer without the extra fails at start
        self.endpoints = list(endpoints)
        self.call_timeout_s = call_timeout_s
        self.credentials = credentials
        self.channel_options = tuple(channel_options)
        self._clients: dict[str, aetcd.Client] = {}
        self._preferred = 0  # index of the endpoint that answered last

    @property
    def tls(self) -> bool:
        return self.credentials is not None

    def sibling(self) -> Etcd:
        """A new client of the same endpoints with the same settings and none of this one's
        connections (for another thread's event loop: a gRPC aio channel belongs to one loop)."""
        return Etcd(self.endpoints, call_timeout_s=self.call_timeout_s, credentials=self.credentials,
                    channel_options=self.channel_options)

    def _client(self, endpoint: str) -> aetcd.Client:
        client = self._clients.get(endpoint)
        if client is None:
            host, _, port = endpoint.rpartition(":")
            settings = dict(host=host.strip("[]"), port=int(port), timeout=self.call_timeout_s,
                            options=dict(self.channel_options), connect_wait_timeout=max(1, int(self.call_timeout_s)))
            client = (_tls_client_class()(credentials=self.credentials, **settings) if self.tls
                      else self._aetcd.Client(**settings))
            self._clients[endpoint] = client
        return client

    async def _call(self, what: str, fn, timeout_s: float | None = None):
        """fn(client) on each endpoint at most once; the first answer wins."""
        bound_s = self.call_timeout_s if timeout_s is None else max(0.05, min(timeout_s, self.call_timeout_s))
        n = len(self.endpoints)
        failures: list[tuple[str, Exception]] = []
        for i in range(n):
            index = (self._preferred + i) % n
            endpoint = self.endpoints[index]
            try:
                result = await asyncio.wait_for(fn(self._client(endpoint)), bound_s)
            except (asyncio.TimeoutError, self._errors.ConnectionFailedError,
                    self._errors.ConnectionTimeoutError, self._errors.InternalError) as exc:
                failures.append((endpoint, exc))
                continue
            except self._errors.ClientError as exc:  # etcd's answer: another endpoint would say the same
                raise EtcdError(f"etcd {what}: {exc}") from exc
            self._preferred = index
            return result
        raise self._unanswered(what, bound_s, failures)

    def _unanswered(self, what: str, bound_s: float, failures: list[tuple[str, Exception]]) -> EtcdError:
        """The error of a call no endpoint answered: EtcdTLSError when an endpoint refused the TLS
        handshake (or this client refused its certificate), else EtcdUnavailable."""
        refused = [f"{endpoint}: {exc}" for endpoint, exc in failures if self.tls and _is_tls_failure(str(exc))]
        if refused:
            return EtcdTLSError(
                f"etcd {what}: TLS with etcd failed ({'; '.join(refused)}): etcd refused this client's certificate "
                "(none, or not signed by etcd's --trusted-ca-file), or this client does not trust etcd's (--cert-file), "
                "or etcd does not serve TLS; check the etcd client certificate, key and CA (the syncer's "
                "--coord-tls-cert, --coord-tls-key, --coord-tls-ca)")
        # A TLS listener closes a plaintext client's connection at once: say so, it looks like etcd being down.
        closed = not self.tls and any("socket closed" in str(exc).lower() for _, exc in failures)
        hint = ("; this client speaks plaintext, and an etcd serving TLS (https, --client-cert-auth) closes "
                "plaintext connections: give it etcd's CA and a client certificate" if closed else "")
        listed = "; ".join(f"{endpoint}: {type(exc).__name__}" for endpoint, exc in failures)
        return EtcdUnavailable(f"etcd {what}: no endpoint answered within {bound_s:.1f} s ({listed}){hint}")

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
