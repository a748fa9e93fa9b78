"""Epoch-tagged manifests on a real checkpoint store: a new leader's lineage wins over what a
deposed leader wrote past the commit pointer, and a deposed leader's later manifests are refused.

Before epochs, the store refused the new leader's step 40 after the deposed leader's step 50
(FAILED_PRECONDITION, "not after the latest committed step") until its steps passed 50.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from services.checkpoint import store as store_lib
from tests.integration.conftest import store_call

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

_RUN = "run"


async def _commit(client, step: int, epoch: int | None, data: bytes) -> int:
    digest = await client.put_blob(data)
    metadata = {} if epoch is None else {"leader_epoch": str(epoch)}
    return await client.commit_manifest(_RUN, step, {"state": (digest, len(data))}, metadata)


def _epoch(manifest) -> int:
    return int(manifest.metadata.get("leader_epoch", "0"))


def test_a_newer_epoch_wins_below_the_latest_step_and_an_older_one_is_refused(cluster):
    address = cluster.start_store().address
    rng = np.random.default_rng(0)

    async def go(client):
        await _commit(client, 30, 1, rng.bytes(1000))
        await _commit(client, 50, 1, rng.bytes(1000))  # written by epoch 1, never committed in etcd
        assert await _commit(client, 40, 2, rng.bytes(1000)) == 40
        latest = await client.latest_manifest(_RUN)
        listed = [(m.step, _epoch(m)) for m in await client.list_manifests(_RUN)]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _commit(client, 60, 1, rng.bytes(1000))  # the deposed leader writes on
        await _commit(client, 41, 2, rng.bytes(1000))  # the new leader carries on as usual
        with pytest.raises(grpc.aio.AioRpcError) as same_epoch:
            await _commit(client, 41, 2, rng.bytes(1000))  # and keeps the step rule in its epoch
        return latest, listed, refused.value, same_epoch.value, await client.latest_manifest(_RUN)

    latest, listed, refused, same_epoch, final = store_call(address, lambda c: asyncio.wait_for(go(c), 45))
    assert (latest.step, _epoch(latest)) == (40, 2)
    assert listed == [(30, 1), (40, 2)]  # one lineage: step 50 of epoch 1 was set aside
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "epoch 1" in refused.details() and "older than epoch 2" in refused.details()
    assert same_epoch.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (final.step, _epoch(final)) == (41, 2)
    aside = list((cluster.workdir / "store" / "superseded" / _RUN).iterdir())
    assert [p.name for p in aside] == [f"{50:020d}.e1.json"]  # still readable for forensics


def test_manifests_without_epochs_keep_the_step_rule(cluster):
    address = cluster.start_store().address
    rng = np.random.default_rng(1)

    async def go(client):
        await _commit(client, 5, None, rng.bytes(500))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _commit(client, 4, None, rng.bytes(500))
        return refused.value

    refused = store_call(address, lambda c: asyncio.wait_for(go(c), 30))
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not after the latest committed step 5" in refused.details()


def test_repair_keeps_one_lineage(tmp_path):
    """RestoreManifest (repair): a deposed leader's manifest held by a peer is not restored over a
    newer lineage, and a newer lineage's manifest restored to a store that holds the deposed one
    sets that one aside."""
    new = store_lib.BlobStore(tmp_path / "new")
    old = store_lib.BlobStore(tmp_path / "old")
    rng = np.random.default_rng(2)

    def manifest(store, step, epoch):
        digest, _ = store.put_blob(data := rng.bytes(300))
        return {"run_id": _RUN, "step": step, "metadata": {"leader_epoch": str(epoch)},
                "blobs": [{"name": "state", "digest": digest, "size_bytes": len(data)}]}

    deposed = manifest(old, 50, 1)
    old.commit_manifest(deposed)
    leading = manifest(new, 40, 2)
    new.commit_manifest(leading)
    digest = deposed["blobs"][0]["digest"]
    with old.open_blob(digest) as reader:
        new.put_blob(reader.read(1 << 20))
    assert new.restore_manifest(deposed) == (False, False)
    assert [m["step"] for m in new.list_manifests(_RUN)] == [40]
    with new.open_blob(leading["blobs"][0]["digest"]) as reader:
        old.put_blob(reader.read(1 << 20))
    assert old.restore_manifest(leading) == (True, True)
    assert [(m["step"], store_lib.manifest_epoch(m)) for m in old.list_manifests(_RUN)] == [(40, 2)]


def test_a_malformed_epoch_is_invalid_argument(cluster):
    address = cluster.start_store().address

    async def go(client):
        digest = await client.put_blob(b"x" * 10)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.commit_manifest(_RUN, 1, {"state": (digest, 10)}, {"leader_epoch": "-3"})
        return info.value

    error = store_call(address, lambda c: asyncio.wait_for(go(c), 30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "leader_epoch" in error.details()
