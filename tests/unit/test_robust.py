"""ddiloco.algo.robust in isolation: the weight cap (by claimed batch) and the direction check."""

from __future__ import annotations

import numpy as np
import pytest

from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import robust as robust_lib
from ddiloco.algo.merge import contribution_weight

SPECS = [fragments_lib.TensorSpec("w", (64, 64)), fragments_lib.TensorSpec("b", (64,))]


def _fragment() -> fragments_lib.Fragment:
    return fragments_lib.plan_fragments(SPECS, 1, 1).fragments[0]


def _history(records, factor: float = 20.0) -> robust_lib.NormHistory:
    """NormHistory with (learner, tokens, steps) contributions of unit norms."""
    frag = _fragment()
    history = robust_lib.NormHistory(robust_lib.NormBoundPolicy(factor=factor), frag)
    for lid, tokens, steps in records:
        history.add(lid, np.ones(len(frag.tensors)), steps, contribution_weight(tokens, steps))
    return history


# ---------------------------------------------------------------------------- weight cap


def test_a_bigger_batch_unit_is_weighted_in_full():
    # Three 1-device learners (512 tokens per step) with varying steps; a 4-device unit with a 4x
    # batch weighs 16x per step, and more when its fragment waited longer: never capped.
    history = _history([("a", 2 * 512, 2), ("b", 4 * 512, 4), ("c", 3 * 512, 3)])
    for steps in (1, 2, 4, 8, 12):
        weight = contribution_weight(steps * 4 * 512, steps)
        assert weight <= history.weight_cap("big", steps), steps
    # A 20x batch (the hostile claim of issue 24) is clipped to batch_factor (4) x the median.
    assert contribution_weight(2 * 20 * 512, 2) > history.weight_cap("big", 2)
    assert history.weight_cap("big", 2) == pytest.approx(2 * (4 * 512) ** 2)


def test_inflated_tokens_are_capped_at_batch_factor_times_the_median_batch():
    history = _history([("a", 1024, 2), ("b", 1024, 2), ("c", 1024, 2)])
    # Claimed 1e9 tokens over 2 steps: the cap is 2 steps x (4 x 512 tokens per step)^2.
    assert history.weight_cap("x", 2) == pytest.approx(2 * (4 * 512) ** 2)
    assert contribution_weight(10**9, 2) > history.weight_cap("x", 2)
    # Inflating the steps as well buys at most step_cap (4) x the others' median steps.
    assert history.weight_cap("x", 10_000) == pytest.approx(4 * 2 * (4 * 512) ** 2)


def test_weight_cap_needs_history_of_other_learners():
    history = _history([("x", 1024, 2), ("x", 1024, 2), ("a", 1024, 2), ("b", 1024, 2)])
    assert history.weight_cap("x", 2) == float("inf")  # two others < min_history 3
    assert history.weight_cap("a", 2) < float("inf")  # x, x, b: three other contributions
    assert _history([("a", 1024, 2)] * 5, factor=0.0).weight_cap("x", 2) == float("inf")  # disabled


# ------------------------------------------------------------------------------ direction


def _guard(**kw) -> tuple[robust_lib.DirectionGuard, int]:
    frag = _fragment()
    return robust_lib.DirectionGuard(robust_lib.DirectionPolicy(**kw), [frag]), frag.numel


def _honest(numel: int, seed: int, shared: np.ndarray, agreement: float = 0.7) -> np.ndarray:
    """A vector whose cosine with `shared` is about `agreement` (random otherwise)."""
    noise = np.random.default_rng(seed).standard_normal(numel)
    noise -= noise @ shared * shared
    noise /= np.linalg.norm(noise)
    return (agreement * shared + np.sqrt(1 - agreement**2) * noise).astype(np.float32) * 1e-3


def _shared(numel: int) -> np.ndarray:
    v = np.random.default_rng(99).standard_normal(numel)
    return v / np.linalg.norm(v)


def _accept(guard, lid: str, delta: np.ndarray, version: int = 0) -> robust_lib.DirectionVerdict:
    d = guard.direction(0, delta)
    verdict = guard.judge(lid, 0, d, version)
    if verdict.within:
        guard.add(lid, 0, d, version)
    return verdict


def test_sign_flipped_contributions_are_refused_honest_ones_pass():
    guard, n = _guard()
    shared = _shared(n)
    for i, lid in enumerate(("a", "b", "c")):  # pairwise cosines ~0.7^2
        assert _accept(guard, lid, _honest(n, i, shared, 0.7)).within
    flipped = _accept(guard, "x", -_honest(n, 7, shared, 0.7), version=1)
    assert not flipped.within and flipped.others == 3 and flipped.cosine == pytest.approx(-0.49, abs=0.05)
    honest = _accept(guard, "d", _honest(n, 8, shared, 0.7), version=1)
    assert honest.within and honest.cosine == pytest.approx(0.49, abs=0.05)


def test_an_honest_learners_odd_contribution_passes_a_flippers_lucky_one_too():
    # cos(honest_i, honest_j) ~ agreement^2: 0.64 here, so -0.64 for a flipped one.
    guard, n = _guard()
    shared = _shared(n)
    for i, lid in enumerate(("a", "b", "c")):
        _accept(guard, lid, _honest(n, i, shared, 0.8))
    assert _accept(guard, "d", _honest(n, 3, shared, 0.8)).within
    odd = _accept(guard, "d", -_honest(n, 4, shared, 0.8))  # pointing away once: d's recent mean is ~0
    assert odd.within and odd.cosine < -0.5 and odd.score > -0.25
    assert _accept(guard, "d", -_honest(n, 5, shared, 0.8)).within  # twice: mean (+.64 -.64 -.64) / 3
    assert not _accept(guard, "d", -_honest(n, 6, shared, 0.8)).within  # a third time: mean < -0.25
    for seed in (10, 11, 12):
        assert not _accept(guard, "x", -_honest(n, seed, shared, 0.8)).within
    lucky = _accept(guard, "x", _honest(n, 13, shared, 0.8))  # agrees: accepted despite x's record
    assert lucky.within and lucky.score < -0.25


def test_the_learners_own_history_is_never_its_reference():
    guard, n = _guard()
    shared = _shared(n)
    for v in range(5):  # x alone keeps sending flipped updates: they agree with each other
        _accept(guard, "x", -_honest(n, v, shared), version=v)
    verdict = _accept(guard, "x", -_honest(n, 9, shared), version=5)
    assert verdict.within and verdict.cosine is None and verdict.others == 0


def test_one_hostile_among_the_others_cannot_push_an_honest_learner_out():
    guard, n = _guard()
    shared = _shared(n)
    _accept(guard, "a", _honest(n, 1, shared))
    _accept(guard, "x", -_honest(n, 2, shared))  # accepted: nothing to compare it with yet
    verdict = _accept(guard, "b", _honest(n, 3, shared))
    # Cosines +0.49 with a, -0.49 with x: the upper median is a's (a mean would be ~0).
    assert verdict.within and verdict.others == 2 and verdict.cosine == pytest.approx(0.49, abs=0.05)


def test_a_refused_learners_earlier_directions_leave_the_reference():
    guard, n = _guard()
    shared = _shared(n)
    for lid, seed in (("a", 1), ("b", 2)):
        _accept(guard, lid, _honest(n, seed, shared))
    guard.add("x", 0, guard.direction(0, -_honest(n, 3, shared)), 0)  # accepted during the bootstrap
    assert guard.judge("c", 0, guard.direction(0, _honest(n, 4, shared)), 0).others == 3
    assert not _accept(guard, "x", -_honest(n, 5, shared)).within
    assert guard.judge("c", 0, guard.direction(0, _honest(n, 6, shared)), 0).others == 2  # x's is gone


def test_too_few_or_too_old_references_check_nothing():
    guard, n = _guard(max_age_versions=2)
    shared = _shared(n)
    _accept(guard, "a", _honest(n, 1, shared), version=0)
    flipped = guard.direction(0, -_honest(n, 2, shared))
    assert guard.judge("x", 0, flipped, 0) == robust_lib.DirectionVerdict(True, None, 1)
    _accept(guard, "b", _honest(n, 3, shared), version=1)
    assert not guard.judge("x", 0, flipped, 2).within  # a (v0) and b (v1) are recent enough
    assert guard.judge("x", 0, flipped, 3).others == 1  # a's is older than 2 versions


def test_off_zero_and_sampled():
    off, n = _guard(mode="off")
    shared = _shared(n)
    assert off.direction(0, _honest(n, 1, shared)) is None
    assert off.judge("x", 0, None, 0) == robust_lib.DirectionVerdict(True, None, 0)
    on, _ = _guard()
    assert on.direction(0, np.zeros(n, np.float32)) is None
    # A fragment larger than sample_size compares a fixed random sample: cosines barely move.
    sampled = robust_lib.DirectionHistory(robust_lib.DirectionPolicy(sample_size=1024), _fragment())
    a, b = _honest(n, 1, shared), _honest(n, 2, shared)
    exact = float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
    da, db = sampled.direction(a), sampled.direction(b)
    assert da.shape == (1024,) and float(da @ db) == pytest.approx(exact, abs=0.1)


def test_policy_validation():
    for bad in ({"mode": "clip"}, {"min_cosine": -2.0}, {"window": 0}):
        with pytest.raises(ValueError):
            robust_lib.DirectionPolicy(**bad)


def test_waiting_proposals_are_references_until_withdrawn_or_forgotten():
    guard, n = _guard()
    shared = _shared(n)
    heading = {lid: guard.direction(0, sign * _honest(n, seed, shared))
               for lid, seed, sign in (("a", 1, 1), ("b", 2, 1), ("x", 3, -1))}
    assert guard.references("a", 0, 0) == 0
    for lid, d in heading.items():  # three first contributions waiting at once
        guard.propose(lid, 0, d, 0)
    assert [guard.references(lid, 0, 0) for lid in heading] == [2, 2, 2]
    assert not guard.judge("x", 0, heading["x"], 0).within  # two honest others: refused, forgotten
    assert guard.references("a", 0, 0) == 1
    verdict = guard.judge("a", 0, heading["a"], 0)
    assert verdict.cosine is None and verdict.others == 1  # x's proposal left with x
    guard.add("a", 0, heading["a"], 0)
    guard.withdraw("a", 0)
    assert guard.references("b", 0, 0) == 1  # a's accepted direction stays a reference
    guard.withdraw("b", 0)
    assert guard.references("a", 0, 0) == 0


def test_judge_wait_must_not_be_negative():
    with pytest.raises(ValueError, match="judge_wait_s"):
        robust_lib.DirectionPolicy(judge_wait_s=-1.0)


def test_only_a_fragments_first_contributions_wait_for_references():
    guard, n = _guard(max_age_versions=1)
    shared = _shared(n)
    for i, lid in enumerate(("a", "b")):
        _accept(guard, lid, _honest(n, i, shared))
        assert not guard.bootstrapped(0)
    _accept(guard, "c", _honest(n, 2, shared))
    assert guard.bootstrapped(0)  # three learners accepted: past the start of the run
    assert guard.references("a", 0, 5) == 0  # later every reference aged out: still bootstrapped
    assert guard.bootstrapped(0)


def test_bootstrap_bound_grows_with_the_steps_a_contribution_spans_up_to_a_cap():
    frag = fragments_lib.plan_fragments([fragments_lib.TensorSpec("w", (64,))], 1, 1).fragments[0]
    history = robust_lib.NormHistory(robust_lib.NormBoundPolicy(), frag)
    norms = np.array([3.0])  # 3x the parameters' norm of 1.0
    assert not history.check("a", norms, steps=1, params_norm=1.0).within  # one step: 2x at most
    verdict = history.check("a", norms, steps=64, params_norm=1.0)  # 64 steps: 2 x 8 = 16x
    assert verdict.within and verdict.basis == "params"
    huge = history.check("a", np.array([1e4]), steps=10**9, params_norm=1.0)  # claims buy at most sqrt(256)
    assert not huge.within and huge.limit == pytest.approx(2.0 * 16.0)


def test_a_reference_that_refuses_two_distinct_learners_is_dropped_but_one_hostile_learner_cannot_drop_it():
    frag = fragments_lib.plan_fragments([fragments_lib.TensorSpec("w", (64,))], 1, 1).fragments[0]
    history = robust_lib.NormHistory(robust_lib.NormBoundPolicy(min_tensor_numel=1), frag)
    for lid in ("a", "b", "c", "d"):  # a reference from tiny warm-up steps: per-step norm 0.01
        history.add(lid, np.array([0.01]), steps=1, weight=1.0)
    assert not history.check("e", np.array([1.0]), steps=1, params_norm=10.0).within  # 100x: refused
    assert not history.refused("e") and not history.refused("e")  # the same learner again: kept
    assert not history.check("f", np.array([1.0]), steps=1, params_norm=10.0).within
    assert history.refused("f") and history.resets == 1  # a second learner: the reference is stale
    verdict = history.check("f", np.array([1.0]), steps=1, params_norm=10.0)
    assert verdict.within and verdict.basis == "params"  # back to the bootstrap bound
    history.add("g", np.array([1.0]), steps=1, weight=1.0)
    assert not history.refused("x")  # an accepted contribution clears the count


def test_verified_steps_are_credited_in_full_unverified_ones_up_to_the_cap():
    frag = fragments_lib.plan_fragments([fragments_lib.TensorSpec("w", (64,))], 1, 1).fragments[0]
    history = robust_lib.NormHistory(robust_lib.NormBoundPolicy(min_tensor_numel=1), frag)
    for lid in ("a", "b", "c"):
        history.add(lid, np.array([0.4]), steps=4, weight=1.0)  # 0.1 per step over 4 steps
    back = np.array([100.0])  # back from a partition: 400 steps, 0.25 per step (2.5x the others')
    assert not history.check("d", back, steps=400, params_norm=1.0).within  # credited 16: limit 32
    assert history.check("d", back, steps=400, params_norm=1.0, steps_verified=True).within  # limit 800
