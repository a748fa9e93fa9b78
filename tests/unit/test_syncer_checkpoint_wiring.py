"""The syncer's checkpoint client from its flags: one --checkpoint-target is the plain client (as
before replication), a comma list the replicated client with the write quorum asked for, and a
quorum larger than the list of stores is refused at parse time."""

from __future__ import annotations

import asyncio

import pytest

from ddiloco import checkpoint_client
from ddiloco import checkpoint_replicas as replicas
from ddiloco.rpc import security
from services.syncer import __main__ as syncer_main
from services.syncer import config as config_lib


def _client(**fields):
    cfg = config_lib.SyncerConfig(insecure=True, **fields)

    async def build():  # aio channels need a running loop
        return syncer_main._checkpoint_client(cfg, security.ClientSecurity(insecure=True))

    return asyncio.run(build())


def test_one_target_is_the_plain_client() -> None:
    assert type(_client(checkpoint_target="127.0.0.1:1")) is checkpoint_client.CheckpointClient


def test_a_comma_list_replicates_with_the_default_or_given_quorum() -> None:
    client = _client(checkpoint_target="127.0.0.1:1, 127.0.0.1:2,127.0.0.1:3")
    assert isinstance(client, replicas.ReplicatedCheckpointClient)
    assert client.store_names == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    assert (client.write_quorum, client.read_quorum) == (2, 2)
    one = _client(checkpoint_target="127.0.0.1:1,127.0.0.1:2", checkpoint_write_quorum=1)
    assert (one.write_quorum, one.read_quorum) == (1, 2)


def test_a_quorum_above_the_number_of_stores_is_refused() -> None:
    with pytest.raises(ValueError, match="checkpoint_write_quorum=3.*1..2"):
        config_lib.SyncerConfig(insecure=True, checkpoint_target="a:1,b:2", checkpoint_write_quorum=3)
    with pytest.raises(ValueError, match="checkpoint_repair_interval_s"):
        config_lib.SyncerConfig(insecure=True, checkpoint_repair_interval_s=0)
