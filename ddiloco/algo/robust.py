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
  is bounded instead by ‖Δ‖ ≤ `params_factor` · ‖θ‖ (default 2), the norm of the current global
  fragment: a pseudo-gradient twice as large as the parameters themselves is never an honest one;
* the merge weight is capped at k · the median weight of other learners' recent contributions.

Violations are rejected or clipped (scaled down to the bound), as configured. Pure numpy; the
syncer core keeps one `NormHistory` per fragment.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from ddiloco.algo import fragments as fragments_lib

ACTIONS = ("reject", "clip")


@dataclasses.dataclass(frozen=True)
class NormBoundPolicy:
    # k; 0 disables the bound and the weight cap. Honest learners with different data (non-IID
    # shards) differ by up to ~17x per tensor early in a run (measured: tiny model, 4 shards of the
    # stdlib corpus, warmup), so k bounds gross updates, not subtle ones.
    factor: float = 20.0
    params_factor: float = 2.0  # bootstrap bound: ||delta|| <= params_factor x ||global fragment||
    action: str = "reject"  # "reject" or "clip"
    min_history: int = 3  # contributions of other learners needed before per-tensor bounds apply
    # Accepted contributions remembered per fragment: short, so the reference follows the learning
    # rate (warmup makes honest pseudo-gradients grow quickly at the start of a run).
    history: int = 16
    step_cap: float = 4.0  # steps credited are at most step_cap x the others' median steps
    min_tensor_numel: int = 1024  # smaller tensors are only bounded through the whole fragment

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"action={self.action!r} must be one of {ACTIONS}")
        if self.factor < 0 or self.min_history < 1 or self.history < self.min_history:
            raise ValueError("need factor >= 0, min_history >= 1 and history >= min_history")

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
    flat = np.asarray(delta, dtype=np.float64)
    return np.array([float(np.linalg.norm(flat[where])) for where in fragment.slices().values()])


def cosine(a: np.ndarray, b: np.ndarray | None) -> float | None:
    """cos(a, b) in float64; None when b is missing or either vector is zero."""
    if b is None:
        return None
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    denominator = float(np.linalg.norm(a64) * np.linalg.norm(b64))
    return float(np.dot(a64, b64) / denominator) if denominator > 0 else None


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

    @staticmethod
    def _extended(norms: np.ndarray) -> np.ndarray:
        norms = np.asarray(norms, dtype=np.float64)
        return np.append(norms, np.sqrt(np.sum(norms * norms)))

    def add(self, learner_id: str, norms: np.ndarray, steps: int, weight: float) -> None:
        steps = max(1, int(steps))
        self._records.append((learner_id, self._extended(norms) / steps, float(weight), steps))

    def _others(self, learner_id: str) -> list:
        return [r for r in self._records if r[0] != learner_id]

    def check(self, learner_id: str, norms: np.ndarray, steps: int, params_norm: float) -> Verdict:
        """Checks per-tensor norms against other learners' (or, early on, the parameters')."""
        norms = np.asarray(norms, dtype=np.float64)
        extended = self._extended(norms)
        total = float(extended[-1])
        k = self.policy.factor
        if not self.policy.enabled:
            return Verdict(True, None, total, float("inf"), "none")
        others = self._others(learner_id)
        if len(others) >= self.policy.min_history:
            credited = min(max(1, int(steps)), self.policy.step_cap * max(1.0, float(np.median([r[3] for r in others]))))
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
        bound = self.policy.params_factor * params_norm
        ratio = total / bound if bound > 0 else 0.0
        if ratio > 1:
            return Verdict(False, np.full_like(norms, 1 / ratio), total, bound, "params", ratio=ratio)
        return Verdict(True, None, total, float("inf"), "params", ratio=ratio)

    def weight_cap(self, learner_id: str) -> float:
        """The largest merge weight this learner's contribution may have (inf: no cap yet)."""
        others = self._others(learner_id)
        if not self.policy.enabled or len(others) < self.policy.min_history:
            return float("inf")
        reference = float(np.median([r[2] for r in others]))
        return self.policy.factor * reference if reference > 0 else float("inf")
