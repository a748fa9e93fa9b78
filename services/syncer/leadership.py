"""Leader election for the syncer (--coord-etcd): standby or leader, and the gate in front of its RPCs.

Without --coord-etcd there is no election: the syncer always leads with epoch 0, as before.

With it, each syncer of the run campaigns for the run's leader key on etcd (ddiloco.coord.election):
  - a **standby** serves, but refuses every learner call with UNAVAILABLE, reason `not_leader` and
    the leader's address in trailing metadata (errors.LEADER_KEY), so a learner goes there; it
    merges, broadcasts and checkpoints nothing (its core is never touched);
  - on winning, it restores the latest **committed** checkpoint (the etcd commit pointer names it;
    manifests the stores hold beyond it were written by a deposed leader and are ignored), then
    opens the gate and leads with its epoch, which rides on every version it broadcasts;
  - a **leader** checks its leadership before every call and before every message of a stream
    (`LeaderGate`), and commits every checkpoint through the fenced pointer. When its lease is
    not refreshed in time (cut off from etcd), or a commit is fenced, it stops at once: the gate
    closes and the process exits with EXIT_LOST_LEADERSHIP, before etcd can elect another
    leader. Its supervisor starts it again, as a standby.

etcd is dialled over TLS with --coord-tls-* (etcd's CA, the syncer's etcd client certificate). A
campaign that etcd refuses at the handshake (EtcdTLSError) ends the process the same way: waiting
would not help, and a restart reads the certificate files again.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import socket
from collections.abc import Callable

import grpc
import prometheus_client

from ddiloco.checkpoint_commit import CommitFenced, CommitRecord
from ddiloco.coord import commit as commit_lib
from ddiloco.coord import election as election_lib
from ddiloco.coord import etcd as etcd_lib
from ddiloco.rpc import errors
from ddiloco.rpc import interceptors as interceptors_lib

_LOG = logging.getLogger("ddiloco.syncer")

EXIT_LOST_LEADERSHIP = 4  # the process status of a leader that lost its lease or was fenced
# Read-only calls a standby still answers (operators see who leads: TrainingState.leader_address).
OPEN_METHODS = frozenset({"GetTrainingState", "WatchTrainingState"})
_SYNCER_PREFIX = "/ddiloco.v1.Syncer/"


class Leadership:
    """Whether this syncer may act. `election` None: no election, always leading with epoch 0."""

    def __init__(self, election: election_lib.Election | None = None, *, coordinated: bool | None = None) -> None:
        self.election = election
        # With election, nothing leads before the election object exists and is won.
        self.coordinated = election is not None if coordinated is None else coordinated
        self.leader_address = ""  # the leader as last observed (a standby's hint to learners)
        self.elected = False  # this syncer won the election, restored and leads
        self.lost_reason = ""
        self.on_lost: Callable[[str], None] | None = None
        self.keeper: election_lib.LeaseKeeper | None = None
        self.etcd: etcd_lib.Etcd | None = None  # the campaign's client; the keeper makes its own sibling
        self.history = None  # the fault tests' history, attached once elected (services/syncer/history.py)

    @property
    def epoch(self) -> int:
        return self.election.epoch if self.election is not None and self.elected else 0

    def leading(self) -> bool:
        if not self.coordinated:
            return True
        return self.election is not None and self.elected and not self.lost_reason and self.election.is_leader()

    def lose(self, reason: str) -> None:
        """Stops leading here, now (idempotent); `on_lost` ends the process."""
        if self.lost_reason or not self.coordinated:
            return
        self.lost_reason = reason
        if self.election is not None:
            self.election.step_down()
        _LOG.error(f"lost leadership: {reason}; no more merges are broadcast or committed by this syncer")
        if self.on_lost is not None:
            self.on_lost(reason)

    def refusal(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        """The details and trailing metadata of a standby's UNAVAILABLE."""
        address = self.leader_address if self.leader_address and not self.elected else ""
        metadata = ((errors.REASON_KEY, errors.REASON_NOT_LEADER),)
        if address:
            metadata += ((errors.LEADER_KEY, address),)
        if self.lost_reason:
            return f"this syncer lost its leadership ({self.lost_reason}); find the new leader", metadata
        where = f"the leader is at {address}" if address else "no leader is known yet"
        return f"this syncer is a standby: {where}", metadata

    async def resign(self) -> None:
        """A clean shutdown: gives the lease back, so a standby need not wait for it to expire."""
        if self.election is not None:
            self.lost_reason = self.lost_reason or "resigned"
            self.election.step_down()
            if self.keeper is not None:  # the keeper stops refreshing before the lease is revoked
                await asyncio.to_thread(self.keeper.join, 2.0)
            await self.election.resign()

    async def commit(self, pointer: commit_lib.EtcdCommitPointer, run_id: str, step: int) -> None:
        """The fenced commit of the checkpoint at `step`, just written to the store."""
        if not self.leading():
            raise CommitFenced(f"not the leader: checkpoint at step {step} not committed")
        try:
            await pointer.commit(CommitRecord(run_id=run_id, step=step, epoch=self.epoch))
        except CommitFenced as exc:
            self.lose(f"checkpoint commit fenced: {exc}")
            raise


class LeaderGate(grpc.aio.ServerInterceptor):
    """Refuses Syncer calls (but OPEN_METHODS) while this syncer does not lead, and ends a
    response stream at its next message once leadership is gone (no version leaves after that)."""

    def __init__(self, leadership: Leadership) -> None:
        self._leadership = leadership

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if (handler is None or not self._leadership.coordinated or not method.startswith(_SYNCER_PREFIX)
                or method[len(_SYNCER_PREFIX):] in OPEN_METHODS):
            return handler
        return _gated(handler, self._check)

    async def _check(self, context: grpc.aio.ServicerContext) -> None:
        if not self._leadership.leading():
            details, metadata = self._leadership.refusal()
            await context.abort(grpc.StatusCode.UNAVAILABLE, details, trailing_metadata=metadata)


def _gated(handler: grpc.RpcMethodHandler, check) -> grpc.RpcMethodHandler:
    def wrap(behavior):
        if inspect.isasyncgenfunction(behavior):
            async def stream_behavior(request, context):
                await check(context)
                responses = behavior(request, context)
                try:
                    async for response in responses:
                        await check(context)
                        yield response
                finally:
                    await responses.aclose()

            return stream_behavior

        async def unary_behavior(request, context):
            await check(context)
            result = behavior(request, context)
            result = await result if inspect.isawaitable(result) else result
            # No acknowledgement from a syncer deposed meanwhile: the caller tries the new leader.
            await check(context)
            return result

        return unary_behavior

    return interceptors_lib.rewrap_handler(handler, wrap)


async def restore_committed(client, pointer: commit_lib.EtcdCommitPointer, run_id: str):
    """The manifest of the run's committed checkpoint: None for a new run. Without a commit yet,
    the store's latest (a run started before election was turned on). Raises LookupError when
    the committed manifest is not in the store."""
    record = await pointer.latest(run_id)
    if record is None:
        return await client.latest_manifest(run_id)
    for manifest in reversed(await client.list_manifests(run_id)):
        if manifest.step == record.step:
            return manifest
    raise LookupError(f"run {run_id}: the committed checkpoint (step {record.step}, epoch {record.epoch}) "
                      "is not in the checkpoint store")


async def campaign_and_lead(leadership: Leadership, *, on_observed: Callable[[str], None], become_leader) -> int:
    """Campaigns until elected, then keeps the lease on a thread of its own (LeaseKeeper:
    leadership.lose is called when it is lost) and runs `become_leader()` (restore; raises to give
    up); returns the epoch."""
    election = leadership.election

    def observed(leader: election_lib.Leader | None) -> None:
        address = leader.address if leader is not None else ""
        if address != leadership.leader_address:
            _LOG.info(f"leader is {address or '(none)'}" + (f" (epoch {leader.epoch})" if leader else ""))
        leadership.leader_address = address
        on_observed(address)

    epoch = await election.campaign(on_observed=observed)
    # The lease is kept from now on, while the checkpoint is restored (a large model takes longer
    # than a lease); the gate stays closed until `elected`.
    loop = asyncio.get_running_loop()
    leadership.keeper = election_lib.LeaseKeeper(
        election, leadership.etcd, on_lost=lambda reason: loop.call_soon_threadsafe(leadership.lose, reason))
    leadership.keeper.start()
    try:
        await become_leader()
        if leadership.lost_reason:
            raise RuntimeError(f"leadership lost while restoring: {leadership.lost_reason}")
    except BaseException as exc:
        # Logged here: stepping down ends the process (on_lost), which cancels the caller before
        # it could say why (the first hub soak's syncers exited 4 in a loop, reason unlogged).
        if not isinstance(exc, asyncio.CancelledError):
            _LOG.error(f"could not take up leadership: {exc!r}")
        election.step_down()
        await asyncio.to_thread(leadership.keeper.join, 2.0)
        await election.resign()
        raise
    leadership.elected = True
    leadership.leader_address = ""
    _LOG.info(f"leading with epoch {epoch}")
    return epoch


def register_metrics(leadership: Leadership, registry) -> None:
    """With election: whether this syncer leads (1) or stands by (0), and its epoch, at scrape time
    (an alert on "no syncer of the run leads" sums the first over the run's syncers)."""
    leader = prometheus_client.Gauge("ddiloco_syncer_leader",
                                     "1 while this syncer leads its run (leader election), 0 while it stands by",
                                     registry=registry)
    leader.set_function(lambda: 1.0 if leadership.leading() else 0.0)
    epoch = prometheus_client.Gauge("ddiloco_syncer_leader_epoch",
                                    "Leader epoch of this syncer while it leads (etcd revision), 0 otherwise",
                                    registry=registry)
    epoch.set_function(lambda: float(leadership.epoch if leadership.leading() else 0))


def advertised(address: str) -> str:
    """The address learners can reach a syncer bound to `address` at: a wildcard host (0.0.0.0,
    ::) becomes this host's address (on Kubernetes, the pod IP its hostname resolves to)."""
    host, _, port = address.rpartition(":")
    if host.strip("[]") not in ("0.0.0.0", "::", ""):
        return address
    try:
        return f"{socket.gethostbyname(socket.gethostname())}:{port}"
    except OSError:
        return address


def elect(cfg, leadership: Leadership, address: str, instance: str) -> tuple[commit_lib.EtcdCommitPointer,
                                                                               etcd_lib.Etcd]:
    """Gives a coordinated Leadership its election (once the syncer serves at `address`), from its
    SyncerConfig; returns the commit pointer and the etcd client."""
    security = cfg.coord_security()  # TLS towards etcd when configured (--coord-tls-*), else plaintext
    etcd = etcd_lib.Etcd(etcd_lib.parse_endpoints(cfg.coord_etcd), call_timeout_s=cfg.coord_call_timeout_s,
                         credentials=security.credentials(), channel_options=security.channel_options())
    key = election_lib.leader_key(cfg.coord_prefix, cfg.store_run_id)  # one election per shard
    election = election_lib.Election(etcd, key, address=cfg.coord_advertise or advertised(address), instance=instance,
                                     lease_ttl_s=cfg.coord_lease_s)
    leadership.election = election
    leadership.etcd = etcd
    return commit_lib.EtcdCommitPointer(etcd, prefix=cfg.coord_prefix, leader_key=key), etcd
