"""What build of ddiloco is running: the package version and the git commit it was built from.

Owns: ``version()`` (from the installed package's metadata, importlib.metadata) and ``commit()``
(the ``BUILD_COMMIT`` file a build writes next to this module, e.g. the Dockerfile's
``GIT_COMMIT`` build argument; else the commit of the git checkout this module sits in; else
"unknown"), and ``describe()``, the one line every entry point's ``--version`` prints.
Must not: read environment variables (a service passes nothing in: the answer is the build's).
"""

from __future__ import annotations

import functools
import importlib.metadata
import pathlib
import subprocess

import ddiloco

UNKNOWN = "unknown"
COMMIT_FILE = pathlib.Path(__file__).with_name("BUILD_COMMIT")
_GIT_TIMEOUT_S = 2.0  # a git call that hangs (a network file system) must not hold a service's start


@functools.cache
def version() -> str:
    """The installed distribution's version; the source tree's when it is not installed."""
    try:
        return importlib.metadata.version("ddiloco")
    except importlib.metadata.PackageNotFoundError:
        return ddiloco.__version__


@functools.cache
def commit() -> str:
    """The git commit of this build: 40 hex digits, or "unknown"."""
    try:
        recorded = COMMIT_FILE.read_text().strip()
    except OSError:
        recorded = ""
    if recorded and recorded != UNKNOWN:
        return recorded
    # A source checkout (development, the test suite, `ddiloco up` from the repository): ask git.
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=pathlib.Path(__file__).parent, capture_output=True,
                             text=True, timeout=_GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return UNKNOWN
    head = out.stdout.strip()
    return head if out.returncode == 0 and len(head) == 40 else UNKNOWN


def describe(prog: str = "ddiloco") -> str:
    """``<prog> <version> (commit <sha>)``: what ``--version`` prints."""
    return f"{prog} {version()} (commit {commit()})"
