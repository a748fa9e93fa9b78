"""No protobuf below the syncer's servicer (issue 22): the syncer's parts work on plain Python values.

Only the gRPC layer (servicer.py, its converter wire_views.py, __main__.py that serves them) may
import generated `*_pb2` / `*_pb2_grpc` modules. Every import statement counts, those inside
functions and under `if TYPE_CHECKING` included, since all of them tie the part to the wire format.
"""

from __future__ import annotations

import ast
import pathlib

SYNCER = pathlib.Path(__file__).resolve().parents[2] / "services" / "syncer"

# The gRPC layer: it reads requests and builds responses, so it is where protobuf belongs.
WIRE_LAYER = {"servicer.py", "wire_views.py", "__main__.py"}

# Parts not yet converted, each with its reason; an entry goes when its module stops importing
# protobuf. Every part is converted (issue 22): do not add to it.
NOT_YET: dict[str, str] = {}


def protobuf_imports(source: str) -> list[str]:
    """The generated-protobuf modules `source` imports (`ddiloco.v1.syncer_pb2`, `syncer_pb2`, ...)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [f"{node.module or ''}.{a.name}" for a in node.names] + [node.module or ""]
        else:
            continue
        found += [n for n in names if any(part.endswith(("_pb2", "_pb2_grpc")) for part in n.split("."))]
    return found


def offenders() -> dict[str, list[str]]:
    out = {}
    for path in sorted(SYNCER.glob("*.py")):
        if path.name in WIRE_LAYER or path.name in NOT_YET:
            continue
        if imports := protobuf_imports(path.read_text()):
            out[path.name] = imports
    return out


def test_syncer_parts_import_no_protobuf():
    assert offenders() == {}, "build protobuf messages in services/syncer/wire_views.py or servicer.py instead"


def test_allowlist_entries_are_still_needed():
    # A converted module must leave NOT_YET, so that it cannot slide back.
    stale = [name for name in NOT_YET if not protobuf_imports((SYNCER / name).read_text())]
    assert stale == []


def test_the_check_sees_every_import_form():
    # The negative case: each of these would put protobuf below the servicer.
    for source in ("from ddiloco.v1 import syncer_pb2\n",
                   "import ddiloco.v1.syncer_pb2 as pb\n",
                   "from ddiloco.v1.syncer_pb2 import RunConfig\n",
                   "def f():\n    from grpc_health.v1 import health_pb2\n",
                   "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ddiloco.v1 import syncer_pb2_grpc\n"):
        assert protobuf_imports(source), source
    assert protobuf_imports("from ddiloco.wire import serde\nimport dataclasses\n") == []
