"""External programs the tests run (a headless browser, promtool), each found by a script under
scripts/ that installs it if missing and prints its path on its last line.

A missing program fails the test that asked for it: it never skips, so CI cannot pass without
having run it.
"""

from __future__ import annotations

import functools
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_SETUP_TIMEOUT_S = 1500  # a first install from the package archive on a slow mirror


@functools.cache
def _find(script: str, what: str) -> tuple[str | None, str]:
    """(path, "") from scripts/<script> (run once per session), or (None, why not)."""
    try:
        result = subprocess.run(["bash", str(ROOT / "scripts" / script)], capture_output=True, text=True,
                                timeout=_SETUP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"scripts/{script} did not finish within {_SETUP_TIMEOUT_S // 60} minutes"
    if result.returncode != 0 or not result.stdout.strip():
        return None, f"no {what} (scripts/{script} exited {result.returncode}):\n{result.stderr[-3000:]}"
    return result.stdout.strip().splitlines()[-1], ""


def require(script: str, what: str) -> str:
    """The path of the program scripts/<script> provides; fails the calling test when there is none."""
    path, error = _find(script, what)
    if path is None:
        pytest.fail(error)
    return path
