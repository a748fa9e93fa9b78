"""A local etcd for fault tests and benchmarks: `EtcdMember`, one member process with its data in a
directory of its own, and `running_etcd`, a single-member cluster for the length of a block.

The binary comes from scripts/etcd_env.sh (Debian's etcd-server package if none is installed).
Members are started, signalled and stopped by PID through the tools' one launcher
(ddiloco/cli/processes.py). etcd cannot bind port 0 and report the port back, so its ports are
picked free just before it starts (racy: a start that loses the race is tried again, bounded).
With `ServerTLS` a member serves its clients https only and requires client certificates
(`--client-cert-auth`), as docker-compose.failover-tls.yml runs etcd; peers stay plain HTTP.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import signal
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence

from ddiloco.cli import processes

ROOT = pathlib.Path(__file__).resolve().parents[2]
START_ATTEMPTS = 3
READY_TIMEOUT_S = 20.0
_SETUP_TIMEOUT_S = 1500  # a first download from the package archive on a slow mirror


def etcd_binary() -> str:
    """The path of a working etcd from scripts/etcd_env.sh; RuntimeError (with its log) when none."""
    try:
        result = subprocess.run(["bash", str(ROOT / "scripts" / "etcd_env.sh")], capture_output=True, text=True,
                                timeout=_SETUP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"scripts/etcd_env.sh did not finish within {_SETUP_TIMEOUT_S // 60} minutes") from None
    if result.returncode != 0 or not result.stdout.strip():
        raise RuntimeError(f"no etcd (scripts/etcd_env.sh exited {result.returncode}):\n{result.stderr[-3000:]}")
    return result.stdout.strip().splitlines()[-1]


@dataclasses.dataclass(frozen=True)
class ServerTLS:
    """Client TLS of an etcd member: its CA for client certificates (--trusted-ca-file), its server
    certificate and key, and a client certificate and key it is probed with (its /health needs one)."""

    ca_file: str
    cert_file: str
    key_file: str
    probe_cert_file: str
    probe_key_file: str

    def args(self) -> list[str]:
        return ["--client-cert-auth", "--trusted-ca-file", self.ca_file, "--cert-file", self.cert_file,
                "--key-file", self.key_file]

    def probe_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_file)
        context.load_cert_chain(self.probe_cert_file, self.probe_key_file)
        return context


def _healthy(endpoint: str, tls: ServerTLS | None = None) -> bool:
    url = f"{'https' if tls else 'http'}://{endpoint}/health"
    try:
        with urllib.request.urlopen(url, timeout=1, context=tls.probe_context() if tls else None) as response:
            return b'"true"' in response.read()
    except OSError:
        return False


@dataclasses.dataclass
class EtcdMember(processes.ProcessControl):
    """One etcd member on 127.0.0.1, with the interface the chaos harness uses for services
    (start / signal / wait / alive / stop / wait_ready). Its data directory survives restarts, so
    a killed member restarts on its own data and rejoins its cluster."""

    name: str
    binary: str
    workdir: pathlib.Path
    client_port: int
    peer_port: int
    initial_cluster: str  # every member as name=http://127.0.0.1:<peer port>, comma-separated
    proc: subprocess.Popen | None = None
    starts: int = 0
    tls: ServerTLS | None = None  # clients: https with client certificates; None: plain HTTP

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def endpoint(self) -> str:
        """host:port of its client URL (what an etcd client is given)."""
        return self.address

    @property
    def log_path(self) -> pathlib.Path:
        return self.workdir / "logs" / f"{self.name}.log"

    def start(self, extra_args: Sequence[str] = ()) -> None:
        client, peer = f"{'https' if self.tls else 'http'}://{self.address}", f"http://127.0.0.1:{self.peer_port}"
        self.launch([self.binary, "--name", self.name, "--data-dir", str(self.workdir / f"{self.name}.data"),
                     "--listen-client-urls", client, "--advertise-client-urls", client,
                     "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                     "--initial-cluster", self.initial_cluster, "--initial-cluster-state", "new",
                     "--initial-cluster-token", "ddiloco-chaos", "--logger", "zap", "--log-outputs", "stderr",
                     *(self.tls.args() if self.tls else ()), *extra_args])
        self.starts += 1

    def wait_ready(self, timeout_s: float) -> str:
        """Until the member reports healthy (it then has a leader: a quorum of members is up)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if _healthy(self.address, self.tls):
                return self.address
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not healthy within {timeout_s:.0f} s:\n{self.log_tail()}")

    def pause(self) -> None:
        """SIGSTOP: etcd answers nothing (cut off from everyone) until resume()."""
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)


@contextlib.contextmanager
def running_etcd(directory: pathlib.Path, binary: str | None = None, *,
                 tls: ServerTLS | None = None) -> Iterator[EtcdMember]:
    """A single-member etcd with its data under `directory`, killed (by PID) when the block ends;
    with `tls`, serving its clients https only, to client certificates its CA signed."""
    binary = binary or etcd_binary()
    directory.mkdir(parents=True, exist_ok=True)
    last_log = ""
    for attempt in range(START_ATTEMPTS):
        name, peer_port = f"etcd-{attempt}", processes.preset_port()
        etcd = EtcdMember(name, binary, directory, processes.preset_port(), peer_port,
                          f"{name}=http://127.0.0.1:{peer_port}", tls=tls)
        etcd.start()
        try:
            etcd.wait_ready(READY_TIMEOUT_S)
        except RuntimeError as exc:
            etcd.kill()
            last_log = str(exc)[-2000:]
            continue
        try:
            yield etcd
        finally:
            etcd.kill()
        return
    raise RuntimeError(f"etcd did not start in {START_ATTEMPTS} attempts:\n{last_log}")
