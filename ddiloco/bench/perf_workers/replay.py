"""The scale section's replay process: `spec["ids"]` lightweight learner identities
(`ddiloco.bench.perf_identity`) against one syncer, each joining, watching fragments, reporting
progress every step and uploading the captured pseudo-gradients on the default fragment schedule,
based on the version it last heard of, as a real learner does, for `spec["seconds"]`.

`python -m ddiloco.bench.perf_workers.replay SPEC_JSON RESULT_PATH` (`perf_workers.run_job`):
the result counts uploads (accepted, refused by status code, skipped), learner-steps of work and
every upload's latency.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import numpy as np

from ddiloco.bench import perf_identity
from ddiloco.bench import perf_workers
from ddiloco.learner import client as client_lib
from ddiloco.rpc import channel as channel_lib
from ddiloco.rpc import errors as errors_lib
from ddiloco.v1 import common_pb2, syncer_pb2_grpc


async def _send(ctx: dict, ident: perf_identity.Identity, fid: int, base: int, steps: int, state: dict,
                final: bool) -> None:
    """One replay upload with the learner's real client; on acceptance its steps are merged work
    and the syncer's back-pressure hint holds the fragment's next upload. `final`: the learner's
    last contribution of the fragment (the syncer merges its round without waiting for it)."""
    info, chunks = ctx["payloads"][fid]
    msgs = ident.messages(fid, base, info, chunks, steps=steps, tokens=steps * 2048, final=final)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        # The base stays what the watch stream delivered: a real learner cannot rebase on a
        # version it has not received (the response's current_version).
        resp = await client_lib.send_upload(ctx["stub"], msgs, 30, pipeline_bytes=ident.pipeline_bytes)
        ctx["counts"]["accepted"] += 1
        ctx["work"]["accepted_steps"] += steps
        state["pending"][fid] -= steps
        ident.sent_base[fid] = base
        if resp.next_upload_after_s > 0:
            ctx["work"]["slowed"] += 1
            state["hold"][fid] = loop.time() + resp.next_upload_after_s
    except grpc.aio.AioRpcError as exc:  # the work stays pending: it goes in the next contribution
        ctx["counts"]["refused"] += 1
        ctx["refusals"][exc.code().name] = ctx["refusals"].get(exc.code().name, 0) + 1
        if errors_lib.reason_of(exc) == "already_pending":  # the open round has its last one: wait for it
            ident.sent_base[fid] = base
    ctx["latencies"].append(loop.time() - t0)


def _try_send(ctx: dict, ident: perf_identity.Identity, fid: int, state: dict, final: bool) -> bool:
    """Starts an upload of the fragment's pending work if the replay learner may send one now."""
    base = ident.versions.get(fid, 0)
    if fid in state["sending"] or state["pending"][fid] <= 0 or ident.sent_base.get(fid) == base:
        return False  # one upload per fragment in flight, one contribution per base version
    if not final and asyncio.get_running_loop().time() < state["hold"].get(fid, 0.0):
        return False  # back-pressure: this period's work joins the next contribution
    task = asyncio.create_task(_send(ctx, ident, fid, base, state["pending"][fid], state, final))
    state["sending"][fid] = task
    task.add_done_callback(lambda _t: state["sending"].pop(fid, None))
    return True


async def _learner(ctx: dict, spec: dict, index: int, stop: asyncio.Event) -> None:
    """One replay learner until `stop`, then its pending work flushed (bounded wait)."""
    fids, period, step_s, work = ctx["fids"], spec["sync_period_steps"], spec["step_s"], ctx["work"]
    ident = perf_identity.Identity(ctx["stub"], f"replay-{spec['first']+index}")
    await ident.join(30)
    watch = asyncio.create_task(ident.watch(stop, 60))
    step = index % period  # learners are not in phase
    progress = asyncio.create_task(ident.report_progress(stop, step_s, lambda: step, timeout_s=10))
    loop = asyncio.get_running_loop()
    next_at = loop.time() + (index % 16) * step_s / 16
    state = {"pending": dict.fromkeys(fids, 0), "hold": {}, "sending": {}}
    try:
        while not stop.is_set():
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            next_at += step_s
            step += 1
            for fid in fids:
                if stop.is_set():
                    break
                due = step % period == ctx["offsets"][fid]
                if due:
                    state["pending"][fid] += period  # one period of work on this fragment
                    work["offered_steps"] += period
                if not _try_send(ctx, ident, fid, state, final=False) and due:
                    ctx["counts"]["skipped"] += 1  # held, in flight, or the base did not move: kept
        # The end of the run: what is pending goes out once its base allows (bounded wait).
        deadline = loop.time() + spec.get("flush_s", 10.0)
        while loop.time() < deadline and (state["sending"] or any(state["pending"].values())):
            for fid in fids:
                work["final_sent"] += _try_send(ctx, ident, fid, state, final=True)
            await asyncio.sleep(0.05)
        for task in list(state["sending"].values()):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 35)
        work["pending_steps_end"] += sum(state["pending"].values())
    finally:
        watch.cancel()
        progress.cancel()


def _captured_payloads(spec: dict) -> dict[int, tuple]:
    """The first captured pseudo-gradient of each fragment, encoded and chunked."""
    with np.load(spec["captured"]) as data:
        deltas = {}
        for key in sorted(data.files):
            fid = int(key.split("_")[0][1:])
            deltas.setdefault(fid, data[key])
    payloads = perf_identity.prepare_payloads(deltas, spec["chunk_size"])
    return {fid: (common_pb2.PayloadInfo.FromString(info.SerializeToString()), chunks)
            for fid, (info, chunks) in payloads.items()}


async def replay(spec: dict) -> dict:
    """Runs the replay learners for `spec["seconds"]`; their counts and latencies."""
    payloads = _captured_payloads(spec)
    channel = channel_lib.aio_channel(spec["address"], None)
    fids = sorted(payloads)
    period = spec["sync_period_steps"]
    counts = {"accepted": 0, "refused": 0, "skipped": 0}
    work = {"offered_steps": 0, "accepted_steps": 0, "pending_steps_end": 0, "slowed": 0, "final_sent": 0}
    ctx = {"stub": syncer_pb2_grpc.SyncerStub(channel), "payloads": payloads, "counts": counts, "refusals": {},
           "work": work, "latencies": [], "fids": fids,
           "offsets": {fid: (fid * period) // len(fids) for fid in fids}}
    stop = asyncio.Event()
    tasks = [asyncio.create_task(_learner(ctx, spec, i, stop)) for i in range(spec["ids"])]
    await asyncio.sleep(spec["seconds"])
    stop.set()
    await asyncio.wait(tasks, timeout=spec.get("flush_s", 10.0) + 40)
    for t in tasks:
        t.cancel()
    await channel.close()
    # What the schedule asked for: one upload per fragment every sync period per identity.
    offered = round(spec["ids"] * len(fids) * spec["seconds"] / (spec["step_s"] * period))
    return {"latencies": ctx["latencies"], "refusals": ctx["refusals"], "offered": offered, **counts, **work}


if __name__ == "__main__":
    perf_workers.run_job(lambda spec: asyncio.run(replay(spec)))
