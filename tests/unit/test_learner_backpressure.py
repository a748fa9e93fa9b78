"""The syncer's back-pressure hold and the learner's round calls (issue 20: learners silent for a minute).

In the goodput benchmark (16 learners, decoupled, seed 2) learners that never faulted sent nothing
for up to 60 s: an accepted upload's response asked for a hold (UploadFragmentResponse.next_upload_after_s,
up to 31 periods, capped at 60 s), the loop answered the fragment's next call anyway, and the
contribution sat in the client's queue on its base while the rounds merged without it (one
contribution in flight per fragment: nothing newer replaced it). When the hold ended it was refused
as too stale. The real SyncClient (never started: no thread, no network) under the real loop on
numpy fakes reproduces that state. And the syncer's rounds waited the whole grace window for the
learners it had asked to hold.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from ddiloco.algo import fragments as fragments_lib
from ddiloco.learner import client as client_lib
from ddiloco.learner import loop as loop_lib
from ddiloco.v1 import syncer_pb2
from tests.fakes import NullSampler, join, settle
from tests.unit.test_learner_resend import _Step
from tests.unit.test_rounds import contribute, make_scheduled_core, report

_INSTANCE = "inst"


def _client() -> client_lib.SyncClient:
    client = client_lib.SyncClient(client_lib.ClientConfig(target="127.0.0.1:1", learner_id="l", incarnation=1,
                                                           region="r", tokens_per_step=64))
    client.instance = _INSTANCE
    client.run_config = syncer_pb2.RunConfig(num_fragments=2, sync_period_steps=2)
    return client


def _deliver(client: client_lib.SyncClient, fid: int, version: int, values: np.ndarray, mark: int = 0) -> None:
    """What the watch stream does with a received version (SyncClient._receive)."""
    with client._lock:
        client._inbox[fid] = client_lib.GlobalFragment(fid, version, _INSTANCE, values, mark)
        client._held[fid] = version
        client._values[fid] = values


def _call(client: client_lib.SyncClient, fid: int, number: int, version: int) -> None:
    with client._lock:  # what the watch stream does with a round call (SyncClient._watch)
        client._calls[fid] = syncer_pb2.RoundCall(fragment_id=fid, round=number, version=version)


def _accept(client: client_lib.SyncClient, job: client_lib.UploadJob, hint_s: float) -> None:
    """The syncer accepted the job and asked for a back-pressure hold of `hint_s`."""
    response = syncer_pb2.UploadFragmentResponse(result=syncer_pb2.UploadFragmentResponse.RESULT_ACCEPTED,
                                                 current_version=job.base_version, next_upload_after_s=hint_s)

    async def accept() -> None:
        client._accepted(job, response, sent_at=0.0)

    asyncio.run(accept())


def _setup():
    client = _client()
    specs = [fragments_lib.TensorSpec("a", (4, 4)), fragments_lib.TensorSpec("b", (8,))]
    plan = fragments_lib.plan_fragments(specs, 2, 2)
    params = {s.name: np.zeros(s.shape, np.float32) for s in specs}
    loop = loop_lib.LearnerLoop(plan=plan, params=params, train_step=_Step(), sampler=NullSampler(), client=client,
                                learner_id="l", incarnation=1, on_arrival="rebase", sync_mode="decoupled")
    for frag in plan.fragments:
        _deliver(client, frag.fragment_id, 0, fragments_lib.flatten_fragment(params, frag))
    loop.apply_updates()
    return loop, client


def test_a_call_during_a_back_pressure_hold_waits_and_the_work_goes_out_whole_on_a_fresh_base():
    loop, client = _setup()
    values = loop.global_copy[0].copy()
    _call(client, 0, 1, 0)
    loop.step()
    first = client._uploads.pop(0)  # the uploader takes it and the syncer accepts it, asking for a hold
    assert first.base_version == 0
    progress = loop.progress_request()
    progress.step_time_s = 1.0  # measured (a life's first step is not: it compiles)
    client.set_progress(progress)
    _accept(client, first, hint_s=30.0)
    assert client._hold_until[0] > client._loop.time()  # the hint started a hold
    # The hold's length is capped at 8 periods of this learner's measured step time (test below);
    # the fake steps' time is wall-clock and a loaded machine can outlast it between two steps, so
    # the hold is pinned open here: what is tested is what a call does while one lasts.
    client._hold_until[0] = float("inf")
    _deliver(client, 0, 1, values, mark=first.local_step)  # version 1 holds it
    loop.step()
    assert 0 not in loop.pending and loop.stats.merged_contributions == 1
    # The rounds go on without this learner while the hold lasts: versions 2..6 and their calls.
    for version in range(1, 7):
        _call(client, 0, version + 1, version)
        loop.step()
        # Before the fix the first of these calls was answered: a contribution on base 1 sat in
        # the client's queue for the whole hold, the loop (one in flight) answered no call after
        # it, and the syncer refused it as too stale when the hold ended.
        assert 0 not in client._uploads and 0 not in loop.pending
        _deliver(client, 0, version + 1, values)
    steps_held = int(loop.c_steps[0])
    assert steps_held >= 7  # the work stays local, whole
    client._hold_until[0] = 0.0  # the hold ends: the newest call (round 7, version 6) is handed over
    _call(client, 0, 8, 7)
    loop.step()
    job = client._uploads[0]
    assert job.base_version == 7 and job.steps == steps_held + 1


def test_a_hold_is_bounded_by_the_fragments_periods_at_the_learners_step_time():
    loop, client = _setup()
    client.set_progress(loop.progress_request())  # step time still unknown: no hold at all
    job = client_lib.UploadJob(fragment_id=1, base_version=0, syncer_instance=_INSTANCE, steps=2, tokens=128,
                               delta=np.zeros(8, np.float32))
    _accept(client, job, hint_s=90.0)
    # Before the fix: 60 s, and a learner at a run's start sent nothing on that fragment for a minute.
    assert client.stats.last_upload_hold_s == 0.0 and client._hold_until.get(1, 0.0) == 0.0
    progress = loop.progress_request()
    progress.step_time_s = 0.25
    client.set_progress(progress)
    _accept(client, job, hint_s=90.0)
    # 8 periods of H = 2 steps at 0.25 s: 4 s (before the fix 60 s, a whole short run).
    assert client.stats.last_upload_hold_s == 4.0
    _accept(client, job, hint_s=1.5)  # a hint below the bound is honoured as given
    assert client.stats.last_upload_hold_s == 1.5
    _call(client, 1, 1, 0)
    assert client.take_calls() == {}  # held: the call waits
    client._hold_until[1] = 0.0
    assert list(client.take_calls()) == [1]


def test_a_round_does_not_wait_for_a_learner_the_syncer_asked_to_hold_that_fragment(clock):
    # The benchmark's rounds waited the whole grace window (10 s) for learners that were holding:
    # the schedule called them, and nobody was going to answer.
    learners = ("a", "b", "c")

    async def run():
        core = make_scheduled_core(clock)
        for lid in learners:
            join(core, lid)
        for lid in learners:
            report(core, lid, 0)
        core.note_hold(syncer_pb2.UploadHeader(learner_id="c", incarnation=1, fragment_id=1), 30.0)
        core.note_hold(syncer_pb2.UploadHeader(learner_id="b", incarnation=2, fragment_id=1), 30.0)  # not this life
        for lid in learners:
            report(core, lid, 2)  # global step 2: fragment 1's round opens and calls everyone
        assert core.round_call(1, "c") is not None  # still called: it answers if its hold ends first
        await contribute(core, "a", 1, mark=2)
        await contribute(core, "b", 1, mark=2)
        await settle()
        assert core.slots[1].version == 1  # before the fix: waiting for c until the grace window ends
        record = core.rounds.merges[-1]
        assert record.reason == "all_contributed" and record.expected_contributors == 3
        clock.now_s += 31.0  # the hold is over: c is waited for again
        assert core.membership.holding(1) == set()

    asyncio.run(run())


def test_a_lifes_first_step_which_compiles_is_not_a_step_time():
    loop, client = _setup()
    loop.end_step(1.0, 64, started=time.monotonic() - 30.0)  # the first step: 30 s of compilation
    assert loop.progress_request().step_time_s == 0.0  # unknown yet (before the fix: 30 s)
    for _ in range(3):
        loop.end_step(1.0, 64, started=time.monotonic() - 0.2)
    assert 0.19 < loop.progress_request().step_time_s < 0.3
    # A hint now folds at most 8 periods of H = 2 steps at ~0.2 s: ~3.2 s (before the fix: 60 s).
    job = client_lib.UploadJob(fragment_id=1, base_version=0, syncer_instance=_INSTANCE, steps=2, tokens=128,
                               delta=np.zeros(8, np.float32))
    client.set_progress(loop.progress_request())
    _accept(client, job, hint_s=90.0)
    assert 3.0 < client.stats.last_upload_hold_s < 5.0
