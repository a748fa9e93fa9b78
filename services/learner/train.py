"""The learner's inner optimization: AdamW config, the jitted step, held-out eval.

Owns: ``InnerOptConfig``, ``make_inner_optimizer``, ``make_mesh``, ``TrainStep`` and
``make_eval_fn``.
Must not: sample data, talk to the syncer or read the environment; the learner
loop wires these pieces together.

A learner unit may span many devices (and hosts). ``TrainStep`` then takes a
``jax.sharding.Mesh`` with axes ``("data", "fsdp")``: the global batch is sharded over
every device of the mesh, parameters and optimizer state are replicated over ``"data"``
and, when the ``"fsdp"`` axis is longer than 1, sharded over it (each tensor along its
first axis divisible by the ``"fsdp"`` size; tensors with no such axis stay replicated).
The inner step is one jitted SPMD program; XLA inserts the gradient all-reduce (and the
FSDP all-gathers / reduce-scatters). Without a mesh the step is the plain single-device
``jax.jit`` it always was.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ddiloco.models.base import Model, Params

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"


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


def make_mesh(devices: Sequence[jax.Device], shape: tuple[int, int] | None = None) -> Mesh:
    """Builds a learner unit's ``("data", "fsdp")`` mesh.

    Args:
        devices: every device of the unit, in process-major order (as ``jax.devices()``).
        shape: ``(data, fsdp)`` with ``data * fsdp == len(devices)``; ``None`` is
            ``(len(devices), 1)``: pure data parallelism with replicated parameters.

    Returns:
        The mesh.

    Raises:
        ValueError: if the shape does not cover the devices exactly.
    """
    devices = list(devices)
    if not devices:
        raise ValueError("make_mesh needs at least one device")
    data, fsdp = shape if shape is not None else (len(devices), 1)
    if data < 1 or fsdp < 1 or data * fsdp != len(devices):
        raise ValueError(
            f"mesh shape {data}x{fsdp} does not cover the {len(devices)} devices: "
            "use DATAxFSDP with DATA*FSDP equal to the device count"
        )
    return Mesh(np.array(devices, dtype=object).reshape(data, fsdp), (DATA_AXIS, FSDP_AXIS))


def fsdp_spec(shape: Sequence[int], fsdp_size: int) -> P:
    """The PartitionSpec of one parameter: its first axis divisible by ``fsdp_size`` is
    sharded over ``"fsdp"``; replicated if there is none (or ``fsdp_size == 1``)."""
    if fsdp_size > 1:
        for axis, dim in enumerate(shape):
            if dim % fsdp_size == 0:
                return P(*([None] * axis), FSDP_AXIS)
    return P()


class TrainStep:
    """Jitted inner step: (params, opt_state, batch) -> (params, opt_state, loss).

    Without a mesh: one device, plain ``jax.jit``. With a mesh: one SPMD program over it
    (see the module docstring); ``place``/``place_params`` put host values where the step
    expects them and ``to_host`` brings one tensor back.
    """

    def __init__(self, model: Model, optimizer: optax.GradientTransformation, mesh: Mesh | None = None) -> None:
        """Compiles lazily on the first call (and again for a new batch shape).

        Args:
            model: supplies the loss and the tensor shapes.
            optimizer: e.g. from ``make_inner_optimizer``.
            mesh: a ``("data", "fsdp")`` mesh from ``make_mesh``; ``None``: one device.
        """
        self._optimizer = optimizer
        self.mesh = mesh

        def step(params: Params, opt_state: optax.OptState, batch: jax.Array):
            loss, grads = jax.value_and_grad(model.loss)(params, batch)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        # No buffer donation: the learner keeps handing its current params to the
        # syncer while training continues, so old buffers must stay valid.
        if mesh is None:
            self._step = jax.jit(step)
            self._init = optimizer.init
            self.param_shardings: dict[str, NamedSharding] = {}
            return
        fsdp_size = mesh.shape[FSDP_AXIS]
        shapes = self._shapes = {spec.name: tuple(spec.shape) for spec in model.tensor_specs()}
        self.param_shardings = {name: NamedSharding(mesh, fsdp_spec(shape, fsdp_size)) for name, shape in shapes.items()}
        self._replicated = NamedSharding(mesh, P())
        self._batch_sharding = NamedSharding(mesh, P((DATA_AXIS, FSDP_AXIS)))
        abstract = {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in shapes.items()}
        opt_shardings = self._opt_state_shardings(jax.eval_shape(optimizer.init, abstract))
        self._init = jax.jit(optimizer.init, in_shardings=(self.param_shardings,), out_shardings=opt_shardings)
        self._step = jax.jit(
            step,
            in_shardings=(self.param_shardings, opt_shardings, self._batch_sharding),
            out_shardings=(self.param_shardings, opt_shardings, self._replicated),
        )

    def _opt_state_shardings(self, abstract_state):
        # Moments (mu, nu, ...) are dicts keyed by parameter name with the parameter's
        # shape: they follow the parameter's sharding. Everything else (step counts) is
        # replicated.
        def sharding_of(path, leaf):
            last = path[-1] if path else None
            name = getattr(last, "key", None)
            if isinstance(name, str) and name in self._shapes and tuple(leaf.shape) == self._shapes[name]:
                return self.param_shardings[name]
            return self._replicated

        return jax.tree_util.tree_map_with_path(sharding_of, abstract_state)

    @property
    def num_devices(self) -> int:
        """Devices the step runs on (every host of the unit)."""
        return 1 if self.mesh is None else self.mesh.size

    def place(self, name: str, value: np.ndarray) -> jax.Array:
        """Puts one host tensor where the step expects parameter ``name``.

        Each device receives only its own slice (``make_array_from_callback``), so this
        also works when the mesh spans hosts; every process must pass the same value.
        """
        if self.mesh is None:
            return jnp.asarray(value)
        value = np.asarray(value, dtype=np.float32)
        return jax.make_array_from_callback(value.shape, self.param_shardings[name], lambda index: value[index])

    def place_params(self, params: Params) -> Params:
        """``place`` for every tensor; without a mesh the params are returned as they are."""
        if self.mesh is None:
            return params
        return {name: self.place(name, np.asarray(value)) for name, value in params.items()}

    @staticmethod
    def to_host(value: jax.Array | np.ndarray) -> np.ndarray:
        """One tensor as a host numpy array (one copy of a replicated tensor).

        Collective for a tensor sharded across hosts (FSDP over several processes): every
        process of the unit must then call it, in the same order.
        """
        if not isinstance(value, jax.Array) or value.is_fully_addressable:
            return np.asarray(value)
        if value.is_fully_replicated:
            return np.asarray(value.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(value, tiled=True))

    def init_opt_state(self, params: Params) -> optax.OptState:
        """Returns a fresh optimizer state (zero moments, step 0) for ``params``."""
        return self._init(params)

    def __call__(
        self, params: Params, opt_state: optax.OptState, batch: np.ndarray
    ) -> tuple[Params, optax.OptState, float]:
        """Runs one AdamW step on ``batch``.

        Args:
            params: current params (not modified); with a mesh, as from ``place_params``.
            opt_state: current optimizer state (not modified).
            batch: int32 ``(B, T+1)`` token windows: the unit's GLOBAL batch. With a mesh,
                every process passes the same batch and its devices take their rows; ``B``
                must be divisible by the mesh size.

        Returns:
            New params, new optimizer state, and the pre-update batch loss in nats.

        Raises:
            ValueError: if the batch shape does not fit the model or the mesh.
        """
        if self.mesh is not None:
            if batch.shape[0] % self.mesh.size:
                raise ValueError(
                    f"batch of {batch.shape[0]} sequences is not divisible by the {self.mesh.size} devices "
                    "of the mesh: use a batch size that is a multiple of the device count"
                )
            host_batch = np.asarray(batch)
            batch = jax.make_array_from_callback(host_batch.shape, self._batch_sharding, lambda index: host_batch[index])
        params, opt_state, loss = self._step(params, opt_state, batch)
        # float() waits for the step to finish: one host sync per step, which also
        # keeps a learner from queueing unbounded async work.
        return params, opt_state, float(self.to_host(loss))


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
