"""Runs one chaos scenario end to end: cluster, fault schedule, histories, invariants, report line.

    result = run_scenario(Scenario(name="soak", seed=1), schedule, workdir, baseline_loss=2.9)
    print(result.report_line)          # one line: faults, lost acks, double applies, recovery, work merged
    assert result.ok, result.violations()

What one run does (everything on 127.0.0.1, processes started and signalled by PID only):
1. Starts a checkpoint store, a syncer and N learners (LocalCluster), each with a `--history-file`,
   the syncer's and learners' failpoints armed for their first life only, and one FaultProxy per
   learner between it and the syncer (plaintext gRPC through the proxy).
2. Waits until every learner's uploads appear in merges (t = 0 of the schedule), then applies the
   schedule: signals (SIGKILL / SIGTERM / SIGSTOP+SIGCONT) with restarts, and link toxics on the
   proxies with their heals. A supervisor restarts any process that died on its own (a failpoint
   crash), without its failpoints, and records it as an injected fault. A restarted learner gets
   the steps its earlier lives did not run, so each learner identity trains `steps` steps in all.
3. When every learner has finished its steps: heals what is left, reads the syncer's final
   state, stops the syncer gracefully (final checkpoint, `shutdown` record), loads every retained
   checkpoint from the store and evaluates the held-out loss of the last one (in this process).
4. Checks I1-I4 (ddiloco/chaos/invariants.py) and, with a baseline loss, I5; computes recovery
   times (heal -> first merge that includes the learner / first merge of the syncer's new life /
   first committed checkpoint) and work merged (tokens in surviving merges / (P x tokens processed);
   not the paper's goodput, which `ddiloco bench goodput` computes);
   writes report.json and report.txt into the workdir.

Learners' training is step-based (the same work with and without faults, so the final loss is
comparable with the fault-free run); the schedule is time-based (`t`), optionally gated on the
number of merges so far (`at_merge`) or on the target learner's own steps (`at_step`), and
events not reached before training ends are reported as not injected. The wall clock is bounded
by `Scenario.max_wall_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import heapq
import json
import logging
import os
import pathlib
import random
import shutil
import signal
import socket
import statistics
import threading
import time
from collections.abc import Callable, Sequence

from ddiloco import history as history_lib
from ddiloco.chaos import invariants
from ddiloco.chaos import schedule as schedule_lib
from ddiloco.chaos.proxy import FaultProxy, ProxyGroup, Toxics

_LOG = logging.getLogger("ddiloco.chaos")

TINY_MODEL = json.dumps({"preset": "tiny"})


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A chaos run's configuration (everything but the faults). Serialized into faults.jsonl."""

    name: str = "custom"
    seed: int = 1
    learners: int = 3
    min_quorum: int = 2
    steps: int = 300  # inner steps per learner identity, over all its lives
    step_delay_s: float = 0.03  # pacing only: wall time per step, not the math
    num_fragments: int = 4
    sync_period_steps: int = 4
    model_config: str = TINY_MODEL
    store: bool = True
    proxy: bool = True  # a FaultProxy between each learner and the syncer (needed for link faults)
    checkpoint_every_merges: int = 4
    # The syncer's liveness timeout and grace cap. Fault scenarios shorten them (3 s, 2 s) so a run
    # sees a dead learner dropped within its few minutes; None passes no flag: the syncer's shipped
    # defaults (bench goodput).
    liveness_timeout_s: float | None = 3.0
    max_grace_s: float | None = 2.0
    chunk_size_bytes: int = 0  # 0: the syncer's default; small values make uploads multi-chunk
    syncer_failpoints: str = ""  # armed for the syncer's first life only
    store_failpoints: str = ""  # store.*=crash|enospc, first life only
    learner_failpoints: tuple[tuple[str, str], ...] = ()  # (learner name, spec), first life only
    call_timeout_s: float = 3.0  # learners: unary deadline (detects a dead link quickly)
    retry_bound_s: float = 8.0
    restart_delay_s: float = 1.0  # a process that died on its own is restarted after this
    max_corpus_bytes: int = 2_000_000
    loss_margin: float = 0.15  # I5: final loss <= (1 + margin) x the fault-free run's
    warmup_timeout_s: float = 180.0
    # Once a learner finished its steps, the others get this long, then are SIGTERMed (they exit
    # cleanly): in the synchronous modes a learner with steps left would wait at a barrier forever.
    finish_grace_s: float = 90.0
    max_wall_s: float = 300.0
    # Learners share <workdir>/jax-cache (--compilation-cache-dir): a restart loads its compiled
    # programs instead of spending seconds of CPU compiling, CPU the other learners on this machine
    # would lose (a deployment keeps the cache on the node or a volume).
    compilation_cache: bool = True
    syncer_args: tuple[str, ...] = ()
    learner_args: tuple[str, ...] = ()
    # What a learner's kill takes down. "learner": that process only; it restarts and rejoins (the
    # others go on, or wait at a barrier). "job": every learner, all restarting after the kill's
    # delay, as a synchronous SPMD job is torn down and relaunched when one worker dies (the
    # paper's "DP, no elasticity" baseline; the syncer, standing for the checkpoint, survives).
    kill_scope: str = "learner"
    # The hub region under fire (ddiloco/chaos/hub.py): two syncers elected on a 3-member etcd,
    # two replicated stores, learners following the leader.
    hub: bool = False

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["learner_failpoints"] = [list(p) for p in self.learner_failpoints]
        d["syncer_args"], d["learner_args"] = list(self.syncer_args), list(self.learner_args)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Scenario:
        known = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        if "learner_failpoints" in d:
            d["learner_failpoints"] = tuple(tuple(p) for p in d["learner_failpoints"])
        for k in ("syncer_args", "learner_args"):
            if k in d:
                d[k] = tuple(d[k])
        return cls(**d)

    def fault_free(self) -> Scenario:
        """The same run without failpoints (for the I5 baseline; give it no schedule)."""
        return dataclasses.replace(self, name=f"{self.name}-baseline", syncer_failpoints="", store_failpoints="",
                                   learner_failpoints=())


def timeout_args(sc: Scenario) -> list[str]:
    """The syncer flags of the scenario's liveness timeout and grace cap (none for a None: shipped default)."""
    args: list[str] = []
    if sc.liveness_timeout_s is not None:
        args += ["--liveness-timeout-s", str(sc.liveness_timeout_s)]
    if sc.max_grace_s is not None:
        args += ["--max-grace-s", str(sc.max_grace_s)]
    return args


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


class _HistoryTail:
    """Counts merges in the syncer's history file as it grows (for `at_merge` and warm-up)."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""
        self.merges = 0
        self.learners_merged: set[str] = set()
        self.last_merge_with: dict[str, float] = {}  # learner -> unix s of its latest merge
        self.last_merge = 0.0
        self.last_checkpoint = 0.0

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            merged, checkpoint = b'"event":"merged"' in line, b'"event":"checkpoint"' in line
            if not (merged or checkpoint):
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if checkpoint:
                self.last_checkpoint = rec["t"]
                continue
            self.merges += 1
            self.last_merge = rec["t"]
            for c in rec["contributors"]:
                self.learners_merged.add(c[0])
                self.last_merge_with[c[0]] = rec["t"]

    def recovered(self, fault: InjectedFault) -> bool:
        """The faulted component made progress after the fault healed (see `_recoveries`)."""
        if fault.healed_at is None:
            return False
        if fault.target.startswith("learner-"):
            return self.last_merge_with.get(fault.target, 0.0) > fault.healed_at
        if fault.target.startswith("syncer"):
            return self.last_merge > fault.healed_at
        return self.last_checkpoint > fault.healed_at


_STATUS = {1: "ACTIVE", 2: "SILENT", 3: "LEFT"}


class _Poller(threading.Thread):
    """Polls the syncer's training state (in its own thread: a stopped syncer must not stall the
    scheduler) and keeps, per learner life, the most steps and tokens it reported."""

    def __init__(self, address: str, interval_s: float = 0.5) -> None:
        super().__init__(name="chaos-poller", daemon=True)
        from ddiloco.rpc import channel as channel_lib
        from ddiloco.v1 import syncer_pb2_grpc

        self._channel = channel_lib.sync_channel(address)
        self._stub = syncer_pb2_grpc.SyncerStub(self._channel)
        self._interval_s = interval_s
        self._halt = threading.Event()
        self.lock = threading.Lock()
        self.lives: dict[tuple[str, int], dict] = {}  # (learner, incarnation) -> {steps, tokens}
        self.samples: list[tuple[float, dict[str, str]]] = []  # (unix s, {learner: ACTIVE|SILENT|LEFT})
        self.errors = 0

    def state(self, timeout_s: float = 3.0):
        from ddiloco.v1 import syncer_pb2

        return self._stub.GetTrainingState(syncer_pb2.GetTrainingStateRequest(recent_merges=0), timeout=timeout_s).state

    def run(self) -> None:
        import grpc

        while not self._halt.is_set():
            try:
                st = self.state(2.0)
                with self.lock:
                    self.samples.append((time.time(), {m.learner_id: _STATUS.get(m.status, "?") for m in st.members}))
                    for m in st.members:
                        life = self.lives.setdefault((m.learner_id, m.incarnation), {"steps": 0, "tokens": 0})
                        life["steps"] = max(life["steps"], m.local_step)
                        life["tokens"] = max(life["tokens"], m.tokens_total)
            except grpc.RpcError:
                self.errors += 1
            self._halt.wait(self._interval_s)

    def record_summary(self, summary: dict) -> None:
        with self.lock:
            life = self.lives.setdefault((summary["learner_id"], summary["incarnation"]), {"steps": 0, "tokens": 0})
            life["steps"] = max(life["steps"], summary["steps"])
            life["tokens"] = max(life["tokens"], summary["tokens"])

    def steps_done(self, learner: str) -> int:
        with self.lock:
            return sum(v["steps"] for (lid, _), v in self.lives.items() if lid == learner)

    def tokens_processed(self) -> int:
        with self.lock:
            return sum(v["tokens"] for v in self.lives.values())

    def stop(self) -> None:
        self._halt.set()
        self.join(5.0)
        self._channel.close()


@dataclasses.dataclass
class _Proc:
    """The harness's view of one service process."""

    state: str = "up"  # up | down (killed, restart pending) | stopped | terming | finished
    restart_after_s: float = -1.0  # terming: restart this long after it exits (< 0: never)
    restart_failpoints: str = ""  # terming: failpoints armed in the restarted life
    final: bool = False  # terming at the end of the run: done once it exits
    fault: InjectedFault | None = None  # the fault it is currently under
    term_at: float = 0.0


class Harness:
    """One scenario run. See the module docstring; `run()` returns a Result (never raises for a
    failed invariant; raises only for a broken set-up)."""

    def __init__(self, scenario: Scenario, schedule: schedule_lib.FaultSchedule | Sequence[schedule_lib.FaultEvent],
                 workdir: str | os.PathLike, *, baseline_loss: float | None = None, evaluate: bool = True,
                 env: dict | None = None, jax_cache_dir: str | os.PathLike | None = None,
                 on_event: Callable[[str], None] | None = None) -> None:
        from ddiloco.cli import cluster as cluster_lib

        self.scenario = scenario
        events = schedule.events if isinstance(schedule, schedule_lib.FaultSchedule) else list(schedule)
        self.schedule = schedule_lib.FaultSchedule(events=list(events), seed=scenario.seed, scenario=scenario.to_dict())
        self.workdir = pathlib.Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        for stale in ("cluster", "history"):  # a fresh run: never restore a previous run's state
            shutil.rmtree(self.workdir / stale, ignore_errors=True)
        self.baseline_loss = baseline_loss
        self.evaluate = evaluate
        env = dict(os.environ if env is None else env)
        if jax_cache_dir is not None:  # compiled train steps are reused by every restart
            env.setdefault("JAX_COMPILATION_CACHE_DIR", str(jax_cache_dir))
            env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
            env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
        self.cluster = cluster_lib.LocalCluster(self.workdir / "cluster", env=env)
        self.run_id = f"chaos-{scenario.name}"
        self.proxies: dict[str, FaultProxy] = {}
        self.procs: dict[str, _Proc] = {}
        self.faults: list[InjectedFault] = []
        self.not_injected: list[schedule_lib.FaultEvent] = []
        self._actions: list = []  # heap of (due unix s, seq, description, fn)
        self._seq = 0
        self._on_event = on_event or (lambda line: _LOG.info(line))
        self.t0 = 0.0
        self._tail: _HistoryTail | None = None
        self._poller: _Poller | None = None
        self._summaries: dict[str, dict | None] = {}
        self._phase_faults: dict[int, list[InjectedFault]] = {}
        self.training_end = 0.0
        self.stopped_at = 0.0
        self._first_finish = 0.0
        self.finished_at: dict[str, float] = {}  # learner -> unix s when it finished its steps
        self.proxy_samples: dict[str, list[tuple[float, int, int, int]]] = {}  # (t, up, down, connections)
        self._next_proxy_sample = 0.0

    # ------------------------------------------------------------------------------ paths

    def _history_path(self, name: str) -> pathlib.Path:
        return self.workdir / "history" / f"{name}.jsonl"

    def _summary_path(self, name: str) -> pathlib.Path:
        return self.cluster.workdir / f"{name}.summary.json"

    def learner_names(self) -> list[str]:
        return [f"learner-{i}" for i in range(self.scenario.learners)]

    # ------------------------------------------------------------------------------ start-up

    def _start_cluster(self) -> None:
        sc, cl = self.scenario, self.cluster
        if sc.store:
            store = cl.add("checkpoint", "services.checkpoint", [
                "--bind", "127.0.0.1:0", "--root", str(cl.workdir / "store"), "--ready-file",
                str(cl.workdir / "checkpoint.ready.json"), "--keep-latest", "100000", "--grace-s", "2",
            ])
            store.start(["--failpoints", sc.store_failpoints] if sc.store_failpoints else [])
            store.wait_ready(60)
            self.procs["checkpoint"] = _Proc()
        args = self._syncer_args("syncer")
        if sc.store:
            args += ["--checkpoint-target", cl.services["checkpoint"].address]
        # The syncer's port is chosen here so that the proxies and learners can start while it
        # boots (they retry joining): the JAX imports of all of them overlap.
        port = _free_port()
        args[args.index("--bind") + 1] = f"127.0.0.1:{port}"
        syncer = cl.add("syncer", "services.syncer", [*args, *sc.syncer_args])
        syncer.address = f"127.0.0.1:{port}"
        syncer.start(["--failpoints", sc.syncer_failpoints] if sc.syncer_failpoints else [])
        self.procs["syncer"] = _Proc()
        self._start_learners([port])
        syncer.wait_ready(120)
        self._tail = _HistoryTail(self._history_path("syncer"))
        self._poller = _Poller(syncer.address)
        self._poller.start()

    def _syncer_args(self, name: str) -> list[str]:
        """The flags of a syncer named `name` (no store target); every syncer writes the one
        history `syncer.jsonl` (one write(2) per record, O_APPEND: lines never interleave)."""
        sc, cl = self.scenario, self.cluster
        args = [
            "--bind", "127.0.0.1:0", "--run-id", self.run_id, "--ready-file", str(cl.workdir / f"{name}.ready.json"),
            "--model-config", sc.model_config, "--num-fragments", str(sc.num_fragments),
            "--sync-period-steps", str(sc.sync_period_steps), "--min-quorum", str(sc.min_quorum),
            *timeout_args(sc),
            "--checkpoint-every-merges", str(sc.checkpoint_every_merges), "--checkpoint-timeout-s", "5",
            "--restore-timeout-s", "30", "--grace-s", "2", "--seed", str(sc.seed),
            "--history-file", str(self._history_path("syncer")),
        ]
        if sc.chunk_size_bytes:
            args += ["--chunk-size-bytes", str(sc.chunk_size_bytes)]
        return args

    def _start_learners(self, syncer_ports: Sequence[int]) -> None:
        """Starts the learners, each given every syncer (through a FaultProxy per syncer when the
        scenario has proxies: a link fault acts on all of a learner's links at once)."""
        sc, cl = self.scenario, self.cluster
        learner_failpoints = dict(sc.learner_failpoints)
        for i, name in enumerate(self.learner_names()):
            targets = [f"127.0.0.1:{port}" for port in syncer_ports]
            if sc.proxy:
                proxies = [FaultProxy("127.0.0.1", "127.0.0.1", int(port), name=name, seed=sc.seed * 1000 + i + 100 * j)
                           for j, port in enumerate(syncer_ports)]
                for proxy in proxies:
                    proxy.start_in_thread()
                self.proxies[name] = proxies[0] if len(proxies) == 1 else ProxyGroup(proxies)
                targets = [proxy.address for proxy in proxies]
            svc = cl.add(name, "services.learner", [
                "--syncer", ",".join(targets), "--learner-id", name, "--region", f"r{i % 2}", "--num-shards", str(sc.learners),
                "--seed", str(sc.seed), "--max-corpus-bytes", str(sc.max_corpus_bytes),
                "--step-delay-s", str(sc.step_delay_s), "--log-every-steps", "50",
                "--call-timeout-s", str(sc.call_timeout_s), "--retry-bound-s", str(sc.retry_bound_s),
                "--summary-file", str(self._summary_path(name)), "--history-file", str(self._history_path(name)),
                "--health-bind", "127.0.0.1:0",  # many learners on this host: a free port each
                # With the cache, uploads are quantized by jax_codec (same bytes): a restart then
                # never loads numba (~0.5 CPU-s less per kill, see services/learner/config.py).
                *(["--compilation-cache-dir", str(self.workdir / "jax-cache"), "--upload-encoder", "jax"]
                  if sc.compilation_cache else []),
                *sc.learner_args,
            ])
            extra = ["--steps", str(sc.steps)]
            if name in learner_failpoints:
                extra += ["--failpoints", learner_failpoints[name]]
            svc.start(extra)
            self.procs[name] = _Proc()

    # ------------------------------------------------------------------------------ actions

    def _later(self, delay_s: float, what: str, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._actions, (time.time() + max(delay_s, 0.0), self._seq, what, fn))

    def _emit(self, text: str) -> None:
        self._on_event(f"[{time.time() - self.t0:7.2f}s] {text}" if self.t0 else f"[warm-up] {text}")

    def _restart(self, name: str, fault: InjectedFault | None, failpoints: str = "") -> None:
        svc, proc = self.cluster.services[name], self.procs[name]
        if proc.state == "finished":  # the run is ending (stragglers stopped): not restarted
            return
        extra: list[str] = ["--failpoints", failpoints] if failpoints else []
        if name.startswith("learner-"):
            # The steps its earlier lives did not run; at least one, so that its last life always
            # re-syncs and exits cleanly with a summary (I3).
            remaining = max(self.scenario.steps - self._poller.steps_done(name), 1)
            extra += ["--steps", str(remaining)]
        svc.start(extra)
        proc.state = "up"
        proc.fault = None
        if fault is not None:
            fault.healed_at = time.time()
        self._emit(f"{name} restarted (pid {svc.pid}{', ' + ' '.join(extra) if extra else ''})")

    def _inject(self, ev: schedule_lib.FaultEvent, phase: int = 0) -> None:
        before = len(self.faults)
        self._inject_one(ev)
        self._phase_faults.setdefault(phase, []).extend(self.faults[before:])

    def _inject_one(self, ev: schedule_lib.FaultEvent) -> None:
        name, proc = ev.target, self.procs.get(ev.target)
        if proc is None:
            self.not_injected.append(ev)
            self._emit(f"skipped {ev.describe()}: no such service in this scenario")
            return
        if ev.kind in schedule_lib.PROCESS_KINDS:
            svc = self.cluster.services[name]
            if proc.state != "up" or not svc.alive():
                self.not_injected.append(ev)
                self._emit(f"skipped {ev.describe()}: {name} is {proc.state}")
                return
            fault = InjectedFault(ev.kind, name, time.time(), detail=f"pid {svc.pid}")
            self.faults.append(fault)
            proc.fault = fault
            if ev.kind == "kill":
                svc.signal(signal.SIGKILL)
                svc.wait(10)
                proc.state = "down"
                delay = float(ev.params.get("restart_after_s", 1.0))
                armed = str(ev.params.get("failpoints", ""))
                if delay >= 0:
                    self._later(delay, f"restart {name}", lambda: self._restart(name, fault, armed))
                if self.scenario.kill_scope == "job" and name.startswith("learner-"):
                    fault.detail += f"; job restart: {self._kill_job(delay)} other learners killed"
            elif ev.kind == "term":
                svc.signal(signal.SIGTERM)
                proc.state, proc.term_at = "terming", time.time()
                proc.restart_after_s = float(ev.params.get("restart_after_s", 1.0))
                proc.restart_failpoints = str(ev.params.get("failpoints", ""))
            else:  # stop
                svc.signal(signal.SIGSTOP)
                proc.state = "stopped"

                def cont(svc=svc, proc=proc, fault=fault) -> None:
                    svc.signal(signal.SIGCONT)
                    if proc.state == "stopped":
                        proc.state = "up"
                    fault.healed_at = time.time()
                    self._emit(f"SIGCONT {name}")

                self._later(float(ev.params.get("duration_s", 2.0)), f"SIGCONT {name}", cont)
            self._emit(f"injected {ev.describe()}")
            return
        proxy = self.proxies.get(name)
        if proxy is None:
            self.not_injected.append(ev)
            self._emit(f"skipped {ev.describe()}: no proxy in front of the syncer for {name}")
            return
        fault = InjectedFault(ev.kind, name, time.time())
        self.faults.append(fault)
        p = ev.params
        toxics = {
            "partition": {"partition": True},
            "blackhole": {"blackhole": True},
            "latency": {"latency_s": float(p.get("latency_s", 0.2)), "jitter_s": float(p.get("jitter_s", 0.0))},
            "bandwidth": {"bandwidth_bytes_per_s": float(p.get("bytes_per_s", 1e6))},
            "limit_data": {"reset_after_bytes": int(p.get("bytes", 10_000))},
            "flap": {"flap_down_s": float(p.get("down_s", 1.0)), "flap_up_s": float(p.get("up_s", 2.0))},
        }.get(ev.kind)
        if toxics is None:  # reset: one-shot
            fault.detail = f"{proxy.reset_peer()} connections reset"
            fault.healed_at = time.time()
        else:
            proxy.set(**toxics)
            cleared = {k: getattr(Toxics(), k) for k in toxics}  # back to the defaults

            def heal(proxy=proxy, cleared=cleared, fault=fault) -> None:
                proxy.set(**cleared)
                fault.healed_at = time.time()
                self._emit(f"healed {fault.kind} {fault.target}")

            self._later(float(p.get("duration_s", 2.0)), f"heal {ev.kind} {name}", heal)
        self._emit(f"injected {ev.describe()}")

    def _kill_job(self, delay_s: float) -> int:
        """SIGKILL every other running (or hung) learner and restart each after delay_s: a job restart."""
        killed = 0
        for name, proc in self.procs.items():
            svc = self.cluster.services[name]
            if not name.startswith("learner-") or proc.state not in ("up", "stopped") or not svc.alive():
                continue
            svc.signal(signal.SIGKILL)
            svc.wait(10)
            proc.state = "down"
            killed += 1
            if delay_s >= 0:
                self._later(delay_s, f"restart {name}", lambda n=name: self._restart(n, None))
        return killed

    def _supervise(self) -> None:
        for name, proc in self.procs.items():
            svc = self.cluster.services[name]
            if svc.alive() or proc.state in ("down", "finished"):
                continue
            code = svc.proc.returncode if svc.proc else None
            if proc.state == "terming" and proc.final:
                self._read_summary(name)
                proc.state = "finished"
                self.finished_at[name] = time.time()
                self._emit(f"{name} stopped at the end of the run (exit {code})")
                continue
            if proc.state == "terming":
                fault = proc.fault
                if fault is not None:
                    fault.detail = f"exited {code} after {time.time() - proc.term_at:.1f} s"
                self._read_summary(name)
                proc.state = "down"
                if proc.restart_after_s >= 0:
                    self._later(proc.restart_after_s, f"restart {name}",
                                lambda n=name, f=fault, fp=proc.restart_failpoints: self._restart(n, f, fp))
                continue
            if name.startswith("learner-") and code == 0:
                proc.state = "finished"
                self.finished_at[name] = time.time()
                self._read_summary(name)
                self._emit(f"{name} finished its steps")
                continue
            # Died on its own: a failpoint (137) or a crash. Restart it, without its failpoints.
            fault = InjectedFault("crash", name, time.time(), detail=f"exit {code}", scheduled=False)
            if code == 137:
                fault.detail += " (failpoint)"
            self.faults.append(fault)
            proc.state, proc.fault = "down", fault
            self._emit(f"{name} exited on its own with {code}: restarting in {self.scenario.restart_delay_s} s")
            self._later(self.scenario.restart_delay_s, f"restart {name}", lambda n=name, f=fault: self._restart(n, f))

    def _read_summary(self, name: str) -> None:
        """After a learner exited 0 (finished, or SIGTERMed): its life's exact steps and held hashes."""
        try:
            summary = json.loads(self._summary_path(name).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return
        self._summaries[name] = summary
        self._poller.record_summary(summary)

    # ------------------------------------------------------------------------------ the run

    def run(self) -> Result:
        started = time.time()
        self.schedule.save(self.workdir / "faults.jsonl")
        error = ""
        final_state: dict = {}
        checkpoints: list = []
        loss = None
        try:
            self._start_cluster()
            error = self._drive(started)
            final_state = self._finish()
            checkpoints, last_snapshot = self._load_checkpoints()
            if self.evaluate and last_snapshot is not None and final_state.get("config") is not None:
                loss = heldout_loss(last_snapshot, final_state["config"], max_corpus_bytes=self.scenario.max_corpus_bytes,
                                    num_shards=self.scenario.learners)
        except Exception as exc:  # noqa: BLE001 - a broken run is reported, never hangs the caller
            _LOG.exception("chaos run failed")
            error = error or f"{type(exc).__name__}: {exc}"
        finally:
            self._cleanup()
        return self._result(started, error, final_state, checkpoints, loss)

    def _end_stragglers(self, now: float) -> None:
        """finish_grace_s after the first learner finished, SIGTERM the ones still training."""
        if not self._first_finish:
            if any(self.procs[n].state == "finished" for n in self.learner_names()):
                self._first_finish = now
            return
        if now - self._first_finish < self.scenario.finish_grace_s:
            return
        for name in self.learner_names():
            proc = self.procs[name]
            if proc.state in ("finished",) or proc.final:
                continue
            svc = self.cluster.services[name]
            if not svc.alive():
                proc.state = "finished"
                continue
            svc.signal(signal.SIGCONT)
            svc.signal(signal.SIGTERM)
            proc.state, proc.term_at, proc.final, proc.restart_after_s = "terming", now, True, -1.0
            self._emit(f"{name} still training {self.scenario.finish_grace_s:.0f} s after the first learner "
                       "finished: SIGTERM")

    def _phases_settled(self, phase: int, now: float, pending: list) -> bool:
        """Phases (events gated on at_merge N > 0) run one after the other: phase N starts once
        every event of the earlier phases was injected, and every fault they made healed and its
        component recovered (or 20 s passed). Without the first condition, two phases whose merge
        counts were both reached started together (a learner kill and a syncer restart at once)."""
        if phase <= 0:
            return True
        if any(not ev.at_step and 0 < ev.at_merge < phase for ev in pending):
            return False
        return all(f.healed_at is not None and now >= f.healed_at + 1.0
                   and (self._tail.recovered(f) or now >= f.healed_at + 20.0)
                   for p, faults in self._phase_faults.items() if p < phase for f in faults)

    def _drive(self, started: float) -> str:
        sc = self.scenario
        pending = list(self.schedule.events)
        reached: dict[int, float] = {}  # merges count -> when the history first held that many
        step_reached: dict[int, float] = {}  # id(at_step event) -> when its learner reached the step
        warm_deadline = time.time() + sc.warmup_timeout_s
        while True:
            now = time.time()
            self._tail.poll()
            if not self.t0:
                if self._tail.learners_merged >= set(self.learner_names()):
                    self.t0 = now
                    self._emit(f"every learner contributed ({self._tail.merges} merges): schedule starts")
                elif now > warm_deadline:
                    return f"warm-up: not every learner contributed within {sc.warmup_timeout_s:.0f} s"
            if self.t0:
                for n in sorted({ev.at_merge for ev in pending if not ev.at_step}):
                    if n not in reached and self._tail.merges >= n and self._phases_settled(n, now, pending):
                        reached[n] = max(now, self.t0)
                for ev in pending:  # step-gated: the target learner's own progress (all its lives)
                    if ev.at_step and id(ev) not in step_reached and self._poller.steps_done(ev.target) >= ev.at_step:
                        step_reached[id(ev)] = now
                due = [ev for ev in pending if (now >= step_reached[id(ev)] + ev.t if ev.at_step and id(ev) in step_reached
                                                else not ev.at_step and ev.at_merge in reached
                                                and now >= reached[ev.at_merge] + ev.t)]
                for ev in due:
                    pending.remove(ev)
                    injected = len(self.faults)
                    self._inject(ev, phase=ev.at_merge)
                    if ev.at_step:  # where the training really was (the poller lags a little)
                        for fault in self.faults[injected:]:
                            fault.detail += f" at step {self._poller.steps_done(ev.target)}"
            while self._actions and self._actions[0][0] <= now:
                _, _, _, fn = heapq.heappop(self._actions)
                fn()
            self._supervise()
            if now >= self._next_proxy_sample:
                self._next_proxy_sample = now + 0.5
                for name, proxy in self.proxies.items():
                    st = proxy.stats
                    self.proxy_samples.setdefault(name, []).append((now, st.bytes_up, st.bytes_down, st.connections))
            if all(self.procs[n].state == "finished" for n in self.learner_names()):
                self.training_end = self.stopped_at = now
                break
            self._end_stragglers(now)
            for name, proc in self.procs.items():  # a SIGTERMed process that hangs is killed
                if proc.state == "terming" and now - proc.term_at > 30:
                    self.cluster.services[name].signal(signal.SIGKILL)
            if now - started > sc.max_wall_s:
                self.stopped_at = now
                return f"timed out after {sc.max_wall_s:.0f} s (learners not finished)"
            time.sleep(0.05)
        self.not_injected += pending
        if pending:
            self._emit(f"training ended before {len(pending)} scheduled faults")
        return ""

    def _finish(self) -> dict:
        """Heals everything, reads the final state, stops the syncer gracefully."""
        while self._actions:  # pending heals and restarts, now
            _, _, _, fn = heapq.heappop(self._actions)
            fn()
        for name in ("checkpoint", "syncer"):
            if name not in self.procs:
                continue
            svc = self.cluster.services[name]
            svc.signal(signal.SIGCONT)
            if not svc.alive():
                svc.start()
            svc.wait_ready(120)
        from google.protobuf import json_format

        deadline = time.time() + 30
        while True:
            try:
                state = self._poller.state(5.0)
                break
            except Exception:  # noqa: BLE001 - a restarting syncer
                if time.time() > deadline:
                    raise
                time.sleep(0.5)
        final = json_format.MessageToDict(state, preserving_proto_field_name=True)
        final["config"] = state.config
        syncer = self.cluster.services["syncer"]
        self.procs["syncer"].state = "finished"
        code = syncer.stop(30)
        self._emit(f"syncer stopped with {code}")
        return final

    def _load_checkpoints(self) -> tuple[list, dict | None]:
        if "checkpoint" not in self.procs:
            return [], None
        loaded = load_checkpoints(self.cluster.services["checkpoint"].address, self.run_id)
        last = next((snap for _, snap in reversed(loaded) if not isinstance(snap, Exception)), None)
        return loaded, last

    def _cleanup(self) -> None:
        try:
            if self._poller is not None:
                self._poller.stop()
        except Exception:  # noqa: BLE001 - never skip stopping the processes below
            _LOG.exception("stopping the poller")
        for proxy in self.proxies.values():
            try:
                proxy.close()
            except Exception:  # noqa: BLE001 - best effort
                pass
        for svc in self.cluster.services.values():
            svc.signal(signal.SIGCONT)
        self.cluster.stop_all(timeout_s=10.0)

    # ------------------------------------------------------------------------------ results

    def _result(self, started: float, error: str, final_state: dict, checkpoints: list, loss: float | None) -> Result:
        syncer_history = history_lib.read(self._history_path("syncer"))
        learner_histories = {n: history_lib.read(self._history_path(n)) for n in self.learner_names()}
        summaries = {n: self._summaries.get(n) for n in self.learner_names()}
        checks = [
            invariants.check_uploads(syncer_history, learner_histories),
            invariants.check_versions(syncer_history),
            invariants.check_learner_hashes(syncer_history, summaries),
            invariants.check_checkpoints(syncer_history, checkpoints),
            invariants.check_loss(loss, self.baseline_loss, self.scenario.loss_margin),
        ]
        _recoveries(self.faults, syncer_history)
        work_merged = None
        processed = self._poller.tokens_processed() if self._poller else 0
        if processed:
            rolled = invariants.rolled_back_merges(invariants.syncer_lives(syncer_history))
            merged_tokens = sum(
                c[3] for r in syncer_history if r["event"] == "merged"
                and (r["instance"], int(r["fragment"]), int(r["version"])) not in rolled for c in r["contributors"])
            starts = [r for r in syncer_history if r["event"] == "start"]
            fragments = len(starts[-1]["fragments"]) if starts else self.scenario.num_fragments  # dp: 1
            work_merged = merged_tokens / (fragments * processed)
        final_state.pop("config", None)
        result = Result(
            scenario=self.scenario, workdir=self.workdir, faults=self.faults, not_injected=self.not_injected,
            checks=checks, work_merged=work_merged, loss=loss, baseline_loss=self.baseline_loss,
            wall_s=time.time() - started, t0=self.t0, training_end=self.training_end,
            learner_finished_at=dict(self.finished_at), stopped_at=self.stopped_at, syncer_history=syncer_history,
            learner_histories=learner_histories, summaries=summaries, final_state=final_state,
            proxy_stats={n: dataclasses.asdict(p.stats) for n, p in self.proxies.items()},
            proxy_samples=self.proxy_samples, member_samples=self._poller.samples if self._poller else [], error=error,
        )
        (self.workdir / "report.json").write_text(json.dumps(result.to_json(), indent=2, default=str))
        (self.workdir / "report.txt").write_text(result.report_line + "\n")
        return result


def _free_port() -> int:
    """A free port on 127.0.0.1 for a service that must have a known address before it is up.

    Taken below the kernel's ephemeral range: a port from bind(0) is ephemeral, so any outgoing
    connection on the machine may take it in the seconds before the service binds it (a goodput
    run's syncer failed to start so: 'Failed to bind to address', beside another run)."""
    low = _EPHEMERAL_LOW
    with contextlib.suppress(OSError, ValueError, IndexError):
        low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12_000), low) if low > 2048 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free port on 127.0.0.1 below {low}")


_EPHEMERAL_LOW = 32768  # Linux's default start of ip_local_port_range


def _recoveries(faults: Sequence[InjectedFault], syncer_history: Sequence[dict]) -> None:
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


def heldout_loss(snapshot: dict, run_config, *, max_corpus_bytes: int, num_shards: int, heldout_fraction: float = 0.05,
                 data_dir: str = "", batches: int = 8, batch_size: int = 16) -> float:
    """The held-out loss of a checkpoint's global parameters (the evaluator's computation, in process)."""
    import jax
    import numpy as np

    from ddiloco import models
    from ddiloco.algo import fragments as fragments_lib
    from ddiloco.data import corpus
    from ddiloco.wire import serde

    model = models.get_model(run_config.model_name, json.loads(run_config.model_config_json))
    plan = serde.plan_from_proto(run_config.fragments, run_config.sync_period_steps)
    by_id = {int(f["fragment_id"]): np.asarray(f["params"], dtype=np.float32) for f in snapshot["fragments"]}
    params = {}
    for frag in plan.fragments:
        params.update(fragments_lib.unflatten_fragment(by_id[frag.fragment_id], frag))
    split = corpus.load_split(data_dir, max_corpus_bytes, num_shards, heldout_fraction)
    held = corpus.heldout_batches(split.heldout, batch_size, model.seq_len, batches)
    key = (run_config.model_name, run_config.model_config_json)
    if key not in _LOSS_FNS:  # one compilation per model in this process
        _LOSS_FNS[key] = jax.jit(model.loss)
    loss_fn = _LOSS_FNS[key]
    return float(sum(float(loss_fn(params, b)) for b in held) / len(held))


_LOSS_FNS: dict = {}


def run_scenario(scenario: Scenario, schedule, workdir, **kwargs) -> Result:
    """Convenience: Harness(...).run(), or the hub's HubHarness for a `hub` scenario."""
    if scenario.hub:
        from ddiloco.chaos import hub  # it builds on this module

        return hub.HubHarness(scenario, schedule, workdir, **kwargs).run()
    return Harness(scenario, schedule, workdir, **kwargs).run()


def load_checkpoints(address: str, run_id: str) -> list[tuple[int, dict | Exception]]:
    """Every checkpoint of `run_id` the store at `address` retains, oldest first, as (step,
    decoded snapshot), or (step, the exception) when one does not load (I4 reports it)."""
    from ddiloco import checkpoint_client
    from ddiloco.rpc import channel as channel_lib
    from ddiloco.cli import service_names

    checkpointing = service_names.load("services.syncer.checkpointing")  # the checkpoint layout is the syncer's

    async def load():
        channel = channel_lib.aio_channel(address)
        try:
            client = checkpoint_client.CheckpointClient(
                channel, timeout=datetime.timedelta(seconds=10), retry_timeout=datetime.timedelta(seconds=20))
            out = []
            for manifest in await client.list_manifests(run_id):
                try:
                    blobs = {ref.name: await client.get_blob(ref.digest) for ref in manifest.blobs}
                    out.append((manifest.step, checkpointing.decode_snapshot(blobs)))
                except Exception as exc:  # noqa: BLE001 - reported by I4
                    out.append((manifest.step, exc))
            return out
        finally:
            await channel.close()

    return asyncio.run(load())
