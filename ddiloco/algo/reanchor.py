"""Re-anchoring: a contribution computed against an older global fragment, as one against the current.

Owns: ``reanchor`` (Decoupled DiLoCo App. D.2), the correction the syncer applies to a stale
contribution before it folds it into a merge round.
Must not: decode payloads, read clocks, keep state or do I/O; callers pass flat float32 vectors.

A learner that took global version ``base`` and uploads the outer gradient ``delta`` holds the
local fragment ``base - delta``. Against the current global version ``current`` its outer gradient
is ``current - (base - delta) = delta + (current - base)``: the work it did, plus the global
progress it has not seen yet, so merging it does not undo the merges that happened meanwhile.
"""

from __future__ import annotations

import numpy as np


def reanchor(delta: np.ndarray, base: np.ndarray, current: np.ndarray) -> np.ndarray:
    """``delta`` (an outer gradient against ``base``) as an outer gradient against ``current``.

    When ``base`` is ``current`` (the same array: the contribution is not stale) ``delta`` itself is
    returned, not a copy, so a caller can tell that statistics it gathered on ``delta`` (per-tensor
    norms) still describe the result. ValueError when the three vectors differ in shape.
    """
    if not delta.shape == base.shape == current.shape:
        raise ValueError(f"shapes differ: delta {delta.shape}, base {base.shape}, current {current.shape}")
    if base is current:
        return delta
    # One new array, written twice: (current - base), then + delta in place. The same bits as
    # delta + (current - base) (float addition commutes), without a second fragment-sized temporary.
    if not delta.dtype == base.dtype == current.dtype:
        return delta + (current - base)  # mixed precisions: numpy's promotion, as before
    corrected = np.subtract(current, base)
    np.add(corrected, delta, out=corrected)
    return corrected
