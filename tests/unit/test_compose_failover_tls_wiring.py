"""docker-compose.failover-tls.yml's etcd wiring, checked from the YAML alone (no Docker engine):
merged over docker-compose.yml + docker-compose.failover.yml + docker-compose.tls.yml, every etcd
member serves its clients https only and requires client certificates signed by etcd's own CA,
from a volume only the members mount; every syncer dials https:// endpoints with the etcd client
certificate, from a volume only the syncers mount; every member's peer links are https only and
require etcd's peer certificate (its CA, common name etcd-peer) from the members' volume; and the
one-shot `certs-failover` script writes those files (run here with a local `ddiloco`), keeping them
on a second run, and adds the peer certificate to a PKI written before peers had TLS.

Before client TLS the file left etcd plain HTTP without client certificates and the syncers
without any etcd TLS setting: every test here failed. Before peer TLS the peer URLs were plain
HTTP and the script wrote no peer certificate: the peer tests failed.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import yaml
from cryptography import x509

from ddiloco.cli import certs
from ddiloco.coord import etcd as etcd_lib
from services.syncer import config as syncer_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
FILES = [yaml.safe_load((ROOT / f).read_text()) for f in (
    "docker-compose.yml", "docker-compose.failover.yml", "docker-compose.tls.yml", "docker-compose.failover-tls.yml")]
ETCD = ("etcd-a", "etcd-b", "etcd-c")
SYNCERS = ("syncer", "syncer-b")


def _volumes(service: dict) -> dict[str, tuple[str, bool]]:
    """target -> (source, read only) of a service's short-syntax volumes."""
    out = {}
    for spec in service.get("volumes", []):
        source, target, *mode = spec.split(":")
        out[target] = (source, "ro" in mode)
    return out


def merged(name: str) -> dict:
    """Compose's merge of the keys checked here: environment, depends_on and healthcheck mappings
    merge, volumes merge by target path, other keys are replaced."""
    merged: dict = {"environment": {}, "depends_on": {}, "healthcheck": {}, "volumes": {}}
    for compose in FILES:
        service = compose["services"].get(name, {})
        for key, value in service.items():
            if key in ("environment", "depends_on", "healthcheck"):
                merged[key] = {**merged[key], **value}
            elif key == "volumes":
                merged["volumes"] = {**merged["volumes"], **_volumes(service)}
            else:
                merged[key] = value
    return merged


def _mounting(volume: str) -> set[str]:
    names = {n for compose in FILES for n in compose["services"]}
    return {n for n in names if any(source == volume for source, _ in merged(n)["volumes"].values())}


def test_every_etcd_member_requires_client_certificates_over_https() -> None:
    for name in ETCD:
        member = merged(name)
        env = member["environment"]
        assert env["ETCD_CLIENT_CERT_AUTH"] == "true", name
        assert env["ETCD_LISTEN_CLIENT_URLS"].startswith("https://"), name
        assert env["ETCD_ADVERTISE_CLIENT_URLS"] == f"https://{name}:2379", name
        for key, file in (("ETCD_TRUSTED_CA_FILE", "ca.pem"), ("ETCD_CERT_FILE", "tls.pem"),
                          ("ETCD_KEY_FILE", "tls.key")):
            directory, _, base = env[key].rpartition("/")
            assert base == file and member["volumes"][directory] == ("tls-etcd", True), (name, key)
        # No plaintext client listener is left: the only http one is the loopback health/metrics port.
        assert "http://" not in env["ETCD_LISTEN_CLIENT_URLS"], name
        assert env["ETCD_LISTEN_METRICS_URLS"].startswith("http://127.0.0.1:"), name
        port = env["ETCD_LISTEN_METRICS_URLS"].rsplit(":", 1)[1]
        assert f"/dev/tcp/127.0.0.1/{port}" in member["healthcheck"]["test"][-1], name
        assert member["depends_on"]["certs-failover"]["condition"] == "service_completed_successfully", name
    # etcd's server key is in a volume only etcd members and the job writing it mount.
    assert _mounting("tls-etcd") == {*ETCD, "certs-failover"}


def test_every_etcd_member_talks_to_its_peers_over_https_with_peer_certificates() -> None:
    expected_cluster = ",".join(f"{n}=https://{n}:2380" for n in ETCD)
    for name in ETCD:
        member = merged(name)
        env = member["environment"]
        assert env["ETCD_LISTEN_PEER_URLS"] == "https://0.0.0.0:2380", name
        assert env["ETCD_INITIAL_ADVERTISE_PEER_URLS"] == f"https://{name}:2380", name
        assert env["ETCD_INITIAL_CLUSTER"] == expected_cluster, name
        assert env["ETCD_PEER_CLIENT_CERT_AUTH"] == "true", name
        # Only etcd's peer certificate makes a member, not the syncers' client one of the same CA.
        assert env["ETCD_PEER_CERT_ALLOWED_CN"] == certs.ETCD_PEER, name
        for key, file in (("ETCD_PEER_TRUSTED_CA_FILE", "ca.pem"), ("ETCD_PEER_CERT_FILE", "peer.pem"),
                          ("ETCD_PEER_KEY_FILE", "peer.key")):
            directory, _, base = env[key].rpartition("/")
            assert base == file and member["volumes"][directory] == ("tls-etcd", True), (name, key)
        assert not [k for k, v in env.items() if "PEER" in k and str(v).startswith("http://")], name


def test_every_syncer_dials_etcd_over_https_with_its_client_certificate() -> None:
    for name in SYNCERS:
        syncer = merged(name)
        env = syncer["environment"]
        endpoints = env["DDILOCO_SYNCER_COORD_ETCD"]
        assert etcd_lib.endpoints_scheme(endpoints) == "https", name
        assert sorted(e.split(":")[0] for e in etcd_lib.parse_endpoints(endpoints)) == list(ETCD), name
        for key, file in (("COORD_TLS_CA", "ca.pem"), ("COORD_TLS_CERT", "tls.pem"), ("COORD_TLS_KEY", "tls.key")):
            directory, _, base = env[f"DDILOCO_SYNCER_{key}"].rpartition("/")
            assert base == file and syncer["volumes"][directory] == ("tls-etcd-client", True), (name, key)
        assert syncer["depends_on"]["certs-failover"]["condition"] == "service_completed_successfully", name
        # The settings parse as the syncer's own configuration would (https with a CA: consistent).
        coord = {k: v for k, v in env.items() if k.startswith("DDILOCO_SYNCER_COORD_") and "${" not in v}
        cfg = syncer_config.parse_config([], coord)
        assert cfg.coord_security().tls_cert.endswith("tls.pem") and not cfg.coord_security().insecure
    assert _mounting("tls-etcd-client") == {*SYNCERS, "certs-failover"}


def certs_failover_runner(root: pathlib.Path):
    """A function running the `certs-failover` script with its volumes as directories under `root`
    (`<root>/tls/...`) and a local `ddiloco`; it returns the script's output."""
    service = merged("certs-failover")
    script = service["command"][0].replace("$$", "$").replace("/tls/", f"{root}/tls/")
    script = script.replace("chown -R 10001:10001", "true")  # not root here
    for target in service["volumes"]:
        (root / target.lstrip("/")).mkdir(parents=True, exist_ok=True)
    shim = root / "bin" / "ddiloco"
    shim.parent.mkdir(exist_ok=True)
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m ddiloco.cli.main \"$@\"\n")
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{shim.parent}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}

    def run() -> str:
        done = subprocess.run(["/bin/sh", "-ec", script], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    return run


def test_certs_failover_writes_etcds_pki_once(tmp_path) -> None:
    run = certs_failover_runner(tmp_path)
    assert "etcd PKI written" in run()
    server_dir, client_dir = tmp_path / "tls" / "etcd", tmp_path / "tls" / "etcd-client"
    issued = (server_dir / "tls.pem").read_bytes()
    assert "etcd PKI exists: kept" in run()
    assert (server_dir / "tls.pem").read_bytes() == issued
    etcd_ca = x509.load_pem_x509_certificate((server_dir / "ca.pem").read_bytes())
    main_ca = x509.load_pem_x509_certificate((tmp_path / "tls" / "ca" / "ca.pem").read_bytes())
    assert (client_dir / "ca.pem").read_bytes() == (server_dir / "ca.pem").read_bytes()
    assert etcd_ca.subject != main_ca.subject  # the main CA's learners do not open etcd
    server = x509.load_pem_x509_certificate(issued)
    client = x509.load_pem_x509_certificate((client_dir / "tls.pem").read_bytes())
    assert server.issuer == client.issuer == etcd_ca.subject
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(ETCD) <= set(sans.get_values_for_type(x509.DNSName))
    assert (client_dir / "tls.key").stat().st_mode & 0o077 == 0


def test_certs_failover_writes_the_peer_certificate_also_to_an_older_etcd_pki(tmp_path) -> None:
    run = certs_failover_runner(tmp_path)
    assert "etcd PKI written" in run()
    server_dir = tmp_path / "tls" / "etcd"
    etcd_ca_pem = (server_dir / "ca.pem").read_bytes()
    peer = x509.load_pem_x509_certificate((server_dir / "peer.pem").read_bytes())
    assert peer.issuer == x509.load_pem_x509_certificate(etcd_ca_pem).subject
    assert peer.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == certs.ETCD_PEER
    sans = peer.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(ETCD) <= set(sans.get_values_for_type(x509.DNSName))
    usages = set(peer.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert {x509.ExtendedKeyUsageOID.SERVER_AUTH, x509.ExtendedKeyUsageOID.CLIENT_AUTH} <= usages  # both ends of a link
    # A PKI written before peers had TLS (no peer certificate): the next run adds it, keeping etcd's CA.
    (server_dir / "peer.pem").unlink()
    (server_dir / "peer.key").unlink()
    assert "etcd PKI written" in run()
    assert (server_dir / "ca.pem").read_bytes() == etcd_ca_pem and (server_dir / "peer.pem").exists()
    assert "etcd PKI exists: kept" in run()
