"""A syncer snapshot (services/syncer/snapshots.py) never counts a merge its fragments do not hold.

A CI run caught it: the snapshot copied each fragment under its own lock, one after the other, and
read the run's counters afterwards, so a merge of an already-copied fragment landed in between. The
checkpoint then claimed outer step 21 with fragment 0 a version behind; at shutdown the final
checkpoint was skipped as already written, and the export held the older values.
"""

from __future__ import annotations

import asyncio

import numpy as np

from tests import fakes


def test_a_merge_during_a_snapshot_is_in_both_its_fragments_and_its_counters_or_in_neither():
    # Fails before the fix: the snapshot holds fragment 0 at version 0 but counts its merge
    # (outer_steps 1, the merge's tokens).
    async def scenario():
        core = fakes.make_core()
        fakes.join_all(core, ["a"])
        first, second = core.slots[0], core.slots[1]
        await second.lock.acquire()  # fragment 1 busy (a merge or a fold-in in progress)
        taking = asyncio.ensure_future(core.snapshot())
        await fakes.settle()
        uploading = asyncio.ensure_future(
            fakes.upload(core, "a", 0, 0, np.full(first.fragment.numel, 0.01, np.float32)))
        await fakes.settle()  # with each fragment locked in turn, fragment 0 merges here
        second.lock.release()
        snapshot = await asyncio.wait_for(taking, 10)
        await asyncio.wait_for(uploading, 10)
        await fakes.settle_until(lambda: first.version == 1, timeout_s=10)
        return snapshot, core.outer_steps

    snapshot, outer_steps = asyncio.run(scenario())
    assert outer_steps == 1  # the merge happened, after the snapshot
    assert snapshot.outer_steps == sum(f.version for f in snapshot.fragments) == 0
    assert snapshot.tokens_merged == 0
