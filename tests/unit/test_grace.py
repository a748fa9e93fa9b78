"""Tests for ddiloco.algo.grace: EMA, the Eq. 3 grace window and every merge decision branch.

All times are explicit numbers; nothing sleeps or reads a clock.
"""

from __future__ import annotations

import math

import pytest

from ddiloco.algo import grace as grace_lib


def _round(contributors: int, quorum_at_s: float | None, expected: int) -> grace_lib.RoundView:
    return grace_lib.RoundView(
        opened_at_s=100.0,
        contributors=contributors,
        quorum_reached_at_s=quorum_at_s,
        expected_contributors=expected,
    )


def test_ema_starts_empty_then_follows_the_recurrence():
    ema = grace_lib.Ema(alpha=0.25)
    assert ema.value is None

    assert ema.update(8.0) == 8.0
    assert ema.update(4.0) == pytest.approx(8.0 + 0.25 * (4.0 - 8.0))
    assert ema.value == pytest.approx(7.0)


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.5])
def test_ema_rejects_alpha_outside_unit_interval(alpha):
    with pytest.raises(ValueError, match=f"alpha={alpha}"):
        grace_lib.Ema(alpha)


def test_ema_rejects_non_finite_samples():
    ema = grace_lib.Ema()
    with pytest.raises(ValueError, match="x=nan"):
        ema.update(math.nan)
    assert ema.value is None


def test_grace_window_follows_eq_3():
    # τ·ξ_step - ξ_quorum - ξ_sync = 2·1.0 - 0.3 - 0.2 = 1.5 s of slack, times γ.
    window_s = grace_lib.grace_window_s(
        step_time_s=1.0, quorum_time_s=0.3, sync_time_s=0.2, tau_steps=2, gamma=0.5
    )
    assert window_s == pytest.approx(0.75)


def test_grace_window_is_zero_without_slack_or_gamma():
    no_slack = grace_lib.grace_window_s(
        step_time_s=1.0, quorum_time_s=1.5, sync_time_s=1.0, tau_steps=2, gamma=0.9
    )
    no_gamma = grace_lib.grace_window_s(
        step_time_s=1.0, quorum_time_s=0.0, sync_time_s=0.0, tau_steps=2, gamma=0.0
    )
    assert no_slack == 0.0 and no_gamma == 0.0


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"step_time_s": -1.0}, "step_time_s=-1.0"),
        ({"quorum_time_s": math.inf}, "quorum_time_s=inf"),
        ({"sync_time_s": math.nan}, "sync_time_s=nan"),
        ({"tau_steps": -1}, "tau_steps=-1"),
        ({"gamma": 1.5}, "gamma=1.5"),
        ({"gamma": -0.1}, "gamma=-0.1"),
    ],
)
def test_grace_window_rejects_bad_inputs(overrides, match):
    times = {"step_time_s": 1.0, "quorum_time_s": 0.1, "sync_time_s": 0.1}
    with pytest.raises(ValueError, match=match):
        grace_lib.grace_window_s(**(times | {"tau_steps": 2, "gamma": 0.5} | overrides))


def test_below_quorum_waits_for_the_next_contribution():
    decision = grace_lib.decide_merge(105.0, _round(1, None, 4), min_quorum=2, grace_s=1.0)
    assert decision == grace_lib.MergeDecision(merge=False, wake_at_s=None, reason="below_quorum")


def test_below_an_unreachable_quorum_merges_once_every_expected_member_contributed():
    # K = 2 with one learner left that could contribute (the others finished or left): the old rule
    # held its round below quorum for good.
    alone = grace_lib.RoundView(opened_at_s=100.0, contributors=1, quorum_reached_at_s=None,
                                expected_contributors=1, quorum_reachable=False)
    decision = grace_lib.decide_merge(100.0, alone, min_quorum=2, grace_s=1.0)
    assert decision == grace_lib.MergeDecision(merge=True, wake_at_s=None, reason="quorum_unreachable")


@pytest.mark.parametrize(("contributors", "expected", "reachable"), [
    (1, 2, False),  # a live learner that may still answer the call
    (0, 1, False),  # nothing to merge
    (1, 1, True),  # a quorum that may still form (a silent learner may come back)
])
def test_below_quorum_waits_unless_the_quorum_is_unreachable_and_everyone_is_in(contributors, expected, reachable):
    view = grace_lib.RoundView(opened_at_s=100.0, contributors=contributors, quorum_reached_at_s=None,
                               expected_contributors=expected, quorum_reachable=reachable)
    assert grace_lib.decide_merge(105.0, view, min_quorum=2, grace_s=1.0).reason == "below_quorum"


def test_merges_early_once_every_expected_member_contributed():
    decision = grace_lib.decide_merge(101.0, _round(3, 101.0, 3), min_quorum=1, grace_s=5.0)
    assert decision == grace_lib.MergeDecision(merge=True, wake_at_s=None, reason="all_contributed")


def test_waits_for_the_grace_window_after_quorum():
    decision = grace_lib.decide_merge(101.2, _round(2, 101.0, 4), min_quorum=2, grace_s=0.5)
    assert decision == grace_lib.MergeDecision(merge=False, wake_at_s=101.5, reason="grace")


@pytest.mark.parametrize("now_s", [101.5, 107.0])
def test_merges_once_the_grace_window_has_passed(now_s):
    decision = grace_lib.decide_merge(now_s, _round(2, 101.0, 4), min_quorum=2, grace_s=0.5)
    assert decision == grace_lib.MergeDecision(merge=True, wake_at_s=None, reason="grace_expired")


def test_zero_grace_merges_as_soon_as_quorum_is_reached():
    decision = grace_lib.decide_merge(101.0, _round(1, 101.0, 4), min_quorum=1, grace_s=0.0)
    assert decision.merge and decision.reason == "grace_expired"


def test_decide_merge_rejects_bad_arguments():
    at_quorum = _round(2, 101.0, 4)
    with pytest.raises(ValueError, match="min_quorum=0"):
        grace_lib.decide_merge(101.0, at_quorum, min_quorum=0, grace_s=1.0)
    with pytest.raises(ValueError, match=r"grace_s=-1\.0"):
        grace_lib.decide_merge(101.0, at_quorum, min_quorum=1, grace_s=-1.0)
    with pytest.raises(ValueError, match="quorum_reached_at_s=None"):
        grace_lib.decide_merge(101.0, _round(2, None, 4), min_quorum=2, grace_s=1.0)
