"""The scale section's replay process: `spec["ids"]` lightweight learner identities
(`ddiloco.bench.perf_identity`) against one syncer, each joining, watching fragments, reporting
progress every step and uploading the captured pseudo-gradients on the default fragment schedule,
based on the version it last heard of, as a real learner does, for `spec["seconds"]`.

Fragment shards: `spec["address"]` is shard 0; a replay learner whose Join answer carries a shard
map joins every other shard too (one identity per shard, as ShardedSyncClient opens one session
per shard), watches and reports progress to each, and sends each fragment's uploads to its owner
(`ShardedLearner.of`). Payloads: the captured pseudo-gradients (`spec["captured"]`, an .npz), or
synthetic ones of the sizes `spec["synthetic_numels"]` gives by fragment id (the model-size rows).

A replay learner reports progress at the real client's interval and counts its steps from the
clock (several per wake-up at short step times), so the process stays cheap beside the shards.
Every step is one step of work on every fragment (offered); a fragment's work since its last
contribution goes out at its turn in the schedule, and is merged once the watch delivers a
version after the one its contribution was accepted on (the round that took it has merged).

The end of the timed run is a real learner's finish (`ddiloco.learner.loop.Learner.finish`): it
reports `finished` from then on (the syncer waits for it no more and opens the rounds holding the
last work once nobody trains), contributes all its remaining work on every fragment, marked
final, as soon as each fragment's base allows (work trained after a contribution on the current
version goes out once the next version arrives), and waits until the global model holds all of
it, at most `spec["flush_s"]` (the real learner's --finish-timeout-s). Its watch streams and
progress reports stay open through that wait. What is still outside the global model then is
counted where it is: never accepted (`pending_steps_end`) or accepted in a round not merged
(`unmerged_steps_end`).

`spec["uploads"]` false: the learners join, watch and report progress but never upload (the
shards' fixed cost per learner).

`python -m ddiloco.bench.perf_workers.replay SPEC_JSON RESULT_PATH` (`perf_workers.run_job`):
the result counts uploads (accepted by shard, refused by status code, skipped), work in
learner-steps summed over fragments (offered: trained; accepted; merged: seen merged by the
learner; and where the rest was at the end) and every upload's latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import time

import grpc
import numpy as np

from ddiloco.bench import perf_identity
from ddiloco.bench import perf_workers
from ddiloco.learner import client as client_lib
from ddiloco.learner import progress as progress_lib
from ddiloco.learner import uploads as uploads_lib
from ddiloco.rpc import channel as channel_lib
from ddiloco.rpc import errors as errors_lib
from ddiloco.v1 import common_pb2, syncer_pb2, syncer_pb2_grpc

TOKENS_PER_STEP = 2048  # what a contribution claims per step (the shards' tokens_merged counts these)
TICK_S = 0.02  # a replay learner's loop wakes at most this often (it counts steps from the clock)


def owner_map(shards) -> dict[int, int]:
    """Fragment id -> index of the shard that owns it, from a Join answer's shard map
    (JoinResponse.shards: entries with `index` and `fragment_ids`); {} when unsharded."""
    return {int(fid): int(shard.index) for shard in shards for fid in shard.fragment_ids}


class ShardedLearner:
    """One replay learner's identities, one per syncer shard: joined to the shard it is pointed at
    first, then, if that answer carries a shard map, to every other shard (`stub_for(address)`
    gives a stub to an address, channels shared by the process). `of(fid)` is the identity that
    talks to the fragment's owner (the only one when unsharded)."""

    def __init__(self, first_stub, learner_id: str, stub_for) -> None:
        self.learner_id = learner_id
        self._stub_for = stub_for
        self.first = perf_identity.Identity(first_stub, learner_id)
        self.by_shard: dict[int, perf_identity.Identity] = {0: self.first}
        self.owner: dict[int, int] = {}

    async def join(self, timeout_s: float) -> None:
        await self.first.join(timeout_s)
        self.owner = owner_map(self.first.shards)
        self.by_shard = {self.first.shard_index: self.first}
        for shard in self.first.shards:
            if shard.index in self.by_shard:
                continue
            ident = perf_identity.Identity(self._stub_for(shard.addresses[0]), self.learner_id)
            await ident.join(timeout_s)
            ident.shard_index = shard.index  # as the map names it, whatever the shard answered
            self.by_shard[shard.index] = ident

    def of(self, fid: int) -> perf_identity.Identity:
        return self.by_shard.get(self.owner.get(fid, self.first.shard_index), self.first)

    @property
    def identities(self) -> list[perf_identity.Identity]:
        return [self.by_shard[i] for i in sorted(self.by_shard)]


async def _send(ctx: dict, ident: perf_identity.Identity, fid: int, base: int, steps: int, state: dict,
                final: bool) -> None:
    """One replay upload with the learner's real client; on acceptance its steps wait in the round
    gathering on the version the answer names (merged once a later version arrives), and the
    syncer's back-pressure hint holds the fragment's next upload. `final`: the learner's last
    contribution of the fragment (the syncer waits for this learner no more)."""
    info, _ = ctx["payloads"][fid]
    # The header is this upload's own; the chunk messages are the fragment's, built once per
    # process (every upload of a fragment sends the same payload).
    msgs = ident.messages(fid, base, info, [], steps=steps, tokens=steps * TOKENS_PER_STEP, final=final)
    msgs += ctx["chunk_messages"][fid]
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        # The base stays what the watch stream delivered: a real learner cannot rebase on a
        # version it has not received (the response's current_version).
        resp = await client_lib.send_upload(ident.stub, msgs, 30, pipeline_bytes=ident.pipeline_bytes)
        ctx["counts"]["accepted"] += 1
        by_shard = ctx["accepted_by_shard"]
        by_shard[str(ident.shard_index)] = by_shard.get(str(ident.shard_index), 0) + 1
        ctx["work"]["accepted_steps"] += steps
        state["pending"][fid] -= steps
        state["unmerged"][fid].append((resp.current_version, steps))
        ident.sent_base[fid] = base
        if resp.next_upload_after_s > 0:
            ctx["work"]["slowed"] += 1
            # The syncer's stretch factor (LoadGauge.factor): the hint is (factor - 1) periods.
            ctx["hint_factor_max"] = max(ctx["hint_factor_max"], 1.0 + resp.next_upload_after_s / ctx["period_s"])
            # Honoured as the real client honours it (at most 8 periods, 60 s): the hint alone
            # can ask for 31 periods, 22 s at the default step, most of a timed run.
            state["hold"][fid] = loop.time() + uploads_lib.honoured_hold_s(
                resp.next_upload_after_s, ctx["period_steps"], ctx["period_s"] / ctx["period_steps"])
    except grpc.aio.AioRpcError as exc:  # the work stays pending: it goes in the next contribution
        ctx["counts"]["refused"] += 1
        ctx["refusals"][exc.code().name] = ctx["refusals"].get(exc.code().name, 0) + 1
        if errors_lib.reason_of(exc) == "already_pending":  # the open round has its last one: wait for it
            ident.sent_base[fid] = base
    ctx["latencies"].append(loop.time() - t0)


def _try_send(ctx: dict, learner: ShardedLearner, fid: int, state: dict, final: bool) -> bool:
    """Starts an upload of the fragment's pending work, to its owner shard, if the replay learner
    may send one now."""
    ident = learner.of(fid)
    base = ident.versions.get(fid, 0)
    if not ctx["uploads"]:
        return False  # an idle level: joined, watching and reporting progress only
    if fid in state["sending"] or state["pending"][fid] <= 0 or ident.sent_base.get(fid) == base:
        return False  # one upload per fragment in flight, one contribution per base version
    if not final and asyncio.get_running_loop().time() < state["hold"].get(fid, 0.0):
        return False  # back-pressure: this period's work joins the next contribution
    task = asyncio.create_task(_send(ctx, ident, fid, base, state["pending"][fid], state, final))
    state["sending"][fid] = task
    task.add_done_callback(lambda _t: state["sending"].pop(fid, None))
    return True


def report_interval_s(owner: dict[int, int], shard_index: int, step_s: float, period: int, fids) -> float:
    """The real client's progress interval (learner.progress) towards shard `shard_index`, given
    the fragment -> shard map `owner` ({}: unsharded, the shard serves every fragment)."""
    served = sum(1 for fid in fids if owner.get(fid, shard_index) == shard_index)
    return progress_lib.progress_interval_s(step_s, period, served or len(fids),
                                            client_lib.ClientConfig.progress_interval_s)


async def _learner(ctx: dict, spec: dict, index: int, stop: asyncio.Event) -> None:
    """One replay learner until `stop`, then its finish (`_finish`). Its watch streams and progress
    reports stay open until the finish is over: the work a learner holds on a base it has already
    contributed on goes out only once it hears of the next version, and the syncer is told that
    this learner has finished."""
    fids, period, step_s = ctx["fids"], spec["sync_period_steps"], spec["step_s"]
    learner = ShardedLearner(ctx["stub"], f"replay-{spec['first']+index}", ctx["stub_for"])
    await learner.join(30)
    ctx["joined"] += 1
    if ctx["joined"] >= ctx["ids"]:
        ctx["all_joined"].set()
    step = index % period  # learners are not in phase
    over = asyncio.Event()  # set once the finish is over
    state = {"trained": dict.fromkeys(fids, 0), "pending": dict.fromkeys(fids, 0), "hold": {}, "sending": {},
             "unmerged": {fid: [] for fid in fids}, "finished": False}
    watches = [asyncio.create_task(ident.watch(over, 60)) for ident in learner.identities]
    # Every shard is told the progress (each counts tokens and runs its own rounds), at the real
    # client's interval for the fragments that shard serves.
    progress = [asyncio.create_task(ident.report_progress(over, report_interval_s(learner.owner, ident.shard_index, step_s, period, fids),
                                                          lambda: step, timeout_s=10, step_time_s=step_s,
                                                          finished=lambda: state["finished"]))
                for ident in learner.identities]
    loop = asyncio.get_running_loop()
    # Steps are counted from the clock, several per wake-up when the step time is shorter than
    # the tick: the loop costs the same CPU whatever the step time.
    tick_s = max(step_s, TICK_S)
    start = loop.time() + (index % 16) * step_s / 16
    done_steps = 0
    try:
        while not stop.is_set():
            await asyncio.sleep(tick_s)
            target = int((loop.time() - start) / step_s)
            while done_steps < target and not stop.is_set():
                done_steps += 1
                step += 1
                _step(ctx, learner, state, step, period)
            _note_merged(ctx, learner, state)
        await _finish(ctx, learner, state, spec.get("flush_s", 10.0))
    finally:
        over.set()
        for task in watches + progress:
            task.cancel()


async def _finish(ctx: dict, learner: ShardedLearner, state: dict, timeout_s: float) -> None:
    """The end of a replay learner's steps, as a real learner's finish: `finished` reported from
    now on, all remaining work (the steps trained since each fragment's last turn too) contributed
    as final uploads whenever the fragment's base allows, until the global model holds all of this
    learner's work or `timeout_s`; then what is left is counted where it is. `spec["finish"]`
    false (a test's control) skips the finish: the learner stops as the bench's learners did."""
    fids, work = ctx["fids"], ctx["work"]
    for fid in fids:  # all progress goes in the last contributions, as the real learner's c_steps
        state["pending"][fid] += state["trained"][fid]
        state["trained"][fid] = 0
    if ctx["finish"] and ctx["uploads"]:
        state["finished"] = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline and _outside_global(state):
            for fid in fids:
                work["final_sent"] += _try_send(ctx, learner, fid, state, final=True)
            await asyncio.sleep(0.05)
            _note_merged(ctx, learner, state)
    # Uploads still in flight settle first (with or without the finish): their steps are pending
    # until answered, so counting before the answer could count them twice or not at all.
    for task in list(state["sending"].values()):
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 35)
    _note_merged(ctx, learner, state)
    work["pending_steps_end"] += sum(state["pending"].values())
    work["unmerged_steps_end"] += sum(steps for fid in fids for _, steps in state["unmerged"][fid])


def _outside_global(state: dict) -> bool:
    """Whether some of the learner's work is not in the global model yet: being sent, never
    accepted, or accepted in a round that has not merged."""
    return bool(state["sending"]) or any(state["pending"].values()) or any(state["unmerged"].values())


def _note_merged(ctx: dict, learner: ShardedLearner, state: dict) -> None:
    """Accepted contributions whose round has merged: the fragment's owner published a version
    after the one the contribution was accepted on (the answer's current_version), and the
    watch delivered it. Their steps are merged work."""
    for fid, waiting in state["unmerged"].items():
        if not waiting:
            continue
        version = learner.of(fid).versions.get(fid, 0)
        merged = [steps for accepted_on, steps in waiting if version > accepted_on]
        if merged:
            ctx["work"]["merged_steps"] += sum(merged)
            state["unmerged"][fid] = [(v, n) for v, n in waiting if version <= v]


def _step(ctx: dict, learner: ShardedLearner, state: dict, step: int, period: int) -> None:
    """One learner step: one step of work on every fragment (offered); a fragment whose turn it
    is makes its work since its last turn ready to send, and every fragment with work ready is
    sent if it may be."""
    work = ctx["work"]
    for fid in ctx["fids"]:
        state["trained"][fid] += 1
        work["offered_steps"] += 1
        due = step % period == ctx["offsets"][fid]
        if due:
            state["pending"][fid] += state["trained"][fid]
            state["trained"][fid] = 0
        if not _try_send(ctx, learner, fid, state, final=False) and due:
            ctx["counts"]["skipped"] += 1  # held, in flight, or the base did not move: kept


def _payloads(spec: dict) -> dict[int, tuple]:
    """Each fragment's upload, encoded and chunked: the first captured pseudo-gradient of each
    fragment, or synthetic ones (std 1e-4) of `spec["synthetic_numels"]`, made and encoded one
    fragment at a time so that only one float32 fragment is held (1B parameters: 1 GB each)."""
    payloads = {}
    if "synthetic_numels" in spec:
        rng = np.random.default_rng(spec.get("seed", 0))
        for fid, numel in sorted((int(f), int(n)) for f, n in spec["synthetic_numels"].items()):
            delta = rng.standard_normal(numel, dtype=np.float32)
            delta *= 1e-4
            payloads.update(perf_identity.prepare_payloads({fid: delta}, spec["chunk_size"]))
            del delta
    else:
        with np.load(spec["captured"]) as data:
            deltas = {}
            for key in sorted(data.files):
                fid = int(key.split("_")[0][1:])
                deltas.setdefault(fid, data[key])
        payloads = perf_identity.prepare_payloads(deltas, spec["chunk_size"])
    return {fid: (common_pb2.PayloadInfo.FromString(info.SerializeToString()), chunks)
            for fid, (info, chunks) in payloads.items()}


def chunk_messages(chunks: list[bytes]) -> list:
    """A payload's chunks as the upload stream's messages, in order, the last one marked."""
    return [syncer_pb2.UploadFragmentRequest(chunk=common_pb2.PayloadChunk(seq=i, data=c, last=i == len(chunks) - 1))
            for i, c in enumerate(chunks)]


def make_context(spec: dict, payloads: dict, stub_for) -> dict:
    """What a replay process's learners share: stubs, payloads, counters, the schedule."""
    fids = sorted(payloads)
    period = spec["sync_period_steps"]
    return {"stub": stub_for(spec["address"]), "stub_for": stub_for, "payloads": payloads,
            "chunk_messages": {fid: chunk_messages(chunks) for fid, (_, chunks) in payloads.items()},
            "counts": {"accepted": 0, "refused": 0, "skipped": 0}, "refusals": {}, "accepted_by_shard": {},
            "work": {"offered_steps": 0, "accepted_steps": 0, "merged_steps": 0, "pending_steps_end": 0,
                     "unmerged_steps_end": 0, "slowed": 0, "final_sent": 0},
            "latencies": [], "fids": fids, "offsets": {fid: (fid * period) // len(fids) for fid in fids},
            "period_s": period * spec["step_s"], "period_steps": period, "hint_factor_max": 1.0,
            "joined": 0, "all_joined": asyncio.Event(), "ids": spec["ids"], "uploads": spec.get("uploads", True),
            "finish": spec.get("finish", True)}


async def replay(spec: dict) -> dict:
    """Runs the replay learners for `spec["seconds"]` from the moment all of them have joined
    (then `spec["running_path"]`, if given, is written: the bench measures from there, whatever
    this process's start-up took on a loaded machine); their counts and latencies."""
    payloads = _payloads(spec)
    channels = {spec["address"]: channel_lib.aio_channel(spec["address"], None)}

    def stub_for(address: str):
        """A stub to a shard, over one channel per address for the whole process."""
        if address not in channels:
            channels[address] = channel_lib.aio_channel(address, None)
        return syncer_pb2_grpc.SyncerStub(channels[address])

    ctx = make_context(spec, payloads, stub_for)
    fids, period, counts, work = ctx["fids"], spec["sync_period_steps"], ctx["counts"], ctx["work"]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(_learner(ctx, spec, i, stop)) for i in range(spec["ids"])]
    with contextlib.suppress(asyncio.TimeoutError):  # a learner that cannot join fails its task
        await asyncio.wait_for(ctx["all_joined"].wait(), 60)
    if spec.get("running_path"):
        pathlib.Path(spec["running_path"]).write_text("running")
    await asyncio.sleep(spec["seconds"])
    stop.set()
    await asyncio.wait(tasks, timeout=spec.get("flush_s", 10.0) + 40)
    for t in tasks:
        t.cancel()
    for channel in channels.values():
        await channel.close()
    # What the schedule asked for: one upload per fragment every sync period per identity.
    offered = round(spec["ids"] * len(fids) * spec["seconds"] / (spec["step_s"] * period))
    return {"latencies": ctx["latencies"], "refusals": ctx["refusals"], "offered": offered,
            "accepted_by_shard": ctx["accepted_by_shard"], "hint_factor_max": ctx["hint_factor_max"],
            "cpu_s": time.process_time(), **counts, **work}


if __name__ == "__main__":
    perf_workers.run_job(lambda spec: asyncio.run(replay(spec)))
