"""The overlap section of `ddiloco bench perf`: a real learner (the LearnerLoop and SyncClient of
``services.learner``), trained in this process against a real syncer process, and the share of the
training thread's wall time spent in communication work.

Four runs on one syncer: a learner that never hears from the syncer (twice, the faster kept), one
with the default configuration (its uploads are captured: the pseudo-gradients the codec and scale
sections replay), and one through a TCP proxy (``ddiloco.chaos.proxy``) capped at the bandwidth the
configuration needs. JAX is imported on first use, after `perf.run` has set this process's XLA_FLAGS.
"""

from __future__ import annotations

import json
import os
import pathlib
import threading
import time
from collections.abc import Callable

import numpy as np

from ddiloco.algo import fragments as fragments_lib
from ddiloco.bench import perf_common as common
from ddiloco.chaos import proxy as proxy_lib
from ddiloco.cli import service_names
from ddiloco.data import corpus
from ddiloco.learner import client as client_lib
from ddiloco.learner import ports as ports_lib
from ddiloco.rpc import security as security_lib
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde

DEFINITION = (
    "share of the training thread's wall time spent in communication work: folding in arrived "
    "fragments (apply_updates), extracting pseudo-gradients and queueing uploads (_contribute), "
    "building and handing over progress reports. The loop never blocks on the network by design.")


class _Timed:
    """Wraps a callable and accumulates the wall time spent in it."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, *args, **kwargs):
        t0 = common.now()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += common.now() - t0
            self.calls += 1


def _thread_cpu_s() -> dict[int, float]:
    """CPU seconds (user + system) of every thread of this process, by native thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in pathlib.Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError, IndexError):  # a thread that just ended
            continue
    return out


def _start_loop(client: client_lib.SyncClient, run_config, batch_size: int, null_client: bool, shard: int,
                compiled: dict | None):
    """The learner's loop on the run's model and plan, holding the global parameters; with
    `null_client`, a loop whose client never delivers anything (it then does no communication
    work). Returns (loop, the loop's client, plan)."""
    from ddiloco import models
    from ddiloco.learner import loop as loop_lib

    train_lib = service_names.load("services.learner.train")
    model = models.get_model(run_config.model_name, json.loads(run_config.model_config_json))
    plan = serde.plan_from_proto(run_config.fragments, run_config.sync_period_steps)
    docs = corpus.load_stdlib_documents(max_bytes=2 << 20)
    split = corpus.split_corpus(docs, 4, 0.05, source_name=corpus.STDLIB_SOURCE_NAME)
    sampler = corpus.BatchSampler(split.shards[shard], batch_size, model.seq_len, seed=shard)
    optimizer = train_lib.make_inner_optimizer(train_lib.InnerOptConfig())
    params = {spec.name: np.zeros(spec.shape, np.float32) for spec in model.tensor_specs()}
    loop_client = ports_lib.NullSyncClient() if null_client else client
    key = run_config.model_config_json
    if compiled is None or key not in compiled:
        train_step = train_lib.TrainStep(model, optimizer)
        if compiled is not None:
            compiled[key] = train_step
    else:
        train_step = compiled[key]
    loop = loop_lib.LearnerLoop(plan=plan, params=params, train_step=train_step,
                                sampler=sampler, client=loop_client, learner_id=client.cfg.learner_id,
                                incarnation=client.cfg.incarnation, mixing_alpha=run_config.mixing_alpha,
                                on_arrival=run_config.on_arrival, round_trigger=run_config.round_trigger)
    if null_client:  # start from the global parameters, then never hear from the syncer again
        for update in client.take_updates():
            frag = plan.fragments[update.fragment_id]
            for name, arr in fragments_lib.unflatten_fragment(update.values, frag).items():
                loop.params[name] = loop._train_step.place(name, arr)
    else:
        loop.apply_updates()
    return loop, loop_client, plan


def _capture_uploads(client: client_lib.SyncClient, capture: dict) -> None:
    """Keeps a copy of every pseudo-gradient the client is handed to upload, by fragment."""
    original_submit = client.submit_upload

    def capturing_submit(job):
        capture.setdefault(job.fragment_id, []).append(np.array(job.delta, copy=True))
        original_submit(job)

    client.submit_upload = capturing_submit


def _timed_steps(loop, loop_client, client: client_lib.SyncClient, steps: int, syncer_pid: int | None) -> dict:
    """Runs `steps` steps with the loop's communication work timed; wall and CPU time shares."""
    # Decoupled mode: a contribution is extracted and queued by _contribute (on the syncer's call).
    timers = {"apply_updates": _Timed(loop.apply_updates), "queue_upload": _Timed(loop._contribute),
              "progress_request": _Timed(loop.progress_request),
              "set_progress": _Timed(loop_client.set_progress)}
    loop.apply_updates = timers["apply_updates"]
    loop._contribute = timers["queue_upload"]
    loop.progress_request = timers["progress_request"]
    loop_client.set_progress = timers["set_progress"]
    stats0 = dict(vars(client.stats))
    training_tid = threading.get_native_id()
    cpu0, syncer0 = _thread_cpu_s(), common.process_cpu_s(syncer_pid) if syncer_pid else 0.0
    started = common.now()
    for _ in range(steps):
        loop.step()
    wall = common.now() - started
    cpu1, syncer1 = _thread_cpu_s(), common.process_cpu_s(syncer_pid) if syncer_pid else 0.0
    stats1 = dict(vars(client.stats))
    training_cpu = cpu1.get(training_tid, 0.0) - cpu0.get(training_tid, 0.0)
    other_cpu = sum(v - cpu0.get(k, 0.0) for k, v in cpu1.items() if k != training_tid)
    comm = sum(t.seconds for t in timers.values())
    return {
        "steps": steps, "wall_s": wall, "step_s": wall / steps, "comm_s": comm, "comm_share": comm / wall,
        # CPU seconds per step: the training thread, the learner's other threads (sync client,
        # its codec workers, XLA), and the syncer process: what competes for the 2 cores.
        "training_thread_cpu_per_step_s": training_cpu / steps,
        "other_threads_cpu_per_step_s": other_cpu / steps,
        "syncer_cpu_per_step_s": (syncer1 - syncer0) / steps,
        "by_part_s": {k: t.seconds for k, t in timers.items()},
        "uploads_queued": timers["queue_upload"].calls, "fragments_applied": loop.stats.fragments_applied,
        "client": {k: stats1[k] - stats0.get(k, 0) for k in stats1 if isinstance(stats1[k], (int, float))},
    }


def _learner_run(target: str, steps: int, warmup: int, capture: dict | None, batch_size: int,
                 null_client: bool = False, shard: int = 0, compiled: dict | None = None,
                 syncer_pid: int | None = None) -> dict:
    """Trains one in-process learner for `steps` steps; returns the time shares. `compiled`
    keeps the jitted train step between runs of the same model (one compilation)."""
    client = client_lib.SyncClient(client_lib.ClientConfig(
        target=target, learner_id=f"bench-learner-{shard}", incarnation=time.time_ns(), region="bench",
        tokens_per_step=0, security=security_lib.ClientSecurity(insecure=True),
    ))
    run_config = client.start(120.0)
    try:
        loop, loop_client, plan = _start_loop(client, run_config, batch_size, null_client, shard, compiled)
        if capture is not None:
            _capture_uploads(client, capture)
        # As the learner's __main__ does at start-up (in a thread there): the host codec's
        # compiled kernels are loaded before training, not by the first upload in the timed steps.
        codec_lib.warm_up()
        for _ in range(warmup):
            loop.step()
        return _timed_steps(loop, loop_client, client, steps, syncer_pid) | {
            "fragment_numels": [f.numel for f in plan.fragments], "sync_period_steps": plan.sync_period_steps,
            "upload_codec": serde.codec_from_proto(run_config.upload_codec),
            "download_codec": serde.codec_from_proto(run_config.download_codec),
            "block_size": run_config.upload_block_size,
        }
    finally:
        client.close(leave=True, timeout_s=5.0)


def needed_bandwidth(run: dict) -> dict:
    """Bytes per second each direction needs at the measured step time, from the configuration:
    every fragment goes up (upload codec) and comes down (download codec) once per H steps."""
    up = sum(codec_lib.expected_raw_size_bytes(run["upload_codec"], n, run["block_size"]) for n in run["fragment_numels"])
    down = sum(codec_lib.expected_raw_size_bytes(run["download_codec"], n, run["block_size"]) for n in run["fragment_numels"])
    per_s = 1.0 / (run["sync_period_steps"] * run["step_s"])
    return {"up_bytes_per_s": up * per_s, "down_bytes_per_s": down * per_s}


def _capped_run(syncer_address: str, cap_bytes_per_s: float, **run_kwargs) -> dict:
    """A learner run through a proxy limited to `cap_bytes_per_s` per direction."""
    host, port = syncer_address.rsplit(":", 1)
    proxy = proxy_lib.FaultProxy("127.0.0.1", host, int(port))
    proxy_port = proxy.start_in_thread()
    try:
        proxy.set(bandwidth_bytes_per_s=cap_bytes_per_s)
        return _learner_run(f"127.0.0.1:{proxy_port}", **run_kwargs) | {"cap_bytes_per_s": cap_bytes_per_s}
    finally:
        proxy.close()


def run_overlap(workdir: pathlib.Path, model: dict, steps: int, warmup: int, batch_size: int, captured_path: pathlib.Path,
                with_cap: bool) -> dict:
    out: dict = {"model": model, "definition": DEFINITION}
    capture: dict = {}
    compiled: dict = {}
    # Rounds opened by the learner's own counter (--round-trigger upload): a contribution every
    # H / P steps from the first step on, so a short timed window always holds the same uploads (with
    # the syncer's schedule they follow its calls; the work per upload is the same).
    with common.running_syncer(workdir, "syncer-overlap", model, ["--round-trigger", "upload"]) as syncer:
        common_kwargs = {"steps": steps, "warmup": warmup, "batch_size": batch_size, "compiled": compiled,
                         "syncer_pid": syncer.pid}
        out["null"] = _learner_run(syncer.address, capture=None, null_client=True, shard=1, **common_kwargs)
        out["default"] = _learner_run(syncer.address, capture=capture, shard=0, **common_kwargs)
        # The null run again: the machine's load changes between runs; keep the faster one.
        again = _learner_run(syncer.address, capture=None, null_client=True, shard=1, **common_kwargs)
        if again["step_s"] < out["null"]["step_s"]:
            out["null"] = again
        need = needed_bandwidth(out["default"])
        out["needed_bandwidth"] = need
        if with_cap:
            out["capped"] = _capped_run(syncer.address, max(need["up_bytes_per_s"], need["down_bytes_per_s"]),
                                        capture=None, shard=2, **common_kwargs)
    arrays = {f"f{fid}_{i}": d for fid, deltas in capture.items() for i, d in enumerate(deltas[-3:])}
    if arrays:
        np.savez(captured_path, **arrays)
    out["captured_fragments"] = len(arrays)
    out["throughput_cost"] = 1.0 - out["null"]["step_s"] / out["default"]["step_s"]
    return out
