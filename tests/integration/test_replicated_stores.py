"""Replicated checkpoint stores as real processes (issue 23, "lose one store's disk entirely").

1. Two stores + syncer + 2 learners: SIGKILL one store, delete its whole data directory, restart
   it empty. Training goes on, the store is rebuilt from its peer by the syncer's background
   repair, and every committed checkpoint loads from EITHER store (every blob read back from each).
2. With one store down a write commits under write quorum 1 and is refused, naming the store,
   under write quorum 2.
3. A blob corrupted on one store's disk is detected, served from the other, and repaired.
4. `ddiloco store repair` rebuilds an emptied store and prints what it copied.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ddiloco import checkpoint_client
from ddiloco import checkpoint_replicas as replicas
from ddiloco.rpc import channel as channel_lib
from services.syncer import checkpointing
from tests.integration.conftest import TINY, SyncerProbe, store_call, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def _steps(address: str, run_id: str) -> list[int]:
    async def go(client):
        return [m.step for m in await client.list_manifests(run_id)]

    return store_call(address, go)


def _load_every_checkpoint(address: str, run_id: str, steps: list[int], *, decode: bool = True) -> list[int]:
    """Reads every blob of the manifests at `steps` from the store at `address` (digest-verified
    by the client) and decodes each syncer checkpoint; returns the steps loaded."""

    async def go(client):
        held = {m.step: m for m in await client.list_manifests(run_id)}
        loaded = []
        for step in steps:
            manifest = held[step]
            blobs = {ref.name: await client.get_blob(ref.digest) for ref in manifest.blobs}
            if not decode:
                loaded.append(step)
                continue
            snapshot = checkpointing.load_snapshot(blobs)
            assert snapshot.outer_steps == step
            for frag in snapshot.fragments:
                digest = hashlib.sha256(np.asarray(frag.params, dtype="<f4").tobytes()).hexdigest()
                assert digest == frag.params_sha256
            loaded.append(step)
        return loaded

    return store_call(address, go)


# Slower learners than LEARNER_PACE: the tiny model merges ~20 times a second at that pace, so the
# store's 5 retained checkpoints (default --keep-latest, one per 16 merges) would span only a few
# seconds, and the checkpoints from before the loss would be pruned before repair could show it
# restored them. At 0.2 s a step they span tens of seconds, as minutes do on a real model.
_SLOW_PACE = ["--step-delay-s", "0.2", "--log-every-steps", "50"]
# Longer than the syncer's per-store retry (5 s), so checkpoints fail during the outage.
_OUTAGE_S = 12.0


def test_a_store_that_lost_its_disk_is_rebuilt_and_every_checkpoint_loads_from_either(cluster):
    run_id = "replicated-disk-loss"
    stores = [cluster.start_store(index=i) for i in range(2)]
    syncer = cluster.start_syncer(run_id=run_id, extra=TINY)
    for i in range(2):
        cluster.start_learner(i, region=f"region-{i}", extra=["--num-shards", "2", *_SLOW_PACE])
    probe = SyncerProbe(syncer.address)
    try:
        wait_until(lambda: len(_steps(stores[1].address, run_id)) >= 3, timeout_s=240,
                   what="three checkpoints on the second store")
        stores[1].signal(signal.SIGKILL)
        assert stores[1].wait(10) == -signal.SIGKILL
        shutil.rmtree(cluster.workdir / "store-1")  # the disk is gone, not just the process
        merges_at_loss = probe.state(0).outer_steps
        before_loss = _steps(stores[0].address, run_id)
        time.sleep(_OUTAGE_S)
        # Training went on; checkpoints did not (write quorum 2 of 2: refused, not half-written).
        assert probe.state(0).outer_steps >= merges_at_loss + 16
        assert "QuorumError" in syncer.log_path.read_text()
        stores[1].start()
        stores[1].wait_ready(60)
        # Repair starts when the syncer's first call reaches the store again: the checkpoints
        # from before the loss come back from its peer (below the new commits' steps).
        wait_until(lambda: set(before_loss) & set(_steps(stores[1].address, run_id)), timeout_s=120,
                   what="checkpoints from before the loss restored to the emptied store")
        merges_back = probe.state(0).outer_steps
        wait_until(lambda: probe.state(0).outer_steps >= merges_back + 32, timeout_s=180,
                   what="merges after the store came back")
        assert all(s.alive() for s in cluster.learners()) and syncer.alive()
        assert syncer.stop(30) == 0  # the final checkpoint goes to both stores
        steps = sorted(set(_steps(stores[0].address, run_id)) | set(_steps(stores[1].address, run_id)))
        assert len(steps) >= 3 and _steps(stores[0].address, run_id) == _steps(stores[1].address, run_id)
        for store in stores:
            assert _load_every_checkpoint(store.address, run_id, steps) == steps, store.name
        assert "manifests restored: " + f"{run_id}@" in syncer.log_path.read_text()
    finally:
        probe.close()


@contextlib.asynccontextmanager
async def _replicated(addresses: list[str], **kwargs):
    channels = [channel_lib.aio_channel(a) for a in addresses]
    try:
        yield replicas.ReplicatedCheckpointClient(
            {a: checkpoint_client.CheckpointClient(ch, timeout=datetime.timedelta(seconds=5),
                                                   retry_timeout=datetime.timedelta(seconds=2))
             for a, ch in zip(addresses, channels)},
            call_timeout_s=10.0, blob_timeout_s=10.0, quorum_wait_s=2.0, **kwargs)
    finally:
        for ch in channels:
            await ch.close()


async def _write(client, step: int, data: bytes) -> None:
    digest = await client.put_blob(data)
    await client.commit_manifest("run", step, {"params": (digest, len(data))})


def test_one_store_down_commits_under_quorum_one_and_is_refused_under_two(cluster):
    stores = [cluster.start_store(index=i) for i in range(2)]
    addresses = [s.address for s in stores]
    data = np.random.default_rng(0).bytes(300_000)
    stores[1].signal(signal.SIGKILL)
    stores[1].wait(10)

    async def go():
        async with _replicated(addresses, write_quorum=1) as client:
            await _write(client, 1, data)
        async with _replicated(addresses) as client:  # default: 2 of 2
            with pytest.raises(replicas.QuorumError) as info:
                await _write(client, 2, data + b"x")
            return str(info.value)

    message = asyncio.run(asyncio.wait_for(go(), 60))
    assert "1 of 2 checkpoint stores acknowledged, the quorum is 2" in message
    assert addresses[1] in message and "UNAVAILABLE" in message
    assert _steps(addresses[0], "run") == [1]  # the refused write committed nothing


def test_a_corrupt_blob_is_served_from_the_other_store_and_repaired(cluster):
    stores = [cluster.start_store(index=i) for i in range(2)]
    addresses = [s.address for s in stores]
    data = np.random.default_rng(1).bytes(200_000)
    digest = hashlib.sha256(data).hexdigest()

    async def go():
        async with _replicated(addresses) as client:
            await _write(client, 1, data)
            path = cluster.workdir / "store" / "blobs" / digest[:2] / digest
            path.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])  # bit rot on the first store
            assert await client.get_blob(digest) == data
            reports = {r.store: r for r in await client.repair(["run"])}
            assert reports[addresses[0]].blobs_copied == 1 and reports[addresses[0]].complete

    asyncio.run(asyncio.wait_for(go(), 60))

    async def direct(client):
        return await client.get_blob(digest)

    assert store_call(addresses[0], direct) == data  # the first store holds the right bytes again


def test_store_repair_command_rebuilds_an_emptied_store(cluster):
    stores = [cluster.start_store(index=i) for i in range(2)]
    addresses = [s.address for s in stores]
    rng = np.random.default_rng(2)

    async def go():
        async with _replicated(addresses) as client:
            for step in range(1, 4):
                await _write(client, step, rng.bytes(50_000))

    asyncio.run(asyncio.wait_for(go(), 60))
    stores[0].stop(10)
    shutil.rmtree(cluster.workdir / "store")
    stores[0].start()
    stores[0].wait_ready(60)
    out = subprocess.run(
        [sys.executable, "-m", "ddiloco.cli.main", "store", "repair", "--store", ",".join(addresses),
         "--run-id", "run", "--timeout-s", "60"],
        capture_output=True, text=True, timeout=120, env=cluster.env, cwd=cluster.workdir,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == (f"{addresses[0]}: 3 blobs (150000 bytes) copied, manifests restored: run@3, run@2, run@1; "
                        "up to date"), out.stdout
    assert lines[1].startswith(f"{addresses[1]}: 0 blobs (0 bytes) copied, manifests restored: none; up to date")
    assert _load_every_checkpoint(addresses[0], "run", [1, 2, 3], decode=False) == [1, 2, 3]
