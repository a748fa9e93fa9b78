"""A real etcd for the tests (ddiloco/chaos/etcd.py): the binary from scripts/etcd_env.sh
(Debian's etcd-server if missing), one single-member cluster per test in its own temporary
directory, stopped by its PID. No etcd fails the test that asked for it: it never skips.
"""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Iterator

from ddiloco.chaos import etcd as etcd_lib
from tests import tools


def etcd_binary() -> str:
    """The path of a working etcd; fails the calling test when there is none."""
    return tools.require("etcd_env.sh", "etcd")


@contextlib.contextmanager
def running_etcd(directory: pathlib.Path) -> Iterator[etcd_lib.EtcdMember]:
    with etcd_lib.running_etcd(directory, etcd_binary()) as etcd:
        yield etcd
