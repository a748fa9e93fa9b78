"""The learner's inner optimization: AdamW config, the jitted step, held-out eval.

Owns: ``make_mesh``, ``TrainStep``, ``make_eval_fn`` and ``enable_compilation_cache`` (the optimizer itself is
``ddiloco.algo.inner``, shared with the syncer's data-parallel mode).
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

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ddiloco.algo.inner import InnerOptConfig, make_inner_optimizer  # noqa: F401 (re-exported)
from ddiloco.models.base import Model, Params

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"

COMPILATION_CACHE_MAX_BYTES = 512 * 2**20


def enable_compilation_cache(path: str, max_size_bytes: int = COMPILATION_CACHE_MAX_BYTES) -> None:
    """Persists every XLA program this process compiles under ``path`` and loads it from there next time.

    A restarted learner otherwise spends seconds of CPU compiling its init and step again (the
    tiny model: 5.4 CPU-s from import to the second step without the cache, 1.0 CPU-s with it,
    measured on our 2-core machines), while on shared hosts those seconds slow every other
    learner too. Entries are written under a file lock (JAX locks when the cache is bounded), so
    learners may share one directory. Call before the first compilation.
    """
    jax.config.update("jax_compilation_cache_dir", path)
    # JAX's defaults skip programs compiled in under a second and small entries: a learner's
    # programs are often both, and are still worth seconds at a restart.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", max_size_bytes)


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

        def gradients(params: Params, batch: jax.Array):
            loss, grads = jax.value_and_grad(model.loss)(params, batch)
            return grads, loss

        # No buffer donation: the learner keeps handing its current params to the
        # syncer while training continues, so old buffers must stay valid.
        if mesh is None:
            self._step = jax.jit(step)
            self._gradients = jax.jit(gradients)
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
        self._gradients = jax.jit(
            gradients,
            in_shardings=(self.param_shardings, self._batch_sharding),
            out_shardings=(self.param_shardings, self._replicated),
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
        params, opt_state, loss = self._step(params, opt_state, self._place_batch(batch))
        # float() waits for the step to finish: one host sync per step, which also
        # keeps a learner from queueing unbounded async work.
        return params, opt_state, float(self.to_host(loss))


    def gradients(self, params: Params, batch: np.ndarray) -> tuple[Params, float]:
        """The gradient of the mean batch loss (no optimizer step): the data-parallel baseline.

        Same arguments and errors as ``__call__``; returns the gradients (sharded like the
        parameters) and the batch loss in nats.
        """
        grads, loss = self._gradients(params, self._place_batch(batch))
        return grads, float(self.to_host(loss))

    def _place_batch(self, batch: np.ndarray) -> jax.Array | np.ndarray:
        if self.mesh is None:
            return batch
        if batch.shape[0] % self.mesh.size:
            raise ValueError(
                f"batch of {batch.shape[0]} sequences is not divisible by the {self.mesh.size} devices "
                "of the mesh: use a batch size that is a multiple of the device count"
            )
        host_batch = np.asarray(batch)
        return jax.make_array_from_callback(host_batch.shape, self._batch_sharding, lambda index: host_batch[index])


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
