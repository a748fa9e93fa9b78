"""Fragment math the syncer applies to contributions: re-anchoring (ddiloco.algo.reanchor) and the
fragment digest (ddiloco.algo.fragments.fragment_sha256)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import reanchor as reanchor_lib
from ddiloco.wire import serde


def test_a_stale_contribution_becomes_the_learners_outer_gradient_against_the_current_version():
    # Values exactly representable in float32, so the identity holds bit for bit.
    base = np.array([1.0, -2.0, 0.5, 4.0], np.float32)
    delta = np.array([0.25, 0.5, -1.0, 0.0], np.float32)
    current = np.array([1.5, -2.0, 0.0, 3.0], np.float32)
    local = base - delta  # what the learner holds
    got = reanchor_lib.reanchor(delta, base, current)
    np.testing.assert_array_equal(got, current - local)
    assert got.dtype == np.float32
    # The inputs are left alone.
    np.testing.assert_array_equal(delta, [0.25, 0.5, -1.0, 0.0])


def test_a_contribution_on_the_current_version_is_returned_as_it_is():
    current = np.arange(6, dtype=np.float32)
    delta = np.full(6, 0.5, np.float32)
    assert reanchor_lib.reanchor(delta, current, current) is delta
    # Equal values in another array are not the same version: corrected (here by zero), a new array.
    same_values = current.copy()
    got = reanchor_lib.reanchor(delta, same_values, current)
    assert got is not delta
    np.testing.assert_array_equal(got, delta)


def test_reanchoring_vectors_of_different_sizes_is_refused():
    with pytest.raises(ValueError, match="shapes differ"):
        reanchor_lib.reanchor(np.zeros(4, np.float32), np.zeros(4, np.float32), np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="shapes differ"):
        # A length-1 base would broadcast silently: refused too.
        reanchor_lib.reanchor(np.zeros(4, np.float32), np.zeros(1, np.float32), np.zeros(4, np.float32))


def test_the_fragment_digest_is_of_little_endian_float32_bytes_whatever_the_array():
    values = np.array([0.1, -2.5, 3.0e-8, 7.0], np.float32)
    expected = hashlib.sha256(values.astype("<f4").tobytes()).hexdigest()
    assert fragments_lib.fragment_sha256(values) == expected
    assert fragments_lib.fragment_sha256(values.astype(">f4")) == expected  # byte order does not matter
    assert fragments_lib.fragment_sha256(values.astype(np.float64)) == expected  # nor the dtype it is held in
    assert fragments_lib.fragment_sha256(np.repeat(values, 2)[::2]) == expected  # nor a strided view
    nudged = values.copy()
    nudged[2] = np.nextafter(nudged[2], np.float32(1))  # one ulp
    assert fragments_lib.fragment_sha256(nudged) != expected
    # One definition: the wire layer's name is the same function.
    assert serde.params_sha256 is fragments_lib.fragment_sha256
