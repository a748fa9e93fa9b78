"""Re-anchoring: a contribution computed against an older global fragment, as one against the current.

Owns: ``reanchor`` (Decoupled DiLoCo App. D.2), the correction the syncer applies to a stale
contribution before it folds it into a merge round.
Must not: decode payloads, read clocks, keep state or do I/O; callers pass flat float32 vectors.

A learner that took global version ``base`` and uploads the outer gradient ``delta`` holds the
local fragment ``base - delta``. Against the current global version ``current`` its outer gradient
is ``current - (base - delta) = delta + (current - base)``: the work it did, plus the global
progress it has not seen yet, so merging it does not undo the merges that happened meanwhile.

``base`` may also be a stand-in for the older values (a `Difference`: it has the shape and dtype
and gives ``current - base`` itself), so that a caller keeps older versions in a compact form
(the syncer keeps the steps learners applied since, services/syncer/versions.py).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Difference(Protocol):
    """An older version that is not kept as its values: it knows how far ``current`` has moved."""

    shape: tuple[int, ...]
    dtype: np.dtype

    def difference_to(self, current: np.ndarray) -> np.ndarray:
        """``current - base`` as a new float32 array of ``current``'s shape."""


def reanchor(delta: np.ndarray, base: np.ndarray | Difference, current: np.ndarray) -> np.ndarray:
    """``delta`` (an outer gradient against ``base``) as an outer gradient against ``current``.

    When ``base`` is ``current`` (the same array: the contribution is not stale) ``delta`` itself is
    returned, not a copy, so a caller can tell that statistics it gathered on ``delta`` (per-tensor
    norms) still describe the result. ValueError when the three vectors differ in shape.
    """
    if not delta.shape == base.shape == current.shape:
        raise ValueError(f"shapes differ: delta {delta.shape}, base {base.shape}, current {current.shape}")
    if base is current:
        return delta
    if not isinstance(base, np.ndarray):
        corrected = base.difference_to(current)
        if corrected.shape != current.shape or corrected.dtype != delta.dtype:
            return delta + corrected
        np.add(corrected, delta, out=corrected)
        return corrected
    # One new array, written twice: (current - base), then + delta in place. The same bits as
    # delta + (current - base) (float addition commutes), without a second fragment-sized temporary.
    if not delta.dtype == base.dtype == current.dtype:
        return delta + (current - base)  # mixed precisions: numpy's promotion, as before
    corrected = np.subtract(current, base)
    np.add(corrected, delta, out=corrected)
    return corrected
