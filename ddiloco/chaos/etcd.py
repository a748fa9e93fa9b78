"""The chaos tools' etcd: the members live in ddiloco/cli/etcd_local.py, shared with `ddiloco up
--syncer-replicas` (the tools' one launcher is in ddiloco/cli, which the chaos tools build on);
this module names them for the harness, the benchmarks and the tests."""

from __future__ import annotations

from ddiloco.cli.etcd_local import (READY_TIMEOUT_S, START_ATTEMPTS, EtcdMember, PeerTLS, ServerTLS, etcd_binary,
                                    peer_url, pki_tls, running_etcd, start_single_member)

__all__ = ["READY_TIMEOUT_S", "START_ATTEMPTS", "EtcdMember", "PeerTLS", "ServerTLS", "etcd_binary", "peer_url",
           "pki_tls", "running_etcd", "start_single_member"]
