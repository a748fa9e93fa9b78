"""Seeded fault schedules: written to `faults.jsonl`, loaded back and replayed exactly.

A schedule is a list of `FaultEvent(t, kind, target, params)`, in the style of torchft's
`fail_at(rank, step)` and Kafka Trogdor's fault specs. `t` is seconds after the scenario's start
(every learner contributing), or, with `at_merge` N > 0, seconds after the syncer's history first
held N merges: a schedule can follow training progress instead of the clock. Events gated on
different `at_merge` values are phases that run one after the other: a phase starts only once the
faults of the earlier phases have healed and their components recovered (or 20 s passed).
With `at_step` S > 0 (learner targets only), `t` counts from when the target learner has run S
inner steps in all its lives: the fault hits the same point of the training in every run, however
fast or slow the mode is (`step_loop` builds such schedules; the goodput benchmark uses them so that
every mode gets the same faults).

Kinds and their params:

  process faults (targets `syncer`, `checkpoint`, `learner-<i>`):
    kill       SIGKILL; restart_after_s (default 1.0; < 0: never restarted); failpoints: armed
               in the restarted life (e.g. "store.after_tmp_write=crash": it then crashes on
               its next temp write, and is restarted once more, clean)
    term       SIGTERM (graceful); restart_after_s after it exited; failpoints as for kill
    stop       SIGSTOP, then SIGCONT after duration_s (a hung peer, Jepsen's "pause")
  region faults (hub target `hub-leader`: the region of the syncer leading at that moment):
    region     SIGKILL of that syncer, its store and its etcd member together (region a: syncer-a,
               store-a, etcd-0; b: syncer-b, store-b, etcd-1), all restarted after restart_after_s
  disk faults (hub targets `store-a`, `store-b`):
    wipe       SIGKILL, the store's whole data directory deleted, restarted empty after
               restart_after_s (its peers and the syncer's repair rebuild it)
  link faults (target `learner-<i>`: the FaultProxy between that learner and the syncer):
    partition  the link is cut (resets, refused connections) for duration_s
    blackhole  nothing is forwarded for duration_s (connections stay open)
    latency    latency_s (+- jitter_s) for duration_s
    bandwidth  bytes_per_s for duration_s
    reset      every open connection is reset once (reset_peer)
    limit_data connections are reset after `bytes` upstream bytes, for duration_s
    flap       down_s down / up_s up, repeatedly, for duration_s

`kill_loop` is torchft's punisher `kill_loop(--num-failures, --mtbf-secs)`: exponentially
distributed gaps with the given mean time between failures, each fault on a seeded random target
(one fault at a time per target, at most `max_learners_down` learners at once).

File format: the first line is a header `{"kind": "header", "seed", "scenario": {...}}` (what a
replay needs to rebuild the run), then one event per line.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import random
from collections.abc import Mapping, Sequence

PROCESS_KINDS = ("kill", "term", "stop")
LINK_KINDS = ("partition", "blackhole", "latency", "bandwidth", "reset", "limit_data", "flap")
DISK_KINDS = ("wipe",)
REGION_KINDS = ("region",)
KINDS = PROCESS_KINDS + LINK_KINDS + DISK_KINDS + REGION_KINDS
SERVICES = ("syncer", "checkpoint")
# The hub scenario's services (ddiloco/chaos/hub.py): two syncers, two stores, three etcd members.
HUB_SERVICES = ("syncer-a", "syncer-b", "store-a", "store-b", "etcd-0", "etcd-1", "etcd-2", "hub-leader")


@dataclasses.dataclass(frozen=True)
class FaultEvent:
    t: float
    kind: str
    target: str
    params: Mapping = dataclasses.field(default_factory=dict)
    at_merge: int = 0  # t counts from when the syncer history held this many merges (0: the start)
    at_step: int = 0  # t counts from when the target learner ran this many inner steps (0: not gated)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind {self.kind!r}: one of {', '.join(KINDS)}")
        if self.t < 0 or self.at_merge < 0 or self.at_step < 0:
            raise ValueError(f"fault {self.kind} on {self.target}: t, at_merge and at_step must be >= 0")
        if self.at_step and (self.at_merge or not self.target.startswith("learner-")):
            raise ValueError(f"fault {self.kind} on {self.target}: at_step gates on a learner's own steps "
                             "(target learner-<i>, no at_merge)")
        if not (self.target in SERVICES or self.target in HUB_SERVICES or self.target.startswith("learner-")):
            raise ValueError(f"fault target {self.target!r}: syncer, checkpoint, learner-<i> or one of the "
                             f"hub's {', '.join(HUB_SERVICES)}")
        if (self.kind in REGION_KINDS) != (self.target == "hub-leader"):
            raise ValueError(f"{self.kind} on {self.target!r}: a region fault targets hub-leader, and only it")
        if self.kind in DISK_KINDS and not self.target.startswith("store-"):
            raise ValueError(f"{self.kind} loses a store's disk: target store-a or store-b, not {self.target!r}")
        if self.kind in LINK_KINDS and not self.target.startswith("learner-"):
            raise ValueError(f"{self.kind} acts on a learner's link to the syncer: target learner-<i>, "
                             f"not {self.target!r}")

    @property
    def duration_s(self) -> float:
        """How long the fault lasts once injected (0 for one-shots; a kill's restart delay)."""
        p = self.params
        if self.kind in ("kill", "term", "wipe", "region"):
            return max(float(p.get("restart_after_s", 1.0)), 0.0)
        if self.kind == "reset":
            return 0.0
        return float(p.get("duration_s", 0.0))

    def to_json(self) -> dict:
        out = {"t": round(self.t, 3), "kind": self.kind, "target": self.target, "params": dict(self.params)}
        if self.at_merge:
            out["at_merge"] = self.at_merge
        if self.at_step:
            out["at_step"] = self.at_step
        return out

    @classmethod
    def from_json(cls, d: Mapping) -> FaultEvent:
        return cls(t=float(d["t"]), kind=d["kind"], target=d["target"], params=dict(d.get("params", {})),
                   at_merge=int(d.get("at_merge", 0)), at_step=int(d.get("at_step", 0)))

    def describe(self) -> str:
        params = ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        when = (f"t={self.t:.1f}s" + (f"/merge>={self.at_merge}" if self.at_merge else "")
                + (f"/step>={self.at_step}" if self.at_step else ""))
        return f"{when} {self.kind} {self.target}" + (f" ({params})" if params else "")


@dataclasses.dataclass
class FaultSchedule:
    events: list[FaultEvent]
    seed: int = 0
    scenario: dict = dataclasses.field(default_factory=dict)  # the Scenario, for replays

    def __post_init__(self) -> None:
        self.events = sorted(self.events, key=lambda e: (e.at_merge, e.at_step, e.t))

    def save(self, path: str | pathlib.Path) -> pathlib.Path:
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"kind": "header", "seed": self.seed, "scenario": self.scenario}, sort_keys=True)]
        lines += [json.dumps(e.to_json(), sort_keys=True) for e in self.events]
        path.write_text("\n".join(lines) + "\n")
        return path

    @classmethod
    def load(cls, path: str | pathlib.Path) -> FaultSchedule:
        seed, scenario, events = 0, {}, []
        for n, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                if d.get("kind") == "header":
                    seed, scenario = int(d.get("seed", 0)), dict(d.get("scenario", {}))
                else:
                    events.append(FaultEvent.from_json(d))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a fault event: {exc}") from None
        return cls(events=events, seed=seed, scenario=scenario)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.events:
            out[e.kind] = out.get(e.kind, 0) + 1
        return out

    def describe(self) -> str:
        return "\n".join(e.describe() for e in self.events)


# Default mix of the kill loop: kinds per kind of target, with relative weights.
DEFAULT_MIX: dict[str, dict[str, float]] = {
    "learner": {"kill": 3, "stop": 2, "term": 1, "partition": 1, "blackhole": 1, "reset": 1, "latency": 1, "flap": 0.5},
    "syncer": {"kill": 2, "term": 1, "stop": 1},
    "checkpoint": {"kill": 2, "stop": 1},
}


def kill_loop(*, seed: int, duration_s: float, mtbf_s: float, learners: int, services: Sequence[str] = SERVICES,
              mix: Mapping[str, Mapping[str, float]] | None = None, start_s: float = 0.0,
              max_learners_down: int = 1, cooldown_s: float = 3.0, max_fault_s: float = 4.0,
              network: bool = True, exclusive: Sequence[str] = (),
              settle_s: Mapping[str, float] | None = None) -> list[FaultEvent]:
    """Seeded faults with exponential gaps of mean `mtbf_s`, over [start_s, start_s + duration_s).

    Each fault picks a target not already under a fault (plus `cooldown_s` to recover), at most
    `max_learners_down` learners at once; `network=False` leaves out the link kinds (no proxies).
    `exclusive`: target name prefixes (e.g. "etcd-") of which at most one target is under a fault
    at once (one etcd member: quorum holds; one store: a checkpoint stays on the other).
    Service targets without their own `mix` entry use the entry named by their prefix before "-".
    `settle_s`: extra seconds a target stays busy after a fault of that kind (a wiped store is
    repaired from its peer: wiping the peer before that would lose both copies, beyond what
    replication promises).
    """
    if mtbf_s <= 0 or duration_s <= 0:
        raise ValueError("kill_loop: mtbf_s and duration_s must be > 0")
    rng = random.Random(seed)
    mix = {k: dict(v) for k, v in (mix or DEFAULT_MIX).items()}
    if not network:
        mix["learner"] = {k: w for k, w in mix["learner"].items() if k in PROCESS_KINDS}
    kinds_of = lambda tg: mix.get(tg) or mix.get(tg.split("-")[0])  # noqa: E731
    targets = [f"learner-{i}" for i in range(learners)] + [s for s in services if kinds_of(s)]
    busy_until: dict[str, float] = {}
    events: list[FaultEvent] = []
    t = start_s
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t >= start_s + duration_s:
            break
        learners_down = sum(1 for tg, until in busy_until.items() if tg.startswith("learner-") and until > t)
        busy = [tg for tg, until in busy_until.items() if until > t]
        free = [tg for tg in targets if busy_until.get(tg, -1.0) <= t
                and not (tg.startswith("learner-") and learners_down >= max_learners_down)
                and not any(tg.startswith(x) and b.startswith(x) for x in exclusive for b in busy)]
        if not free:
            continue
        target = rng.choice(free)
        kinds = mix["learner"] if target.startswith("learner-") else kinds_of(target)
        kind = rng.choices(list(kinds), weights=list(kinds.values()))[0]
        params = _params(rng, kind, max_fault_s)
        event = FaultEvent(t=round(t, 3), kind=kind, target=target, params=params)
        events.append(event)
        busy_until[target] = t + event.duration_s + cooldown_s + (settle_s or {}).get(kind, 0.0)
    return events


def step_loop(*, seed: int, steps: int, mtbf_steps: float, learners: int,
              mix: Mapping[str, float] | None = None, start_step: int = 10, end_margin_steps: int = 20,
              cooldown_steps: int = 20, max_fault_s: float = 4.0) -> list[FaultEvent]:
    """Seeded learner faults placed in training progress, not in wall time (`at_step` events).

    Positions on the step axis (every learner runs `steps` inner steps) have exponential gaps of
    mean `mtbf_steps` over [start_step, steps - end_margin_steps); each fault hits a seeded random
    learner that had no fault in the last `cooldown_steps` of its own steps, and fires when that
    learner reaches the position. `mix` weighs the process kinds (default kill and stop, 1:1).
    The list depends only on the arguments: every mode of a benchmark gets the same faults, the
    same targets and the same points of the training, whatever its speed.
    """
    if mtbf_steps <= 0 or steps <= 0:
        raise ValueError("step_loop: mtbf_steps and steps must be > 0")
    rng = random.Random(seed)
    kinds = dict(mix or {"kill": 1.0, "stop": 1.0})
    if not kinds or set(kinds) - set(PROCESS_KINDS):
        raise ValueError(f"step_loop: mix of process kinds ({', '.join(PROCESS_KINDS)}), not {sorted(kinds)}")
    last: dict[str, float] = {}
    events: list[FaultEvent] = []
    s = float(start_step)
    while True:
        s += rng.expovariate(1.0 / mtbf_steps)
        if s >= steps - end_margin_steps:
            break
        free = [f"learner-{i}" for i in range(learners)
                if s - last.get(f"learner-{i}", -1e9) >= cooldown_steps]
        if not free:
            continue
        target = rng.choice(free)
        kind = rng.choices(list(kinds), weights=list(kinds.values()))[0]
        events.append(FaultEvent(t=0.0, kind=kind, target=target, params=_params(rng, kind, max_fault_s),
                                 at_step=max(int(s), 1)))
        last[target] = s
    return events


def _params(rng: random.Random, kind: str, max_fault_s: float) -> dict:
    span = lambda lo: round(rng.uniform(lo, max(lo, max_fault_s)), 2)  # noqa: E731
    if kind in ("kill", "term", "wipe"):
        return {"restart_after_s": span(0.5)}
    if kind == "stop":
        return {"duration_s": span(1.0)}
    if kind in ("partition", "blackhole"):
        return {"duration_s": span(1.0)}
    if kind == "latency":
        return {"duration_s": span(2.0), "latency_s": round(rng.uniform(0.05, 0.3), 3), "jitter_s": 0.02}
    if kind == "bandwidth":
        return {"duration_s": span(2.0), "bytes_per_s": rng.choice([100_000, 250_000, 1_000_000])}
    if kind == "limit_data":
        return {"duration_s": span(1.0), "bytes": rng.randint(2_000, 50_000)}
    if kind == "flap":
        return {"duration_s": span(3.0), "down_s": 0.5, "up_s": 1.0}
    return {}
