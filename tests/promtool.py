"""Prometheus's promtool for the tests, from scripts/promtool_env.sh (Debian's package if missing).

No promtool fails the test that asked for it: it never skips, so CI cannot pass without having
checked the metrics and the alerting rules.
"""

from __future__ import annotations

import functools
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@functools.cache
def _path() -> tuple[str | None, str]:
    try:
        result = subprocess.run(["bash", str(ROOT / "scripts" / "promtool_env.sh")], capture_output=True, text=True,
                                timeout=1500)
    except subprocess.TimeoutExpired:
        return None, "scripts/promtool_env.sh did not finish within 25 minutes"
    if result.returncode != 0 or not result.stdout.strip():
        return None, f"no promtool (scripts/promtool_env.sh exited {result.returncode}):\n{result.stderr[-3000:]}"
    return result.stdout.strip().splitlines()[-1], ""


def promtool() -> str:
    """The path of a working promtool; fails the calling test when there is none."""
    path, error = _path()
    if path is None:
        pytest.fail(error)
    return path


def run(*args: str, stdin: str | None = None, cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
    """promtool ARGS, bounded in time; the caller checks the result."""
    return subprocess.run([promtool(), *args], input=stdin, capture_output=True, text=True, timeout=120, cwd=cwd)


def check_metrics(exposition: str, what: str) -> None:
    """`promtool check metrics` must find no problem at all (exit 0 and no lint message)."""
    result = run("check", "metrics", stdin=exposition)
    problems = (result.stdout + result.stderr).strip()
    assert result.returncode == 0 and not problems, f"promtool check metrics on {what}:\n{problems}"
