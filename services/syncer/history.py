"""The syncer's durable history for fault tests (`--history-file`; format in ddiloco/history.py).

A passive observer of SyncerCore (events `upload_accepted` and `merged`) plus three records the
syncer's wiring adds: `start` (what this life restored), `checkpoint` (a committed checkpoint) and
`shutdown` (the rounds still open at a graceful exit). Records are written before the action they
record is acknowledged (an upload's record before its response), so a SIGKILL loses none.
"""

from __future__ import annotations

from ddiloco import history as history_lib


class SyncerHistory:
    def __init__(self, core, path: str) -> None:
        self._core = core
        self._writer = history_lib.HistoryWriter(path)

    def _write(self, event: str, **fields) -> None:
        self._writer.write(event, instance=self._core.instance, **fields)

    def started(self) -> None:
        core = self._core
        self._write("start", restored=core.restored_from_checkpoint, outer_steps=core.outer_steps,
                    min_quorum=core.run.min_quorum, liveness_timeout_s=core.liveness_timeout_s,
                    max_grace_s=core.max_grace_s,
                    fragments={str(fid): list(core.fragment_digest(fid)) for fid in core.versions()})

    def upload_accepted(self, header) -> None:
        self._write("accepted", learner=header.learner_id, incarnation=header.incarnation,
                    fragment=header.fragment_id, base_version=header.base_version, tokens=header.tokens)

    def merged(self, record) -> None:
        # Called under the fragment's lock, right after the merge: the digests are this version's.
        _, published_sha256, params_sha256 = self._core.fragment_digest(record.fragment_id)
        self._write("merged", fragment=record.fragment_id, version=record.version, sha256=published_sha256,
                    params_sha256=params_sha256, reason=record.reason,
                    contributors=[[c.learner_id, c.incarnation, c.base_version, c.tokens] for c in record.contributors])

    def checkpoint_committed(self, snapshot) -> None:
        """`snapshot`: the committed SyncerSnapshot."""
        self._write("checkpoint", outer_step=snapshot.outer_steps,
                    versions={str(f.fragment_id): f.version for f in snapshot.fragments})

    def shutdown(self) -> None:
        pending = [[fid, c.learner_id, c.incarnation, c.base_version] for fid, c in self._core.pending_contributions()]
        self._write("shutdown", pending=pending)
        self._writer.close()


def attach(core, path: str) -> SyncerHistory | None:
    """Starts recording to `path` (None when empty): writes `start` and observes the core."""
    if not path:
        return None
    history = SyncerHistory(core, path)
    history.started()
    core.observe(history)
    return history
