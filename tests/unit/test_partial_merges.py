"""Partial merges and the outer step (ddiloco.algo.outer.merge_share), pure: merge, re-anchoring,
rebase and Nesterov steps on flat vectors, no syncer.

With "steps" (the syncer's default until 2026-11-26) a merge that holds 1 of M expected learners
moves the global fragment by a whole round's delta with a whole momentum push: with learners out of step (a loaded
machine, no grace window) the syncer takes M full steps per round of work and feeds its own moves
back through the re-anchoring of stale contributions, a loop that diverges in these loops. "work"
(now the default) counts the absent learners as zero pseudo-gradients. These are pure loops; neither mode's
effect on a full run's quality or goodput is shown here.
"""

from __future__ import annotations

import numpy as np
import pytest

from ddiloco.algo import arrival as arrival_lib
from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import merge as merge_lib
from ddiloco.algo import outer as outer_lib
from ddiloco.algo import reanchor as reanchor_lib

H = 8
FRAGMENT = fragments_lib.Fragment(0, tuple(fragments_lib.TensorSpec(f"t{i}", (16,)) for i in range(4)), 0)


def test_merge_share_of_each_mode():
    lone = [(800, 8)]  # one learner's H steps (100 tokens a step)
    share = outer_lib.merge_share
    assert share("whole", lone, contributors=1, expected_contributors=2, sync_period_steps=H) == (1.0, 1.0)
    assert share("steps", lone, contributors=1, expected_contributors=2, sync_period_steps=H) == (1.0, 1.0)
    assert share("work", lone, contributors=1, expected_contributors=2, sync_period_steps=H) == (0.5, 0.5)
    # A learner that missed a round brings two rounds' work: alone, that is one round of both learners.
    assert share("work", [(1600, 16)], contributors=1, expected_contributors=2, sync_period_steps=H) == (1.0, 0.5)
    assert share("steps", [(1600, 16)], contributors=1, expected_contributors=2, sync_period_steps=H) == (2.0, 1.0)
    # Every expected learner in the merge: "work" is "steps" (a short first round: a fraction of a step).
    both = [(400, 4), (400, 4)]
    assert share("work", both, contributors=2, expected_contributors=2, sync_period_steps=H) == (0.5, 1.0)
    assert share("work", both, contributors=2, expected_contributors=2, sync_period_steps=H) == \
        share("steps", both, contributors=2, expected_contributors=2, sync_period_steps=H)
    assert share("work", [(0, 3)], contributors=1, expected_contributors=4, sync_period_steps=H) == (1.0, 1.0)
    with pytest.raises(ValueError, match="half"):
        share("half", lone, contributors=1, expected_contributors=1, sync_period_steps=H)


def _lone_merge(stepper, params, state, delta, *, rule: str, mode: str, learners: int):
    """One learner's contribution of H steps merged alone, `learners` expected."""
    accumulator = merge_lib.MergeAccumulator(FRAGMENT, rule=rule)
    accumulator.add(delta, merge_lib.contribution_weight(100 * H, H), key="m", steps=H)
    share = outer_lib.merge_share(mode, [(100 * H, H)], contributors=1, expected_contributors=learners,
                                  sync_period_steps=H)
    merged = outer_lib.scale_delta(accumulator.scaled_result(), share.delta_scale)
    stepped = stepper.step_scaled(params, state, *merged, fraction=share.fraction)
    return stepped.params.copy(), [stepped.state[0].copy()]


@pytest.mark.parametrize("rule", ["rda", "mean"])
def test_lone_stale_merges_send_the_syncers_own_moves_back_amplified_unless_scaled_by_the_learners_share(rule):
    # Two learners take turns, each merged alone and one version stale, with no work of its own:
    # its re-anchored contribution is exactly the syncer's last move, Θ_v - Θ_(v-1). A whole
    # step per lone merge sends it back x η(1 + μ) = 1.33 and the moves grow (|λ| = 1.04 per
    # merge); with the learners' share (1/2) they die out (|λ| = 0.84). RDA and the mean agree:
    # one contribution is its own mean and its own RDA.
    stepper = outer_lib.OuterStepper(outer_lib.make_outer_optimizer(0.7, 0.9))
    moves = {}
    for mode in ("steps", "work"):
        rng = np.random.default_rng(0)
        history = [np.zeros(FRAGMENT.numel, np.float32)]
        params, state = history[0], stepper.init(history[0])
        first = (0.01 * rng.standard_normal(FRAGMENT.numel)).astype(np.float32)
        params, state = _lone_merge(stepper, params, state, first, rule=rule, mode=mode, learners=2)
        history.append(params)
        for _ in range(120):
            stale = reanchor_lib.reanchor(np.zeros_like(params), history[-2], history[-1])
            params, state = _lone_merge(stepper, params, state, stale, rule=rule, mode=mode, learners=2)
            history.append(params)
        first_move = np.linalg.norm(history[1] - history[0])
        moves[mode] = np.linalg.norm(history[-1] - history[-2]) / first_move
    assert moves["steps"] > 20, moves  # 1.04 ** 120 ~ 80
    assert moves["work"] < 1e-6, moves  # 0.84 ** 120 ~ 1e-9


def _desynchronised_run(rule: str, mode: str, *, latency_steps: int = 4, steps: int = 400) -> list[float]:
    """Two rebasing learners (SGD on a noisy quadratic) whose contributions are H steps apart by
    half a period, so every merge holds one of them; uploads reach the syncer and versions reach
    the learners `latency_steps` steps late (a loaded machine). The loss of Θ at the start and
    after every step."""
    rng = np.random.default_rng(1)
    curvature = np.exp(rng.uniform(np.log(0.1), np.log(3.0), FRAGMENT.numel)).astype(np.float32)
    optimum = rng.standard_normal(FRAGMENT.numel).astype(np.float32)
    stepper = outer_lib.OuterStepper(outer_lib.make_outer_optimizer(0.7, 0.9))
    params = np.zeros(FRAGMENT.numel, np.float32)
    state, versions, published, in_flight = stepper.init(params), [params], [], []
    losses = [0.5 * float(np.sum(curvature * optimum**2))]
    learners = [{"local": params, "held": 0, "steps": 0, "pending": None, "offset": o} for o in (0, H // 2)]
    for t in range(1, steps + 1):
        for index, me in enumerate(learners):
            for visible_at, version, merged_mark in published:
                if visible_at <= t and version > me["held"]:
                    folded = arrival_lib.fold_in(rule="rebase", local=me["local"], held=versions[me["held"]],
                                                 new=versions[version], pending=me["pending"],
                                                 merged_through_step=merged_mark.get(index, 0))
                    me["local"], me["held"] = folded.local, version
                    if folded.merged is not None:
                        me["steps"], me["pending"] = me["steps"] - folded.merged.steps, None
            noise = 0.5 * rng.standard_normal(FRAGMENT.numel).astype(np.float32)
            me["local"] = (me["local"] - 0.05 * (curvature * (me["local"] - optimum) + noise)).astype(np.float32)
            me["steps"] += 1
            if (t - me["offset"]) % H == 0 and me["pending"] is None:
                delta = versions[me["held"]] - me["local"]
                me["pending"] = arrival_lib.PendingContribution(t, delta, me["steps"], 100 * me["steps"])
                in_flight.append((t + latency_steps, index, delta, me["steps"], me["held"], t))
        for arrived in [c for c in in_flight if c[0] <= t]:
            in_flight.remove(arrived)
            _, index, delta, contribution_steps, base, mark = arrived
            accumulator = merge_lib.MergeAccumulator(FRAGMENT, rule=rule)
            tokens = 100 * contribution_steps
            accumulator.add(reanchor_lib.reanchor(delta, versions[base], versions[-1]),
                            merge_lib.contribution_weight(tokens, contribution_steps), steps=contribution_steps)
            share = outer_lib.merge_share(mode, [(tokens, contribution_steps)], contributors=1,
                                          expected_contributors=len(learners), sync_period_steps=H)
            merged = outer_lib.scale_delta(accumulator.scaled_result(), share.delta_scale)
            stepped = stepper.step_scaled(versions[-1], state, *merged, fraction=share.fraction)
            versions.append(stepped.params.copy())
            state = [stepped.state[0].copy()]
            published.append((t + latency_steps, len(versions) - 1, {index: mark}))
        losses.append(0.5 * float(np.sum(curvature * (versions[-1] - optimum) ** 2)))
    return losses


@pytest.mark.parametrize("rule", ["rda", "mean"])
def test_desynchronised_learners_diverge_with_whole_lone_steps_and_train_with_the_learners_share(rule):
    steps = _desynchronised_run(rule, "steps")
    work = _desynchronised_run(rule, "work")
    best = min(steps)
    assert best < 0.1 * steps[0] and steps[-1] > 100 * best, (steps[0], best, steps[-1])  # trained, then diverged
    assert max(work[len(work) // 2:]) < 0.1 * work[0], (work[0], work[-1])
    assert work[-1] < steps[-1] / 100


def test_the_weighted_mean_never_moves_further_than_rda_even_with_a_long_contribution():
    # Not the merge rule: the weighted mean's norm is at most RDA's (‖Σ w·v‖ / Σ w <= Σ w·‖v‖ / Σ w),
    # also when one contribution spans k rounds (k x the steps, so k x the weight and about k x the norm).
    rng = np.random.default_rng(3)
    for k in (1, 3, 10):
        vectors = [rng.standard_normal(FRAGMENT.numel).astype(np.float32) * scale for scale in (1.0, 1.0, k)]
        weights = [merge_lib.contribution_weight(100 * s, s) for s in (H, H, k * H)]
        merged = {}
        for rule in ("mean", "rda"):
            accumulator = merge_lib.MergeAccumulator(FRAGMENT, rule=rule)
            for vector, weight in zip(vectors, weights, strict=True):
                accumulator.add(vector, weight)
            merged[rule] = np.linalg.norm(accumulator.result())
        assert merged["mean"] <= merged["rda"] * (1 + 1e-6), (k, merged)
