"""Local TCP ports for tests that cannot let a server bind 127.0.0.1:0 itself.

Prefer binding 127.0.0.1:0 in the process that serves and reading the port back (start_server,
ready files): nothing can take the port in between. These helpers are for the other cases.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


def free_port() -> int:
    """A port free at the time of the call, for a child process that must be told its port before
    it starts (a port Docker publishes, jax.distributed's coordinator). Racy: another process may
    bind it before the child does; use it only where the child cannot bind port 0 and report back."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def refused_address() -> Iterator[str]:
    """host:port on 127.0.0.1 where nothing listens, for the block: the port stays bound (never
    listening), so every connection to it is refused and no other process can take it meanwhile."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


@contextlib.contextmanager
def frozen_address() -> Iterator[str]:
    """An address whose kernel completes TCP handshakes (the listen backlog) and where nothing ever
    answers: a frozen (SIGSTOPped, partitioned-after-accept) server, as gRPC clients see one."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()
