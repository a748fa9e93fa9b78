"""ReplicatedCheckpointClient over in-memory fake stores: quorum writes, verified reads with
fallback, the latest checkpoint with and without a commit pointer, bounded repair."""

from __future__ import annotations

import asyncio
import hashlib
import time

import grpc
import pytest

from ddiloco import checkpoint_replicas as replicas
from ddiloco.checkpoint_client import BlobRef, BlobVerificationError, Manifest
from ddiloco.checkpoint_commit import CommitFenced, CommitRecord
from ddiloco.rpc import retry as retry_lib
from tests import fakes


class FakeStore:
    """The store's semantics in memory; `down` makes every call fail as an outage would."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.manifests: dict[str, dict[int, Manifest]] = {}
        self.down = False
        self.calls = 0

    def _enter(self) -> None:
        self.calls += 1
        if self.down:
            raise retry_lib.RetriesExhausted("fake", 1, None)

    async def put_blob(self, data: bytes) -> str:
        self._enter()
        digest = hashlib.sha256(data).hexdigest()
        self.blobs.setdefault(digest, data)
        return digest

    async def get_blob(self, digest: str) -> bytes:
        self._enter()
        if digest not in self.blobs:
            raise KeyError(digest)
        if hashlib.sha256(self.blobs[digest]).hexdigest() != digest:
            raise BlobVerificationError(digest)
        return self.blobs[digest]

    async def stat_blobs(self, digests) -> set[str]:
        self._enter()
        return {d for d in digests if d in self.blobs}

    async def commit_manifest(self, run_id, step, blobs, metadata=None) -> int:
        self._enter()
        refs = tuple(BlobRef(n, d, s) for n, (d, s) in blobs.items())
        if any(r.digest not in self.blobs for r in refs):
            raise ValueError("blob missing")
        steps = self.manifests.setdefault(run_id, {})
        if steps and step <= max(steps):
            raise ValueError("step not after the latest")
        steps[step] = Manifest(run_id, step, 0.0, refs, dict(metadata or {}))
        return step

    async def latest_manifest(self, run_id):
        self._enter()
        steps = self.manifests.get(run_id, {})
        return steps[max(steps)] if steps else None

    async def list_manifests(self, run_id):
        self._enter()
        steps = self.manifests.get(run_id, {})
        return [steps[s] for s in sorted(steps)]

    async def restore_manifest(self, manifest):
        self._enter()
        assert all(r.digest in self.blobs for r in manifest.blobs), "blobs must be copied first"
        steps = self.manifests.setdefault(manifest.run_id, {})
        if manifest.step in steps:
            return False, True
        steps[manifest.step] = manifest
        return True, True


class FakePointer:
    def __init__(self) -> None:
        self.records: dict[str, CommitRecord] = {}

    async def latest(self, run_id):
        return self.records.get(run_id)

    async def commit(self, record):
        held = self.records.get(record.run_id)
        if held is not None and record.epoch < held.epoch:
            raise CommitFenced(record)
        self.records[record.run_id] = record


def _client(n: int, **kwargs):
    stores = {f"s{i}": FakeStore() for i in range(n)}
    kwargs.setdefault("quorum_wait_s", 0.0)
    return replicas.ReplicatedCheckpointClient(stores, **kwargs), stores


async def _checkpoint(client, step: int, payload: bytes, **kwargs) -> None:
    digest = await client.put_blob(payload)
    await client.commit_manifest("run", step, {"params": (digest, len(payload))}, **kwargs)


def test_default_write_quorum_and_bounds() -> None:
    assert replicas.default_write_quorum(1) == 1
    assert replicas.default_write_quorum(3) == 2
    with pytest.raises(ValueError, match="write_quorum=3"):
        _client(2, write_quorum=3)


def test_blob_write_needs_the_quorum_and_names_the_failed_stores() -> None:
    client, stores = _client(3)
    stores["s0"].down = True
    asyncio.run(_checkpoint(client, 1, b"a"))  # 2 of 3 acknowledged
    assert all(hashlib.sha256(b"a").hexdigest() in stores[s].blobs for s in ("s1", "s2"))
    stores["s1"].down = True
    with pytest.raises(replicas.QuorumError, match=r"1 of 3 .*quorum is 2.*s0: .*s1: "):
        asyncio.run(client.put_blob(b"b"))


def test_write_quorum_one_commits_with_one_store_down() -> None:
    client, stores = _client(2, write_quorum=1)
    stores["s1"].down = True
    asyncio.run(_checkpoint(client, 1, b"a"))
    assert 1 in stores["s0"].manifests["run"] and "run" not in stores["s1"].manifests


def test_a_failed_store_is_skipped_until_its_backoff_ends() -> None:
    clock = fakes.FakeClock()
    client, stores = _client(2, write_quorum=1, down_backoff_s=5.0, clock=clock)
    stores["s1"].down = True
    asyncio.run(client.put_blob(b"a"))
    calls = stores["s1"].calls
    asyncio.run(client.put_blob(b"b"))
    assert stores["s1"].calls == calls  # benched
    clock.advance(6.0)
    asyncio.run(client.put_blob(b"c"))
    assert stores["s1"].calls == calls + 1  # tried again


def test_a_corrupt_copy_is_served_from_the_other_store() -> None:
    client, stores = _client(2)
    digest = asyncio.run(client.put_blob(b"payload"))
    stores["s0"].blobs[digest] = b"rotted!"
    assert asyncio.run(client.get_blob(digest)) == b"payload"
    stores["s1"].blobs[digest] = b"rotted!"
    with pytest.raises(replicas.BlobUnavailable, match="s0: BlobVerificationError.*s1: BlobVerificationError"):
        asyncio.run(client.get_blob(digest))


def test_latest_without_a_pointer_is_the_highest_step_of_a_read_quorum() -> None:
    client, stores = _client(3)  # write quorum 2, read quorum 2
    asyncio.run(_checkpoint(client, 1, b"a"))
    stores["s0"].down = True
    asyncio.run(_checkpoint(client, 2, b"b"))  # on s1 and s2 only
    stores["s0"].down, stores["s1"].down = False, True
    assert asyncio.run(client.latest_manifest("run")).step == 2  # s0 says 1, s2 says 2
    stores["s2"].down = True
    with pytest.raises(replicas.QuorumError, match="1 of 3 .* quorum is 2"):
        asyncio.run(client.latest_manifest("run"))


def test_latest_with_a_pointer_reads_the_pointed_step_from_any_store() -> None:
    client, stores = _client(2)
    pointer = FakePointer()
    asyncio.run(_checkpoint(client, 1, b"a", pointer=pointer, epoch=1))
    asyncio.run(_checkpoint(client, 2, b"b"))  # written, never committed through the pointer
    assert asyncio.run(client.latest_manifest("run", pointer=pointer)).step == 1
    stores["s0"].down = True
    assert asyncio.run(client.latest_manifest("run", pointer=pointer)).step == 1
    pointer.records["run"] = CommitRecord("run", 7, 1)
    with pytest.raises(replicas.QuorumError, match="names step 7"):
        asyncio.run(client.latest_manifest("run", pointer=pointer))
    assert asyncio.run(client.latest_manifest("other", pointer=pointer)) is None


class SilentStore(FakeStore):
    """A store whose host vanished: calls get no answer at all (not even a refusal)."""

    async def list_manifests(self, run_id):
        self.calls += 1
        await asyncio.sleep(3600)

    async def get_blob(self, digest: str) -> bytes:
        self.calls += 1
        await asyncio.sleep(3600)


def test_with_a_pointer_a_silent_store_does_not_hold_up_the_restore() -> None:
    # Failed before the reads were hedged: the first store was asked alone and held the restore
    # for its whole call timeout (here the test's 60 s bound), and then the blob reads went to it
    # first again.
    stores = {"s0": SilentStore(), "s1": FakeStore()}
    client = replicas.ReplicatedCheckpointClient(stores, write_quorum=1, call_timeout_s=60.0,
                                                 blob_timeout_s=60.0, quorum_wait_s=0.0)
    pointer = FakePointer()
    digest = asyncio.run(stores["s1"].put_blob(b"params"))
    asyncio.run(stores["s1"].commit_manifest("run", 3, {"params": (digest, 6)}))
    pointer.records["run"] = CommitRecord("run", 3, 1)

    async def restore():
        manifest = await client.latest_manifest("run", pointer=pointer)
        return manifest, await client.get_blob(manifest.blobs[0].digest)

    started = time.monotonic()
    manifest, data = asyncio.run(asyncio.wait_for(restore(), 5.0))
    assert manifest.step == 3 and data == b"params"
    assert time.monotonic() - started < 2.0
    assert stores["s0"].calls == 1  # asked once (the manifest), never for the blob
    # The syncer's restore lists the manifests over a read quorum (1 of 2 under write quorum 2):
    # the silent store must not hold that up either (it did, for the whole call timeout).
    client = replicas.ReplicatedCheckpointClient(stores, write_quorum=2, call_timeout_s=60.0,
                                                 blob_timeout_s=60.0, quorum_wait_s=0.0)
    started = time.monotonic()
    listed = asyncio.run(asyncio.wait_for(client.list_manifests("run"), 5.0))
    assert [m.step for m in listed] == [3] and time.monotonic() - started < 2.0
    assert asyncio.run(asyncio.wait_for(client.get_blob(digest), 5.0)) == b"params"


def test_a_fenced_or_below_quorum_commit_does_not_move_the_pointer() -> None:
    client, stores = _client(2)
    pointer = FakePointer()
    pointer.records["run"] = CommitRecord("run", 1, 5)
    with pytest.raises(CommitFenced):
        asyncio.run(_checkpoint(client, 2, b"a", pointer=pointer, epoch=4))
    stores["s1"].down = True
    with pytest.raises(replicas.QuorumError):
        asyncio.run(_checkpoint(client, 3, b"b", pointer=pointer, epoch=5))
    assert pointer.records["run"] == CommitRecord("run", 1, 5)


def test_repair_rebuilds_a_store_that_lost_everything_and_fills_gaps_below_its_latest() -> None:
    client, stores = _client(2, write_quorum=1)
    for step in (1, 2):
        asyncio.run(_checkpoint(client, step, bytes([step]) * 10))
    stores["s1"].down = True
    asyncio.run(_checkpoint(client, 3, b"three"))  # s1 misses step 3 ...
    stores["s1"].down = False
    client._down_until.clear()
    asyncio.run(_checkpoint(client, 4, b"four"))  # ... but takes step 4: step 3 is a gap below its latest
    assert sorted(stores["s1"].manifests["run"]) == [1, 2, 4]
    gap = {r.store: r for r in asyncio.run(client.repair(["run"]))}
    assert gap["s1"].manifests_restored == [("run", 3)] and gap["s1"].blobs_copied == 1
    assert sorted(stores["s1"].manifests["run"]) == [1, 2, 3, 4]
    stores["s1"].blobs.clear()  # then its disk is lost
    stores["s1"].manifests.clear()
    reports = {r.store: r for r in asyncio.run(client.repair(["run"]))}
    assert reports["s1"].manifests_restored == [("run", 4), ("run", 3), ("run", 2), ("run", 1)]
    assert reports["s1"].blobs_copied == 4 and reports["s1"].complete
    assert reports["s0"].blobs_copied == 0 and not reports["s0"].manifests_restored
    assert sorted(stores["s1"].manifests["run"]) == [1, 2, 3, 4]
    assert stores["s1"].blobs == stores["s0"].blobs
    again = {r.store: r for r in asyncio.run(client.repair(["run"]))}
    assert again["s1"].blobs_copied == 0 and again["s1"].manifests_restored == []


def test_repair_is_bounded_per_pass_and_reports_unreachable_stores() -> None:
    client, stores = _client(3, write_quorum=1)
    for step in range(1, 4):
        asyncio.run(_checkpoint(client, step, bytes([step]) * 100))
    stores["s1"].blobs.clear()
    stores["s1"].manifests.clear()
    stores["s2"].down = True
    reports = {r.store: r for r in asyncio.run(client.repair(["run"], max_bytes=150))}
    assert reports["s1"].blobs_copied == 1 and not reports["s1"].complete
    assert reports["s2"].errors == ["unreachable (RetriesExhausted: fake: gave up after 1 attempts; last error "
                                    "NoneType: None)"]
    passes = 1
    while not reports["s1"].complete:
        reports = {r.store: r for r in asyncio.run(client.repair(["run"], max_bytes=150))}
        passes += 1
        assert passes <= 4
    assert sorted(stores["s1"].manifests["run"]) == [1, 2, 3]


def test_background_repair_runs_after_a_commit_a_store_missed() -> None:
    async def go() -> None:
        client, stores = _client(2, write_quorum=1, down_backoff_s=0.0)
        client.start_repair(["run"], interval_s=3600.0)  # only the commit can wake it
        try:
            stores["s1"].down = True
            await _checkpoint(client, 1, b"a")
            stores["s1"].down = False  # before the repair task first runs (the fakes never yield)
            for _ in range(200):
                if stores["s1"].manifests.get("run"):
                    break
                await asyncio.sleep(0.01)
            assert stores["s1"].manifests.get("run"), "repair never ran"
        finally:
            await client.close()

    asyncio.run(asyncio.wait_for(go(), 10))


def test_a_store_that_refuses_a_commit_is_repaired_at_once() -> None:
    async def go() -> None:
        client, stores = _client(2, write_quorum=1)
        client.start_repair(["run"], interval_s=3600.0)  # only the refused commit can wake it
        try:
            digest = await stores["s0"].put_blob(b"a")  # s1 missed this upload
            await client.commit_manifest("run", 1, {"params": (digest, 1)})  # s1: "blob missing"
            assert "run" not in stores["s1"].manifests
            for _ in range(200):
                if stores["s1"].manifests.get("run"):
                    break
                await asyncio.sleep(0.01)
            assert sorted(stores["s1"].manifests["run"]) == [1] and digest in stores["s1"].blobs
        finally:
            await client.close()

    asyncio.run(asyncio.wait_for(go(), 10))


class _NotFound(Exception):
    """What a store answers for a blob it does not hold (grpc.aio.AioRpcError's code and details)."""

    def code(self):
        return grpc.StatusCode.NOT_FOUND

    def details(self) -> str:
        return "no such blob"


class PrunedStore(FakeStore):
    """A store whose garbage collection removed blobs: GetBlob answers NOT_FOUND."""

    async def get_blob(self, digest: str) -> bytes:
        if digest not in self.blobs and not self.down:
            raise _NotFound()
        return await super().get_blob(digest)


def test_a_blob_every_store_lacks_is_not_found_one_store_down_is_not() -> None:
    """`ddiloco audit replay` tells a pruned blob (every store: NOT_FOUND) from an outage."""
    stores = {"s0": PrunedStore(), "s1": PrunedStore()}
    client = replicas.ReplicatedCheckpointClient(stores, quorum_wait_s=0.0)
    with pytest.raises(replicas.BlobUnavailable) as pruned:
        asyncio.run(client.get_blob("ab" * 32))
    assert pruned.value.not_found
    stores["s1"].down = True
    with pytest.raises(replicas.BlobUnavailable) as unknown:
        asyncio.run(client.get_blob("ab" * 32))
    assert not unknown.value.not_found
