"""The learner's training loop: inner AdamW steps plus the Decoupled DiLoCo fragment rounds.

Per step (paper Alg. 1, learner side): fold in any global fragments that arrived (by the run's
on-arrival rule, ddiloco.algo.arrival: rebase by default, which keeps un-merged work), take one
inner step, advance the per-fragment step and token counters, and answer the syncer's round calls:
for each fragment whose round is open, queue its pseudo-gradient (the global fragment held minus
the local fragment: all of this learner's progress on it since its last merged contribution) for
upload. A fragment with an uploaded contribution whose fate is unknown answers once the version
that decides it arrives (one contribution in flight per fragment, so no work is sent twice).
Nothing here waits on the network: the client does that (the loop uses only the members of
ports.SyncClientLike; the SyncClient in production). With the run's round_trigger
"upload" the learner's own counter decides instead (the previous design, kept for comparison).
At the end, `finish` contributes the remaining progress on every fragment and waits (bounded)
until the global model holds it.

`step` runs the loop's own train step on its sampler's next batch (the service learner); a user's
own training loop runs its step itself and calls `end_step` and `apply_updates` (ddiloco.Learner,
api.py): the rest of the step is the same code either way.

The parameters live wherever the train step keeps them (one device, or sharded over a learner
unit's mesh). Fragments move between host and devices one tensor at a time through the train
step's `to_host` / `place`: extracting or folding in a fragment never holds more than that
fragment on the host, whatever the model size. In a multi-process unit every process runs this
same loop in lockstep (see distributed.py); only the leader's client uploads.

The syncer's RunConfig.sync_mode picks the behaviour (the baselines exist for comparisons):
  * ``decoupled``: as above; the learner never waits.
  * ``diloco``: synchronous DiLoCo. Every fragment is due at the same step; after queueing its
    pseudo-gradients the learner blocks until the merge of each arrives (a barrier).
  * ``dp``: data-parallel through the syncer. No inner optimizer step: every step the learner
    sends its gradient (P = H = 1) and blocks until the syncer's AdamW step comes back.
Time spent blocked is counted in ``LoopStats.wait_s`` (the learner's communication wait).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable

import numpy as np

from ddiloco.algo import arrival as arrival_lib
from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import grace as grace_lib
from ddiloco.algo import rounds as rounds_lib
from ddiloco.v1 import syncer_pb2
from ddiloco.wire import serde
from ddiloco.learner import client as client_lib
from ddiloco.learner import ports
from ddiloco.learner import snapshot as snapshot_lib

_LOG = logging.getLogger("ddiloco.learner")

# Contributions sent at once (at the next steps) in answer to one round call when the syncer
# refuses them (a norm bound, a quarantine): more would only repeat the refusal every step.
_MAX_CALL_ANSWERS = 3
# Beyond those, the call is answered again after 1, 2, 4, ... periods of H steps (at most this
# many) while its round stays open. The syncer calls a learner once per round, and a round below
# quorum waits: a call given up after a few refusals left such a round, and its fragment, waiting
# for good on a learner that had the work (and would have been accepted later: the norm bound's
# reference moves, and the contribution's steps grow).
_MAX_ANSWER_BACKOFF_PERIODS = 8
_FINISH_MAX_REFUSALS = 3  # finish() stops sending a fragment the syncer refused this many times


@dataclasses.dataclass
class LoopStats:
    steps: int = 0
    tokens: int = 0
    uploads_queued: int = 0
    fragments_applied: int = 0
    resets_nonfinite: int = 0
    wait_s: float = 0.0  # blocked on the syncer (synchronous modes only)
    compute_s: float = 0.0  # everything else inside step()
    barrier_resends: int = 0
    merged_contributions: int = 0  # own contributions a received version held (MergeReceipt)
    unmerged_contributions: int = 0  # ... that a version showed were never merged (work kept)
    first_loss: float | None = None
    resumed_from_step: int = 0  # the snapshot's step this life resumed from (0: none; `steps` counts on from it)
    loss_ema: grace_lib.Ema = dataclasses.field(default_factory=lambda: grace_lib.Ema(0.1))
    step_time_ema: grace_lib.Ema = dataclasses.field(default_factory=lambda: grace_lib.Ema(0.2))


class LearnerLoop:
    """Owns the local parameters, the inner optimizer state and the per-fragment counters."""

    def __init__(
        self,
        *,
        plan: fragments_lib.FragmentPlan,
        params: dict,
        train_step,
        sampler,
        client: ports.SyncClientLike,
        learner_id: str,
        incarnation: int,
        mixing_alpha: float = 0.0,
        step_delay_s: Callable[[], float] | None = None,
        sync_mode: str = rounds_lib.DECOUPLED,
        should_stop: Callable[[], bool] = lambda: False,
        barrier_resend_s: float = 15.0,
        on_arrival: str = "",
        round_trigger: str = "schedule",
    ) -> None:
        """`sync_mode` comes from the syncer's RunConfig (see the module docstring). In the
        synchronous modes `should_stop` ends a barrier wait (SIGTERM), and an upload whose merge
        has not come back within `barrier_resend_s` is sent again (idempotent on the syncer), so
        a lost upload cannot deadlock a quorum that needs every learner. `on_arrival` and
        `round_trigger` come from the RunConfig (decoupled mode only; the synchronous modes
        overwrite, or mix with `mixing_alpha`, and upload on their own schedule)."""
        if sync_mode not in rounds_lib.SYNC_MODES:
            raise ValueError(f"sync_mode={sync_mode!r}: this learner knows {rounds_lib.SYNC_MODES}; upgrade it")
        self.plan = plan
        self.params = train_step.place_params(params)
        self.opt_state = train_step.init_opt_state(self.params)
        self._train_step = train_step
        self._sampler = sampler
        self._client = client
        self._learner_id = learner_id
        self._incarnation = incarnation
        self._alpha = mixing_alpha
        self._step_delay_s = step_delay_s
        num = plan.num_fragments
        self.global_copy: dict[int, np.ndarray] = {}
        self.held: dict[int, tuple[str, int]] = {}  # fragment -> (syncer instance, version)
        self.c_steps = np.zeros(num, dtype=np.int64)
        self.c_tokens = np.zeros(num, dtype=np.int64)
        self._last_upload_base: dict[int, tuple[str, int]] = {}
        self.stats = LoopStats()
        self.sync_mode = sync_mode
        self._barrier = sync_mode in (rounds_lib.DILOCO, rounds_lib.DP)
        self._gradient_mode = sync_mode == rounds_lib.DP
        self._should_stop = should_stop
        self._barrier_resend_s = barrier_resend_s
        default_rule = "mix" if mixing_alpha else "overwrite"
        self.on_arrival = (on_arrival or default_rule) if sync_mode == rounds_lib.DECOUPLED else default_rule
        if self.on_arrival not in arrival_lib.ON_ARRIVAL_RULES:
            raise ValueError(f"on_arrival={on_arrival!r}: this learner knows {arrival_lib.ON_ARRIVAL_RULES}")
        self._called = sync_mode == rounds_lib.DECOUPLED and round_trigger != "upload"
        self.pending: dict[int, arrival_lib.PendingContribution] = {}
        self._not_taken = np.zeros(num, dtype=np.int64)  # contributions refused or lost, per fragment
        self._jobs: dict[int, client_lib.UploadJob] = {}  # the job behind each pending contribution
        self._calls: dict[int, syncer_pb2.RoundCall] = {}  # open calls, until answered and accepted
        # fragment -> the syncer life its calls came from (per fragment: with fragment shards each
        # fragment's owner is a syncer life of its own, which restarts alone).
        self._calls_instance: dict[int, str | None] = {}
        self._call_answers: dict[int, int] = {}  # contributions sent for each fragment's current call
        self._answered_round: dict[int, int] = {}  # the round of the call each fragment last answered
        self._answer_at_step: dict[int, int] = {}  # a refused call's next answer waits until this step
        self.finished = False
        self._before_upload: Callable[[int, int], None] | None = None  # set_before_upload
        self.tokens_before = 0  # tokens of earlier lives, up to the snapshot this life resumed from

    def _take_outcomes(self) -> None:
        for outcome in self._client.take_outcomes():
            pending = self.pending.get(outcome.fragment_id)
            if pending is None or pending.mark_step != outcome.local_step:
                continue
            if outcome.result == client_lib.OUTCOME_NOT_TAKEN:
                # Never merged: the work stays in the progress, and the round's call (kept) is
                # answered again while its round is open, backing off (see _due_fragments).
                del self.pending[outcome.fragment_id]
                self._not_taken[outcome.fragment_id] += 1
            else:
                pending.accepted = True
                pending.accepted_version = outcome.current_version
                # Answered: the round holds it. (The fragment's next call may already be here:
                # only the call this contribution answered ends.)
                call = self._calls.get(outcome.fragment_id)
                if call is not None and call.round == self._answered_round.get(outcome.fragment_id):
                    del self._calls[outcome.fragment_id]

    def apply_updates(self) -> int:
        """Folds in every global fragment that arrived; returns how many."""
        self._take_outcomes()
        updates = self._client.take_updates()
        for update in updates:
            fid = update.fragment_id
            frag = self.plan.fragments[fid]
            values = update.values
            pending = self.pending.get(fid)
            job = self._jobs.get(fid)
            if pending is not None and pending.sent is None and job is not None and job.local_step == pending.mark_step:
                pending.sent = job.sent_values  # what the syncer decoded (None: lossless upload)
            if fid not in self.global_copy:  # the first copy: nothing local to keep
                new_local, merged, reset = values, None, True
            else:
                # Overwrite needs no local values: the fragment does not come to the host.
                local = (values if self.on_arrival == "overwrite"
                         else fragments_lib.flatten_fragment(self._host_params(frag), frag))
                folded = arrival_lib.fold_in(
                    rule=self.on_arrival, local=local,
                    held=self.global_copy[fid], new=values, pending=pending,
                    merged_through_step=update.merged_through_step, alpha=self._alpha)
                new_local, merged, reset = folded.local, folded.merged, folded.reset_counters
            for name, arr in fragments_lib.unflatten_fragment(np.asarray(new_local, np.float32), frag).items():
                self.params[name] = self._train_step.place(name, arr)
            self.global_copy[fid] = values
            self.held[fid] = (update.syncer_instance, update.version)
            if merged is not None:
                self.stats.merged_contributions += 1
                del self.pending[fid]
                if not reset:  # keep the counts of the steps taken after the merged contribution
                    self.c_steps[fid] = max(0, int(self.c_steps[fid]) - merged.steps)
                    self.c_tokens[fid] = max(0, int(self.c_tokens[fid]) - merged.tokens)
            elif pending is not None and pending.resolved_unmerged(update.version, update.syncer_instance,
                                                                   update.merged_through_step):
                self.stats.unmerged_contributions += 1
                del self.pending[fid]
            if reset:
                self.c_steps[fid] = 0
                self.c_tokens[fid] = 0
                self.pending.pop(fid, None)
        self.stats.fragments_applied += len(updates)
        return len(updates)

    def _host_params(self, frag: fragments_lib.Fragment) -> dict[str, np.ndarray]:
        return {t.name: self._train_step.to_host(self.params[t.name]) for t in frag.tensors}

    def step(self) -> float:
        """One inner step plus the fragment schedule. Returns the step's training loss."""
        started = time.monotonic()
        self.apply_updates()
        batch = self._sampler.next()
        grads = None
        if self._gradient_mode:
            grads, loss = self._train_step.gradients(self.params, batch)
        else:
            self.params, self.opt_state, loss = self._train_step(self.params, self.opt_state, batch)
        if self._step_delay_s is not None:
            time.sleep(self._step_delay_s())  # simulated slower hardware (benchmarks, tests)
        self.end_step(loss, self._sampler.tokens_per_batch, started=started, grads=grads)
        return loss

    def end_step(self, loss: float | None, tokens: int, *, started: float, grads: dict | None = None) -> None:
        """Everything after an inner step's compute, whoever ran the step (`step`, or a user's own
        loop through ddiloco.learner.api): the counters, the answers to the syncer's round calls,
        the progress report and, in the synchronous modes, the barrier. `self.params` must already
        hold the step's result. `started`: time.monotonic() when the step began (the step time
        reported to the syncer, whose round schedule follows it); `loss`: None when not known."""
        self.stats.steps += 1
        self.stats.tokens += tokens
        self.c_steps += 1
        self.c_tokens += tokens
        if loss is not None:
            if self.stats.first_loss is None:
                self.stats.first_loss = loss
            self.stats.loss_ema.update(loss)
        if self.sync_mode == rounds_lib.DECOUPLED:
            jobs = [job for job in (self._contribute(fid) for fid in self._due_fragments()) if job is not None]
            arrivals = {}
        else:
            due = self.plan.due(self.stats.steps)
            arrivals = self._client.arrivals() if self._barrier and due else {}
            jobs = [job for job in (self._queue_upload(fid, grads) for fid in due) if job is not None]
        compute_s = time.monotonic() - started
        self.stats.compute_s += compute_s
        if self.stats.steps > self.stats.resumed_from_step + 1:
            # A life's first step compiles its program (or loads it from the cache): seconds, up to
            # a minute when many learners start on few cores. In the smoothed step time it would
            # stretch the syncer's schedule, grace window and back-pressure holds for tens of steps.
            self.stats.step_time_ema.update(compute_s)
        self._client.set_progress(self.progress_request())
        if jobs and self._barrier:
            self._wait_for_merges(jobs, arrivals)

    def _due_fragments(self) -> list[int]:
        """Fragments to contribute now (decoupled mode): those the syncer called (or, with the
        "upload" round trigger, those the local counter says are due) that have progress and no
        contribution in flight. A call whose round has closed (its version arrived) is dropped:
        the work waits, whole, for the fragment's next round."""
        if not self._called:
            return [fid for fid in self.plan.due(self.stats.steps) if fid not in self.pending]
        for fid in list(self._calls):
            if self._client.instance_of(fid) != self._calls_instance.get(fid):
                # Calls of an earlier syncer life name its rounds and versions: they mean nothing now.
                del self._calls[fid]
        for fid, call in self._client.take_calls().items():
            self._calls_instance[fid] = self._client.instance_of(fid)  # None: a multi-process unit's client
            if fid not in self._calls or self._calls[fid].round != call.round:
                self._call_answers[fid] = 0
                self._answer_at_step.pop(fid, None)
            self._calls[fid] = call
        due = []
        for fid, call in list(self._calls.items()):
            held = self.held.get(fid)
            instance = self._calls_instance.get(fid)
            if held is None or (instance is not None and held[0] != instance):
                # The call came before this syncer life's copy of the fragment (a re-join sends
                # the calls first): a contribution now would be based on the previous life, which
                # the client drops. Answer once the copy is here.
                continue
            if held[1] > call.version:
                del self._calls[fid]  # the round merged without this work: it waits for the next
            elif (fid not in self.pending and self.c_steps[fid] > 0
                  and self.stats.steps >= self._answer_at_step.get(fid, 0)):
                # The call stays until the syncer accepts the contribution or the round closes: one
                # refused (or lost) is sent again with the steps taken since, _MAX_CALL_ANSWERS
                # times at once, then backing off (_MAX_ANSWER_BACKOFF_PERIODS).
                self._call_answers[fid] += 1
                self._answered_round[fid] = call.round
                beyond = self._call_answers[fid] - _MAX_CALL_ANSWERS
                if beyond >= 0:
                    periods = min(2 ** beyond, _MAX_ANSWER_BACKOFF_PERIODS)
                    self._answer_at_step[fid] = self.stats.steps + periods * self.plan.sync_period_steps
                due.append(fid)
        return sorted(due)

    def _contribute(self, fid: int, *, final: bool = False) -> client_lib.UploadJob | None:
        """Queues this learner's whole un-merged progress on a fragment (decoupled mode)."""
        base = self.held.get(fid)
        if base is None or self.c_steps[fid] == 0 or fid in self.pending:
            return None
        frag = self.plan.fragments[fid]
        delta = fragments_lib.pseudo_gradient(self.global_copy[fid],
                                              fragments_lib.flatten_fragment(self._host_params(frag), frag))
        if not np.all(np.isfinite(delta)):
            self._reset_nonfinite(fid)
            return None
        job = client_lib.UploadJob(
            fragment_id=fid, base_version=base[1], syncer_instance=base[0], steps=int(self.c_steps[fid]),
            tokens=int(self.c_tokens[fid]), delta=delta, local_step=self.stats.steps, final=final,
        )
        self.pending[fid] = arrival_lib.PendingContribution(
            mark_step=job.local_step, delta=delta, steps=job.steps, tokens=job.tokens, syncer_instance=base[0])
        self._jobs[fid] = job
        if self._before_upload is not None:
            self._before_upload(fid, job.local_step)
        self._client.submit_upload(job)
        self.stats.uploads_queued += 1
        return job

    def _reset_nonfinite(self, fid: int) -> None:
        # Diverged locally: never send it; start this fragment again from the global copy.
        _LOG.error("non-finite local fragment; resetting it to the global copy", extra={"fields": {"fragment": fid}})
        frag = self.plan.fragments[fid]
        for name, arr in fragments_lib.unflatten_fragment(self.global_copy[fid], frag).items():
            self.params[name] = self._train_step.place(name, arr)
        self.c_steps[fid] = 0
        self.c_tokens[fid] = 0
        self.stats.resets_nonfinite += 1

    def finish(self, timeout_s: float) -> bool:
        """Ends training without losing work: contributes the remaining progress on every fragment
        (marked final, so the syncer opens those rounds at once) and waits until the global model
        holds it, at most `timeout_s`. Returns True when nothing of this learner's work is left
        outside the global model (decoupled), or the last barrier completed (synchronous modes)."""
        self.finished = True
        deadline = time.monotonic() + timeout_s
        self.apply_updates()
        self._client.set_progress(self.progress_request())
        if self.sync_mode != rounds_lib.DECOUPLED:
            arrivals = self._client.arrivals()
            jobs = [job for job in (self._queue_upload(fid) for fid in range(self.plan.num_fragments)
                                    if self.c_steps[fid] > 0) if job is not None]
            if jobs:
                self._wait_for_merges(jobs, arrivals, deadline_s=deadline)
            return not jobs or all(self.c_steps[job.fragment_id] == 0 for job in jobs)
        refused_before = self._not_taken.copy()
        while True:
            # A fragment refused again and again (a quarantined learner, a bound it exceeds) is given up.
            refused = self._not_taken - refused_before
            left = [fid for fid in range(self.plan.num_fragments)
                    if (self.c_steps[fid] > 0 or fid in self.pending) and refused[fid] < _FINISH_MAX_REFUSALS]
            if not left:
                return not refused.any()
            if self._agreed(time.monotonic() >= deadline) or self._should_stop_finish():
                _LOG.warning("finished with work not yet merged", extra={"fields": {"fragments": left}})
                return False
            for fid in left:
                self._contribute(fid, final=True)
            arrivals = self._client.arrivals()
            self._client.wait_for_arrivals({fid: arrivals.get(fid, 0) for fid in left}, timeout_s=0.1)
            self.apply_updates()
            self._client.set_progress(self.progress_request())

    def _agreed(self, flag: bool) -> bool:
        # A multi-process unit's processes must leave the loop at the same iteration (their
        # clocks differ): its client agrees on the flag (True when any process says so).
        return self._client.agree_any(flag)

    def _should_stop_finish(self) -> bool:
        return self._client.fenced is not None

    def _wait_for_merges(self, jobs: list, arrivals: dict[int, int], deadline_s: float = math.inf) -> None:
        """The synchronous modes' barrier: block until a new version of every uploaded fragment
        arrived, then fold them in."""
        started = time.monotonic()
        after = {job.fragment_id: arrivals.get(job.fragment_id, 0) for job in jobs}
        last_send = started
        while not self._client.wait_for_arrivals(after, timeout_s=1.0):
            if self._should_stop() or self._client.fenced is not None or time.monotonic() >= deadline_s:
                break
            if self._bases_superseded(jobs):
                # A newer version arrived while the step ran (counted in `arrivals` before the
                # barrier began): the round these uploads were for closed without them, and the
                # syncer refuses them as stale. Waiting for one more version would wait forever
                # (that round needs this learner); fold in what arrived and step again.
                break
            if time.monotonic() - last_send >= self._barrier_resend_s:
                # The merge has not come back: the upload may have been lost (a syncer restart,
                # a refused retry). Sending it again is idempotent on the syncer.
                for job in jobs:
                    self._client.submit_upload(job)
                self.stats.barrier_resends += 1
                last_send = time.monotonic()
        self.stats.wait_s += time.monotonic() - started
        self.apply_updates()

    def _bases_superseded(self, jobs: list) -> bool:
        """True when the client holds a newer version from the same syncer life of every job's fragment
        (a new life is waited for as before: its fragments arrive with the re-join)."""
        held = self._client.held_values()
        return all(job.syncer_instance == self._client.instance_of(job.fragment_id)
                   and held.get(job.fragment_id, (-1, None))[0] > job.base_version for job in jobs)

    def _queue_upload(self, fid: int, grads: dict | None = None) -> client_lib.UploadJob | None:
        for rfid, instance, version in self._client.take_refused():
            # Refused, not taken: this base may be sent again (with the steps taken since).
            if self._last_upload_base.get(rfid) == (instance, version):
                del self._last_upload_base[rfid]
        base = self.held.get(fid)
        # One contribution per base version: the syncer keys uploads on it, and a second one
        # would carry the same steps again.
        if base is None or self._last_upload_base.get(fid) == base or self.c_steps[fid] == 0:
            return None
        frag = self.plan.fragments[fid]
        if grads is not None:  # data-parallel baseline: the gradient itself is the contribution
            delta = fragments_lib.flatten_fragment(
                {t.name: self._train_step.to_host(grads[t.name]) for t in frag.tensors}, frag)
        else:
            local = fragments_lib.flatten_fragment(self._host_params(frag), frag)
            delta = fragments_lib.pseudo_gradient(self.global_copy[fid], local)
        if not np.all(np.isfinite(delta)):
            self._reset_nonfinite(fid)
            return None
        job = client_lib.UploadJob(
            fragment_id=fid, base_version=base[1], syncer_instance=base[0],
            steps=int(self.c_steps[fid]), tokens=int(self.c_tokens[fid]), delta=delta, local_step=self.stats.steps,
        )
        self._client.submit_upload(job)
        self._last_upload_base[fid] = base
        self.stats.uploads_queued += 1
        return job

    def progress_request(self) -> syncer_pb2.ReportProgressRequest:
        return syncer_pb2.ReportProgressRequest(
            protocol_version=serde.PROTOCOL_VERSION,
            learner_id=self._learner_id,
            incarnation=self._incarnation,
            local_step=self.stats.steps,
            tokens_total=self.stats.tokens,
            fragments=[
                syncer_pb2.FragmentProgress(fragment_id=f, steps=int(self.c_steps[f]), tokens=int(self.c_tokens[f]))
                for f in range(self.plan.num_fragments)
            ],
            step_time_s=self.stats.step_time_ema.value or 0.0,
            inner_loss=self.stats.loss_ema.value or 0.0,
            held=serde.versions_to_proto({f: v for f, (_, v) in self.held.items()}),
            finished=self.finished,
        )

    # ------------------------------------------------------------------------------ resume

    def set_before_upload(self, hook: Callable[[int, int], None] | None) -> None:
        """`hook(fragment, step)` runs before each contribution goes to the client."""
        self._before_upload = hook

    def export_snapshot(self, identity: snapshot_lib.RunIdentity, sampler_position: dict,
                        data_shard: int) -> snapshot_lib.LearnerSnapshot:
        """This learner's state as host arrays, for SnapshotStore.write (decoupled mode)."""
        pending = {}
        for fid, p in self.pending.items():
            job = self._jobs.get(fid)
            values = p.sent
            if values is None and job is not None and job.local_step == p.mark_step:
                values = job.sent_values  # decoded as the syncer will merge it, once encoded
            pending[fid] = snapshot_lib.PendingRecord(p.mark_step, p.steps, p.tokens,
                                                      p.delta if values is None else values)
        return snapshot_lib.LearnerSnapshot(
            identity=identity, step=self.stats.steps, tokens_total=self.tokens_before + self.stats.tokens,
            params={name: np.array(self._train_step.to_host(v), np.float32) for name, v in self.params.items()},
            opt_leaves=snapshot_lib.opt_state_to_host(self.opt_state),
            held=dict(self.held), global_copy=dict(self.global_copy),
            c_steps=self.c_steps.copy(), c_tokens=self.c_tokens.copy(), pending=pending,
            sampler=sampler_position, data_shard=data_shard)

    def resume(self, snap: snapshot_lib.LearnerSnapshot, sent_after: set[int]) -> dict:
        """Continues from a snapshot: its parameters, optimizer state, counters, held global
        fragments and step. Call before the first apply_updates: the syncer's current fragments then
        fold in as any late arrival does (rebase keeps the snapshot's un-merged progress).

        What the previous life did after the snapshot is unknown, and the syncer's receipts speak
        only for the life that sent a contribution. Never counting work twice, this assumes the worst
        for work, not for the model: a contribution pending at the snapshot is taken as merged (its
        values leave the progress, its counts the counters), and a fragment contributed after the
        snapshot (`sent_after`, the journal) restarts from its held global copy. Work the previous
        life did after the snapshot is lost unless it reached the syncer. Returns what it did.
        SnapshotMismatch (nothing changed) when the tensors or the optimizer differ."""
        if self.global_copy:
            raise RuntimeError("resume() must come before the first apply_updates()")
        shapes = {name: tuple(np.shape(v)) for name, v in self.params.items()}
        saved = {name: tuple(v.shape) for name, v in snap.params.items()}
        if saved != shapes:
            raise snapshot_lib.SnapshotMismatch("the snapshot's tensors differ from the model's")
        opt_state = snapshot_lib.opt_state_from_host(self.opt_state, snap.opt_leaves)
        params = {name: np.array(v, np.float32) for name, v in snap.params.items()}
        c_steps, c_tokens = snap.c_steps.astype(np.int64), snap.c_tokens.astype(np.int64)
        dropped, assumed_merged = [], []
        for fid, frag in enumerate(self.plan.fragments):
            if fid not in snap.global_copy:
                continue  # never held: the first copy replaces it, as at a fresh start
            if fid in sent_after:
                local, c_steps[fid], c_tokens[fid] = snap.global_copy[fid], 0, 0
                dropped.append(fid)
            elif fid in snap.pending:
                record = snap.pending[fid]
                local = fragments_lib.flatten_fragment(params, frag) + record.values
                c_steps[fid] = max(0, int(c_steps[fid]) - record.steps)
                c_tokens[fid] = max(0, int(c_tokens[fid]) - record.tokens)
                assumed_merged.append(fid)
            else:
                continue
            params.update(fragments_lib.unflatten_fragment(np.asarray(local, np.float32), frag))
        self.params = {name: self._train_step.place(name, arr) for name, arr in params.items()}
        self.opt_state = opt_state
        self.c_steps, self.c_tokens = c_steps, c_tokens
        self.global_copy = {fid: np.asarray(v, np.float32) for fid, v in snap.global_copy.items()}
        self.held = dict(snap.held)
        self.stats.steps = self.stats.resumed_from_step = snap.step
        self.tokens_before = snap.tokens_total
        return {"step": snap.step, "contributed_after_snapshot": sorted(dropped),
                "pending_assumed_merged": sorted(assumed_merged),
                "opt_state_sha256": snapshot_lib.leaves_sha256(snapshot_lib.opt_state_to_host(self.opt_state))}
