"""Configuration of the checkpoint store service: one frozen dataclass, validated on construction,
and `parse_config`, which builds it from flags and `DDILOCO_CHECKPOINT_*` environment variables.

Only `__main__` passes in the real `os.environ`; everything here is pure.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from collections.abc import Mapping, Sequence

from ddiloco import failpoints as failpoints_lib
from ddiloco import flags
from ddiloco.rpc import security
from ddiloco.rpc import server as server_lib

# Every option `--foo-bar` can also be set as DDILOCO_CHECKPOINT_FOO_BAR, so compose files and
# Kubernetes manifests configure the service without editing its command.
ENV_PREFIX = "DDILOCO_CHECKPOINT_"
# Shared by every service, so one variable arms a fault test across processes. Tests only.
FAILPOINTS_ENV = "DDILOCO_FAILPOINTS"

_MIN_CHUNK_BYTES = 1024
# Half the message limit leaves ample room for the envelope of a chunk message.
_MAX_CHUNK_BYTES = server_lib.MAX_MESSAGE_BYTES // 2


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _env(field: str) -> str:
    return ENV_PREFIX + field.upper()


def _invalid(field: str, value: object, fix: str) -> ValueError:
    return ValueError(
        f"{field}={value!r} is invalid: {fix} (flag {_flag(field)}, env {_env(field)})"
    )


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Everything the checkpoint store service needs; validated in `__post_init__`."""

    # Directory holding blobs/ and manifests/; use a persistent volume in deployments.
    root: pathlib.Path
    # host:port to listen on; port 0 picks a free port (tests; read it from the ready file).
    bind: str = "0.0.0.0:50052"
    # Committed checkpoints kept per run (retention policy LatestN).
    keep_latest: int = 5
    # Largest blob accepted; bigger uploads fail with RESOURCE_EXHAUSTED.
    max_blob_bytes: int = 2 * 1024**3
    # Data per GetBlob message; must stay well below the gRPC message limit.
    chunk_size_bytes: int = 512 * 1024
    # Unreferenced blobs younger than this survive GC, so the blobs of a checkpoint still being
    # uploaded (referenced by no manifest yet) are not collected under the writer's feet.
    gc_grace_s: float = 3600.0
    # Merges per (run, fragment) whose retained contributions (ledger blobs) GC keeps; 0 keeps all.
    # Older records stay in the ledger, their blobs go unless a checkpoint references them.
    ledger_retain_merges: int = 64
    log_level: str = "INFO"
    # One JSON object per log line (for log shippers) instead of human-readable lines.
    json_logs: bool = False
    # Written (atomically, JSON with address and pid) once the server is serving.
    ready_file: pathlib.Path | None = None
    # On SIGTERM/SIGINT, in-flight RPCs get this long to finish.
    grace_s: float = 10.0
    # host:port for Prometheus /metrics (port 0: any free port); empty disables it.
    metrics_bind: str = ""
    # Mutual TLS (PEM file paths), or explicit plaintext; see ddiloco.rpc.security. Under mTLS only
    # the syncer's identity may write; readers (operators) may read.
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    insecure: bool = False
    # Bearer tokens -> identities, with revocations (for TLS terminated elsewhere).
    auth_tokens_file: str = ""
    # Revoked client certificates (serials or identities, one a line), re-read on change.
    tls_deny_list: str = ""
    # Also serve the health service alone, in plaintext, on this host:port (probes).
    health_bind: str = ""
    # Fault injection for tests, e.g. "store.write=enospc" (ddiloco.failpoints). Empty in production.
    failpoints: str = ""

    def __post_init__(self) -> None:
        if not str(self.root):
            raise _invalid("root", str(self.root), "give the directory to store checkpoints in")
        host, sep, port = self.bind.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise _invalid("bind", self.bind, "use host:port, e.g. 0.0.0.0:50052 or 127.0.0.1:0")
        if self.keep_latest < 1:
            raise _invalid("keep_latest", self.keep_latest, "keep at least 1 checkpoint per run")
        if self.max_blob_bytes < 1:
            raise _invalid("max_blob_bytes", self.max_blob_bytes, "use a positive byte count")
        if not _MIN_CHUNK_BYTES <= self.chunk_size_bytes <= _MAX_CHUNK_BYTES:
            raise _invalid(
                "chunk_size_bytes",
                self.chunk_size_bytes,
                f"use {_MIN_CHUNK_BYTES}..{_MAX_CHUNK_BYTES} bytes (524288 is a good default)",
            )
        if self.gc_grace_s < 0:
            raise _invalid("gc_grace_s", self.gc_grace_s, "use 0 or more seconds")
        if self.ledger_retain_merges < 0:
            raise _invalid("ledger_retain_merges", self.ledger_retain_merges, "use 0 (keep all) or more merges")
        if self.grace_s < 0:
            raise _invalid("grace_s", self.grace_s, "use 0 or more seconds")
        if not isinstance(logging.getLevelName(self.log_level.upper()), int):
            raise _invalid("log_level", self.log_level, "use DEBUG, INFO, WARNING or ERROR")
        if self.health_bind and ":" not in self.health_bind:
            raise _invalid("health_bind", self.health_bind, "use host:port, e.g. 127.0.0.1:8082")
        try:
            failpoints_lib.parse(self.failpoints, prefix="store.")
        except ValueError as exc:
            raise ValueError(
                f"failpoints: {exc} (flag --failpoints, env {FAILPOINTS_ENV})"
            ) from None

    def server_security(self) -> security.ServerSecurity:
        """ValueError unless mutual TLS is fully configured or plaintext was asked for."""
        return security.ServerSecurity(tls_ca=self.tls_ca, tls_cert=self.tls_cert, tls_key=self.tls_key,
                                       insecure=self.insecure, auth_tokens_file=self.auth_tokens_file,
                                       tls_deny_list=self.tls_deny_list)


def parse_config(argv: Sequence[str], environ: Mapping[str, str]) -> CheckpointConfig:
    """Builds the config from `argv` (flags win) and `environ`; exits with usage on bad input."""
    environ = security.with_shared_insecure(environ, ENV_PREFIX)
    parser = flags.EnvArgumentParser(
        # The command a user types (`python -m services.checkpoint` runs the same code), as for
        # `ddiloco syncer` and `ddiloco learner`.
        prog="ddiloco checkpoint",
        description="The ddiloco checkpoint store: content-addressed blobs plus per-run "
        "manifests that commit a checkpoint atomically, served over gRPC.",
        environ=environ,
    )
    defaults = CheckpointConfig(root=pathlib.Path("."))

    def add(field: str, help_text: str, **kwargs) -> None:
        kwargs.setdefault("default", getattr(defaults, field))
        parser.add_env_argument(_flag(field), env=_env(field), help=help_text, **kwargs)

    add("root", "directory for blobs/ and manifests/ (required)", type=pathlib.Path,
        default=None, required=True)
    add("bind", "host:port to serve on; port 0 picks a free port")
    add("keep_latest", "committed checkpoints kept per run; older ones are pruned", type=int)
    add("max_blob_bytes", "largest blob accepted, in bytes", type=int)
    add("chunk_size_bytes", "bytes of blob data per streamed message", type=int)
    add("gc_grace_s", "seconds an unreferenced blob survives garbage collection (protects "
        "checkpoints still uploading)", type=float)
    add("ledger_retain_merges", "merges per run and fragment whose retained contributions (merge ledger blobs) "
        "garbage collection keeps; older records stay, their blobs are collected; 0: keep all", type=int)
    add("log_level", "DEBUG, INFO, WARNING or ERROR")
    # Booleans work as plain switches (`--json-logs`) and with a value (`--json-logs false`), as
    # in every service (flags.parse_dataclass).
    add("json_logs", "log one JSON object per line", type=flags.parse_bool, nargs="?", const=True,
        metavar="BOOL")
    add("ready_file", "write {address, pid, service} here once serving", type=pathlib.Path)
    add("grace_s", "seconds in-flight RPCs may finish after SIGTERM", type=float)
    add("metrics_bind", "serve Prometheus metrics on host:port (e.g. 0.0.0.0:9092); empty: off")
    add("tls_ca", "mutual TLS: CA bundle (PEM) that client certificates must chain to")
    add("tls_cert", "mutual TLS: this store's certificate chain (PEM)")
    add("tls_key", "mutual TLS: this store's private key (PEM)")
    add("insecure", "serve plaintext without client certificates (local runs only; DDILOCO_INSECURE=1 "
        "sets it too)", type=flags.parse_bool, nargs="?", const=True, metavar="BOOL")
    add("auth_tokens_file", "JSON {tokens: {token: kind/name}, revoked: [...]}: accept bearer tokens")
    add("tls_deny_list", "mutual TLS: file of revoked client certificates, one a line: a serial number in hex or an "
        "identity (kind/name); # starts a comment; re-read within a second of a change (`ddiloco certs revoke`)")
    add("health_bind", "also serve gRPC health alone, in plaintext, on host:port (probes without certificates)")
    parser.add_env_argument(
        "--failpoints",
        env=FAILPOINTS_ENV,
        default="",
        metavar="POINT=ACTION,...",
        help="TESTS ONLY: crash or fail with ENOSPC at named store points, e.g. "
        "store.after_tmp_write=crash,store.write=enospc",
    )
    args = parser.parse_args(list(argv))
    try:
        return CheckpointConfig(**vars(args))
    except ValueError as exc:
        parser.error(str(exc))
