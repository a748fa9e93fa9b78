"""A base for model plugins whose parameters are a JAX pytree (Flax NNX, Equinox, ...).

Owns: ``PytreeModel``, what such a plugin shares whatever its library: the config defaults and
their check, the flat ``Params`` layout of the tree (tensor names from tree paths, in flattening
order), ``tensor_specs``, ``vocab_size``/``seq_len`` and the next-token loss over ``logits``.
Must not: import a neural-network library (the subclass brings its own; examples/flax_lm.py and
examples/equinox_lm.py are two).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ddiloco.algo.fragments import TensorSpec
from ddiloco.models.base import PARAM_DTYPE, Params


class PytreeModel:
    """The ``Model`` protocol over a pytree of parameter arrays.

    A subclass sets ``name``, ``defaults`` (every config key, ``vocab_size`` and ``seq_len``
    among them) and ``embedding_prefixes``; its ``__init__`` calls ``super().__init__(config)``,
    builds the module once and hands its parameter tree to ``set_layout``; it defines ``init``
    (with ``flatten``) and ``logits`` (with ``unflatten``).
    """

    name: str
    defaults: Mapping[str, Any]
    # Tensors whose name starts with one of these are embeddings (merged by a weighted mean).
    embedding_prefixes: tuple[str, ...] = ()

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = {**self.defaults, **dict(config or {})}
        unknown = set(self.config) - set(self.defaults)
        if unknown:
            raise ValueError(f"{self.name}: unknown config keys {sorted(unknown)}")
        self._names: list[str] = []
        self._shapes: list[tuple[int, ...]] = []
        self._treedef = None

    def set_layout(self, tree: Any, tensor_name: Callable[[tuple], str]) -> None:
        """Takes the tensor names (``tensor_name`` of each leaf's tree path), shapes and tree
        structure from ``tree``, a parameter tree of the module."""
        leaves_with_paths, self._treedef = jax.tree_util.tree_flatten_with_path(tree)
        self._names = [tensor_name(path) for path, _ in leaves_with_paths]
        self._shapes = [tuple(leaf.shape) for _, leaf in leaves_with_paths]

    def flatten(self, tree: Any) -> Params:
        """A parameter tree of the layout's structure as flat float32 ``Params``."""
        leaves = jax.tree_util.tree_leaves(tree)
        return {name: jnp.asarray(leaf, PARAM_DTYPE) for name, leaf in zip(self._names, leaves, strict=True)}

    def unflatten(self, params: Mapping[str, jax.Array]) -> Any:
        """The parameter tree of flat ``params`` (inside ``logits``: jittable)."""
        return jax.tree_util.tree_unflatten(self._treedef, [params[name] for name in self._names])

    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]

    @property
    def seq_len(self) -> int:
        return self.config["seq_len"]

    def tensor_specs(self) -> list[TensorSpec]:
        return [TensorSpec(name, shape, is_embedding=name.startswith(self.embedding_prefixes))
                for name, shape in zip(self._names, self._shapes, strict=True)]

    def logits(self, params: Mapping[str, jax.Array], tokens: jax.Array) -> jax.Array:
        """Next-token logits ``(B, T, vocab_size)`` of int32 ``tokens`` ``(B, T)``."""
        raise NotImplementedError

    def loss(self, params: Mapping[str, jax.Array], batch: jax.Array) -> jax.Array:
        log_probs = jax.nn.log_softmax(self.logits(params, batch[:, :-1]), axis=-1)
        return -jnp.take_along_axis(log_probs, batch[:, 1:, None], axis=-1).mean()
