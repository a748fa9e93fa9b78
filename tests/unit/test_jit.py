"""Tests for ddiloco._jit: compiled kernels work with and without a writable numba cache."""

from __future__ import annotations

import numba
import numpy as np

from ddiloco import _jit


def _double(x):
    return x * 2


def test_kernels_compile_without_a_writable_cache(monkeypatch):
    real_njit = numba.njit
    asked = []

    def njit_without_locator(*args, cache=False, **kwargs):
        asked.append(cache)
        if cache:
            raise RuntimeError("cannot cache function '_double': no locator available for file")
        return real_njit(*args, **kwargs)

    monkeypatch.setattr(_jit.numba, "njit", njit_without_locator)
    double = _jit.njit()(_double)
    assert asked == [True, False]
    np.testing.assert_array_equal(double(np.arange(3.0)), [0.0, 2.0, 4.0])
