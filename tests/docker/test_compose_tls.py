"""docker-compose.tls.yml, the mutual-TLS override, checked without a Docker engine.

`docker compose -f docker-compose.yml -f docker-compose.tls.yml config` must accept the pair, and
the merged project must be wired as the override promises: every service waits for the one-shot
`certs` service, mounts only its own identity's volume (read-only) and is pointed at it through
DDILOCO_<SERVICE>_TLS_* variables, plaintext is switched off, healthchecks use the plaintext
health ports. The certs script itself runs here too (with a local `ddiloco` on PATH): it writes
for every volume exactly the identity the service mounting it claims, keys readable by the owner
only, and keeps an existing PKI. The default docker-compose.yml alone stays plaintext.
"""

from __future__ import annotations

import json
import os
import pathlib
import stat
import subprocess
import sys

import pytest
from cryptography import x509

from ddiloco.rpc import security
from tests.docker.conftest import REPO, run

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]

TLS_FILE = REPO / "docker-compose.tls.yml"
PREFIX = {"checkpoint": "DDILOCO_CHECKPOINT_", "syncer": "DDILOCO_SYNCER_", "learner-region-a": "DDILOCO_LEARNER_",
          "learner-region-b": "DDILOCO_LEARNER_", "chaos-learner": "DDILOCO_LEARNER_", "evaluator": "DDILOCO_EVAL_",
          "status": "DDILOCO_"}
KIND = {"checkpoint": "checkpoint", "syncer": "syncer", "evaluator": "evaluator", "status": "reader"}



def _config(env, *files: pathlib.Path) -> dict:
    args = [a for f in files for a in ("-f", str(f))]
    done = run(["docker", "compose", *args, "--profile", "eval", "--profile", "chaos", "--profile", "tools",
                "config", "--format", "json"], env=env, timeout=60)
    return json.loads(done.stdout)


def _mounts(service: dict) -> dict[str, dict]:
    return {m["target"]: m for m in service.get("volumes", [])}


def test_tls_override_is_valid_and_wires_every_service(compose_env):
    plain = _config(compose_env, REPO / "docker-compose.yml")
    assert "certs" not in plain["services"]
    assert all(s["environment"].get("DDILOCO_INSECURE") == "1" for n, s in plain["services"].items())

    project = _config(compose_env, REPO / "docker-compose.yml", TLS_FILE)
    services = project["services"]
    certs = services.pop("certs")
    assert certs["network_mode"] == "none" and certs["restart"] == "no"
    volumes_of_certs = {m["source"]: m["target"] for m in certs["volumes"]}
    assert set(services) == set(PREFIX)
    for name, service in services.items():
        env, prefix = service["environment"], PREFIX[name]
        if name != "status":
            assert service["depends_on"]["certs"]["condition"] == "service_completed_successfully", name
            assert env["DDILOCO_INSECURE"] == "0", name
        mount = _mounts(service)["/etc/ddiloco/tls"]
        assert mount["read_only"] and mount["source"] in volumes_of_certs and mount["source"] != "tls-ca", name
        for key, file in (("TLS_CA", "ca.pem"), ("TLS_CERT", "tls.pem"), ("TLS_KEY", "tls.key")):
            assert env[prefix + key] == f"/etc/ddiloco/tls/{file}", (name, key)
    # Learners have fixed ids, one replica each (identity is per learner under mutual TLS).
    for name in ("learner-region-a", "learner-region-b", "chaos-learner"):
        assert services[name]["deploy"]["replicas"] == 1
        assert _mounts(services[name])["/etc/ddiloco/tls"]["source"] == "tls-" + services[name]["environment"][
            "DDILOCO_LEARNER_LEARNER_ID"]
    # Servers keep a plaintext health port on loopback, where their healthchecks look.
    for name, port in (("syncer", 50061), ("checkpoint", 50062)):
        assert services[name]["environment"][PREFIX[name] + "HEALTH_BIND"] == f"127.0.0.1:{port}"
        assert services[name]["healthcheck"]["test"][-1] == f"127.0.0.1:{port}"
    # The certs script: every volume gets the identity its consumer claims.
    _check_certs_script(certs, services)


def _check_certs_script(certs: dict, services: dict) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        for target in (m["target"] for m in certs["volumes"]):
            (root / target.lstrip("/")).mkdir(parents=True)
        shim = root / "bin" / "ddiloco"
        shim.parent.mkdir()
        shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m ddiloco.cli.main \"$@\"\n")
        shim.chmod(0o755)
        script = certs["command"][0].replace("$$", "$").replace("/tls/", f"{root}/tls/")
        script = script.replace("chown -R 10001:10001", "true")  # not root here
        env = {**os.environ, "PATH": f"{shim.parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
        for expected in ("PKI written", "PKI exists: kept"):  # the second run keeps the first PKI
            done = subprocess.run(["/bin/sh", "-ec", script], env=env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0 and expected in done.stdout, done.stdout + done.stderr
        volume_dir = {m["source"]: root / m["target"].lstrip("/") for m in certs["volumes"]}
        assert sorted(p.name for p in volume_dir["tls-ca"].iterdir()).count("ca.key") == 1
        for name, service in services.items():
            directory = volume_dir[_mounts(service)["/etc/ddiloco/tls"]["source"]]
            assert sorted(p.name for p in directory.iterdir()) == ["ca.pem", "tls.key", "tls.pem"], name
            assert stat.S_IMODE((directory / "tls.key").stat().st_mode) == 0o600, name
            cert = x509.load_pem_x509_certificate((directory / "tls.pem").read_bytes())
            uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
                x509.UniformResourceIdentifier)
            identity = security.Identity.parse(uris[0])
            learner_id = service["environment"].get("DDILOCO_LEARNER_LEARNER_ID")
            if learner_id:
                assert identity == security.Identity("learner", learner_id), name
            else:
                assert identity.kind == KIND[name], (name, identity)
            dns = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
                x509.DNSName)
            if name in ("syncer", "checkpoint"):  # clients dial syncer:50051 and checkpoint:50052
                assert name in dns, dns
