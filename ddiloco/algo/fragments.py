"""Parameter fragments: balanced tensor fragmentation and the staggered sync schedule.

Owns: ``TensorSpec``, ``Fragment``, ``FragmentPlan``, ``plan_fragments`` (greedy LPT
bin-packing of whole tensors into P fragments, Decoupled DiLoCo §3.1) and the flat
float32 layout of a fragment (``flatten_fragment`` / ``unflatten_fragment``) and its digest
(``fragment_sha256``).
Must not: do I/O, talk to the network, or know how fragments are merged or encoded.

A fragment is an ordered set of whole tensors (sorted by name), serialized as one flat
float32 vector: the tensors concatenated in that order, each raveled C-order.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TensorSpec:
    """One named parameter tensor of a model.

    Attributes:
        name: stable tensor name, e.g. ``"block0.attn.wqkv"``.
        shape: the tensor's shape; every dimension is positive (``()`` is a scalar).
        is_embedding: True for token/position embedding tables, which are merged with a
            weighted mean instead of RDA (their outer gradients are not orthogonal).
    """

    name: str
    shape: tuple[int, ...]
    is_embedding: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("TensorSpec.name is empty: give every tensor a stable name")
        # Accept lists (e.g. from JSON or protobuf) but store a hashable tuple.
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if any(d <= 0 for d in self.shape):
            raise ValueError(
                f"TensorSpec {self.name!r} has shape={self.shape}: every dimension must be >= 1"
            )

    @property
    def numel(self) -> int:
        """Number of elements in the tensor."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class Fragment:
    """A set of whole tensors synchronized together.

    Attributes:
        fragment_id: index of the fragment in its plan.
        tensors: the tensors, in serialization order (sorted by name).
        offset_steps: the fragment is due at local steps ``t >= 1`` with
            ``t % sync_period_steps == offset_steps``.
    """

    fragment_id: int
    tensors: tuple[TensorSpec, ...]
    offset_steps: int

    @property
    def numel(self) -> int:
        """Total number of elements, i.e. the length of the flat vector."""
        return sum(spec.numel for spec in self.tensors)

    def slices(self) -> dict[str, slice]:
        """Returns where each tensor lives in the flat vector, keyed by tensor name."""
        out: dict[str, slice] = {}
        start = 0
        for spec in self.tensors:
            out[spec.name] = slice(start, start + spec.numel)
            start += spec.numel
        return out


@dataclass(frozen=True)
class FragmentPlan:
    """All fragments of a model and the period at which each one is synchronized.

    Attributes:
        fragments: the fragments; ``fragments[i].fragment_id == i``.
        sync_period_steps: H, local steps between two syncs of the same fragment.
    """

    fragments: tuple[Fragment, ...]
    sync_period_steps: int

    def __post_init__(self) -> None:
        if self.sync_period_steps < 1:
            raise ValueError(f"sync_period_steps={self.sync_period_steps} is invalid: must be >= 1")
        for index, fragment in enumerate(self.fragments):
            if fragment.fragment_id != index:
                raise ValueError(
                    f"fragments[{index}].fragment_id={fragment.fragment_id}: "
                    "fragment ids must equal their index in the plan"
                )
            if not 0 <= fragment.offset_steps < self.sync_period_steps:
                raise ValueError(
                    f"fragment {index} has offset_steps={fragment.offset_steps}: "
                    f"must be in [0, sync_period_steps={self.sync_period_steps})"
                )

    @property
    def num_fragments(self) -> int:
        """P, the number of fragments."""
        return len(self.fragments)

    def due(self, step: int) -> list[int]:
        """Returns the ids of the fragments due at a local step.

        Args:
            step: local step counter, counted from 1 after the first inner step; step 0
                (before any training) has nothing due.

        Returns:
            Fragment ids in increasing order; over any H consecutive steps every fragment
            appears exactly once.

        Raises:
            ValueError: if ``step`` is negative.
        """
        if step < 0:
            raise ValueError(f"step={step} is negative: local steps count up from 0")
        if step == 0:
            return []
        phase = step % self.sync_period_steps
        return [f.fragment_id for f in self.fragments if f.offset_steps == phase]

    def fragment_of(self, tensor_name: str) -> int:
        """Returns the id of the fragment holding a tensor.

        Raises:
            ValueError: if no fragment holds ``tensor_name``.
        """
        try:
            return self._fragment_by_tensor[tensor_name]
        except KeyError:
            raise ValueError(
                f"tensor_name={tensor_name!r} is in no fragment of this plan: "
                "check the model matches the plan"
            ) from None

    @functools.cached_property
    def _fragment_by_tensor(self) -> dict[str, int]:
        return {spec.name: f.fragment_id for f in self.fragments for spec in f.tensors}


def plan_fragments(
    specs: Sequence[TensorSpec], num_fragments: int, sync_period_steps: int, *, staggered: bool = True
) -> FragmentPlan:
    """Bin-packs whole tensors into balanced fragments with staggered sync offsets.

    Greedy LPT (Graham): tensors sorted by size descending (ties by name) each go to the
    currently lightest fragment (ties to the lowest index). The largest fragment, which
    sets the peak bandwidth of one sync, is then within 4/3 of the best possible packing.
    Offsets are ``(fragment_id * H) // P``, so with ``P == H`` exactly one fragment is due
    per step, and with ``P > H`` several fragments share a step.

    Args:
        specs: every tensor of the model, in any order.
        num_fragments: P, at least 1 and at most ``len(specs)`` (no empty fragments).
        sync_period_steps: H, at least 1.
        staggered: stagger the offsets (Streaming / Decoupled DiLoCo); False puts every
            fragment at offset 0, so all are due at the same steps (synchronous DiLoCo).

    Returns:
        The plan; deterministic for a given set of specs, whatever their input order.

    Raises:
        ValueError: on P or H < 1, P > number of tensors, or duplicate tensor names.
    """
    if num_fragments < 1:
        raise ValueError(f"num_fragments={num_fragments} is invalid: must be >= 1")
    if sync_period_steps < 1:
        raise ValueError(f"sync_period_steps={sync_period_steps} is invalid: must be >= 1")
    if num_fragments > len(specs):
        raise ValueError(
            f"num_fragments={num_fragments} exceeds the {len(specs)} tensors: fragments hold "
            "whole tensors, so use num_fragments <= number of tensors"
        )
    duplicates = sorted(n for n, c in Counter(s.name for s in specs).items() if c > 1)
    if duplicates:
        raise ValueError(f"duplicate tensor names {duplicates}: tensor names must be unique")

    bins: list[list[TensorSpec]] = [[] for _ in range(num_fragments)]
    # Heap of (load, bin index): the minimum is the lightest bin, ties to the lowest index.
    heap = [(0, index) for index in range(num_fragments)]
    for spec in sorted(specs, key=lambda s: (-s.numel, s.name)):
        load, index = heapq.heappop(heap)
        bins[index].append(spec)
        heapq.heappush(heap, (load + spec.numel, index))

    fragments = tuple(
        Fragment(
            fragment_id=index,
            tensors=tuple(sorted(members, key=lambda s: s.name)),
            offset_steps=(index * sync_period_steps) // num_fragments if staggered else 0,
        )
        for index, members in enumerate(bins)
    )
    return FragmentPlan(fragments=fragments, sync_period_steps=sync_period_steps)


def flatten_fragment(params: Mapping[str, np.ndarray], fragment: Fragment) -> np.ndarray:
    """Serializes a fragment's tensors into one flat float32 vector.

    Args:
        params: flat ``name -> array`` parameters holding at least the fragment's tensors
            (other tensors are ignored). Values are cast to float32.
        fragment: the fragment to extract.

    Returns:
        A fresh 1-D float32 array of ``fragment.numel`` values (never a view of ``params``).

    Raises:
        ValueError: if a tensor is missing or has the wrong shape.
    """
    parts = []
    for spec in fragment.tensors:
        if spec.name not in params:
            raise ValueError(
                f"params has no tensor {spec.name!r} of fragment {fragment.fragment_id}: "
                "pass the full parameter dict of the same model"
            )
        value = np.asarray(params[spec.name], dtype=np.float32)
        if value.shape != spec.shape:
            raise ValueError(
                f"params[{spec.name!r}].shape={value.shape} but the fragment expects "
                f"{spec.shape}: check the model matches the plan"
            )
        parts.append(value.ravel())
    # concatenate always allocates, so the result never aliases the caller's params.
    return np.concatenate(parts)


def unflatten_fragment(flat: np.ndarray, fragment: Fragment) -> dict[str, np.ndarray]:
    """Splits a fragment's flat vector back into named tensors.

    Args:
        flat: 1-D array of ``fragment.numel`` values.
        fragment: the fragment it was serialized from.

    Returns:
        ``name -> float32 array`` shaped per spec. For a float32 ``flat`` these are views
        into it (no copy): copy them if ``flat`` is modified afterwards.

    Raises:
        ValueError: if ``flat`` is not 1-D or has the wrong length.
    """
    flat = np.asarray(flat, dtype=np.float32)
    if flat.ndim != 1 or flat.size != fragment.numel:
        raise ValueError(
            f"flat has shape {flat.shape} but fragment {fragment.fragment_id} needs a 1-D "
            f"vector of {fragment.numel} values"
        )
    return {
        spec.name: flat[where].reshape(spec.shape)
        for spec, where in zip(fragment.tensors, fragment.slices().values(), strict=True)
    }


def state_sha256(arrays) -> str:
    """sha256 (hex) of a sequence of arrays (an outer optimizer's state: the momentum buffer), each
    as little-endian float32 bytes, in order. A merge's ledger record carries it: the parameters
    alone can hide a changed merge, whose last bits round away when added to the parameters while
    the momentum buffer keeps them (and shows them a few merges later)."""
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(np.ascontiguousarray(array, dtype="<f4").tobytes())
    return digest.hexdigest()


def pseudo_gradient(global_values: np.ndarray, local_values: np.ndarray) -> np.ndarray:
    """A learner's contribution to a fragment (paper Alg. 1): the global values it last folded in
    minus its local values, flat float32; the outer optimizer steps against its merge."""
    return np.subtract(global_values, local_values, dtype=np.float32)


def version_step(held: np.ndarray, new_values: np.ndarray) -> np.ndarray:
    """new_values - held in float32: what the syncer encodes as a delta-encoded global version
    (GlobalFragmentHeader.delta); learners then hold apply_delta(held, decoded step)."""
    return np.subtract(new_values, held, dtype=np.float32)


def apply_delta(held: np.ndarray, step: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
    """held + step in float32: how the syncer and every learner compute a delta-encoded global
    version (GlobalFragmentHeader.delta), so that both get bit-identical values. `out`: a float32
    array to write the sum into (it may be `step` itself, so the syncer holds no second
    fragment-sized array); the bits are the same as without it."""
    return np.add(held, step, out=out, dtype=np.float32)


def fragment_sha256(values: np.ndarray) -> str:
    """sha256 (hex) of a flat fragment's values as little-endian float32 bytes: how learners, the
    syncer and checkpoints tell whether they hold the same fragment values, whatever the dtype or
    byte order of the array they hold them in. Hashes the buffer itself (no copy) when the values
    already are contiguous little-endian float32, as the syncer's and learners' fragments are."""
    return hashlib.sha256(np.ascontiguousarray(values, dtype="<f4").data).hexdigest()


def shard_fragments(num_fragments: int, num_shards: int, shard_index: int) -> list[int]:
    """The fragment ids syncer shard `shard_index` of `num_shards` owns (docs/architecture.md,
    "Fragment shards"): fragment f belongs to shard f mod num_shards. Round-robin rather than
    contiguous because fragment rounds are staggered by id: neighbouring rounds land on different
    shards, so the shards' merge load is spread in time as well as in bytes (the plan already
    balances fragments' sizes). Every shard must own at least one fragment."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    if not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index {shard_index} is outside 0..{num_shards - 1}")
    if num_fragments < num_shards:
        raise ValueError(f"{num_shards} syncer shards need at least as many fragments, got {num_fragments}")
    return list(range(shard_index, num_fragments, num_shards))
