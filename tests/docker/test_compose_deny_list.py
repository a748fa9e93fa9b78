"""The certificate deny list in docker-compose.tls.yml, checked without a Docker engine: the certs
service creates the list (and keeps an existing one), the syncer and the store read it read-only
through DDILOCO_*_TLS_DENY_LIST, nothing else mounts it, and the `certs-revoke` service (profile
admin) appends an entry the servers' parser accepts."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from ddiloco.rpc import security
from tests.docker.conftest import REPO, run

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]

TLS_FILE = REPO / "docker-compose.tls.yml"
DENY = "/etc/ddiloco/deny/deny.txt"


def _project(env) -> dict:
    done = run(["docker", "compose", "-f", str(REPO / "docker-compose.yml"), "-f", str(TLS_FILE),
                "--profile", "eval", "--profile", "chaos", "--profile", "tools", "--profile", "admin",
                "config", "--format", "json"], env=env, timeout=60)
    return json.loads(done.stdout)


def test_deny_list_is_wired_into_the_servers_only_and_revoke_appends_to_it(compose_env, tmp_path):
    services = _project(compose_env)["services"]
    for name, prefix in (("syncer", "DDILOCO_SYNCER_"), ("checkpoint", "DDILOCO_CHECKPOINT_")):
        (mount,) = [m for m in services[name]["volumes"] if m["source"] == "tls-deny"]
        assert mount["read_only"] and mount["target"] == "/etc/ddiloco/deny", name
        assert services[name]["environment"][prefix + "TLS_DENY_LIST"] == DENY, name
    readers = {n for n, s in services.items() if any(m.get("source") == "tls-deny" for m in s.get("volumes", []))}
    assert readers == {"syncer", "checkpoint", "certs", "certs-revoke"}
    revoke = services["certs-revoke"]
    assert revoke["network_mode"] == "none" and revoke["profiles"] == ["admin"]
    assert revoke["entrypoint"] == ["ddiloco", "certs", "revoke", "--deny-list", "/tls/deny/deny.txt"]

    # The certs script creates the list; certs-revoke's entrypoint appends to it.
    for target in (m["target"] for m in services["certs"]["volumes"]):
        (tmp_path / target.lstrip("/")).mkdir(parents=True)
    shim = tmp_path / "bin" / "ddiloco"
    shim.parent.mkdir()
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m ddiloco.cli.main \"$@\"\n")
    shim.chmod(0o755)
    script = services["certs"]["command"][0].replace("$$", "$").replace("/tls/", f"{tmp_path}/tls/")
    script = script.replace("chown -R 10001:10001", "true")  # not root here
    env = {**os.environ, "PATH": f"{shim.parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    done = subprocess.run(["/bin/sh", "-ec", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    deny = tmp_path / "tls" / "deny" / "deny.txt"
    assert security.parse_deny_list(deny.read_text()) == (frozenset(), frozenset())
    argv = [str(tmp_path / a.lstrip("/")) if a.startswith("/tls/") else a for a in revoke["entrypoint"]]
    done = subprocess.run([*argv, "--identity", "learner/region-b-chaos"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert security.parse_deny_list(deny.read_text())[1] == {security.Identity("learner", "region-b-chaos")}
    # A second certs run (a restart) keeps the list as it is.
    subprocess.run(["/bin/sh", "-ec", script], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert security.parse_deny_list(deny.read_text())[1] == {security.Identity("learner", "region-b-chaos")}
    assert pathlib.Path(deny).exists()
