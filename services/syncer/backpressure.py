"""Back-pressure: how much later than its schedule a learner should send its next upload.

Owns `LoadGauge`: the syncer's saturation, read as the event loop's lag (how late a timer that
should fire every `TICK_S` fires; the servicer's upload path, decode on arrival included, runs on
that loop, so a syncer that cannot keep up with its uploads shows it there first, and so does a
machine whose cores are taken), and the factor by which learners should stretch the interval
between their uploads of a fragment. A controller with memory: the factor grows while the lag
stays above `TARGET_LAG_S` and shrinks back towards 1 once it is below, so that at saturation
the offered upload rate settles where the syncer keeps up instead of oscillating between "send
everything" and "send nothing".

The hint a response carries (UploadFragmentResponse.next_upload_after_s) is the extra time,
beyond the fragment's own period, before that learner's next upload of the fragment: the learner
folds the periods in between into one contribution (its work is kept, never dropped). No upload
is refused for load: uploads beyond the servicer's slots wait for one (SyncerServicer).
Also owns `decoding_bound`: how many contributions a syncer holds decoded at once (the rest wait).
Must not: read configuration or know about gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

TICK_S = 0.05  # how often the loop's lag is sampled
TARGET_LAG_S = 0.01  # above this (smoothed), with uploads contending, the syncer counts as saturated
_SMOOTHING = 0.2  # weight of the newest lag sample
_STEP = 1.06  # the factor moves by this ratio per tick (x2 in ~0.6 s)
MAX_FACTOR = 32.0  # at most this many periods folded into one contribution


class LoadGauge:
    """See the module docstring. `start` on the servicer's loop, `stop` at shutdown."""

    def __init__(self, clock=time.monotonic, contended=lambda: True) -> None:
        """`contended()`: whether uploads are competing for the syncer now (the servicer: more
        than one in flight). Lag without it is other processes' load on the machine, not uploads
        the syncer cannot keep up with: slowing learners down would not help."""
        self._clock = clock
        self._contended = contended
        self.lag_s = 0.0  # smoothed event-loop lag
        self.factor = 1.0  # interval stretch learners are asked for (1: their own schedule)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="syncer-load-gauge")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            before = self._clock()
            await asyncio.sleep(TICK_S)
            self.observe(max(0.0, self._clock() - before - TICK_S))

    def observe(self, lag_s: float) -> None:
        """One lag sample: updates the smoothed lag and the factor."""
        self.lag_s += _SMOOTHING * (lag_s - self.lag_s)
        if self.lag_s > TARGET_LAG_S and self._contended():
            self.factor = min(MAX_FACTOR, self.factor * _STEP)
        else:
            self.factor = max(1.0, self.factor / _STEP)

    def next_upload_after_s(self, period_s: float) -> float:
        """The extra wait before a learner's next upload of a fragment whose period (its sync
        period in seconds at the learners' step time) is `period_s`; 0 when not saturated."""
        if self.factor <= 1.0 or not math.isfinite(period_s) or period_s <= 0:
            return 0.0
        return (self.factor - 1.0) * period_s


def decoding_bound(owned: frozenset[int], min_others: int) -> int:
    """Contributions between decode and fold-in at once (Admission's `max_decoding`): enough for
    each fragment this syncer owns to have one judged against `min_others` others (the direction
    check waits for them), no more. Counted over the owned fragments, not the plan's: a shard of
    N would otherwise let N times its share of fragment-sized decoded values in at once (at 1B
    parameters and 4 shards, 1 GB each). Unsharded, every fragment is owned: the bound is the one
    Admission has always used. More uploads wait for a permit; none is refused for it."""
    return max(1, len(owned)) * (min_others + 1)
