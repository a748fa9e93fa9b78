"""Bounds on well-formed but hostile contributions: per-tensor norm bound and weight cap.

A contribution (one learner's pseudo-gradient for one fragment) passes every wire check and can
still be hostile: scaled by 1e4, or carrying an inflated token count that makes its merge weight
(tokens² / steps) dominate. The syncer bounds both relative to the *other* contributors of the
same fragment, so a learner can never raise its own reference:

* for the whole fragment and for each tensor of at least `min_tensor_numel` values, per inner
  step: ‖Δ_t‖ / s ≤ k · median over the last N accepted contributions of other learners of their
  ‖Δ_t‖ / s (references of 0 bound nothing). Small tensors (biases, norms) differ too much
  between honest learners' data to be bounded alone; the whole-fragment bound covers them. A learner
  whose fragment waited long for a new global version honestly contributes many steps at once, so
  norms are compared per step; the steps it may claim for this are capped at 4 × the others'
  median, so inflating the step count buys at most that factor;
* until `min_history` such contributions exist (the first rounds of a run), the whole fragment
  is bounded instead by ‖Δ‖ ≤ `params_factor` · ‖θ‖ · √s (default 2), the norm of the current global
  fragment, with s the contribution's steps (at most `bootstrap_max_steps`): a pseudo-gradient
  much larger than the parameters is never an honest one, but progress grows with the steps it
  spans (the tiny model's fragment of small tensors moved 2.1x its norm in 87 steps, and a
  synchronous run with H = 64 was refused for good under the bound without √s);
* the merge weight (tokens² / steps, quadratic in a unit's batch) is capped through the claimed
  batch, the quantity a learner inflates: tokens per step ≤ b · the median tokens per step of
  other learners' recent contributions (b: `batch_factor`, 4), over the steps credited as above.
  A legitimately bigger unit (a 4-device learner with a 4x global batch weighs 16x per step) is
  weighted in full; comparing weights themselves would clip every unit whose batch exceeds √b
  times the median;
* median-of-norms clipping (`clip_factor`): a contribution within the bound whose norm is above
  clip_factor x the others' median per step (over their contributions of the last
  `clip_window_versions` versions and of similar step counts, `clip_step_ratio`; below their
  median step count compared as √steps, merge.norm_allowance_steps) is scaled down to it,
  accepted and not a strike (the merge itself applies the same clip to its largest contribution,
  and caps the share of its heaviest at `max_share` in merges of `share_min_contributors` or more
  or for unverified claims: ddiloco.algo.merge.MergeAccumulator).

Violations are rejected or clipped (scaled down to the bound), as configured.

Sign-flipped (or otherwise reversed) updates have honest norms and pass every bound above. The
direction check compares a contribution with the other learners' latest accepted contributions to
the same fragment (at most `max_age_versions` old): the median of its cosines with them, and the
learner's mean over its recent contributions, must not both fall below `min_cosine`. Honest
pseudo-gradients of one fragment point the same way on average (see `DirectionPolicy` for the
measured distribution); a negated one points away from all of them. The median over other
learners, never including the learner's own history, means a learner cannot build its own
reference, and one hostile learner among the others cannot drag an honest learner below the
threshold. Cosines are computed on a fixed random sample of `sample_size` coordinates of
large fragments (the syncer keeps one small vector per learner and fragment, not a model copy),
against the `max_references` most recently accepted ones: the syncer's memory for the check does
not grow with the number of learners.

A contribution with fewer than `min_others` others to compare with (the first ones of a run) is
proposed as a reference and waits, up to `judge_wait_s`, for others: simultaneous first
contributions judge each other instead of being merged unjudged (a sign flip merged alone with
quorum 1 moves the global fragment the wrong way, and outer momentum carries it on).

Pure numpy; the syncer core keeps one `NormHistory` and one `DirectionHistory` per fragment.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np

from ddiloco.algo import _kernels
from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import merge as merge_lib

ACTIONS = ("reject", "clip")


@dataclasses.dataclass(frozen=True)
class NormBoundPolicy:
    # k; 0 disables the bound and the weight cap. Honest learners with different data (non-IID
    # shards) differ by up to ~17x per tensor early in a run (measured: tiny model, 4 shards of the
    # stdlib corpus, warmup), so k bounds gross updates, not subtle ones.
    factor: float = 20.0
    params_factor: float = 2.0  # bootstrap bound: ||delta|| <= params_factor x ||global fragment|| x sqrt(steps)
    bootstrap_max_steps: int = 256  # steps credited by the bootstrap bound (claims beyond buy nothing)
    action: str = "reject"  # "reject" or "clip"
    min_history: int = 3  # contributions of other learners needed before per-tensor bounds apply
    # Accepted contributions remembered per fragment: short, so the reference follows the learning
    # rate (warmup makes honest pseudo-gradients grow quickly at the start of a run).
    history: int = 16
    step_cap: float = 4.0  # steps credited are at most step_cap x the others' median steps
    min_tensor_numel: int = 1024  # smaller tensors are only bounded through the whole fragment
    # Bounded influence (see `influence` below the class). A claimed batch (tokens per step) above
    # batch_factor x the others' median is clipped to it: 4 keeps a 4-device unit with a 4x batch
    # whole (weight 16x per step); the hostile claim of issue 24 was 20x. 0: the norm factor k.
    batch_factor: float = 4.0
    # Median-of-norms clipping: a contribution whose whole-fragment norm per step is above
    # clip_factor x the others' median is scaled down to it (accepted, no strike; 0: off). The
    # reject bound above (k = 20) only catches gross updates; this keeps updates within k from
    # moving the merged norm far (RDA's norm is the weighted mean of the contributions').
    clip_factor: float = 4.0
    # The merge's own clip (in-merge median) for contributions the syncer cannot vouch for: claims
    # clipped or unchecked, or clipped here in norm (MergeAccumulator unverified_norm_ratio; 0: off).
    unverified_clip_factor: float = 2.0
    # The largest share of one merge's total weight a contribution may have (MergeAccumulator
    # max_share, in [0.5, 1]; 1: no cap), in merges of at least share_min_contributors (the others
    # are a majority to compare with) and for contributions whose claims were clipped.
    max_share: float = 0.5
    share_min_contributors: int = 3
    # The clip's reference: other learners' contributions accepted within this many versions of the
    # fragment, of step counts within clip_step_ratio of the contribution's (0: any), compared per
    # step (below their median steps as sqrt(steps x median), step_scaling). Measured on the ledgers
    # of two seeded 16-learner goodput runs (docs/security.md#bounded-influence): the old reference
    # (the last 16 kept, any steps, per step) put honest contributions at up to 12-14x, mostly in the
    # learning rate's warm-up, where 4-40-step contributions met references of 1-3 steps.
    clip_window_versions: int = 2
    clip_step_ratio: float = 2.0
    step_scaling: str = "sqrt_below_median"  # merge.STEP_SCALINGS

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"action={self.action!r} must be one of {ACTIONS}")
        if self.factor < 0 or self.min_history < 1 or self.history < self.min_history:
            raise ValueError("need factor >= 0, min_history >= 1 and history >= min_history")
        if min(self.batch_factor, self.clip_factor, self.unverified_clip_factor) < 0:
            raise ValueError("need batch_factor, clip_factor and unverified_clip_factor >= 0 (0: off)")
        if not 0.5 <= self.max_share <= 1.0:
            raise ValueError(f"max_share={self.max_share} must be in [0.5, 1] (1: no cap)")
        if self.share_min_contributors < 1 or self.clip_window_versions < 0 or self.clip_step_ratio < 0:
            raise ValueError("need share_min_contributors >= 1, clip_window_versions >= 0 and clip_step_ratio >= 0")
        merge_lib.norm_allowance_steps(1, 1, self.step_scaling)  # checks the name

    @property
    def enabled(self) -> bool:
        return self.factor > 0


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The outcome of checking one contribution."""

    within: bool  # every tensor within its bound
    scales: np.ndarray | None  # per-tensor factors (<= 1) that clip the contribution to the bound
    norm: float  # ‖Δ‖ over the whole fragment
    limit: float  # the bound that was exceeded the most (for messages); inf if none applied
    basis: str  # "others" (median of other learners) or "params" (bootstrap) or "none"
    tensor: int = -1  # index of the tensor exceeding its bound the most (-1: none or whole fragment)
    ratio: float = 0.0  # largest norm / (k x reference) over the bounded entries (> 1: beyond the bound)


def tensor_norms(delta: np.ndarray, fragment: fragments_lib.Fragment) -> np.ndarray:
    """‖Δ_t‖ of every tensor of the fragment, in fragment order (float64)."""
    # merge.vector_norm: one float32 pass, float64 totals (a float64 copy of the fragment and
    # numpy's threaded BLAS norm were the largest cost of an upload on the syncer).
    flat = np.asarray(delta)
    return np.array([merge_lib.vector_norm(flat[where]) for where in fragment.slices().values()])


def cosine(a: np.ndarray, b: np.ndarray | None) -> float | None:
    """cos(a, b) in float64; None when b is missing or either vector is zero."""
    if b is None:
        return None
    denominator = merge_lib.vector_norm(a) * merge_lib.vector_norm(b)
    return float(merge_lib.vector_dot(a, b) / denominator) if denominator > 0 else None


class DecodedStats:
    """Per-tensor norms and the dot product with a reference, gathered while a contribution is
    decoded: pass `update` as `codec.decode`'s `on_chunk`, then read `tensor_norms` and `cosine`
    (and `sample`: the direction check's coordinates, when given their indices).

    The same quantities as `tensor_norms` and `cosine`, without their passes over memory: each
    decoded piece is squared (and dotted with the reference, and its sample coordinates copied)
    while it is in cache, in one compiled call per piece (`_kernels.piece_stats`), and the norm
    of the contribution comes from the per-tensor sums instead of another pass. Float64 sums: they
    agree with `tensor_norms` / `cosine` to ~1e-6 relative. Pieces may arrive out of order and from
    two threads: totals are added in index order at the end, so they do not depend on timing."""

    def __init__(self, fragment: fragments_lib.Fragment,
                 reference: np.ndarray | merge_lib.ScaledResult | None = None,
                 reference_norm: float | None = None, sample_index: np.ndarray | None = None) -> None:
        """`reference`: the vector to take the cosine with (None: no cosine), written out or
        in the merge's factored form (the syncer keeps its last merged delta that way, never
        written out). `reference_norm`: its norm if the caller has it (it changes once per
        merge, not per upload). `sample_index`: sorted coordinates to copy out (`sample`)."""
        self._bounds = np.array([(w.start, w.stop) for w in fragment.slices().values()], np.int64).reshape(-1, 2)
        if reference is not None and not isinstance(reference, merge_lib.ScaledResult):
            whole = np.ascontiguousarray(reference, np.float32)
            reference = merge_lib.ScaledResult(whole, np.array([0, whole.size], np.int64), np.ones(1, np.float32))
        self._reference = reference
        bounds = np.zeros(1, np.int64) if reference is None else np.asarray(reference.bounds, np.int64)
        self._reference_parts = np.stack([bounds[:-1], bounds[1:]], axis=1)  # [start, stop) of each factor
        self._reference_scales = [] if reference is None else [float(x) for x in reference.scales]
        self._reference_values = np.ascontiguousarray(np.zeros(0) if reference is None else reference.values, np.float32)
        self._reference_norm = reference_norm
        self._index = np.zeros(0, np.int64) if sample_index is None else np.ascontiguousarray(sample_index, np.int64)
        self._sample = np.empty(self._index.size, np.float32)
        # start of the piece -> (float64 squares per tensor, dot per reference factor, sampled count)
        self._pieces: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}

    def update(self, start: int, values: np.ndarray) -> None:
        """Adds one decoded piece: values[i] is element start + i of the contribution."""
        squares, dots = np.empty(len(self._bounds)), np.empty(len(self._reference_parts))
        sampled = _kernels.piece_stats(values, start, self._bounds, self._reference_values, self._reference_parts,
                                       self._index, self._sample, squares, dots)
        self._pieces[start] = (squares, dots, sampled)

    @property
    def sample(self) -> np.ndarray | None:
        """values[sample_index] of the contribution, once every piece was seen (else None)."""
        complete = self._index.size and sum(p[2] for p in self._pieces.values()) == self._index.size
        return self._sample if complete else None

    def tensor_norms(self, values: np.ndarray) -> np.ndarray:
        """‖Δ_t‖ of every tensor (float64), as `tensor_norms(values, fragment)` gives it.
        `values`: the decoded contribution (read again only when float32 squares overflowed or
        underflowed, where the exact path is needed)."""
        totals = np.add.reduce([self._pieces[start][0] for start in sorted(self._pieces)] or [np.zeros(len(self._bounds))])
        norms = np.sqrt(totals)
        for index, total in enumerate(totals):
            if math.isinf(total) or total < 1e-30:  # merge.vector_norm's careful path (0 too: flushed squares)
                t0, t1 = self._bounds[index]
                norms[index] = merge_lib.vector_norm(values[t0:t1])
        return norms

    def cosine(self, values: np.ndarray, norms: np.ndarray) -> float | None:
        """cos(values, reference) as `cosine` gives it; `norms`: from `tensor_norms`. None
        without a reference or when either vector is zero."""
        if self._reference is None:
            return None
        dots = np.add.reduce([self._pieces[start][1] for start in sorted(self._pieces)] or [np.zeros(1)])
        dot = math.fsum(d * scale for d, scale in zip(dots.tolist(), self._reference_scales))
        if not math.isfinite(dot):
            dot = merge_lib.vector_dot(values, self._reference.materialize())
        norm = float(np.sqrt(np.sum(np.square(norms))))
        reference_norm = (merge_lib.vector_norm(self._reference.materialize()) if self._reference_norm is None
                          else self._reference_norm)
        denominator = norm * reference_norm
        return float(dot / denominator) if denominator > 0 else None


def scale_tensors(delta: np.ndarray, fragment: fragments_lib.Fragment, scales: np.ndarray) -> np.ndarray:
    """A copy of `delta` with tensor t multiplied by scales[t]."""
    out = np.array(delta, dtype=np.float32, copy=True)
    for scale, where in zip(scales, fragment.slices().values(), strict=True):
        if scale != 1.0:
            out[where] *= np.float32(scale)
    return out


class NormHistory:
    """Recent accepted contributions of one fragment: (learner, per-tensor norms, weight)."""

    def __init__(self, policy: NormBoundPolicy, fragment: fragments_lib.Fragment) -> None:
        self.policy = policy
        self._records: collections.deque = collections.deque(maxlen=policy.history)
        # Which entries of [tensor norms..., total norm] are bounded on their own.
        sizes = [t.numel for t in fragment.tensors]
        self._bounded = np.array([n >= policy.min_tensor_numel for n in sizes] + [True])
        self._refused_since_accept: set[str] = set()
        self.resets = 0

    def refused(self, learner_id: str) -> bool:
        """Records that a contribution was refused against the others' reference. When two or more
        distinct learners have been refused since the last accepted contribution, the reference is
        taken to be stale and is dropped (back to the bootstrap bound until it is rebuilt): one
        hostile learner cannot trigger this, while a reference built during the inner learning
        rate's warm-up (per-step norms up to 20x smaller) refused every honest learner for good and
        quarantined them all (16 learners, tiny model). Returns True when the history was reset."""
        self._refused_since_accept.add(learner_id)
        if len(self._refused_since_accept) < 2:
            return False
        self._records.clear()
        self._refused_since_accept.clear()
        self.resets += 1
        return True

    @staticmethod
    def _extended(norms: np.ndarray) -> np.ndarray:
        norms = np.asarray(norms, dtype=np.float64)
        return np.append(norms, np.sqrt(np.sum(norms * norms)))

    def add(self, learner_id: str, norms: np.ndarray, steps: int, weight: float, version: int = 0) -> None:
        """Records an accepted contribution, at the fragment version it was accepted at."""
        self._refused_since_accept.clear()
        steps = max(1, int(steps))
        self._records.append((learner_id, self._extended(norms) / steps, float(weight), steps, int(version)))

    def _others(self, learner_id: str, version: int | None = None) -> list:
        """Other learners' records; with `version`, only those of the clip's window before it."""
        oldest = -math.inf if version is None else version - self.policy.clip_window_versions
        return [r for r in self._records if r[0] != learner_id and r[4] >= oldest]

    def check(self, learner_id: str, norms: np.ndarray, steps: int, params_norm: float, *,
              steps_verified: bool = False) -> Verdict:
        """Checks per-tensor norms against other learners' (or, early on, the parameters').

        `steps_verified`: the caller has checked the steps against what it observed of the learner
        (the syncer: its progress reports and merged marks), so all of them are credited; otherwise
        at most `step_cap` x the others' median (a learner back from a partition carries many
        rounds' worth of steps, and clipping them to 4x the others' loses that work)."""
        norms = np.asarray(norms, dtype=np.float64)
        extended = self._extended(norms)
        total = float(extended[-1])
        k = self.policy.factor
        if not self.policy.enabled:
            return Verdict(True, None, total, float("inf"), "none")
        others = self._others(learner_id)
        if len(others) >= self.policy.min_history:
            credited = max(1, int(steps))
            if not steps_verified:
                credited = min(credited, self.policy.step_cap * max(1.0, float(np.median([r[3] for r in others]))))
            reference = np.median(np.stack([r[1] for r in others]), axis=0)  # per step
            limits = k * reference * credited
            over = self._bounded & (reference > 0) & (extended > limits)
            with np.errstate(divide="ignore", invalid="ignore"):
                ratios = np.where(self._bounded & (reference > 0), extended / limits, 0.0)
            ratio = float(np.max(ratios))
            if not over.any():
                return Verdict(True, None, total, float("inf"), "others", ratio=ratio)
            factors = np.ones_like(extended)
            factors[over] = limits[over] / extended[over]
            # A tensor is scaled by its own factor and by the whole fragment's.
            scales = np.minimum(factors[:-1], factors[-1])
            worst = int(np.argmin(factors))
            tensor = worst if worst < len(norms) else -1
            return Verdict(False, scales, total, float(limits[worst]), "others", tensor, ratio)
        credited = min(max(1, int(steps)), self.policy.bootstrap_max_steps)
        bound = self.policy.params_factor * params_norm * math.sqrt(credited)
        ratio = total / bound if bound > 0 else 0.0
        if ratio > 1:
            return Verdict(False, np.full_like(norms, 1 / ratio), total, bound, "params", ratio=ratio)
        return Verdict(True, None, total, float("inf"), "params", ratio=ratio)

    def weight_cap(self, learner_id: str, steps: int = 1) -> float:
        """The largest merge weight this learner's contribution of `steps` steps may have (inf: no cap yet).

        Bounds the claimed batch, not the weight: tokens / steps <= b x the others' median tokens
        per step (b: batch_factor, or k when 0), over at most step_cap x the others' median steps,
        i.e. weight <= credited steps x (b x median tokens per step)^2 (weights are tokens^2 /
        steps = steps x (tokens per step)^2).
        """
        others = self._others(learner_id)
        if not self.policy.enabled or len(others) < self.policy.min_history:
            return float("inf")
        per_step = float(np.median([np.sqrt(r[2] / r[3]) for r in others]))  # tokens per step
        if per_step <= 0:
            return float("inf")
        credited = min(max(1, int(steps)), self.policy.step_cap * max(1.0, float(np.median([r[3] for r in others]))))
        batch = self.policy.batch_factor or self.policy.factor
        return credited * (batch * per_step) ** 2

    def clip_reference(self, learner_id: str, version: int | None = None,
                       steps: int | None = None) -> tuple[float, float] | None:
        """(median norm per step, median steps) of the other learners' contributions in the clip's
        window before `version` (all kept ones when None) whose steps are within clip_step_ratio of
        `steps` (any when None); None with fewer than min_history."""
        others = self._others(learner_id, version)
        ratio = self.policy.clip_step_ratio
        if steps is not None and ratio > 0:
            others = [r for r in others if r[3] <= ratio * steps and steps <= ratio * r[3]]
        if len(others) < self.policy.min_history:
            return None
        return float(np.median([r[1][-1] for r in others])), float(np.median([r[3] for r in others]))

    def norm_ratio(self, learner_id: str, norm: float, steps: int, version: int | None = None) -> float | None:
        """The contribution's whole-fragment norm over the others' median per step times its
        allowance (merge.norm_allowance_steps; None: no reference, clip_reference). What
        median-of-norms clipping acts on."""
        reference = self.clip_reference(learner_id, version, max(1, int(steps)))
        if reference is None or reference[0] <= 0:
            return None
        return norm / (reference[0] * merge_lib.norm_allowance_steps(steps, reference[1], self.policy.step_scaling))

    def clip_scale(self, learner_id: str, norm: float, steps: int, version: int | None = None) -> float:
        """The factor (<= 1) median-of-norms clipping scales the contribution by: at most clip_factor
        x the reference (norm_ratio; 1 when off, within, or without a reference)."""
        if not self.policy.enabled or self.policy.clip_factor <= 0:
            return 1.0
        ratio = self.norm_ratio(learner_id, norm, steps, version)
        if ratio is None or ratio <= self.policy.clip_factor:
            return 1.0
        return self.policy.clip_factor / ratio


# ------------------------------------------------------------------------------ direction

DIRECTION_MODES = ("off", "reject")


@dataclasses.dataclass(frozen=True)
class DirectionPolicy:
    """Refuse contributions pointing away from the other learners' (sign flips).

    A contribution's cosine is the (upper) median of its cosines with the other learners' latest
    accepted contributions to the same fragment; a learner's score is the mean of its last
    `window` such cosines (all fragments, refused contributions included). A contribution is
    refused when both its cosine and its learner's score are below `min_cosine`: one unusual batch
    of an honest learner does not trip it, and a sign-flipping learner whose update happens to
    agree with the others (and so, flipped back, helps) is not refused for it.

    Measured (tiny model, 4 learners on 4 non-IID shards of the stdlib corpus, H=4, int4 uploads,
    100 steps each; six runs, ~1 000 honest contributions): honest cosines have per-learner
    medians of +0.28 to +0.77 and a long lower tail late in a run, when pseudo-gradients are
    mostly noise (1st percentile down to -0.56, minimum -0.60, the lowest ones with a sign-flipped
    learner among the others and a plain median); honest scores (window 8) never went below
    -0.19, and not below +0.15 with the upper median used here. A sign-flipping learner's cosines
    were -0.24 at most (median -0.84 when its updates were merged, -0.58 to -0.68 when refused),
    its score -0.49 at most. The default threshold, -0.25, sits between the two.
    """

    mode: str = "reject"  # "off" or "reject"
    min_cosine: float = -0.25  # refuse when both the cosine and the learner's score are below this
    window: int = 8  # a learner's score is the mean of its last `window` cosines
    min_others: int = 2  # other learners' contributions needed before a fragment's check applies
    max_age_versions: int = 4  # others' contributions older than this (fragment versions) are ignored
    sample_size: int = 1 << 16  # coordinates compared in fragments larger than this (fixed random subset)
    # Other learners' directions kept per fragment (the most recently accepted): 256 KiB each at
    # the default sample size, so 64 learners x 4 fragments held 64 MiB; a median over the latest
    # 16 is as robust as one over all of them (hostile learners need half of either).
    max_references: int = 16
    # At the start of a run a contribution has fewer than `min_others` others to be compared with; merged unjudged, a sign flip gets into the model
    # before it can be recognised. Such a contribution is proposed as a reference and waits up
    # to this long for others to arrive, so that the first contributions judge each other.
    judge_wait_s: float = 8.0

    def __post_init__(self) -> None:
        if self.mode not in DIRECTION_MODES:
            raise ValueError(f"mode={self.mode!r} must be one of {DIRECTION_MODES}")
        if not -1.0 <= self.min_cosine <= 1.0:
            raise ValueError(f"min_cosine={self.min_cosine} must be in [-1, 1]")
        if self.window < 1 or self.min_others < 1 or self.max_age_versions < 0 or self.sample_size < 1:
            raise ValueError("need window >= 1, min_others >= 1, max_age_versions >= 0 and sample_size >= 1")
        if self.max_references < self.min_others:
            raise ValueError(f"max_references={self.max_references} must be >= min_others={self.min_others}")
        if not self.judge_wait_s >= 0:
            raise ValueError(f"judge_wait_s={self.judge_wait_s} must be >= 0")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


@dataclasses.dataclass(frozen=True)
class DirectionVerdict:
    """The outcome of comparing one contribution's direction with the other learners'."""

    within: bool  # not refused (nothing to compare with counts as within)
    cosine: float | None  # median cosine with the others' latest contributions; None: not compared
    others: int  # contributions compared with
    score: float | None = None  # the learner's mean cosine over its last `window` compared contributions


class DirectionHistory:
    """The latest accepted contribution direction of each learner, for one fragment.

    Each direction is a unit vector over a fixed sample of the fragment's coordinates (all of
    them when the fragment has at most `sample_size` values), tagged with the fragment version at
    which it was accepted. A contribution waiting to be judged is *proposed*: it counts as a
    reference for the others while it waits, so that simultaneous first contributions can judge
    each other (a proposal leaves when it is accepted, refused or abandoned).
    """

    def __init__(self, policy: DirectionPolicy, fragment: fragments_lib.Fragment, *, seed: int = 0) -> None:
        self.policy = policy
        numel = fragment.numel
        if numel > policy.sample_size:
            rng = np.random.default_rng([seed, fragment.fragment_id])
            self._index: np.ndarray | None = np.sort(rng.choice(numel, policy.sample_size, replace=False))
        else:
            self._index = None
        self._latest: dict[str, tuple[int, np.ndarray]] = {}
        self._proposed: dict[str, tuple[int, np.ndarray]] = {}
        self._first: set[str] = set()  # the first min_others + 1 learners ever accepted here

    def direction(self, delta: np.ndarray, sample: np.ndarray | None = None) -> np.ndarray | None:
        """The unit vector compared (float32); None for a zero or non-finite contribution.
        `sample`: delta[`index`] if the caller gathered it (DecodedStats.sample)."""
        values = np.asarray(delta)
        if self._index is not None:  # sample first: no float64 copy of the whole fragment
            values = values[self._index] if sample is None else sample
        values = values.astype(np.float64)
        norm = float(np.linalg.norm(values))
        if not np.isfinite(norm) or norm == 0.0:
            return None
        return (values / norm).astype(np.float32)

    def compare(self, learner_id: str, direction: np.ndarray | None, version: int) -> tuple[float | None, int]:
        """(upper median cosine, count) against other learners' latest directions accepted at
        fragment version `version - max_age_versions` or later; (None, count) below `min_others`.

        The upper median (the larger middle value of an even count) keeps an honest learner's
        cosine honest while at most half of the others are hostile: with two others, one of them
        sign-flipped, it is the cosine with the honest one, where a mean would sit near 0.
        """
        if direction is None:
            return None, 0
        others = self._others(learner_id, version)
        if len(others) < self.policy.min_others:
            return None, len(others)
        # One float32 dot per reference: stacking every reference into a float64 matrix per upload
        # cost tens of MiB and most of the syncer's event loop at 64 learners.
        cosines = np.sort(np.fromiter((np.dot(d, direction) for d in others), np.float64, len(others)))
        return float(cosines[len(cosines) // 2]), len(others)

    def _others(self, learner_id: str, version: int) -> list[np.ndarray]:
        """Other learners' references recent enough for `version`: a learner's pending proposal
        stands in for its latest accepted direction (it is the newer of the two)."""
        oldest = version - self.policy.max_age_versions
        refs = {**self._latest, **self._proposed}
        return [d for lid, (v, d) in refs.items() if lid != learner_id and v >= oldest]

    def references(self, learner_id: str, version: int) -> int:
        """How many other learners' directions a contribution at `version` would be compared with."""
        return len(self._others(learner_id, version))

    def add(self, learner_id: str, direction: np.ndarray | None, version: int) -> None:
        """Records an accepted contribution's direction (at the fragment version it was accepted at).

        Directions too old to be compared again are dropped (fragment versions only grow), and
        beyond `max_references` the least recently accepted ones: what is kept does not grow with
        the number of learners."""
        if direction is not None:
            self._latest.pop(learner_id, None)  # re-inserted last: the dict is oldest first
            self._latest[learner_id] = (int(version), direction)
            if len(self._first) <= self.policy.min_others:
                self._first.add(learner_id)
        oldest = version - self.policy.max_age_versions
        for lid in [lid for lid, (v, _) in self._latest.items() if v < oldest]:
            del self._latest[lid]
        while len(self._latest) > self.policy.max_references:
            del self._latest[next(iter(self._latest))]

    def bootstrapped(self) -> bool:
        """More than `min_others` learners' contributions were accepted here at some point: past
        the start of the run, when first contributions are worth waiting for to judge each other."""
        return len(self._first) > self.policy.min_others

    def propose(self, learner_id: str, direction: np.ndarray, version: int) -> None:
        """Makes a contribution waiting for its judgment a reference for the others meanwhile."""
        self._proposed[learner_id] = (int(version), direction)

    def withdraw(self, learner_id: str) -> None:
        self._proposed.pop(learner_id, None)

    def forget(self, learner_id: str) -> None:
        self._latest.pop(learner_id, None)
        self._proposed.pop(learner_id, None)


class DirectionGuard:
    """The direction check of a whole model: one DirectionHistory per fragment, one score per learner."""

    def __init__(self, policy: DirectionPolicy, fragments, *, seed: int = 0) -> None:
        self.policy = policy
        self._histories = {f.fragment_id: DirectionHistory(policy, f, seed=seed) for f in fragments}
        self._recent: dict[str, collections.deque] = {}

    def direction(self, fragment_id: int, delta: np.ndarray, sample: np.ndarray | None = None) -> np.ndarray | None:
        """What `judge` and `add` take for `delta` (None when the check is off). Thread-safe.
        `sample`: delta at `sample_index(fragment_id)`, if the caller gathered it."""
        return self._histories[fragment_id].direction(delta, sample) if self.policy.enabled else None

    def sample_index(self, fragment_id: int) -> np.ndarray | None:
        """The sorted coordinates `direction` reads (None: all of them, or the check is off)."""
        return self._histories[fragment_id]._index if self.policy.enabled else None

    def judge(self, learner_id: str, fragment_id: int, direction: np.ndarray | None, version: int) -> DirectionVerdict:
        """Compares a contribution with the others' and updates the learner's score with it.

        A refused learner's earlier directions (accepted before there was anything to compare
        them with) leave every fragment's reference: they are suspect now.
        """
        cosine, others = self._histories[fragment_id].compare(learner_id, direction, version)
        if cosine is None:
            return DirectionVerdict(True, None, others)
        recent = self._recent.setdefault(learner_id, collections.deque(maxlen=self.policy.window))
        recent.append(cosine)
        score = float(np.mean(recent))
        floor = self.policy.min_cosine
        within = cosine >= floor or score >= floor
        if not within:
            for history in self._histories.values():
                history.forget(learner_id)
        return DirectionVerdict(within, cosine, others, score)

    def add(self, learner_id: str, fragment_id: int, direction: np.ndarray | None, version: int) -> None:
        """Records an accepted contribution (it becomes part of the other learners' reference)."""
        self._histories[fragment_id].add(learner_id, direction, version)

    def references(self, learner_id: str, fragment_id: int, version: int) -> int:
        """Other learners' directions a contribution to `fragment_id` at `version` is compared with."""
        return self._histories[fragment_id].references(learner_id, version)

    def propose(self, learner_id: str, fragment_id: int, direction: np.ndarray, version: int) -> None:
        """See DirectionHistory.propose; `withdraw` when the contribution is settled."""
        self._histories[fragment_id].propose(learner_id, direction, version)

    def withdraw(self, learner_id: str, fragment_id: int) -> None:
        self._histories[fragment_id].withdraw(learner_id)

    def bootstrapped(self, fragment_id: int) -> bool:
        """See DirectionHistory.bootstrapped."""
        return self._histories[fragment_id].bootstrapped()
