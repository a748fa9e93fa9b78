"""The learner loop's declared sync-client interface (ddiloco/learner/ports.py, issue 22).

The loop talks to its client only through `SyncClientLike`: its source (read as an AST) uses
exactly the Protocol's members, never probes the client (`getattr`, `hasattr`) nor hands it on;
and every client the loop is given (the SyncClient, a multi-process unit's UnitClient, the null
client, the fragment shards' ShardedSyncClient, the chaos tools' hostile client and the test fakes)
has every member, methods with the Protocol's parameters. A loop that starts using a member the Protocol lacks fails here.
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import threading
import types

import pytest

from ddiloco.chaos import hostile_learner
from ddiloco.learner import client as client_lib
from ddiloco.learner import ports
from ddiloco.learner import sharded as sharded_lib
from ddiloco.rpc import security
from services.learner import distributed
from tests import fakes
from tests.unit import test_learner_resend

LOOP = pathlib.Path(__file__).resolve().parents[2] / "ddiloco" / "learner" / "loop.py"
PROTOCOL_MEMBERS = frozenset(name for name in vars(ports.SyncClientLike) if not name.startswith("_"))


def client_uses(source: str) -> tuple[set[str], list[str]]:
    """(members of `self._client` the source reads, every other use of `self._client`: a probe,
    an alias, an argument), the assignment that stores the client aside."""
    members: set[str] = set()
    strays: list[str] = []
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr == "_client"
                and isinstance(node.value, ast.Name) and node.value.id == "self"):
            continue
        parent = parents[node]
        if isinstance(parent, ast.Attribute):
            members.add(parent.attr)
        elif not (isinstance(parent, ast.Assign) and node in parent.targets):
            strays.append(f"line {node.lineno}: {ast.unparse(parent)}")
    return members, strays


def test_the_protocol_is_what_the_loop_uses():
    members, strays = client_uses(LOOP.read_text(encoding="utf-8"))
    assert not strays, strays
    assert members == PROTOCOL_MEMBERS, (
        f"the loop uses {sorted(members - PROTOCOL_MEMBERS)} beyond SyncClientLike, "
        f"which declares {sorted(PROTOCOL_MEMBERS - members)} the loop does not use")


def test_a_new_member_or_a_probe_in_the_loop_is_caught():
    # The negative case: the loop's source with one more client call and a getattr probe.
    source = LOOP.read_text(encoding="utf-8").replace(
        "        self.finished = True\n",
        "        self.finished = True\n        self._client.flush(1.0)\n"
        "        getattr(self._client, 'close', None)\n", 1)
    members, strays = client_uses(source)
    assert members - PROTOCOL_MEMBERS == {"flush"}
    assert len(strays) == 1 and "getattr(self._client, 'close', None)" in strays[0], strays


def _sync_client(cls=client_lib.SyncClient, **kwargs) -> client_lib.SyncClient:
    return cls(client_lib.ClientConfig(target="127.0.0.1:1", learner_id="l", incarnation=1, region="r",
                                       tokens_per_step=0, security=security.ClientSecurity(insecure=True)), **kwargs)


@pytest.fixture
def implementations():
    """Every client the loop is given, in production, tools and tests (never started: no network)."""
    sync_client = _sync_client()
    hostile = _sync_client(hostile_learner.HostileSyncClient, factor=-1.0)
    unit = distributed.UnitClient(types.SimpleNamespace(is_leader=False), None, threading.Event())
    sharded = sharded_lib.ShardedSyncClient(sync_client.cfg, session_factory=lambda cfg: sync_client)
    yield {
        "SyncClient": sync_client, "HostileSyncClient": hostile, "UnitClient": unit, "ShardedSyncClient": sharded,
        "NullSyncClient": ports.NullSyncClient(),
        "test_learner_resend._Client": test_learner_resend._Client(),
        "test_learner_resend._CallClient": test_learner_resend._CallClient(),
        "test_learner_resend._BarrierClient": test_learner_resend._BarrierClient({0: 1}),
        "fakes.RecordingSyncClient": fakes.RecordingSyncClient(),
    }
    for client in (sync_client, hostile):
        client._loop.close()  # created by the constructor; never run


def _parameters(function) -> list[str]:
    return [p.name for p in inspect.signature(function).parameters.values()][1:]  # without self


def test_every_client_satisfies_the_protocol(implementations):
    methods = {name: _parameters(member) for name, member in vars(ports.SyncClientLike).items()
               if name in PROTOCOL_MEMBERS and inspect.isfunction(member)}
    assert len(methods) == len(PROTOCOL_MEMBERS) - 1  # all but the property fenced
    for label, client in implementations.items():
        assert isinstance(client, ports.SyncClientLike), (label, sorted(
            name for name in PROTOCOL_MEMBERS if not hasattr(client, name)))
        for name, parameters in methods.items():
            assert _parameters(getattr(type(client), name)) == parameters, (label, name)
        instance = client.instance_of(0)
        assert client.fenced is None and (instance is None or isinstance(instance, str)), label


def test_a_client_missing_a_member_does_not_satisfy_it():
    class Partial:  # a fake of before the Protocol: only what one scenario needed
        def take_updates(self):
            return []

        def submit_upload(self, job):
            pass

        def set_progress(self, request):
            pass

    assert not isinstance(Partial(), ports.SyncClientLike)
