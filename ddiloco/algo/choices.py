"""The names of the algorithm's choices, one definition each, free of numpy, numba and jax.

Owns: ``RULES`` and ``EQUAL_MEAN`` (the merge rules, merge.py), ``STEP_SCALINGS`` (how norms of
contributions of different step counts compare, merge.py) and ``OUTER_STEP_FRACTIONS`` (how much of a
whole outer step a merge takes, outer.py). Configuration modules (services/syncer/config.py) validate
flags against these without loading the kernels those modules load.
Must not: import anything heavier than the standard library.
"""

from __future__ import annotations

EQUAL_MEAN = "equal_mean"
# Per-tensor merge rules (merge.py's docstring says what each computes).
RULES: tuple[str, ...] = ("rda", "mean", EQUAL_MEAN)
# How norms of contributions spanning different step counts are compared (merge.norm_allowance_steps).
STEP_SCALINGS: tuple[str, ...] = ("per_step", "sqrt_below_median")
# How much of a whole outer step a merge takes (outer.merge_share): "work" (the syncer's default), "steps"
# (the default until the `ddiloco up` divergence in docs/internals.md), "whole".
OUTER_STEP_FRACTIONS: tuple[str, ...] = ("work", "steps", "whole")
