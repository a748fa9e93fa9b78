"""The initial values of the fragments a syncer owns, built from the seeded model.

Owns `initial_fragments`: version 0 of each owned fragment (every fragment when unsharded), as a
flat float32 vector. A fragment shard builds its own fragments' tensors only, fragment by fragment
(ddiloco.models.init_tensors), never the whole model: at 1B parameters the whole model is 4 GB
per shard before any copy. A slice equals what an unsharded syncer builds for the same fragments
(the same seed, the same per-tensor keys), so shards and an unsharded run start from one model.
Must not: hold the values after start-up (the core's slots copy them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import jax
import numpy as np

from ddiloco import models
from ddiloco.algo import fragments as fragments_lib


def initial_fragments(model: models.Model, plan: fragments_lib.FragmentPlan, seed: int,
                      owned: Iterable[int]) -> dict[int, np.ndarray]:
    """Fragment id -> its initial flat float32 values (as fragments.flatten_fragment lays them
    out), for the fragments in `owned`."""
    tensor = _tensor_source(model, jax.random.PRNGKey(seed))
    initial = {}
    for fragment_id in sorted(owned):
        fragment = plan.fragments[fragment_id]
        flat = np.empty(fragment.numel, np.float32)
        offset = 0
        for spec in fragment.tensors:  # one tensor at a time: written in place, then dropped
            values = np.asarray(tensor(spec.name), dtype=np.float32)
            if values.shape != tuple(spec.shape):
                raise ValueError(f"the model's tensor {spec.name!r} has shape {values.shape}, the plan says {spec.shape}")
            flat[offset:offset + values.size] = values.reshape(-1)
            offset += values.size
            del values
        initial[fragment_id] = flat
    return initial


def _tensor_source(model: models.Model, rng) -> Callable[[str], object]:
    """name -> that tensor's initial values: built alone when the model can (init_tensors), else
    taken from one whole init, held until the owned fragments are built."""
    if hasattr(model, "init_tensors"):
        return lambda name: models.init_tensors(model, rng, [name])[name]
    params = model.init(rng)
    return params.__getitem__
