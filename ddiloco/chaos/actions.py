"""What the chaos harness does to processes and links: inject a scheduled fault (signals with
restarts, proxy toxics with heals), restart a process that died on its own, and stop the learners
still training at the end. `FaultActions` is the part of `Harness` (ddiloco/chaos/harness.py)
that owns them; the harness drives it from its loop."""

from __future__ import annotations

import dataclasses
import heapq
import json
import pathlib
import signal
import time
from collections.abc import Callable

from ddiloco.chaos import schedule as schedule_lib
from ddiloco.chaos.config import Scenario
from ddiloco.chaos.observe import Poller
from ddiloco.chaos.proxy import FaultProxy, Toxics
from ddiloco.chaos.report import InjectedFault
from ddiloco.cli import cluster as cluster_lib


@dataclasses.dataclass
class ProcessState:
    """The harness's view of one service process."""

    state: str = "up"  # up | down (killed, restart pending) | stopped | terming | finished
    restart_after_s: float = -1.0  # terming: restart this long after it exits (< 0: never)
    restart_failpoints: str = ""  # terming: failpoints armed in the restarted life
    final: bool = False  # terming at the end of the run: done once it exits
    fault: InjectedFault | None = None  # the fault it is currently under
    term_at: float = 0.0


class FaultActions:
    """Injection, restarts and supervision of a run's processes; mixed into `Harness`, which sets
    the state below up and calls `_inject`, `_supervise` and `_end_stragglers` from its loop."""

    scenario: Scenario
    cluster: cluster_lib.LocalCluster
    procs: dict[str, ProcessState]
    proxies: dict[str, FaultProxy]
    faults: list[InjectedFault]
    not_injected: list[schedule_lib.FaultEvent]
    finished_at: dict[str, float]
    t0: float
    _actions: list  # heap of (due unix s, seq, description, fn)
    _seq: int
    _on_event: Callable[[str], None]
    _poller: Poller | None
    _summaries: dict[str, dict | None]
    _phase_faults: dict[int, list[InjectedFault]]
    _first_finish: float

    def learner_names(self) -> list[str]:
        return [f"learner-{i}" for i in range(self.scenario.learners)]

    def _summary_path(self, name: str) -> pathlib.Path:
        return self.cluster.workdir / f"{name}.summary.json"

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
                svc.kill(10)
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
            svc.kill(10)
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
