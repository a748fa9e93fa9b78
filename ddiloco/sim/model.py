"""The failure/recovery model behind `ddiloco simulate`, and the goodput tables it produces.

Owns a seeded, vectorized discrete-event simulation of training units under chip failures, the
constants calibrated once against the paper's Table 1, and the two tables the report prints: the
paper's fleets (150k to 2.4M chips) and our own deployment. Pure: no I/O, no environment, no clock.

The model (every assumption, stated once; the report repeats them):

* Failures. Every chip fails as a Poisson process with a mean time between interruptions (MTBI)
  of one year (365.25 days). A unit of n chips therefore fails at rate n / MTBI; a fleet of 1.2M
  chips sees a failure every 26 s. Failures are independent of load and of each other.
* Units. A failure takes down its whole unit, never more: for data-parallel (DP) the unit is the
  whole synchronous job (N chips); for Decoupled DiLoCo it is one learner of N / M chips, and the
  other learners keep stepping (the syncer merges with a quorum of K = 1, so it never waits for a
  failed learner and nobody's work is held back by it). Learners are therefore independent
  identical units and a Decoupled cell is simulated as M x the simulated time of one learner.
* Delays. Every delay (restart, scale-down, scale-up, chip repair) is drawn from an
  exponentiated Weibull distribution, F(x) = (1 - exp(-(x / scale)^k))^a, sampled by inverse CDF.
  All delays share the shape (k, a); only the scale differs by kind of delay. With k < 1 the tail
  is heavier than exponential: most restarts are quick, a few take many minutes.
* A failure during a delay re-plans it: the restart (or re-mesh) that was under way is abandoned
  and a fresh one, with a fresh delay, begins, because it needed the chip that just failed.
* DP without elasticity ("restart" unit): a failure stops the job; it restarts on spare chips after
  a restart delay (which includes reloading its last in-memory checkpoint), then runs at full size.
* Elastic DP ("elastic" unit): a failure pauses the job for a scale-down (re-mesh without the
  failed model replica of `REPLICA_CHIPS` chips), after which it runs without that replica. The
  failed chips come back after a repair delay; returned chips are folded into the next
  reconfiguration if one starts within `REJOIN_BATCH_S`, otherwise the job pauses for a
  scale-up when that window closes. Chips out for repair are lost chip-time: their mean share,
  REPLICA_CHIPS x mean repair / MTBI, does not depend on the fleet size and is ~0.2 %. In steady
  state the returns of a repair pool fed by Poisson failures form a Poisson stream of the same rate
  (the output theorem of the M/G/inf queue), so returns are drawn as such.
* Decoupled DiLoCo learners are elastic units too (a learner is a scaled-down DP job with the same
  re-mesh machinery; the paper's rule "M learners ~ one learner with M x fewer chips" and its
  Table 1, where Decoupled at N chips matches elastic DP at N / M within 4 points, say so). So the
  partial step in flight is the only work a failure destroys, and it is neglected (< 1 s against
  ~30 s per failure).
* A learner that restarts whole (our learners: one process, no re-mesh; and the report's
  sensitivity rows) is a "restart" unit that also loses the work it did since each fragment's last
  sync: with P staggered fragments synced every S seconds, a learner up for u seconds loses
  u - u^2 / 2S if u < S, else S / 2.
* Goodput is the share of allocated chip-time whose work ends up in the model: time not stalled,
  minus chips out for repair, minus lost work. Uptime is the share of time some work is advancing
  (for Decoupled: at least one learner stepping, learners independent).
* Not modelled: chip speed variance and stragglers (the grace window absorbs them), syncer
  failures in the paper's table (the syncer is CPU-only and sharded; `OursConfig` models ours),
  correlated failures (power, network), and the quality effect of fewer learners per merge.

The free parameters (the delay shape, the restart, scale-down and scale-up scales and the rejoin
batch window) were fitted once, together, against all 30 cells of Table 1 (minimax deviation) and
are identical across cells; everything else is physical or taken from the paper.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Sequence

import numpy as np

SECONDS_PER_YEAR = 365.25 * 86400.0
# The paper's chaos knob: mean time between interruptions of one chip, fixed at one year.
CHIP_MTBI_S = SECONDS_PER_YEAR

# --- Constants calibrated against Table 1 (fit once, minimax over all 30 cells; identical in every cell) ---
# Shape of every delay distribution: Weibull exponent k < 1 (heavier tail than exponential) and the
# exponentiation power a. Fitted on the DP row (whose goodput is exactly E[exp(-rate * restart)]).
DELAY_WEIBULL_SHAPE = 0.8
DELAY_POWER = 1.1
# DP without elasticity: reschedule the whole job on spares and reload the last checkpoint.
# Scale 79 s -> mean 96 s, median 56 s, p99 9 min (algorithm.md's renewal fit says ~80 s per failure).
DP_RESTART_SCALE_S = 79.0
# Elastic re-mesh without the failed replica (mean 23 s) and with returned replicas (mean 14 s).
SCALE_DOWN_SCALE_S = 18.8
SCALE_UP_SCALE_S = 11.4
# Returned chips wait up to this long to be folded into the next reconfiguration before the job
# pauses to add them on its own (so a failure costs ~23 s + 14 s when failures are rare, ~23 s
# when they come every minute or two).
REJOIN_BATCH_S = 124.0

# --- Physical assumptions (not fitted; their effect on the table is < 0.3 points) ---
# Chips per data-parallel model replica: what an elastic job drops when one of them fails.
REPLICA_CHIPS = 16
# Time for failed chips to return (repair / replacement): scale 1 h -> mean ~1.4 h, heavy tail.
REPAIR_SCALE_S = 3600.0

# The paper's Table 1 (dense 5B, 1T tokens, MTBI 1 year per chip): goodput in percent.
PAPER_FLEETS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
PAPER_TABLE1 = {
    "DP, no elasticity": (72.0, 57.0, 38.0, 27.0, 18.0),
    "DP, elastic": (88.0, 80.0, 69.0, 58.0, 40.0),
    "Decoupled M=2": (94.0, 88.0, 80.0, 70.0, 54.0),
    "Decoupled M=4": (96.0, 93.0, 89.0, 82.0, 73.0),
    "Decoupled M=8": (98.0, 96.0, 94.0, 88.0, 80.0),
    "Decoupled M=16": (99.0, 98.0, 96.0, 93.0, 86.0),
}
PAPER_LEARNERS = (2, 4, 8, 16)

# Default precision: 60 simulated days per cell, at most 200k failures per cell (the 150k-chip
# fleet sees ~25k failures in 60 days; standard errors stay below ~0.25 points).
DEFAULT_SIM_S = 60 * 86400.0
DEFAULT_MAX_FAILURES = 200_000


# The assumptions, as the report states them (the module docstring explains each one).
ASSUMPTIONS = (
    "Chips fail independently as a Poisson process, MTBI 1 year (365.25 days) per chip; a unit of n chips "
    "fails at rate n / MTBI (1.2M chips: a failure every 26 s).",
    "A failure takes down its whole unit and nothing else: DP, the whole synchronous job; Decoupled, one "
    "learner of N/M chips while the others keep stepping (syncer quorum K = 1 never waits), so learners are "
    "independent identical units.",
    "Every delay (restart, scale-down, scale-up, chip repair) is exponentiated-Weibull, "
    "F(x) = (1 - exp(-(x/scale)^k))^a, with one shared shape (k, a) and a scale per kind of delay.",
    "A failure during a restart or re-mesh abandons it; a fresh one (fresh delay) begins.",
    "DP without elasticity restarts whole on spare chips; the restart delay includes reloading the last "
    "checkpoint. Its goodput is then exactly E[exp(-rate x restart delay)].",
    "Elastic DP pauses for a scale-down, runs without the failed replica of 16 chips, and takes the repaired "
    "chips back at the next reconfiguration within the rejoin window, else in a scale-up pause. Chips out for "
    "repair (~0.2 % of chip-time, independent of the fleet) count as lost; repaired chips return as a Poisson "
    "stream (M/G/inf output).",
    "Decoupled learners are elastic units too (a learner is a scaled-down DP job; the paper's Decoupled cells "
    "at N chips match elastic DP at N/M chips within 4 points). The partial step in flight (< 1 s) is neglected.",
    "Goodput = share of allocated chip-time whose work reaches the model; uptime = share of time some work "
    "advances (Decoupled: at least one learner stepping).",
    "Not modelled: chip speed variance and stragglers, correlated failures, syncer failures (CPU-only, "
    "sharded; modelled for our deployment only), and the quality cost of merges with fewer learners.",
)


@dataclasses.dataclass(frozen=True)
class ExpWeibull:
    """Exponentiated Weibull delay: F(x) = (1 - exp(-(x / scale_s)^weibull_shape))^power."""

    scale_s: float
    weibull_shape: float = DELAY_WEIBULL_SHAPE
    power: float = DELAY_POWER

    def __post_init__(self) -> None:
        if not (self.scale_s >= 0 and self.weibull_shape > 0 and self.power > 0):
            raise ValueError(f"invalid exponentiated Weibull {self}")

    def quantile_s(self, q: np.ndarray | float) -> np.ndarray:
        """Inverse CDF (numpy only; scipy is not a dependency)."""
        q = np.asarray(q, dtype=np.float64)
        return self.scale_s * (-np.log1p(-(q ** (1.0 / self.power)))) ** (1.0 / self.weibull_shape)

    def sample_s(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return self.quantile_s(rng.random(n))

    def mean_s(self) -> float:
        """E[X] = integral of the survival function, on a log grid wide enough for k >= 0.2."""
        if self.scale_s == 0:
            return 0.0
        x = np.geomspace(1e-9, 1e5, 40001) * self.scale_s
        survival = 1.0 - (-np.expm1(-((x / self.scale_s) ** self.weibull_shape))) ** self.power
        return float(np.trapezoid(survival, x))

    @classmethod
    def with_mean(cls, mean_s: float, weibull_shape: float = DELAY_WEIBULL_SHAPE,
                  power: float = DELAY_POWER) -> ExpWeibull:
        """The distribution of this shape whose mean is `mean_s` (the scale is linear in the mean)."""
        unit_mean = cls(1.0, weibull_shape, power).mean_s()
        return cls(mean_s / unit_mean, weibull_shape, power)

    def summary(self) -> dict:
        p50, p90, p99 = (float(v) for v in self.quantile_s(np.array([0.5, 0.9, 0.99])))
        return {"scale_s": self.scale_s, "weibull_shape": self.weibull_shape, "power": self.power,
                "mean_s": self.mean_s(), "p50_s": p50, "p90_s": p90, "p99_s": p99}


@dataclasses.dataclass(frozen=True)
class RestartUnit:
    """A synchronous unit that stops on a failure and restarts whole.

    `save_period_s` = 0: nothing beyond the stall is lost (the restart delay already includes the
    checkpoint reload). Otherwise progress is saved every `save_period_s`: staggered fragment syncs
    (`saves_staggered`, a learner) or periodic checkpoints counted from the restart (a syncer).
    """

    restart: ExpWeibull
    save_period_s: float = 0.0
    saves_staggered: bool = True


@dataclasses.dataclass(frozen=True)
class ElasticUnit:
    """A unit that pauses to drop a failed replica, runs without it and pauses to take it back."""

    scale_down: ExpWeibull
    scale_up: ExpWeibull
    rejoin_batch_s: float
    out_fraction: float = 0.0  # mean share of the unit's chips out for repair


@dataclasses.dataclass(frozen=True)
class UnitResult:
    goodput: float  # share of the unit's chip-time that ends up in the model
    stderr: float  # standard error of `goodput` across independent replicas
    stalled_fraction: float  # share of time the unit is not stepping at all
    failures: int
    replicas: int
    unit_time_s: float


def _lost_work_s(unit: RestartUnit, up_s: np.ndarray) -> np.ndarray:
    period = unit.save_period_s
    if period <= 0:
        return np.zeros_like(up_s)
    if unit.saves_staggered:
        # Fragment p was last pulled A_p ~ U[0, S) ago, independently of the restart; the work on
        # it since then (and never more than the time up) is lost. Averaged over fragments:
        return np.where(up_s < period, up_s - up_s * up_s / (2.0 * period), period / 2.0)
    return np.mod(up_s, period)


@dataclasses.dataclass
class _Replicas:
    """Every replica's state and counters, one array entry per replica, advanced together."""

    t: np.ndarray  # the replica's clock; negative during its warm-up
    stalled: np.ndarray
    stall_end: np.ndarray
    rejoin_deadline: np.ndarray  # elastic: returned chips waiting to be added
    up_s: np.ndarray  # restart: time up since the last restart
    useful_s: np.ndarray
    stalled_s: np.ndarray
    lost_s: np.ndarray
    failures: np.ndarray

    @classmethod
    def start(cls, replicas: int, warmup_s: float) -> _Replicas:
        """Every replica running, at the start of its warm-up."""
        return cls(
            t=np.full(replicas, -warmup_s), stalled=np.zeros(replicas, dtype=bool),
            stall_end=np.full(replicas, np.inf), rejoin_deadline=np.full(replicas, np.inf),
            up_s=np.zeros(replicas), useful_s=np.zeros(replicas), stalled_s=np.zeros(replicas),
            lost_s=np.zeros(replicas), failures=np.zeros(replicas, dtype=np.int64),
        )


def simulate_unit(unit: RestartUnit | ElasticUnit, failure_rate_per_s: float, unit_time_s: float,
                  rng: np.random.Generator, failures_per_replica: float = 100.0,
                  max_replicas: int = 4096, warmup_fraction: float = 0.1) -> UnitResult:
    """Simulates `unit_time_s` of one unit, split into independent replicas run side by side.

    Each replica is an event-driven state machine (running / stalled in a restart, scale-down or
    scale-up) advanced one event per iteration, all replicas at once with numpy. Poisson streams
    are memoryless, so the time to the next failure (and return) is redrawn at every event.
    Each replica first runs an uncounted warm-up (`warmup_fraction` of its horizon, >= 10 failures)
    so that counting starts in the stationary state: starting every replica freshly up would
    overstate goodput by about one failure's loss per replica (0.6 points at 2.4M chips).
    """
    if failure_rate_per_s < 0 or unit_time_s <= 0:
        raise ValueError("failure rate must be >= 0 and simulated time > 0")
    expected_failures = failure_rate_per_s * unit_time_s
    replicas = int(np.clip(expected_failures / failures_per_replica, 16, max_replicas))
    horizon_s = unit_time_s / replicas
    warmup_s = warmup_fraction * horizon_s
    if failure_rate_per_s > 0:
        warmup_s = max(warmup_s, 10.0 / failure_rate_per_s)
    state = _Replicas.start(replicas, warmup_s)
    while True:
        active = state.t < horizon_s
        if not active.any():
            break
        event = _advance_to_next_event(state, active, unit, failure_rate_per_s, horizon_s, rng)
        fail = active & (event == 0)
        state.failures += fail & (state.t >= 0.0)
        if isinstance(unit, ElasticUnit):
            done, rejoin = _elastic_events(state, unit, active, event, fail, rng)
        else:
            done, rejoin = _restart_events(state, unit, active, event, fail, rng)
        state.stall_end[done] = np.inf
        state.stalled = (state.stalled | fail | rejoin) & ~done

    goodput = (state.useful_s - state.lost_s) / horizon_s
    return UnitResult(
        goodput=float(goodput.mean()),
        stderr=float(goodput.std(ddof=1) / math.sqrt(replicas)),
        stalled_fraction=float(state.stalled_s.sum() / (horizon_s * replicas)),
        failures=int(state.failures.sum()),
        replicas=replicas,
        unit_time_s=unit_time_s,
    )


def _advance_to_next_event(state: _Replicas, active: np.ndarray, unit: RestartUnit | ElasticUnit,
                           failure_rate_per_s: float, horizon_s: float, rng: np.random.Generator) -> np.ndarray:
    """Moves every active replica to its next event, counting the time in between (after the
    warm-up) as useful or stalled; returns each replica's event number."""
    replicas = state.t.size
    never = np.full(replicas, np.inf)
    t = state.t

    def next_poisson() -> np.ndarray:
        if failure_rate_per_s == 0:
            return never
        return t + rng.exponential(1.0 / failure_rate_per_s, replicas)

    elastic = isinstance(unit, ElasticUnit)
    out_fraction = unit.out_fraction if elastic else 0.0
    # Candidate events: 0 failure, 1 repaired chips return, 2 stall ends, 3 rejoin window closes, 4 horizon.
    candidates = np.stack([
        next_poisson(),
        next_poisson() if elastic else never,
        np.where(state.stalled, state.stall_end, np.inf),
        np.where(state.stalled, np.inf, state.rejoin_deadline),
        np.full(replicas, horizon_s),
    ])
    event = candidates.argmin(axis=0)
    t_next = np.where(active, candidates[event, np.arange(replicas)], t)
    dt = t_next - np.maximum(t, 0.0)  # only the part after the warm-up counts
    dt = np.maximum(dt, 0.0)
    running = active & ~state.stalled
    state.useful_s += np.where(running, dt * (1.0 - out_fraction), 0.0)
    state.stalled_s += np.where(active & state.stalled, dt, 0.0)
    state.up_s += np.where(running, t_next - t, 0.0)
    state.t = t_next
    return event


def _elastic_events(state: _Replicas, unit: ElasticUnit, active: np.ndarray, event: np.ndarray, fail: np.ndarray,
                    rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """An elastic unit's response to its events: returned chips open a rejoin window, a failure
    starts a scale-down, a closed window a scale-up. Returns (stall ended, scale-up started)."""
    t = state.t
    returned = active & (event == 1) & ~state.stalled & np.isinf(state.rejoin_deadline)
    state.rejoin_deadline[returned] = t[returned] + unit.rejoin_batch_s
    done = active & (event == 2)
    rejoin = active & (event == 3)
    # A failure starts (or re-plans) a scale-down that also takes back any returned chips.
    state.stall_end[fail] = t[fail] + unit.scale_down.sample_s(rng, int(fail.sum()))
    state.stall_end[rejoin] = t[rejoin] + unit.scale_up.sample_s(rng, int(rejoin.sum()))
    state.rejoin_deadline[fail | rejoin] = np.inf
    return done, rejoin


def _restart_events(state: _Replicas, unit: RestartUnit, active: np.ndarray, event: np.ndarray, fail: np.ndarray,
                    rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A restart unit's response to its events: a failure while running loses the work since
    the last checkpoint and starts a restart. Returns (stall ended, no scale-up)."""
    t = state.t
    done = active & (event == 2)
    lost_now = fail & active & ~state.stalled
    # Work lost at a failure counts only for the part done after the warm-up.
    state.lost_s[lost_now] += np.minimum(_lost_work_s(unit, state.up_s[lost_now]), np.maximum(t[lost_now], 0.0))
    state.up_s[fail] = 0.0
    state.stall_end[fail] = t[fail] + unit.restart.sample_s(rng, int(fail.sum()))
    return done, np.zeros(t.size, dtype=bool)


@dataclasses.dataclass(frozen=True)
class FleetModel:
    """The paper's setting: chip MTBI and the (calibrated) delays, shared by every cell."""

    chip_mtbi_s: float = CHIP_MTBI_S
    dp_restart: ExpWeibull = ExpWeibull(DP_RESTART_SCALE_S)
    scale_down: ExpWeibull = ExpWeibull(SCALE_DOWN_SCALE_S)
    scale_up: ExpWeibull = ExpWeibull(SCALE_UP_SCALE_S)
    rejoin_batch_s: float = REJOIN_BATCH_S
    replica_chips: int = REPLICA_CHIPS
    repair: ExpWeibull = ExpWeibull(REPAIR_SCALE_S)
    # Only for the sensitivity rows (learners that restart whole): seconds between two syncs of
    # one fragment, H = 24 steps of ~1 s (assumed; the paper's step time is not known).
    learner_sync_period_s: float = 24.0

    def restart_unit(self) -> RestartUnit:
        return RestartUnit(self.dp_restart)

    def whole_learner_unit(self) -> RestartUnit:
        """A learner without elasticity: restarts like a DP job and loses its unsynced work."""
        return RestartUnit(self.dp_restart, save_period_s=self.learner_sync_period_s, saves_staggered=True)

    def elastic_unit(self) -> ElasticUnit:
        out = min(1.0, self.replica_chips * self.repair.mean_s() / self.chip_mtbi_s)
        return ElasticUnit(self.scale_down, self.scale_up, self.rejoin_batch_s, out_fraction=out)

    def constants(self) -> dict:
        return {
            "chip_mtbi_s": self.chip_mtbi_s,
            "dp_restart": self.dp_restart.summary(),
            "scale_down": self.scale_down.summary(),
            "scale_up": self.scale_up.summary(),
            "rejoin_batch_s": self.rejoin_batch_s,
            "replica_chips": self.replica_chips,
            "repair": self.repair.summary(),
            "repair_out_fraction": self.elastic_unit().out_fraction,
            "learner_sync_period_s": self.learner_sync_period_s,
        }


def _cell_rng(seed: int, label: str, key: int) -> np.random.Generator:
    # One stream per cell, keyed by its label: a cell's number does not depend on which other
    # cells are simulated or in which order.
    return np.random.default_rng([seed, zlib.crc32(label.encode()), key])


def _key(seconds: float) -> int:
    return 0 if math.isinf(seconds) else int(seconds)


@dataclasses.dataclass(frozen=True)
class Cell:
    row: str
    fleet_chips: int
    goodput_pct: float
    stderr_pct: float
    uptime_pct: float
    failures: int
    replicas: int
    simulated_s: float  # wall-clock time of the whole fleet that was simulated
    paper_pct: float | None = None

    @property
    def diff_pct(self) -> float | None:
        return None if self.paper_pct is None else self.goodput_pct - self.paper_pct


WHOLE_RESTART = ", learners restart whole"


def row_labels(learners: Sequence[int]) -> list[str]:
    return ["DP, no elasticity", "DP, elastic"] + [f"Decoupled M={m}" for m in learners]


def sensitivity_labels(learners: Sequence[int]) -> list[str]:
    """Rows outside the paper: Decoupled learners that restart whole instead of re-meshing."""
    return [f"Decoupled M={m}{WHOLE_RESTART}" for m in learners]


def simulate_cell(model: FleetModel, row: str, fleet_chips: int, sim_s: float, seed: int,
                  max_failures: float = DEFAULT_MAX_FAILURES) -> Cell:
    """One cell of Table 1: `sim_s` of wall-clock time of a fleet of `fleet_chips` chips.

    Big fleets fail so often that they reach the precision sooner: no cell simulates more than
    `max_failures` chip failures (the time is shortened instead; `Cell.simulated_s` says how much).
    """
    rng = _cell_rng(seed, row, fleet_chips)
    if row == "DP, no elasticity":
        units, unit = 1, model.restart_unit()
    elif row == "DP, elastic":
        units, unit = 1, model.elastic_unit()
    elif row.startswith("Decoupled M=") and row.endswith(WHOLE_RESTART):
        units, unit = int(row[len("Decoupled M="):-len(WHOLE_RESTART)]), model.whole_learner_unit()
    elif row.startswith("Decoupled M="):
        units, unit = int(row[len("Decoupled M="):]), model.elastic_unit()
    else:
        raise ValueError(f"unknown row {row!r}")
    unit_chips = fleet_chips / units
    fleet_rate = fleet_chips / model.chip_mtbi_s
    if fleet_rate * sim_s > max_failures:
        sim_s = max_failures / fleet_rate
    result = simulate_unit(unit, unit_chips / model.chip_mtbi_s, units * sim_s, rng)
    # Decoupled is down only when every learner is stalled at once (K = 1, learners independent).
    uptime = 1.0 - result.stalled_fraction ** units
    paper = None
    if row in PAPER_TABLE1 and fleet_chips in PAPER_FLEETS:
        paper = PAPER_TABLE1[row][PAPER_FLEETS.index(fleet_chips)]
    return Cell(row, fleet_chips, 100.0 * result.goodput, 100.0 * result.stderr, 100.0 * uptime,
                result.failures, result.replicas, sim_s, paper)


def goodput_table(model: FleetModel = FleetModel(), fleets: Sequence[int] = PAPER_FLEETS,
                  learners: Sequence[int] = PAPER_LEARNERS, sim_s: float = DEFAULT_SIM_S,
                  seed: int = 0, max_failures: float = DEFAULT_MAX_FAILURES) -> list[Cell]:
    """Every (row, fleet) cell, rows in the paper's order."""
    return [simulate_cell(model, row, int(n), sim_s, seed, max_failures)
            for row in row_labels(learners) for n in fleets]


def sensitivity_table(model: FleetModel = FleetModel(), fleets: Sequence[int] = PAPER_FLEETS,
                      learners: Sequence[int] = PAPER_LEARNERS, sim_s: float = DEFAULT_SIM_S,
                      seed: int = 0, max_failures: float = DEFAULT_MAX_FAILURES) -> list[Cell]:
    """The Decoupled rows again, with learners that restart whole (see `FleetModel.whole_learner_unit`)."""
    return [simulate_cell(model, row, int(n), sim_s, seed, max_failures)
            for row in sensitivity_labels(learners) for n in fleets]


def renewal_goodput(loss_per_failure_s: float, cluster_mtbf_s: float) -> float:
    """algorithm.md's sanity check: g = 1 / (1 + T_loss / MTBF_cluster)."""
    return 1.0 / (1.0 + loss_per_failure_s / cluster_mtbf_s)


# --- Our deployment ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OursConfig:
    """Our setting: a few learners of a few accelerators, each one process that restarts whole.

    Defaults come from our docker chaos tests (docs/deploy.md, failure drills): a learner re-joins and contributes again
    within 5-25 s of a crash (mean taken as 15 s), the syncer serves again ~5 s after a crash and
    restores its last checkpoint, so the merges since then are lost (every 16 merges ~ 32 s of
    steps by default). Fragments sync every H = 8 steps (~8 s at ~1 s a step).
    """

    learners: tuple[int, ...] = (2, 4, 8)
    learner_mtbf_s: tuple[float, ...] = (60.0, 600.0, 3600.0, 86400.0)
    chips_per_learner: int = 4
    learner_restart_mean_s: float = 15.0
    sync_period_s: float = 8.0
    syncer_mtbf_s: float = 86400.0
    syncer_restart_mean_s: float = 5.0
    syncer_checkpoint_period_s: float = 32.0
    chip_mtbi_s: float = CHIP_MTBI_S

    def mtbf_cases_s(self) -> list[float]:
        """The flags' learner MTBFs plus the paper's 1 year per chip for our learner size."""
        per_chip = self.chip_mtbi_s / self.chips_per_learner
        return sorted(set(self.learner_mtbf_s) | {per_chip})


@dataclasses.dataclass(frozen=True)
class OursCell:
    learners: int
    learner_mtbf_s: float
    decoupled_pct: float
    decoupled_stderr_pct: float
    synchronous_pct: float
    synchronous_stderr_pct: float
    syncer_pct: float


def ours_table(cfg: OursConfig = OursConfig(), sim_s: float = DEFAULT_SIM_S, seed: int = 0) -> list[OursCell]:
    """Goodput of our learners (Decoupled, K = 1) against a synchronous job of the same processes.

    The synchronous baseline stops every learner when any one fails and restarts them together
    (same restart delay, nothing lost beyond the stall: state is synchronized every step). Syncer
    crashes hit both alike and multiply both goodputs (independent processes; overlaps are
    second-order).
    """
    restart = ExpWeibull.with_mean(cfg.learner_restart_mean_s)
    learner = RestartUnit(restart, save_period_s=cfg.sync_period_s, saves_staggered=True)
    syncer = RestartUnit(ExpWeibull.with_mean(cfg.syncer_restart_mean_s),
                         save_period_s=cfg.syncer_checkpoint_period_s, saves_staggered=False)
    syncer_rate = 0.0 if math.isinf(cfg.syncer_mtbf_s) else 1.0 / cfg.syncer_mtbf_s
    g_syncer = simulate_unit(syncer, syncer_rate, sim_s, _cell_rng(seed, "ours syncer", 0))
    cells = []
    for m in cfg.learners:
        for mtbf in cfg.mtbf_cases_s():
            rate = 0.0 if math.isinf(mtbf) else 1.0 / mtbf
            dec = simulate_unit(learner, rate, m * sim_s, _cell_rng(seed, f"ours decoupled {m}", _key(mtbf)))
            sync = simulate_unit(RestartUnit(restart), m * rate, sim_s, _cell_rng(seed, f"ours sync {m}", _key(mtbf)))
            cells.append(OursCell(
                learners=m, learner_mtbf_s=mtbf,
                decoupled_pct=100.0 * dec.goodput * g_syncer.goodput,
                decoupled_stderr_pct=100.0 * math.hypot(dec.stderr, g_syncer.stderr),
                synchronous_pct=100.0 * sync.goodput * g_syncer.goodput,
                synchronous_stderr_pct=100.0 * math.hypot(sync.stderr, g_syncer.stderr),
                syncer_pct=100.0 * g_syncer.goodput,
            ))
    return cells
