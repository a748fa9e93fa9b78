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

The parts: `config` (Scenario), `actions` (injection, restarts, supervision), `observe` (history
tail, state poller), `checkpoints` (what the store kept, the held-out loss), `report` (Result and
its line); this module runs them in order and re-exports their public names.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import logging
import os
import pathlib
import shutil
import signal
import time
from collections.abc import Callable, Sequence

from ddiloco import history as history_lib
from ddiloco.chaos import invariants
from ddiloco.chaos import schedule as schedule_lib
from ddiloco.chaos.actions import FaultActions, ProcessState
from ddiloco.chaos.checkpoints import heldout_loss, load_checkpoints
from ddiloco.chaos.config import Scenario, timeout_args  # noqa: F401 (timeout_args: re-exported)
from ddiloco.chaos.observe import HistoryTail, Poller
from ddiloco.chaos.proxy import FaultProxy, ProxyGroup
from ddiloco.chaos.report import InjectedFault, Result, mark_recoveries, work_merged
from ddiloco.cli import cluster as cluster_lib
from ddiloco.cli import processes

_LOG = logging.getLogger("ddiloco.chaos")


class Harness(FaultActions):
    """One scenario run. See the module docstring; `run()` returns a Result (never raises for a
    failed invariant; raises only for a broken set-up)."""

    def __init__(self, scenario: Scenario, schedule: schedule_lib.FaultSchedule | Sequence[schedule_lib.FaultEvent],
                 workdir: str | os.PathLike, *, baseline_loss: float | None = None, evaluate: bool = True,
                 env: dict | None = None, jax_cache_dir: str | os.PathLike | None = None,
                 on_event: Callable[[str], None] | None = None) -> None:
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
        self.procs: dict[str, ProcessState] = {}
        self.faults: list[InjectedFault] = []
        self.not_injected: list[schedule_lib.FaultEvent] = []
        self._actions: list = []  # heap of (due unix s, seq, description, fn)
        self._seq = 0
        self._on_event = on_event or (lambda line: _LOG.info(line))
        self.t0 = 0.0
        self._tail: HistoryTail | None = None
        self._poller: Poller | None = None
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
            self.procs["checkpoint"] = ProcessState()
        args = self._syncer_args("syncer")
        if sc.store:
            args += ["--checkpoint-target", cl.services["checkpoint"].address]
        # The syncer's port is chosen here so that the proxies and learners can start while it
        # boots (they retry joining): the JAX imports of all of them overlap.
        port = processes.preset_port()
        args[args.index("--bind") + 1] = f"127.0.0.1:{port}"
        syncer = cl.add("syncer", "services.syncer", [*args, *sc.syncer_args])
        syncer.address = f"127.0.0.1:{port}"
        syncer.start(["--failpoints", sc.syncer_failpoints] if sc.syncer_failpoints else [])
        self.procs["syncer"] = ProcessState()
        self._start_learners([port])
        syncer.wait_ready(120)
        self._tail = HistoryTail(self._history_path("syncer"))
        self._poller = Poller(syncer.address)
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
            self.procs[name] = ProcessState()

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

    def _load_checkpoints(self) -> tuple[list, object | None]:
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
            invariants.check_quarantines(final_state.get("members", []),
                                         dict(self._poller.quarantined) if self._poller else {}),
        ]
        mark_recoveries(self.faults, syncer_history)
        processed = self._poller.tokens_processed() if self._poller else 0
        merged = work_merged(syncer_history, processed, self.scenario.num_fragments)
        final_state.pop("config", None)
        result = Result(
            scenario=self.scenario, workdir=self.workdir, faults=self.faults, not_injected=self.not_injected,
            checks=checks, work_merged=merged, loss=loss, baseline_loss=self.baseline_loss,
            wall_s=time.time() - started, t0=self.t0, training_end=self.training_end,
            learner_finished_at=dict(self.finished_at), stopped_at=self.stopped_at, syncer_history=syncer_history,
            learner_histories=learner_histories, summaries=summaries, final_state=final_state,
            proxy_stats={n: dataclasses.asdict(p.stats) for n, p in self.proxies.items()},
            proxy_samples=self.proxy_samples, member_samples=self._poller.samples if self._poller else [], error=error,
        )
        (self.workdir / "report.json").write_text(json.dumps(result.to_json(), indent=2, default=str))
        (self.workdir / "report.txt").write_text(result.report_line + "\n")
        return result


def run_scenario(scenario: Scenario, schedule, workdir, **kwargs) -> Result:
    """Convenience: Harness(...).run(), or the hub's HubHarness for a `hub` scenario."""
    if scenario.hub:
        from ddiloco.chaos import hub  # it builds on this module

        return hub.HubHarness(scenario, schedule, workdir, **kwargs).run()
    return Harness(scenario, schedule, workdir, **kwargs).run()
