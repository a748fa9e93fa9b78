"""The scale section of `ddiloco bench perf`: one syncer process and 8..64 lightweight learners,
driven by a few replay processes (`ddiloco.bench.perf_workers.replay`), a fresh syncer per learner
count: merges per second, upload and merge latency p50/p99, uploads accepted and refused (by the
syncer's reason) against those the schedule offered, and the syncer's peak RSS (VmHWM).
"""

from __future__ import annotations

import pathlib
import time

import numpy as np

from ddiloco.algo import fragments as fragments_lib
from ddiloco.bench import perf_common as common
from ddiloco.cli import cluster as cluster_lib
from ddiloco.rpc import channel as channel_lib
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc


def synthetic_capture(model: dict, path: pathlib.Path) -> None:
    """Random pseudo-gradients (std 1e-4) of each of the model's default fragments, saved as the
    overlap section saves captured ones."""
    from ddiloco import models  # JAX: after perf.run has set XLA_FLAGS

    plan = fragments_lib.plan_fragments(models.get_model("transformer", model).tensor_specs(), 4, 8)
    rng = np.random.default_rng(0)
    np.savez(path, **{f"f{f.fragment_id}_0": (rng.standard_normal(f.numel) * 1e-4).astype(np.float32)
                      for f in plan.fragments})


def _start_replays(workdir: pathlib.Path, syncer_address: str, captured: pathlib.Path, count: int, seconds: float,
                   step_s: float, processes: int) -> list[cluster_lib.ServiceProcess]:
    """`count` replay learners spread over `processes` replay processes, started."""
    per = [count // processes + (1 if i < count % processes else 0) for i in range(processes)]
    procs = []
    first = 0
    for i, n in enumerate(per):
        if n == 0:
            continue
        spec = {"address": syncer_address, "captured": str(captured), "ids": n, "first": first,
                "seconds": seconds, "step_s": step_s, "sync_period_steps": 8, "chunk_size": 512 * 1024,
                "flush_s": 10.0}
        first += n
        procs.append(common.start_worker(workdir, f"replay-{count}-{i}", "ddiloco.bench.perf_workers.replay", spec))
    return procs


def _level(count: int, s0, s1, elapsed_s: float, final, replays: list[dict]) -> dict:
    """One learner count's figures, from the syncer's training state before, during and after,
    and the replay processes' results."""
    lat = [m.quorum_wait_s + m.grace_used_s for m in s1.recent_merges]
    upload_lat = [x for r in replays for x in r["latencies"]]
    return {
        "learners": count,
        "merges_per_s": (s1.outer_steps - s0.outer_steps) / elapsed_s,
        "merge_latency_p50_s": common.percentile(lat, 50), "merge_latency_p99_s": common.percentile(lat, 99),
        "merge_compute_s": s1.sync_time_s,
        "upload_latency_p50_s": common.percentile(upload_lat, 50),
        "upload_latency_p99_s": common.percentile(upload_lat, 99),
        "uploads_accepted": sum(r["accepted"] for r in replays), "uploads_refused": sum(r["refused"] for r in replays),
        "uploads_skipped": sum(r["skipped"] for r in replays),
        "uploads_offered": sum(r["offered"] for r in replays),
        # Work in learner-steps per fragment: trained (offered), in accepted contributions
        # (each in exactly one merge), still pending when the run ended (kept, not sent).
        **{key: sum(r[key] for r in replays) for key in
           ("offered_steps", "accepted_steps", "pending_steps_end", "slowed", "final_sent")},
        "refusals": {code: sum(r["refusals"].get(code, 0) for r in replays)
                     for code in sorted({c for r in replays for c in r["refusals"]})},
        "syncer_uploads": dict(final.uploads),
    }


def _run_level(workdir: pathlib.Path, model: dict, captured: pathlib.Path, count: int, seconds: float, step_s: float,
               processes: int) -> dict:
    with common.running_syncer(workdir, f"syncer-scale-{count}", model, ["--liveness-timeout-s", "30"]) as syncer:
        rss_idle = common.vm_hwm_bytes(syncer.pid)
        procs = _start_replays(workdir, syncer.address, captured, count, seconds, step_s, processes)
        probe = channel_lib.sync_channel(syncer.address)
        try:
            stub = syncer_pb2_grpc.SyncerStub(probe)

            def state(recent_merges: int):
                return stub.GetTrainingState(syncer_pb2.GetTrainingStateRequest(recent_merges=recent_merges),
                                             timeout=10).state

            # Skip the joins and first uploads; measure merges over the middle of the run.
            time.sleep(min(2.0, seconds / 4))
            s0, t0 = state(0), common.now()
            time.sleep(seconds * 0.6)
            s1, t1 = state(256), common.now()
            replays = [common.worker_result(p, timeout_s=seconds + 120) for p in procs]
            # The syncer's own upload counters (refusals by reason: stale, already_pending, busy...).
            level = _level(count, s0, s1, t1 - t0, state(0), replays)
        finally:
            probe.close()
            for p in procs:
                p.stop(5.0)
        return level | {"syncer_cpu_s": common.process_cpu_s(syncer.pid),
                        "syncer_peak_rss_bytes": common.vm_hwm_bytes(syncer.pid),
                        "syncer_rss_before_learners_bytes": rss_idle}


def run_scale(workdir: pathlib.Path, model: dict, captured: pathlib.Path, counts: list[int], seconds: float,
              step_s: float, processes: int) -> dict:
    out = {"model": model, "step_s": step_s, "seconds": seconds, "levels": []}
    for count in counts:
        out["levels"].append(_run_level(workdir, model, captured, count, seconds, step_s, processes))
    return out
