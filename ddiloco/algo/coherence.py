"""Cross-round coherence of a learner's residual: a bias kept up round after round shows, honest differences do not.

Owns `ResidualCoherence`. A learner's residual in one merge is the unit direction of its
contribution minus the unit direction of the other contributions' mean (leave-one-out, on the
direction check's sample of coordinates, `ddiloco.algo.robust.DirectionGuard.direction`). Per
learner and fragment it keeps an exponentially weighted sum S of the residuals, the weighted sum
Q of their squared norms, and the sums of the weights W1 and of their squares W2. For residuals of
equal norm r_t = a + n_t (a fixed part a, a part n_t that changes direction from round to round),
|S|^2 / Q = N (|a|^2 / |r|^2) + (1 - |a|^2 / |r|^2) with N = W1^2 / W2 the rounds the sum holds,
so `persistent` = (|S|^2 / Q - 1) / (N - 1), the share of the residual's energy that keeps its
direction, does not grow with the number of rounds and compares learners with different counts.
A constant bias b added to each contribution (the hostile matrix's drift) is such a fixed part;
an honest learner's residual, even on its own data shard, turns as the model moves.

Measured (ddiloco bench hostile, tiny model, 4 learners on 4 data shards, ~25 merges per
fragment): honest learners' `persistent` per fragment 0.03-0.21 (most of it from the first
rounds, when every learner's update still points along its shard's token frequencies); a learner
adding 0.5 x its norm along one fixed direction every round (the bias hidden from its own rebase)
0.5-0.7. ddiloco/cli/audit.py reads it.

Memory: the sums live in a count sketch of `dims` coordinates (each sampled coordinate adds, with
a fixed random sign, to one of `dims` buckets; the same hashing per sample length), so a state is
`dims` float64 values whatever the fragment's size: 8 KiB at 1024, 2 MiB for 64 learners x 4
fragments, where the plain sum over the direction sample (65 536 coordinates) would take 512 KiB
per state, 128 MiB. Inner products and norms survive the sketch within about sqrt(2 / dims) (4 % at
1024), which is far below the gap measured above. At most `max_states` states are kept (the least
recently updated go first): bounded even when identities come and go.
Must not: decide anything about a contribution (the audit and the operators do).
"""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np

SKETCH_DIMS = 1024
# Weight decay per round: the sum holds (1 + DECAY) / (1 - DECAY) ~ 32 rounds at steady state, so a
# learner that turns hostile late shows within a few dozen of its contributions, and the start of a
# run (where honest residuals are most alike from round to round) fades.
DECAY = 0.94
MAX_STATES = 4096
# A reference is the mean of at least MIN_OTHERS other learners' directions no older than
# MAX_AGE_VERSIONS fragment versions (as the direction check's, ddiloco.algo.robust.DirectionPolicy):
# with one other, two learners' residuals are each other's negatives and cannot tell which one is off.
MIN_OTHERS = 2
MAX_AGE_VERSIONS = 4


@dataclasses.dataclass(frozen=True)
class Score:
    """One learner's coherence on one fragment, after a residual was added."""

    coherence: float  # |S| / sqrt(Q): ~1 for residuals that turn, up to sqrt(rounds) for a fixed one
    persistent: float  # (coherence^2 - 1) / (rounds - 1), clamped to [0, 1]; 0 below 2 rounds
    rounds: float  # W1^2 / W2: the effective number of residuals in the sums


@dataclasses.dataclass
class _State:
    total: np.ndarray  # S, sketched
    energy: float = 0.0  # Q
    w1: float = 0.0
    w2: float = 0.0


class ResidualCoherence:
    """See the module docstring. Not thread-safe: call from one thread (the syncer's loop)."""

    def __init__(self, *, dims: int = SKETCH_DIMS, decay: float = DECAY, max_states: int = MAX_STATES,
                 max_age_versions: int = MAX_AGE_VERSIONS, min_others: int = MIN_OTHERS, seed: int = 0) -> None:
        if dims < 1 or not 0.0 < decay <= 1.0 or max_states < 1:
            raise ValueError(f"dims={dims}, decay={decay}, max_states={max_states}")
        self.dims = dims
        self.decay = decay
        self.max_states = max_states
        self.max_age_versions = max_age_versions
        self.min_others = min_others
        # fragment -> learner -> (version, sketched unit direction): the others' latest, for references.
        self._latest: dict[int, dict[str, tuple[int, np.ndarray]]] = {}
        self._seed = seed
        self._hashes: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # sample length -> (bucket, sign)
        self._states: collections.OrderedDict[tuple[str, int], _State] = collections.OrderedDict()

    def sketch(self, values: np.ndarray) -> np.ndarray:
        """The count sketch of `values` (float64, `dims` long); one pass over them."""
        values = np.asarray(values, np.float64).ravel()
        if values.size not in self._hashes:
            rng = np.random.default_rng([self._seed, values.size])
            self._hashes[values.size] = (rng.integers(0, self.dims, values.size),
                                         rng.choice(np.array([-1.0, 1.0]), values.size))
        bucket, sign = self._hashes[values.size]
        return np.bincount(bucket, weights=sign * values, minlength=self.dims)

    def observe(self, fragment: int, version: int, directions: dict[str, np.ndarray | None]) -> dict[str, Score]:
        """Folds one merge's contributions in: each learner's residual is its (sketched, unit)
        direction minus the unit direction of the mean of the other learners' latest directions to
        `fragment` (this merge's and earlier ones', at most `max_age_versions` old; at least
        `min_others` of them). Leave-one-out: its own bias does not pull its reference, and a
        biased learner pushes each honest one's reference by 1/n of its bias, not by its share of a
        merged update. Earlier merges count because most merges hold one or two contributions
        (measured: 97 of 117 held one on a loaded machine). Returns each scored learner's Score."""
        latest = self._latest.setdefault(fragment, {})
        sketched = {}
        for learner, direction in directions.items():
            if direction is None:
                continue
            s = self.sketch(direction)
            norm = float(np.linalg.norm(s))
            if norm > 0 and math.isfinite(norm):
                sketched[learner] = s / norm
                latest.pop(learner, None)
                latest[learner] = (version, sketched[learner])
        for learner in [k for k, (v, _) in latest.items() if v < version - self.max_age_versions]:
            del latest[learner]
        while len(latest) > self.max_states:
            latest.pop(next(iter(latest)))
        out = {}
        for learner, s in sketched.items():
            others = [d for k, (_, d) in latest.items() if k != learner]
            if len(others) < self.min_others:
                continue
            mean = np.sum(others, axis=0)
            norm = float(np.linalg.norm(mean))
            if norm > 0 and math.isfinite(norm):
                out[learner] = self.add(learner, fragment, s - mean / norm, sketched=True)
        return out

    def add(self, learner: str, fragment: int, residual: np.ndarray, *, sketched: bool = False) -> Score:
        """Folds one residual (sketched already, or not) into the learner's sums for `fragment`;
        its score after it."""
        key = (learner, fragment)
        state = self._states.pop(key, None)
        if state is None:
            state = _State(np.zeros(self.dims))
            while len(self._states) >= self.max_states:
                self._states.popitem(last=False)
        self._states[key] = state  # most recently updated last
        r = np.asarray(residual, np.float64) if sketched else self.sketch(residual)
        d = self.decay
        state.total = d * state.total + r
        state.energy = d * d * state.energy + float(r @ r)
        state.w1 = d * state.w1 + 1.0
        state.w2 = d * d * state.w2 + 1.0
        return self.score(learner, fragment)

    def score(self, learner: str, fragment: int) -> Score | None:
        state = self._states.get((learner, fragment))
        if state is None:
            return None
        if state.energy <= 0:
            return Score(0.0, 0.0, 0.0)
        ratio = float(state.total @ state.total) / state.energy
        rounds = state.w1 * state.w1 / state.w2
        persistent = 0.0 if rounds < 2 else min(1.0, max(0.0, (ratio - 1.0) / (rounds - 1.0)))
        return Score(math.sqrt(ratio), persistent, rounds)

    def scores(self) -> dict[str, float]:
        """Per learner, the median over its fragments of `persistent` (the metrics' gauge)."""
        per: dict[str, list[float]] = collections.defaultdict(list)
        for learner, fragment in self._states:
            per[learner].append(self.score(learner, fragment).persistent)
        return {learner: float(np.median(v)) for learner, v in sorted(per.items())}
