"""The syncer's round schedule: when each fragment's merge round opens.

Owns: ``RoundSchedule``, the syncer's *global step* (the mean progress of the live learners, from
their progress reports) and the staggered slots at which each fragment's round opens.
Must not: read the clock, do I/O, or know about contributions; the caller feeds progress reports
and opens the rounds it is told are due.

Decoupled DiLoCo's rounds belong to the syncer (paper §1.3: "for global step s: p <- fragment
scheduled at s"): fragment p's round opens at global steps ``offset_p + n*H`` (n >= 0, and never
at step 0: a fragment at offset 0 first opens at H), every live learner is called to contribute
p in that round, and the round merges at quorum plus the grace window. A learner's own step
counter decides nothing: learners in different phases (a restart, a slower chip) still
contribute to the same rounds.

The global step advances by the mean of the learners' step increments: each progress report adds
``(local_step - previous local_step) / live learners``, so with every learner stepping once the
global step advances by one, whatever the number of learners or their speeds. A learner's first
report (a new life) only sets its baseline, so restarts never move the schedule backwards.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from ddiloco.algo import fragments as fragments_lib

# How learners and the syncer synchronize (RunConfig.sync_mode): Decoupled DiLoCo's rounds, and the
# two baselines it is compared with (synchronous DiLoCo, data-parallel through the syncer). The
# strings are the wire's and the CLI's (RunConfig.sync_mode, --sync-mode): compare with these names.
DECOUPLED, DILOCO, DP = SYNC_MODES = ("decoupled", "diloco", "dp")

# Sums of fractions of a step (1/3 + 1/3 + 1/3) fall short of whole steps in floating point.
_STEP_EPS = 1e-6


class RoundSchedule:
    """The global step and the next opening of each fragment's round."""

    def __init__(self, plan: fragments_lib.FragmentPlan, *, global_step: float = 0.0) -> None:
        """Starts the schedule at `global_step` (a restored syncer passes the step it had)."""
        self.period_steps = plan.sync_period_steps
        self.global_step = float(global_step)
        self._last_step: dict[Hashable, int] = {}
        self._next_open: list[float] = []
        for frag in plan.fragments:
            first = frag.offset_steps if frag.offset_steps > 0 else self.period_steps
            self._next_open.append(self._first_slot_after(first, self.global_step))

    def _first_slot_after(self, slot: float, step: float) -> float:
        while slot <= step + _STEP_EPS and step > 0:
            slot += self.period_steps
        return slot

    def observe(self, learner: Hashable, local_step: int, live_learners: int) -> None:
        """Adds one progress report: `learner` (any key for one life of one learner) has taken
        `local_step` steps; `live_learners` (>= 1) learners share the schedule."""
        previous = self._last_step.get(learner)
        self._last_step[learner] = local_step
        if previous is None or local_step <= previous:
            return  # a new life's baseline (or a repeated report): no progress to count
        self.global_step += (local_step - previous) / max(live_learners, 1)

    def forget(self, learner: Hashable) -> None:
        """Drops a learner's baseline (it left, or a newer life replaced it)."""
        self._last_step.pop(learner, None)

    def due(self, is_open: Callable[[int], bool]) -> list[int]:
        """Fragments whose round should open now, in id order; advances their next opening.

        A fragment whose previous round is still open (`is_open(fid)`) stays due: its round opens
        as soon as the previous one has merged, then the schedule skips to the first slot after
        the current global step (late rounds are not made up for by opening several at once).
        """
        out = []
        for fid, slot in enumerate(self._next_open):
            if self.global_step + _STEP_EPS >= slot and not is_open(fid):
                out.append(fid)
                self._next_open[fid] = self._first_slot_after(slot, self.global_step)
        return out

    def next_open(self, fragment_id: int) -> float:
        """The global step at which the fragment's next round is scheduled."""
        return self._next_open[fragment_id]
