"""Cross-round coherence of a learner's residual: a bias kept up round after round shows, honest differences do not.

Owns `ResidualCoherence`. A learner's residual in one merge is the unit direction of its
contribution minus the unit direction of the other contributions' mean (leave-one-out, on the
direction check's sample of coordinates, `ddiloco.algo.robust.DirectionGuard.direction`). Per
learner and fragment it keeps an exponentially weighted sum S of the residuals, the weighted sum
Q of their squared norms, and the sums of the weights W1 and of their squares W2. For residuals
r_t = a + n_t (a fixed part a, a part n_t that changes direction from round to round), the
`coherence` |S| / sqrt(Q) is about 1 when a = 0 and grows like sqrt(rounds) when a dominates, and
E[|S|^2 - Q] = |a|^2 (W1^2 - W2): `persistent` = (|S|^2 - Q) / (W1^2 - W2) estimates |a|^2, the
squared norm of the residual's fixed part in units of one contribution's (unit) direction, the same
whatever the number of rounds. A learner adding x times its norm along one fixed direction adds
about x^2 / (1 + x^2) to it (0.2 at x = 0.5, the hostile matrix's drift). An honest learner's
residual has a fixed part too, on its own data shard: its update keeps pointing a little toward its
shard's statistics; that part turns as the model moves, slowly (a 100-step run is too short to see
much of the turn), so the audit compares learners with each other rather than with zero.

Measured (ddiloco bench hostile on a loaded 2-core machine, tiny model, 4 learners on 4 data
shards): honest learners' `persistent`, median over fragments, 0.06-0.13 (single fragments
0.03-0.52, the high ones from learners whose few residuals came early in the run); a learner adding
0.5 x its norm along one fixed direction every round, its bias hidden from its own rebase
(ddiloco/chaos/hostile_learner.py), 0.27-0.34, 2.5-3 times the others' median (300 steps: 0.34
against 0.10-0.12; 4 honest learners alone 0.07-0.12). A smaller bias, or honest learners whose data differ more, would not stand out
this way: the test is of a bias as large as the differences between honest learners' data.
ddiloco/cli/audit.py reads it.

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
# With fewer residuals in the sums a score says little (after one round `persistent` is 0, after two
# it is the dot product of the two residuals), and what it says is about the start of the run, where
# honest residuals are most alike: scores() and the audit leave such states out.
MIN_ROUNDS = 8.0
# A reference is the mean of at least MIN_OTHERS other learners' directions no older than
# MAX_AGE_VERSIONS fragment versions (as the direction check's, ddiloco.algo.robust.DirectionPolicy):
# with one other, two learners' residuals are each other's negatives and cannot tell which one is off.
MIN_OTHERS = 2
MAX_AGE_VERSIONS = 4


@dataclasses.dataclass(frozen=True)
class Score:
    """One learner's coherence on one fragment, after a residual was added."""

    coherence: float  # |S| / sqrt(Q): ~1 for residuals that turn, up to sqrt(rounds) for a fixed one
    persistent: float  # (|S|^2 - Q) / (W1^2 - W2): the fixed part's squared norm, clamped to [0, 4]; 0 below 2 rounds
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
        total = np.sum([d for _, d in latest.values()], axis=0) if latest else None
        for learner, s in sketched.items():
            if len(latest) - 1 < self.min_others:
                break
            if learner not in latest:  # evicted (more learners in one merge than max_states)
                continue
            mean = total - latest[learner][1]  # the others' sum (each learner's latest once)
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
        total = float(state.total @ state.total)
        spread = state.w1 * state.w1 - state.w2  # 0 after one round
        persistent = 0.0 if spread <= 1e-9 else min(4.0, max(0.0, (total - state.energy) / spread))
        return Score(math.sqrt(total / state.energy), persistent, state.w1 * state.w1 / state.w2)

    def scores(self, min_rounds: float = MIN_ROUNDS) -> dict[str, float]:
        """Per learner, the median over its fragments of `persistent`, from sums of `min_rounds` or
        more (the metrics' gauge)."""
        per: dict[str, list[float]] = collections.defaultdict(list)
        for learner, fragment in self._states:
            score = self.score(learner, fragment)
            if score.rounds >= min_rounds:
                per[learner].append(score.persistent)
        return {learner: float(np.median(v)) for learner, v in sorted(per.items())}
