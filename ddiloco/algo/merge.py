"""Merging learners' pseudo-gradients for one fragment (Decoupled DiLoCo §1.4, Sec. 3.2).

Owns: the contribution weight (tokens² / steps), the batch merge rules (weighted mean,
Radial-Directional Averaging and the equal-weight mean) and ``MergeAccumulator``, their
streaming per-tensor form.
Must not: apply the outer optimizer, decode payloads, read clocks or do I/O.

RDA({v_m, w_m}) = (Σ w_m‖v_m‖ / Σ w_m) · φ(Σ w_m φ(v_m) / Σ w_m), with φ(x) = x/‖x‖,
φ(0) = 0, applied per tensor. Learners' outer gradients are nearly orthogonal, so a plain
mean of M vectors of norm R has norm ≈ R/√M; RDA keeps the norm at R whatever M is, so the
outer learning rate need not be retuned with the number of learners. Embedding tensors,
whose outer gradients are not orthogonal, use the weighted mean instead.

Rules (``RULES``), per tensor:

* ``"rda"``: RDA with the contributions' weights (the Decoupled DiLoCo default for
  non-embedding tensors).
* ``"mean"``: the weighted mean Σ w·v / Σ w (the default for embedding tensors).
* ``"equal_mean"``: the plain arithmetic mean Σ v / M of the M contributions, every weight
  ignored (a weight of 0 counts as much as any other): classic synchronous DiLoCo
  (Douillard et al., 2023), whose outer gradient is the average of the learners'
  pseudo-gradients. The syncer's ``diloco`` baseline uses it for every tensor.

Zero weights (weighted rules): a contribution of weight 0 (a learner that processed no
tokens) counts for nothing, unless every contribution has weight 0; then all are merged
with equal weights, so a merge always has a well-defined result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ddiloco.algo import _kernels
from ddiloco.algo import choices
from ddiloco.algo import fragments as fragments_lib

# The names of the rules and step scalings (one definition, light enough for the config modules).
EQUAL_MEAN, RULES, STEP_SCALINGS = choices.EQUAL_MEAN, choices.RULES, choices.STEP_SCALINGS


class _Entry(NamedTuple):
    """A contribution held back or folded in by ``MergeAccumulator``."""

    delta: np.ndarray
    weight: float
    norms: np.ndarray
    key: str
    steps: int
    per_step: float  # ‖Δ‖ / steps
    claims_unverified: bool  # its claimed steps or batch were clipped or not checked: the share cap always applies


def norm_allowance_steps(steps: int, reference_steps: float, scaling: str) -> float:
    """The multiple of a per-step reference norm (from contributions of `reference_steps` steps,
    their median) a contribution of `steps` steps is compared with: ``"per_step"``, `steps`;
    ``"sqrt_below_median"``, `steps` from the reference's step count up, √(steps · reference_steps)
    below it. Why (docs/security.md#bounded-influence): norms grow about linearly with steps across
    one merge's learners, except for contributions of far fewer steps (a restarted learner's first
    ones), whose per-step norms are higher. Claiming fewer steps only lowers a weight (tokens² /
    steps), so the allowance buys a hostile learner little: weight x norm falls as steps^1.5."""
    if scaling not in STEP_SCALINGS:
        raise ValueError(f"scaling={scaling!r} is unknown: use one of {list(STEP_SCALINGS)}")
    steps = max(1, int(steps))
    if scaling == "per_step" or steps >= reference_steps:
        return float(steps)
    return math.sqrt(steps * float(reference_steps))


def contribution_weight(tokens: int, steps: int) -> float:
    """Returns a contribution's merge weight, tokens · (tokens / steps).

    "Quantity × quality" (paper Sec. 3.2): linear in the steps a learner contributed and
    quadratic in its per-step batch, so learners with bigger batches count for more.

    Args:
        tokens: tokens the learner processed on the fragment since it last received it.
        steps: inner steps over the same period.

    Returns:
        ``tokens**2 / steps`` as a float; 0.0 when ``tokens == 0``.

    Raises:
        ValueError: if ``steps <= 0`` or ``tokens < 0``.
    """
    if steps <= 0:
        raise ValueError(f"steps={steps} is invalid: a contribution needs at least 1 step")
    if tokens < 0:
        raise ValueError(f"tokens={tokens} is negative: token counts must be >= 0")
    return float(tokens) * float(tokens) / float(steps)


def weighted_mean(vectors: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """Returns Σ w·v / Σ w (equal weights if every weight is 0).

    Args:
        vectors: one or more arrays of the same shape, all finite.
        weights: one finite weight >= 0 per vector.

    Returns:
        A float32 array of the vectors' shape, computed in float64.

    Raises:
        ValueError: on empty or mismatched inputs, non-finite values or bad weights.
    """
    stacked, w = _check_batch(vectors, weights)
    return (np.tensordot(w, stacked, axes=1) / w.sum()).astype(np.float32)


def equal_mean(vectors: Sequence[np.ndarray], weights: Sequence[float] | None = None) -> np.ndarray:
    """Returns the plain mean Σ v / M of the M vectors: rule ``"equal_mean"`` (classic DiLoCo).

    Args:
        vectors: one or more arrays of the same shape, all finite.
        weights: ignored, apart from being checked like the other rules' (one finite weight
            >= 0 per vector) when given.

    Returns:
        A float32 array of the vectors' shape, computed in float64.

    Raises:
        ValueError: on empty or mismatched inputs, non-finite values or bad weights.
    """
    stacked, _ = _check_batch(vectors, [1.0] * len(vectors) if weights is None else weights)
    return stacked.mean(axis=0).astype(np.float32)


def radial_directional_average(
    vectors: Sequence[np.ndarray], weights: Sequence[float]
) -> np.ndarray:
    """Returns RDA of the vectors: the weighted mean norm along the weighted mean direction.

    Each vector is treated as one tensor (its norm is taken over all its elements).

    Args:
        vectors: one or more arrays of the same shape, all finite.
        weights: one finite weight >= 0 per vector (equal weights if every weight is 0).

    Returns:
        A float32 array of the vectors' shape, computed in float64.

    Raises:
        ValueError: on empty or mismatched inputs, non-finite values or bad weights.
    """
    stacked, w = _check_batch(vectors, weights)
    flat = stacked.reshape(len(stacked), -1)
    norms = np.linalg.norm(flat, axis=1)
    # φ(0) = 0: a zero vector adds nothing to the direction (its norm 0 still counts).
    inv_norms = np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0)
    direction = np.tensordot(w * inv_norms, stacked, axes=1)
    radius = float(w @ norms) / w.sum()
    return (_unit(direction) * radius).astype(np.float32)


# Values per BLAS call when a norm is summed in pieces (float32 partial sums, float64 total).
_NORM_CHUNK = 1 << 15


class ScaledResult(NamedTuple):
    """A merged delta in factored form: Δ[bounds[k]:bounds[k+1]] = values[...] · scales[k]
    (float32 products), one factor per tensor."""

    values: np.ndarray  # float32, the whole fragment
    bounds: np.ndarray  # int64, len(scales) + 1 offsets from 0 to values.size
    scales: np.ndarray  # float32
    # Σ values² per segment (float64) when known, so ‖Δ‖² = Σ scales² · sum_squares needs no pass.
    sum_squares: np.ndarray | None = None

    def materialize(self) -> np.ndarray:
        """Δ as a fresh float32 vector."""
        out = np.empty_like(self.values)
        for k, scale in enumerate(self.scales):
            lo, hi = self.bounds[k], self.bounds[k + 1]
            np.multiply(self.values[lo:hi], scale, out=out[lo:hi])
        return out


class MergeAccumulator:
    """Streaming merge for one fragment: memory O(fragment size), independent of the number
    of contributions.

    Each tensor of the fragment is merged on its own: RDA norms are per tensor, and tensors
    flagged ``is_embedding`` use ``embedding_rule`` instead of ``rule``. Kept per tensor:
    Σ w·‖v‖ (float64) and Σ w·φ(v) for RDA tensors, Σ w·v for mean tensors, Σ v for
    equal-mean tensors (their merge is Σ v / count: the weights passed to ``add`` are
    checked, summed into ``total_weight``, and otherwise ignored).

    The vector sums are float32: with C contributions their relative rounding error is at
    most about C·2**-24 (4e-6 for 64 learners), far below the quantization error of what
    learners upload. float64 sums took three times the memory traffic plus a float64 copy of
    every contribution (a fold-in of a 33 MB fragment ran at 0.8 GB/s on a 2-core VM).

    A fold-in is one compiled pass (``_kernels.fold_segments``): y += c·x per tensor, and the
    squared norm of every updated sum taken while its block is in cache, so the merge never
    reads the sums again for RDA's norms. Measured on a 2-core VM against a memcpy of the
    contribution: 51 % (131K values) and 91 % (25M) where the numpy version (multiply, then add,
    over L2-sized chunks) reached 32 % and 54 %. A contribution's own per-tensor norms are a
    second read-only pass, unless the caller already has them (the syncer gathers them while
    decoding). Norms are float32 squares summed in float64, which neither overflow nor
    underflow. Not BLAS saxpy: on a busy 2-core machine OpenBLAS's threads spin, and it ran 50x
    slower than a numpy loop there.

    Bounded influence (``max_share`` < 1): no contribution's weight exceeds that share of the
    merge's total. A share is only known once every weight is, so the heaviest contribution so
    far is held back (by reference) and folded in last, by ``scaled_result``, with its weight
    lowered to max_share / (1 - max_share) x the others' total if it is above. With max_share >=
    1/2 no other contribution can be above it, so the cap is exact. The cap applies in merges of
    at least ``share_cap_min_count`` contributions, where the others are a majority to compare
    with, and always to a contribution whose claims the syncer clipped or could not check yet (no
    other learners' history at the start of a run): in a merge of two, the cap
    at 1/2 gave an honest 4x-batch unit the weight of a 1x learner, undoing tokens² / steps.
    Likewise (``max_norm_ratio``) the contribution of the largest norm per step is held back and
    clipped to that many times the median of the others' (per step, with ``norm_allowance_steps``
    below the others' median step count). It is the largest per step that is held back, so with
    ``"sqrt_below_median"`` a few-step contribution held back leaves a many-step one above the
    ratio unclipped here (the syncer's history clip still bounds that one); one the syncer could not
    vouch for (``claims_unverified``) at ``unverified_norm_ratio`` if lower: before any history (a
    run's first merges) no other norm reference exists. At most two fragments more in memory.
    """

    def __init__(
        self,
        fragment: fragments_lib.Fragment,
        *,
        rule: str = "rda",
        embedding_rule: str = "mean",
        max_share: float = 1.0,
        max_norm_ratio: float = 0.0,
        share_cap_min_count: int = 1,
        step_scaling: str = "per_step",
        unverified_norm_ratio: float = 0.0,
    ) -> None:
        """Creates an empty accumulator.

        Args:
            fragment: the fragment whose flat deltas will be added.
            rule: merge rule of non-embedding tensors, one of ``RULES``.
            embedding_rule: merge rule of embedding tensors, one of ``RULES``.
            max_share: the largest share of the merge's total weight one contribution may
                have, in [0.5, 1] (1: no cap). See ``scaled_result``.
            max_norm_ratio: the contribution of the largest norm per step is held back too, and
                clipped to this x the median of the others' in the merge (0: not).
            share_cap_min_count: the share cap applies in merges of at least this many
                contributions, and to contributions added with ``claims_unverified`` in any merge.
            step_scaling: one of ``STEP_SCALINGS`` (``norm_allowance_steps``).
            unverified_norm_ratio: ``max_norm_ratio`` for a contribution added with
                ``claims_unverified``, when lower (0: the same ratio for all).

        Raises:
            ValueError: on an unknown rule or a share outside [0.5, 1].
        """
        for field, value in (("rule", rule), ("embedding_rule", embedding_rule)):
            if value not in RULES:
                raise ValueError(f"{field}={value!r} is unknown: use one of {list(RULES)}")
        if not 0.5 <= max_share <= 1.0:
            raise ValueError(f"max_share={max_share} must be in [0.5, 1]: below 0.5 more than one "
                             "contribution could exceed it, and a streamed merge can hold back only one")
        norm_allowance_steps(1, 1, step_scaling)  # checks the name
        self._max_share = float(max_share)
        self._share_cap_min_count = int(share_cap_min_count)
        self._step_scaling = step_scaling
        # Held back, not folded in yet: the heaviest contribution so far (max_share < 1: only it
        # can exceed a share >= 1/2, so capping it at the end is exact) and the one of the largest
        # norm per step (max_norm_ratio > 0), possibly the same.
        self._heavy: _Entry | None = None
        self._large: _Entry | None = None
        self._max_norm_ratio = float(max_norm_ratio)
        self._unverified_norm_ratio = float(unverified_norm_ratio)
        self._folded: list[tuple[float, int]] = []  # (‖Δ‖ / steps, steps) of each contribution folded in
        self.held_norm_scale = 1.0  # the factor the largest contribution was scaled by (clipped: < 1)
        self.norm_clipped_key = ""  # whose contribution that was
        # (key, weight, capped weight) of the contribution scaled_result capped, if any.
        self.capped: tuple[str, float, float] | None = None
        # Keys in the order their contributions went into the sums (held-back ones last): float32
        # sums depend on it, so an audit that recomputes a merge checks it (ddiloco audit replay).
        self.fold_order: list[str] = []
        self._fragment = fragment
        self._segments = [
            (where, embedding_rule if spec.is_embedding else rule)
            for spec, where in zip(fragment.tensors, fragment.slices().values(), strict=True)
        ]
        self._bounds = np.array([0] + [where.stop for where, _ in self._segments], np.int64)
        # Segments merged with the contributions' weights (not "equal_mean").
        self._weighted = [index for index, (_, r) in enumerate(self._segments) if r != EQUAL_MEAN]
        self._sums = np.zeros(fragment.numel, dtype=np.float32)
        # Σ sums² of every segment (float64), kept up to date by each fold-in.
        self._sum_squares = np.zeros(len(self._segments), dtype=np.float64)
        self._radial_sums = np.zeros(len(self._segments), dtype=np.float64)
        self._count = 0
        self._total_weight = 0.0
        # Weights are folded into the weighted segments' sums as weight / _weight_unit (the
        # first positive weight), or as 1 while every weight so far is 0 (equal-weight
        # fallback). Equal-mean segments fold every contribution with 1 and divide by _count.
        self._weight_unit = 1.0
        self._folded_weight = 0.0

    def _held(self) -> list[_Entry]:
        return [e for i, e in enumerate((self._heavy, self._large)) if e is not None and (i == 0 or e is not self._heavy)]

    @property
    def count(self) -> int:
        """Number of contributions added."""
        return self._count + len(self._held())

    @property
    def total_weight(self) -> float:
        """Sum of the weights passed to ``add`` (after ``scaled_result``: with the cap applied)."""
        return self._total_weight + sum(e.weight for e in self._held())

    def add(self, delta_flat: np.ndarray, weight: float, norms: np.ndarray | None = None, *,
            key: str = "", steps: int = 1, claims_unverified: bool = False) -> None:
        """Folds one learner's pseudo-gradient into the merge.

        Args:
            delta_flat: 1-D array of ``fragment.numel`` finite values (the flat delta).
            weight: finite weight >= 0, usually ``contribution_weight(tokens, steps)``;
                checked but not used by ``"equal_mean"`` tensors.
            norms: the delta's per-tensor norms if the caller has them (the syncer gathers
                them while decoding, ``robust.DecodedStats``); they must be those of
                ``delta_flat``, which is then trusted to be finite. None: computed here, in
                one read-only pass that also checks every value is finite.
            key: who contributed (``capped`` names it). With ``max_share`` < 1 the heaviest
                contribution is kept by reference until the merge: do not modify it.
            steps: the inner steps the contribution spans (``max_norm_ratio`` compares per step).
            claims_unverified: the caller clipped this contribution's claims (steps, batch) or
                had nothing to check them against: the share cap applies to it whatever the
                merge's size.

        Raises:
            ValueError: on a wrong size, non-finite values (or norms), or a negative or
                non-finite weight. The accumulator is unchanged.
        """
        delta = np.asarray(delta_flat)
        if delta.ndim != 1 or delta.size != self._fragment.numel:
            raise ValueError(
                f"delta_flat has shape {delta.shape} but fragment "
                f"{self._fragment.fragment_id} needs a 1-D vector of {self._fragment.numel}"
            )
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"weight={weight} is invalid: must be finite and >= 0")
        delta = np.ascontiguousarray(delta, dtype=np.float32)
        if norms is None:
            squares = np.empty(len(self._segments), np.float64)
            _kernels.segment_square_sums(delta, self._bounds, squares)  # non-finite iff a value is
            norms = np.sqrt(squares)
        else:
            norms = np.asarray(norms, dtype=np.float64)
            if norms.shape != (len(self._segments),) or (norms < 0).any():
                raise ValueError(
                    f"norms has shape {norms.shape} for a fragment of {len(self._segments)} tensors: "
                    "pass one norm >= 0 per tensor"
                )
        if not np.isfinite(norms).all():
            raise ValueError(
                f"delta_flat for fragment {self._fragment.fragment_id} has non-finite values: "
                "reject the contribution"
            )
        steps = max(1, int(steps))
        entry = _Entry(delta, float(weight), norms, key, steps, math.sqrt(float(np.sum(np.square(norms)))) / steps,
                       bool(claims_unverified))
        holding = (self._max_share < 1.0, self._max_norm_ratio > 0 or self._unverified_norm_ratio > 0)
        if not any(holding):
            self._fold_entry(entry)
            return
        candidates = list({id(e): e for e in (self._heavy, self._large, entry) if e is not None}.values())
        heavy = max(candidates, key=lambda e: e.weight) if holding[0] else None  # first of equals: the earlier
        large = max(candidates, key=lambda e: e.per_step) if holding[1] else None
        for e in candidates:
            if e is not heavy and e is not large:
                self._fold_entry(e)
        self._heavy, self._large = heavy, large

    def _fold_entry(self, entry: _Entry) -> None:
        self.fold_order.append(entry.key)
        self._folded.append((entry.per_step, entry.steps))
        self._fold(entry.delta, entry.weight, entry.norms)

    def _settle(self) -> None:
        """Folds in the held contributions: the largest with its norm clipped to ``max_norm_ratio``
        x the median of the others' per step (no history needed, so it holds at the start of a run
        too), the heaviest with its weight capped at ``max_share`` of the total."""
        heavy, large = self._heavy, self._large
        self._heavy = self._large = None
        if large is not None:
            others = self._folded + ([(heavy.per_step, heavy.steps)] if heavy is not None and heavy is not large else [])
            limit, ratio = 0.0, self._max_norm_ratio
            if large.claims_unverified and self._unverified_norm_ratio > 0:
                ratio = min(ratio, self._unverified_norm_ratio) if ratio > 0 else self._unverified_norm_ratio
            if others:
                allowance = norm_allowance_steps(large.steps, float(np.median([s for _, s in others])),
                                                 self._step_scaling)
                limit = ratio * float(np.median([n for n, _ in others])) * allowance
            norm = large.per_step * large.steps
            if limit > 0 and norm > limit:
                self.held_norm_scale, self.norm_clipped_key = limit / norm, large.key
                clipped = large._replace(delta=large.delta * np.float32(limit / norm), norms=large.norms * (limit / norm),
                                         per_step=limit / large.steps)
                heavy = clipped if heavy is large else heavy
                large = clipped
        if large is not None and large is not heavy:
            self._fold_entry(large)
        if heavy is None:
            return
        rest = self._total_weight
        applies = self._count + 1 >= self._share_cap_min_count or heavy.claims_unverified
        if applies and rest > 0 and heavy.weight > self._max_share * (heavy.weight + rest):
            capped = self._max_share / (1.0 - self._max_share) * rest
            self.capped = (heavy.key, heavy.weight, capped)
            heavy = heavy._replace(weight=capped)
        self._fold_entry(heavy)

    def _fold(self, delta: np.ndarray, weight: float, norms: np.ndarray) -> None:
        """Adds a checked contribution to the sums."""
        if weight > 0 and self._total_weight == 0.0:
            # Only weight ratios matter: folding weights relative to the first positive one
            # keeps tiny or huge weights from underflowing or overflowing the sums.
            self._weight_unit = float(weight)
            if self._count:
                # Earlier contributions all had weight 0 and were folded in with equal
                # weights as the fallback; now they must count for nothing (in the weighted
                # segments: equal-mean segments keep them).
                for index in self._weighted:
                    self._sums[self._segments[index][0]] = 0.0
                    self._sum_squares[index] = 0.0
                    self._radial_sums[index] = 0.0
                self._folded_weight = 0.0
        fold = weight / self._weight_unit if weight > 0 or self._total_weight > 0 else 1.0
        self._count += 1
        self._total_weight += float(weight)
        if fold == 0 and len(self._weighted) == len(self._segments):
            return
        self._folded_weight += fold
        coefs = np.zeros(len(self._segments), np.float32)
        for index, ((_, rule), norm) in enumerate(zip(self._segments, norms.tolist(), strict=True)):
            if rule == EQUAL_MEAN:
                coefs[index] = 1.0  # the weight is ignored: Σ v, divided by the count
            elif fold == 0:
                continue  # weight 0 among positive weights: counts for nothing here
            elif rule == "mean":
                coefs[index] = fold
            elif norm > 0:  # φ(0) = 0: a zero tensor adds nothing to either sum.
                self._radial_sums[index] += fold * norm
                coefs[index] = fold / norm
        _kernels.fold_segments(delta, self._bounds, coefs, self._sums, self._sum_squares)

    def scaled_result(self) -> ScaledResult:
        """Returns the merged flat delta in factored form, without writing it out.

        Every tensor's merge is its sum scaled by one number (1/Σw for the mean; 1/count for
        the equal mean; the mean radius over the sum's norm for RDA), so the outer step can
        multiply as it goes and never store the delta twice (``OuterStepper.step_scaled``). No
        pass over the sums: the norms of the RDA sums were taken by the last fold-in.

        Returns:
            ``ScaledResult``. ``values`` is the accumulator's own sum vector (read it, do
            not write it, and do not add to the accumulator while it is in use), or a fresh
            materialized delta when a tensor's magnitudes are too extreme for a float32
            scale (then every scale is 1).

        Raises:
            ValueError: if nothing was added.
        """
        self._settle()  # the cap needs every weight: from here on the round is complete
        if self._count == 0:
            raise ValueError(
                f"fragment {self._fragment.fragment_id} has no contributions: "
                "add at least one before merging"
            )
        bounds = np.empty(len(self._segments) + 1, np.int64)
        scales = np.empty(len(self._segments), np.float32)
        bounds[0] = 0
        for index, (where, rule) in enumerate(self._segments):
            bounds[index + 1] = where.stop
            if rule == "mean":
                scales[index] = np.float32(1.0 / self._folded_weight)
                continue
            if rule == EQUAL_MEAN:
                scales[index] = np.float32(1.0 / self._count)
                continue
            radius = self._radial_sums[index] / self._folded_weight
            norm = math.sqrt(self._sum_squares[index])  # taken by the last fold-in, no pass here
            if norm == 0:
                scales[index] = 0.0
            elif 1e-30 < norm < 1e30 and 1e-30 < radius / norm < 1e30:
                scales[index] = np.float32(radius / norm)
            else:  # extreme magnitudes: materialize with the careful, slower path
                return self._careful_result(scales, bounds, index)
        return ScaledResult(self._sums, bounds, scales, self._sum_squares.copy())

    def result(self) -> np.ndarray:
        """Returns the merged flat delta (the accumulator stays usable).

        Returns:
            A fresh 1-D float32 array of ``fragment.numel`` values, equal bit for bit to what
            ``scaled_result`` describes.

        Raises:
            ValueError: if nothing was added.
        """
        return self.scaled_result().materialize()

    def _careful_result(self, scales: np.ndarray, bounds: np.ndarray, first_extreme: int) -> ScaledResult:
        """The delta written out, for a fragment where some tensor's sum or radius is near
        float32's limits (scales of earlier tensors are already in ``scales``)."""
        out = np.empty(self._fragment.numel, dtype=np.float32)
        for index, (where, rule) in enumerate(self._segments):
            sums = self._sums[where]
            if index < first_extreme:
                np.multiply(sums, scales[index], out=out[where])
                continue
            if rule == "mean":
                np.multiply(sums, np.float32(1.0 / self._folded_weight), out=out[where])
                continue
            if rule == EQUAL_MEAN:
                np.multiply(sums, np.float32(1.0 / self._count), out=out[where])
                continue
            radius = self._radial_sums[index] / self._folded_weight
            norm = _norm(sums)
            if norm == 0:
                out[where] = 0.0
            elif 1e-30 < norm < 1e30 and 1e-30 < radius / norm < 1e30:
                np.multiply(sums, np.float32(radius / norm), out=out[where])
            else:
                out[where] = _unit(sums) * radius
        return ScaledResult(out, np.array([0, out.size], np.int64), np.ones(1, np.float32))


def vector_norm(vector: np.ndarray) -> float:
    """‖x‖ of a 1-D vector, fast: float32 dot products over chunks, added in float64.

    NaN or inf if a value is; exact (float64) when the float32 squares overflow or underflow.
    One read-only pass, no float64 copy of the vector (robust.py's norm bound uses it too).
    """
    return _norm(np.ascontiguousarray(vector, dtype=np.float32))


def vector_dot(a: np.ndarray, b: np.ndarray) -> float:
    """a·b of two 1-D vectors: float32 dot products over chunks, added in float64."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    total = _chunked_dot(a, b)
    if not math.isfinite(total):
        return float(np.dot(a.astype(np.float64), b.astype(np.float64)))
    return total


def _chunked_dot(a: np.ndarray, b: np.ndarray) -> float:
    """a·b of two float32 vectors over chunks, added in float64 (BLAS dots raise no numpy warnings)."""
    return float(sum(float(np.dot(a[i : i + _NORM_CHUNK], b[i : i + _NORM_CHUNK])) for i in range(0, a.size, _NORM_CHUNK)))


def _norm(vector: np.ndarray) -> float:
    """‖x‖ of a float32 vector (NaN or inf if a value is; exact in float64 when squares overflow)."""
    total = _chunked_dot(vector, vector)
    if math.isinf(total):
        with np.errstate(over="ignore", invalid="ignore"):
            return float(np.linalg.norm(vector.astype(np.float64)))
    if total < 1e-30 and (total > 0 or vector.any()):
        # squares near or below float32's underflow (a non-zero vector whose squares all
        # flush to 0 would look like the zero vector): recompute exactly
        return float(np.linalg.norm(vector.astype(np.float64)))
    return math.sqrt(total)


def _unit(vector: np.ndarray) -> np.ndarray:
    """φ(x) = x / ‖x‖, with φ(0) = 0."""
    # Divide by the largest entry first: squaring tiny (or huge) entries would underflow
    # (or overflow) and lose the direction.
    largest = np.abs(vector).max(initial=0.0)
    if largest == 0:
        return np.zeros_like(vector)
    scaled = vector / largest
    return scaled / np.linalg.norm(scaled)


def _check_batch(vectors: Sequence[np.ndarray], weights: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Validates a batch merge's inputs; returns them stacked as float64 and the weights
    scaled to a maximum of 1 (equal weights when they are all 0)."""
    if len(vectors) == 0:
        raise ValueError("vectors is empty: a merge needs at least one vector")
    if len(weights) != len(vectors):
        raise ValueError(
            f"len(weights)={len(weights)} but len(vectors)={len(vectors)}: pass one weight "
            "per vector"
        )
    shapes = {np.shape(v) for v in vectors}
    if len(shapes) != 1:
        raise ValueError(f"vectors have shapes {sorted(shapes)}: all must have the same shape")
    stacked = np.stack([np.asarray(v, dtype=np.float64) for v in vectors])
    if not np.isfinite(stacked).all():
        raise ValueError("vectors have non-finite values: reject those contributions")
    w = np.asarray(weights, dtype=np.float64)
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError(f"weights={list(weights)} are invalid: each must be finite and >= 0")
    # Only ratios matter: scaling by the largest weight avoids underflow and overflow.
    return stacked, (w / w.max() if w.max() > 0 else np.ones_like(w))
