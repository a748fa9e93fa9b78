"""Prometheus's promtool for the tests, from scripts/promtool_env.sh (Debian's package if missing).

No promtool fails the test that asked for it: it never skips, so CI cannot pass without having
checked the metrics and the alerting rules.
"""

from __future__ import annotations

import pathlib
import subprocess

from tests import tools

ROOT = pathlib.Path(__file__).resolve().parents[1]


def promtool() -> str:
    """The path of a working promtool; fails the calling test when there is none."""
    return tools.require("promtool_env.sh", "promtool")


def run(*args: str, stdin: str | None = None, cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
    """promtool ARGS, bounded in time; the caller checks the result."""
    return subprocess.run([promtool(), *args], input=stdin, capture_output=True, text=True, timeout=120, cwd=cwd)


def check_metrics(exposition: str, what: str) -> None:
    """`promtool check metrics` must find no problem at all (exit 0 and no lint message)."""
    result = run("check", "metrics", stdin=exposition)
    problems = (result.stdout + result.stderr).strip()
    assert result.returncode == 0 and not problems, f"promtool check metrics on {what}:\n{problems}"
