"""The outer optimizer: SGD with Nesterov momentum applied to one fragment at a time.

Owns: ``make_outer_optimizer`` and ``OuterStepper``, which runs the optimizer on flat
float32 fragment vectors and keeps its state as plain numpy arrays (checkpointable).
Must not: merge contributions, hold state for more than the call, or do I/O.

The outer gradient is Δ = Θ - θ (the syncer's global fragment minus a learner's, merged
over learners), so a step moves Θ towards the learners:
    buf ← μ·buf + Δ;    Θ ← Θ - η·(Δ + μ·buf)
(optax ``sgd(nesterov=True)``). DiLoCo's defaults are η = 0.7, μ = 0.9; the Decoupled
DiLoCo paper publishes no values of its own.

Speed: for the optimizer ``make_outer_optimizer`` builds (element-wise SGD with momentum) the
step is one compiled pass (``_kernels.scaled_sgd_step``, numba) with the same state layout as
optax's (the momentum buffer), and it can take the merged delta in the merge accumulator's
factored form, so the delta is computed, stepped on and written once. Outputs come from a
small per-size pool of arrays that nobody else references any more: on a 2-core VM, first
touching fresh pages cost more than the step itself for a 100 MB fragment. A jitted optax
call copied every input in and every output out (0.12 GB/s for 33 MB fragments); numpy
ufuncs need six passes per chunk (10-17 % of memory-copy bandwidth). Other optimizers take
the jitted optax path.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ddiloco.algo import _kernels
from ddiloco.algo import choices
from ddiloco.algo import merge as merge_lib

# The optimizer state's leaf shapes/dtypes and treedef for one fragment size.
_Structure = tuple[list[jax.ShapeDtypeStruct], jax.tree_util.PyTreeDef]
# Output arrays (params, momentum, delta) that nobody references any more are kept for reuse,
# at most this many per fragment size between steps: a step frees three (the oldest params
# version, the old momentum, the old delta) and takes three. Memory cost: those three stay
# allocated until the next step of a fragment of that size, instead of being freed and
# faulted in again.
POOL_FREE_ARRAYS = 3
# ... and at most this many bytes of them per size. An array larger than this is never pooled
# (freed as soon as nobody holds it): free arrays leave the pool only at its next take, so a pooled
# fragment-sized array idles until that fragment's next merge. At 100M parameters x 4 shards the
# pool held two free 100 MB arrays at a shard's peak (8 bytes per owned parameter); a 1B model's
# fragments are ~1 GB. Memory for speed: a fragment above it faults its outputs in at each step.
POOL_FREE_BYTES = 64 * 2**20
# Arrays tracked per size (in use or free), to bound the scan.
_POOL_TRACKED = 64
# The pool trusts CPython's reference counts; a free-threaded build could race them.
_POOL_SAFE = sys.implementation.name == "cpython" and getattr(sys, "_is_gil_enabled", lambda: True)()


class OuterStepResult(NamedTuple):
    """What ``OuterStepper.step_scaled`` computes."""

    params: np.ndarray  # the new global params Θ'
    state: list[np.ndarray]  # the new optimizer state
    outer_grad: np.ndarray | None  # the merged delta Δ the step applied, written out (None if not asked)
    outer_grad_norm: float  # ‖Δ‖
    finite: bool  # whether every new parameter is finite


class _SGDTransformation(optax.GradientTransformation):
    """``optax.sgd`` that also carries its hyperparameters, so that ``OuterStepper`` can run
    it as a numpy loop. Behaves as the optax transformation everywhere else."""

    hyperparameters: tuple[float, float, bool]


OUTER_STEP_FRACTIONS = choices.OUTER_STEP_FRACTIONS  # how much of a whole outer step a merge takes


class MergeShare(NamedTuple):
    """How much of a whole outer step one merge takes (``merge_share``)."""

    fraction: float  # OuterStepper.step_scaled's fraction s
    delta_scale: float  # the merged Δ is multiplied by this before the step (1: as merged)


def merge_share(mode: str, contributions: Sequence[tuple[int, int]], *, contributors: int,
                expected_contributors: int, sync_period_steps: int) -> MergeShare:
    """The share of a round's work a merge holds, as the outer step takes it.

    A round's work is H inner steps of every learner the round was for. ``rounds`` = the
    contributions' token-weighted mean inner steps / H (the work of how many rounds each holds)
    and ``q`` = contributors / expected contributors (how many of the round's learners it holds):

    * ``"work"``: Δ·q stepped as the fraction rounds·q. The learners the round expected but did
      not get count as zero pseudo-gradients with the present ones' mean weight (the weighted
      mean then is Δ·q, and so is RDA, whose radius averages a norm of 0 for them): a merge of
      1 of M learners moves Θ by its Δ/M with a 1/M share of a momentum push, as M lone merges
      add up to one merge of all M. Their work is not lost (rebase keeps it; the next merge that
      holds it counts its steps). A merge that holds every expected learner is exactly ``"steps"``.
    * ``"steps"``: Δ stepped as the fraction rounds, whatever q. Every lone merge moves Θ by a
      whole round's Δ with a whole momentum push, so with learners desynchronised (a loaded
      machine, no grace window) Θ takes M full steps per round of work. That loop is unstable:
      a stale contribution is re-anchored by the syncer's own last move (Θ_v − Θ_base), which
      the step sends back amplified by η(1 + μ); with η = 0.7, μ = 0.9 and each lone merge one
      version stale its moves grow by |λ| = 1.04 per merge even when the learners do no work
      (at q = 1/2 with "work": 0.84); two rebasing learners on a noisy quadratic, half a period
      apart with a few steps of latency, diverge with "steps" and train with "work"
      (tests/unit/test_partial_merges.py: pure loops, no syncer). Under load a quick
      ``bench quality`` run's held-out loss went 4.53 -> 5.29 in 12 merges; this loop is the
      suspected cause, not a shown one (the run was not recorded merge by merge), and "work" has
      not been measured for quality or goodput in a full run.
    * ``"whole"``: every merge one whole step of Δ (the synchronous baselines).

    Args:
        mode: one of ``OUTER_STEP_FRACTIONS``.
        contributions: (tokens, inner steps) of each contribution in the merge.
        contributors: distinct learners in the merge.
        expected_contributors: learners the round was for (live ones and those in the merge).
        sync_period_steps: H, > 0.

    Returns:
        ``MergeShare``; (1, 1) for ``"whole"`` and for a merge without tokens.

    Raises:
        ValueError: on an unknown mode.
    """
    if mode not in OUTER_STEP_FRACTIONS:
        raise ValueError(f"outer step fraction {mode!r} is not one of {OUTER_STEP_FRACTIONS}")
    tokens = sum(t for t, _ in contributions)
    if mode == "whole" or tokens <= 0:
        return MergeShare(1.0, 1.0)
    rounds = max(sum(t * s for t, s in contributions) / tokens, 1.0) / sync_period_steps
    if mode == "steps":
        return MergeShare(rounds, 1.0)
    share = min(1.0, contributors / max(expected_contributors, contributors, 1))
    return MergeShare(rounds * share, share)


def scale_delta(merged: merge_lib.ScaledResult, factor: float) -> merge_lib.ScaledResult:
    """Δ·factor (``MergeShare.delta_scale``), still factored (float32 scales, sum_squares kept: it is
    per unscaled value); ``merged`` itself when factor is 1, so a full merge is bit for bit unchanged."""
    if factor == 1.0:
        return merged
    return merged._replace(scales=(merged.scales * np.float32(factor)).astype(np.float32))


def make_outer_optimizer(
    learning_rate: float = 0.7, momentum: float = 0.9, nesterov: bool = True
) -> optax.GradientTransformation:
    """Builds the outer optimizer.

    Args:
        learning_rate: η, > 0.
        momentum: μ, in [0, 1).
        nesterov: use Nesterov momentum (the paper's choice) rather than heavy ball.

    Returns:
        ``optax.sgd(learning_rate, momentum, nesterov)``.

    Raises:
        ValueError: on a non-positive learning rate or momentum outside [0, 1).
    """
    if not (math.isfinite(learning_rate) and learning_rate > 0):
        raise ValueError(f"learning_rate={learning_rate} is invalid: must be finite and > 0")
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum={momentum} is invalid: must be in [0, 1)")
    transformation = _SGDTransformation(*optax.sgd(learning_rate=learning_rate, momentum=momentum, nesterov=nesterov))
    transformation.hyperparameters = (float(learning_rate), float(momentum), bool(nesterov))
    return transformation


class OuterStepper:
    """Applies the outer optimizer to one fragment's flat float32 params; jitted once per
    fragment size.

    One stepper serves every fragment: state is passed in and returned, never kept. State is
    a list of numpy arrays (the optimizer state's leaves), so it can be checkpointed and
    restored bit-exactly; the same inputs always give bit-identical outputs. The stepper
    keeps only a pool of output arrays that no caller references any more (CPython's
    reference count says so), and reuses them: callers may keep any array it returned for
    as long as they like, and it is never written again while they do.
    """

    def __init__(
        self,
        optimizer: optax.GradientTransformation,
        tensors: Sequence[tuple[str, tuple[int, ...]]] | None = None,
        *,
        pool_free_arrays: int = POOL_FREE_ARRAYS,
        pool_free_bytes: int = POOL_FREE_BYTES,
    ) -> None:
        """Wraps an optimizer.

        Args:
            optimizer: usually ``make_outer_optimizer()``.
            tensors: ``(name, shape)`` of the fragment's tensors in flattening order, for an
                optimizer that needs the tensor structure (AdamW's per-tensor weight-decay
                mask and global-norm clipping in the data-parallel baseline). The stepper
                then serves only fragments of that layout. ``None``: the optimizer sees the
                flat vector (element-wise optimizers such as Nesterov SGD).
            pool_free_arrays: unreferenced output arrays kept per fragment size for reuse;
                0 allocates every output anew.
            pool_free_bytes: at most this many bytes of them per fragment size; outputs
                larger than this are never pooled.
        """
        self._optimizer = optimizer
        # (η, μ, nesterov) when the step can run as the numpy loop (element-wise SGD).
        self._sgd = getattr(optimizer, "hyperparameters", None) if tensors is None else None
        self._tensors = None if tensors is None else [(name, tuple(shape)) for name, shape in tensors]
        sizes = None if tensors is None else [math.prod(shape) for _, shape in self._tensors]
        self._tree_numel = None if sizes is None else sum(sizes)

        def to_tree(flat):
            if self._tensors is None:
                return flat
            parts = jnp.split(flat, np.cumsum(sizes)[:-1].tolist()) if len(sizes) > 1 else [flat]
            return {name: part.reshape(shape) for (name, shape), part in zip(self._tensors, parts, strict=True)}

        def to_flat(tree):
            if self._tensors is None:
                return tree
            return jnp.concatenate([tree[name].reshape(-1) for name, _ in self._tensors])

        def step(params, state, grad):
            params_tree, grad_tree = to_tree(params), to_tree(grad)
            updates, state = optimizer.update(grad_tree, state, params_tree)
            return to_flat(optax.apply_updates(params_tree, updates)), state

        self._to_tree = to_tree
        self._step = jax.jit(step)
        # numel -> state structure; computed once per fragment size.
        self._structures: dict[int, _Structure] = {}
        # numel -> arrays this stepper returned earlier, reused once nobody else holds them.
        self._pool: dict[int, list[np.ndarray]] = {}
        self._pool_lock = threading.Lock()
        self._pool_free_arrays = pool_free_arrays if _POOL_SAFE else 0
        self._pool_free_bytes = pool_free_bytes
        # Δ's per-block scratch when a step need not write it out: one per thread, since the
        # syncer steps different fragments with one stepper from several threads at once.
        self._scratch_local = threading.local()
        if self._sgd is not None:
            _kernels.warm_up()  # compile now (~0.5 s once per process), not in the first merge

    def init(self, params_flat: np.ndarray) -> list[np.ndarray]:
        """Returns a fresh optimizer state for a fragment.

        Args:
            params_flat: the fragment's 1-D float32 global params.

        Returns:
            The state's leaves as numpy arrays.

        Raises:
            ValueError: if ``params_flat`` is not a 1-D float32 array.
        """
        params = _check_vector("params_flat", params_flat)
        self._check_layout(params.size)
        leaves = jax.tree_util.tree_leaves(self._optimizer.init(self._to_tree(jnp.asarray(params))))
        return [np.array(leaf) for leaf in leaves]

    def step(
        self,
        params_flat: np.ndarray,
        state: list[np.ndarray],
        outer_grad_flat: np.ndarray,
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """Applies one outer step.

        Args:
            params_flat: the fragment's 1-D float32 global params Θ.
            state: the state from ``init`` or a previous ``step`` (or restored from disk).
            outer_grad_flat: the merged outer gradient Δ, same size as ``params_flat``.

        Returns:
            The new params and the new state: new numpy arrays, or arrays this stepper
            returned before that no caller references any more.

        Raises:
            ValueError: on mismatched sizes or dtypes, or a state that does not have the
                structure ``init`` gives for this fragment size.
        """
        params, grad = _check_fragment_pair("outer_grad_flat", outer_grad_flat, params_flat)
        leaves = self._check_state(params.size, state)
        whole = np.array([0, grad.size], np.int64)
        result = self._step_checked(params, leaves, grad, whole, np.ones(1, np.float32))
        return result.params, result.state

    def step_scaled(
        self,
        params_flat: np.ndarray,
        state: list[np.ndarray],
        values: np.ndarray,
        bounds: np.ndarray,
        scales: np.ndarray,
        sum_squares: np.ndarray | None = None,
        *,
        write_grad: bool = True,
        fraction: float = 1.0,
    ) -> OuterStepResult:
        """Applies one outer step to a delta given in factored form (``merge.ScaledResult``):
        Δ[bounds[k]:bounds[k+1]] = values[...] · scales[k].

        ``fraction`` s > 0 is the share of a full round's work the merge holds (its inner steps
        over H). s < 1 makes it a fractional step (a round of a few steps, at the start or the
        end of training): the momentum decays by μ^s instead of μ and the step takes s·μ of it
        instead of μ (Nesterov: Θ ← Θ − η·(Δ + s·μ·b'), b' = Δ + μ^s·b), so s → 0 moves Θ by η·Δ
        alone and leaves the momentum as it was, and 1/s steps of s each move about as much as
        one whole step. A whole step (s = 1) costs momentum one decay and takes one full carry,
        however little work the merge holds: with μ = 0.9 an empty merge moved Θ by ~0.8 of a
        regular outer step. s > 1 (the work of many rounds at once: learners cut off from the
        syncer for a while) moves Θ by the whole Δ but feeds the momentum only Δ/s, one round's
        rate (b' = Δ/s + μ·b, Θ ← Θ − η·(Δ + μ·b')): the momentum would otherwise carry the
        whole of Δ on for ~1/(1 − μ) more merges, ten times a many-round Δ at μ = 0.9, faster
        than the next rounds' few steps can correct it (the chaos soak diverged that way:
        contributions of 60-170 inner steps at H = 4 after syncer outages, held-out loss +58 %
        and +128 % over the fault-free run). SGD-with-momentum optimizers only; others ignore it.

        Bit for bit the same as ``step(params_flat, state, Δ)`` with Δ written out first,
        in one pass over memory for SGD; Δ is also returned written out unless
        ``write_grad`` is False (a caller that keeps the factored form saves a sixth of the
        step's memory traffic), with its norm and whether the new params are all finite.

        Args:
            params_flat: the fragment's 1-D float32 global params Θ.
            state: the state from ``init`` or a previous step.
            values: 1-D float32 vector, same size as ``params_flat``.
            bounds: int64 offsets, increasing from 0 to ``values.size``.
            scales: float32, one per segment (``len(bounds) - 1``).
            sum_squares: Σ values² per segment (float64), if known (``ScaledResult``
                carries the merge's): ‖Δ‖ then comes from them, and the step's pass needs
                only a cheap finiteness probe instead of float64 sums (~25 % of its time).

        Returns:
            ``OuterStepResult``, all arrays fresh or recycled from this stepper's pool.

        Raises:
            ValueError: on mismatched sizes or dtypes, bad bounds, or a state that does not
                have the structure ``init`` gives for this fragment size.
        """
        params, values = _check_fragment_pair("values", values, params_flat)
        bounds, scales = _check_segments(values.size, bounds, scales)
        grad_sq = None if sum_squares is None else _squared_norm(sum_squares, scales)
        if not (fraction > 0.0 and math.isfinite(fraction)):
            raise ValueError(f"fraction={fraction}: a step's fraction must be a finite number > 0")
        return self._step_checked(params, self._check_state(params.size, state), values, bounds, scales, write_grad,
                                  grad_sq, fraction)

    def _check_state(self, numel: int, state: list[np.ndarray]) -> list[np.ndarray]:
        self._check_layout(numel)
        leaf_specs, _ = self._structure(numel)
        if len(state) != len(leaf_specs):
            raise ValueError(
                f"state has {len(state)} arrays but the optimizer state has "
                f"{len(leaf_specs)}: pass the list returned by init() or step()"
            )
        leaves = [np.asarray(leaf) for leaf in state]
        for index, (leaf, spec) in enumerate(zip(leaves, leaf_specs, strict=True)):
            if leaf.shape != spec.shape or leaf.dtype != spec.dtype:
                raise ValueError(
                    f"state[{index}] is {leaf.dtype}{list(leaf.shape)} but the optimizer "
                    f"expects {spec.dtype}{list(spec.shape)}: the state belongs to another "
                    "fragment or optimizer"
                )
        return leaves

    def _step_checked(
        self, params: np.ndarray, leaves: list[np.ndarray], values: np.ndarray, bounds: np.ndarray, scales: np.ndarray,
        write_grad: bool = True, grad_sq: float | None = None, fraction: float = 1.0,
    ) -> OuterStepResult:
        if self._sgd is not None:
            lr, mu, nesterov = self._sgd
            whole = mu if nesterov else 1.0  # what a whole step carries of the momentum
            if fraction > 1.0:  # many rounds' work: the momentum takes one round's rate of it
                decay, carry, into = mu, whole, 1.0 / fraction
            else:
                decay, carry, into = (mu, whole, 1.0) if fraction == 1.0 else (mu**fraction, fraction * whole, 1.0)
            buf = np.ascontiguousarray(leaves[0])
            params_out, buf_out = self._take(params.size), self._take(params.size)
            # Without write_grad, Δ goes block by block to an L1-sized scratch (for its norm).
            grad_out = self._take(params.size) if write_grad or params.size <= _kernels.BLOCK else self._scratch
            kernel_sq, params_sum = _kernels.scaled_sgd_step(
                np.ascontiguousarray(values), bounds, scales, (np.ascontiguousarray(params), buf),
                (grad_out, params_out, buf_out), (np.float32(decay), np.float32(-lr), np.float32(carry), np.float32(into)),
                nesterov, grad_sq is None,
            )
            grad_sq = kernel_sq if grad_sq is None else grad_sq
            grad = grad_out if write_grad else None
            return OuterStepResult(params_out, [buf_out], grad, math.sqrt(grad_sq), math.isfinite(params_sum))
        grad = merge_lib.ScaledResult(values, bounds, scales).materialize()
        _, treedef = self._structure(params.size)
        tree = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(leaf) for leaf in leaves])
        new_params, new_state = self._step(jnp.asarray(params), tree, jnp.asarray(grad))
        # np.array copies, so callers never hold buffers owned by JAX.
        new_params = np.array(new_params)
        return OuterStepResult(
            new_params, [np.array(x) for x in jax.tree_util.tree_leaves(new_state)], grad,
            float(np.linalg.norm(grad.astype(np.float64))), bool(np.isfinite(new_params).all()),
        )

    @property
    def _scratch(self) -> np.ndarray:
        scratch = getattr(self._scratch_local, "array", None)
        if scratch is None:
            scratch = self._scratch_local.array = np.empty(_kernels.BLOCK, np.float32)
        return scratch

    def _take(self, numel: int) -> np.ndarray:
        """An output array of ``numel`` float32 values: a pooled one that nobody else
        references, or a new one. Trims the pool's free arrays to ``pool_free_arrays`` and
        ``pool_free_bytes``; an array above ``pool_free_bytes`` is not pooled at all."""
        keep_free = min(self._pool_free_arrays, self._pool_free_bytes // max(1, 4 * numel))
        if keep_free <= 0:
            return np.empty(numel, np.float32)
        with self._pool_lock:
            pool = self._pool.setdefault(numel, [])
            # References of a free array: the pool's list and getrefcount's argument. Any
            # other holder (a caller, a view, a buffer export such as a pending encode)
            # makes the count larger.
            free = [index for index in range(len(pool)) if sys.getrefcount(pool[index]) == 2]
            if free:
                array = pool[free[0]]
                for index in reversed(free[keep_free:]):
                    del pool[index]  # beyond what the next steps need: let it go
                return array
            array = np.empty(numel, np.float32)
            if len(pool) < _POOL_TRACKED:
                pool.append(array)
            return array

    def _check_layout(self, numel: int) -> None:
        if self._tree_numel is not None and numel != self._tree_numel:
            raise ValueError(
                f"this stepper serves a fragment of {self._tree_numel} values, got {numel}: "
                "use one stepper per fragment layout"
            )

    def _structure(self, numel: int) -> _Structure:
        """Returns the state's leaf specs and treedef for a fragment size, derived from the
        optimizer itself so that a state restored from disk can be checked without init()."""
        if numel not in self._structures:
            if self._tensors is None:
                spec = jax.ShapeDtypeStruct((numel,), np.float32)
            else:
                spec = {name: jax.ShapeDtypeStruct(shape, np.float32) for name, shape in self._tensors}
            # eval_shape traces init without computing or allocating anything.
            self._structures[numel] = jax.tree_util.tree_flatten(
                jax.eval_shape(self._optimizer.init, spec)
            )
        return self._structures[numel]


def _check_segments(numel: int, bounds: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``bounds`` as contiguous int64 and ``scales`` as contiguous float32, once they are
    checked to split a vector of ``numel`` values into ``len(scales)`` segments."""
    bounds = np.ascontiguousarray(bounds, dtype=np.int64)
    scales = np.ascontiguousarray(scales, dtype=np.float32)
    # A fragment has a few segments: Python on the list is ~4 us cheaper per step than
    # numpy's diff and any (a few % of the step of a 131K-value fragment).
    offsets = bounds.tolist() if bounds.ndim == 1 else []
    if (
        scales.ndim != 1 or len(offsets) != scales.size + 1
        or offsets[0] != 0 or offsets[-1] != numel
        or any(lo > hi for lo, hi in zip(offsets, offsets[1:]))
    ):
        raise ValueError(
            f"bounds {bounds.tolist()[:8]} and {scales.size} scales do not split a vector "
            f"of {numel} values: need len(scales) + 1 increasing offsets from 0"
        )
    return bounds, scales


def _squared_norm(sum_squares: np.ndarray, scales: np.ndarray) -> float:
    """‖Δ‖² from the factored form's Σ values² per segment and its float32 scales."""
    squares = np.asarray(sum_squares, dtype=np.float64)
    if squares.shape != scales.shape:
        raise ValueError(f"sum_squares has shape {squares.shape}: pass one per segment ({scales.size})")
    return float(np.dot(squares, np.square(scales.astype(np.float64))))


def _check_vector(field: str, value: np.ndarray) -> np.ndarray:
    array = np.asarray(value)
    if array.ndim != 1 or array.dtype != np.float32:
        raise ValueError(f"{field} is {array.dtype}{list(array.shape)}: pass a 1-D float32 vector")
    return array


def _check_fragment_pair(field: str, value: np.ndarray, params_flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(params_flat, value) as checked vectors of the same fragment: both 1-D float32, same size."""
    params = _check_vector("params_flat", params_flat)
    array = _check_vector(field, value)
    if array.shape != params.shape:
        raise ValueError(
            f"{field} has {array.size} values but params_flat has {params.size}: both must cover the same fragment"
        )
    return params, array
