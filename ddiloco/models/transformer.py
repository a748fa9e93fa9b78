"""A small byte-level decoder-only transformer written directly in jax.numpy.

Owns: ``TransformerConfig``, its named presets and the ``Transformer`` model
(init, logits, per-token and mean loss, tensor specs).
Must not: hold state between calls; every method is a pure function of its args.

Architecture (GPT-2 style): learned token + position embeddings, ``n_layers``
pre-LayerNorm blocks (causal multi-head self-attention, then a GELU MLP), a
final LayerNorm and an UNTIED output head. Untied because with a 256-byte
vocabulary the head is tiny, and keeping ``embed`` a pure input table means
only the two embedding tables are merged by plain averaging (``is_embedding``);
``head`` is an ordinary dense matrix like the rest.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ddiloco.algo.fragments import TensorSpec
from ddiloco.models.base import PARAM_DTYPE, Params


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Shape and init hyperparameters; the defaults are the ``"small"`` preset."""

    vocab_size: int = 256  # byte-level: one token per byte value
    seq_len: int = 128  # context length T; the position table has this many rows
    d_model: int = 128  # residual stream width
    n_layers: int = 2  # transformer blocks
    n_heads: int = 4  # attention heads; must divide d_model
    d_ff: int = 512  # MLP hidden width (4 * d_model, the GPT-2 ratio)
    init_std: float = 0.02  # std of the normal init of weights and embeddings (GPT-2)
    layer_norm_eps: float = 1e-5  # added to the variance so LayerNorm never divides by 0

    def __post_init__(self) -> None:
        for field in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff"):
            value = getattr(self, field)
            # bool is an int subclass; True as a layer count is always a mistake.
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TransformerConfig.{field}={value!r}: use a positive int")
        for field in ("init_std", "layer_norm_eps"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"TransformerConfig.{field}={value!r}: use a positive float")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"TransformerConfig.d_model={self.d_model} is not divisible by "
                f"n_heads={self.n_heads}: pick n_heads that divides d_model"
            )


# Named starting points; config keys override individual fields.
PRESETS: dict[str, TransformerConfig] = {
    # Unit tests: 30k params; the AdamW train step compiles in ~2.5 s and runs in
    # ~3 ms (batch 16 x 32) on a 2-core CPU.
    "tiny": TransformerConfig(seq_len=32, d_model=32, n_layers=1, n_heads=2, d_ff=128),
    # The demo: 478k params in 25 tensors; one AdamW step on batch 16 x 128 takes
    # ~130 ms on an idle 2-core CPU (4 layers took ~270 ms), so 4 learners +
    # syncer + evaluator sharing those cores still step a few times per second.
    "small": TransformerConfig(),
}
DEFAULT_PRESET = "small"


def config_from_overrides(overrides: Mapping[str, Any] | None = None) -> TransformerConfig:
    """Resolves ``{"preset": name, **field_overrides}`` into a ``TransformerConfig``.

    Args:
        overrides: optional ``"preset"`` (default ``"small"``) plus any
            ``TransformerConfig`` fields, which replace the preset's values.

    Returns:
        The complete config.

    Raises:
        ValueError: on an unknown preset or field, or an invalid value.
    """
    overrides = dict(overrides or {})
    preset = overrides.pop("preset", DEFAULT_PRESET)
    if preset not in PRESETS:
        raise ValueError(f"transformer preset={preset!r} is unknown: use one of {sorted(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"transformer config keys {unknown} are unknown: use 'preset' or {sorted(fields)}")
    return dataclasses.replace(PRESETS[preset], **overrides)


def _layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    mean = x.mean(axis=-1, keepdims=True)
    var = jnp.square(x - mean).mean(axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def _init_leaf(key: jax.Array, shape: tuple[int, ...], rule: str, std: float) -> jax.Array:
    """One tensor's initial values by its rule: 1, 0, or N(0, std^2) drawn from `key`."""
    if rule == "ones":
        return jnp.ones(shape, PARAM_DTYPE)
    if rule == "zeros":
        return jnp.zeros(shape, PARAM_DTYPE)
    return std * jax.random.normal(key, shape, PARAM_DTYPE)


# Jitted as in Transformer._init (eager normal sampling differs in the last ulp): the shape, rule
# and std are static, so a model compiles one program per distinct tensor shape, not per tensor.
_init_leaf_jit = jax.jit(_init_leaf, static_argnums=(1, 2, 3))
_split_jit = jax.jit(jax.random.split, static_argnums=1)


class Transformer:
    """The byte-level transformer as a ``Model``; see the module docstring."""

    name = "transformer"

    def __init__(self, cfg: TransformerConfig | None = None) -> None:
        """Builds the model description; no parameters are allocated here.

        Args:
            cfg: shapes and init scale; defaults to the ``"small"`` preset.
        """
        self.cfg = cfg or PRESETS[DEFAULT_PRESET]
        self.config: dict[str, Any] = dataclasses.asdict(self.cfg)
        self._layout = self._build_layout()
        self._init_jit = jax.jit(self._init)

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def seq_len(self) -> int:
        return self.cfg.seq_len

    def _build_layout(self) -> list[tuple[TensorSpec, str]]:
        """Every tensor with its init rule, in forward-pass order."""
        c = self.cfg
        layout = [
            (TensorSpec("embed", (c.vocab_size, c.d_model), is_embedding=True), "normal"),
            (TensorSpec("pos_embed", (c.seq_len, c.d_model), is_embedding=True), "normal"),
        ]
        for i in range(c.n_layers):
            b = f"block{i}"
            layout += [
                (TensorSpec(f"{b}.ln1.scale", (c.d_model,)), "ones"),
                (TensorSpec(f"{b}.ln1.bias", (c.d_model,)), "zeros"),
                (TensorSpec(f"{b}.attn.wqkv", (c.d_model, 3 * c.d_model)), "normal"),
                (TensorSpec(f"{b}.attn.wo", (c.d_model, c.d_model)), "residual"),
                (TensorSpec(f"{b}.ln2.scale", (c.d_model,)), "ones"),
                (TensorSpec(f"{b}.ln2.bias", (c.d_model,)), "zeros"),
                (TensorSpec(f"{b}.mlp.w_in", (c.d_model, c.d_ff)), "normal"),
                (TensorSpec(f"{b}.mlp.b_in", (c.d_ff,)), "zeros"),
                (TensorSpec(f"{b}.mlp.w_out", (c.d_ff, c.d_model)), "residual"),
                (TensorSpec(f"{b}.mlp.b_out", (c.d_model,)), "zeros"),
            ]
        layout += [
            (TensorSpec("ln_f.scale", (c.d_model,)), "ones"),
            (TensorSpec("ln_f.bias", (c.d_model,)), "zeros"),
            (TensorSpec("head", (c.d_model, c.vocab_size)), "normal"),
        ]
        return layout

    def tensor_specs(self) -> list[TensorSpec]:
        """Returns every parameter's spec, in forward-pass order."""
        return [spec for spec, _ in self._layout]

    def init(self, rng: jax.Array) -> Params:
        """Initializes parameters GPT-2 style.

        Weights and embeddings are N(0, init_std); the two projections that write
        into the residual stream (``attn.wo``, ``mlp.w_out``) are scaled down by
        sqrt(2 * n_layers) so the residual variance does not grow with depth.
        LayerNorm scales start at 1, biases at 0. A small head init makes the
        initial loss ~ln(vocab_size).

        Args:
            rng: a JAX PRNG key.

        Returns:
            Flat float32 params keyed by ``TensorSpec.name``, in spec order.
        """
        params = self._init_jit(rng)
        return {spec.name: params[spec.name] for spec, _ in self._layout}

    def _init(self, rng: jax.Array) -> Params:
        # Always run under jit (see __init__): eager and jitted normal sampling
        # differ in the last ulp, and every process must build identical params.
        std = self.cfg.init_std
        stds = {"normal": std, "residual": std / math.sqrt(2 * self.cfg.n_layers)}
        keys = jax.random.split(rng, len(self._layout))
        return {spec.name: _init_leaf(key, spec.shape, rule, stds[rule] if rule in stds else 0.0)
                for key, (spec, rule) in zip(keys, self._layout)}

    def init_tensors(self, rng: jax.Array, names: Iterable[str]) -> Params:
        """Initializes only the tensors named, each bit-identical to ``init(rng)[name]``.

        A fragment shard of the syncer holds a slice of the model: it builds that slice, one
        tensor at a time, instead of the whole model (at 1B parameters, 4 GB per shard). Every
        tensor's key is the same split of ``rng`` as in ``init``, and its values are drawn by the
        same jitted rule (``_init_leaf``), so a slice equals the whole model's.

        Args:
            rng: a JAX PRNG key (the one ``init`` would take).
            names: tensor names, each a ``TensorSpec.name`` of this model.

        Returns:
            Flat float32 params of the tensors named, in spec order.

        Raises:
            ValueError: on a name the model does not have.
        """
        wanted = set(names)
        unknown = wanted - {spec.name for spec, _ in self._layout}
        if unknown:
            raise ValueError(f"init_tensors: the model has no tensor {sorted(unknown)}")
        std = self.cfg.init_std
        stds = {"normal": std, "residual": std / math.sqrt(2 * self.cfg.n_layers)}
        keys = _split_jit(rng, len(self._layout))
        return {spec.name: _init_leaf_jit(keys[index], spec.shape, rule, stds[rule] if rule in stds else 0.0)
                for index, (spec, rule) in enumerate(self._layout) if spec.name in wanted}

    def _attention(self, params: Params, block: str, x: jax.Array) -> jax.Array:
        batch, length, width = x.shape
        heads = self.cfg.n_heads
        qkv = x @ params[f"{block}.attn.wqkv"]
        q, k, v = (t.reshape(batch, length, heads, width // heads) for t in jnp.split(qkv, 3, -1))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(width // heads)
        # Causal mask: position q attends to keys k <= q only. The diagonal is always
        # allowed, so no row is all -inf and softmax stays finite.
        causal = jnp.tril(jnp.ones((length, length), dtype=bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, width)
        return out @ params[f"{block}.attn.wo"]

    def logits(self, params: Params, tokens: jax.Array) -> jax.Array:
        """Next-token logits for every position.

        Args:
            params: as returned by ``init``.
            tokens: int32 ``(B, T)`` token ids with ``T <= seq_len``.

        Returns:
            float32 ``(B, T, vocab_size)``; row ``t`` depends on ``tokens[:, :t+1]`` only.

        Raises:
            ValueError: if ``tokens`` is not 2-D or longer than ``seq_len``.
        """
        if tokens.ndim != 2 or not 1 <= tokens.shape[1] <= self.cfg.seq_len:
            raise ValueError(f"tokens.shape={tokens.shape}: need (batch, T) with 1 <= T <= seq_len={self.cfg.seq_len}")
        eps = self.cfg.layer_norm_eps
        x = params["embed"][tokens] + params["pos_embed"][: tokens.shape[1]]
        for i in range(self.cfg.n_layers):
            b = f"block{i}"
            h = _layer_norm(x, params[f"{b}.ln1.scale"], params[f"{b}.ln1.bias"], eps)
            x = x + self._attention(params, b, h)
            h = _layer_norm(x, params[f"{b}.ln2.scale"], params[f"{b}.ln2.bias"], eps)
            h = jax.nn.gelu(h @ params[f"{b}.mlp.w_in"] + params[f"{b}.mlp.b_in"])
            x = x + h @ params[f"{b}.mlp.w_out"] + params[f"{b}.mlp.b_out"]
        x = _layer_norm(x, params["ln_f.scale"], params["ln_f.bias"], eps)
        return x @ params["head"]

    def token_losses(self, params: Params, batch: jax.Array) -> jax.Array:
        """Per-position next-token cross-entropy in nats.

        Args:
            params: as returned by ``init``.
            batch: int32 ``(B, T+1)``; ``batch[:, :-1]`` are inputs, ``batch[:, 1:]`` targets.

        Returns:
            float32 ``(B, T)``; entry ``t`` is the loss of predicting ``batch[:, t+1]``.

        Raises:
            ValueError: if ``batch`` is not ``(B, T+1)`` with ``1 <= T <= seq_len``.
        """
        if batch.ndim != 2 or batch.shape[1] < 2:
            raise ValueError(f"batch.shape={batch.shape}: need (batch, T+1) with T >= 1")
        log_probs = jax.nn.log_softmax(self.logits(params, batch[:, :-1]), axis=-1)
        return -jnp.take_along_axis(log_probs, batch[:, 1:, None], axis=-1)[..., 0]

    def loss(self, params: Params, batch: jax.Array) -> jax.Array:
        """Mean next-token cross-entropy in nats over all ``B*T`` predictions."""
        return self.token_losses(params, batch).mean()


def from_config(config: Mapping[str, Any] | None = None) -> Transformer:
    """Builds a ``Transformer`` from ``{"preset": ..., **overrides}``.

    Args:
        config: see ``config_from_overrides``; ``None`` means the ``"small"`` preset.

    Returns:
        The model; its ``config`` is complete and rebuilds the same model.

    Raises:
        ValueError: on an unknown preset or field, or an invalid value.
    """
    return Transformer(config_from_overrides(config))
