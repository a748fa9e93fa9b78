"""Bounded influence: the merge's per-contribution share cap (ddiloco.algo.merge.MergeAccumulator
max_share) and the claimed-batch and norm clips (ddiloco.algo.robust.NormHistory)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import merge as merge_lib
from ddiloco.algo import robust as robust_lib

TensorSpec = fragments_lib.TensorSpec


def _fragment() -> fragments_lib.Fragment:
    return fragments_lib.Fragment(fragment_id=0, tensors=(TensorSpec("w", (64,)), TensorSpec("e", (32,), is_embedding=True)),
                                  offset_steps=0)


def _capped(weights: list[float], share: float) -> list[float]:
    """The weights a merge with the cap should use: the heaviest lowered to `share` of the total."""
    out = list(weights)
    top = int(np.argmax(out))
    rest = sum(out) - out[top]
    if rest > 0 and out[top] > share * sum(out):
        out[top] = share / (1 - share) * rest
    return out


@settings(max_examples=60, deadline=None)
@given(weights=st.lists(st.one_of(st.just(0.0), st.floats(1e-3, 1e4)), min_size=1, max_size=6), share=st.sampled_from([0.5, 0.6, 0.9, 1.0]),
       seed=st.integers(0, 2**31 - 1), rule=st.sampled_from(["rda", "mean"]))
def test_share_cap_equals_the_batch_merge_with_capped_weights(weights, share, seed, rule):
    """Whatever order contributions arrive in, the streamed merge with the cap is the batch merge
    whose heaviest weight is lowered to `share` of the total, and no share exceeds it."""
    fragment = _fragment()
    rng = np.random.default_rng(seed)
    deltas = [rng.normal(size=fragment.numel).astype(np.float32) for _ in weights]
    capped = _accumulate(fragment, deltas, weights, share, rule)
    reference = _accumulate(fragment, deltas, _capped(weights, share), 1.0, rule)
    np.testing.assert_allclose(capped.result(), reference.result(), rtol=2e-4, atol=2e-5)
    if sum(weights) > 0 and len(weights) > 1:
        assert max(_capped(weights, share)) <= share * capped.total_weight * (1 + 1e-9) or \
            sum(w for w in weights if w != max(weights)) == 0
    assert capped.count == len(weights)


def _accumulate(fragment, deltas, weights, share, rule):
    acc = merge_lib.MergeAccumulator(fragment, rule=rule, max_share=share)
    for i, (delta, weight) in enumerate(zip(deltas, weights, strict=True)):
        acc.add(delta, weight, key=f"l{i}")
    return acc


def test_a_heavy_contribution_is_capped_at_half_and_named():
    fragment = _fragment()
    acc = merge_lib.MergeAccumulator(fragment, max_share=0.5)
    ones = np.ones(fragment.numel, np.float32)
    acc.add(ones, 1.0, key="a")
    acc.add(ones * 2, 1600.0, key="hostile")
    acc.add(ones, 1.0, key="b")
    acc.add(ones, 1.0, key="c")
    acc.scaled_result()
    assert acc.capped == ("hostile", 1600.0, 3.0)
    assert acc.total_weight == pytest.approx(6.0)


def test_share_cap_outside_half_to_one_is_refused():
    with pytest.raises(ValueError, match="max_share"):
        merge_lib.MergeAccumulator(_fragment(), max_share=0.3)


def _norm_history(records, **policy):
    """A NormHistory of one 2-tensor fragment with (learner, tokens, steps, per-step norm) records."""
    history = robust_lib.NormHistory(robust_lib.NormBoundPolicy(**policy), _fragment())
    for learner, tokens, steps, norm in records:
        history.add(learner, np.array([norm * steps, 0.0]), steps, merge_lib.contribution_weight(tokens, steps))
    return history


def test_median_of_norms_clipping_scales_down_to_clip_factor_times_the_others_median():
    history = _norm_history([("a", 512, 4, 1.0), ("b", 512, 4, 2.0), ("c", 512, 4, 3.0)])
    # Per step: the others' median is 2; 4 x 2 = 8 per step is the most left whole.
    assert history.clip_scale("x", 8.0 * 4, 4) == 1.0
    assert history.clip_scale("x", 80.0 * 4, 4) == pytest.approx(0.1)
    assert history.norm_ratio("x", 80.0 * 4, 4) == pytest.approx(40.0)
    # Off, or without three other learners' contributions: nothing is clipped.
    assert _norm_history([("a", 512, 4, 1.0)] * 3, clip_factor=0.0).clip_scale("x", 1e6, 4) == 1.0
    assert _norm_history([("a", 512, 4, 1.0), ("x", 512, 4, 1.0)]).clip_scale("x", 1e6, 4) == 1.0


def test_the_issue_24_claims_buy_at_most_16x_per_step_and_the_share_cap_takes_the_rest():
    """4x steps and a 20x batch: weight 1,600x an honest contribution's before; the claimed batch
    is clipped to 4x the median (16x per step), and in a merge with three honest contributions
    the share cap leaves it half of the weight."""
    history = _norm_history([("a", 4 * 512, 4, 1.0), ("b", 4 * 512, 4, 1.0), ("c", 4 * 512, 4, 1.0)])
    honest = merge_lib.contribution_weight(4 * 512, 4)
    claimed = merge_lib.contribution_weight(16 * 20 * 512, 16)
    assert claimed / honest == pytest.approx(1600)
    capped = min(claimed, history.weight_cap("x", 4))  # the syncer credits the 4 steps it can vouch for
    assert capped / honest == pytest.approx(16)
    acc = merge_lib.MergeAccumulator(_fragment(), max_share=0.5)
    for learner, weight in (("a", honest), ("b", honest), ("c", honest), ("x", capped)):
        acc.add(np.ones(_fragment().numel, np.float32), weight, key=learner)
    acc.scaled_result()
    assert acc.capped[0] == "x" and acc.capped[2] / acc.total_weight == pytest.approx(0.5)


def test_the_heaviest_contribution_is_clipped_to_the_merges_other_norms_without_history():
    """At the start of a run there is no norm history: the merge itself bounds its heaviest
    contribution's norm per step to max_norm_ratio x the median of the others'."""
    fragment = _fragment()
    acc = merge_lib.MergeAccumulator(fragment, max_share=0.5, max_norm_ratio=4.0, rule="mean", embedding_rule="mean")
    unit = np.zeros(fragment.numel, np.float32)
    unit[0] = 1.0
    acc.add(unit * 100, 50.0, key="hostile", steps=2)  # 50 per step
    acc.add(unit, 1.0, key="a", steps=1)
    acc.add(unit * 2, 1.0, key="b", steps=2)  # 1 per step
    merged = acc.result()
    assert acc.norm_clipped_key == "hostile" and acc.held_norm_scale == pytest.approx(8 / 100)
    # mean with weights 1, 1 and the capped 2: (1 + 2 + 2 x 8) / 4
    assert merged[0] == pytest.approx((1 + 2 + 2 * 8) / 4)


def test_the_largest_norm_is_clipped_even_when_it_does_not_weigh_the_most():
    """A scaled-up update with honest claims (not the heaviest) is the one clipped."""
    fragment = _fragment()
    acc = merge_lib.MergeAccumulator(fragment, max_share=0.5, max_norm_ratio=4.0, rule="mean", embedding_rule="mean")
    unit = np.zeros(fragment.numel, np.float32)
    unit[0] = 1.0
    acc.add(unit, 1.0, key="a", steps=1)
    acc.add(unit * 1000, 1.0, key="scaled", steps=1)
    acc.add(unit * 2, 1.5, key="b", steps=1)
    acc.add(unit * 3, 1.0, key="c", steps=1)
    merged = acc.result()
    # others' per-step norms 1, 2, 3: median 2, limit 8; b is the heaviest (1.5 of 4.5: not capped)
    assert acc.norm_clipped_key == "scaled" and acc.capped is None
    assert merged[0] == pytest.approx((1 + 8 + 1.5 * 2 + 3) / 4.5)
    assert acc.count == 4 and acc.total_weight == pytest.approx(4.5)
