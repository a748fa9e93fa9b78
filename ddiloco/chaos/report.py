"""What a chaos run found: the faults it injected (`InjectedFault`), its `Result` (checks, work
merged, loss, histories) and the one-line report of it; recovery times from the syncer's history.
"""

from __future__ import annotations

import dataclasses
import pathlib
import statistics
from collections.abc import Sequence

from ddiloco.chaos import invariants
from ddiloco.chaos import schedule as schedule_lib
from ddiloco.chaos.config import Scenario


@dataclasses.dataclass
class InjectedFault:
    kind: str
    target: str
    at: float  # unix seconds
    healed_at: float | None = None  # restart / SIGCONT / link back
    recovered_at: float | None = None
    detail: str = ""
    scheduled: bool = True  # False: a crash the supervisor found (a failpoint)

    @property
    def recovery_s(self) -> float | None:
        if self.recovered_at is None or self.healed_at is None:
            return None
        return max(0.0, self.recovered_at - self.healed_at)


@dataclasses.dataclass
class Result:
    scenario: Scenario
    workdir: pathlib.Path
    faults: list[InjectedFault]
    not_injected: list[schedule_lib.FaultEvent]
    checks: list[invariants.Check]
    work_merged: float | None  # tokens in surviving merges / (P x tokens processed)
    loss: float | None
    baseline_loss: float | None
    wall_s: float
    t0: float  # unix seconds when the schedule started
    training_end: float  # unix seconds when the last learner finished its steps (0: it did not)
    syncer_history: list[dict]
    learner_histories: dict[str, list[dict]]
    summaries: dict[str, dict | None]
    final_state: dict
    proxy_stats: dict[str, dict]
    proxy_samples: dict[str, list[tuple[float, int, int, int]]] = dataclasses.field(default_factory=dict)
    member_samples: list[tuple[float, dict[str, str]]] = dataclasses.field(default_factory=list)
    learner_finished_at: dict[str, float] = dataclasses.field(default_factory=dict)  # learner -> unix s
    stopped_at: float = 0.0  # unix seconds when the run stopped driving: training ended or max_wall_s hit
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and all(c.ok for c in self.checks)

    def check(self, prefix: str) -> invariants.Check:
        return next(c for c in self.checks if c.name.startswith(prefix))

    def violations(self) -> list[str]:
        out = [self.error] if self.error else []
        for c in self.checks:
            out += [f"{c.name}: {v}" for v in c.violations]
        return out

    @property
    def recoveries(self) -> list[float]:
        return [f.recovery_s for f in self.faults if f.recovery_s is not None]

    def merges_between(self, start: float, end: float) -> list[dict]:
        return [r for r in self.syncer_history if r["event"] == "merged" and start <= r["t"] < end]

    @property
    def report_line(self) -> str:
        return report_line(self)

    def to_json(self) -> dict:
        return {
            "scenario": self.scenario.to_dict(), "ok": self.ok, "error": self.error, "report": self.report_line,
            "wall_s": round(self.wall_s, 2), "t0": self.t0, "training_end": self.training_end,
            "work_merged": self.work_merged, "loss": self.loss,
            "baseline_loss": self.baseline_loss,
            "faults": [dataclasses.asdict(f) | {"recovery_s": f.recovery_s} for f in self.faults],
            "not_injected": [e.to_json() for e in self.not_injected],
            "checks": [dataclasses.asdict(c) for c in self.checks],
            "proxy_stats": self.proxy_stats,
        }


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(sorted(values), n=100, method="inclusive")[int(q) - 1]


def report_line(result: Result) -> str:
    """One line per scenario: faults, lost acked uploads, double applies, recovery, work merged, loss."""
    i1, i2 = result.check("I1").figures, result.check("I2").figures
    i3, i4 = result.check("I3").figures, result.check("I4").figures
    counts: dict[str, int] = {}
    for f in result.faults:
        key = f.kind if f.scheduled else "crash"
        counts[key] = counts.get(key, 0) + 1
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    rec = result.recoveries
    recovery = (f"recovery p50 {_percentile(rec, 50):.1f} s p95 {_percentile(rec, 95):.1f} s "
                f"({len(rec)}/{len(result.faults)} recovered)") if rec else f"recovery - (0/{len(result.faults)})"
    merged = f"work merged {100 * result.work_merged:.1f} %" if result.work_merged is not None else "work merged -"
    if result.loss is not None and result.baseline_loss is not None:
        delta = 100 * (result.loss - result.baseline_loss) / result.baseline_loss
        loss = (f"loss {result.loss:.3f} vs {result.baseline_loss:.3f} fault-free ({delta:+.1f} %, "
                f"margin {100 * result.scenario.loss_margin:.0f} %)")
    elif result.loss is not None:
        loss = f"loss {result.loss:.3f} (no baseline)"
    else:
        loss = "loss -"
    verdict = "PASS" if result.ok else f"FAIL ({len(result.violations())} violations)"
    return (
        f"chaos {result.scenario.name} seed={result.scenario.seed}: {len(result.faults)} faults injected"
        f"{f' ({kinds})' if kinds else ''}, acked uploads lost {i1.get('lost', 0)} of {i1.get('acked', 0)} "
        f"(+{i1.get('lost_on_syncer_crash', 0)} in open rounds of crashed syncer lives, "
        f"{i1.get('rolled_back', 0)} rolled back, {i1.get('pending', 0)} pending), "
        f"double-applied {i1.get('double_applied', 0)}, {i2.get('merges', 0)} merges "
        f"({i2.get('below_quorum', 0)} below quorum"
        f"{f' + {unreachable} with the quorum unreachable' if (unreachable := i2.get('quorum_unreachable')) else ''}, "
        f"{i2.get('restarts', 0)} syncer restarts"
        f"{f', STALLED fragments {stalled}' if (stalled := i2.get('stalled_fragments')) else ''}), "
        f"learners hash-equal {i3.get('hash_equal', 0)}/{i3.get('learners', 0)}"
        f"{f' ({stale} ended before re-syncing)' if (stale := i3.get('stale', 0)) else ''}, "
        f"checkpoints loadable {i4.get('loadable', 0)}/{i4.get('checkpoints', 0)}, {recovery}, {merged}, {loss}: "
        f"{verdict} in {result.wall_s:.0f} s"
    )


def mark_recoveries(faults: Sequence[InjectedFault], syncer_history: Sequence[dict]) -> None:
    """Sets each fault's recovered_at: the first progress of the faulted component after its heal."""
    merges = [r for r in syncer_history if r["event"] == "merged"]
    checkpoints = [r for r in syncer_history if r["event"] == "checkpoint"]
    starts = {r["instance"]: r["t"] for r in syncer_history if r["event"] == "start"}
    for fault in faults:
        if fault.healed_at is None:
            continue
        h = fault.healed_at
        if fault.target.startswith("learner-"):
            found = next((r for r in merges if r["t"] > h and any(c[0] == fault.target for c in r["contributors"])), None)
        elif fault.target.startswith("syncer"):
            found = next((r for r in merges if r["t"] > h and starts.get(r["instance"], 0) <= r["t"]), None)
        else:
            found = next((r for r in checkpoints if r["t"] > h), None)
        fault.recovered_at = found["t"] if found else None




def work_merged(syncer_history: Sequence[dict], tokens_processed: int, num_fragments: int) -> float | None:
    """Tokens in surviving merges / (P x tokens processed), P the fragments of the syncer's last
    life (`num_fragments` when it never started); None when nothing was processed. Merges a
    later syncer life rolled back do not count."""
    if not tokens_processed:
        return None
    rolled = invariants.rolled_back_merges(invariants.syncer_lives(syncer_history))
    merged_tokens = sum(
        c[3] for r in syncer_history if r["event"] == "merged"
        and (r["instance"], int(r["fragment"]), int(r["version"])) not in rolled for c in r["contributors"])
    starts = [r for r in syncer_history if r["event"] == "start"]
    fragments = len(starts[-1]["fragments"]) if starts else num_fragments  # dp: 1
    return merged_tokens / (fragments * tokens_processed)
