"""The commit pointer on etcd (ddiloco.checkpoint_commit.CommitPointer), fenced by the leader's epoch.

One key per run, `<prefix>/commit/<run>`, holds `{"step", "epoch"}` of the latest committed
checkpoint. A commit is one etcd transaction that puts it only if

  - the leader key's create revision still equals the record's epoch (the writer still leads, with
    the lease it was elected with: a deposed leader's commit fails even if nobody has committed
    since), and
  - the pointer has not changed since it was read (compare-and-put on its mod revision).

A failed comparison is `CommitFenced` when the leader key moved on, and is read again otherwise
(bounded). The bytes of a checkpoint are written to the stores before its commit; a manifest that
is never committed is never restored.
"""

from __future__ import annotations

import json
import logging

from ddiloco.checkpoint_commit import CommitFenced, CommitRecord
from ddiloco.coord import etcd as etcd_lib

_LOG = logging.getLogger("ddiloco.coord")

_COMMIT_ATTEMPTS = 4  # reads-and-puts when the pointer moves under a commit (only retries of our own)


def commit_key(prefix: str, run_id: str) -> bytes:
    return f"{prefix.rstrip('/')}/commit/{run_id}".encode()


class EtcdCommitPointer:
    """See the module docstring. `leader_key` is the election key whose epoch fences commits."""

    def __init__(self, etcd: etcd_lib.Etcd, *, prefix: str, leader_key: bytes) -> None:
        self._etcd = etcd
        self._prefix = prefix
        self._leader_key = leader_key

    def _parse(self, run_id: str, kv: etcd_lib.KeyValue) -> CommitRecord:
        try:
            fields = json.loads(kv.value)
            return CommitRecord(run_id=run_id, step=int(fields["step"]), epoch=int(fields["epoch"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"commit pointer of run {run_id!r} is not readable: {kv.value[:200]!r}") from exc

    async def latest(self, run_id: str) -> CommitRecord | None:
        kv = await self._etcd.get(commit_key(self._prefix, run_id))
        return None if kv is None else self._parse(run_id, kv)

    async def commit(self, record: CommitRecord) -> None:
        if record.epoch <= 0 or record.step < 0:
            raise ValueError(f"commit needs an epoch > 0 and a step >= 0, got {record}")
        key = commit_key(self._prefix, record.run_id)
        value = json.dumps({"step": record.step, "epoch": record.epoch}, sort_keys=True).encode()
        for _ in range(_COMMIT_ATTEMPTS):
            current_kv = await self._etcd.get(key)
            current = None if current_kv is None else self._parse(record.run_id, current_kv)
            if current is not None:
                if current.epoch > record.epoch:
                    raise CommitFenced(f"run {record.run_id}: epoch {record.epoch} is older than the committed "
                                       f"epoch {current.epoch}")
                if current == record:
                    return  # an earlier attempt whose answer was lost
                if current.epoch == record.epoch and current.step > record.step:
                    raise ValueError(f"run {record.run_id}: step {record.step} is before the committed step "
                                     f"{current.step} of the same epoch")
            result = await self._etcd.txn(
                [etcd_lib.create_equals(self._leader_key, record.epoch),
                 etcd_lib.mod_equals(key, current_kv.mod_revision if current_kv is not None else 0)],
                put=(key, value, 0), read_key=self._leader_key)
            if result.succeeded:
                return
            leader_epoch = result.read.create_revision if result.read is not None else 0
            if leader_epoch != record.epoch:
                raise CommitFenced(f"run {record.run_id}: epoch {record.epoch} no longer leads "
                                   f"(leader key epoch {leader_epoch or 'none'})")
        raise etcd_lib.EtcdUnavailable(f"run {record.run_id}: the commit pointer kept moving; "
                                       f"gave up after {_COMMIT_ATTEMPTS} attempts")
