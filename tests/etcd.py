"""A real etcd for the tests (ddiloco/cli/etcd_local.py, named by ddiloco/chaos/etcd.py): the binary from scripts/etcd_env.sh
(Debian's etcd-server if missing), one single-member cluster per test in its own temporary
directory, stopped by its PID. No etcd fails the test that asked for it: it never skips.

`running_tls_etcd` starts it as docker-compose.failover-tls.yml runs its members: clients over
https only, with client certificates signed by etcd's own CA (`--client-cert-auth`), from the PKI
`ddiloco certs --etcd-names` writes (`etcd_pki`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
from collections.abc import Iterator

from ddiloco.chaos import etcd as etcd_lib
from ddiloco.cli import certs
from tests import tools


def etcd_binary() -> str:
    """The path of a working etcd; fails the calling test when there is none."""
    return tools.require("etcd_env.sh", "etcd")


@contextlib.contextmanager
def running_etcd(directory: pathlib.Path) -> Iterator[etcd_lib.EtcdMember]:
    with etcd_lib.running_etcd(directory, etcd_binary()) as etcd:
        yield etcd


@dataclasses.dataclass(frozen=True)
class EtcdPKI:
    """The files of `ddiloco certs --out <directory> --etcd-names localhost`."""

    directory: pathlib.Path

    def path(self, stem: str, suffix: str = ".pem") -> str:
        return str(self.directory / f"{stem}{suffix}")

    @property
    def ca(self) -> str:
        return self.path("etcd-ca")

    @property
    def client_cert(self) -> str:
        return self.path(certs.ETCD_CLIENT)

    @property
    def client_key(self) -> str:
        return self.path(certs.ETCD_CLIENT, ".key")

    def server_tls(self) -> etcd_lib.ServerTLS:
        return etcd_lib.ServerTLS(ca_file=self.ca, cert_file=self.path(certs.ETCD_SERVER),
                                  key_file=self.path(certs.ETCD_SERVER, ".key"), probe_cert_file=self.client_cert,
                                  probe_key_file=self.client_key)


def etcd_pki(directory: pathlib.Path) -> EtcdPKI:
    """etcd's CA, server and client certificates, written by `ddiloco certs`' own code."""
    certs.write_etcd_certs(directory, names=["localhost"])
    return EtcdPKI(directory)


@contextlib.contextmanager
def running_tls_etcd(directory: pathlib.Path, pki: EtcdPKI) -> Iterator[etcd_lib.EtcdMember]:
    """A single-member etcd serving its clients https only, to certificates `pki`'s CA signed."""
    with etcd_lib.running_etcd(directory, etcd_binary(), tls=pki.server_tls()) as etcd:
        yield etcd
