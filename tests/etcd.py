"""A real etcd for the tests: the binary from scripts/etcd_env.sh (Debian's etcd-server if
missing), one single-member cluster per test in its own temporary directory.

etcd cannot bind port 0 and report the port back, so its two ports come from tests/ports.py
(racy: a start that loses the race is retried, bounded). The process is stopped by its PID only.
"""

from __future__ import annotations

import contextlib
import pathlib
import signal
import subprocess
import time
from collections.abc import Iterator

from tests import ports, tools

_START_ATTEMPTS = 3
_READY_TIMEOUT_S = 20.0


def etcd_binary() -> str:
    """The path of a working etcd; fails the calling test when there is none."""
    return tools.require("etcd_env.sh", "etcd")


class EtcdProcess:
    def __init__(self, proc: subprocess.Popen, endpoint: str, log_path: pathlib.Path) -> None:
        self.proc = proc
        self.endpoint = endpoint
        self.log_path = log_path

    def pause(self) -> None:
        """SIGSTOP: etcd answers nothing (a partition from everyone) until resume()."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=10)


def _healthy(endpoint: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{endpoint}/health", timeout=1) as response:
            return b'"true"' in response.read()
    except OSError:
        return False


@contextlib.contextmanager
def running_etcd(directory: pathlib.Path) -> Iterator[EtcdProcess]:
    """A single-member etcd with its data under `directory`, killed (by PID) when the block ends."""
    binary = etcd_binary()
    directory.mkdir(parents=True, exist_ok=True)
    last_log = ""
    for attempt in range(_START_ATTEMPTS):
        client_port, peer_port = ports.free_port(), ports.free_port()
        client, peer = f"127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
        log_path = directory / f"etcd-{attempt}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [binary, "--name", "t", "--data-dir", str(directory / f"data-{attempt}"),
                 "--listen-client-urls", f"http://{client}", "--advertise-client-urls", f"http://{client}",
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"t={peer}", "--logger", "zap", "--log-outputs", "stderr"],
                stdout=log, stderr=subprocess.STDOUT)
        etcd = EtcdProcess(proc, client, log_path)
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline and not _healthy(client):
            time.sleep(0.1)
        if proc.poll() is None and _healthy(client):
            try:
                yield etcd
            finally:
                etcd.stop()
            return
        etcd.stop()
        last_log = log_path.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"etcd did not start in {_START_ATTEMPTS} attempts:\n{last_log}")
