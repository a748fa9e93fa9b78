"""When to merge a fragment's open round: minimum quorum plus an adaptive grace window.

Owns: ``Ema`` (smoothing of measured step/quorum/sync times), ``grace_window_s``
(Decoupled DiLoCo Eq. 3) and ``decide_merge``, a pure decision over one round.
Must not: read the clock, sleep, or hold state about rounds; the caller passes ``now_s``
(monotonic seconds) and acts on the returned decision.

Eq. 3: the syncer may wait for more learners only as long as the wait stays hidden behind
the τ inner steps a fragment's communication overlaps, so no learner ever blocks:
    ξ_grace = γ · max(0, τ·ξ_step - ξ_quorum - ξ_sync),  γ in [0, 1].
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class Ema:
    """Exponential moving average; ``value`` is None until the first update."""

    def __init__(self, alpha: float = 0.2) -> None:
        """Creates an empty average.

        Args:
            alpha: weight of each new sample, in (0, 1]; 1 keeps only the latest sample.

        Raises:
            ValueError: if ``alpha`` is outside (0, 1].
        """
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha={alpha} is invalid: must be in (0, 1]")
        self._alpha = alpha
        self._value: float | None = None

    @property
    def value(self) -> float | None:
        """The current average, or None before the first sample."""
        return self._value

    def update(self, x: float) -> float:
        """Adds a sample and returns the new average (the first sample is taken as is).

        Raises:
            ValueError: if ``x`` is not finite.
        """
        if not math.isfinite(x):
            raise ValueError(f"x={x} is not finite: only add measured, finite samples")
        if self._value is None:
            self._value = float(x)
        else:
            self._value += self._alpha * (x - self._value)
        return self._value


def grace_window_s(
    *,
    step_time_s: float,
    quorum_time_s: float,
    sync_time_s: float,
    tau_steps: int,
    gamma: float,
) -> float:
    """Returns how long to keep a round open after quorum (Eq. 3).

    Args:
        step_time_s: ξ_step, (smoothed) inner-step time.
        quorum_time_s: ξ_quorum, (smoothed) time from a round's first contribution to quorum.
        sync_time_s: ξ_sync, (smoothed) time to merge and broadcast a fragment.
        tau_steps: τ, inner steps a fragment's communication may overlap.
        gamma: γ, safety factor in [0, 1]; 0 disables the grace window.

    Returns:
        ``gamma * max(0, tau_steps * step_time_s - quorum_time_s - sync_time_s)``, >= 0.

    Raises:
        ValueError: on a negative or non-finite time, ``tau_steps < 0``, or ``gamma``
            outside [0, 1].
    """
    times = {"step_time_s": step_time_s, "quorum_time_s": quorum_time_s, "sync_time_s": sync_time_s}
    for field, value in times.items():
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{field}={value} is invalid: must be finite and >= 0")
    if tau_steps < 0:
        raise ValueError(f"tau_steps={tau_steps} is invalid: must be >= 0")
    if not 0 <= gamma <= 1:
        raise ValueError(f"gamma={gamma} is invalid: must be in [0, 1]")
    return gamma * max(0.0, tau_steps * step_time_s - quorum_time_s - sync_time_s)


@dataclass(frozen=True)
class RoundView:
    """What the syncer knows about one fragment's open merge round.

    Attributes:
        opened_at_s: arrival time of the round's first contribution (lets the caller
            measure ξ_quorum; not used by ``decide_merge``).
        contributors: contributions accepted into this round.
        quorum_reached_at_s: when ``contributors`` first reached the minimum quorum, or
            None while below it.
        expected_contributors: live members that could still contribute; the round merges
            early once all of them have.
        quorum_reachable: False once too few learners remain that could ever contribute
            (the others finished or left) to bring the round to the minimum quorum; such a
            round merges below quorum once every expected contributor is in, so that the
            last work is not held by a quorum that cannot form.
    """

    opened_at_s: float
    contributors: int
    quorum_reached_at_s: float | None
    expected_contributors: int
    quorum_reachable: bool = True


@dataclass(frozen=True)
class MergeDecision:
    """Whether to merge a round now.

    Attributes:
        merge: merge the round now.
        wake_at_s: when not merging, when to decide again (None: only on the next
            contribution).
        reason: ``"below_quorum"``, ``"grace"``, ``"all_contributed"``,
            ``"grace_expired"`` or ``"quorum_unreachable"``.
    """

    merge: bool
    wake_at_s: float | None
    reason: str


def decide_merge(
    now_s: float, round_: RoundView, *, min_quorum: int, grace_s: float
) -> MergeDecision:
    """Decides whether a fragment's open round should be merged now.

    Below quorum the round waits for contributions, unless the quorum can no longer be
    reached (``round_.quorum_reachable`` False) and every expected contributor is in: it then
    merges what it holds (a round with no contribution never merges). At or above quorum it
    merges once every expected contributor is in, or once the grace window after quorum has
    passed; until then it waits for the window's end. With ``grace_s == 0`` it merges as soon
    as the quorum is reached.

    Args:
        now_s: current time, on the same clock as the round's timestamps.
        round_: the round.
        min_quorum: K, contributions needed before merging (>= 1).
        grace_s: grace window after quorum, e.g. from ``grace_window_s`` (>= 0).

    Returns:
        The decision.

    Raises:
        ValueError: on ``min_quorum < 1``, a negative or non-finite ``grace_s``, or a
            round at quorum without ``quorum_reached_at_s``.
    """
    if min_quorum < 1:
        raise ValueError(f"min_quorum={min_quorum} is invalid: must be >= 1")
    if not (math.isfinite(grace_s) and grace_s >= 0):
        raise ValueError(f"grace_s={grace_s} is invalid: must be finite and >= 0")
    if round_.contributors < min_quorum:
        if (not round_.quorum_reachable and round_.contributors >= 1
                and round_.contributors >= round_.expected_contributors):
            return MergeDecision(merge=True, wake_at_s=None, reason="quorum_unreachable")
        return MergeDecision(merge=False, wake_at_s=None, reason="below_quorum")
    if round_.quorum_reached_at_s is None:
        raise ValueError(
            f"round has contributors={round_.contributors} >= min_quorum={min_quorum} but "
            "quorum_reached_at_s=None: set it when the round reaches quorum"
        )
    if round_.contributors >= round_.expected_contributors:
        return MergeDecision(merge=True, wake_at_s=None, reason="all_contributed")
    deadline_s = round_.quorum_reached_at_s + grace_s
    if now_s >= deadline_s:
        return MergeDecision(merge=True, wake_at_s=None, reason="grace_expired")
    return MergeDecision(merge=False, wake_at_s=deadline_s, reason="grace")
