"""--commit-before-broadcast (services/syncer/commit_gate.py): no merged version is sent before a
committed checkpoint holds it, every merge is committed, and a failed commit is retried.

Through the syncer's own checkpointer (services/syncer/__main__.py _Checkpointer) over a fake store
whose commits can fail or be held, and a real SyncerCore: the watch streams' test
(`SyncerCore.sendable`) is what WatchFragments asks before sending a fragment's version.
"""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pytest

from services.syncer import commit_gate
from services.syncer import config as config_lib
from services.syncer.__main__ import _Checkpointer
from tests import fakes


class _Store:
    """A checkpoint client that keeps manifests; `fail` commits refused first; `gate` holds commits."""

    def __init__(self, fail: int = 0) -> None:
        self.fail, self.blobs, self.manifests = fail, {}, []
        self.gate = asyncio.Event()
        self.gate.set()

    async def put_blob(self, data: bytes) -> bytes:
        digest = hashlib.sha256(data).digest()
        self.blobs[digest] = data
        return digest

    async def commit_manifest(self, run_id: str, step: int, refs, metadata) -> None:
        await self.gate.wait()
        if self.fail:
            self.fail -= 1
            raise ConnectionError("store unavailable")
        self.manifests.append(step)


def _setup(store: _Store, **fields):
    cfg = config_lib.SyncerConfig(**{**fakes.CONFIG_DEFAULTS, "checkpoint_target": "store:1",
                                     "commit_before_broadcast": True, **fields})
    core = fakes.make_core(config=cfg)
    checkpointer = _Checkpointer(core, store, cfg)
    if checkpointer.commit_loop is not None:
        checkpointer.commit_loop.retry_s = 0.01  # the test's pauses, not the shipped 0.2 s
    core.on_merge = checkpointer.on_merge
    fakes.join_all(core, ["a"])
    return core, checkpointer


async def _merge(core, fid: int = 0) -> None:
    slot = core.slots[fid]
    version = slot.version
    await fakes.upload(core, "a", fid, version, np.full(slot.fragment.numel, 0.01, np.float32))
    await fakes.settle_until(lambda: slot.version > version)


def test_a_merged_version_is_held_back_until_its_checkpoint_is_committed():
    async def scenario():
        store = _Store()
        store.gate.clear()  # the store holds the commit
        core, checkpointer = _setup(store)
        slot = core.slots[0]
        assert core.downloads.sendable(slot)  # the initial version is sent at once
        await _merge(core)
        await fakes.settle()
        held = (slot.version, core.downloads.sendable(slot), list(store.manifests))
        counter = core.change_counter
        store.gate.set()
        await fakes.settle_until(lambda: core.downloads.sendable(slot), timeout_s=10)
        released = (core.downloads.sendable(slot), list(store.manifests), core.change_counter > counter)
        await checkpointer.drain()
        return held, released

    held, released = asyncio.run(scenario())
    assert held == (1, False, [])  # merged, not sendable, nothing committed yet
    assert released == (True, [1], True)  # committed at outer step 1, sendable, watchers woken


def test_every_merge_is_committed_and_a_failed_commit_is_retried():
    async def scenario():
        store = _Store(fail=2)
        core, checkpointer = _setup(store)
        for _ in range(3):
            await _merge(core, 0)
            await _merge(core, 1)
        await fakes.settle_until(lambda: core.last_checkpoint_outer_step == core.outer_steps, timeout_s=10)
        sendable = [core.downloads.sendable(s) for s in core.owned_slots]
        await checkpointer.drain()
        return core.outer_steps, store.manifests, checkpointer.commit_loop.failures, sendable

    outer_steps, manifests, failures, sendable = asyncio.run(scenario())
    assert outer_steps == 6
    assert manifests[-1] == 6 and manifests == sorted(manifests)  # the last merge committed too
    assert failures == 2  # both refusals retried, no merge given up
    assert sendable == [True, True]


def test_a_restored_version_counts_as_committed():
    async def scenario():
        core, checkpointer = _setup(_Store())
        await _merge(core)
        snapshot = await core.snapshot()
        await checkpointer.drain()
        fresh, _ = _setup(_Store())
        before = fresh.downloads.sendable(fresh.slots[0])
        fresh.restore(snapshot)
        return before, fresh.slots[0].version, fresh.downloads.sendable(fresh.slots[0])

    assert asyncio.run(scenario()) == (True, 1, True)


def test_without_the_mode_versions_are_sent_at_once():
    async def scenario():
        store = _Store()
        store.gate.clear()
        core, checkpointer = _setup(store, commit_before_broadcast=False)
        await _merge(core)
        return core.downloads.sendable(core.slots[0]), store.manifests

    assert asyncio.run(scenario()) == (True, [])  # no checkpoint per merge (every 16 by default)


def test_the_mode_needs_a_checkpoint_store():
    with pytest.raises(ValueError, match="commit_before_broadcast"):
        config_lib.SyncerConfig(**fakes.CONFIG_DEFAULTS, commit_before_broadcast=True)


def test_commit_loop_coalesces_requests_made_while_a_checkpoint_is_written():
    async def scenario():
        merged, committed, saves = [0], [0], []
        release = asyncio.Event()

        async def save() -> bool:
            saves.append(merged[0])
            await release.wait()
            committed[0] = saves[-1]
            return True

        loop = commit_gate.CommitLoop(save, lambda: merged[0] > committed[0], retry_s=0.01)
        merged[0] = 1
        loop.request()
        await asyncio.sleep(0.01)
        for _ in range(5):  # five merges while the first checkpoint is written
            merged[0] += 1
            loop.request()
        release.set()
        for _ in range(100):
            if committed[0] == merged[0]:
                break
            await asyncio.sleep(0.01)
        await loop.drain(1.0)
        return saves, committed[0]

    saves, committed = asyncio.run(scenario())
    assert saves == [1, 6] and committed == 6  # one more checkpoint covers all five
