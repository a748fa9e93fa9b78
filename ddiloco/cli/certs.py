"""`ddiloco certs`: a development CA plus per-service and per-learner certificates (and tokens),
and `ddiloco certs revoke`, which adds a certificate to a servers' deny list.

    ddiloco certs --out certs --learners learner-0,learner-1 --services syncer,checkpoint,evaluator,operator \
        --model-readers exporter

writes `ca.pem` and `ca.key`, and `<name>.pem` / `<name>.key` for every learner, service and model
reader. An existing `ca.pem` + `ca.key` in `--out` is reused, so certificates added later (a new
learner) are signed by the same CA. With `--tokens` it also writes `tokens.json` (the syncer's token
file: token -> identity, plus an empty revocation list) and one `<name>.token` per identity, for
deployments that terminate TLS elsewhere.

Identity lives in a URI SAN, `spiffe://ddiloco/<kind>/<name>` (`ddiloco.rpc.security`):
learners are kind `learner`; the services `syncer`, `checkpoint` and `evaluator` are their own
kind; any other service name (`operator`, ...) gets the kind `reader`, which reads the training
state but not the model; `--model-readers` names get `model-reader`, which may also download the
model's weights (WatchFragments, the store's GetBlob). Every certificate
also carries DNS SANs `localhost`, its own name and `--dns-names`, and the IP SAN 127.0.0.1, and is
valid for both server and client authentication (ECDSA P-256, SHA-256).

    ddiloco certs revoke --deny-list deny.txt (--cert certs/learner-3.pem | --serial HEX | --identity ID)

appends the certificate's serial number (or the serial or identity given) to the deny list that
the syncer and the store read with `--tls-deny-list`; they re-read it within a second, without a
restart. The file is replaced atomically, so a server never reads half of it. See docs/security.md.

    ddiloco certs --out certs --etcd-names etcd-a,etcd-b,etcd-c

also writes etcd's own PKI for client TLS towards etcd (docs/failover.md): `etcd-ca.pem`/`.key`, a
CA of its own (reused when present), `etcd-server.pem`/`.key` for the etcd members (etcd's
--cert-file/--key-file; DNS SANs the names given, localhost and IP 127.0.0.1) and
`etcd-client.pem`/`.key`, the syncers' client certificate (their --coord-tls-cert/--coord-tls-key),
and `etcd-peer.pem`/`.key`, the members' certificate towards each other (etcd's --peer-cert-file/
--peer-key-file; the same DNS SANs as the server's, common name `etcd-peer`, which the members
require of each other with --peer-cert-allowed-cn: the syncers' client certificate, signed by the
same CA, must not join the cluster as a member). A separate CA because etcd started with --client-cert-auth --trusted-ca-file admits every
certificate that CA signed, with full access to the keys that fence leadership: learners'
certificates must not chain to it.

These are development credentials: keys are written unencrypted (mode 0600). For production use
your own PKI (cert-manager, Vault, ...) with the same SAN scheme.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import json
import os
import pathlib
import secrets
from collections.abc import Iterable, Sequence

from ddiloco import extras
from ddiloco.rpc import security

try:  # the `certificates` extra: without it `ddiloco --help` still works, and making a certificate says what to install
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
except ImportError as _exc:
    _MISSING: ImportError | None = _exc
else:
    _MISSING = None

_CA_NAME = "ddiloco development CA"


def _need_cryptography() -> None:
    if _MISSING is not None:
        raise extras.missing("cryptography", "certificates") from _MISSING


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_ca(common_name: str = _CA_NAME, *, days: int = 3650) -> tuple[bytes, bytes]:
    """A self-signed CA certificate and its key, both PEM: (cert_pem, key_pem)."""
    _need_cryptography()
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def issue_cert(
    ca_cert_pem: bytes,
    ca_key_pem: bytes,
    identity: security.Identity | str,
    *,
    dns_names: Iterable[str] = (),
    days: int = 825,
    not_before: datetime.datetime | None = None,
    not_after: datetime.datetime | None = None,
) -> tuple[bytes, bytes]:
    """A leaf certificate for `identity`, signed by the CA: (cert_pem, key_pem).

    SANs: the identity URI, DNS localhost + `identity.name` + `dns_names`, IP 127.0.0.1.
    `not_before`/`not_after` override the validity window (tests use them for expired certs).
    A plain string instead of an identity is only a common name (no URI SAN): a certificate for
    something other than ddiloco's services, e.g. etcd.
    """
    _need_cryptography()
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    start = not_before or now - datetime.timedelta(minutes=5)
    end = not_after or now + datetime.timedelta(days=days)
    name = identity if isinstance(identity, str) else identity.name
    dns = list(dict.fromkeys(["localhost", name, *dns_names]))
    sans: list[x509.GeneralName] = [] if isinstance(identity, str) else [x509.UniformResourceIdentifier(identity.uri)]
    sans += [x509.DNSName(d) for d in dns if d]
    subject = [x509.NameAttribute(NameOID.COMMON_NAME, name)]
    if not isinstance(identity, str):
        subject.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, identity.kind))
    sans.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(subject))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_cert_sign=False,
                                     crl_sign=False, content_commitment=False, data_encipherment=False,
                                     key_agreement=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def model_reader_identity(name: str) -> security.Identity:
    """The identity of a model reader's certificate (reads the state and the model's weights)."""
    return security.Identity(security.KIND_MODEL_READER, name)


def service_identity(name: str) -> security.Identity:
    """The identity of a service certificate: syncer/checkpoint/evaluator keep their kind, others are readers."""
    kind = name if name in (security.KIND_SYNCER, security.KIND_CHECKPOINT, security.KIND_EVALUATOR) \
        else security.KIND_READER
    return security.Identity(kind, name)


def _write(path: pathlib.Path, data: bytes, *, secret: bool) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _ca_in(root: pathlib.Path, stem: str, common_name: str) -> tuple[bytes, bytes]:
    """The CA `root/<stem>.pem` + `<stem>.key`: reused when both exist (re-running `certs` extends a
    PKI instead of replacing it), else made and written. Returns (cert_pem, key_pem)."""
    root.mkdir(parents=True, exist_ok=True)
    ca_pem_path, ca_key_path = root / f"{stem}.pem", root / f"{stem}.key"
    if ca_pem_path.exists() and ca_key_path.exists():
        return ca_pem_path.read_bytes(), ca_key_path.read_bytes()
    ca_pem, ca_key = make_ca(common_name)
    _write(ca_key_path, ca_key, secret=True)
    _write(ca_pem_path, ca_pem, secret=False)
    return ca_pem, ca_key


def write_dev_certs(
    out: str | os.PathLike,
    *,
    learners: Sequence[str] = (),
    services: Sequence[str] = ("syncer", "checkpoint", "evaluator", "operator"),
    dns_names: Sequence[str] = (),
    days: int = 825,
    tokens: bool = False,
    model_readers: Sequence[str] = (),
) -> dict[str, security.Identity]:
    """Writes (or extends) a development PKI in `out`; returns {file stem: identity}.

    Reuses `out/ca.pem` + `out/ca.key` when both exist. Names must be unique across learners and
    services (they name the files).
    """
    _need_cryptography()  # before anything is written
    root = pathlib.Path(out)
    ca_pem, ca_key = _ca_in(root, "ca", _CA_NAME)
    identities: dict[str, security.Identity] = {}
    for name in learners:
        identities[name] = security.Identity(security.KIND_LEARNER, name)
    for name in services:
        if name in identities:
            raise ValueError(f"{name!r} is both a learner and a service: names must be unique")
        identities[name] = service_identity(name)
    for name in model_readers:
        if name in identities:
            raise ValueError(f"{name!r} is named twice (learners, services, model readers): names must be unique")
        identities[name] = model_reader_identity(name)
    for stem, identity in identities.items():
        security.Identity.parse(str(identity))  # validates the name
        cert, key = issue_cert(ca_pem, ca_key, identity, dns_names=dns_names if identity.kind != "learner" else (),
                               days=days)
        _write(root / f"{stem}.key", key, secret=True)
        _write(root / f"{stem}.pem", cert, secret=False)
    if tokens:
        token_path = root / "tokens.json"
        table = json.loads(token_path.read_text()) if token_path.exists() else {"tokens": {}, "revoked": []}
        for stem, identity in identities.items():
            token = secrets.token_urlsafe(32)
            table["tokens"][token] = str(identity)
            _write(root / f"{stem}.token", (token + "\n").encode(), secret=True)
        _write(token_path, (json.dumps(table, indent=2, sort_keys=True) + "\n").encode(), secret=True)
    return identities


ETCD_CA_NAME = "ddiloco etcd CA"
ETCD_SERVER, ETCD_CLIENT, ETCD_PEER = "etcd-server", "etcd-client", "etcd-peer"  # file stems (and common names)


def write_etcd_certs(out: str | os.PathLike, *, names: Sequence[str], days: int = 825) -> dict[str, list[pathlib.Path]]:
    """etcd's PKI in `out` (see the module docstring): reuses `etcd-ca.pem` + `etcd-ca.key` when both
    exist, and (re)writes the server and peer certificates for `names` and the client certificate.
    Returns {what: paths} of the files etcd and the syncers are given."""
    _need_cryptography()
    if not names:
        raise ValueError("the etcd server certificate needs the members' DNS names (--etcd-names)")
    root = pathlib.Path(out)
    ca_pem, ca_key = _ca_in(root, "etcd-ca", ETCD_CA_NAME)
    ca_pem_path = root / "etcd-ca.pem"
    for stem, dns_names in ((ETCD_SERVER, names), (ETCD_CLIENT, ()), (ETCD_PEER, names)):
        cert, key = issue_cert(ca_pem, ca_key, stem, dns_names=dns_names, days=days)
        _write(root / f"{stem}.key", key, secret=True)
        _write(root / f"{stem}.pem", cert, secret=False)
    return {"CA (etcd --trusted-ca-file, syncer --coord-tls-ca)": [ca_pem_path],
            "server (etcd --cert-file/--key-file)": [root / f"{ETCD_SERVER}.pem", root / f"{ETCD_SERVER}.key"],
            "client (syncer --coord-tls-cert/--coord-tls-key)": [root / f"{ETCD_CLIENT}.pem", root / f"{ETCD_CLIENT}.key"],
            f"peer (etcd --peer-cert-file/--peer-key-file, --peer-cert-allowed-cn {ETCD_PEER})":
                [root / f"{ETCD_PEER}.pem", root / f"{ETCD_PEER}.key"]}


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


# ------------------------------------------------------------------------------- revocation


def _certificate_identity(cert: x509.Certificate) -> str:
    """The ddiloco identity in a certificate's URI SANs, or its subject if it has none."""
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        for uri in sans.get_values_for_type(x509.UniformResourceIdentifier):
            if uri.startswith(security.URI_PREFIX):
                return uri[len(security.URI_PREFIX):]
    except x509.ExtensionNotFound:
        pass
    return cert.subject.rfc4514_string()


def revoke(deny_list: str | os.PathLike, *, cert_pem: bytes | None = None, serial: str | None = None,
           identity: str | None = None) -> tuple[str, bool]:
    """Appends one entry to `deny_list` (created if missing): a certificate's serial number (with
    its identity as a comment), a serial given in hex, or an identity. Returns (entry, added);
    added is False when the file already denies it. ValueError for bad input, or for an existing
    file the servers could not parse (appending to it would not take effect)."""
    if sum(x is not None for x in (cert_pem, serial, identity)) != 1:
        raise ValueError("give exactly one of a certificate, a serial number or an identity")
    path = pathlib.Path(deny_list)
    try:
        text = path.read_text() if path.exists() else ""
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read deny list {str(path)!r}: {exc}") from None
    try:
        serials, identities = security.parse_deny_list(text)
    except ValueError as exc:
        raise ValueError(f"deny list {str(path)!r} does not parse ({exc}); fix it first: servers keep their "
                         "previous list while it is broken") from None
    when = _now().strftime("%Y-%m-%dT%H:%M:%SZ")
    if cert_pem is not None:
        _need_cryptography()
        try:
            cert = x509.load_pem_x509_certificate(cert_pem)
        except ValueError as exc:
            raise ValueError(f"not a PEM certificate: {exc}") from None
        entry = security.format_serial(cert.serial_number)
        line = f"{entry}  # {_certificate_identity(cert)}, revoked {when}"
        present = cert.serial_number in serials
    elif serial is not None:
        number = security.parse_serial(serial)
        entry = security.format_serial(number)
        line = f"{entry}  # revoked {when}"
        present = number in serials
    else:
        parsed = security.Identity.parse(identity or "")
        entry = str(parsed)
        line = f"{entry}  # every certificate of this identity, revoked {when}"
        present = parsed in identities
    if present:
        return entry, False
    if text and not text.endswith("\n"):
        text += "\n"
    if not text:
        text = "# ddiloco deny list (--tls-deny-list): certificate serials (hex) or identities, one a line\n"
    _write(path, (text + line + "\n").encode(), secret=False)
    return entry, True


def add_revoke_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--deny-list", required=True,
                        help="the deny list file the servers read with --tls-deny-list (created if missing)")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--cert", help="revoke this certificate (PEM): its serial number is added")
    what.add_argument("--serial", help="revoke the certificate with this serial number (hex, e.g. 0x3f9a... or 3F:9A:...)")
    what.add_argument("--identity",
                      help="revoke every certificate of this identity, e.g. learner/learner-3 (re-admit it by "
                           "removing the line; a new certificate for the same identity stays refused until then)")


def run_revoke(args: argparse.Namespace) -> int:
    try:
        cert_pem = _read_cert(args.cert) if args.cert else None
        entry, added = revoke(args.deny_list, cert_pem=cert_pem, serial=args.serial, identity=args.identity)
    except ValueError as exc:
        print(f"ddiloco certs revoke: {exc}")
        return 2
    if added:
        print(f"revoked {entry}: added to {args.deny_list}; servers with --tls-deny-list {args.deny_list} refuse it "
              "within a second")
    else:
        print(f"{entry} is already in {args.deny_list}")
    return 0


def _read_cert(path: str) -> bytes:
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read certificate {path!r}: {exc.strerror or exc}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="certs", help="directory to write ca.pem, <name>.pem and <name>.key into")
    parser.add_argument("--learners", default="learner-0,learner-1,learner-2,learner-3",
                        help="comma-separated learner ids (one certificate each, kind learner)")
    parser.add_argument("--services", default="syncer,checkpoint,evaluator,operator",
                        help="comma-separated service names; syncer, checkpoint and evaluator are their own kind, "
                             "any other name (operator) is a reader: the training state, not the model")
    parser.add_argument("--model-readers", default="",
                        help="comma-separated names of model-reader credentials: the training state and the "
                             "model's weights (WatchFragments, the store's GetBlob), e.g. exporter")
    parser.add_argument("--dns-names", default="",
                        help="extra DNS SANs for the service certificates, e.g. syncer.ddiloco.svc.cluster.local")
    parser.add_argument("--etcd-names", default="",
                        help="also write etcd's own PKI for client TLS towards etcd: etcd-ca.pem/.key (a separate "
                             "CA), etcd-server.pem/.key and etcd-peer.pem/.key with these DNS names (the etcd members, e.g. "
                             "etcd-a,etcd-b,etcd-c) and etcd-client.pem/.key, the syncers' client certificate")
    parser.add_argument("--days", type=int, default=825, help="validity of the leaf certificates")
    parser.add_argument("--tokens", action="store_true",
                        help="also write tokens.json (the syncer's --auth-tokens-file) and <name>.token files")
    sub = parser.add_subparsers(dest="certs_command", metavar="{revoke}")
    add_revoke_arguments(sub.add_parser(
        "revoke", help="add a certificate (or a serial, or an identity) to a deny list (--tls-deny-list)",
        description="Adds a certificate's serial number, a serial, or an identity to the deny list the "
                    "syncer and the checkpoint store read with --tls-deny-list (re-read within a second)."))


def run(args: argparse.Namespace) -> int:
    if getattr(args, "certs_command", None) == "revoke":
        return run_revoke(args)
    try:
        identities = write_dev_certs(
            args.out, learners=_names(args.learners), services=_names(args.services),
            dns_names=_names(args.dns_names), days=args.days, tokens=args.tokens,
            model_readers=_names(args.model_readers),
        )
        etcd = write_etcd_certs(args.out, names=_names(args.etcd_names), days=args.days) if args.etcd_names else {}
    except ValueError as exc:
        print(f"ddiloco certs: {exc}")
        return 2
    out = pathlib.Path(args.out)
    print(f"CA: {out / 'ca.pem'} (key {out / 'ca.key'}: keep it private)")
    for stem, identity in identities.items():
        print(f"  {identity.uri:<44} {out / (stem + '.pem')}  {out / (stem + '.key')}")
    if args.tokens:
        print(f"tokens: {out / 'tokens.json'} (syncer --auth-tokens-file) and <name>.token")
    for what, paths in etcd.items():
        print(f"etcd {what}: {'  '.join(map(str, paths))}")
    return 0
