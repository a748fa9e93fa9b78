"""The tools' one launcher (ddiloco/cli/processes.py): a child's output in its log, stop() and
kill() of a running and of a SIGSTOPped child, by PID."""

from __future__ import annotations

import dataclasses
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from ddiloco.cli import processes

pytestmark = pytest.mark.timeout(60)

# Prints a line, then waits for a signal; SIGTERM exits 0 through the handler (a clean stop).
_CHILD = ("import signal, sys, time\n"
          "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
          "print('child up', flush=True)\n"
          "time.sleep(60)\n")


@dataclasses.dataclass
class _Child(processes.ProcessControl):
    name: str
    workdir: pathlib.Path
    proc: subprocess.Popen | None = None

    @property
    def log_path(self) -> pathlib.Path:
        return self.workdir / "logs" / f"{self.name}.log"

    def start(self) -> None:
        lives = self.log_tail().count("child up")
        self.launch([sys.executable, "-c", _CHILD], cwd=self.workdir)
        deadline = time.monotonic() + 30
        while self.log_tail().count("child up") == lives and time.monotonic() < deadline:
            time.sleep(0.05)


def test_a_child_logs_to_its_file_and_stops_cleanly_even_when_stopped(tmp_path):
    child = _Child("a", tmp_path)
    assert child.log_tail() == "(no log)" and not child.alive() and child.stop() is None
    child.start()
    assert child.log_tail() == "child up" and child.alive() and child.pid == child.proc.pid
    child.signal(signal.SIGSTOP)
    # SIGSTOPped, it would not act on SIGTERM: stop() continues it first, so it exits cleanly.
    assert child.stop(timeout_s=20) == 0
    assert not child.alive() and child.stop() == 0  # stopping again reports the same exit


def test_kill_ends_a_stopped_child_at_once(tmp_path):
    child = _Child("b", tmp_path)
    child.start()
    child.signal(signal.SIGSTOP)
    assert child.kill(timeout_s=20) == -signal.SIGKILL
    child.start()  # a second life appends to the same log
    assert child.log_tail().splitlines() == ["child up", "child up"]
    assert child.stop(timeout_s=20) == 0

