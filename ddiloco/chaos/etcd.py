"""A local etcd for fault tests and benchmarks: one single-member cluster in a directory of its own.

The binary comes from scripts/etcd_env.sh (Debian's etcd-server package if none is installed).
etcd cannot bind port 0 and report the port back, so its ports are picked free just before it
starts (racy: a start that loses the race is tried again, bounded). It is stopped by its PID only.
"""

from __future__ import annotations

import contextlib
import pathlib
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{endpoint}/health", timeout=1) as response:
            return b'"true"' in response.read()
    except OSError:
        return False


class EtcdProcess:
    def __init__(self, proc: subprocess.Popen, endpoint: str, log_path: pathlib.Path) -> None:
        self.proc = proc
        self.endpoint = endpoint  # host:port of its client URL
        self.log_path = log_path

    def pause(self) -> None:
        """SIGSTOP: etcd answers nothing (cut off from everyone) until resume()."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=10)


@contextlib.contextmanager
def running_etcd(directory: pathlib.Path, binary: str | None = None) -> Iterator[EtcdProcess]:
    """A single-member etcd with its data under `directory`, killed (by PID) when the block ends."""
    binary = binary or etcd_binary()
    directory.mkdir(parents=True, exist_ok=True)
    last_log = ""
    for attempt in range(START_ATTEMPTS):
        client, peer = f"127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}"
        log_path = directory / f"etcd-{attempt}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [binary, "--name", "m", "--data-dir", str(directory / f"data-{attempt}"),
                 "--listen-client-urls", f"http://{client}", "--advertise-client-urls", f"http://{client}",
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"m={peer}", "--logger", "zap", "--log-outputs", "stderr"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        etcd = EtcdProcess(proc, client, log_path)
        deadline = time.monotonic() + READY_TIMEOUT_S
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
    raise RuntimeError(f"etcd did not start in {START_ATTEMPTS} attempts:\n{last_log}")
