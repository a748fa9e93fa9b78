"""numba's ``njit`` with the options every compiled kernel of ddiloco uses.

Owns: the decorator, and the choice of an on-disk cache of the machine code. numba compiles a
kernel on its first call (~0.5 s per kernel on a 2-core VM, more when several processes start
together); the cache makes that a one-time cost per machine or container instead of per
process. numba keeps it in ``__pycache__`` beside the source, or under ``$HOME/.cache`` (or
``NUMBA_CACHE_DIR``) when the install is read-only; with no writable place at all the kernels
still work, compiled in each process.

numba is optional (the `numba` extra). Without it ``COMPILED`` is False, ``njit`` leaves a function
as Python, and each ``_kernels`` module replaces its kernels by their numpy twins
(``_kernels_numpy``): the loops as plain Python would be about a thousand times slower.
"""

from __future__ import annotations

from collections.abc import Callable

try:
    import numba
except ImportError:  # the numba extra is not installed
    numba = None

COMPILED = numba is not None


def njit(**options) -> Callable[[Callable], Callable]:
    """``numba.njit(nogil=True, boundscheck=False, cache=True, **options)``, falling back to
    no cache when numba finds no writable cache location."""

    def wrap(function: Callable) -> Callable:
        if numba is None:
            return function  # replaced by its numpy twin (see the module docstring)
        settings = {"nogil": True, "boundscheck": False, **options}
        try:
            return numba.njit(cache=True, **settings)(function)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return numba.njit(cache=False, **settings)(function)

    return wrap
