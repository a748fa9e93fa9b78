"""The learner's inner optimization: AdamW config, the jitted step, held-out eval.

Owns: ``InnerOptConfig``, ``make_inner_optimizer``, ``TrainStep`` and ``make_eval_fn``.
Must not: sample data, talk to the syncer or read the environment; the learner
loop wires these pieces together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ddiloco.models.base import Model, Params


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
        if self.weight_decay < 0:
            raise ValueError(f"InnerOptConfig.weight_decay={self.weight_decay}: use a value >= 0")
        for field in ("b1", "b2"):
            if not 0 <= getattr(self, field) < 1:
                raise ValueError(f"InnerOptConfig.{field}={getattr(self, field)}: use [0, 1)")


def _decay_mask(params: Params) -> dict[str, bool]:
    # Decay matrices (weights, embeddings) only: decaying LayerNorm scales and
    # biases pulls them toward 0 for no regularization benefit.
    return {name: p.ndim >= 2 for name, p in params.items()}


def make_inner_optimizer(cfg: InnerOptConfig) -> optax.GradientTransformation:
    """AdamW with global-norm clipping, linear warmup then a constant LR.

    The LR at step ``s`` is ``learning_rate * min(1, (s + 1) / (warmup_steps + 1))``:
    the first step already moves (no batch is wasted) and the peak is reached at
    step ``warmup_steps``. It stays constant after (no cosine decay) because a
    learner in Decoupled DiLoCo runs open-ended: it joins, leaves and rejoins, so
    there is no fixed total step count to decay against.

    Args:
        cfg: hyperparameters.

    Returns:
        The optax transformation; its state counts steps for the warmup.
    """

    def schedule(step: jax.Array) -> jax.Array:
        return cfg.learning_rate * jnp.minimum(1.0, (step + 1) / (cfg.warmup_steps + 1))

    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip_norm),
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=_decay_mask),
    )


class TrainStep:
    """Jitted inner step: (params, opt_state, batch) -> (params, opt_state, loss)."""

    def __init__(self, model: Model, optimizer: optax.GradientTransformation) -> None:
        """Compiles lazily on the first call (and again for a new batch shape).

        Args:
            model: supplies the loss.
            optimizer: e.g. from ``make_inner_optimizer``.
        """
        self._optimizer = optimizer

        def step(params: Params, opt_state: optax.OptState, batch: jax.Array):
            loss, grads = jax.value_and_grad(model.loss)(params, batch)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        # No buffer donation: the learner keeps handing its current params to the
        # syncer while training continues, so old buffers must stay valid.
        self._step = jax.jit(step)

    def init_opt_state(self, params: Params) -> optax.OptState:
        """Returns a fresh optimizer state (zero moments, step 0) for ``params``."""
        return self._optimizer.init(params)

    def __call__(
        self, params: Params, opt_state: optax.OptState, batch: np.ndarray
    ) -> tuple[Params, optax.OptState, float]:
        """Runs one AdamW step on ``batch``.

        Args:
            params: current params (not modified).
            opt_state: current optimizer state (not modified).
            batch: int32 ``(B, T+1)`` token windows.

        Returns:
            New params, new optimizer state, and the pre-update batch loss in nats.

        Raises:
            ValueError: if the batch shape does not fit the model.
        """
        params, opt_state, loss = self._step(params, opt_state, batch)
        # float() waits for the step to finish: one host sync per step, which also
        # keeps a learner from queueing unbounded async work.
        return params, opt_state, float(loss)


def make_eval_fn(model: Model) -> Callable[[Params, Sequence[np.ndarray]], float]:
    """Builds a jitted held-out evaluator.

    Args:
        model: supplies the loss.

    Returns:
        ``eval_fn(params, batches) -> float``: the mean loss in nats over the given
        ``(B, T+1)`` batches (equal-size batches weigh equally). It raises
        ``ValueError`` if ``batches`` is empty.
    """
    loss_fn = jax.jit(model.loss)

    def eval_fn(params: Params, batches: Sequence[np.ndarray]) -> float:
        if not batches:
            raise ValueError("batches is empty: pass at least one held-out batch")
        # Accumulate on device; one host sync at the end.
        total = sum((loss_fn(params, batch) for batch in batches), jnp.zeros(()))
        return float(total) / len(batches)

    return eval_fn
