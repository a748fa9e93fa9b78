"""A local etcd for `ddiloco up --syncer-replicas`, the chaos harness, benchmarks and tests:
`EtcdMember`, one member process with its data in a directory of its own; `start_single_member`,
a one-member cluster; `running_etcd`, one for the length of a block.

The binary comes from scripts/etcd_env.sh in a checkout (Debian's etcd-server package if none is
installed), else from PATH. Members are started, signalled and stopped by PID through the tools'
one launcher (ddiloco/cli/processes.py). etcd cannot bind port 0 and report the port back, so its
ports are picked free just before it starts (racy: a start that loses the race is tried again,
bounded). With `ServerTLS` a member serves its clients https only and requires client
certificates (`--client-cert-auth`); with `PeerTLS` its peer URLs are https too and members
require each other's peer certificate (`--peer-client-cert-auth`, `--peer-cert-allowed-cn`), as
docker-compose.failover-tls.yml runs etcd. `pki_tls` reads both from the files `ddiloco certs
--etcd-names` writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import shutil
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
    """The path of a working etcd: from scripts/etcd_env.sh in a checkout, else `etcd` on PATH (an
    installed ddiloco has no scripts/); RuntimeError (with the reason) when none."""
    if not (ROOT / "scripts" / "etcd_env.sh").exists():
        found = shutil.which("etcd")
        if found is None:
            raise RuntimeError("no etcd on PATH: install etcd 3.4 or newer (Debian/Ubuntu: etcd-server)")
        return found
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


@dataclasses.dataclass(frozen=True)
class PeerTLS:
    """Peer TLS of an etcd member: https peer URLs, its CA for the other members' certificates
    (--peer-trusted-ca-file), its peer certificate and key, and the common name every member's
    peer certificate must carry (--peer-cert-allowed-cn: another certificate of the same CA, such
    as the syncers' client certificate, does not make a member)."""

    ca_file: str
    cert_file: str
    key_file: str
    allowed_cn: str = ""

    def args(self) -> list[str]:
        return ["--peer-client-cert-auth", "--peer-trusted-ca-file", self.ca_file, "--peer-cert-file", self.cert_file,
                "--peer-key-file", self.key_file, *(["--peer-cert-allowed-cn", self.allowed_cn] if self.allowed_cn else [])]


def pki_tls(directory: str | pathlib.Path) -> tuple[ServerTLS, PeerTLS]:
    """Client and peer TLS of a member from the files `ddiloco certs --etcd-names` wrote in
    `directory` (ddiloco.cli.certs.write_etcd_certs): etcd's CA for both, the server and peer
    certificates, and the syncers' client certificate to probe /health with."""
    from ddiloco.cli import certs  # cryptography only when TLS is asked for

    root = pathlib.Path(directory)

    def pair(stem: str) -> tuple[str, str]:
        return str(root / f"{stem}.pem"), str(root / f"{stem}.key")

    ca = str(root / "etcd-ca.pem")
    server, client, peer = pair(certs.ETCD_SERVER), pair(certs.ETCD_CLIENT), pair(certs.ETCD_PEER)
    return (ServerTLS(ca_file=ca, cert_file=server[0], key_file=server[1], probe_cert_file=client[0],
                      probe_key_file=client[1]),
            PeerTLS(ca_file=ca, cert_file=peer[0], key_file=peer[1], allowed_cn=certs.ETCD_PEER))


def peer_url(port: int, peer_tls: PeerTLS | None = None) -> str:
    """A member's peer URL on 127.0.0.1 (what --initial-cluster lists)."""
    return f"{'https' if peer_tls else 'http'}://127.0.0.1:{port}"


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
    initial_cluster: str  # every member as name=<peer_url(peer port)>, comma-separated
    proc: subprocess.Popen | None = None
    starts: int = 0
    tls: ServerTLS | None = None  # clients: https with client certificates; None: plain HTTP
    peer_tls: PeerTLS | None = None  # peers: https with peer certificates; None: plain HTTP

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
        client, peer = f"{'https' if self.tls else 'http'}://{self.address}", peer_url(self.peer_port, self.peer_tls)
        self.launch([self.binary, "--name", self.name, "--data-dir", str(self.workdir / f"{self.name}.data"),
                     "--listen-client-urls", client, "--advertise-client-urls", client,
                     "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                     "--initial-cluster", self.initial_cluster, "--initial-cluster-state", "new",
                     "--initial-cluster-token", "ddiloco-chaos", "--logger", "zap", "--log-outputs", "stderr",
                     *(self.tls.args() if self.tls else ()), *(self.peer_tls.args() if self.peer_tls else ()),
                     *extra_args])
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


def start_single_member(directory: pathlib.Path, binary: str | None = None, *, tls: ServerTLS | None = None,
                        peer_tls: PeerTLS | None = None, ready_timeout_s: float = READY_TIMEOUT_S) -> EtcdMember:
    """A healthy single-member etcd with its data under `directory` (the caller kills it); with
    `tls`, serving its clients https only, to client certificates its CA signed; with `peer_tls`,
    its peer URL https (one member has no peer to talk to, but runs as a cluster of TLS peers
    would). RuntimeError with the last log when START_ATTEMPTS starts fail."""
    binary = binary or etcd_binary()
    directory.mkdir(parents=True, exist_ok=True)
    last_log = ""
    for attempt in range(START_ATTEMPTS):
        name, peer_port = f"etcd-{attempt}", processes.preset_port()
        etcd = EtcdMember(name, binary, directory, processes.preset_port(), peer_port,
                          f"{name}={peer_url(peer_port, peer_tls)}", tls=tls, peer_tls=peer_tls)
        etcd.start()
        try:
            etcd.wait_ready(ready_timeout_s)
        except RuntimeError as exc:
            etcd.kill()
            last_log = str(exc)[-2000:]
            continue
        return etcd
    raise RuntimeError(f"etcd did not start in {START_ATTEMPTS} attempts:\n{last_log}")


@contextlib.contextmanager
def running_etcd(directory: pathlib.Path, binary: str | None = None, *, tls: ServerTLS | None = None,
                 peer_tls: PeerTLS | None = None) -> Iterator[EtcdMember]:
    """`start_single_member` for the length of a block, killed (by PID) when it ends."""
    etcd = start_single_member(directory, binary, tls=tls, peer_tls=peer_tls)
    try:
        yield etcd
    finally:
        etcd.kill()
