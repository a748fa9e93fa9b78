"""`ddiloco bench snapshot`: what a learner's resume snapshot costs (size on disk, time per write).

Builds the learner's own loop (ddiloco.learner.loop) on a model (the default transformer unless
--model-config says otherwise), takes a few inner steps so the optimizer state is real, then writes
the snapshot the way the learner does (Snapshotter.write: host copies of the parameters, the
optimizer state and the held global fragments, safetensors encoding, tmp + fsync + rename +
directory fsync) --writes times into a scratch directory. Reports the file size and the median,
p90 and max seconds per write, and the overhead at the shipped interval as a share of the measured
inner step time. Writes bench/results/snapshot.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time

import jax
import numpy as np

from ddiloco import models
from ddiloco.algo import fragments as fragments_lib
from ddiloco.bench import results as results_lib
from ddiloco.data import corpus
from ddiloco.learner import loop as loop_lib
from ddiloco.learner import ports
from ddiloco.learner import snapshot as snapshot_lib
from ddiloco.cli import service_names

learner_config = service_names.load("services.learner.config")
train_lib = service_names.load("services.learner.train")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-config", default="{}", help="transformer config JSON ({} = the default, 'small')")
    parser.add_argument("--num-fragments", type=int, default=4, help="P (the syncer's default)")
    parser.add_argument("--steps", type=int, default=5, help="inner steps before measuring (optimizer state warm)")
    parser.add_argument("--writes", type=int, default=10, help="snapshot writes to time")
    parser.add_argument("--state-dir", default="", help="where to write (default: a temporary directory)")
    parser.add_argument("--out-dir", default=str(results_lib.DEFAULT_OUT_DIR))


def _loop(model, cfg: learner_config.LearnerConfig, num_fragments: int) -> tuple[loop_lib.LearnerLoop, object]:
    plan = fragments_lib.plan_fragments(model.tensor_specs(), num_fragments, 8)
    params = {k: np.asarray(v) for k, v in jax.jit(model.init)(jax.random.PRNGKey(0)).items()}
    step = train_lib.TrainStep(model, train_lib.make_inner_optimizer(cfg.inner_optimizer()))
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, size=1 << 20).astype(np.uint16)
    sampler = corpus.BatchSampler(tokens, cfg.batch_size, model.seq_len, seed=0)
    loop = loop_lib.LearnerLoop(plan=plan, params=params, train_step=step, sampler=sampler,
                                client=ports.NullSyncClient(), learner_id="bench", incarnation=1)
    # The learner holds every global fragment (the held copy is half the file's parameters).
    loop.global_copy = {f.fragment_id: fragments_lib.flatten_fragment(params, f) for f in plan.fragments}
    loop.held = {f.fragment_id: ("bench", 0) for f in plan.fragments}
    return loop, sampler


def run(args: argparse.Namespace) -> int:
    cfg = learner_config.LearnerConfig()
    model = models.get_model("transformer", json.loads(args.model_config))
    loop, sampler = _loop(model, cfg, args.num_fragments)
    loop.step()  # compiles
    started = time.monotonic()
    for _ in range(args.steps):
        loop.step()
    step_s = (time.monotonic() - started) / max(1, args.steps)
    identity = snapshot_lib.RunIdentity("bench", models.model_fingerprint(model), "bench", "bench")
    with tempfile.TemporaryDirectory() as scratch:
        store = snapshot_lib.SnapshotStore(args.state_dir or scratch)
        snapshots = snapshot_lib.Snapshotter(store, identity, every_steps=cfg.snapshot_every_steps,
                                             interval_s=cfg.snapshot_interval_s)
        times = [snapshots.write(lambda: loop.export_snapshot(identity, sampler.position(), 0)).seconds
                 for _ in range(args.writes)]
        size = store.path.stat().st_size
    num_params = sum(int(np.prod(s.shape)) for s in model.tensor_specs())
    median_s = statistics.median(times)
    result = {
        "what": "learner snapshot (ddiloco/learner/snapshot.py) written by Snapshotter.write, as the learner does",
        "model": model.name, "model_config": model.config, "params": num_params,
        "file_bytes": size, "bytes_per_param": round(size / num_params, 2),
        "writes": len(times), "median_s": round(median_s, 4),
        "p90_s": round(sorted(times)[int(0.9 * (len(times) - 1))], 4), "max_s": round(max(times), 4),
        "inner_step_s": round(step_s, 4), "snapshot_every_steps": cfg.snapshot_every_steps,
        "snapshot_interval_s": cfg.snapshot_interval_s,
        # One write per interval: every N steps (or 60 s if the steps are slower than that).
        "overhead_share": round(median_s / (median_s + min(cfg.snapshot_every_steps * step_s,
                                                           cfg.snapshot_interval_s)), 5),
        "provenance": results_lib.provenance(),
    }
    md = "\n".join([
        "# Learner snapshot cost (`ddiloco bench snapshot`)", "",
        f"The learner's resume snapshot of the `{model.name}` model ({num_params:,} parameters, config "
        f"`{json.dumps(model.config)}`), written {len(times)} times by the learner's own code path (host copies + "
        "safetensors encoding + tmp/fsync/rename/directory fsync), after a few inner steps.", "",
        results_lib.markdown_table(
            ["file", "bytes / parameter", "median write", "p90", "max", "inner step", "overhead at the default interval"],
            [[f"{size / 2**20:.1f} MiB", f"{size / num_params:.2f}", f"{median_s * 1000:.0f} ms",
              f"{result['p90_s'] * 1000:.0f} ms", f"{result['max_s'] * 1000:.0f} ms", f"{step_s * 1000:.0f} ms",
              f"{100 * result['overhead_share']:.2f} % (every {cfg.snapshot_every_steps} steps / "
              f"{cfg.snapshot_interval_s:g} s)"]]),
        "",
        "The file holds the local parameters, the held global fragments (the same size), AdamW's two moments "
        "and counts, and the pending contributions: about 4-5 float32 copies of the model.", "",
        results_lib.provenance_markdown(result["provenance"]),
    ])
    json_path, md_path = results_lib.write_result(pathlib.Path(args.out_dir), "snapshot", result, md)
    print(md)
    print(f"wrote {json_path} and {md_path}")
    return 0
