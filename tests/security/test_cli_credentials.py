"""The read-only tools under mutual TLS: `ddiloco status`, `ddiloco dashboard` and the dashboard of
`ddiloco up --tls --dashboard` read a syncer with a reader certificate; without one (or with a
learner's) they fail at once with a message saying what to pass: exit code 2, no traceback."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from rich.console import Console

from ddiloco.cli import up as up_cli
from tests.security.conftest import client_security, reader_flags

pytestmark = pytest.mark.timeout(180)

_DDILOCO = [sys.executable, "-m", "ddiloco.cli.main"]




def _status(address: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([*_DDILOCO, "status", "--json", "--target", address, "--timeout-s", "5", *flags],
                          capture_output=True, text=True, timeout=60)


def _no_traceback(result: subprocess.CompletedProcess) -> bool:
    return "Traceback" not in result.stdout + result.stderr


def test_status_reads_with_a_reader_certificate_and_explains_every_refusal(mtls_syncer, pki):
    ok = _status(mtls_syncer.address, *reader_flags(pki))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert json.loads(ok.stdout.splitlines()[-1])["run_id"] == "security"

    cases = {
        "plaintext": ((), "probably serves mutual TLS"),
        "explicit plaintext": (("--insecure",), "probably serves mutual TLS"),
        "TLS without a client certificate": (("--tls-ca", str(pki / "ca.pem")), "requires mutual TLS"),
        "a learner's certificate": (reader_flags(pki, "learner-0"), "refused these credentials"),
        "another CA": (["--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(pki / "rogue.pem"),
                        "--tls-key", str(pki / "rogue.key")], "TLS handshake failed"),
    }
    for what, (flags, hint) in cases.items():
        result = _status(mtls_syncer.address, *flags)
        out = " ".join((result.stdout + result.stderr).split())  # rich wraps long lines
        assert result.returncode == 2 and hint in out and _no_traceback(result), (what, out)
    # Contradictory or missing files: a usage error before any call.
    for flags, hint in (((*reader_flags(pki), "--insecure"), "contradicts"),
                        (("--tls-ca", str(pki / "missing.pem")), "cannot read CA bundle")):
        result = _status(mtls_syncer.address, *flags)
        assert result.returncode == 2 and hint in " ".join(result.stdout.split()) and _no_traceback(result), result


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def _wait_available(url: str, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    state = {}
    while time.monotonic() < deadline:
        state = _get_json(url + "api/state")
        if state["available"]:
            return state
        time.sleep(0.2)
    raise AssertionError(f"dashboard never reached the syncer: {state.get('error')}")


def test_dashboard_serves_with_a_reader_certificate_and_refuses_to_start_without(mtls_syncer, pki):
    proc = subprocess.Popen([*_DDILOCO, "dashboard", "--target", mtls_syncer.address, "--bind", "127.0.0.1:0",
                             "--interval-s", "0.2", *reader_flags(pki)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("dashboard: http://"), line + proc.stderr.read()
        state = _wait_available(line.split()[1])
        assert state["run_id"] == "security"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    for flags, hint in (((), "probably serves mutual TLS"), (reader_flags(pki, "learner-0"), "refused these credentials")):
        result = subprocess.run([*_DDILOCO, "dashboard", "--target", mtls_syncer.address, "--bind", "127.0.0.1:0",
                                 "--timeout-s", "5", *flags], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and hint in result.stderr and _no_traceback(result), result


def test_dashboard_of_up_uses_the_clusters_reader_credential(mtls_syncer, pki):
    # `ddiloco up --tls --dashboard` passes LocalCluster.client_security() (the operator's reader
    # certificate, as here) to the dashboard it starts in-process.
    console = Console(file=io.StringIO())
    dashboard = up_cli._start_dashboard(console, mtls_syncer.address, "127.0.0.1:0", client_security(pki, "operator"))
    assert dashboard is not None, console.file.getvalue()
    try:
        assert _wait_available(dashboard.url)["run_id"] == "security"
    finally:
        dashboard.stop()
