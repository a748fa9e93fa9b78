"""The scale section of `ddiloco bench perf`: a syncer of 1..N fragment shards (processes) and
8..64 lightweight learners, driven by a few replay processes (`ddiloco.bench.perf_workers.replay`,
which send each fragment to its owner shard), a fresh syncer per learner count and shard count:
merges per second, upload and merge latency p50/p99, uploads accepted and refused (by the syncer's
reason) against those the schedule offered, and each shard's peak RSS (VmHWM); the speed-up of N
shards over one at each learner count. The saturation levels (`run_saturation`) run each shard
count at a step short enough that the schedule offers more rounds than one shard merges: merges/s
and uploads accepted per second, each shard's and the replay processes' CPU over the measurement
window, and the shards' CPU seconds per merge and per upload. The model-size rows (`run_sizes`) run the same level on
synthetic models of a given number of parameters (0.5M, 100M, 1B: `model_for_params`).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import pathlib
import time
from collections.abc import Sequence

import numpy as np

from ddiloco.algo import fragments as fragments_lib
from ddiloco.bench import perf_common as common
from ddiloco.bench.perf_workers import replay as replay_lib
from ddiloco.cli import cluster as cluster_lib
from ddiloco.rpc import channel as channel_lib
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc

_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9}
NUM_FRAGMENTS = 4  # the syncer's default P
SYNC_PERIOD_STEPS = 8  # H of the replay learners (the syncer's default)
# How long a replay learner, at the end of its timed run, keeps sending what it holds and waits
# for it to merge: a real learner's default --finish-timeout-s (its finish waits that long).
FLUSH_S = 30.0
_LEVELS = itertools.count()  # names every level's processes apart within one invocation


def parse_params(text: str) -> int:
    """A parameter count as the flags take it: "0.5M", "100M", "1B", "30k" or a plain number."""
    value = text.strip().lower()
    scale = _SUFFIXES.get(value[-1:], 0.0)
    number = float(value[:-1] if scale else value)
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"parameter count {text!r}: give a positive number, optionally with k, M or B")
    return int(round(number * (scale or 1.0)))


def params_label(params: int) -> str:
    """A row's name for a model size: 478,464 -> "0.5M", 99.7M -> "100M", 1.02B -> "1.0B"."""
    if params >= 1e9:
        return f"{params / 1e9:.1f}B"
    if params >= 10e6:
        return f"{params / 1e6:.0f}M"
    if params >= 1e5:
        return f"{params / 1e6:.1f}M"
    return f"{params / 1e3:.0f}k"


def model_for_params(params: int) -> dict:
    """A transformer config (byte vocabulary, T = 128, d_ff = 4 d) with about `params` parameters:
    the "tiny" preset up to 100k, "small" (478k, the default model) up to 2M, else blocks of
    width d (a multiple of 64, heads of 64) and depth L with 12 d^2 L ~ params."""
    if params <= 100_000:
        return {"preset": "tiny"}
    if params <= 2_000_000:
        return {"preset": "small"}
    layers = 4 if params < 20e6 else 14 if params < 500e6 else 16
    d_model = max(64, 64 * round(math.sqrt(params / (12 * layers)) / 64))
    return {"preset": "small", "d_model": d_model, "n_layers": layers, "n_heads": d_model // 64, "d_ff": 4 * d_model}


def fragment_numels(model: dict) -> dict[int, int]:
    """The values of each of the model's default fragments, by fragment id."""
    from ddiloco import models  # JAX: after perf.run has set XLA_FLAGS

    plan = fragments_lib.plan_fragments(models.get_model("transformer", model).tensor_specs(), NUM_FRAGMENTS, 8)
    return {f.fragment_id: f.numel for f in plan.fragments}


def synthetic_capture(model: dict, path: pathlib.Path) -> None:
    """Random pseudo-gradients (std 1e-4) of each of the model's default fragments, saved as the
    overlap section saves captured ones."""
    rng = np.random.default_rng(0)
    np.savez(path, **{f"f{fid}_0": (rng.standard_normal(numel) * 1e-4).astype(np.float32)
                      for fid, numel in fragment_numels(model).items()})


def _start_replays(workdir: pathlib.Path, syncer_address: str, payload: dict, count: int, seconds: float,
                   step_s: float, processes: int, tag: str) -> list[cluster_lib.ServiceProcess]:
    """`count` replay learners spread over `processes` replay processes, started. `payload`: the
    spec's "captured" path or "synthetic_numels"."""
    per = [count // processes + (1 if i < count % processes else 0) for i in range(processes)]
    procs = []
    first = 0
    for i, n in enumerate(per):
        if n == 0:
            continue
        spec = {"address": syncer_address, **payload, "ids": n, "first": first, "seconds": seconds,
                "step_s": step_s, "sync_period_steps": SYNC_PERIOD_STEPS, "chunk_size": 512 * 1024, "flush_s": FLUSH_S}
        first += n
        name = f"replay-{tag}-{i}"
        spec["running_path"] = str(running_path(workdir, name))
        running_path(workdir, name).unlink(missing_ok=True)
        procs.append(common.start_worker(workdir, name, "ddiloco.bench.perf_workers.replay", spec))
    return procs


def running_path(workdir: pathlib.Path, name: str) -> pathlib.Path:
    """Where a replay process says all its learners have joined (its timed run starts)."""
    return workdir / f"{name}.running"


def wait_running(workdir: pathlib.Path, procs: list, timeout_s: float) -> None:
    """Until every replay process has its learners joined (or has exited, or `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        while (not running_path(workdir, p.name).exists() and p.alive()
               and time.monotonic() < deadline):
            time.sleep(0.05)


def _level(count: int, s0s: list, s1s: list, elapsed_s: float, finals: list, replays: list[dict],
           cpu: dict | None = None) -> dict:
    """One level's figures, from each shard's training state before, during and after, the
    replay processes' results and (`cpu`: "shards0"/"shards1", "replays0"/"replays1", CPU seconds
    of each process at the window's ends) what the processes spent in the window."""
    lat = [m.quorum_wait_s + m.grace_used_s for s1 in s1s for m in s1.recent_merges]
    upload_lat = [x for r in replays for x in r["latencies"]]
    merges = [(s1.outer_steps - s0.outer_steps) / elapsed_s for s0, s1 in zip(s0s, s1s, strict=True)]
    syncer_uploads: dict[str, int] = {}
    for final in finals:
        for key, value in final.uploads.items():
            syncer_uploads[key] = syncer_uploads.get(key, 0) + value
    by_shard: dict[str, int] = {}
    for r in replays:
        for shard, n in r.get("accepted_by_shard", {}).items():
            by_shard[shard] = by_shard.get(shard, 0) + n
    work = {key: sum(r.get(key, 0) for r in replays) for key in
            ("offered_steps", "accepted_steps", "merged_steps", "pending_steps_end", "unmerged_steps_end",
             "slowed", "final_sent")}
    return {
        "learners": count, "shards": len(s0s),
        "merges_per_s": sum(merges), "merges_per_s_by_shard": merges,
        "merge_latency_p50_s": common.percentile(lat, 50), "merge_latency_p99_s": common.percentile(lat, 99),
        "merge_compute_s": sum(s1.sync_time_s for s1 in s1s),
        "upload_latency_p50_s": common.percentile(upload_lat, 50),
        "upload_latency_p99_s": common.percentile(upload_lat, 99),
        "uploads_accepted": sum(r["accepted"] for r in replays), "uploads_refused": sum(r["refused"] for r in replays),
        "uploads_accepted_by_shard": dict(sorted(by_shard.items())),
        "uploads_skipped": sum(r["skipped"] for r in replays),
        "uploads_offered": sum(r["offered"] for r in replays),
        # Work in learner-steps summed over fragments, over the whole run: trained (offered: every
        # step is a step on every fragment), in accepted contributions, merged (in a contribution
        # the learner saw merged: a later version of the fragment arrived) by the end of its finish;
        # at the end, still outside the global model: never accepted (pending) or accepted in a
        # round that had not merged (unmerged); lost: in none of these (0 by construction).
        **work,
        "work_merged_share": work["merged_steps"] / work["offered_steps"] if work["offered_steps"] else 0.0,
        "lost_steps": (work["offered_steps"] - work["merged_steps"] - work["unmerged_steps_end"]
                       - work["pending_steps_end"]),
        # What the shards report merged (their tokens_merged), in replay learner-steps.
        "merged_steps_syncer": sum(f.tokens_merged for f in finals) // replay_lib.TOKENS_PER_STEP,
        "hint_factor_max": max([r.get("hint_factor_max", 1.0) for r in replays], default=1.0),
        "replay_cpu_s": sum(r.get("cpu_s", 0.0) for r in replays),
        "refusals": {code: sum(r["refusals"].get(code, 0) for r in replays)
                     for code in sorted({c for r in replays for c in r["refusals"]})},
        "syncer_uploads": syncer_uploads,
    } | window_figures(s0s, s1s, elapsed_s, cpu)


def window_figures(s0s: list, s1s: list, elapsed_s: float, cpu: dict | None) -> dict:
    """The measurement window's rates and CPU: uploads the shards accepted and slowed (their own
    counters), merges, each shard's and the replay processes' CPU in cores, and the shards' CPU
    seconds per merge and per accepted upload (machine-independent: the work one merge costs)."""
    def delta(key: str) -> int:
        return sum(s1.uploads.get(key, 0) - s0.uploads.get(key, 0) for s0, s1 in zip(s0s, s1s, strict=True))

    merges = sum(s1.outer_steps - s0.outer_steps for s0, s1 in zip(s0s, s1s, strict=True))
    accepted, slowed = delta("accepted"), delta("slowed")
    out = {"window_s": elapsed_s, "window_merges": merges, "window_uploads_accepted": accepted,
           "uploads_accepted_per_s": accepted / elapsed_s if elapsed_s > 0 else 0.0,
           "slowed_share": slowed / accepted if accepted else 0.0}
    if cpu:
        shard_s = [b - a for a, b in zip(cpu["shards0"], cpu["shards1"], strict=True)]
        replay_s = sum(b - a for a, b in zip(cpu["replays0"], cpu["replays1"], strict=True))
        out |= {"shard_cpu_share_by_shard": [x / elapsed_s for x in shard_s],
                "replay_cpu_share": replay_s / elapsed_s,
                "shard_cpu_s_per_merge": sum(shard_s) / merges if merges else 0.0,
                "shard_cpu_s_per_upload": sum(shard_s) / accepted if accepted else 0.0}
    return out


def _cpu_s(procs: list) -> list[float]:
    """CPU seconds of each process so far (0 for one that has exited)."""
    out = []
    for p in procs:
        try:
            out.append(common.process_cpu_s(p.pid))
        except (OSError, ValueError, IndexError):
            out.append(0.0)
    return out


def _measure(syncers: list[cluster_lib.ServiceProcess], procs: list, count: int, seconds: float) -> dict:
    """Merges over the middle of the run, from every shard's training state, then the replays'
    results and every shard's own upload counters (refusals by reason); the CPU every shard and
    replay process spent in that window."""
    probes = [channel_lib.sync_channel(s.address) for s in syncers]
    try:
        stubs = [syncer_pb2_grpc.SyncerStub(p) for p in probes]

        def states(recent_merges: int) -> list:
            return [stub.GetTrainingState(syncer_pb2.GetTrainingStateRequest(recent_merges=recent_merges),
                                          timeout=30).state for stub in stubs]

        # Skip the start-up, joins and first uploads; measure merges over the middle of the run.
        if procs:
            wait_running(procs[0].workdir, procs, 120.0)
        time.sleep(min(2.0, seconds / 4))
        cpu = {"shards0": _cpu_s(syncers), "replays0": _cpu_s(procs)}
        s0s, t0 = states(0), common.now()
        time.sleep(seconds * 0.6)
        s1s, t1 = states(256), common.now()
        cpu |= {"shards1": _cpu_s(syncers), "replays1": _cpu_s(procs)}
        # The replay learners end as real learners do: each finishes (final uploads, then a wait
        # of at most FLUSH_S for its last work to merge) before its process returns its result.
        replays = [common.worker_result(p, timeout_s=seconds + FLUSH_S + 300) for p in procs]
        # What the shards merged once every learner has finished (no further wait: the cross-check
        # of the learners' own count, never above it by more than merges after their deadline).
        return _level(count, s0s, s1s, t1 - t0, states(0), replays, cpu)
    finally:
        for p in probes:
            p.close()


def _run_level(workdir: pathlib.Path, model: dict, payload: dict, count: int, seconds: float, step_s: float,
               processes: int, shards: int, one_at_a_time: bool = False) -> dict:
    tag = f"{next(_LEVELS)}-{count}x{shards}"
    with common.running_syncer_shards(workdir, f"syncer-scale-{tag}", model, shards, ["--liveness-timeout-s", "30"],
                                      one_at_a_time=one_at_a_time) as syncers:
        rss_idle = [common.vm_hwm_bytes(s.pid) for s in syncers]
        procs = _start_replays(workdir, syncers[0].address, payload, count, seconds, step_s, processes, tag)
        try:
            level = _measure(syncers, procs, count, seconds)
        finally:
            for p in procs:
                p.stop(5.0)
        peaks = [common.vm_hwm_bytes(s.pid) for s in syncers]
        rss_now = [_vm_rss_bytes(s.pid) for s in syncers]
        return level | {"syncer_cpu_s_by_shard": [common.process_cpu_s(s.pid) for s in syncers],
                        "syncer_cpu_s": sum(common.process_cpu_s(s.pid) for s in syncers),
                        "shard_peak_rss_bytes": peaks, "shard_rss_before_learners_bytes": rss_idle,
                        "shard_rss_end_bytes": rss_now,
                        # One process's figures (the largest shard's), as before shards.
                        "syncer_peak_rss_bytes": max(peaks), "syncer_rss_before_learners_bytes": max(rss_idle)}


def _vm_rss_bytes(pid: int) -> int:
    """Resident set size of a process now (VmRSS), in bytes; 0 if it cannot be read."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def shard_speedups(levels: list[dict]) -> list[dict]:
    """For each learner count measured with one shard and with more: merges/s of N shards over
    one shard's, uploads accepted (whole run, and per second of the window where measured) and
    the shards' CPU seconds per merge, each beside one shard's."""
    one = {lv["learners"]: lv for lv in levels if lv.get("shards", 1) == 1}

    def ratio(a: float, b: float) -> float:
        return a / b if b > 0 else 0.0

    out = []
    for lv in levels:
        if lv.get("shards", 1) <= 1 or lv["learners"] not in one:
            continue
        base = one[lv["learners"]]
        row = {"learners": lv["learners"], "shards": lv["shards"], "merges_per_s": lv["merges_per_s"],
               "one_shard_merges_per_s": base["merges_per_s"], "ratio": ratio(lv["merges_per_s"], base["merges_per_s"]),
               "uploads_accepted": lv.get("uploads_accepted", 0),
               "one_shard_uploads_accepted": base.get("uploads_accepted", 0),
               "uploads_ratio": ratio(lv.get("uploads_accepted", 0), base.get("uploads_accepted", 0))}
        for key in ("uploads_accepted_per_s", "shard_cpu_s_per_merge", "shard_cpu_s_per_upload"):
            if key in lv and key in base:
                row |= {key: lv[key], f"one_shard_{key}": base[key], f"{key}_ratio": ratio(lv[key], base[key])}
        out.append(row)
    return out


def run_scale(workdir: pathlib.Path, model: dict, captured: pathlib.Path, counts: list[int], seconds: float,
              step_s: float, processes: int, shard_counts: Sequence[int] = (1,)) -> dict:
    """Every learner count at every shard count (shard counts interleaved per learner count, so
    that both see the same machine load), at the default schedule (`step_s`: the measured step)."""
    out = {"model": model, "step_s": step_s, "seconds": seconds, "shard_counts": list(shard_counts), "levels": []}
    for count in counts:
        for shards in shard_counts:
            out["levels"].append(_run_level(workdir, model, {"captured": str(captured)}, count, seconds, step_s,
                                            processes, shards))
    out["speedups"] = shard_speedups(out["levels"])
    return out


def offered_rates(learners: int, step_s: float) -> dict:
    """What the fragment schedule asks for at `step_s`: rounds per second (P / (H x step), the
    most merges/s any number of shards can make) and uploads per second (one per learner per round)."""
    rounds = NUM_FRAGMENTS / (SYNC_PERIOD_STEPS * step_s)
    return {"offered_rounds_per_s": rounds, "offered_uploads_per_s": learners * rounds}


def saturated(level: dict, offered_rounds_per_s: float) -> bool:
    """Whether a level ran at saturation: its merges/s fell short of the schedule's rounds by more
    than 10 % (the shards, not the schedule, set the rate) and the back-pressure gauge was engaged
    (some accepted uploads were slowed)."""
    return level["merges_per_s"] < 0.9 * offered_rounds_per_s and level.get("slowed_share", 0.0) > 0.0


CPU_BOUND_CORES = 0.8  # a shard this busy (cores over the window) is bounded by its own CPU


def cpu_bound(level: dict) -> bool:
    """Whether a saturated level's shards were bounded by their own CPU (one at least
    CPU_BOUND_CORES busy), rather than by what the machine's other load left them."""
    return max(level.get("shard_cpu_share_by_shard", [0.0]), default=0.0) >= CPU_BOUND_CORES


def run_saturation(workdir: pathlib.Path, model: dict, captured: pathlib.Path, learners: int, step_s: float,
                   seconds: float, processes: int, shard_counts: Sequence[int], params: int = 0) -> dict:
    """The scale-out levels: `learners` replay learners at a step time short enough that the
    schedule offers more rounds and uploads than one shard can serve, against each shard count
    in turn (same load): merges/s and uploads accepted per second, every process's CPU, and
    the shards' CPU with the same learners idle (no uploads). `params` > 0: on a synthetic model
    of about that many parameters (`model_for_params`, its fragments' synthetic pseudo-gradients)
    instead of `model` and the captured ones: larger fragments put more of each upload's cost in
    the shard (decode, norms, fold-in, outer step) than in the replay process, which sends bytes
    encoded once."""
    payload: dict = {"captured": str(captured)}
    numels = None
    if params > 0:
        model = model_for_params(params)
        numels = fragment_numels(model)
        payload = {"synthetic_numels": {str(f): n for f, n in numels.items()}}
    out = {"model": model, "step_s": step_s, "seconds": seconds, "learners": learners, "cores": os.cpu_count() or 1,
           "shard_counts": list(shard_counts), **offered_rates(learners, step_s), "levels": []}
    if numels:
        out |= {"params": sum(numels.values()), "fragment_numels": [numels[f] for f in sorted(numels)]}
    for shards in shard_counts:
        # The same learners joined, watching and reporting progress, without uploads: the shards'
        # CPU that does not depend on the work merged (every learner talks to every shard).
        idle = _run_level(workdir, model, payload | {"uploads": False}, learners,
                          max(3.0, seconds / 3), step_s, processes, shards)
        level = _run_level(workdir, model, payload, learners, seconds, step_s, processes, shards)
        out["levels"].append(level | {"saturated": saturated(level, out["offered_rounds_per_s"]),
                                      "cpu_bound": cpu_bound(level),
                                      "idle_shard_cpu_share_by_shard": idle.get("shard_cpu_share_by_shard", []),
                                      "idle_replay_cpu_share": idle.get("replay_cpu_share", 0.0)})
    out["speedups"] = shard_speedups(out["levels"])
    return out


# Peak RSS of one shard, measured at 100M parameters x 4 shards with 4 replay learners (s35, after
# earlier versions are kept as int4 steps and whole-version caches only while used; s34: 92):
# about 0.5 GB of start-up (imports, gRPC, JAX) plus ~77 bytes per parameter the shard OWNS (the
# start-up's whole-model build, values, momentum and published ~12, at the peak of merges: the
# outer step's new values, the merge's sums and held contributions, decodes in flight;
# bench/results/perf-memory-s35.md); each shard owns params / shards.
SHARD_BASE_BYTES = 512 * 2**20
SHARD_PEAK_BYTES_PER_OWNED_PARAM = 77


def memory_needed_bytes(params: int, shards: int) -> int:
    """What a level of a `params`-parameter model with `shards` shards needs at its peak: every
    shard's start-up plus its owned fragments' peak (SHARD_PEAK_BYTES_PER_OWNED_PARAM x params /
    shards), plus the replay processes' encoded payloads (about 1 byte a parameter)."""
    return int(shards * SHARD_BASE_BYTES + params * (SHARD_PEAK_BYTES_PER_OWNED_PARAM + 1))


def _mem_available_bytes() -> int:
    """MemAvailable of /proc/meminfo, in bytes (0 if it cannot be read)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def run_sizes(workdir: pathlib.Path, sizes: list[str], shards: int, learners: int, seconds: float, step_s: float,
              processes: int) -> dict:
    """The model-size rows: one level per size (`parse_params`), `shards` shards and `learners`
    replay learners uploading synthetic pseudo-gradients of that model's fragments. Shards start
    one at a time from 200M parameters (each builds its own fragments' initial values, tensor by
    tensor: one start-up's transient at a time)."""
    rows = []
    for size in sizes:
        params_target = parse_params(size)
        model = model_for_params(params_target)
        numels = fragment_numels(model)
        params = sum(numels.values())
        row = {"size": size, "label": params_label(params_target), "params": params, "model": model,
               "shards": shards, "learners": learners}
        need_bytes, available_bytes = memory_needed_bytes(params, shards), _mem_available_bytes()
        if need_bytes > 0.9 * available_bytes:
            # Not started: the machine would swap or kill processes (it may be shared).
            rows.append(row | {"not_run": f"needs about {need_bytes / 2**30:.1f} GiB at its peak (each shard "
                                          f"~{SHARD_PEAK_BYTES_PER_OWNED_PARAM} bytes per parameter it owns), {available_bytes / 2**30:.1f} GiB available"})
            continue
        level = _run_level(workdir, model, {"synthetic_numels": {str(f): n for f, n in numels.items()}}, learners,
                           seconds, step_s, processes, shards, one_at_a_time=params >= 200e6)
        rows.append(row | level)
    return {"step_s": step_s, "seconds": seconds, "shards": shards, "learners": learners, "rows": rows}
