"""A byte-level language model written with Equinox, trained by ddiloco as a model plugin.

Run it with `PYTHONPATH=examples ddiloco up --model equinox_lm:build`. ddiloco sees any model as
pure functions of a flat ``{tensor name: float32 array}`` dict (ddiloco.models.base.Model); the
adapter here partitions the Equinox module into its arrays and its static rest once, names the
arrays by their tree paths, and combines them back inside ``loss``. It also chooses the learners'
inner optimizer (`inner_optimizer`): any optax chain, here AdamW without weight decay on the
learners' own warm-up and cosine schedule.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from ddiloco.algo.inner import InnerOptConfig, lr_schedule
from ddiloco.models.pytree import PytreeModel

NAME = "equinox_lm:build"  # the name every process resolves (module:factory)
DEFAULTS = {"vocab_size": 256, "seq_len": 64, "width": 64, "heads": 4, "depth": 2, "init_seed": 0}


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, width: int, heads: int, key: jax.Array) -> None:
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(width)
        self.attn = eqx.nn.MultiheadAttention(heads, width, key=k1)
        self.norm2 = eqx.nn.LayerNorm(width)
        self.up = eqx.nn.Linear(width, 4 * width, key=k2)
        self.down = eqx.nn.Linear(4 * width, width, key=k3)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:  # x: (T, width), one sequence
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h, mask=mask)
        h = jax.vmap(self.norm2)(x)
        return x + jax.vmap(lambda v: self.down(jax.nn.gelu(self.up(v))))(h)


class ByteLM(eqx.Module):
    embed: eqx.nn.Embedding
    pos: eqx.nn.Embedding
    blocks: list
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, cfg: Mapping[str, Any], key: jax.Array) -> None:
        keys = jax.random.split(key, 3 + cfg["depth"])
        self.embed = eqx.nn.Embedding(cfg["vocab_size"], cfg["width"], key=keys[0])
        self.pos = eqx.nn.Embedding(cfg["seq_len"], cfg["width"], key=keys[1])
        self.blocks = [Block(cfg["width"], cfg["heads"], k) for k in keys[3:]]
        self.norm = eqx.nn.LayerNorm(cfg["width"])
        self.head = eqx.nn.Linear(cfg["width"], cfg["vocab_size"], key=keys[2])

    def __call__(self, tokens: jax.Array) -> jax.Array:  # tokens: (T,) -> logits (T, vocab)
        length = tokens.shape[0]
        x = jax.vmap(self.embed)(tokens) + jax.vmap(self.pos)(jnp.arange(length))
        mask = jnp.tril(jnp.ones((length, length), bool))
        for block in self.blocks:
            x = block(x, mask)
        return jax.vmap(lambda v: self.head(self.norm(v)))(x)


def _name(path) -> str:
    """`blocks.0.attn.query_proj.weight` from a tree path (attributes, list indices)."""
    return ".".join(str(getattr(key, "name", getattr(key, "idx", getattr(key, "key", key)))) for key in path)


class EquinoxModel(PytreeModel):
    """The ddiloco Model protocol over an Equinox module."""

    name = NAME
    defaults = DEFAULTS
    embedding_prefixes = ("embed.", "pos.")

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        arrays, self._static = eqx.partition(ByteLM(self.config, jax.random.PRNGKey(self.config["init_seed"])),
                                             eqx.is_inexact_array)
        self.set_layout(arrays, _name)

    def init(self, rng: jax.Array) -> dict[str, jax.Array]:
        if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
            rng = jax.random.key_data(rng)  # equinox takes raw uint32 keys
        return self.flatten(eqx.filter(ByteLM(self.config, rng), eqx.is_inexact_array))

    def logits(self, params: Mapping[str, jax.Array], tokens: jax.Array) -> jax.Array:
        module = eqx.combine(self.unflatten(params), self._static)
        return jax.vmap(module)(tokens)

    def inner_optimizer(self, default: InnerOptConfig) -> optax.GradientTransformation:
        """The learners' inner optimizer for this model: any optax chain. Here: the learners'
        clipping and LR schedule (warm-up, cosine decay over --steps), AdamW without decay."""
        return optax.chain(optax.clip_by_global_norm(default.grad_clip_norm),
                           optax.adamw(lr_schedule(default), b1=default.b1, b2=default.b2, weight_decay=0.0))


def build(config: Mapping[str, Any] | None = None) -> EquinoxModel:
    """The factory ddiloco calls with the syncer's `--model-config` (a JSON object)."""
    return EquinoxModel(config)
