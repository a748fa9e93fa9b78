"""The initial values of the fragments a syncer owns, built from the seeded model.

Owns `initial_fragments`: version 0 of each owned fragment (every fragment when unsharded), as a
flat float32 vector. A fragment shard builds its own fragments' tensors only, fragment by fragment
(ddiloco.models.init_tensors), never the whole model: at 1B parameters the whole model is 4 GB
per shard before any copy. A slice equals what an unsharded syncer builds for the same fragments
(the same seed, the same per-tensor keys), so shards and an unsharded run start from one model.
Must not: hold the values after start-up (the core's slots copy them).
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import numpy as np

from ddiloco import models
from ddiloco.algo import fragments as fragments_lib


def initial_fragments(model: models.Model, plan: fragments_lib.FragmentPlan, seed: int,
                      owned: Iterable[int]) -> dict[int, np.ndarray]:
    """Fragment id -> its initial flat float32 values, for the fragments in `owned`."""
    rng = jax.random.PRNGKey(seed)
    initial = {}
    for fragment_id in sorted(owned):
        fragment = plan.fragments[fragment_id]
        # One fragment's tensors at a time: they are flattened (copied) and dropped before the next.
        params = models.init_tensors(model, rng, [spec.name for spec in fragment.tensors])
        initial[fragment_id] = fragments_lib.flatten_fragment(params, fragment)
        del params
    return initial
