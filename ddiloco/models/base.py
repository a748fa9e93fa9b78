"""The model interface every learner, syncer and evaluator codes against.

Owns: the flat ``Params`` layout, the ``Model`` protocol and ``model_fingerprint``.
Must not: know about data, optimizers or transport.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from ddiloco.algo.fragments import TensorSpec

# FLAT dict: tensor name -> float32 array. Flat (not nested) so that fragments,
# wire manifests and checkpoints all address a tensor by one stable string.
Params = dict[str, jax.Array]

# Every parameter is stored in this dtype; it is part of the fingerprint.
PARAM_DTYPE = jnp.float32


class Model(Protocol):
    """A language model over int32 token ids, as pure functions of ``Params``."""

    name: str
    # JSON-serializable and complete (all defaults filled), so that
    # ``get_model(model.name, model.config)`` rebuilds an identical model.
    config: Mapping[str, Any]

    def init(self, rng: jax.Array) -> Params:
        """Returns freshly initialized parameters, one entry per tensor spec."""
        ...

    def loss(self, params: Params, batch: jax.Array) -> jax.Array:
        """Mean next-token cross-entropy in nats of an int32 ``(B, T+1)`` batch.

        Pure and jittable: ``batch[:, :-1]`` are inputs, ``batch[:, 1:]`` targets.
        """
        ...

    def tensor_specs(self) -> list[TensorSpec]:
        """Name, shape and embedding flag of every parameter, in a stable order."""
        ...

    @property
    def vocab_size(self) -> int:
        """Number of distinct token ids."""
        ...

    @property
    def seq_len(self) -> int:
        """Longest input length ``T`` the model accepts (batches are ``T+1`` wide)."""
        ...


def model_fingerprint(model: Model) -> str:
    """Hashes a model's identity so processes can refuse mismatched peers.

    The hash covers the model name, its complete config and every tensor's name,
    shape and dtype, serialized as canonical JSON (sorted keys, no whitespace), so
    it is identical across processes and Python versions.

    Args:
        model: the model to fingerprint.

    Returns:
        The sha256 hex digest.
    """
    identity = {
        "name": model.name,
        "config": dict(model.config),
        "tensors": [[spec.name, list(spec.shape), jnp.dtype(PARAM_DTYPE).name] for spec in model.tensor_specs()],
    }
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
