"""Tests for ddiloco.algo.merge: weights, RDA, weighted and equal-weight means, the streaming accumulator."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import merge as merge_lib

TensorSpec = fragments_lib.TensorSpec
_BATCH_RULES = {"rda": merge_lib.radial_directional_average, "mean": merge_lib.weighted_mean,
                "equal_mean": merge_lib.equal_mean}


def _fragment(*specs: TensorSpec) -> fragments_lib.Fragment:
    return fragments_lib.Fragment(fragment_id=0, tensors=specs, offset_steps=0)


@st.composite
def _contributions(draw):
    """A fragment of 1-3 tensors, 1-5 flat deltas (some tensors zero) and their weights."""
    # Tensors of >= 2 values: with 1 value, opposite signs cancel exactly and the RDA
    # direction is undefined (any rounding decides it).
    sizes = draw(st.lists(st.integers(2, 20), min_size=1, max_size=3))
    embeddings = draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes)))
    fragment = _fragment(
        *(
            TensorSpec(f"t{i}", (n,), is_embedding=e)
            for i, (n, e) in enumerate(zip(sizes, embeddings, strict=True))
        )
    )
    count = draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    deltas = []
    for _ in range(count):
        delta = (rng.standard_normal(fragment.numel) * rng.uniform(0.01, 10)).astype(np.float32)
        if draw(st.booleans()):  # exercise φ(0) = 0 on a whole tensor
            delta[fragment.slices()["t0"]] = 0.0
        deltas.append(delta)
    weight = st.one_of(st.just(0.0), st.floats(0.01, 1e6))
    weights = draw(st.lists(weight, min_size=count, max_size=count))
    return fragment, deltas, weights


def _accumulate(fragment, deltas, weights, **rules) -> merge_lib.MergeAccumulator:
    acc = merge_lib.MergeAccumulator(fragment, **rules)
    for delta, weight in zip(deltas, weights, strict=True):
        acc.add(delta, weight)
    return acc


def test_contribution_weight_is_tokens_squared_over_steps():
    assert merge_lib.contribution_weight(tokens=100, steps=10) == 1000.0
    assert merge_lib.contribution_weight(tokens=0, steps=3) == 0.0
    # b tokens per step over s steps: weight b² · s, linear in steps.
    assert merge_lib.contribution_weight(64 * 6, 6) == 2 * merge_lib.contribution_weight(64 * 3, 3)


@pytest.mark.parametrize(("tokens", "steps", "match"), [(10, 0, "steps=0"), (-1, 1, "tokens=-1")])
def test_contribution_weight_rejects_bad_counts(tokens, steps, match):
    with pytest.raises(ValueError, match=match):
        merge_lib.contribution_weight(tokens, steps)


def test_rda_of_a_hand_computed_example():
    vectors = [np.array([3.0, 0.0]), np.array([0.0, 4.0])]

    out = merge_lib.radial_directional_average(vectors, [1.0, 3.0])

    # radius (1·3 + 3·4) / 4 = 3.75, along the unit vector of (1, 0) + 3·(0, 1).
    np.testing.assert_allclose(out, 3.75 * np.array([1.0, 3.0]) / math.sqrt(10), rtol=1e-6)
    assert out.dtype == np.float32


def test_weighted_mean_of_a_hand_computed_example():
    out = merge_lib.weighted_mean([np.array([1.0, 2.0]), np.array([3.0, 6.0])], [1.0, 3.0])
    np.testing.assert_allclose(out, [2.5, 5.0])


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 8), st.floats(0.1, 100), st.integers(0, 2**32 - 1))
def test_rda_keeps_the_norm_of_aligned_inputs(count, radius, seed):
    rng = np.random.default_rng(seed)
    direction = rng.standard_normal(50)
    direction /= np.linalg.norm(direction)
    vectors = [radius * direction] * count

    out = merge_lib.radial_directional_average(vectors, rng.uniform(0.1, 5, count))

    np.testing.assert_allclose(out, radius * direction, rtol=1e-5, atol=1e-6 * radius)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 8), st.integers(0, 2**32 - 1))
def test_rda_norm_is_the_weighted_mean_norm(count, seed):
    rng = np.random.default_rng(seed)
    vectors = [rng.standard_normal(30) * rng.uniform(0.1, 10) for _ in range(count)]
    weights = rng.uniform(0.1, 5, count)
    norms = np.array([np.linalg.norm(v) for v in vectors])

    out = merge_lib.radial_directional_average(vectors, weights)

    expected = weights @ norms / weights.sum()
    assert np.linalg.norm(out) == pytest.approx(expected, rel=1e-5)
    assert np.linalg.norm(out) <= norms.max() * (1 + 1e-6)


def test_rda_keeps_the_norm_of_nearly_orthogonal_inputs_where_mean_shrinks_it():
    rng = np.random.default_rng(0)
    radius, count = 3.0, 16
    vectors = []
    for _ in range(count):
        v = rng.standard_normal(20_000)
        vectors.append(radius * v / np.linalg.norm(v))
    weights = [1.0] * count

    rda = merge_lib.radial_directional_average(vectors, weights)
    mean = merge_lib.weighted_mean(vectors, weights)

    assert np.linalg.norm(rda) == pytest.approx(radius, rel=1e-5)
    assert np.linalg.norm(mean) == pytest.approx(radius / math.sqrt(count), rel=0.05)


@settings(max_examples=50, deadline=None)
@given(_contributions(), st.sampled_from(merge_lib.RULES), st.sampled_from(merge_lib.RULES))
def test_accumulator_equals_the_batch_rules_per_tensor(contributions, rule, embedding_rule):
    fragment, deltas, weights = contributions

    merged = _accumulate(
        fragment, deltas, weights, rule=rule, embedding_rule=embedding_rule
    ).result()

    assert merged.dtype == np.float32 and merged.shape == (fragment.numel,)
    for spec, where in zip(fragment.tensors, fragment.slices().values(), strict=True):
        batch = _BATCH_RULES[embedding_rule if spec.is_embedding else rule]
        expected = batch([d[where] for d in deltas], weights)
        np.testing.assert_allclose(merged[where], expected, rtol=1e-5, atol=1e-6)


@settings(max_examples=50, deadline=None)
@given(_contributions(), st.randoms(use_true_random=False))
def test_accumulator_is_permutation_invariant(contributions, random):
    fragment, deltas, weights = contributions
    order = list(range(len(deltas)))
    random.shuffle(order)

    merged = _accumulate(fragment, deltas, weights).result()
    shuffled = _accumulate(
        fragment, [deltas[i] for i in order], [weights[i] for i in order]
    ).result()

    # Sums are float32: another order rounds differently, by a few float32 ulps.
    np.testing.assert_allclose(shuffled, merged, rtol=1e-5, atol=1e-6)


@settings(max_examples=50, deadline=None)
@given(_contributions(), st.sampled_from(merge_lib.RULES), st.floats(0, 1e6))
def test_one_contributor_is_returned_unchanged(contributions, rule, weight):
    fragment, deltas, _ = contributions

    merged = _accumulate(fragment, deltas[:1], [weight], rule=rule, embedding_rule=rule).result()

    np.testing.assert_allclose(merged, deltas[0], rtol=1e-6)


def test_mean_rule_with_equal_weights_is_plain_averaging():
    fragment = _fragment(TensorSpec("a", (3,)), TensorSpec("b", (2, 2)))
    rng = np.random.default_rng(1)
    deltas = [rng.standard_normal(fragment.numel).astype(np.float32) for _ in range(5)]

    merged = _accumulate(fragment, deltas, [2.5] * 5, rule="mean").result()

    np.testing.assert_allclose(merged, np.mean(deltas, axis=0), rtol=1e-6)


def test_embedding_tensors_use_the_embedding_rule():
    fragment = _fragment(TensorSpec("embed", (2,), is_embedding=True), TensorSpec("w", (2,)))
    deltas = [
        np.array([3.0, 0.0, 3.0, 0.0], np.float32),
        np.array([0.0, 3.0, 0.0, 3.0], np.float32),
    ]

    merged = _accumulate(fragment, deltas, [1.0, 1.0]).result()
    swapped = _accumulate(fragment, deltas, [1.0, 1.0], rule="mean", embedding_rule="rda").result()

    rda = 3.0 / math.sqrt(2)
    np.testing.assert_allclose(merged, [1.5, 1.5, rda, rda], rtol=1e-6)
    np.testing.assert_allclose(swapped, [rda, rda, 1.5, 1.5], rtol=1e-6)


def test_zero_weights_fall_back_to_equal_weights_only_when_all_are_zero():
    fragment = _fragment(TensorSpec("w", (2,)))
    a, b, c = (np.array(v, np.float32) for v in ([1.0, 0.0], [0.0, 1.0], [4.0, 4.0]))

    all_zero = _accumulate(fragment, [a, b], [0.0, 0.0], rule="mean")
    zero_first = _accumulate(fragment, [a, b, c], [0.0, 0.0, 2.0], rule="mean")
    zero_last = _accumulate(fragment, [c, a], [2.0, 0.0], rule="mean")

    assert all_zero.total_weight == 0.0 and all_zero.count == 2
    np.testing.assert_allclose(all_zero.result(), [0.5, 0.5])
    np.testing.assert_allclose(zero_first.result(), c)
    np.testing.assert_allclose(zero_last.result(), c)
    assert zero_first.count == 3 and zero_first.total_weight == 2.0
    np.testing.assert_allclose(merge_lib.weighted_mean([a, b], [0.0, 0.0]), [0.5, 0.5])


def test_result_is_repeatable_and_fresh():
    fragment = _fragment(TensorSpec("w", (3,)))
    acc = _accumulate(fragment, [np.ones(3, np.float32)], [1.0])

    first = acc.result()
    first[:] = 0.0

    np.testing.assert_array_equal(acc.result(), np.ones(3))


@settings(max_examples=40, deadline=None)
@given(_contributions(), st.sampled_from(merge_lib.RULES))
def test_scaled_result_is_one_factor_per_tensor_and_materializes_to_result(contributions, rule):
    fragment, deltas, weights = contributions
    acc = _accumulate(fragment, deltas, weights, rule=rule)
    scaled = acc.scaled_result()

    bounds = [0] + [where.stop for where in fragment.slices().values()]
    assert scaled.bounds.tolist() == bounds and scaled.scales.dtype == np.float32
    assert scaled.materialize().tobytes() == acc.result().tobytes()


def test_scaled_result_of_extreme_magnitudes_is_written_out_carefully():
    fragment = _fragment(TensorSpec("tiny", (4,)), TensorSpec("w", (2,)))
    delta = np.array([1e-35, -2e-35, 3e-35, 0.0, 1.0, 2.0], np.float32)
    acc = _accumulate(fragment, [delta], [1.0])
    scaled = acc.scaled_result()

    assert scaled.bounds.tolist() == [0, 6] and scaled.scales.tolist() == [1.0]
    assert scaled.values is not acc.scaled_result().values  # fresh each time, not the sums
    # One contributor comes back unchanged (up to rounding), direction and norm both.
    np.testing.assert_allclose(scaled.values, delta, rtol=1e-5)


@pytest.mark.parametrize(
    ("delta", "weight", "match"),
    [
        (np.zeros(2, np.float32), 1.0, "needs a 1-D vector of 3"),
        (np.zeros((3, 1), np.float32), 1.0, "needs a 1-D vector of 3"),
        (np.array([0.0, np.nan, 0.0], np.float32), 1.0, "non-finite"),
        (np.array([0.0, np.inf, 0.0], np.float32), 1.0, "non-finite"),
        (np.zeros(3, np.float32), -1.0, "weight=-1.0"),
        (np.zeros(3, np.float32), math.nan, "weight=nan"),
        (np.zeros(3, np.float32), math.inf, "weight=inf"),
    ],
)
def test_add_rejects_bad_contributions_and_stays_unchanged(delta, weight, match):
    acc = merge_lib.MergeAccumulator(_fragment(TensorSpec("w", (3,))))

    with pytest.raises(ValueError, match=match):
        acc.add(delta, weight)

    assert acc.count == 0 and acc.total_weight == 0.0


def test_accumulator_rejects_unknown_rules_and_empty_results():
    fragment = _fragment(TensorSpec("w", (3,)))
    with pytest.raises(ValueError, match="rule='median'"):
        merge_lib.MergeAccumulator(fragment, rule="median")
    with pytest.raises(ValueError, match="embedding_rule='sum'"):
        merge_lib.MergeAccumulator(fragment, embedding_rule="sum")
    with pytest.raises(ValueError, match="no contributions"):
        merge_lib.MergeAccumulator(fragment).result()


@pytest.mark.parametrize("merge", list(_BATCH_RULES.values()))
def test_batch_rules_reject_bad_inputs(merge):
    with pytest.raises(ValueError, match="empty"):
        merge([], [])
    with pytest.raises(ValueError, match="one weight per vector"):
        merge([np.zeros(2)], [1.0, 2.0])
    with pytest.raises(ValueError, match="same shape"):
        merge([np.zeros(2), np.zeros(3)], [1.0, 1.0])
    with pytest.raises(ValueError, match="non-finite"):
        merge([np.array([np.nan])], [1.0])
    with pytest.raises(ValueError, match="finite and >= 0"):
        merge([np.zeros(2)], [-1.0])


def test_fold_kernel_is_numpys_multiply_then_add_and_tracks_each_sums_squared_norm():
    from ddiloco.algo import _kernels

    rng = np.random.default_rng(5)
    numel = 3 * 2048 + 77  # several kernel blocks and a partial one
    values = rng.standard_normal(numel).astype(np.float32)
    sums = rng.standard_normal(numel).astype(np.float32)
    bounds = np.array([0, 100, 100, 5000, numel], np.int64)  # an empty segment too
    coefs = np.array([0.37, 2.5, 0.0, -1.25], np.float32)  # coefficient 0: segment untouched
    squares = np.full(4, -1.0)
    expected = sums.copy()
    for k in (0, 1, 3):
        lo, hi = bounds[k], bounds[k + 1]
        expected[lo:hi] = expected[lo:hi] + np.multiply(values[lo:hi], coefs[k])
    _kernels.fold_segments(values, bounds, coefs, sums, squares)
    np.testing.assert_array_equal(sums, expected)  # bit for bit, no FMA
    for k in (0, 3):
        lo, hi = bounds[k], bounds[k + 1]
        assert squares[k] == pytest.approx(float(np.sum(sums[lo:hi].astype(np.float64) ** 2)), rel=1e-12)
    assert squares[1] == 0.0 and squares[2] == -1.0  # empty segment: sum 0; coefficient 0: not written


def test_scaled_result_norms_come_from_the_fold_and_match_a_fresh_pass():
    fragment = _fragment(TensorSpec("a", (5000,)), TensorSpec("b", (3000,)))
    rng = np.random.default_rng(9)
    acc = merge_lib.MergeAccumulator(fragment)
    deltas = [rng.standard_normal(fragment.numel).astype(np.float32) for _ in range(3)]
    for delta, weight in zip(deltas, (1.0, 2.0, 0.5), strict=True):
        acc.add(delta, weight)
    merged = acc.scaled_result()
    batch = merge_lib.radial_directional_average([d[:5000] for d in deltas], [1.0, 2.0, 0.5])
    np.testing.assert_allclose(merged.values[:5000] * merged.scales[0], batch, rtol=1e-5, atol=1e-7)
    # The factor is radius / ‖sums‖ with ‖sums‖ tracked by the fold: the merged tensor has the radius.
    radius = (1.0 * np.linalg.norm(deltas[0][:5000]) + 2.0 * np.linalg.norm(deltas[1][:5000])
              + 0.5 * np.linalg.norm(deltas[2][:5000])) / 3.5
    assert np.linalg.norm(acc.result()[:5000].astype(np.float64)) == pytest.approx(radius, rel=1e-6)


def test_add_with_the_callers_norms_equals_add_without_them():
    fragment = _fragment(TensorSpec("emb", (700,), is_embedding=True), TensorSpec("w", (1300,)), TensorSpec("z", (50,)))
    rng = np.random.default_rng(4)
    plain, given_norms = merge_lib.MergeAccumulator(fragment), merge_lib.MergeAccumulator(fragment)
    for weight in (3.0, 1.0, 0.25):
        delta = rng.standard_normal(fragment.numel).astype(np.float32)
        delta[2000:] = 0.0  # a zero tensor: φ(0) = 0
        norms = np.array([np.linalg.norm(delta[where].astype(np.float64)) for where in fragment.slices().values()])
        plain.add(delta, weight)
        given_norms.add(delta, weight, norms=norms)
    np.testing.assert_allclose(given_norms.result(), plain.result(), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("norms, match", [
    (np.array([1.0]), "one norm >= 0 per tensor"),
    (np.array([1.0, -2.0]), "one norm >= 0 per tensor"),
    (np.array([1.0, np.nan]), "non-finite"),
])
def test_add_rejects_bad_norms_and_stays_unchanged(norms, match):
    fragment = _fragment(TensorSpec("a", (3,)), TensorSpec("b", (2,)))
    acc = merge_lib.MergeAccumulator(fragment)
    acc.add(np.ones(5, np.float32), 1.0)
    before = acc.result()
    with pytest.raises(ValueError, match=match):
        acc.add(np.ones(5, np.float32), 1.0, norms=norms)
    assert acc.count == 1
    np.testing.assert_array_equal(acc.result(), before)


def test_scaled_result_carries_each_segments_sum_of_squares():
    fragment = _fragment(TensorSpec("a", (300,), is_embedding=True), TensorSpec("b", (4100,)))
    rng = np.random.default_rng(12)
    acc = merge_lib.MergeAccumulator(fragment)
    for weight in (1.0, 0.5):
        acc.add(rng.standard_normal(fragment.numel).astype(np.float32), weight)
    merged = acc.scaled_result()
    expected = [np.sum(merged.values[:300].astype(np.float64) ** 2), np.sum(merged.values[300:].astype(np.float64) ** 2)]
    np.testing.assert_allclose(merged.sum_squares, expected, rtol=1e-12)
    # ‖Δ‖ from them, without a pass: what the outer step reports.
    norm = math.sqrt(float(np.dot(merged.sum_squares, merged.scales.astype(np.float64) ** 2)))
    assert norm == pytest.approx(float(np.linalg.norm(acc.result().astype(np.float64))), rel=1e-6)


# Very different weights: what contribution_weight gives learners of very different batches
# and step counts, a learner with no tokens, and a tiny one.
_SKEWED_WEIGHTS = [1e6, 1.0, 0.0, 3e-4, 2.5e3]


def _skewed_deltas(fragment: fragments_lib.Fragment, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(fragment.numel) * scale).astype(np.float32) for scale in (0.1, 3.0, 1.0, 7.0, 0.5)]


def test_equal_mean_is_the_plain_mean_whatever_the_weights():
    assert "equal_mean" in merge_lib.RULES and merge_lib.EQUAL_MEAN == "equal_mean"
    fragment = _fragment(TensorSpec("embed", (40, 3), is_embedding=True), TensorSpec("w", (2500,)),
                         TensorSpec("zero", (7,)))
    deltas = _skewed_deltas(fragment, 21)
    for delta in deltas[1:]:
        delta[fragment.slices()["zero"]] = 0.0  # φ(0) matters not: a zero tensor is averaged like any other
    plain = np.mean(np.stack(deltas).astype(np.float64), axis=0)

    acc = _accumulate(fragment, deltas, _SKEWED_WEIGHTS, rule="equal_mean", embedding_rule="equal_mean")
    merged = acc.result()

    np.testing.assert_allclose(merged, plain, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(merge_lib.equal_mean(deltas, _SKEWED_WEIGHTS), plain, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(merge_lib.equal_mean(deltas), plain, rtol=1e-6, atol=1e-7)
    # The weights are still checked and summed, the count is every contribution.
    assert acc.count == 5 and acc.total_weight == pytest.approx(sum(_SKEWED_WEIGHTS))
    # Any other weights, in any order: the same mean.
    again = _accumulate(fragment, deltas[::-1], [0.0, 1.0, 0.0, 5e7, 1e-9], rule="equal_mean",
                        embedding_rule="equal_mean").result()
    np.testing.assert_allclose(again, merged, rtol=1e-5, atol=1e-6)
    # All weights 0 (no fallback needed): still the plain mean.
    zeros = _accumulate(fragment, deltas, [0.0] * 5, rule="equal_mean", embedding_rule="equal_mean").result()
    np.testing.assert_allclose(zeros, merged, rtol=1e-6, atol=1e-7)


def test_rda_and_the_weighted_mean_differ_from_the_equal_mean():
    fragment = _fragment(TensorSpec("embed", (40, 3), is_embedding=True), TensorSpec("w", (2500,)))
    deltas = _skewed_deltas(fragment, 22)
    equal = _accumulate(fragment, deltas, _SKEWED_WEIGHTS, rule="equal_mean", embedding_rule="equal_mean").result()
    default = _accumulate(fragment, deltas, _SKEWED_WEIGHTS).result()  # rda + weighted mean of embeddings
    unweighted_rda = _accumulate(fragment, deltas, [1.0] * 5, rule="rda", embedding_rule="rda").result()

    embed, w = fragment.slices().values()
    for where in (embed, w):
        assert not np.allclose(default[where], equal[where], rtol=1e-2, atol=1e-3)
    # Not only the weights: RDA with equal weights keeps the mean norm, the plain mean of nearly
    # orthogonal deltas shrinks it (here to two thirds: one delta of norm 7 dominates it).
    assert np.linalg.norm(unweighted_rda[w]) > 1.3 * np.linalg.norm(equal[w])
    np.testing.assert_allclose(
        np.linalg.norm(unweighted_rda[w]), np.mean([np.linalg.norm(d[w].astype(np.float64)) for d in deltas]),
        rtol=1e-5)


def test_equal_mean_beside_weighted_rules_keeps_zero_weight_contributions_in_its_tensors():
    fragment = _fragment(TensorSpec("embed", (6,), is_embedding=True), TensorSpec("w", (5,)))
    embed, w = fragment.slices().values()
    deltas = _skewed_deltas(fragment, 23)
    # Weights 0 first (the weighted tensors' equal-weight fallback, then reset), 0 among positive ones.
    weights = [0.0, 0.0, 4.0, 0.0, 1.0]

    acc = _accumulate(fragment, deltas, weights, rule="rda", embedding_rule="equal_mean")
    merged = acc.result()

    np.testing.assert_allclose(merged[embed], np.mean([d[embed] for d in deltas], axis=0), rtol=1e-5, atol=1e-6)
    expected_w = merge_lib.radial_directional_average([d[w] for d in deltas], weights)
    np.testing.assert_allclose(merged[w], expected_w, rtol=1e-5, atol=1e-6)
    swapped = _accumulate(fragment, deltas, weights, rule="equal_mean", embedding_rule="mean").result()
    np.testing.assert_allclose(swapped[w], np.mean([d[w] for d in deltas], axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(swapped[embed], merge_lib.weighted_mean([d[embed] for d in deltas], weights),
                               rtol=1e-5, atol=1e-6)


def test_equal_mean_scaled_result_is_sums_over_count_with_their_sum_of_squares():
    fragment = _fragment(TensorSpec("a", (300,), is_embedding=True), TensorSpec("b", (4100,)))
    deltas = _skewed_deltas(fragment, 24)
    given_norms = merge_lib.MergeAccumulator(fragment, rule="equal_mean", embedding_rule="equal_mean")
    for delta, weight in zip(deltas, _SKEWED_WEIGHTS, strict=True):
        norms = np.array([np.linalg.norm(delta[where].astype(np.float64)) for where in fragment.slices().values()])
        given_norms.add(delta, weight, norms=norms)
    plain = _accumulate(fragment, deltas, _SKEWED_WEIGHTS, rule="equal_mean", embedding_rule="equal_mean")

    merged = plain.scaled_result()
    assert merged.scales.tolist() == [np.float32(1 / 5)] * 2 and merged.bounds.tolist() == [0, 300, 4400]
    np.testing.assert_allclose(merged.values, np.sum(deltas, axis=0), rtol=1e-5, atol=1e-5)
    expected = [np.sum(merged.values[:300].astype(np.float64) ** 2), np.sum(merged.values[300:].astype(np.float64) ** 2)]
    np.testing.assert_allclose(merged.sum_squares, expected, rtol=1e-12)
    # ‖Δ‖ from the fold's sums of squares, as the outer step takes it.
    norm = math.sqrt(float(np.dot(merged.sum_squares, merged.scales.astype(np.float64) ** 2)))
    assert norm == pytest.approx(float(np.linalg.norm(plain.result().astype(np.float64))), rel=1e-6)
    assert given_norms.result().tobytes() == plain.result().tobytes()


def test_equal_mean_of_extreme_magnitudes_is_written_out_carefully():
    fragment = _fragment(TensorSpec("tiny", (4,)), TensorSpec("w", (2,)))
    a = np.array([1e-35, -2e-35, 3e-35, 0.0, 1.0, 2.0], np.float32)
    b = np.array([3e-35, 2e-35, 1e-35, 0.0, 3.0, 0.0], np.float32)
    # RDA on "tiny" takes the careful path; the equal-mean tensor is written out beside it.
    acc = _accumulate(fragment, [a, b], [1.0, 100.0], rule="rda", embedding_rule="equal_mean")
    mixed = _accumulate(fragment, [a, b], [1.0, 100.0], rule="equal_mean")
    scaled = acc.scaled_result()
    assert scaled.bounds.tolist() == [0, 6]
    np.testing.assert_allclose(scaled.values[:4], merge_lib.radial_directional_average([a[:4], b[:4]], [1.0, 100.0]),
                               rtol=1e-5)
    np.testing.assert_allclose(scaled.values[4:], merge_lib.radial_directional_average([a[4:], b[4:]], [1.0, 100.0]),
                               rtol=1e-5)
    np.testing.assert_allclose(mixed.result(), (a.astype(np.float64) + b) / 2, rtol=1e-5, atol=0)
