"""The inner optimizer: AdamW with global-norm clipping, a linear warmup and a cosine decay.

Owns ``InnerOptConfig`` and ``make_inner_optimizer``. Learners run it on their own parameters
(inner steps); the syncer runs the very same transformation in the data-parallel baseline
(`--sync-mode dp`), where learners send gradients and the syncer takes the optimizer step, so
the baseline differs from Decoupled DiLoCo only in where and how often the optimizer runs.
Must not: hold state or do I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def lr_schedule(cfg: InnerOptConfig) -> optax.Schedule:
    """The inner LR at step ``s`` (0-based): a linear ramp ``peak * (s + 1) / (warmup_steps + 1)``
    (the first step already moves, so no batch is wasted; the peak is reached at step
    ``warmup_steps``), then the peak, or with ``decay_steps`` a cosine from the peak down to
    ``final_lr_fraction * peak`` at step ``decay_steps``, constant after."""
    def warmup(step: jax.Array) -> jax.Array:
        return cfg.learning_rate * jnp.minimum(1.0, (step + 1) / (cfg.warmup_steps + 1))

    if not cfg.decay_steps:
        return warmup
    decay = optax.cosine_decay_schedule(cfg.learning_rate, cfg.decay_steps - cfg.warmup_steps,
                                        alpha=cfg.final_lr_fraction)
    return optax.join_schedules([warmup, decay], boundaries=[cfg.warmup_steps])


def make_inner_optimizer(cfg: InnerOptConfig) -> optax.GradientTransformation:
    """AdamW with global-norm clipping and the LR of ``lr_schedule``.

    Without ``decay_steps`` the LR stays constant after the warmup: a learner in Decoupled DiLoCo
    that runs open-ended (it joins, leaves and rejoins under a fleet token budget, or until
    SIGTERM) has no total step count to decay against. A restarted learner starts a new schedule
    (its Adam moments start from zero too, so the re-warmup is what a fresh optimizer needs).

    Args:
        cfg: hyperparameters.

    Returns:
        The optax transformation; its state counts steps for the schedule.
    """
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip_norm),
        optax.adamw(lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask),
    )
