"""LocalCluster: starts the services as separate processes on 127.0.0.1, for `ddiloco up` and tests.

Each service binds port 0 the first time and announces its address in a ready file; a restarted
service re-binds the same port so that clients reconnect to the address they know. Only
processes started here are ever signalled, by PID.

Transport: plaintext by default, asked for explicitly (DDILOCO_INSECURE=1 in the services'
environment: a local run on loopback). With `tls=True` the cluster writes a development PKI
(`ddiloco certs`) under <workdir>/certs and every service and client uses mutual TLS with its own
certificate; `client_security()` gives tools (probes, `ddiloco status`) the read-only credential.

Failover (`start_etcd` + `start_syncer_replicas`): a single-member etcd for the run (stopped last)
and syncer instances of one run electing their leader through it; learners and the evaluator are
given every instance (`syncer_target`). With fragment shards too, every shard has its instances
and its own leader, and learners are given shard 0's instances. With `tls=True` etcd has a PKI of its own in the same
directory (`ddiloco certs --etcd-names`: etcd-ca.pem, a CA no learner's certificate chains to):
clients over https with client certificates (--client-cert-auth), the peer URL over https with
peer certificates, and the syncers get the etcd client certificate (--coord-tls-*).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence

from ddiloco.cli import etcd_local
from ddiloco.cli import service_names
from ddiloco.cli.processes import ProcessControl, preset_port
from ddiloco.rpc import security as security_lib


# services/syncer/leadership.EXIT_LOST_LEADERSHIP (the tools do not import the services).
EXIT_LOST_LEADERSHIP = 4
# The failover instances' lease and etcd call deadline on one machine (the syncer's defaults, 3 s and
# 1 s, are for hub hosts of their own): here the learners compile and step on the same cores, and a
# leader whose keep-alive thread was starved past 2.4 s was deposed every 7-15 s of an
# `up --syncer-replicas 2 --tls` on a loaded 2-core machine (8 merges in 4 minutes; etcd itself
# answered a keep-alive in 2-3 ms). A dead leader is replaced within about the lease.
LOCAL_LEASE_S, LOCAL_ETCD_CALL_TIMEOUT_S = 10, 3.0


class ServiceStartError(RuntimeError):
    """A service exited or did not announce itself in time; the message includes its log tail."""


def _record_pid(workdir: pathlib.Path, name: str, pid: int) -> None:
    # Every PID ever started, so tools and tests can check that nothing was left behind.
    path = workdir / "pids.json"
    pids = json.loads(path.read_text()) if path.exists() else {}
    pids.setdefault(name, []).append(pid)
    path.write_text(json.dumps(pids))


@dataclasses.dataclass
class ServiceProcess(ProcessControl):
    """One `python -m <module>` process in `workdir`, its output in logs/<name>.log: a service of
    LocalCluster, or a process of a benchmark (ddiloco.bench.perf_common starts every one of its
    own: syncers, a bare gRPC sink, proxies, worker jobs)."""

    name: str
    module: str  # python -m <module>, named as in the repository (service_names.module maps it)
    args: list[str]
    workdir: pathlib.Path
    env: Mapping[str, str]
    proc: subprocess.Popen | None = None
    address: str = ""
    starts: int = 0
    info: dict = dataclasses.field(default_factory=dict)  # the ready file's fields (a proxy's ports)

    @property
    def ready_file(self) -> pathlib.Path:
        return self.workdir / f"{self.name}.ready.json"

    @property
    def log_path(self) -> pathlib.Path:
        return self.workdir / "logs" / f"{self.name}.log"

    def start(self, extra_args: Sequence[str] = ()) -> None:
        """Starts the process (re-binding the previous port when restarting a server)."""
        self.ready_file.unlink(missing_ok=True)
        args = list(self.args) + list(extra_args)
        if self.address and "--bind" in args:
            args[args.index("--bind") + 1] = self.address
        self.launch([sys.executable, "-m", service_names.module(self.module), *args], env=self.env, cwd=self.workdir)
        self.starts += 1
        self._record_pid()

    def _record_pid(self) -> None:
        _record_pid(self.workdir, self.name, self.proc.pid)

    def wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                self.info = json.loads(self.ready_file.read_text())
                self.address = self.info["address"].replace("0.0.0.0", "127.0.0.1")
                return self.address
            if self.proc is not None and self.proc.poll() is not None:
                raise ServiceStartError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            time.sleep(0.05)
        raise ServiceStartError(f"{self.name} not ready within {timeout_s:.0f} s:\n{self.log_tail()}")


class LocalCluster:
    """A checkpoint store, a syncer, learners and an evaluator as processes on 127.0.0.1."""

    def __init__(self, workdir: str | os.PathLike, *, env: Mapping[str, str] | None = None, tls: bool = False) -> None:
        self.workdir = pathlib.Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        base_env = dict(os.environ if env is None else env)
        base_env["PYTHONUNBUFFERED"] = "1"
        # Several JAX processes share the machine: one compute thread each. XLA's default thread
        # pool per process oversubscribes the cores; with 4 learners on 2 cores this took a
        # learner step from 1.33 s to 0.59 s. A user-set XLA_FLAGS is left alone.
        base_env.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
        # In a checkout the services are imported from the project root (python -m services.<name>);
        # an installed wheel has them as ddiloco.services, already importable.
        if service_names.SOURCE_ROOT is not None:
            root = service_names.SOURCE_ROOT
            base_env["PYTHONPATH"] = root + (os.pathsep + base_env["PYTHONPATH"] if base_env.get("PYTHONPATH") else "")
        self.tls_dir = self.workdir / "certs" if tls else None
        if self.tls_dir is None:
            base_env[security_lib.SHARED_INSECURE_ENV] = "1"  # plaintext on loopback, explicitly
        else:
            base_env.pop(security_lib.SHARED_INSECURE_ENV, None)
            from ddiloco.cli import certs as certs_lib  # cryptography only when TLS is asked for

            certs_lib.write_dev_certs(self.tls_dir, services=("syncer", "checkpoint", "evaluator", "operator"))
        self.env = base_env
        self.services: dict[str, ServiceProcess] = {}
        self.etcd: etcd_local.EtcdMember | None = None  # start_etcd
        self._replicas: list[str] = []  # the names of start_syncer_replicas' instances
        self._target_replicas: list[str] = []  # ... of its shard 0 (syncer_target)

    def start_etcd(self) -> etcd_local.EtcdMember:
        """A single-member etcd for leader election, data under <workdir>/etcd, its PID in pids.json;
        with TLS, client and peer certificates of etcd's own CA (see the module docstring)."""
        tls = peer_tls = None
        if self.tls_dir is not None:
            from ddiloco.cli import certs as certs_lib  # cryptography only when TLS is asked for

            if not (self.tls_dir / f"{certs_lib.ETCD_CLIENT}.pem").exists():
                certs_lib.write_etcd_certs(self.tls_dir, names=["localhost"])
            tls, peer_tls = etcd_local.pki_tls(self.tls_dir)
        try:
            self.etcd = etcd_local.start_single_member(self.workdir / "etcd", tls=tls, peer_tls=peer_tls)
        except RuntimeError as exc:
            raise ServiceStartError(f"etcd: {exc}") from None
        _record_pid(self.workdir, "etcd", self.etcd.pid)
        return self.etcd

    def coord_args(self, *, client_certificate: bool = True) -> list[str]:
        """A syncer's flags for the election through `start_etcd`'s etcd: its endpoint (https under
        TLS), etcd's CA and, unless `client_certificate` is False, the etcd client certificate."""
        if self.etcd is None:
            raise ServiceStartError("no etcd: start_etcd first")
        if self.tls_dir is None:
            return ["--coord-etcd", self.etcd.endpoint]
        from ddiloco.cli import certs as certs_lib

        args = ["--coord-etcd", f"https://{self.etcd.endpoint}", "--coord-tls-ca", str(self.tls_dir / "etcd-ca.pem")]
        if client_certificate:
            args += ["--coord-tls-cert", str(self.tls_dir / f"{certs_lib.ETCD_CLIENT}.pem"),
                     "--coord-tls-key", str(self.tls_dir / f"{certs_lib.ETCD_CLIENT}.key")]
        return args

    def tls_args(self, name: str) -> list[str]:
        """`--tls-*` flags for the process holding identity `name` (its certificate is made on demand)."""
        if self.tls_dir is None:
            return []
        cert, key = self.tls_dir / f"{name}.pem", self.tls_dir / f"{name}.key"
        if not cert.exists():
            from ddiloco.cli import certs as certs_lib

            certs_lib.write_dev_certs(self.tls_dir, learners=[name], services=())
        return ["--tls-ca", str(self.tls_dir / "ca.pem"), "--tls-cert", str(cert), "--tls-key", str(key)]

    def client_security(self, name: str = "operator") -> security_lib.ClientSecurity:
        """Credentials for an in-process client (the read-only `operator` by default)."""
        if self.tls_dir is None:
            return security_lib.ClientSecurity(insecure=True)
        return security_lib.ClientSecurity(tls_ca=str(self.tls_dir / "ca.pem"), tls_cert=str(self.tls_dir / f"{name}.pem"),
                                           tls_key=str(self.tls_dir / f"{name}.key"))

    def add(self, name: str, module: str, args: Sequence[str]) -> ServiceProcess:
        svc = ServiceProcess(name=name, module=module, args=list(args), workdir=self.workdir, env=self.env)
        self.services[name] = svc
        return svc

    def start_store(self, *, extra: Sequence[str] = (), timeout_s: float = 60.0, index: int = 0) -> ServiceProcess:
        """Store `index` 0 is "checkpoint" (root store/); replicas 1, 2, ... are "checkpoint-<i>" (store-<i>/)."""
        name, root = ("checkpoint", "store") if index == 0 else (f"checkpoint-{index}", f"store-{index}")
        svc = self.add(name, "services.checkpoint", [
            "--bind", "127.0.0.1:0", "--root", str(self.workdir / root),
            "--ready-file", str(self.workdir / f"{name}.ready.json"), "--metrics-bind", "127.0.0.1:0",
            *self.tls_args("checkpoint"), *extra,
        ])
        svc.start()
        svc.wait_ready(timeout_s)
        return svc

    def start_syncer(self, *, run_id: str, extra: Sequence[str] = (), timeout_s: float = 120.0) -> ServiceProcess:
        args = ["--bind", "127.0.0.1:0", "--run-id", run_id, "--ready-file", str(self.workdir / "syncer.ready.json"),
                "--metrics-bind", "127.0.0.1:0"]
        if self.stores():  # several stores: the syncer replicates every checkpoint to all of them
            args += ["--checkpoint-target", ",".join(s.address for s in self.stores())]
        svc = self.add("syncer", "services.syncer", [*args, *self.tls_args("syncer"), *extra])
        svc.start()
        svc.wait_ready(timeout_s)
        return svc

    def start_syncer_shards(self, count: int, *, run_id: str, extra: Sequence[str] = (),
                            timeout_s: float = 120.0) -> list[ServiceProcess]:
        """`count` syncer processes splitting the fragments between them (fragment shards,
        docs/deploy.md): shard 0 is "syncer" (where learners and tools are pointed; they find the
        others in its answers), shard i > 0 "syncer-<i>". Every shard gets the same shard map,
        so their ports are chosen before any starts (processes.preset_port). One shard is exactly
        start_syncer: no shard flags, port 0."""
        if count < 1:
            raise ServiceStartError(f"syncer shards must be 1 or more, got {count}")
        if count == 1:
            return [self.start_syncer(run_id=run_id, extra=extra, timeout_s=timeout_s)]
        addresses = [f"127.0.0.1:{preset_port()}" for _ in range(count)]
        shard_map = ",".join(addresses)
        shards = []
        for index, address in enumerate(addresses):
            name = "syncer" if index == 0 else f"syncer-{index}"
            args = ["--bind", address, "--run-id", run_id, "--ready-file", str(self.workdir / f"{name}.ready.json"),
                    "--metrics-bind", "127.0.0.1:0", "--fragment-shard", str(index), "--fragment-shards", shard_map]
            if self.stores():
                args += ["--checkpoint-target", ",".join(s.address for s in self.stores())]
            svc = self.add(name, "services.syncer", [*args, *self.tls_args("syncer"), *extra])
            svc.start()  # all of them at once: they load the model in parallel
            shards.append(svc)
        for svc in shards:
            svc.wait_ready(timeout_s)
        return shards

    def start_syncer_replicas(self, count: int, *, run_id: str, shards: int = 1, extra: Sequence[str] = (),
                              instance_extra: Callable[[str], Sequence[str]] | None = None,
                              timeout_s: float = 120.0) -> list[ServiceProcess]:
        """`count` syncer instances of one run electing a leader through `start_etcd`'s etcd: "syncer",
        "syncer-b", "syncer-c", ...; one leads, the others stand by (redirecting clients to the
        leader) and take over when it goes, within LOCAL_LEASE_S. Every instance gets every store;
        `extra` comes last (it may set another lease), then `instance_extra(name)` (a test's
        per-instance files).

        With `shards` > 1 (fragment shards x failover): `count` instances per shard, each shard
        electing its own leader (the election key and commit pointer are per shard: the syncer's
        `<run>.shard-I-of-N`). Shard 0's instances are named as above, shard i's "syncer-<i>",
        "syncer-<i>-b", ...; every instance gets the same map, a shard's instances joined by '|'
        (`a0|b0,a1|b1`), so their ports are chosen before any starts. Returned (and in
        `syncers()`) shard by shard; learners and tools are given shard 0's instances."""
        if count < 2:
            raise ServiceStartError(f"syncer replicas with failover must be 2 or more, got {count}")
        if shards < 1:
            raise ServiceStartError(f"syncer shards must be 1 or more, got {shards}")
        coord = [*self.coord_args(), "--coord-lease-s", str(LOCAL_LEASE_S),
                 "--coord-call-timeout-s", str(LOCAL_ETCD_CALL_TIMEOUT_S)]
        names = [[self.replica_name(shard, index) for index in range(count)] for shard in range(shards)]
        binds = [["127.0.0.1:0" if shards == 1 else f"127.0.0.1:{preset_port()}" for _ in row] for row in names]
        shard_args = []
        if shards > 1:
            shard_map = ",".join("|".join(row) for row in binds)
            shard_args = [["--fragment-shard", str(shard), "--fragment-shards", shard_map] for shard in range(shards)]
        replicas = []
        for shard, row in enumerate(names):
            for name, bind in zip(row, binds[shard]):
                args = ["--bind", bind, "--run-id", run_id, "--ready-file", str(self.workdir / f"{name}.ready.json"),
                        "--metrics-bind", "127.0.0.1:0", *coord, *(shard_args[shard] if shard_args else [])]
                if self.stores():
                    args += ["--checkpoint-target", ",".join(s.address for s in self.stores())]
                per_instance = list(instance_extra(name)) if instance_extra is not None else []
                svc = self.add(name, "services.syncer", [*args, *self.tls_args("syncer"), *extra, *per_instance])
                svc.start()  # all of them at once: they load the model in parallel
                self._replicas.append(name)
                replicas.append(svc)
        self._target_replicas = names[0]
        for svc in replicas:
            svc.wait_ready(timeout_s)
        return replicas

    @staticmethod
    def replica_name(shard: int, index: int) -> str:
        """start_syncer_replicas' name of instance `index` of fragment shard `shard`: "syncer",
        "syncer-b", ... for shard 0 (as without shards), "syncer-<shard>", "syncer-<shard>-b", ...
        for the others."""
        base = "syncer" if shard == 0 else f"syncer-{shard}"
        return base if index == 0 else f"{base}-{chr(ord('a') + index)}"

    def revive_syncer_replicas(self) -> list[str]:
        """Starts again every failover instance that exited with EXIT_LOST_LEADERSHIP (a leader that
        lost its lease or was fenced exits so, and is meant to come back as a standby: what its
        supervisor does on Kubernetes or in compose); returns their names. Another exit is left to
        the caller (a crash is not hidden by a restart)."""
        revived = []
        for name in self._replicas:
            svc = self.services[name]
            if svc.proc is not None and svc.proc.poll() == EXIT_LOST_LEADERSHIP:
                svc.start()  # the same port: learners keep the address they were given
                revived.append(name)
        return revived

    def syncer_target(self) -> str:
        """What learners, the evaluator and tools are given: every syncer instance with failover
        (they follow the leader; with fragment shards too, shard 0's instances: the others are in
        its answers), else the syncer (shard 0 with fragment shards)."""
        if self._replicas:
            return ",".join(self.services[n].address for n in self._target_replicas)
        return self.services["syncer"].address

    def syncers(self) -> list[ServiceProcess]:
        """The syncer and, with fragment shards, its other shards (syncer-<i>), in shard order; or
        every instance of start_syncer_replicas (shard by shard)."""
        return [s for n, s in self.services.items() if n == "syncer" or n in self._replicas
                or (n.startswith("syncer-") and n.removeprefix("syncer-").isdigit())]

    def start_learner(self, index: int, *, region: str, extra: Sequence[str] = (),
                      module: str = "services.learner") -> ServiceProcess:
        """`module`: another program taking the learner's flags (ddiloco.chaos.hostile_learner)."""
        name = f"learner-{index}"
        svc = self.add(name, module, [
            "--syncer", self.syncer_target(), "--learner-id", name, "--region", region,
            "--summary-file", str(self.workdir / f"{name}.summary.json"),
            # Many learners share this host: each its own free health port (logged as "health on").
            "--health-bind", "127.0.0.1:0", *self.tls_args(name), *extra,
        ])
        svc.start()
        return svc

    def start_evaluator(self, *, extra: Sequence[str] = ()) -> ServiceProcess:
        svc = self.add("evaluator", "services.learner.evaluator", [
            "--syncer", self.syncer_target(), *self.tls_args("evaluator"), *extra,
        ])
        svc.start()
        return svc

    def stores(self) -> list[ServiceProcess]:
        return [s for n, s in self.services.items() if n == "checkpoint" or n.startswith("checkpoint-")]

    def learners(self) -> list[ServiceProcess]:
        return [s for n, s in self.services.items() if n.startswith("learner-")]

    def _standbys_first(self, syncers: list[ServiceProcess]) -> list[ServiceProcess]:
        """Failover instances in the order of their epochs (standbys, epoch 0, first): a leader
        stopped first would hand over to a standby that is stopped next, restoring and
        checkpointing for nothing."""
        if not self._replicas:
            return syncers
        import grpc

        from ddiloco.cli import run_view

        reader = run_view.RunReader(self.syncer_target(), self.client_security(), timeout_s=2.0, recent_merges=0)
        epochs = {}
        for svc in syncers:
            try:
                epochs[svc.name] = reader.fetch(svc.address).epoch if svc.alive() and svc.address else -1
            except grpc.RpcError:
                epochs[svc.name] = -1
        reader.close()
        return sorted(syncers, key=lambda svc: epochs[svc.name])

    def stop_all(self, timeout_s: float = 15.0, clients_timeout_s: float | None = None) -> None:
        """Stops learners and the evaluator first, then the syncer shards (they checkpoint), then the
        stores, then etcd (a leader commits its last checkpoint through it).

        The learners and the evaluator stop together: each may take up to its finish timeout
        after SIGTERM (waiting for its last contributions to be merged, longer when the syncer is
        already gone), and one after the other those waits added up (a test's teardown of two
        learners without a syncer: 2 x 10 s). `clients_timeout_s` (default `timeout_s`) is how
        long they get before SIGKILL: a caller that does not need their last work merged (a
        test's teardown) gives them less."""
        stores, syncers = self.stores(), self.syncers()
        clients = [s for s in self.services.values() if s not in syncers and s not in stores]
        clients_s = timeout_s if clients_timeout_s is None else clients_timeout_s
        if len(clients) > 1:
            with concurrent.futures.ThreadPoolExecutor(len(clients), thread_name_prefix="stop") as pool:
                list(pool.map(lambda svc: svc.stop(clients_s), clients))
        else:
            for svc in clients:
                svc.stop(clients_s)
        for svc in self._standbys_first(syncers) + stores:
            svc.stop(timeout_s)
        if self.etcd is not None:
            self.etcd.stop(timeout_s)
