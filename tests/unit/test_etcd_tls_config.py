"""Client TLS towards etcd without an etcd: the syncer's --coord-tls-* flags are checked when parsed,
and `ddiloco certs --etcd-names` writes etcd's own PKI (tests/integration/test_coord_etcd_tls.py
runs them against a real etcd with --client-cert-auth)."""

from __future__ import annotations

import pytest
from cryptography import x509

from ddiloco.cli import certs
from ddiloco.cli import main as cli_main
from ddiloco.coord import etcd as etcd_lib
from services.syncer import config as config_lib


def test_etcd_tls_flags_are_checked_at_parse_time(capsys):
    """Contradictions and half settings are refused before anything starts (config only, no etcd)."""
    base = ["--insecure", "--coord-etcd"]
    cases = {  # what the error says -> flags
        "https:// endpoints need --coord-tls-ca": [*base, "https://a:1"],
        "http:// endpoints contradict --coord-tls-ca": [*base, "http://a:1", "--coord-tls-ca", "ca.pem"],
        "mix schemes": [*base, "https://a:1,b:2", "--coord-tls-ca", "ca.pem"],
        "--coord-tls-cert and --coord-tls-key go together": [*base, "https://a:1", "--coord-tls-ca", "ca.pem",
                                                             "--coord-tls-cert", "c.pem"],
        "needs --coord-tls-ca": [*base, "a:1", "--coord-tls-cert", "c.pem", "--coord-tls-key", "c.key"],
        "it needs --coord-etcd": ["--insecure", "--coord-tls-ca", "ca.pem"],
        "is not [https://]host:port": [*base, "https://a:1/path", "--coord-tls-ca", "ca.pem"],
    }
    for expected, argv in cases.items():
        with pytest.raises(SystemExit):
            config_lib.parse_config(argv, {})
        assert expected in capsys.readouterr().err, expected
    cfg = config_lib.parse_config([*base, "https://a:1,https://b:2", "--coord-tls-ca", "ca.pem"], {})
    assert etcd_lib.parse_endpoints(cfg.coord_etcd) == ["a:1", "b:2"]
    assert etcd_lib.endpoints_scheme(cfg.coord_etcd) == "https"
    assert cfg.coord_security().tls_ca == "ca.pem" and not cfg.coord_security().insecure
    assert config_lib.parse_config([*base, "a:1"], {}).coord_security().insecure


def test_certs_writes_an_etcd_pki_of_its_own(tmp_path):
    """`ddiloco certs --etcd-names`: a separate CA (learners' certificates must not open etcd), a
    server certificate naming the members, a client certificate; the CA is kept on a second run."""
    certs.write_dev_certs(tmp_path, learners=["learner-0"], services=["syncer"])
    certs.write_etcd_certs(tmp_path, names=["etcd-a", "etcd-b"])
    ca = (tmp_path / "etcd-ca.pem").read_bytes()
    server = x509.load_pem_x509_certificate((tmp_path / "etcd-server.pem").read_bytes())
    client = x509.load_pem_x509_certificate((tmp_path / "etcd-client.pem").read_bytes())
    etcd_ca = x509.load_pem_x509_certificate(ca)
    main_ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    assert etcd_ca.subject != main_ca.subject and server.issuer == client.issuer == etcd_ca.subject
    learner = x509.load_pem_x509_certificate((tmp_path / "learner-0.pem").read_bytes())
    assert learner.issuer != etcd_ca.subject
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"etcd-a", "etcd-b", "localhost"} <= set(names.get_values_for_type(x509.DNSName))
    assert (tmp_path / "etcd-client.key").stat().st_mode & 0o077 == 0
    # The members' peer certificate: the same CA and names, its own common name (--peer-cert-allowed-cn).
    peer = x509.load_pem_x509_certificate((tmp_path / "etcd-peer.pem").read_bytes())
    assert peer.issuer == etcd_ca.subject
    assert peer.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == certs.ETCD_PEER
    peer_names = peer.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"etcd-a", "etcd-b"} <= set(peer_names.get_values_for_type(x509.DNSName))
    assert (tmp_path / "etcd-peer.key").stat().st_mode & 0o077 == 0
    certs.write_etcd_certs(tmp_path, names=["etcd-a"])
    assert (tmp_path / "etcd-ca.pem").read_bytes() == ca
    with pytest.raises(ValueError):
        certs.write_etcd_certs(tmp_path, names=[])


def test_certs_command_writes_the_etcd_files(tmp_path, capsys):
    assert cli_main.main(["certs", "--out", str(tmp_path), "--learners", "", "--services", "",
                          "--etcd-names", "etcd-a,etcd-b,etcd-c"]) == 0
    for stem in ("etcd-ca", certs.ETCD_SERVER, certs.ETCD_CLIENT):
        assert (tmp_path / f"{stem}.pem").exists() and (tmp_path / f"{stem}.key").exists()
    out = capsys.readouterr().out
    assert "--trusted-ca-file" in out and "--coord-tls-cert" in out
