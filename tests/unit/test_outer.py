"""Tests for ddiloco.algo.outer: Nesterov semantics, determinism, state round trips."""

from __future__ import annotations

import io

import numpy as np
import pytest

from ddiloco.algo import outer as outer_lib


def _vectors(seed: int, size: int = 64, count: int = 4) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    params = rng.standard_normal(size).astype(np.float32)
    grads = [rng.standard_normal(size).astype(np.float32) * 0.1 for _ in range(count)]
    return params, grads


def _run(stepper, params, state, grads):
    for grad in grads:
        params, state = stepper.step(params, state, grad)
    return params, state


def test_step_matches_the_nesterov_formula():
    lr, mu = 0.7, 0.9
    stepper = outer_lib.OuterStepper(outer_lib.make_outer_optimizer(lr, mu))
    params, grads = _vectors(seed=0)
    state = stepper.init(params)
    expected, buf = params.astype(np.float64), np.zeros(params.size)

    for grad in grads:
        params, state = stepper.step(params, state, grad)
        buf = mu * buf + grad
        expected = expected - lr * (grad + mu * buf)

    np.testing.assert_allclose(params, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state[0], buf, rtol=1e-5, atol=1e-6)
    assert params.dtype == np.float32


def test_heavy_ball_and_plain_sgd():
    params, grads = _vectors(seed=1, count=2)
    heavy = outer_lib.OuterStepper(outer_lib.make_outer_optimizer(0.5, 0.9, nesterov=False))
    plain = outer_lib.OuterStepper(outer_lib.make_outer_optimizer(0.5, 0.0))

    heavy_params, _ = _run(heavy, params, heavy.init(params), grads)
    plain_params, _ = _run(plain, params, plain.init(params), grads)

    # heavy ball: buf1 = g0, buf2 = 0.9 g0 + g1, each step subtracts lr·buf.
    np.testing.assert_allclose(
        heavy_params, params - 0.5 * (grads[0] + 0.9 * grads[0] + grads[1]), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        plain_params, params - 0.5 * (grads[0] + grads[1]), rtol=1e-5, atol=1e-6
    )


def test_same_inputs_give_bit_identical_outputs():
    params, grads = _vectors(seed=2)
    first = outer_lib.OuterStepper(outer_lib.make_outer_optimizer())
    second = outer_lib.OuterStepper(outer_lib.make_outer_optimizer())

    a_params, a_state = _run(first, params, first.init(params), grads)
    b_params, b_state = _run(second, params, second.init(params), grads)

    assert a_params.tobytes() == b_params.tobytes()
    assert [x.tobytes() for x in a_state] == [x.tobytes() for x in b_state]


def test_state_restored_from_bytes_continues_bit_exactly():
    params, grads = _vectors(seed=3, count=6)
    stepper = outer_lib.OuterStepper(outer_lib.make_outer_optimizer())
    straight_params, straight_state = _run(stepper, params, stepper.init(params), grads)

    mid_params, mid_state = _run(stepper, params, stepper.init(params), grads[:3])
    saved = io.BytesIO()
    np.savez(saved, *mid_state, params=mid_params)
    saved.seek(0)
    loaded = np.load(saved)
    restored_state = [loaded[f"arr_{i}"] for i in range(len(mid_state))]
    # A fresh stepper (as after a restart) never saw init() for this fragment.
    restarted = outer_lib.OuterStepper(outer_lib.make_outer_optimizer())
    resumed_params, resumed_state = _run(restarted, loaded["params"], restored_state, grads[3:])

    assert resumed_params.tobytes() == straight_params.tobytes()
    assert [x.tobytes() for x in resumed_state] == [x.tobytes() for x in straight_state]


def test_one_stepper_serves_fragments_of_different_sizes():
    stepper = outer_lib.OuterStepper(outer_lib.make_outer_optimizer())
    for size in (3, 17):
        params = np.ones(size, np.float32)
        new_params, state = stepper.step(params, stepper.init(params), np.ones(size, np.float32))
        assert new_params.shape == (size,) and [s.shape for s in state] == [(size,)]


def test_outputs_are_fresh_writable_arrays():
    stepper = outer_lib.OuterStepper(outer_lib.make_outer_optimizer())
    params = np.ones(4, np.float32)
    state = stepper.init(params)
    grad = np.ones(4, np.float32)

    new_params, new_state = stepper.step(params, state, grad)
    new_params[:] = 0.0
    new_state[0][:] = 0.0

    np.testing.assert_array_equal(params, 1.0)
    again, _ = stepper.step(params, state, grad)
    np.testing.assert_allclose(again, 1.0 - 0.7 * (1.0 + 0.9 * 1.0), rtol=1e-6)


@pytest.mark.parametrize(
    ("learning_rate", "momentum", "match"),
    [
        (0.0, 0.9, "learning_rate=0.0"),
        (float("nan"), 0.9, "learning_rate=nan"),
        (0.7, 1.0, "momentum=1.0"),
        (0.7, -0.1, "momentum=-0.1"),
    ],
)
def test_make_outer_optimizer_rejects_bad_hyperparameters(learning_rate, momentum, match):
    with pytest.raises(ValueError, match=match):
        outer_lib.make_outer_optimizer(learning_rate, momentum)


def test_step_rejects_mismatched_inputs():
    stepper = outer_lib.OuterStepper(outer_lib.make_outer_optimizer())
    params = np.zeros(4, np.float32)
    state = stepper.init(params)
    grad = np.zeros(4, np.float32)

    with pytest.raises(ValueError, match="state has 2 arrays"):
        stepper.step(params, state + state, grad)
    with pytest.raises(ValueError, match=r"state\[0\] is float32\[5\]"):
        stepper.step(params, [np.zeros(5, np.float32)], grad)
    with pytest.raises(ValueError, match=r"state\[0\] is float64\[4\]"):
        stepper.step(params, [np.zeros(4, np.float64)], grad)
    with pytest.raises(ValueError, match="outer_grad_flat has 3 values"):
        stepper.step(params, state, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"params_flat is float64\[4\]"):
        stepper.step(params.astype(np.float64), state, grad)
    with pytest.raises(ValueError, match=r"params_flat is float32\[2, 2\]"):
        stepper.init(params.reshape(2, 2))


def _optax_order_step(params, buf, grad, lr, mu, nesterov):
    """One SGD step as float32 ufuncs in optax's order (trace, Nesterov, scale, apply)."""
    mu32, neg_lr = np.float32(mu), np.float32(-lr)
    new_buf = grad + mu32 * buf
    update = grad + mu32 * new_buf if nesterov else new_buf
    return params + update * neg_lr, new_buf


@pytest.mark.parametrize("nesterov", [True, False])
def test_compiled_step_equals_float32_ufuncs_in_optax_order_bit_for_bit(nesterov):
    rng = np.random.default_rng(7)
    size = 5003  # not a multiple of the kernel's block or of any SIMD width
    params = rng.standard_normal(size).astype(np.float32)
    stepper = outer_lib.OuterStepper(outer_lib.make_outer_optimizer(0.7, 0.9, nesterov=nesterov))
    state = stepper.init(params)
    expected_params, expected_buf = params, np.zeros(size, np.float32)
    for _ in range(4):
        grad = (rng.standard_normal(size) * 0.1).astype(np.float32)
        params, state = stepper.step(params, state, grad)
        expected_params, expected_buf = _optax_order_step(expected_params, expected_buf, grad, 0.7, 0.9, nesterov)
        assert params.tobytes() == expected_params.tobytes()
        assert state[0].tobytes() == expected_buf.tobytes()


def test_step_scaled_writes_the_delta_and_equals_step_on_it():
    rng = np.random.default_rng(8)
    size = 9000
    params = rng.standard_normal(size).astype(np.float32)
    sums = rng.standard_normal(size).astype(np.float32)
    bounds = np.array([0, 10, 10, 4099, size], np.int64)  # an empty segment too
    scales = np.array([0.5, 3.0, 1e-3, 0.0], np.float32)
    stepper = outer_lib.OuterStepper(outer_lib.make_outer_optimizer())
    state = stepper.init(params)
    state[0][:] = rng.standard_normal(size).astype(np.float32)

    delta = np.concatenate([sums[lo:hi] * scale for lo, hi, scale in zip(bounds[:-1], bounds[1:], scales)])
    result = stepper.step_scaled(params, state, sums, bounds, scales)
    plain_params, plain_state = stepper.step(params, state, delta)

    assert result.outer_grad.tobytes() == delta.astype(np.float32).tobytes()
    assert result.params.tobytes() == plain_params.tobytes()
    assert result.state[0].tobytes() == plain_state[0].tobytes()
    assert result.outer_grad_norm == pytest.approx(float(np.linalg.norm(delta.astype(np.float64))), rel=1e-12)
    assert result.finite


def test_step_scaled_reports_non_finite_params():
    stepper = outer_lib.OuterStepper(outer_lib.make_outer_optimizer(0.7, 0.9))
    params = np.full(300, 3e38, np.float32)  # one step pushes these past float32's range
    grad = np.full(300, -3e38, np.float32)
    result = stepper.step_scaled(params, stepper.init(params), grad, np.array([0, 300]), np.ones(1, np.float32))
    assert not result.finite
    ok = stepper.step_scaled(params, stepper.init(params), np.zeros(300, np.float32), np.array([0, 300]), np.ones(1, np.float32))
    assert ok.finite and ok.outer_grad_norm == 0.0


@pytest.mark.parametrize(
    ("bounds", "scales"),
    [([0, 5], [1.0]), ([0, 2, 10], [1.0]), ([1, 10], [1.0]), ([0, 6, 4, 10], [1.0, 1.0, 1.0])],
)
def test_step_scaled_rejects_bounds_that_do_not_split_the_vector(bounds, scales):
    stepper = outer_lib.OuterStepper(outer_lib.make_outer_optimizer())
    params = np.ones(10, np.float32)
    with pytest.raises(ValueError, match="do not split a vector of 10"):
        stepper.step_scaled(params, stepper.init(params), params, np.array(bounds), np.array(scales, np.float32))


def test_pool_reuses_only_arrays_nobody_holds():
    stepper = outer_lib.OuterStepper(outer_lib.make_outer_optimizer())
    params = np.ones(1000, np.float32)
    grad = np.full(1000, 0.5, np.float32)
    first_params, first_state = stepper.step(params, stepper.init(params), grad)
    view = first_state[0][10:20]  # a view keeps its base in use
    held = {id(first_params), id(first_state[0])}
    snapshot = (first_params.copy(), first_state[0].copy())

    for _ in range(20):
        new_params, new_state = stepper.step(first_params, first_state, grad)
        assert not held & {id(new_params), id(new_state[0])}
        del new_params, new_state  # now free: the next step may reuse them
    assert first_params.tobytes() == snapshot[0].tobytes()
    assert first_state[0].tobytes() == snapshot[1].tobytes() and view.base is first_state[0]

    # Released arrays come back instead of new allocations, within the free-array bound.
    seen = set()
    for _ in range(10):
        out = stepper.step_scaled(first_params, first_state, grad, np.array([0, 1000]), np.ones(1, np.float32))
        seen |= {id(out.params), id(out.state[0]), id(out.outer_grad)}
        del out
    assert len(seen) <= 3 + outer_lib.POOL_FREE_ARRAYS


def test_pool_can_be_switched_off():
    stepper = outer_lib.OuterStepper(outer_lib.make_outer_optimizer(), pool_free_arrays=0)
    params = np.ones(100, np.float32)
    state = stepper.init(params)
    ids = set()
    outs = []
    for _ in range(5):
        out = stepper.step(params, state, params)
        ids |= {id(out[0])}
        outs.append(out)  # keep them alive so ids are not recycled by the allocator
    assert len(ids) == 5


@pytest.mark.parametrize("numel", [1000, 3 * 2048 + 5])
@pytest.mark.parametrize("nesterov", [True, False])
def test_step_scaled_without_writing_the_delta_steps_the_same(numel, nesterov):
    stepper = outer_lib.OuterStepper(outer_lib.make_outer_optimizer(momentum=0.9, nesterov=nesterov))
    rng = np.random.default_rng(3)
    params = rng.standard_normal(numel).astype(np.float32)
    state = stepper.step(params, stepper.init(params), rng.standard_normal(numel).astype(np.float32))[1]
    values = rng.standard_normal(numel).astype(np.float32)
    bounds, scales = np.array([0, 400, numel], np.int64), np.array([0.5, 2.0], np.float32)
    written = stepper.step_scaled(params, state, values, bounds, scales)
    factored = stepper.step_scaled(params, state, values, bounds, scales, write_grad=False)
    assert factored.outer_grad is None
    np.testing.assert_array_equal(factored.params, written.params)
    np.testing.assert_array_equal(factored.state[0], written.state[0])
    assert factored.outer_grad_norm == written.outer_grad_norm  # same blocks, same float64 sums
    assert factored.outer_grad_norm == pytest.approx(float(np.linalg.norm(written.outer_grad.astype(np.float64))))
    assert factored.finite and written.finite


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_step_scaled_with_known_sum_squares_steps_the_same_and_still_catches_non_finite_params(bad):
    stepper = outer_lib.OuterStepper(outer_lib.make_outer_optimizer())
    rng = np.random.default_rng(8)
    numel = 3 * 2048 + 11
    params = rng.standard_normal(numel).astype(np.float32)
    state = stepper.init(params)
    values = rng.standard_normal(numel).astype(np.float32)
    bounds, scales = np.array([0, 5000, numel], np.int64), np.array([0.25, 3.0], np.float32)
    squares = np.array([np.sum(values[:5000].astype(np.float64) ** 2), np.sum(values[5000:].astype(np.float64) ** 2)])
    plain = stepper.step_scaled(params, state, values, bounds, scales, write_grad=False)
    known = stepper.step_scaled(params, state, values, bounds, scales, squares, write_grad=False)
    np.testing.assert_array_equal(known.params, plain.params)
    np.testing.assert_array_equal(known.state[0], plain.state[0])
    assert known.outer_grad_norm == pytest.approx(plain.outer_grad_norm, rel=1e-6)
    assert known.finite and plain.finite
    params[6000] = bad  # in the last, partial block
    broken = stepper.step_scaled(params, state, values, bounds, scales, squares, write_grad=False)
    assert not broken.finite
    with pytest.raises(ValueError, match="sum_squares"):
        stepper.step_scaled(params, state, values, bounds, scales, squares[:1])


def _one_segment(grad):
    return grad, np.array([0, grad.size], np.int64), np.ones(1, np.float32)


@pytest.mark.parametrize("nesterov", [True, False])
def test_a_fractional_step_of_one_is_the_whole_step(nesterov):
    stepper = outer_lib.OuterStepper(outer_lib.make_outer_optimizer(0.7, 0.9, nesterov=nesterov))
    params, grads = _vectors(5, size=300)
    state = stepper.init(params)
    warm = stepper.step_scaled(params, state, *_one_segment(grads[0]))  # a momentum to carry
    whole = stepper.step_scaled(warm.params, warm.state, *_one_segment(grads[1]))
    same = stepper.step_scaled(warm.params, warm.state, *_one_segment(grads[1]), fraction=1.0)
    np.testing.assert_array_equal(whole.params, same.params)
    np.testing.assert_array_equal(whole.state[0], same.state[0])


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("s", [0.25, 8.0])
def test_a_fractional_step_follows_its_formula(nesterov, s):
    # s < 1: a short round (momentum decays by mu^s, carried s times); s > 1: many rounds' work in
    # one merge (the fragment moves by all of it, the momentum takes delta / s).
    lr, mu = 0.7, 0.9
    stepper = outer_lib.OuterStepper(outer_lib.make_outer_optimizer(lr, mu, nesterov=nesterov))
    params, grads = _vectors(6, size=300)
    warm = stepper.step_scaled(params, stepper.init(params), *_one_segment(grads[0]))
    buf = warm.state[0].astype(np.float64)
    delta = max(1.0, s) * grads[1]  # a round's work scaled by the rounds it holds
    out = stepper.step_scaled(warm.params, warm.state, *_one_segment(delta), fraction=s)
    g, share, into = delta.astype(np.float64), min(1.0, s), min(1.0, 1 / s)
    new_buf = into * g + mu**share * buf
    move = g + share * mu * new_buf if nesterov else g + share * (new_buf - into * g)
    np.testing.assert_allclose(out.state[0], new_buf, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.params, warm.params - lr * move, rtol=1e-5, atol=1e-6)
    if s > 1:  # what the momentum carries on into later merges: one round's worth, not eight
        whole = stepper.step_scaled(warm.params, warm.state, *_one_segment(delta))
        assert np.linalg.norm(out.state[0]) < 0.3 * np.linalg.norm(whole.state[0])


def test_an_empty_merge_as_a_small_fraction_barely_moves_while_a_whole_step_pushes_the_momentum():
    # The case it exists for: a merge holding almost no work at the end of training.
    stepper = outer_lib.OuterStepper(outer_lib.make_outer_optimizer(0.7, 0.9))
    params, grads = _vectors(7, size=300)
    state = stepper.init(params)
    for g in grads:  # a momentum built over four regular rounds
        out = stepper.step_scaled(params, state, *_one_segment(g))
        params, state = out.params, out.state
    empty = np.zeros_like(params)
    whole = stepper.step_scaled(params, state, *_one_segment(empty))
    tiny = stepper.step_scaled(params, state, *_one_segment(empty), fraction=1 / 64)
    # A whole step with no work in it moves more than lr x a regular round's delta.
    assert np.linalg.norm(whole.params - params) > np.linalg.norm(0.7 * grads[-1])
    assert np.linalg.norm(tiny.params - params) < 0.02 * np.linalg.norm(whole.params - params)
    np.testing.assert_allclose(tiny.state[0], 0.9 ** (1 / 64) * state[0], rtol=1e-6)


@pytest.mark.parametrize("fraction", [0.0, -0.5, float("inf"), float("nan")])
def test_a_fraction_that_is_not_a_positive_number_is_refused(fraction):
    stepper = outer_lib.OuterStepper(outer_lib.make_outer_optimizer(0.7, 0.9))
    params, grads = _vectors(8, size=300)
    with pytest.raises(ValueError, match="fraction"):
        stepper.step_scaled(params, stepper.init(params), *_one_segment(grads[0]), fraction=fraction)


def test_pool_keeps_no_array_above_its_byte_bound():
    # A fragment larger than the pool's byte bound: its outputs are freed as soon as nobody holds
    # them (a shard of a 1B model must not keep old ~1 GB versions alive between steps).
    import weakref

    stepper = outer_lib.OuterStepper(outer_lib.make_outer_optimizer(), pool_free_bytes=3999)
    params = np.ones(1000, np.float32)  # 4000 bytes per array
    state = stepper.init(params)
    out = stepper.step_scaled(params, state, np.full(1000, 0.5, np.float32), np.array([0, 1000]),
                              np.ones(1, np.float32))
    refs = [weakref.ref(out.params), weakref.ref(out.state[0]), weakref.ref(out.outer_grad)]
    del out
    assert all(ref() is None for ref in refs)
    # Within the bound, the pool keeps at most what its bytes allow: one 4000-byte array here.
    small = outer_lib.OuterStepper(outer_lib.make_outer_optimizer(), pool_free_bytes=4000)
    seen = set()
    for _ in range(6):
        out = small.step_scaled(params, state, np.full(1000, 0.5, np.float32), np.array([0, 1000]),
                                np.ones(1, np.float32))
        seen |= {id(out.params), id(out.state[0]), id(out.outer_grad)}
        del out
    assert len(seen) <= 3 + 1
