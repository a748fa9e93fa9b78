"""The inner optimizer: AdamW with global-norm clipping, a linear warmup and a cosine decay.

Owns ``InnerOptConfig``, ``make_inner_optimizer`` and its LR schedule (``InnerScheduleState``,
``continue_schedule``). Learners run it on their own parameters
(inner steps); the syncer runs the very same transformation in the data-parallel baseline
(`--sync-mode dp`), where learners send gradients and the syncer takes the optimizer step, so
the baseline differs from Decoupled DiLoCo only in where and how often the optimizer runs.
Must not: hold state or do I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

Params = dict

@dataclass(frozen=True)
class InnerOptConfig:
    """AdamW hyperparameters; defaults are tuned for the ``"small"`` transformer
    preset at batch 16 x 128 bytes (see each comment)."""

    # Peak LR. Single-learner 300-step sweeps on the small preset (held-out
    # nats/byte at step 300): 1e-3 -> 2.21, 2e-3 -> 2.18, 3e-3 -> 2.19,
    # 6e-3 -> 2.61 (unstable). 2e-3 is the best and keeps a 3x margin to the edge,
    # which syncer merges and outer momentum can push toward.
    learning_rate: float = 2e-3
    # Linear ramp to the peak LR: Adam's first updates use poorly estimated
    # second moments, and a short ramp avoids the resulting loss spike.
    warmup_steps: int = 20
    # Cosine decay of the LR from the peak (at warmup_steps) to final_lr_fraction x peak at
    # decay_steps, then constant; 0: no decay (constant after the warmup). A learner decays over
    # its --steps when it has a step budget: the last inner steps of a run then move the model
    # little, so the end-of-training merges do not leave the global model wherever the last
    # rounds' large steps happened to put it (DiLoCo's inner optimizer decays likewise).
    decay_steps: int = 0
    final_lr_fraction: float = 0.1
    # Decoupled decay on matrices only (see make_inner_optimizer); 0.1 is the
    # DiLoCo-lineage value.
    weight_decay: float = 0.1
    b1: float = 0.9
    # 0.99 rather than 0.999: second moments adapt within ~100 steps, which suits
    # short runs and params overwritten by syncer merges.
    b2: float = 0.99
    # Clip the global gradient norm at this value, as in nanoGPT/DiLoCo.
    grad_clip_norm: float = 1.0

    def __post_init__(self) -> None:
        for field in ("learning_rate", "grad_clip_norm"):
            if not getattr(self, field) > 0:
                raise ValueError(f"InnerOptConfig.{field}={getattr(self, field)}: use a value > 0")
        if self.warmup_steps < 0:
            raise ValueError(f"InnerOptConfig.warmup_steps={self.warmup_steps}: use a value >= 0")
        if self.decay_steps < 0:
            raise ValueError(f"InnerOptConfig.decay_steps={self.decay_steps}: use a value >= 0 (0: no decay)")
        if self.decay_steps and self.decay_steps <= self.warmup_steps:
            raise ValueError(f"InnerOptConfig.decay_steps={self.decay_steps} must exceed warmup_steps="
                             f"{self.warmup_steps} (or be 0: no decay)")
        if not 0 <= self.final_lr_fraction <= 1:
            raise ValueError(f"InnerOptConfig.final_lr_fraction={self.final_lr_fraction}: use [0, 1]")
        if self.weight_decay < 0:
            raise ValueError(f"InnerOptConfig.weight_decay={self.weight_decay}: use a value >= 0")
        for field in ("b1", "b2"):
            if not 0 <= getattr(self, field) < 1:
                raise ValueError(f"InnerOptConfig.{field}={getattr(self, field)}: use [0, 1)")


def decay_mask(params: Params) -> dict[str, bool]:
    # Decay matrices (weights, embeddings) only: decaying LayerNorm scales and
    # biases pulls them toward 0 for no regularization benefit.
    return {name: p.ndim >= 2 for name, p in params.items()}


class InnerScheduleState(NamedTuple):
    """The inner LR schedule's position and constants, kept as arrays in the optimizer state.

    The jitted step reads the constants as inputs rather than baking them into the program: the
    lives of one learner (another --steps, hence another decay horizon, and another start step)
    then run the same compiled step, which a restart loads from the compilation cache instead of
    compiling again (a restarted learner's first step took ~6 s under load while the schedule's
    horizon was a compile-time constant, and its first contributions came too late to merge).
    """

    count: jax.Array  # int32: inner steps taken on this schedule, by every life of the learner
    peak_lr: jax.Array  # float32, as the rest
    warmup_steps: jax.Array
    decay_steps: jax.Array  # 0: no decay
    final_lr_fraction: jax.Array


def schedule_value(step, peak_lr, warmup_steps, decay_steps, final_lr_fraction) -> jax.Array:
    """The inner LR at step ``step`` (0-based), for Python numbers or (traced) arrays alike: a linear
    ramp ``peak * (s + 1) / (warmup_steps + 1)`` (the first step already moves, so no batch is
    wasted; the peak is reached at step ``warmup_steps``), then the peak, or with ``decay_steps`` a
    cosine from the peak down to ``final_lr_fraction * peak`` at step ``decay_steps``, constant
    after."""
    step = jnp.asarray(step, jnp.float32)
    ramp = peak_lr * jnp.minimum(1.0, (step + 1.0) / (warmup_steps + 1.0))
    # jnp.maximum keeps the unused branch finite when there is no decay (decay_steps 0).
    progress = jnp.clip((step - warmup_steps) / jnp.maximum(decay_steps - warmup_steps, 1.0), 0.0, 1.0)
    cosine = peak_lr * ((1.0 - final_lr_fraction) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress)) + final_lr_fraction)
    return jnp.where((decay_steps > 0) & (step >= warmup_steps), cosine, ramp)


def lr_schedule(cfg: InnerOptConfig) -> optax.Schedule:
    """``schedule_value`` with ``cfg``'s constants, as an optax schedule (for models that build
    their own inner optimizer; the constants are then compiled into their step)."""
    return lambda step: schedule_value(step, cfg.learning_rate, float(cfg.warmup_steps), float(cfg.decay_steps),
                                       cfg.final_lr_fraction)


def scale_by_inner_schedule(cfg: InnerOptConfig) -> optax.GradientTransformation:
    """Scales updates by ``-schedule_value`` at the state's count, with the constants taken from the
    state (``InnerScheduleState``), initialised from ``cfg``; ``continue_schedule`` moves them."""

    def init(params) -> InnerScheduleState:
        del params
        return _schedule_state(0, cfg)

    def update(updates, state: InnerScheduleState, params=None):
        del params
        lr = schedule_value(state.count, state.peak_lr, state.warmup_steps, state.decay_steps, state.final_lr_fraction)
        updates = jax.tree_util.tree_map(lambda g: (-lr).astype(g.dtype) * g, updates)
        return updates, state._replace(count=optax.safe_int32_increment(state.count))

    return optax.GradientTransformation(init, update)


def _schedule_state(count: int, cfg: InnerOptConfig) -> InnerScheduleState:
    def f32(value) -> jax.Array:
        return jnp.asarray(value, jnp.float32)

    return InnerScheduleState(count=jnp.asarray(count, jnp.int32), peak_lr=f32(cfg.learning_rate),
                              warmup_steps=f32(cfg.warmup_steps), decay_steps=f32(cfg.decay_steps),
                              final_lr_fraction=f32(cfg.final_lr_fraction))


def _is_schedule(node) -> bool:
    # optax's ScaleByScheduleState: the count of a model's own optimizer's schedule (Adam's
    # ScaleByAdamState count is not one: its bias correction must restart with fresh moments).
    return isinstance(node, (InnerScheduleState, optax.ScaleByScheduleState))


def schedule_count(opt_state) -> int | None:
    """The step count of the first LR schedule in ``opt_state``; None when it has none."""
    nodes = [n for n in jax.tree_util.tree_leaves(opt_state, is_leaf=_is_schedule) if _is_schedule(n)]
    return int(nodes[0].count) if nodes else None


def continue_schedule(opt_state, cfg: InnerOptConfig, start_step: int | None):
    """``opt_state`` with every LR schedule's count set to ``start_step`` (None: kept, e.g. as
    restored from a snapshot) and ``InnerScheduleState``'s constants set to ``cfg``'s.

    A restarted learner's schedule thus goes on from the steps its earlier lives ran instead of
    warming up again; Adam's moments and bias-correction count are left as they are (zero for a
    fresh state). Each new leaf is placed like the one it replaces (a unit's mesh)."""

    def like(old: jax.Array, value) -> jax.Array:
        new = jnp.asarray(value, old.dtype)
        # Committed only where the old leaf was (a unit's mesh): jit annotates committed inputs in
        # the program it lowers, so a leaf committed here and not in another life would change the
        # compilation-cache key.
        return jax.device_put(new, old.sharding) if getattr(old, "committed", False) else new

    def update(node):
        if not _is_schedule(node):
            return node
        count = node.count if start_step is None else like(node.count, start_step)
        if isinstance(node, optax.ScaleByScheduleState):
            return node._replace(count=count)
        fresh = _schedule_state(0, cfg)
        return InnerScheduleState(count, *(like(o, f) for o, f in zip(node[1:], fresh[1:])))

    return jax.tree_util.tree_map(update, opt_state, is_leaf=_is_schedule)


def make_inner_optimizer(cfg: InnerOptConfig) -> optax.GradientTransformation:
    """AdamW with global-norm clipping and the LR of ``schedule_value``.

    Without ``decay_steps`` the LR stays constant after the warmup: a learner in Decoupled DiLoCo
    that runs open-ended (it joins, leaves and rejoins under a fleet token budget, or until
    SIGTERM) has no total step count to decay against. A restarted learner's schedule goes on from
    its earlier lives' steps (``continue_schedule``); its Adam moments start from zero.

    Args:
        cfg: hyperparameters.

    Returns:
        The optax transformation (optax.adamw's parts, with the LR schedule's constants in its
        state: ``InnerScheduleState``).
    """
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip_norm),
        optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2),
        optax.add_decayed_weights(cfg.weight_decay, decay_mask),
        scale_by_inner_schedule(cfg),
    )
