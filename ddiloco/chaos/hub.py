"""The hub region under fire (issue 23): the chaos harness with two elected syncers, two
replicated checkpoint stores and a three-member etcd, for the `hub-soak` scenario.

What it adds to `Harness` (ddiloco/chaos/harness.py), everything on 127.0.0.1, signalled by PID:
- a local 3-member etcd cluster (`etcd.EtcdMember`, the binary from scripts/etcd_env.sh); members
  `etcd-0..2` are fault targets like any service (kill restarts a member on its own data
  directory: it rejoins the cluster). With `Scenario.hub_tls` it runs as
  docker-compose.failover-tls.yml runs etcd: clients over https with client certificates, peers
  over https with peer certificates (a restarted member rejoins over peer TLS), all of etcd's own
  CA (`ddiloco certs --etcd-names`, in <cluster>/etcd-pki), the syncers with --coord-tls-*;
- stores `store-a`, `store-b` (each its own directory; the fault `wipe` deletes it);
- syncers `syncer-a`, `syncer-b`, both with `--coord-etcd` and both stores, writing the one
  `syncer.jsonl` history (a syncer's life starts there when it leads); a deposed leader exits 4 and
  the supervisor restarts it as a standby (an unscheduled `crash` in the report);
- learners given both syncers, each through its own FaultProxy, so a link fault cuts a learner off
  from both. A standby redirects a learner to the leader's own address, which bypasses the proxy
  until that session fails (then the learner rotates through its list again).
At the end: every service back up, the standby stopped, then the leader (final checkpoint);
one repair pass over both stores, then every checkpoint is loaded from each store (I4 per store),
and learners' folded-in versions are checked against leader epochs (I6).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import pathlib
import shutil
import signal
import time
from collections.abc import Sequence

import grpc

from ddiloco.chaos import etcd as etcd_lib
from ddiloco.chaos import invariants
from ddiloco.chaos import schedule as schedule_lib
from ddiloco.chaos.actions import ProcessState
from ddiloco.chaos.checkpoints import load_checkpoints
from ddiloco.chaos.harness import Harness
from ddiloco.chaos.observe import HistoryTail, Poller
from ddiloco.chaos.report import InjectedFault, Result
from ddiloco.cli import processes
from ddiloco import checkpoint_client
from ddiloco import checkpoint_replicas as replicas_lib
from ddiloco import history as history_lib
from ddiloco.rpc import channel as channel_lib
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc

SYNCERS = ("syncer-a", "syncer-b")
STORES = ("store-a", "store-b")
ETCD_MEMBERS = ("etcd-0", "etcd-1", "etcd-2")
_LEADER_WAIT_S = 60.0


class _HubPoller(Poller):
    """Polls every syncer; members are taken from whichever answers (only the leader lists them)."""

    def __init__(self, addresses: Sequence[str], interval_s: float = 0.5) -> None:
        super().__init__(addresses[0], interval_s)
        self._channels = [self._channel] + [channel_lib.sync_channel(a) for a in addresses[1:]]
        self._stubs = [self._stub] + [syncer_pb2_grpc.SyncerStub(ch) for ch in self._channels[1:]]
        self.addresses = list(addresses)
        self.leader_address = ""

    def state(self, timeout_s: float = 3.0):
        """The leader's training state (epoch > 0); the last answer, or the last error, otherwise."""
        answer, error = None, None
        for address, stub in zip(self.addresses, self._stubs):
            try:
                st = stub.GetTrainingState(syncer_pb2.GetTrainingStateRequest(recent_merges=0), timeout=timeout_s).state
            except grpc.RpcError as exc:
                error = exc
                continue
            answer = st
            if st.epoch > 0:
                self.leader_address = address
                return st
        if answer is None:
            raise error
        return answer

    def stop(self) -> None:
        super().stop()
        for ch in self._channels[1:]:
            ch.close()


class HubHarness(Harness):
    """A `hub` scenario's run; see the module docstring."""

    def _store_root(self, name: str) -> pathlib.Path:
        return self.cluster.workdir / name

    def _start_cluster(self) -> None:
        sc, cl = self.scenario, self.cluster
        binary = etcd_lib.etcd_binary()
        tls, peer_tls, coord_tls = self._etcd_tls()
        ports = {name: (processes.preset_port(), processes.preset_port()) for name in ETCD_MEMBERS}
        initial = ",".join(f"{n}={etcd_lib.peer_url(peer, peer_tls)}" for n, (_, peer) in ports.items())
        for name, (client, peer) in ports.items():  # all at once: the first needs a quorum to be healthy
            member = etcd_lib.EtcdMember(name, binary, cl.workdir, client, peer, initial, tls=tls, peer_tls=peer_tls)
            cl.services[name] = member
            member.start()
            self.procs[name] = ProcessState()
        for name in ETCD_MEMBERS:
            cl.services[name].wait_ready(60)
        for name in STORES:
            store = cl.add(name, "services.checkpoint", [
                "--bind", "127.0.0.1:0", "--root", str(self._store_root(name)), "--ready-file",
                str(cl.workdir / f"{name}.ready.json"), "--keep-latest", "100000", "--grace-s", "2"])
            store.start()
            self.procs[name] = ProcessState()
        for name in STORES:
            cl.services[name].wait_ready(60)
        stores = ",".join(cl.services[n].address for n in STORES)
        endpoints = ",".join(("https://" if tls else "") + cl.services[n].address for n in ETCD_MEMBERS)
        syncer_ports = []
        for name in SYNCERS:
            port = processes.preset_port()
            args = self._syncer_args(name)
            args[args.index("--bind") + 1] = f"127.0.0.1:{port}"
            svc = cl.add(name, "services.syncer", [*args, "--checkpoint-target", stores, "--coord-etcd", endpoints,
                                                   *coord_tls, "--coord-advertise", f"127.0.0.1:{port}",
                                                   *sc.syncer_args])
            svc.address = f"127.0.0.1:{port}"
            svc.start()
            self.procs[name] = ProcessState()
            syncer_ports.append(port)
        self._start_learners(syncer_ports)
        for name in SYNCERS:
            cl.services[name].wait_ready(120)
        self._tail = HistoryTail(self._history_path("syncer"))
        self._poller = _HubPoller([cl.services[n].address for n in SYNCERS])
        self._poller.start()

    def _etcd_tls(self) -> tuple[etcd_lib.ServerTLS | None, etcd_lib.PeerTLS | None, list[str]]:
        """The members' client and peer TLS and the syncers' --coord-tls-* flags (Scenario.hub_tls);
        None, None, [] for plain HTTP."""
        if not self.scenario.hub_tls:
            return None, None, []
        from ddiloco.cli import certs

        pki = self.cluster.workdir / "etcd-pki"
        certs.write_etcd_certs(pki, names=["localhost"])
        tls, peer_tls = etcd_lib.pki_tls(pki)
        return tls, peer_tls, ["--coord-tls-ca", tls.ca_file, "--coord-tls-cert", tls.probe_cert_file,
                               "--coord-tls-key", tls.probe_key_file]

    def _inject_one(self, ev: schedule_lib.FaultEvent) -> None:
        if ev.kind == "region":
            return self._kill_region(ev)
        if ev.kind != "wipe":
            return super()._inject_one(ev)
        name, proc = ev.target, self.procs.get(ev.target)
        svc = self.cluster.services.get(name)
        if proc is None or svc is None or proc.state != "up" or not svc.alive():
            self.not_injected.append(ev)
            self._emit(f"skipped {ev.describe()}: {name} is {proc.state if proc else 'absent'}")
            return
        fault = InjectedFault("wipe", name, time.time(), detail=f"pid {svc.pid}")
        self.faults.append(fault)
        proc.fault = fault
        svc.kill(10)
        shutil.rmtree(self._store_root(name), ignore_errors=True)  # the whole disk: blobs and manifests
        proc.state = "down"
        delay = float(ev.params.get("restart_after_s", 1.0))
        self._later(delay, f"restart {name}", lambda: self._restart(name, fault))
        self._emit(f"injected {ev.describe()}")

    def _kill_region(self, ev: schedule_lib.FaultEvent) -> None:
        """SIGKILLs the leading syncer's region: that syncer, its store and its etcd member."""
        leader = next((n for n in SYNCERS if self.cluster.services[n].address == self._poller.leader_address), None)
        if leader is None or self.procs[leader].state != "up":
            self.not_injected.append(ev)
            self._emit(f"skipped {ev.describe()}: no leader known ({self._poller.leader_address or 'none'})")
            return
        i = SYNCERS.index(leader)
        members = [leader, STORES[i], ETCD_MEMBERS[i]]
        fault = InjectedFault("region", leader, time.time(), detail="SIGKILL " + ", ".join(members))
        self.faults.append(fault)
        delay = float(ev.params.get("restart_after_s", 5.0))
        for name in members:
            svc, proc = self.cluster.services[name], self.procs[name]
            svc.signal(signal.SIGCONT)
            svc.kill(10)
            proc.state, proc.fault = "down", fault
            self._later(delay, f"restart {name}", lambda n=name: self._restart(n, fault))
        self._emit(f"injected {ev.describe()}: {fault.detail}")

    def _finish(self) -> dict:
        """Heals everything, brings every service back, reads the leader's final state, stops the
        standby and then the leader (its final checkpoint, committed under its epoch)."""
        import heapq

        from google.protobuf import json_format

        while self._actions:
            _, _, _, fn = heapq.heappop(self._actions)
            fn()
        for group, timeout_s in ((ETCD_MEMBERS, 60), (STORES, 60), (SYNCERS, 120)):
            for name in group:
                svc = self.cluster.services[name]
                svc.signal(signal.SIGCONT)
                if not svc.alive():
                    svc.start()
                self.procs[name].state = "up"
            for name in group:
                self.cluster.services[name].wait_ready(timeout_s)
        deadline = time.time() + _LEADER_WAIT_S
        while True:
            try:
                state = self._poller.state(5.0)
                if state.epoch > 0:
                    break
            except Exception:  # noqa: BLE001 - syncers restarting
                pass
            if time.time() > deadline:
                raise RuntimeError(f"no syncer leads {_LEADER_WAIT_S:.0f} s after every service is back")
            time.sleep(0.5)
        final = json_format.MessageToDict(state, preserving_proto_field_name=True)
        final["config"] = state.config
        leader = next(n for n in SYNCERS if self.cluster.services[n].address == self._poller.leader_address)
        for name in [n for n in SYNCERS if n != leader] + [leader]:
            self.procs[name].state = "finished"
            self._emit(f"{name} stopped with {self.cluster.services[name].stop(30)}")
        self.leader_at_end = leader
        return final

    def _load_checkpoints(self) -> tuple[list, object | None]:
        """One repair pass over both stores, then every retained checkpoint of each store."""
        self.repair_summaries = asyncio.run(_repair([self.cluster.services[n].address for n in STORES], self.run_id))
        self.store_checkpoints = {n: load_checkpoints(self.cluster.services[n].address, self.run_id) for n in STORES}
        loaded = self.store_checkpoints[STORES[0]]
        last = next((snap for _, snap in reversed(loaded) if not isinstance(snap, Exception)), None)
        return loaded, last

    def _result(self, started: float, error: str, final_state: dict, checkpoints: list, loss: float | None) -> Result:
        result = super()._result(started, error, final_state, checkpoints, loss)
        for check in result.checks:
            if check.name.startswith("I4"):
                check.name += f" ({STORES[0]})"
        for name in STORES[1:]:
            check = invariants.check_checkpoints(result.syncer_history, getattr(self, "store_checkpoints", {}).get(name, []))
            check.name += f" ({name})"
            result.checks.append(check)
        result.checks.append(invariants.check_epochs(result.learner_histories))
        extra = {"repair": getattr(self, "repair_summaries", []), "leader_at_end": getattr(self, "leader_at_end", "")}
        (self.workdir / "report.json").write_text(json.dumps({**result.to_json(), **extra}, indent=2, default=str))
        (self.workdir / "report.txt").write_text(result.report_line + "\n")
        return result


async def _repair(addresses: Sequence[str], run_id: str) -> list[str]:
    channels = {a: channel_lib.aio_channel(a) for a in addresses}
    try:
        stores = {a: checkpoint_client.CheckpointClient(ch, timeout=datetime.timedelta(seconds=10),
                                                        retry_timeout=datetime.timedelta(seconds=5))
                  for a, ch in channels.items()}
        client = replicas_lib.ReplicatedCheckpointClient(stores, write_quorum=1)
        reports = await asyncio.wait_for(client.repair([run_id]), 120)
        return [r.summary() for r in reports]
    finally:
        for ch in channels.values():
            await ch.close()


def outage_summary(workdir: str | pathlib.Path) -> str:
    """A markdown table of what each fault of a hub run did to merging, computed from the run's
    report.json and syncer history: for a syncer fault, whether the faulted syncer led (its life
    made no merge after the heal) and the time from the fault to the first merge of another life; for the
    other faults, the merges and checkpoints made while the fault lasted (injection to heal) and
    the longest gap between merges in that window."""
    workdir = pathlib.Path(workdir)
    report = json.loads((workdir / "report.json").read_text())
    history = history_lib.read(workdir / "history" / "syncer.jsonl")
    merges = [r for r in history if r["event"] == "merged"]
    checkpoints = [r["t"] for r in history if r["event"] == "checkpoint"]
    t0 = report["t0"]
    rows = ["| t (s) | fault | target | lasted (s) | effect |", "|---|---|---|---|---|"]
    for f in report["faults"]:
        at, healed = f["at"], f["healed_at"] or f["at"]
        before = [r for r in merges if r["t"] <= at]
        after = next((r for r in merges if r["t"] > at), None)
        if f["target"].startswith("syncer") and f["scheduled"]:
            # It led if the life that merged last before the fault never merged again after the
            # heal (a leader SIGSTOPped for less than its lease may merge once more on SIGCONT,
            # unbroadcast and uncommitted: its lease is gone, then it exits 4).
            life = before[-1]["instance"] if before else ""
            led = bool(life) and not any(r["instance"] == life and r["t"] > healed + 1.0 for r in merges)
            new = next((r for r in merges if r["t"] > at and r["instance"] != life), None)
            if led and new is not None:
                effect = f"**leader**: first merge by the new leader {new['t'] - at:.2f} s after the fault"
            elif led:
                effect = "**leader**: no merge by another leader after it"
            else:
                effect = (f"no leader change (a standby, or a leader stopped for less than its lease): next merge "
                          f"{after['t'] - at:.2f} s after the fault" if after else "no merge after it")
        else:
            times = [at] + [r["t"] for r in merges if at < r["t"] <= healed] + [healed]
            gap = max(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else 0.0
            during = sum(1 for r in merges if at < r["t"] <= healed)
            ckpts = sum(1 for t in checkpoints if at < t <= healed)
            effect = f"{during} merges, {ckpts} checkpoints while it lasted; longest merge gap {gap:.2f} s"
        kind = f["kind"] if f["scheduled"] else f"crash ({f['detail']})"
        rows.append(f"| {at - t0:.1f} | {kind} | {f['target']} | {healed - at:.1f} | {effect} |")
    return "\n".join(rows) + "\n"
