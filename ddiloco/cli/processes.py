"""Child processes for the tools: the one launcher of `ddiloco up` (LocalCluster), the chaos
harness and its etcd members, and the benchmarks and tests that use them.

A child is started with its output in a log file and signalled by its PID only, never by name;
`preset_port` gives one a port before it starts when it cannot bind port 0 and report it back.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import random
import signal
import socket
import subprocess
from collections.abc import Mapping, Sequence

# Linux's default start of ip_local_port_range, when /proc does not say.
_EPHEMERAL_LOW = 32768


class ProcessControl:
    """Starts one child process and signals, waits for and reads the log of it: `name` and
    `log_path` are the subclass's. The services of `LocalCluster` and the etcd members of the
    chaos tools (ddiloco/cli/etcd_local.py) are started, stopped and killed through it."""

    proc: subprocess.Popen | None
    name: str

    @property
    def log_path(self) -> pathlib.Path:
        raise NotImplementedError

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def launch(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
               cwd: str | os.PathLike | None = None) -> None:
        """Starts `argv` with stdout and stderr appended to `log_path` and no stdin."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=None if env is None else dict(env), cwd=cwd)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.proc.pid, sig)

    def wait(self, timeout_s: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self, timeout_s: float = 10.0) -> int | None:
        """SIGKILL (a stopped process dies too), then wait up to timeout_s for its exit."""
        self.signal(signal.SIGKILL)
        return self.wait(timeout_s)

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within timeout_s. A stopped (SIGSTOPped)
        process is continued first: it would not act on SIGTERM until then."""
        if not self.alive():
            return self.proc.returncode if self.proc else None
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        code = self.wait(timeout_s)
        if code is None:
            self.signal(signal.SIGKILL)
            code = self.wait(timeout_s)
        return code


def preset_port() -> int:
    """A free port on 127.0.0.1 for a child that must have a known address before it is up.

    Taken below the kernel's ephemeral range: a port from bind(0) is ephemeral, so any outgoing
    connection on the machine may take it in the seconds before the child binds it (a goodput
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
