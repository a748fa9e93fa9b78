"""A byte-level language model written with Flax NNX, trained by ddiloco as a model plugin.

Run it with `PYTHONPATH=examples ddiloco up --model flax_lm:build` (every process resolves the same
name: the syncer, the learners, the evaluator and `ddiloco export`). ddiloco sees any model as
pure functions of a flat ``{tensor name: float32 array}`` dict (ddiloco.models.base.Model); this
file shows the adapter for Flax NNX: split the module into its graph and its parameters once,
flatten the parameters with their tree paths as names, and merge them back inside ``loss``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ddiloco.models.pytree import PytreeModel

NAME = "flax_lm:build"  # the name every process resolves (module:factory)
DEFAULTS = {"vocab_size": 256, "seq_len": 64, "width": 64, "heads": 4, "depth": 2, "init_seed": 0}


class Block(nnx.Module):
    """Pre-norm self-attention and MLP, with residual connections."""

    def __init__(self, width: int, heads: int, rngs: nnx.Rngs) -> None:
        self.norm1 = nnx.LayerNorm(width, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=width, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class ByteLM(nnx.Module):
    def __init__(self, cfg: Mapping[str, Any], rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(cfg["vocab_size"], cfg["width"], rngs=rngs)
        self.pos = nnx.Embed(cfg["seq_len"], cfg["width"], rngs=rngs)
        self.blocks = nnx.List([Block(cfg["width"], cfg["heads"], rngs) for _ in range(cfg["depth"])])
        self.norm = nnx.LayerNorm(cfg["width"], rngs=rngs)
        self.head = nnx.Linear(cfg["width"], cfg["vocab_size"], rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[-1]))
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def _name(path) -> str:
    """`blocks.0.attn.query.kernel` from a tree path (dict keys, list indices, attributes); the
    Param's own `.value` attribute at the end is not part of the name."""
    parts = [str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))) for key in path]
    return ".".join(parts[:-1] if parts and parts[-1] == "value" else parts)


class FlaxModel(PytreeModel):
    """The ddiloco Model protocol over a Flax NNX module."""

    name = NAME
    defaults = DEFAULTS
    embedding_prefixes = ("embed.", "pos.")

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        # The graph (structure, static attributes) is fixed; only the parameters travel.
        module = ByteLM(self.config, nnx.Rngs(params=self.config["init_seed"]))
        self._graphdef, state = nnx.split(module, nnx.Param)
        self.set_layout(state, _name)

    def init(self, rng: jax.Array) -> dict[str, jax.Array]:
        if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
            rng = jax.random.wrap_key_data(rng)  # a raw uint32 key, as jax.random.PRNGKey makes
        module = ByteLM(self.config, nnx.Rngs(params=rng))
        return self.flatten(nnx.split(module, nnx.Param)[1])

    def logits(self, params: Mapping[str, jax.Array], tokens: jax.Array) -> jax.Array:
        return nnx.merge(self._graphdef, self.unflatten(params))(tokens)


def build(config: Mapping[str, Any] | None = None) -> FlaxModel:
    """The factory ddiloco calls with the syncer's `--model-config` (a JSON object)."""
    return FlaxModel(config)
