"""`ddiloco bench checkpoint`: what a checkpoint costs the syncer, to price "commit every merge
before its broadcast" against the default cadence (one checkpoint every 16 merges, off the
broadcast path).

Builds the syncer's state for the default model exactly as `services.syncer` does, starts 1 or 2
real checkpoint stores (separate processes on 127.0.0.1, as `ddiloco up --checkpoint-stores`),
and times, `--reps` times each, the three parts of one checkpoint the syncer's `_Checkpointer`
runs: `SyncerCore.snapshot()`, `checkpointing.encode_snapshot` and the write (every blob to every
store, then the manifest; replicated: the write quorum is 2 of 2). Writes
bench/results/checkpoint-cost.json and .md.

Each repetition checkpoints a new global state, as a run does: the parameters are perturbed
before each snapshot, so every blob is new to the stores (no "already stored" shortcut).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import pathlib
import platform
import statistics
import tempfile
import time

import jax
import numpy as np

from ddiloco import checkpoint_client as checkpoint_client_lib
from ddiloco import checkpoint_replicas as replicas_lib
from ddiloco import models
from ddiloco.algo import fragments as fragments_lib
from ddiloco.cli import cluster as cluster_lib
from ddiloco.rpc import channel as channel_lib
from ddiloco.cli import service_names

checkpointing = service_names.load("services.syncer.checkpointing")
config_lib = service_names.load("services.syncer.config")
core_lib = service_names.load("services.syncer.core")
wire_views = service_names.load("services.syncer.wire_views")

_DEFAULT_OUT = pathlib.Path("bench/results/checkpoint-cost")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-config", default=config_lib.SyncerConfig.model_config,
                        help="the syncer's --model-config (default: the syncer's default model)")
    parser.add_argument("--reps", type=int, default=20, help="checkpoints timed per store count")
    parser.add_argument("--out", default=str(_DEFAULT_OUT), help="writes OUT.json and OUT.md")


def _core(cfg: config_lib.SyncerConfig) -> tuple[core_lib.SyncerCore, object]:
    """The syncer's core at start, built as services.syncer.__main__.serve builds it."""
    model = models.get_model(cfg.model, cfg.model_overrides)
    plan = fragments_lib.plan_fragments(model.tensor_specs(), cfg.num_fragments, cfg.sync_period_steps,
                                        staggered=True)
    params = {k: np.asarray(v, dtype=np.float32) for k, v in model.init(jax.random.PRNGKey(cfg.seed)).items()}
    initial = {f.fragment_id: fragments_lib.flatten_fragment(params, f) for f in plan.fragments}
    run = core_lib.make_run_settings(
        cfg, model_name=model.name, fingerprint=models.model_fingerprint(model),
        model_config_json=json.dumps(dict(model.config), sort_keys=True))
    core = core_lib.SyncerCore(
        run=run, plan=plan, initial_params=initial, settings=core_lib.CoreSettings.of(cfg),
        clock=time.monotonic, wall_clock=time.time)
    return core, checkpointing.describe_run(cfg, wire_views.run_config(core.run, plan), plan)


def _client(addresses: list[str]):
    channels = [channel_lib.aio_channel(a) for a in addresses]
    stores = {a: checkpoint_client_lib.CheckpointClient(ch, timeout=datetime.timedelta(seconds=30))
              for a, ch in zip(addresses, channels)}
    client = stores[addresses[0]] if len(addresses) == 1 else replicas_lib.ReplicatedCheckpointClient(stores)
    return client, channels


async def _time_checkpoints(core, description, addresses: list[str], reps: int, rng) -> dict:
    client, channels = _client(addresses)
    parts: dict[str, list[float]] = {"snapshot_s": [], "encode_s": [], "write_s": [], "total_s": []}
    size_bytes = 0
    try:
        for step in range(1, reps + 1):
            t0 = time.perf_counter()
            snapshot = await core.snapshot()
            snapshot_s = time.perf_counter() - t0
            for fragment in snapshot.fragments:  # a new global state, as after a merge (untimed)
                fragment.params += rng.standard_normal(fragment.params.shape).astype(np.float32) * 1e-3
            t1 = time.perf_counter()
            blobs, metadata = await asyncio.to_thread(checkpointing.encode_snapshot, snapshot, description)
            t2 = time.perf_counter()
            refs = {name: (await client.put_blob(data), len(data)) for name, data in blobs.items()}
            await client.commit_manifest(f"bench-{len(addresses)}", step, refs, metadata)
            t3 = time.perf_counter()
            for key, value in zip(parts, (snapshot_s, t2 - t1, t3 - t2, snapshot_s + t3 - t1)):
                parts[key].append(value)
            size_bytes = sum(len(b) for b in blobs.values())
    finally:
        for ch in channels:
            await ch.close()
    summary = {k: {"median": statistics.median(v), "p95": sorted(v)[max(0, int(0.95 * len(v)) - 1)]}
               for k, v in parts.items()}
    return {"stores": len(addresses), "checkpoint_bytes": size_bytes, "reps": reps, **summary}


def run(args: argparse.Namespace) -> int:
    cfg = config_lib.SyncerConfig(model_config=args.model_config)
    core, description = _core(cfg)
    rng = np.random.default_rng(0)
    results = []
    with tempfile.TemporaryDirectory(prefix="ddiloco-bench-ckpt-") as workdir:
        cluster = cluster_lib.LocalCluster(workdir)
        try:
            stores = [cluster.start_store(index=i) for i in range(2)]
            for count in (1, 2):
                results.append(asyncio.run(_time_checkpoints(
                    core, description, [s.address for s in stores[:count]], args.reps, rng)))
        finally:
            cluster.stop_all(timeout_s=10.0)
    report = {
        "what": "one syncer checkpoint (snapshot + encode + write to every store + manifest), seconds",
        "model_config": args.model_config, "params": sum(f.numel for f in core.plan.fragments),
        "checkpoint_every_merges_default": config_lib.SyncerConfig.checkpoint_every_merges,
        "host": {"machine": platform.machine(), "python": platform.python_version()},
        "unix_s": time.time(), "results": results,
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(_markdown(report))
    print(_markdown(report))
    return 0


def _markdown(report: dict) -> str:
    every = report["checkpoint_every_merges_default"]
    lines = [
        "# Checkpoint cost: commit every merge before its broadcast vs the default cadence",
        "",
        f"`ddiloco bench checkpoint`: model {report['model_config']} ({report['params']:,} parameters), "
        f"{report['results'][0]['reps']} checkpoints per row, real store processes on 127.0.0.1 "
        "(one machine: no network latency). Median (p95) seconds.",
        "",
        "| stores | checkpoint MB | snapshot | encode | write (blobs + manifest) | total | "
        f"added to every broadcast, commit-before-broadcast | per merge at the default cadence (1 in {every}, "
        "in the background) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        def cell(key: str, r: dict = r) -> str:
            return f"{r[key]['median']:.3f} ({r[key]['p95']:.3f})"
        lines.append(
            f"| {r['stores']} | {r['checkpoint_bytes'] / 1e6:.1f} | {cell('snapshot_s')} | {cell('encode_s')} | "
            f"{cell('write_s')} | {cell('total_s')} | {r['total_s']['median']:.3f} s, merges capped at "
            f"{1 / r['total_s']['median']:.1f}/s | {r['total_s']['median'] / every:.4f} s of background work, "
            "0 on the broadcast path |")
    return "\n".join(lines) + "\n"
