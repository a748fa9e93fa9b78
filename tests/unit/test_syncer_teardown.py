"""The syncer's bounded teardown: once its state is durable, a hung teardown ends the process."""

from __future__ import annotations

import subprocess
import sys


def test_a_hung_teardown_is_cut_short_with_the_exit_code():
    # A non-daemon thread that would keep the interpreter alive for 120 s, like a stuck worker.
    code = ("import threading, time\n"
            "from services.syncer.__main__ import _exit_if_teardown_hangs\n"
            "threading.Thread(target=time.sleep, args=(120,)).start()\n"
            "_exit_if_teardown_hangs(0, 0.5)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "teardown still running" in done.stderr


def test_a_normal_exit_does_not_wait_for_the_limit():
    code = ("import time\n"
            "from services.syncer.__main__ import _exit_if_teardown_hangs\n"
            "_exit_if_teardown_hangs(0, 120.0)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "teardown still running" not in done.stderr, done.stderr
