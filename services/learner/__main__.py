"""Runs one learner: `python -m services.learner --help` (or `ddiloco learner`).

Wiring only: join the syncer (which owns the run configuration and the model choice), load this
learner's data shard, then train until --steps or SIGTERM while the SyncClient syncs fragments in
the background. Exit status: 0 done, 3 could not join, 4 fenced off by a newer life.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import jax
import numpy as np

from ddiloco import build_info
from ddiloco import liveness as liveness_lib
from ddiloco import logs, models, runtime
from ddiloco import metrics as metrics_lib
from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import inner as inner_lib
from ddiloco.algo import rounds as rounds_lib
from ddiloco.data import corpus
from ddiloco.data import sources as data_sources
from ddiloco.learner import client as client_lib
from ddiloco.learner import sharded as sharded_lib
from ddiloco.learner import loop as loop_lib
from ddiloco.learner import snapshot as snapshot_lib
from ddiloco.rpc import security as security_lib
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde
from . import config as config_lib
from . import distributed as distributed_lib
from . import metrics as learner_metrics
from . import train as train_lib

_LOG = logging.getLogger("ddiloco.learner")


# Builds the learner's SyncClient from its config: the seam through which a tool runs this learner
# with another client (ddiloco.chaos.hostile_learner corrupts every upload).
ClientFactory = Callable[[client_lib.ClientConfig], client_lib.SyncClient]


class _Startup:
    """Where a (re)start's time goes until the first inner step: a killed learner's capacity is
    lost for exactly this long after its restart, so it is logged once and kept in the summary."""

    def __init__(self) -> None:
        self._last_s = time.monotonic()
        # The interpreter's start and the imports, which ran before any timer here.
        self.phases_s: dict[str, float | None] = {"process_and_imports": runtime.process_age_s()}

    def mark(self, phase: str) -> None:
        now_s = time.monotonic()
        self.phases_s[phase] = now_s - self._last_s
        self._last_s = now_s

    def report(self) -> dict[str, float | None]:
        phases = {k: round(v, 3) if v is not None else None for k, v in self.phases_s.items()}
        total = sum(v for v in self.phases_s.values() if v is not None)
        return {"total_s": round(total, 3), **phases}


@dataclasses.dataclass
class _Life:
    """What one life of the learner trains with, once joined and loaded."""

    cfg: config_lib.LearnerConfig
    unit: distributed_lib.LearnerUnit
    sync_client: client_lib.SyncClient  # the client this process built (failpoints live on it)
    client: client_lib.SyncClient  # the one the loop talks to (the unit's wrapper in a multi-host unit)
    loop: loop_lib.LearnerLoop
    sampler: corpus.BatchSampler
    shard: int
    incarnation: int
    sync_mode: str
    snapshots: snapshot_lib.Snapshotter | None
    stop: threading.Event
    liveness: liveness_lib.LoopLiveness
    startup: _Startup


def run(cfg: config_lib.LearnerConfig, client_factory: ClientFactory = sharded_lib.ShardedSyncClient) -> int:
    startup = _Startup()
    if cfg.compilation_cache_dir:
        train_lib.enable_compilation_cache(cfg.compilation_cache_dir)
    # The unit's devices and mesh (and jax.distributed for a multi-host unit), before any JAX use.
    try:
        unit = distributed_lib.init_unit_from_config(cfg)
    except ValueError as exc:
        _LOG.error(str(exc))
        return 2
    incarnation = unit.agree_int(cfg.incarnation or time.time_ns())  # one identity per unit
    # Liveness from here on: the start, the join and every inner step are progress (see config).
    liveness = liveness_lib.LoopLiveness(cfg.liveness_timeout_s)
    # Held for the whole life: a gRPC server nobody references is stopped when it is collected.
    health_server = _serve_health(cfg, liveness) if cfg.health_bind else None
    if cfg.health_bind and health_server is None:
        return 2
    startup.mark("devices_and_health")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    # In a multi-host unit only process 0 talks to the syncer; the wrapper keeps the others in step.
    sync_client = client_factory(_client_config(cfg, incarnation, stop))
    client = unit.wrap_client(sync_client, stop)
    collector = learner_metrics.LearnerCollector(cfg.learner_id, cfg.region, client)
    if cfg.metrics_bind:
        registry = metrics_lib.new_registry("learner")
        registry.register(collector)
        metrics_server = metrics_lib.serve(cfg.metrics_bind, registry)
        _LOG.info(f"metrics on http://{metrics_server.address}/metrics")
    joined = _join(cfg, client, liveness)
    if isinstance(joined, int):
        return joined
    run_config, model, sync_mode = joined
    startup.mark("join")
    split = _load_data(cfg, client, model)
    if split is None:
        return 2
    startup.mark("data")
    shard = client.data_shard  # pinned, or assigned by the syncer at the join (same on every process of a unit)
    _LOG.info(f"data {split.source}: {split.shard_summary(shard)} (this learner's); {split.heldout_summary()}")
    sampler = corpus.BatchSampler(split.shards[shard], cfg.batch_size, model.seq_len,
                                  seed=int(np.random.SeedSequence([cfg.seed, shard, incarnation]).generate_state(1)[0]))
    loop = _make_loop(cfg, unit, client, run_config, model, sampler, incarnation, sync_mode, stop)
    collector.loop = loop
    snapshots = _resume(cfg, loop, run_config, sampler, shard, sync_mode)  # None: --state-dir off
    schedule_step = _continue_schedule(cfg, loop, client.schedule_start_step)
    loop.apply_updates()
    _LOG.info(
        f"learner {cfg.learner_id} training",
        extra={"fields": {"incarnation": incarnation, "shard": shard, "data": split.source, "syncer": cfg.syncer,
                          "fragments": loop.plan.num_fragments, "H": loop.plan.sync_period_steps,
                          "inner_optimizer": "model" if hasattr(model, "inner_optimizer") else "adamw",
                          "version": build_info.version(), "commit": build_info.commit(),
                          "resumed_from_step": loop.stats.resumed_from_step, "schedule_step": schedule_step,
                          **unit.describe()}},
    )
    startup.mark("build_and_resume")
    life = _Life(cfg, unit, sync_client, client, loop, sampler, shard, incarnation, sync_mode, snapshots, stop,
                 liveness, startup)
    started = time.monotonic()
    if not _train(life):
        return 4
    summary = _finish(life, started)
    _LOG.info("done", extra={"fields": summary})
    if cfg.summary_file:
        with open(cfg.summary_file, "w") as f:
            json.dump(summary, f)
    return 0


def _serve_health(cfg: config_lib.LearnerConfig,
                  liveness: liveness_lib.LoopLiveness) -> liveness_lib.HealthServer | None:
    """The liveness health endpoint on --health-bind; None (logged) when its port is taken. The
    caller keeps the server referenced for as long as it must answer."""
    try:
        health_server = liveness_lib.HealthServer(cfg.health_bind, liveness)
    except OSError as exc:
        _LOG.error(f"{exc}: another learner on this host? give each its own --health-bind "
                   "(127.0.0.1:0 picks a free port; empty disables it)")
        return None
    _LOG.info(f"health on {health_server.address} (NOT_SERVING after {cfg.liveness_timeout_s:g} s "
              "without an inner step)")
    return health_server


def _client_config(cfg: config_lib.LearnerConfig, incarnation: int, stop: threading.Event) -> client_lib.ClientConfig:
    """The sync client's configuration for this life."""
    return client_lib.ClientConfig(
        target=cfg.syncer, learner_id=cfg.learner_id, incarnation=incarnation, region=cfg.region,
        tokens_per_step=0, call_timeout_s=cfg.call_timeout_s, retry_bound_s=cfg.retry_bound_s,
        progress_interval_s=cfg.progress_interval_s, security=cfg.client_security(),
        failpoints=cfg.failpoints, history_file=cfg.history_file, initial_values=_initial_fragments,
        encode=_upload_encoder(cfg),
        on_budget_reached=stop.set,  # the run's token budget is spent: finish as on SIGTERM
        # Ids without a shard number (--learner-id auto) take the shard the syncer assigns.
        num_data_shards=cfg.num_shards, data_shard=cfg.pinned_shard_index,
        fallback_data_shard=cfg.resolved_shard_index,
    )


def _join(cfg: config_lib.LearnerConfig, client, liveness: liveness_lib.LoopLiveness):
    """Joins the syncer and builds its model: (run config, model, sync mode), or the exit status
    (3 could not join, 4 fenced off or another model, 2 a baseline mode in a multi-process unit)."""
    try:
        run_config = client.start(cfg.join_timeout_s)
    except client_lib.FencedError as exc:
        _LOG.error(str(exc))
        client.close(leave=False)
        return 4
    except TimeoutError as exc:
        _LOG.error(str(exc))
        client.close(leave=False)
        return 3
    liveness.beat()  # joined: the bound now covers loading the data and compiling the first step
    model = models.get_model(run_config.model_name, json.loads(run_config.model_config_json))
    if models.model_fingerprint(model) != run_config.model_fingerprint:
        _LOG.error("this learner builds a different model than the syncer's (fingerprint mismatch)")
        client.close(leave=False)
        return 4
    sync_mode = run_config.sync_mode or rounds_lib.DECOUPLED
    if sync_mode != rounds_lib.DECOUPLED and cfg.num_processes > 1:
        _LOG.error(f"sync mode {sync_mode!r} (a baseline) is not supported by multi-process learner units")
        client.close(leave=False)
        return 2
    return run_config, model, sync_mode


def _load_data(cfg: config_lib.LearnerConfig, client, model: models.Model) -> corpus.CorpusSplit | None:
    """The run's data, checked against the model's vocabulary; None (logged, client closed) if unusable."""
    try:
        split = data_sources.load(cfg.data_spec())  # warnings (a truncating size cap, binary files) are logged
        data_sources.check_vocabulary(split, model.vocab_size)
    except (ValueError, OSError) as exc:
        _LOG.error(f"data {cfg.data_spec().describe()}: {exc}")
        client.close(leave=True)
        return None
    return split


def _make_loop(cfg: config_lib.LearnerConfig, unit: distributed_lib.LearnerUnit, client, run_config,
               model: models.Model, sampler: corpus.BatchSampler, incarnation: int, sync_mode: str,
               stop: threading.Event) -> loop_lib.LearnerLoop:
    """The inner loop over the model's train step, from zeroed parameters the global fragments
    overwrite before the first step."""
    plan = serde.plan_from_proto(run_config.fragments, run_config.sync_period_steps)
    # A model may choose its own inner optimizer, any optax chain (ddiloco.models, docs/models.md).
    # The LR schedule goes on from the steps the syncer counted for this learner's earlier lives.
    inner = cfg.inner_optimizer(schedule_offset=client.schedule_start_step)
    optimizer = (model.inner_optimizer(inner) if hasattr(model, "inner_optimizer")
                 else train_lib.make_inner_optimizer(inner))
    # Start from zeros of the right shapes; the global fragments overwrite every tensor before
    # the first step (client.start waited for all of them).
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0))  # shapes only: nothing runs
    params = {k: np.zeros(v.shape, np.float32) for k, v in shapes.items()}
    rng = random.Random(incarnation)
    delay = None
    if cfg.step_delay_s:
        delay = lambda: cfg.step_delay_s * (1.0 + cfg.step_jitter * rng.uniform(-1.0, 1.0))  # noqa: E731
    return loop_lib.LearnerLoop(
        plan=plan, params=params, train_step=train_lib.TrainStep(model, optimizer, unit.mesh), sampler=sampler, client=client,
        learner_id=cfg.learner_id, incarnation=incarnation, mixing_alpha=run_config.mixing_alpha, step_delay_s=delay,
        sync_mode=sync_mode, should_stop=stop.is_set, on_arrival=run_config.on_arrival,
        round_trigger=run_config.round_trigger or "schedule",
    )


def _train(life: _Life) -> bool:
    """Inner steps until --steps, a signal or the unit stops; False when fenced off (client closed)."""
    cfg, loop, client = life.cfg, life.loop, life.client
    while not life.unit.should_stop(client, life.stop) and (cfg.steps == 0 or loop.stats.steps < cfg.steps):
        if client.fenced:
            _LOG.error(str(client.fenced))
            client.close(leave=False)
            return False
        life.sync_client.hit_failpoint("learner.inner_step")  # fault tests only: `stall` hangs the loop here
        loss = loop.step()
        life.liveness.beat()
        if loop.stats.steps == 1 + loop.stats.resumed_from_step:
            life.startup.mark("first_step")  # compiled (or loaded from the compilation cache) and run
            _LOG.info("first inner step", extra={"fields": {"startup": life.startup.report()}})
            # The train step is compiled: a prompt exit after SIGTERM, shorter full collections.
            runtime.freeze_start_up_objects()
        if life.snapshots is not None and life.snapshots.due(loop.stats.steps):
            _write_snapshot(life)
        if loop.stats.steps % cfg.log_every_steps == 0:
            _LOG.info(
                "step",
                extra={"fields": {"learner": cfg.learner_id, "step": loop.stats.steps, "loss": round(float(loss), 4),
                                  "step_s": round(loop.stats.step_time_ema.value or 0.0, 3),
                                  "held": {f: v for f, (_, v) in sorted(loop.held.items())}}},
            )
    return True


def _write_snapshot(life: _Life) -> None:
    life.snapshots.write(lambda: life.loop.export_snapshot(life.snapshots.identity, life.sampler.position(), life.shard))


def _finish(life: _Life, started: float) -> dict:
    """The end of training merges everything: the last progress on every fragment goes out and the
    learner waits (bounded) until the global model holds it; then queued uploads drain, the client
    leaves and the last snapshot is written. Returns the life's summary."""
    cfg, loop, client = life.cfg, life.loop, life.client
    finish_started = time.monotonic()
    all_merged = loop.finish(timeout_s=cfg.finish_timeout_s) if not client.fenced else False
    finish_s = time.monotonic() - finish_started
    client.flush(timeout_s=min(10.0, cfg.retry_bound_s))
    client.close(leave=True)
    if life.snapshots is not None:  # a restart continues the optimizer state and the data order
        _write_snapshot(life)
    return {
        "learner_id": cfg.learner_id, "incarnation": life.incarnation, "data_shard": life.shard,
        "steps": loop.stats.steps,
        "tokens": loop.stats.tokens, "first_loss": loop.stats.first_loss, "last_loss_ema": loop.stats.loss_ema.value,
        "wall_s": round(time.monotonic() - started, 3), "uploads_queued": loop.stats.uploads_queued,
        "fragments_applied": loop.stats.fragments_applied, "client": vars(client.stats),
        "sync_mode": life.sync_mode, "wait_s": round(loop.stats.wait_s, 3),
        "compute_s": round(loop.stats.compute_s, 3),
        "barrier_resends": loop.stats.barrier_resends,
        "merged_contributions": loop.stats.merged_contributions,
        "resumed_from_step": loop.stats.resumed_from_step, "tokens_all_lives": loop.tokens_before + loop.stats.tokens,
        "snapshots": life.snapshots.summary() if life.snapshots is not None else None,
        "unmerged_contributions": loop.stats.unmerged_contributions,
        "finish": {"all_merged": all_merged, "wait_s": round(finish_s, 3)},
        "startup": life.startup.report(),  # this life's start, up to its first inner step
        # Why training stopped: the run's token budget (the syncer said so), or a signal / --steps.
        "budget_reached": client.budget_reached,
        "tokens_per_step": life.sampler.tokens_per_batch, "params_sha256": distributed_lib.params_sha256(loop.params),
        # The global values this learner holds, per fragment: compare with the syncer's published_sha256.
        "held": {str(f): {"version": v, "sha256": fragments_lib.fragment_sha256(loop.global_copy[f])}
                 for f, (_, v) in sorted(loop.held.items())},
        "held_instances": {str(f): inst for f, (inst, _) in sorted(loop.held.items())},  # the syncer lives
        **life.unit.describe(),
    }


def _resume(cfg: config_lib.LearnerConfig, loop: loop_lib.LearnerLoop, run_config, sampler, shard: int,
            sync_mode: str) -> snapshot_lib.Snapshotter | None:
    """With --state-dir: resumes the loop from this learner's snapshot when it belongs to this run,
    model and fragment plan (else warns and starts from the global model), journals contributions
    from now on, and returns what writes the next snapshots."""
    if not cfg.state_dir:
        return None
    if sync_mode != rounds_lib.DECOUPLED or cfg.num_processes > 1:
        _LOG.warning(f"--state-dir ignored: resume supports single-process learners in decoupled mode "
                     f"(this is {sync_mode}, {cfg.num_processes} process(es))")
        return None
    store = snapshot_lib.SnapshotStore(cfg.state_dir)
    snapshots = snapshot_lib.Snapshotter(store, snapshot_lib.run_identity(run_config, cfg.learner_id),
                                         every_steps=cfg.snapshot_every_steps, interval_s=cfg.snapshot_interval_s)
    snap = store.load_matching(snapshots.identity)
    if snap is not None:
        try:
            resumed = loop.resume(snap, store.sent_since(snap.step))
        except snapshot_lib.SnapshotMismatch as exc:
            _LOG.warning(f"not resuming: {exc}; starting from the global model (the next snapshot replaces it)")
        else:
            snapshots.restart_from(snap.step)
            try:
                if snap.data_shard != shard:
                    raise ValueError(f"it was taken on data shard {snap.data_shard}, this life trains {shard}")
                sampler.seek(snap.sampler)
                resumed["data_position"] = "continued"
            except ValueError as exc:
                _LOG.warning(f"resumed, but not the data position: {exc}; a fresh data order")
                resumed["data_position"] = "fresh"
            _LOG.info("resumed from snapshot", extra={"fields": {
                **resumed, "age_s": round(time.time() - snap.written_at_unix_s, 1), "path": str(store.path)}})
    loop.set_before_upload(store.note_sent)
    return snapshots


def _continue_schedule(cfg: config_lib.LearnerConfig, loop: loop_lib.LearnerLoop, start_step: int) -> int | None:
    """Sets the inner LR schedule's step where the learner's earlier lives left it: a resumed
    snapshot's restored count, else ``start_step`` (the syncer's count of those lives' steps; Adam's
    fresh moments keep their bias-correction count 0), with the decay ending where this life's
    --steps end. Returns the schedule's step (None: the optimizer has no schedule state)."""
    resumed = loop.stats.resumed_from_step > 0
    count = inner_lib.schedule_count(loop.opt_state) if resumed else start_step
    if count is None:
        return None
    offset = max(count - loop.stats.steps, 0)  # the schedule's step when this life's counter was 0
    loop.opt_state = inner_lib.continue_schedule(loop.opt_state, cfg.inner_optimizer(schedule_offset=offset),
                                                 None if resumed else count)
    return count


def _upload_encoder(cfg: config_lib.LearnerConfig):
    """The upload quantizer --upload-encoder asks for. The host codec's numba kernels take ~0.5
    CPU-s to import and load at every process start; jax_codec's programs come from the
    compilation cache in ~0.15 CPU-s but compile per fragment size when the cache is cold."""
    if cfg.upload_encoder == "jax":
        from ddiloco.wire import jax_codec

        return jax_codec.encode
    # Loaded while the model compiles, not at the first upload.
    threading.Thread(target=codec_lib.warm_up, name="codec-warm-up", daemon=True).start()
    return codec_lib.encode


def _initial_fragments(run_config) -> dict[int, np.ndarray]:
    """The run's initial fragments as this learner computes them (the syncer initializes the same
    model with the same seed); the sync client skips downloading those whose hash matches."""
    model = models.get_model(run_config.model_name, json.loads(run_config.model_config_json))
    # One jitted program (cached with the others under --compilation-cache-dir), not one eager
    # dispatch per initializer op: ~1.3 CPU-s less at each start of the tiny model.
    params = jax.jit(model.init)(jax.random.PRNGKey(run_config.init_seed))
    plan = serde.plan_from_proto(run_config.fragments, run_config.sync_period_steps)
    return {f.fragment_id: fragments_lib.flatten_fragment(params, f) for f in plan.fragments}

def main(argv: list[str] | None = None, client_factory: ClientFactory = sharded_lib.ShardedSyncClient) -> int:
    cfg = config_lib.parse_learner_config(sys.argv[1:] if argv is None else argv, os.environ, socket.gethostname())
    # Plaintext must be asked for: refuse to start with neither a CA nor --insecure.
    security_lib.require_choice("ddiloco learner", cfg.client_security)
    logs.setup_logging(cfg.log_level, json_lines=cfg.json_logs)
    return run(cfg, client_factory)


if __name__ == "__main__":
    sys.exit(main())
