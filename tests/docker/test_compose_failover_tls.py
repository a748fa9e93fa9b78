"""docker-compose.failover-tls.yml: mutual TLS for the failover stack, checked without a Docker engine.

`docker compose config` must accept docker-compose.yml + docker-compose.failover.yml +
docker-compose.tls.yml + docker-compose.failover-tls.yml, and in the merged project the second hub
must be wired like the first: syncer-b and checkpoint-b off plaintext, on the same certificate
volumes, variables, deny list and plaintext health ports as syncer and checkpoint, both syncers
still differing only in their advertised address, and every server waiting for the re-issued
certificates. The two certificate scripts (`certs`, then `certs-failover`) run here too, with a
local `ddiloco` on PATH: the syncer's certificate names both syncers and the store's both stores,
under their services' identities, a second run keeps them, and a mutual-TLS handshake with the
evaluator's credentials succeeds under either syncer's name. Without the fourth file (the three
files alone) syncer-b and checkpoint-b stayed plaintext and the certificates named neither, so a
TLS client reached no second-hub container; the first test fails on that project.
"""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import stat
import subprocess
import sys
import tempfile

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ddiloco.rpc import channel as channel_lib
from ddiloco.rpc import security
from tests.docker.conftest import REPO
from tests.docker.test_compose_tls import _config, _mounts

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]

FILES = [REPO / f for f in ("docker-compose.yml", "docker-compose.failover.yml", "docker-compose.tls.yml",
                            "docker-compose.failover-tls.yml")]
SERVERS = {"syncer": ("DDILOCO_SYNCER_", 50061), "syncer-b": ("DDILOCO_SYNCER_", 50061),
           "checkpoint": ("DDILOCO_CHECKPOINT_", 50062), "checkpoint-b": ("DDILOCO_CHECKPOINT_", 50062)}



def test_the_second_hub_speaks_tls_like_the_first(compose_env):
    services = _config(compose_env, *FILES)["services"]
    for name, service in services.items():
        if name.startswith("etcd-") or name.startswith("certs"):
            continue  # etcd has TLS of its own (tests/unit/test_compose_failover_tls_wiring.py); certs has no network
        env = service["environment"]
        assert env.get("DDILOCO_INSECURE", "0") == "0", name
        assert _mounts(service)["/etc/ddiloco/tls"]["read_only"], name
    for name, (prefix, health_port) in SERVERS.items():
        service, twin = services[name], services[name.removesuffix("-b")]
        env = service["environment"]
        for key, file in (("TLS_CA", "ca.pem"), ("TLS_CERT", "tls.pem"), ("TLS_KEY", "tls.key")):
            assert env[prefix + key] == f"/etc/ddiloco/tls/{file}", (name, key)
        assert env[prefix + "TLS_DENY_LIST"] == "/etc/ddiloco/deny/deny.txt", name
        assert env[prefix + "HEALTH_BIND"] == f"127.0.0.1:{health_port}", name
        assert service["healthcheck"]["test"][-1] == f"127.0.0.1:{health_port}", name
        mounts, twin_mounts = _mounts(service), _mounts(twin)
        for target in ("/etc/ddiloco/tls", "/etc/ddiloco/deny"):
            assert mounts[target]["source"] == twin_mounts[target]["source"], (name, target)
        for certs in ("certs", "certs-failover"):
            assert service["depends_on"][certs]["condition"] == "service_completed_successfully", (name, certs)
    a, b = services["syncer"]["environment"], services["syncer-b"]["environment"]
    differ = {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    assert differ == {"DDILOCO_SYNCER_COORD_ADVERTISE"}, differ
    # Every client is given both syncers (the TLS file does not narrow the failover file's lists).
    for name in ("learner-region-a", "learner-region-b", "chaos-learner"):
        assert services[name]["environment"]["DDILOCO_LEARNER_SYNCER"] == "syncer:50051,syncer-b:50051", name
    assert services["evaluator"]["environment"]["DDILOCO_EVAL_SYNCER"] == "syncer:50051,syncer-b:50051"
    assert services["certs-failover"]["network_mode"] == "none"


def test_etcd_peers_speak_tls_with_peer_certificates_in_the_merged_project(compose_env):
    """Compose's own merge of the four files: every member's peer URLs are https only (listen,
    advertise, the initial cluster), peer certificates are required (etcd's CA, common name
    etcd-peer) and every TLS file a member is given lies in the read-only tls-etcd volume, which
    `certs-failover` fills. The three files without the fourth leave the peers on http."""
    services = _config(compose_env, *FILES)["services"]
    members = ("etcd-a", "etcd-b", "etcd-c")
    cluster = ",".join(f"{m}=https://{m}:2380" for m in members)
    for name in members:
        env, mounts = services[name]["environment"], _mounts(services[name])
        assert env["ETCD_LISTEN_PEER_URLS"] == "https://0.0.0.0:2380", name
        assert env["ETCD_INITIAL_ADVERTISE_PEER_URLS"] == f"https://{name}:2380", name
        assert env["ETCD_INITIAL_CLUSTER"] == cluster, name
        assert env["ETCD_PEER_CLIENT_CERT_AUTH"] == "true" and env["ETCD_PEER_CERT_ALLOWED_CN"] == "etcd-peer", name
        assert env["ETCD_CLIENT_CERT_AUTH"] == "true" and env["ETCD_LISTEN_CLIENT_URLS"].startswith("https://"), name
        for key in ("ETCD_PEER_TRUSTED_CA_FILE", "ETCD_PEER_CERT_FILE", "ETCD_PEER_KEY_FILE", "ETCD_TRUSTED_CA_FILE",
                    "ETCD_CERT_FILE", "ETCD_KEY_FILE"):
            mount = mounts[env[key].rpartition("/")[0]]
            assert mount["source"].endswith("tls-etcd") and mount["read_only"], (name, key)
    written = services["certs-failover"]["command"][0]
    for file in ("ca.pem", "peer.pem", "peer.key", "tls.pem", "tls.key"):
        assert f"/tls/etcd/{file}" in written, file
    plain = _config(compose_env, *FILES[:3])["services"]
    assert all(plain[m]["environment"]["ETCD_LISTEN_PEER_URLS"].startswith("http://") for m in members)


def _script(service: dict, root: pathlib.Path) -> str:
    script = service["command"][0].replace("$$", "$").replace("/tls/", f"{root}/tls/")
    return script.replace("chown -R 10001:10001", "true")  # not root here


def _sans(path: pathlib.Path) -> tuple[security.Identity, list[str]]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return security.Identity.parse(sans.get_values_for_type(x509.UniformResourceIdentifier)[0]), \
        sans.get_values_for_type(x509.DNSName)


def test_the_certificates_name_both_hubs_and_are_kept_by_a_second_run(compose_env):
    services = _config(compose_env, *FILES)["services"]
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        for target in {m["target"] for s in ("certs", "certs-failover") for m in services[s]["volumes"]}:
            (root / target.lstrip("/")).mkdir(parents=True, exist_ok=True)
        shim = root / "bin" / "ddiloco"
        shim.parent.mkdir()
        shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m ddiloco.cli.main \"$@\"\n")
        shim.chmod(0o755)
        env = {**os.environ, "PATH": f"{shim.parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)}

        def run_script(name: str) -> str:
            done = subprocess.run(["/bin/sh", "-ec", _script(services[name], root)], env=env, capture_output=True,
                                  text=True, timeout=120)
            assert done.returncode == 0, done.stdout + done.stderr
            return done.stdout

        assert "PKI written" in run_script("certs")
        assert "failover SANs written" in run_script("certs-failover")
        issued = {name: (root / "tls" / name / "tls.pem").read_bytes() for name in ("syncer", "checkpoint")}
        assert "PKI exists: kept" in run_script("certs")
        assert "failover SANs exist: kept" in run_script("certs-failover")
        ca_pem = (root / "tls" / "ca" / "ca.pem").read_bytes()
        for name in ("syncer", "checkpoint"):
            directory = root / "tls" / name
            assert (directory / "tls.pem").read_bytes() == issued[name], name  # the second run kept them
            assert (directory / "ca.pem").read_bytes() == ca_pem, name  # the same CA every client trusts
            assert stat.S_IMODE((directory / "tls.key").stat().st_mode) == 0o600, name
            identity, dns = _sans(directory / "tls.pem")
            assert identity == security.Identity(name, name), identity
            assert {name, f"{name}-b"} <= set(dns), dns
        # Only the servers' certificates gained the second hub's names.
        for name in ("evaluator", "operator", "region-a-0"):
            assert not any(d.endswith("-b") for d in _sans(root / "tls" / name / "tls.pem")[1]), name
        # A real mutual-TLS handshake: the evaluator's credentials reach a server holding the
        # syncer volume's certificate under either syncer's name, and under no other.
        assert _handshake(root / "tls" / "syncer", root / "tls" / "evaluator", "syncer-b")
        assert _handshake(root / "tls" / "syncer", root / "tls" / "evaluator", "syncer")
        assert not _handshake(root / "tls" / "syncer", root / "tls" / "evaluator", "checkpoint-b")


def _handshake(server_dir: pathlib.Path, client_dir: pathlib.Path, server_name: str) -> bool:
    """Whether a health check over mutual TLS succeeds, the client expecting `server_name`."""
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    credentials = security.ServerSecurity(tls_ca=str(server_dir / "ca.pem"), tls_cert=str(server_dir / "tls.pem"),
                                          tls_key=str(server_dir / "tls.key")).credentials()
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    client = security.ClientSecurity(tls_ca=str(client_dir / "ca.pem"), tls_cert=str(client_dir / "tls.pem"),
                                     tls_key=str(client_dir / "tls.key"), tls_server_name=server_name)
    channel = channel_lib.sync_channel(f"127.0.0.1:{port}", client)
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5.0)
        return True
    except grpc.RpcError:
        return False
    finally:
        channel.close()
        server.stop(None)
