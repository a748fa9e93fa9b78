"""Debian's headless Chromium for the tests that look at a page, from scripts/browser_env.sh
(apt-get if missing).

No browser fails the test that asked for one: it never skips, so CI cannot pass without having
looked at the page.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess

import pytest

from tests import tools

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def chromium() -> str:
    """The path of a working Chromium; fails the calling test when there is none."""
    return tools.require("browser_env.sh", "headless browser")


def run(profile: pathlib.Path, *args: str, timeout_s: float = 120.0, virtual_time_ms: int = 4000) -> str:
    """Runs headless Chromium once (own session); on timeout kills its process group (started here)."""
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
           "--no-first-run", "--no-default-browser-check", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--disable-extensions", "--hide-scrollbars",
           f"--user-data-dir={profile}", f"--virtual-time-budget={virtual_time_ms}", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group of the browser started above, not yet reaped
        proc.communicate(timeout=30)
        pytest.fail(f"chromium did not finish within {timeout_s:.0f} s: {cmd}")
    if proc.returncode != 0:
        pytest.fail(f"chromium exited {proc.returncode}:\n{err[-3000:]}")
    return out


def screenshot(url: str, shot: pathlib.Path, *, width: int = 1400, height: int = 900, min_bytes: int = 20_000,
               virtual_time_ms: int = 4000) -> pathlib.Path:
    """A PNG of url (after virtual_time_ms of the page's scripts) in shot; fails on an empty picture."""
    run(shot.parent / "chromium-profile", f"--screenshot={shot}", f"--window-size={width},{height}", url,
        virtual_time_ms=virtual_time_ms)
    data = shot.read_bytes() if shot.exists() else b""
    assert data[:8] == PNG_MAGIC and len(data) > min_bytes, f"{shot}: not a PNG of a drawn page ({len(data)} bytes)"
    return shot
