"""--commit-before-broadcast: no fragment version leaves the syncer before a committed checkpoint holds it.

By default the syncer writes a checkpoint every --checkpoint-every-merges merges, in the background,
and a crash or a failover loses the merges since the last one: learners may already hold versions
the restarted syncer (or the new leader) never had, and rebase their work onto the restored ones.
In this mode every merge asks for a checkpoint (`CommitLoop.request`), and watch streams send a
fragment's version only once a committed checkpoint holds it (`publishing.Downloads.sendable`,
`FragmentSlot.committed_version`; with leader election "committed" means through the fenced etcd
pointer). A restarted syncer or a new leader therefore restores every version any learner was
sent: the failover loses no merge that left the syncer.

The price is one checkpoint on the path from each merge to its broadcast (measured in
docs/failover-stores.md: 0.11 s with one store, 0.24 s with two, for the default model on the test
VM, plus a round trip to the farthest store in the write quorum). Learners never wait for it: they
train on and fold versions in when they arrive; the grace window sees the longer sync time.

Owns `CommitLoop`: one checkpoint at a time; merges that land while one is written are covered by
the next (requests coalesce); a checkpoint that fails is retried after a capped, doubling pause for
as long as merges are uncommitted (the store being down delays broadcasts, it never drops a merge).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

_LOG = logging.getLogger("ddiloco.syncer")


class CommitLoop:
    """Commits checkpoints until no merge is left uncommitted. See the module docstring.

    `save` writes one checkpoint of the current state and returns whether it was committed;
    `pending` says whether some merge is not yet in a committed checkpoint."""

    def __init__(self, save: Callable[[], Awaitable[bool]], pending: Callable[[], bool], *,
                 retry_s: float = 0.2, max_retry_s: float = 5.0) -> None:
        if not 0 < retry_s <= max_retry_s:
            raise ValueError(f"retry_s must be in (0, max_retry_s], got {retry_s} and {max_retry_s}")
        self._save, self._pending = save, pending
        self.retry_s, self.max_retry_s = retry_s, max_retry_s
        self._task: asyncio.Task | None = None
        self.failures = 0  # checkpoints that failed and were retried (tests, logs)

    def request(self) -> None:
        """A merge happened: make sure a checkpoint holding it will be committed (call in the loop)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        delay_s = self.retry_s
        while self._pending():
            if await self._save():
                delay_s = self.retry_s
                continue
            self.failures += 1
            _LOG.warning(f"commit before broadcast: checkpoint not committed; merged versions wait, "
                         f"retrying in {delay_s:.1f} s")
            await asyncio.sleep(delay_s)
            delay_s = min(2 * delay_s, self.max_retry_s)

    async def drain(self, timeout_s: float) -> None:
        """Waits (at most `timeout_s`) for the checkpoint being written, then stops retrying."""
        task, self._task = self._task, None
        if task is None or task.done():
            return
        await asyncio.wait([task], timeout=timeout_s)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
