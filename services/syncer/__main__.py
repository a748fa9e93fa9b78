"""Runs the syncer: `python -m services.syncer --help` (or `ddiloco syncer`).

Wiring only: read the configuration, build the model's initial parameters and fragment plan,
restore the latest checkpoint if the store has one, serve, checkpoint periodically and on SIGTERM.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import NamedTuple

from grpc_health.v1 import health_pb2

from ddiloco import checkpoint_client as checkpoint_client_lib
from ddiloco import checkpoint_replicas as replicas_lib
from ddiloco import build_info, logs, models, runtime
from ddiloco import metrics as metrics_lib
from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import inner as inner_lib
from ddiloco.algo import outer as outer_lib
from ddiloco.algo import rounds as rounds_lib
from ddiloco import failpoints as failpoints_lib
from ddiloco.rpc import channel as channel_lib
from ddiloco.rpc import interceptors as rpc_interceptors
from ddiloco.rpc import retry as retry_lib
from ddiloco.rpc import security as security_lib
from ddiloco.rpc import server as server_lib
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc
from ddiloco.wire import codec as codec_lib
from . import checkpointing
from . import config as config_lib
from . import core as core_lib
from . import history as history_lib
from . import initial as initial_lib
from . import influence as influence_lib
from . import commit_gate
from . import leadership as leadership_lib
from . import ledger_sink as ledger_sink_lib
from . import metrics as syncer_metrics
from . import servicer as servicer_lib
from . import state as state_lib
from . import wire_views

_LOG = logging.getLogger("ddiloco.syncer")


class _Checkpointer:
    """Writes checkpoints in the background; one at a time; a failure never stops training."""

    def __init__(self, core: core_lib.SyncerCore, client, cfg: config_lib.SyncerConfig, metrics=None) -> None:
        self._core = core
        self._metrics = metrics
        self._client = client
        self._cfg = cfg
        self._merges_since = 0
        self._task: asyncio.Task | None = None
        self.on_commit = None  # called with the snapshot of each committed checkpoint (history)
        # Leader election (services/syncer/leadership.py): whether this syncer may write, and the
        # fenced commit of a written checkpoint (awaited with its step). None: no election.
        self.may_write = None
        self.on_written = None
        # With election: the leader's epoch, written into each manifest (the store keeps one lineage).
        self.epoch = None
        # Every checkpoint says what its bytes mean (model, config, fragment plan): `ddiloco export`.
        self._description = checkpointing.describe_run(cfg, wire_views.run_config(core.run, core.plan), core.plan)
        self.commit_loop: commit_gate.CommitLoop | None = None
        if cfg.commit_before_broadcast:
            core.commit_before_broadcast = True
            self.commit_loop = commit_gate.CommitLoop(
                self.save, lambda: core.outer_steps > core.last_checkpoint_outer_step)

    def on_merge(self) -> None:
        if self.commit_loop is not None:  # --commit-before-broadcast: every merge, before its broadcast
            self.commit_loop.request()
            return
        self._merges_since += 1
        if self._merges_since >= self._cfg.checkpoint_every_merges and (self._task is None or self._task.done()):
            self._merges_since = 0
            self._task = asyncio.get_running_loop().create_task(self.save())

    async def save(self) -> bool:
        core = self._core
        if self._client is None or core.outer_steps <= core.last_checkpoint_outer_step:
            return False
        if self.may_write is not None and not self.may_write():
            return False
        started = time.monotonic()
        snapshot = await core.snapshot()
        blobs, metadata = await asyncio.to_thread(checkpointing.encode_snapshot, snapshot, self._description)
        try:
            await asyncio.wait_for(self._write(snapshot.outer_steps, blobs, metadata), self._cfg.checkpoint_timeout_s)
        except Exception as exc:  # the store being down must not stop training; we retry next time
            _LOG.warning(f"checkpoint at outer step {snapshot.outer_steps} failed: {exc!r}")
            if self._metrics is not None:
                self._metrics.checkpoint_failures.inc()
            return False
        if self._metrics is not None:
            self._metrics.checkpoint_write.observe(time.monotonic() - started)
        core.note_checkpoint(snapshot.outer_steps, time.time())
        core.mark_committed(snapshot)
        if self.on_commit is not None:
            self.on_commit(snapshot)
        _LOG.info("checkpoint committed", extra={"fields": {"outer_step": snapshot.outer_steps, "seconds": round(time.monotonic() - started, 3)}})
        return True

    async def _write(self, step: int, blobs: dict[str, bytes], metadata: dict) -> None:
        refs = {}
        for name, data in blobs.items():
            digest = await self._client.put_blob(data)
            refs[name] = (digest, len(data))
        if self.may_write is not None and not self.may_write():
            # Deposed while the blobs went out (harmless: content-addressed, unreferenced): no
            # manifest, which the store would keep as its latest although nobody commits it.
            raise RuntimeError(f"no longer the leader: checkpoint at step {step} not written")
        if self.epoch is not None:
            metadata = {**metadata, "leader_epoch": str(self.epoch())}
        await self._client.commit_manifest(self._cfg.store_run_id, step, refs, metadata)
        if self.on_written is not None:
            await self.on_written(step)

    async def drain(self) -> None:
        if self.commit_loop is not None:
            await self.commit_loop.drain(self._cfg.checkpoint_timeout_s)
        if self._task is not None and not self._task.done():
            await asyncio.wait([self._task], timeout=self._cfg.checkpoint_timeout_s)


async def stop_serving(handle: server_lib.ServerHandle, servicer: servicer_lib.SyncerServicer, grace_s: float) -> None:
    """Stops the server: new calls are refused, uploads in flight get grace_s to finish. Watch
    streams never end on their own; they are ended once those uploads are done, so the stop
    returns then instead of after the whole grace period."""
    closing = asyncio.create_task(handle.close(grace_s))
    await asyncio.sleep(0)  # the server starts refusing new calls
    await servicer.end_streams(grace_s)
    await closing


async def _settle_merges(core: core_lib.SyncerCore, timeout_s: float = 10.0) -> None:
    """Shutdown, once no RPC can arrive: waits for running merges and cancels the open rounds'
    grace timers, so that nothing changes after the final checkpoint. Open rounds stay open
    (their uploads are not in the checkpoint, as after a crash; the history lists them)."""
    deadline = time.monotonic() + timeout_s
    while True:
        core.cancel_timers()
        if not core.merging or time.monotonic() > deadline:
            return
        await asyncio.sleep(0.02)


async def _restore(client, cfg: config_lib.SyncerConfig, manifest=None) -> state_lib.SyncerSnapshot | None:
    """The latest committed snapshot of this run (or that of `manifest`), None for a new run;
    raises if the store is down."""
    # The client retries transient failures for at most restore_timeout_s (see serve()).
    if manifest is None:
        manifest = await client.latest_manifest(cfg.store_run_id)
    if manifest is None:
        return None
    blobs = {}
    for ref in manifest.blobs:
        blobs[ref.name] = await client.get_blob(ref.digest)
    state = checkpointing.load_snapshot(blobs)
    _LOG.info("restoring checkpoint", extra={"fields": {"run": cfg.store_run_id, "outer_step": manifest.step}})
    return state


# Replicated stores: how long one store's client retries a transient failure before the replicated
# client counts that store as down for the call (its peers carry the checkpoint; repair catches up).
_REPLICA_RETRY_S = 5.0


def _checkpoint_client(cfg: config_lib.SyncerConfig, security: security_lib.ClientSecurity):
    """One store: the plain client, as always. Several: the replicated client over one per store."""
    def one(target: str, retry_s: float) -> checkpoint_client_lib.CheckpointClient:
        return checkpoint_client_lib.CheckpointClient(
            channel_lib.aio_channel(target, security), timeout=datetime.timedelta(seconds=10),
            retry_timeout=datetime.timedelta(seconds=retry_s))

    targets = cfg.checkpoint_targets
    if len(targets) == 1:
        return one(targets[0], cfg.restore_timeout_s)
    return replicas_lib.ReplicatedCheckpointClient(
        {t: one(t, min(_REPLICA_RETRY_S, cfg.restore_timeout_s)) for t in targets},
        write_quorum=cfg.checkpoint_write_quorum or None, call_timeout_s=10.0,
        blob_timeout_s=cfg.checkpoint_timeout_s, quorum_wait_s=cfg.restore_timeout_s)


def _dp_stepper_factory(cfg: config_lib.SyncerConfig):
    """dp mode: each fragment gets the learners' AdamW (tensor-aware: decay mask, clipping)."""
    optimizer = inner_lib.make_inner_optimizer(inner_lib.InnerOptConfig(
        learning_rate=cfg.dp_learning_rate, warmup_steps=cfg.dp_warmup_steps, weight_decay=cfg.dp_weight_decay,
        decay_steps=cfg.dp_decay_steps))
    return lambda frag: outer_lib.OuterStepper(optimizer, tensors=[(t.name, tuple(t.shape)) for t in frag.tensors])


class _Security(NamedTuple):
    """The syncer's transport security, read once at the start."""

    server: security_lib.ServerSecurity
    credentials: object  # the server's gRPC credentials (None: plaintext)
    authenticator: object
    store: security_lib.ClientSecurity  # towards the checkpoint store

    @classmethod
    def load(cls, cfg: config_lib.SyncerConfig) -> _Security:
        """Reads every certificate and token file now. Raises ValueError on an unreadable one."""
        server = cfg.server_security()
        credentials = server.credentials()
        authenticator = server.authenticator()
        store = cfg.checkpoint_security()
        store.token()
        try:  # etcd's CA and the etcd client certificate (--coord-tls-*), read again in elect()
            cfg.coord_security().check_files()
        except ValueError as exc:
            raise ValueError(f"etcd client TLS (--coord-tls-*): {exc}") from None
        return cls(server, credentials, authenticator, store)


async def serve(cfg: config_lib.SyncerConfig) -> int:
    # Transport security first: unreadable certificates or token files stop the start (status 2).
    try:
        security = _Security.load(cfg)
    except ValueError as exc:
        _LOG.error(f"security configuration: {exc}")
        return 2
    model = models.get_model(cfg.model, cfg.model_overrides)
    plan = _plan_fragments(cfg, model)
    client = _checkpoint_client(cfg, security.store) if cfg.checkpoint_target else None
    core = make_core(cfg, model, plan)
    registry = metrics_lib.new_registry("syncer")
    metrics = syncer_metrics.SyncerMetrics(core, registry)
    checkpointer, leadership = _checkpointing_and_leadership(cfg, core, client, metrics, registry)
    if client is not None and not leadership.coordinated:  # with election: once elected (_lead)
        refused = await _restore_at_start(cfg, core, client, metrics)
        if refused is not None:
            return refused
    # Captured before serving, so the ready file shows exactly what was restored.
    # With election a syncer's life (for the history) starts when it leads, once restored (_lead).
    history = None if leadership.coordinated else history_lib.attach(core, cfg.history_file)
    if cfg.merge_ledger:  # one hash-chained record per merge (ddiloco audit)
        core.attach_ledgers(ledger=influence_lib.MergeLedger(cfg.merge_ledger, max_bytes=cfg.merge_ledger_max_bytes))
    store_ledger = await _start_store_ledger(cfg, core, client, leadership)
    if store_ledger is not None:
        metrics.watch_ledger(store_ledger)
    if history is not None:  # fault tests: what the invariant checkers read
        checkpointer.on_commit = history.checkpoint_committed
    initial_state = _initial_state(core)
    servicer, handle = await _start_serving(cfg, core, security, registry, leadership)
    _announce(cfg, model, plan, core, security, handle, registry, initial_state)
    runtime.freeze_start_up_objects()  # a prompt exit after SIGTERM, shorter full collections
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    leading = None
    if leadership.coordinated:
        leading = loop.create_task(_lead(cfg, leadership, handle, core, client, servicer, checkpointer,
                                         metrics, stop))
    await stop.wait()
    if leading is not None and not leadership.leading():
        return await _stop_not_leading(handle, servicer, leadership, leading, cfg.grace_s)
    await _shut_down(cfg, handle, servicer, core, checkpointer, store_ledger, leadership, client, history)
    return 0


def _plan_fragments(cfg: config_lib.SyncerConfig, model: models.Model) -> fragments_lib.FragmentPlan:
    """The model's fragment plan; a baseline sync mode is said in the log, with its quorum."""
    plan = fragments_lib.plan_fragments(model.tensor_specs(), cfg.num_fragments, cfg.sync_period_steps,
                                        staggered=cfg.sync_mode == rounds_lib.DECOUPLED)
    if cfg.sync_mode != rounds_lib.DECOUPLED:
        _LOG.info(f"sync mode {cfg.sync_mode} (a baseline): {config_lib.apply_sync_mode.__doc__.split(chr(10))[0]}",
                  extra={"fields": {"min_quorum": cfg.min_quorum, "fragments": cfg.num_fragments,
                                    "H": cfg.sync_period_steps, "upload": cfg.upload_codec}})
        if cfg.min_quorum == 1:
            _LOG.warning(f"sync mode {cfg.sync_mode} with --min-quorum 1: merges will not wait for every learner; "
                         "set --min-quorum to the number of learners for the synchronous baseline")
    return plan


def make_core(cfg: config_lib.SyncerConfig, model: models.Model,
              plan: fragments_lib.FragmentPlan | None = None) -> core_lib.SyncerCore:
    """The core over the model's initial parameters (seeded by --seed), before any restore: a
    fragment shard builds and holds its own fragments only (initial.py). `plan`: the model's
    fragment plan for `cfg` unless given. Public: how tests build the core the service runs."""
    if plan is None:
        plan = _plan_fragments(cfg, model)
    fingerprint = models.model_fingerprint(model)
    initial = initial_lib.initial_fragments(model, plan, cfg.seed, cfg.shard_layout.owned)
    run = core_lib.make_run_settings(
        cfg, model_name=model.name, model_config_json=json.dumps(dict(model.config), sort_keys=True),
        fingerprint=fingerprint,
    )
    return core_lib.SyncerCore(
        run=run, plan=plan, initial_params=initial, settings=core_lib.CoreSettings.of(cfg),
        clock=time.monotonic, wall_clock=time.time,
        stepper_factory=_dp_stepper_factory(cfg) if cfg.sync_mode == rounds_lib.DP else None,
    )


def _checkpointing_and_leadership(cfg: config_lib.SyncerConfig, core: core_lib.SyncerCore, client,
                                  metrics: syncer_metrics.SyncerMetrics,
                                  registry) -> tuple[_Checkpointer, leadership_lib.Leadership]:
    """The background checkpointer hooked to the core's merges, writing only while this syncer
    leads (always, without --coord-etcd); fault tests' failpoints."""
    checkpointer = _Checkpointer(core, client, cfg, metrics)
    core.on_merge = checkpointer.on_merge
    if cfg.failpoints:  # fault tests only
        core.failpoint = failpoints_lib.Failpoints(cfg.failpoints, prefix="syncer.").hit
    leadership = leadership_lib.Leadership(coordinated=bool(cfg.coord_etcd))
    if leadership.coordinated:
        leadership_lib.register_metrics(leadership, registry)
    checkpointer.may_write = leadership.leading
    if leadership.coordinated:
        checkpointer.epoch = lambda: leadership.epoch
    return checkpointer, leadership


async def _restore_at_start(cfg: config_lib.SyncerConfig, core: core_lib.SyncerCore, client,
                            metrics: syncer_metrics.SyncerMetrics) -> int | None:
    """Restores the store's latest checkpoint, if any, and starts repairing replicas. Returns
    the exit status 3 when the store cannot be reached (never a fresh run over it), else None."""
    restore_started = time.monotonic()
    try:
        state = await _restore(client, cfg)
    except (retry_lib.RetriesExhausted, replicas_lib.QuorumError) as exc:
        _LOG.error(f"checkpoint store unreachable, refusing to start a fresh run over it: {exc}")
        return 3
    if state is None and cfg.shard_layout.sharded and await _unsharded_checkpoint(client, cfg):
        _LOG.error(f"run {cfg.run_id!r} has checkpoints of an unsharded syncer, and none of "
                   f"{cfg.shard_layout.describe()} ({cfg.store_run_id}): refusing to start a fresh sharded run over "
                   "it; run it unsharded (no --fragment-shards) or give the sharded run another --run-id")
        return 2
    if state is not None:
        try:
            core.restore(state)
        except ValueError as exc:  # another plan or shard layout: never train over it
            _LOG.error(f"checkpoint of run {cfg.store_run_id!r} refused: {exc}")
            return 2
        metrics.restore_seconds.set(time.monotonic() - restore_started)
    _start_repair(cfg, client, metrics)
    return None


async def _unsharded_checkpoint(client, cfg: config_lib.SyncerConfig) -> bool:
    """Whether the store holds a checkpoint of this run written without fragment shards."""
    return await client.latest_manifest(cfg.run_id) is not None


def _start_repair(cfg: config_lib.SyncerConfig, client, metrics: syncer_metrics.SyncerMetrics) -> None:
    """Replicated stores: background repair passes and their metrics (by the leader only, with election)."""
    if isinstance(client, replicas_lib.ReplicatedCheckpointClient) and len(client.store_names) > 1:
        client.start_repair([cfg.store_run_id], interval_s=cfg.checkpoint_repair_interval_s)
        metrics.watch_repair(client)


def _initial_state(core: core_lib.SyncerCore) -> dict:
    """What the ready file says was restored: outer steps and each fragment's version and hash."""
    digests = {fid: core.fragment_digest(fid) for fid in core.versions()}
    return {
        "restored": core.restored_from_checkpoint, "outer_steps": core.outer_steps,
        "fragments": {fid: {"version": version, "sha256": params} for fid, (version, _, params) in digests.items()},
    }


async def _start_serving(cfg: config_lib.SyncerConfig, core: core_lib.SyncerCore, security: _Security, registry,
                         leadership: leadership_lib.Leadership,
                         ) -> tuple[servicer_lib.SyncerServicer, server_lib.ServerHandle]:
    """The servicer behind metrics, authentication and the leader gate, serving on --bind."""
    servicer = servicer_lib.SyncerServicer(
        core, max_concurrent_uploads=cfg.max_concurrent_uploads, upload_idle_timeout_s=cfg.upload_idle_timeout_s,
        max_concurrent_uploads_per_learner=cfg.max_concurrent_uploads_per_learner,
        state_watch_cap=servicer_lib.StreamCap(cfg.max_state_watchers, cfg.max_state_watchers_per_identity,
                                               "--max-state-watchers"),
        fragment_watch_cap=servicer_lib.StreamCap(cfg.max_fragment_watchers, cfg.max_fragment_watchers_per_identity,
                                                  "--max-fragment-watchers"),
    )
    auth = security_lib.AuthInterceptor(security.authenticator, security_lib.SYNCER_POLICY,
                                        on_reject=servicer.record_interceptor_refusal)
    handle = await server_lib.start_server(
        cfg.bind,
        [syncer_pb2.DESCRIPTOR.services_by_name["Syncer"].full_name],
        [lambda s: syncer_pb2_grpc.add_SyncerServicer_to_server(servicer, s)],
        interceptors=[rpc_interceptors.MetricsInterceptor(registry), auth, leadership_lib.LeaderGate(leadership)],
        credentials=security.credentials,
        health_bind=cfg.health_bind,
    )
    return servicer, handle


def _announce(cfg: config_lib.SyncerConfig, model: models.Model, plan: fragments_lib.FragmentPlan,
              core: core_lib.SyncerCore, security: _Security, handle: server_lib.ServerHandle, registry,
              initial_state: dict) -> None:
    """Logs the serving line, starts the metrics endpoint and writes the ready file."""
    _LOG.info(
        f"syncer serving on {handle.address}",
        extra={"fields": {"run": cfg.run_id, "model": model.name, "fragments": plan.num_fragments,
                          "params": sum(f.numel for f in plan.fragments), "restored": core.restored_from_checkpoint,
                          "outer_step": core.outer_steps, **({"owns": sorted(core.owned)} if core.shards.sharded else {}),
                          "transport": "mtls" if security.server.tls else "plaintext",
                          "tokens": bool(cfg.auth_tokens_file), "health": handle.health_address or handle.address,
                          "version": build_info.version(), "commit": build_info.commit()}},
    )
    metrics_server = metrics_lib.serve(cfg.metrics_bind, registry) if cfg.metrics_bind else None
    if metrics_server is not None:
        initial_state["metrics_address"] = metrics_server.address
    if handle.health_address:
        initial_state["health_address"] = handle.health_address
    if cfg.ready_file:
        server_lib.write_ready_file(
            cfg.ready_file, address=handle.address, service="syncer", instance=core.instance, **initial_state
        )


async def _shut_down(cfg: config_lib.SyncerConfig, handle: server_lib.ServerHandle,
                     servicer: servicer_lib.SyncerServicer, core: core_lib.SyncerCore, checkpointer: _Checkpointer,
                     store_ledger: ledger_sink_lib.StoreLedger | None, leadership: leadership_lib.Leadership, client,
                     history) -> None:
    """A leader's (or lone syncer's) shutdown: drain RPCs, settle merges, write the final
    checkpoint and the last ledger records, then give up the lease."""
    _LOG.info("shutting down: draining RPCs and writing a final checkpoint")
    await handle.health.enter_graceful_shutdown()
    # RPCs first (in-flight uploads finish), then merges, then the final checkpoint: no merge may
    # land after it (a rolling restart would silently roll it back; found by ddiloco chaos).
    await stop_serving(handle, servicer, cfg.grace_s)
    await _settle_merges(core)
    await checkpointer.drain()
    await checkpointer.save()
    if store_ledger is not None:  # the last merges' records, briefly: a store that is down must not hold the exit
        await store_ledger.drain(min(_LEDGER_DRAIN_S, cfg.checkpoint_timeout_s))
        await store_ledger.close()
    await leadership.resign()  # after the final commit: a standby leads at once, without waiting for the lease
    history = history or leadership.history
    if isinstance(client, replicas_lib.ReplicatedCheckpointClient):
        await client.close()
    if history is not None:
        history.shutdown()
    _exit_if_teardown_hangs(0, _TEARDOWN_LIMIT_S)


_TEARDOWN_LIMIT_S = 5.0
_LEDGER_DRAIN_S = 10.0  # at shutdown, how long queued merge records may take to reach the store


async def _start_store_ledger(cfg, core, client, leadership) -> ledger_sink_lib.StoreLedger | None:
    """The checkpoint store's merge ledger (--store-ledger), continuing the chain the store holds.
    With election the head is read when a record is first sent (this syncer may not lead yet)."""
    if client is None or not cfg.store_ledger:
        return None
    sink = ledger_sink_lib.StoreLedger(client, cfg.store_run_id, call_timeout_s=10.0,
                                       blob_timeout_s=cfg.checkpoint_timeout_s)
    core.attach_ledgers(store_ledger=sink, retain_contributions=cfg.retain_contributions,
                        epoch=lambda: leadership.epoch)
    if not leadership.coordinated:
        try:
            await sink.resume()
        except Exception as exc:  # the shipping loop reads the head again before its first append
            _LOG.warning(f"merge ledger: the store's head is unknown for now: {exc!r}")
    sink.start()
    return sink


async def _lead(cfg, leadership, handle, core, client, servicer, checkpointer, metrics, stop) -> None:
    """Leader election (--coord-etcd): campaigns, and once elected restores the committed
    checkpoint and opens the gate. Sets `stop` when leadership is lost or cannot be taken up.
    The health status of the Syncer service is NOT_SERVING until then (the overall status stays
    SERVING: a standby is alive), so a readiness probe on it routes a Service to the leader only."""
    address = handle.address
    syncer_service = syncer_pb2.DESCRIPTOR.services_by_name["Syncer"].full_name
    await handle.health.set(syncer_service, health_pb2.HealthCheckResponse.NOT_SERVING)
    pointer, _etcd = leadership_lib.elect(cfg, leadership, address, core.instance)

    def lost(_reason: str) -> None:
        stop.set()
        # Whatever the event loop is busy with, the process is gone soon (its gate refuses already).
        _exit_if_teardown_hangs(leadership_lib.EXIT_LOST_LEADERSHIP, 2.0)

    leadership.on_lost = lost

    def observed(leader_address: str) -> None:
        servicer.leader_address = leader_address

    async def become_leader() -> None:
        started = time.monotonic()
        if client is not None:
            manifest = await leadership_lib.restore_committed(client, pointer, cfg.store_run_id)
            state = await _restore(client, cfg, manifest) if manifest is not None else None
            if state is not None:
                core.restore(state)
                metrics.restore_seconds.set(time.monotonic() - started)
        leadership.history = history_lib.attach(core, cfg.history_file)
        if leadership.history is not None:
            checkpointer.on_commit = leadership.history.checkpoint_committed
        servicer.epoch = leadership.election.epoch
        servicer.leader_address = address
        _start_repair(cfg, client, metrics)
        checkpointer.on_written = lambda step: leadership.commit(pointer, cfg.store_run_id, step)
        await handle.health.set(syncer_service, health_pb2.HealthCheckResponse.SERVING)
        _LOG.info("elected: serving learners", extra={"fields": {
            "epoch": servicer.epoch, "outer_step": core.outer_steps, "restored": core.restored_from_checkpoint,
            "seconds": round(time.monotonic() - started, 3)}})

    try:
        await leadership_lib.campaign_and_lead(leadership, on_observed=observed, become_leader=become_leader)
    except Exception as exc:
        _LOG.error(f"could not take up leadership (etcd, or restoring the committed checkpoint): {exc!r}")
        stop.set()
        raise


async def _stop_not_leading(handle: server_lib.ServerHandle, servicer: servicer_lib.SyncerServicer,
                            leadership: leadership_lib.Leadership, leading: asyncio.Task, grace_s: float) -> int:
    """Shutdown of a syncer that does not lead. A standby (SIGTERM) has nothing to checkpoint: it
    gives its candidate lease back and exits 0. A leader that lost its lease, or could not take
    it up, writes no final checkpoint and waits for no upload (the gate refuses everything) and
    exits EXIT_LOST_LEADERSHIP; its supervisor starts it again as a standby."""
    if not leadership.lost_reason and not (leading.done() and not leading.cancelled() and leading.exception()):
        leading.cancel()
        await stop_serving(handle, servicer, grace_s)
        await leadership.resign()
        _exit_if_teardown_hangs(0, _TEARDOWN_LIMIT_S)
        return 0
    await stop_serving(handle, servicer, 0.0)
    _exit_if_teardown_hangs(leadership_lib.EXIT_LOST_LEADERSHIP, 0.5)
    return leadership_lib.EXIT_LOST_LEADERSHIP


def _exit_if_teardown_hangs(code: int, limit_s: float) -> None:
    """Everything durable is written; bounds what is left (asyncio.run cancelling the server's
    remaining tasks and joining worker threads). A fresh-clone CI run saw that teardown hang for
    30 s until the rolling restart's SIGKILL. A daemon timer: a normal exit never waits for it."""
    def hard_exit() -> None:
        _LOG.warning(f"shutdown: teardown still running after {limit_s:.0f} s; exiting")
        logging.shutdown()
        os._exit(code)

    timer = threading.Timer(limit_s, hard_exit)
    timer.daemon = True
    timer.start()


def main(argv: list[str] | None = None) -> int:
    # Before the server's threads start allocating (see ddiloco.runtime for the measurements):
    # per-thread malloc arenas kept ~100 MiB of freed upload and download buffers at 64 learners,
    # and multi-threaded BLAS calls on top of the syncer's own threads stalled for milliseconds.
    runtime.limit_malloc_arenas(2)
    runtime.set_blas_threads(1)
    cfg = config_lib.parse_config(sys.argv[1:] if argv is None else argv, os.environ)
    # Plaintext must be asked for: refuse to start with neither certificates nor --insecure.
    security_lib.require_choice("ddiloco syncer", cfg.server_security)
    logs.setup_logging(cfg.log_level, json_lines=cfg.json_logs)
    # The upload decoder's compiled kernels load while the server starts, not in the first upload.
    threading.Thread(target=codec_lib.warm_up, name="codec-warm-up", daemon=True).start()
    return asyncio.run(serve(cfg))


if __name__ == "__main__":
    sys.exit(main())
