"""Tests for ddiloco.algo.fragments: LPT balance, the staggered schedule, flat layout."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.algo import fragments as fragments_lib

TensorSpec = fragments_lib.TensorSpec


@st.composite
def _specs(draw, max_tensors: int = 12, max_dim: int = 40) -> list[TensorSpec]:
    """Uniquely named tensors of 0-3 dims (sizes collide often, to exercise tie-breaking)."""
    n = draw(st.integers(1, max_tensors))
    shapes = draw(st.lists(st.lists(st.integers(1, max_dim), max_size=3), min_size=n, max_size=n))
    names = draw(st.permutations([f"t{i:02d}" for i in range(n)]))
    return [TensorSpec(name, tuple(shape)) for name, shape in zip(names, shapes, strict=True)]


@st.composite
def _plan_inputs(draw, max_tensors: int = 12) -> tuple[list[TensorSpec], int, int]:
    specs = draw(_specs(max_tensors=max_tensors))
    return specs, draw(st.integers(1, len(specs))), draw(st.integers(1, 30))


def _optimal_makespan(sizes: list[int], num_bins: int) -> int:
    """Exact minimum of the largest bin, by branch and bound (small inputs only)."""
    sizes = sorted(sizes, reverse=True)
    loads = [0] * num_bins
    best = sum(sizes)

    def place(i: int) -> None:
        nonlocal best
        if i == len(sizes):
            best = min(best, max(loads))
            return
        tried = set()
        for b in range(num_bins):
            # Bins with equal loads are interchangeable; a bin reaching `best` cannot improve.
            if loads[b] in tried or loads[b] + sizes[i] >= best:
                continue
            tried.add(loads[b])
            loads[b] += sizes[i]
            place(i + 1)
            loads[b] -= sizes[i]

    place(0)
    return best


@settings(max_examples=50, deadline=None)
@given(_plan_inputs())
def test_every_tensor_is_in_exactly_one_fragment(inputs):
    specs, num_fragments, period = inputs
    plan = fragments_lib.plan_fragments(specs, num_fragments, period)

    placed = [spec for fragment in plan.fragments for spec in fragment.tensors]
    assert sorted(s.name for s in placed) == sorted(s.name for s in specs)
    assert plan.num_fragments == num_fragments
    for index, fragment in enumerate(plan.fragments):
        assert fragment.fragment_id == index
        assert fragment.tensors, "no empty fragments"
        assert [s.name for s in fragment.tensors] == sorted(s.name for s in fragment.tensors)
        for spec in fragment.tensors:
            assert plan.fragment_of(spec.name) == index


@settings(max_examples=50, deadline=None)
@given(_plan_inputs(max_tensors=8))
def test_largest_fragment_is_within_grahams_lpt_bound_of_optimal(inputs):
    # Graham: LPT <= (4/3 - 1/(3P)) * OPT. The bound is against the optimal packing, not
    # against max(total/P, largest): with 4 equal tensors and P = 3 even the optimum is
    # 1.5x that lower bound.
    specs, num_fragments, period = inputs
    plan = fragments_lib.plan_fragments(specs, num_fragments, period)

    largest = max(fragment.numel for fragment in plan.fragments)
    optimal = _optimal_makespan([s.numel for s in specs], num_fragments)
    assert 3 * num_fragments * largest <= (4 * num_fragments - 1) * optimal


@settings(max_examples=50, deadline=None)
@given(_plan_inputs(max_tensors=40))
def test_largest_fragment_is_within_list_scheduling_bound(inputs):
    # Greedy placement can exceed the average by at most one tensor's worth.
    specs, num_fragments, period = inputs
    plan = fragments_lib.plan_fragments(specs, num_fragments, period)

    total = sum(s.numel for s in specs)
    biggest = max(s.numel for s in specs)
    largest = max(fragment.numel for fragment in plan.fragments)
    assert largest <= total / num_fragments + biggest * (1 - 1 / num_fragments) + 1e-9


def test_lpt_places_a_known_instance_step_by_step():
    sizes = {"a": 7, "b": 5, "c": 4, "d": 4, "e": 3, "f": 3}
    specs = [TensorSpec(name, (n,)) for name, n in sizes.items()]

    plan = fragments_lib.plan_fragments(specs, num_fragments=2, sync_period_steps=4)

    # Largest first, each to the lighter bin: a->0 (7), b->1 (5), c->1 (9), d->0 (11),
    # e->1 (12), f->0 (14). The optimum is 13 (a+e+f, b+c+d): LPT is within 4/3 of it.
    assert [[s.name for s in f.tensors] for f in plan.fragments] == [
        ["a", "d", "f"],
        ["b", "c", "e"],
    ]
    assert [f.numel for f in plan.fragments] == [14, 12]
    assert [f.offset_steps for f in plan.fragments] == [0, 2]


@settings(max_examples=50, deadline=None)
@given(_plan_inputs(), st.integers(0, 100))
def test_every_fragment_is_due_once_in_any_period(inputs, start):
    specs, num_fragments, period = inputs
    plan = fragments_lib.plan_fragments(specs, num_fragments, period)

    due = [i for step in range(start + 1, start + 1 + period) for i in plan.due(step)]
    assert sorted(due) == list(range(num_fragments))
    for fragment in plan.fragments:
        assert fragment.offset_steps == (fragment.fragment_id * period) // num_fragments


def test_one_fragment_per_step_when_p_equals_h():
    specs = [TensorSpec(f"t{i}", (i + 1,)) for i in range(6)]
    plan = fragments_lib.plan_fragments(specs, num_fragments=6, sync_period_steps=6)

    assert plan.due(0) == []
    assert [plan.due(step) for step in range(1, 13)] == [[1], [2], [3], [4], [5], [0]] * 2


def test_several_fragments_per_step_when_p_exceeds_h():
    specs = [TensorSpec(f"t{i}", (4,)) for i in range(4)]
    plan = fragments_lib.plan_fragments(specs, num_fragments=4, sync_period_steps=2)

    assert [plan.due(step) for step in (1, 2)] == [[2, 3], [0, 1]]


def test_plan_does_not_depend_on_input_order():
    specs = [TensorSpec(f"t{i}", (i % 3 + 1, 5)) for i in range(9)]

    forward = fragments_lib.plan_fragments(specs, 4, 8)
    backward = fragments_lib.plan_fragments(specs[::-1], 4, 8)

    assert forward == backward


@settings(max_examples=50, deadline=None)
@given(_plan_inputs(), st.integers(0, 2**32 - 1))
def test_flatten_unflatten_round_trip(inputs, seed):
    specs, num_fragments, period = inputs
    plan = fragments_lib.plan_fragments(specs, num_fragments, period)
    rng = np.random.default_rng(seed)
    params = {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in specs}

    for fragment in plan.fragments:
        flat = fragments_lib.flatten_fragment(params, fragment)
        assert flat.dtype == np.float32 and flat.shape == (fragment.numel,)
        restored = fragments_lib.unflatten_fragment(flat, fragment)
        assert list(restored) == [s.name for s in fragment.tensors]
        for name, value in restored.items():
            np.testing.assert_array_equal(value, params[name])
        for spec in fragment.tensors:
            np.testing.assert_array_equal(
                flat[fragment.slices()[spec.name]], params[spec.name].ravel()
            )


def test_flatten_returns_a_fresh_array():
    spec = TensorSpec("w", (2, 3))
    plan = fragments_lib.plan_fragments([spec], 1, 1)
    params = {"w": np.ones((2, 3), dtype=np.float32)}

    flat = fragments_lib.flatten_fragment(params, plan.fragments[0])
    flat[:] = 7.0

    np.testing.assert_array_equal(params["w"], 1.0)


def test_scalar_tensors_have_one_element():
    assert TensorSpec("s", ()).numel == 1
    assert TensorSpec("w", [2, 3]).shape == (2, 3)


@pytest.mark.parametrize(
    ("specs", "num_fragments", "period", "match"),
    [
        ([TensorSpec("a", (1,))], 0, 1, "num_fragments=0"),
        ([TensorSpec("a", (1,))], 1, 0, "sync_period_steps=0"),
        ([TensorSpec("a", (1,)), TensorSpec("b", (1,))], 3, 1, "exceeds the 2 tensors"),
        ([TensorSpec("a", (1,)), TensorSpec("a", (2,))], 1, 1, r"duplicate tensor names \['a'\]"),
    ],
)
def test_plan_fragments_rejects_bad_arguments(specs, num_fragments, period, match):
    with pytest.raises(ValueError, match=match):
        fragments_lib.plan_fragments(specs, num_fragments, period)


@pytest.mark.parametrize("shape", [(0,), (3, -1)])
def test_tensor_spec_rejects_non_positive_dims(shape):
    with pytest.raises(ValueError, match="every dimension must be >= 1"):
        TensorSpec("w", shape)


def test_flatten_and_unflatten_reject_mismatches():
    plan = fragments_lib.plan_fragments([TensorSpec("w", (2, 3))], 1, 1)
    fragment = plan.fragments[0]

    with pytest.raises(ValueError, match="no tensor 'w'"):
        fragments_lib.flatten_fragment({}, fragment)
    with pytest.raises(ValueError, match=r"shape=\(3, 2\)"):
        fragments_lib.flatten_fragment({"w": np.zeros((3, 2), np.float32)}, fragment)
    with pytest.raises(ValueError, match="1-D vector of 6"):
        fragments_lib.unflatten_fragment(np.zeros(5, np.float32), fragment)
    with pytest.raises(ValueError, match="in no fragment"):
        plan.fragment_of("missing")
    with pytest.raises(ValueError, match="step=-1"):
        plan.due(-1)


def test_plan_rejects_inconsistent_fragments():
    fragment = fragments_lib.Fragment(
        fragment_id=1, tensors=(TensorSpec("a", (1,)),), offset_steps=0
    )
    with pytest.raises(ValueError, match="must equal their index"):
        fragments_lib.FragmentPlan(fragments=(fragment,), sync_period_steps=2)
    late = fragments_lib.Fragment(fragment_id=0, tensors=(TensorSpec("a", (1,)),), offset_steps=2)
    with pytest.raises(ValueError, match="offset_steps=2"):
        fragments_lib.FragmentPlan(fragments=(late,), sync_period_steps=2)


def test_numel_sums_tensor_sizes():
    fragment = fragments_lib.Fragment(
        fragment_id=0, tensors=(TensorSpec("a", (2, 3)), TensorSpec("b", (4,))), offset_steps=0
    )
    assert fragment.numel == 10 == math.prod((2, 3)) + 4
    assert fragment.slices() == {"a": slice(0, 6), "b": slice(6, 10)}


def test_applying_a_delta_in_place_gives_the_bits_of_the_allocating_form():
    # The syncer writes the new version into the decoded step (out=step); learners allocate.
    # Both must hold bit-identical values, subnormals, infinities and signed zeros included.
    rng = np.random.default_rng(7)
    held = (rng.standard_normal(10_000) * np.float32(1e3)).astype(np.float32)
    step = (rng.standard_normal(10_000) * np.float32(1e-3)).astype(np.float32)
    held[:3] = [np.float32(1e-40), -0.0, np.inf]
    step[:3] = [np.float32(-3e-41), 0.0, 1.0]
    allocated = fragments_lib.apply_delta(held, step)
    into = step.copy()
    in_place = fragments_lib.apply_delta(held, into, out=into)
    assert in_place is into and allocated is not step
    np.testing.assert_array_equal(in_place.view(np.uint32), allocated.view(np.uint32))
    assert allocated.dtype == np.float32
    # The step the syncer encodes is the float32 difference, whatever dtype the new values come in.
    finite = held[3:]
    new = finite.astype(np.float64) + 0.25
    np.testing.assert_array_equal(fragments_lib.version_step(finite, new), new.astype(np.float32) - finite)
