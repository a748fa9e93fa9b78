"""The learner loop's one-contribution-in-flight rule and refused uploads (the fragment stall).

A fragment's round below quorum merges only when enough learners contributed. The loop sends one
upload per base version, so before the fix an upload the syncer refused without taking it (its
round held an earlier life's contribution, admission, a lost connection) was never sent again until
a new version arrived, and that version never came: the fragment stalled. The numpy fakes below
stand in for the train step and the SyncClient (no JAX, no network).
"""

from __future__ import annotations

import numpy as np

from ddiloco.algo import fragments as fragments_lib
from ddiloco.v1 import syncer_pb2
from ddiloco.learner import client as client_lib
from ddiloco.learner import loop as loop_lib
from tests import fakes


class _Step:
    """A numpy 'train step': every call moves each parameter by a constant."""

    def place_params(self, params):
        return {k: np.asarray(v, dtype=np.float32) for k, v in params.items()}

    def init_opt_state(self, params):
        return None

    def __call__(self, params, opt_state, batch):
        return {k: v - np.float32(0.01) for k, v in params.items()}, opt_state, 1.0

    def to_host(self, value):
        return np.asarray(value)

    def place(self, name, value):
        return np.asarray(value, dtype=np.float32)


class _Client(fakes.RecordingSyncClient):
    """Records uploads; the test decides which the syncer refused."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: set = set()
        self.outcomes: list = []

    def take_refused(self):
        out, self.refused = self.refused, set()
        return out

    def take_outcomes(self):
        out, self.outcomes = self.outcomes, []
        return out


def _make_loop(client, *, version: int, instance: str, **loop_args):
    """A two-fragment loop on the numpy fakes, holding every fragment at `version` of `instance`."""
    specs = [fragments_lib.TensorSpec("a", (4, 4)), fragments_lib.TensorSpec("b", (8,))]
    plan = fragments_lib.plan_fragments(specs, 2, 2)
    params = {s.name: np.zeros(s.shape, np.float32) for s in specs}
    loop = loop_lib.LearnerLoop(plan=plan, params=params, train_step=_Step(), sampler=fakes.NullSampler(), client=client,
                                learner_id="l", incarnation=1, on_arrival="rebase", sync_mode="decoupled",
                                **loop_args)
    client.inbox = [client_lib.GlobalFragment(f.fragment_id, version, instance,
                                              fragments_lib.flatten_fragment(params, f)) for f in plan.fragments]
    loop.apply_updates()
    return loop, client, plan


def _loop():
    # Rounds opened by the learner's own counter (round_trigger "upload"): due every H / P steps.
    return _make_loop(_Client(), version=0, instance="inst", round_trigger="upload")


def _uploads_of(client, fid):
    return [j for j in client.uploads if j.fragment_id == fid]


def _outcome(job, result, version=0):
    return client_lib.UploadOutcome(job.fragment_id, job.local_step, result, version)


def test_a_refused_upload_is_sent_again_on_the_same_base_with_the_steps_since():
    loop, client, plan = _loop()
    for _ in range(2 * plan.num_fragments * 2):  # each fragment due twice, no new version arrives
        loop.step()
    first = _uploads_of(client, 0)
    assert len(first) == 1 and first[0].base_version == 0  # one contribution in flight per fragment
    client.outcomes = [_outcome(first[0], client_lib.OUTCOME_NOT_TAKEN)]  # refused without taking it
    for _ in range(2 * plan.num_fragments):
        loop.step()
    again = _uploads_of(client, 0)
    assert len(again) == 2 and again[1].base_version == 0
    assert again[1].steps > again[0].steps  # the refused steps are still in the contribution
    assert len(_uploads_of(client, 1)) == 1  # fragments that were not refused: still one in flight


def test_a_refusal_of_an_older_contribution_does_not_reopen_the_current_one():
    loop, client, plan = _loop()
    for _ in range(2 * plan.num_fragments):
        loop.step()
    first = _uploads_of(client, 0)[0]
    client.outcomes = [_outcome(first, client_lib.OUTCOME_ACCEPTED, version=0)]
    # Version 1 arrives without it (its receipt holds no mark of this learner): never merged.
    client.inbox = [client_lib.GlobalFragment(0, 1, "inst", loop.global_copy[0] + 1)]
    for _ in range(2 * plan.num_fragments):
        loop.step()
    assert [j.base_version for j in _uploads_of(client, 0)] == [0, 1]
    assert _uploads_of(client, 0)[1].steps > first.steps  # the unmerged steps went out again
    client.outcomes = [_outcome(first, client_lib.OUTCOME_NOT_TAKEN)]  # a late word on the old one
    for _ in range(2 * plan.num_fragments):
        loop.step()
    assert [j.base_version for j in _uploads_of(client, 0)] == [0, 1]


class _CallClient(_Client):
    """A client of scheduled rounds: the syncer's calls, and the syncer life it is joined to."""

    def __init__(self) -> None:
        super().__init__()
        self.instance = "life-1"
        self.calls: dict = {}

    def take_calls(self):
        out, self.calls = self.calls, {}
        return out


def _called_loop():
    return _make_loop(_CallClient(), version=3, instance="life-1")


def _call(fid, version, rnd=1):
    return syncer_pb2.RoundCall(fragment_id=fid, version=version, round=rnd)


def test_a_call_that_comes_before_the_new_syncer_lifes_copy_is_answered_once_the_copy_is_here():
    # A re-join to a restarted syncer sends the round calls before the fragments. Answered at once,
    # the contribution was based on the previous life: the client dropped it, the call was used up,
    # and the round waited for a quorum that could not come (a chaos run: 3 of 4 fragments stalled).
    loop, client, plan = _called_loop()
    for _ in range(3):
        loop.step()
    client.instance = "life-2"
    client.calls = {0: _call(0, version=3, rnd=9)}
    loop.step()
    assert _uploads_of(client, 0) == []  # nothing based on life-1
    client.inbox = [client_lib.GlobalFragment(0, 3, "life-2", loop.global_copy[0])]
    loop.step()
    [job] = _uploads_of(client, 0)
    assert job.syncer_instance == "life-2" and job.base_version == 3 and job.steps == 5


def test_a_refused_answer_to_a_call_is_sent_again_a_bounded_number_of_times():
    loop, client, plan = _called_loop()
    loop.step()
    client.calls = {0: _call(0, version=3)}
    for attempt in range(1, loop_lib._MAX_CALL_ANSWERS + 2):
        loop.step()
        jobs = _uploads_of(client, 0)
        assert len(jobs) == min(attempt, loop_lib._MAX_CALL_ANSWERS)
        client.outcomes = [_outcome(jobs[-1], client_lib.OUTCOME_NOT_TAKEN)]  # refused each time
    assert [j.steps for j in _uploads_of(client, 0)] == [2, 3, 4]  # the refused steps go out again


def test_a_call_refused_again_and_again_is_answered_backing_off_while_its_round_is_open():
    # The syncer calls a learner once per round. Before the fix the call was dropped after
    # _MAX_CALL_ANSWERS refusals: a round below quorum that needed this learner (K = 2 with one
    # other learner down, or its norm bound's reference since moved) then waited for good, and its
    # fragment with it. Now the answers go on while the round is open, 1, 2, 4, 8, 8 ... periods
    # apart (H = 2 steps here), each with all the steps taken since the last merge.
    loop, client, plan = _called_loop()
    loop.step()
    client.calls = {0: _call(0, version=3)}
    for _ in range(52):
        loop.step()
        jobs = _uploads_of(client, 0)
        if jobs and jobs[-1].local_step == loop.stats.steps:
            client.outcomes = [_outcome(jobs[-1], client_lib.OUTCOME_NOT_TAKEN)]
    jobs = _uploads_of(client, 0)
    assert [j.local_step for j in jobs] == [2, 3, 4, 6, 10, 18, 34, 50]
    assert [j.steps for j in jobs] == [2, 3, 4, 6, 10, 18, 34, 50]  # nothing of the work is dropped
    assert all(j.base_version == 3 for j in jobs)
    # The round merged without it (version 4): the call ends, the work waits for the next call.
    client.inbox = [client_lib.GlobalFragment(0, 4, "life-1", loop.global_copy[0])]
    for _ in range(40):
        loop.step()
    assert len(_uploads_of(client, 0)) == len(jobs)
    # The next round's call is answered at once again.
    client.calls = {0: _call(0, version=4, rnd=2)}
    loop.step()
    assert [j.base_version for j in _uploads_of(client, 0)][len(jobs):] == [4]


def test_the_acceptance_of_an_answer_does_not_end_the_next_rounds_call():
    # The round merges right after accepting, and the next round's call can come before the loop
    # reads the acceptance, which must then end only the call it answered (it ended the next one:
    # nobody answered round 2 and every fragment waited until the learners finished).
    loop, client, plan = _called_loop()
    loop.step()
    client.calls = {0: _call(0, version=3, rnd=1)}
    loop.step()
    [first] = _uploads_of(client, 0)
    client.calls = {0: _call(0, version=4, rnd=2)}
    loop.step()  # round 2's call waits: the answer to round 1 is still in flight
    client.outcomes = [_outcome(first, client_lib.OUTCOME_ACCEPTED, version=3)]
    client.inbox = [client_lib.GlobalFragment(0, 4, "life-1", loop.global_copy[0], merged_through_step=first.local_step)]
    for _ in range(2):
        loop.step()
    assert [j.base_version for j in _uploads_of(client, 0)] == [3, 4]


def test_an_accepted_answer_ends_the_call():
    loop, client, plan = _called_loop()
    loop.step()
    client.calls = {0: _call(0, version=3)}
    loop.step()
    [job] = _uploads_of(client, 0)
    client.outcomes = [_outcome(job, client_lib.OUTCOME_ACCEPTED, version=3)]
    # Version 4 does not hold it (its round was dropped): the work waits for the next call.
    client.inbox = [client_lib.GlobalFragment(0, 4, "life-1", loop.global_copy[0])]
    for _ in range(3):
        loop.step()
    assert len(_uploads_of(client, 0)) == 1


class _BarrierClient(_Client):
    """A synchronous-mode client whose next version arrived while the step ran: it is already
    counted in `arrivals()` when the barrier begins, and no version after it will come (the syncer
    refuses this learner's upload on the older base as stale)."""

    instance = "inst"

    def __init__(self, held: dict[int, int]) -> None:
        super().__init__()
        self.held = held

    def arrivals(self):
        return {fid: 2 for fid in self.held}

    def wait_for_arrivals(self, after, timeout_s):
        return False

    def held_values(self):
        return {fid: (version, None) for fid, version in self.held.items()}


def test_a_barrier_whose_base_was_superseded_during_the_step_ends():
    # A restarted learner joined at version 0 of a round that then closed without it (version 1).
    # Before the fix its barrier waited for a version after 1 forever, re-sending the stale upload.
    import threading

    specs = [fragments_lib.TensorSpec("a", (4, 4))]
    plan = fragments_lib.plan_fragments(specs, 1, 1)
    params = {s.name: np.zeros(s.shape, np.float32) for s in specs}
    client = _BarrierClient({0: 1})
    loop = loop_lib.LearnerLoop(plan=plan, params=params, train_step=_Step(), sampler=fakes.NullSampler(), client=client,
                                learner_id="l", incarnation=1, sync_mode="diloco")
    client.inbox = [client_lib.GlobalFragment(0, 0, "inst", fragments_lib.flatten_fragment(params, plan.fragments[0]))]
    loop.apply_updates()
    stepper = threading.Thread(target=loop.step, daemon=True)
    stepper.start()
    stepper.join(timeout=15)
    assert not stepper.is_alive(), "the barrier waits for a version that cannot come"
    assert [job.base_version for job in client.uploads] == [0]


def test_a_barrier_waits_while_its_base_is_the_newest_version():
    import threading

    specs = [fragments_lib.TensorSpec("a", (4, 4))]
    plan = fragments_lib.plan_fragments(specs, 1, 1)
    params = {s.name: np.zeros(s.shape, np.float32) for s in specs}
    client = _BarrierClient({0: 0})
    stop = threading.Event()
    loop = loop_lib.LearnerLoop(plan=plan, params=params, train_step=_Step(), sampler=fakes.NullSampler(), client=client,
                                learner_id="l", incarnation=1, sync_mode="diloco", should_stop=stop.is_set)
    client.inbox = [client_lib.GlobalFragment(0, 0, "inst", fragments_lib.flatten_fragment(params, plan.fragments[0]))]
    loop.apply_updates()
    stepper = threading.Thread(target=loop.step, daemon=True)
    stepper.start()
    stepper.join(timeout=2.5)
    assert stepper.is_alive(), "the barrier ended without a newer version"
    stop.set()
    stepper.join(timeout=15)
    assert not stepper.is_alive()
