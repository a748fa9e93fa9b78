"""The syncer's side of the checkpoint store's merge ledger: records shipped in order, in the background.

Owns `StoreLedger`: `append` (called by Influence.merged under a fragment's lock) only queues the
record and its retained contributions; a background task ships them in order: the blobs first
(PutBlob, content-addressed), then the records (AppendLedger), each call under a deadline and a
bounded number of retries (tenacity). Records are chained when first sent, onto the store's head
(`prev`), so a restarted syncer continues the store's chain (`resume` reads the head) and a record
that was never acknowledged is re-sent as the same line. When the store refuses the chain
(FAILED_PRECONDITION: another writer moved the head, or the store lost records) the head is read
again: the queued records already held there count as acknowledged, the rest are chained onto it.
The queue is bounded: beyond `max_pending` records new ones are dropped (counted, logged); beyond
`max_pending_bytes` of retained contributions a record keeps its hashes but not the bytes
(`fold.blob_dropped`). Nothing here ever blocks or fails a merge.
Must not: decide what a record holds (influence.py) or talk to the store except through `client`
(a CheckpointClient or ReplicatedCheckpointClient).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json
import logging

import grpc
import tenacity

from ddiloco import checkpoint_replicas as replicas_lib
from ddiloco.rpc import retry as retry_lib

_LOG = logging.getLogger("ddiloco.syncer")

FORMAT = "ddiloco.ledger/1"
BATCH_RECORDS = 64  # records per AppendLedger call
_BACKOFF_MAX_S = 30.0


@dataclasses.dataclass
class _Entry:
    record: dict
    blobs: dict[str, bytes]
    line: str = ""  # serialized once chained; re-sent as it is
    prev: str = ""


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, (asyncio.TimeoutError, retry_lib.RetriesExhausted, ConnectionError)):
        return True
    return isinstance(exc, grpc.RpcError) and exc.code() in (grpc.StatusCode.UNAVAILABLE,
                                                             grpc.StatusCode.DEADLINE_EXCEEDED)


def _refused_chain(exc: BaseException) -> bool:
    if isinstance(exc, grpc.RpcError):
        return exc.code() == grpc.StatusCode.FAILED_PRECONDITION
    return isinstance(exc, replicas_lib.QuorumError) and "FAILED_PRECONDITION" in str(exc)


def line_hash(line: str) -> str:
    return hashlib.sha256(line.encode()).hexdigest()


class StoreLedger:
    """See the module docstring. `call_timeout_s` bounds each call, `blob_timeout_s` each blob."""

    def __init__(self, client, run_id: str, *, call_timeout_s: float = 10.0, blob_timeout_s: float = 120.0,
                 attempts: int = 4, max_pending: int = 100_000, max_pending_bytes: int = 1 << 30) -> None:
        self._client = client
        self.run_id = run_id
        self._call_timeout_s = call_timeout_s
        self._blob_timeout_s = blob_timeout_s
        self._attempts = attempts
        self._max_pending = max_pending
        self._max_pending_bytes = max_pending_bytes
        self._pending: collections.deque[_Entry] = collections.deque()
        self._pending_bytes = 0
        self._uploaded: set[str] = set()  # blobs of the queued records already stored
        self._head: str | None = None  # the store's head; None: read it before the next append
        self.length = 0  # the store's ledger length, as last acknowledged
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task | None = None
        # Counters since this syncer started (services/syncer/metrics.py exports them).
        self.acknowledged = 0
        self.record_bytes = 0  # bytes of the records the store acknowledged from an append of ours
        self.dropped = 0
        self.blobs_dropped = 0
        self.blob_bytes_dropped = 0
        self.failures = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def pending_bytes(self) -> int:
        """Bytes of the retained contributions still queued (bounded by `max_pending_bytes`)."""
        return self._pending_bytes

    async def resume(self) -> None:
        """Reads the store's head (under the call deadline); queued records it already holds are
        acknowledged. Raises on failure (the shipping loop reads it again before sending)."""
        length, head = await asyncio.wait_for(self._client.ledger_head(self.run_id), self._call_timeout_s)
        for index, entry in enumerate(self._pending):
            if entry.line and line_hash(entry.line) == head:  # sent, acknowledged, the answer lost
                for _ in range(index + 1):
                    self._pop()
                break
        self._head, self.length = head, length

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="ledger-sink")

    def append(self, record: dict, blobs: dict[str, bytes] | None = None) -> None:
        """Queues one merge record (its `prev` is set when it is sent). Never blocks, never raises."""
        if len(self._pending) >= self._max_pending:
            self.dropped += 1
            _LOG.error("merge ledger queue full: record dropped", extra={"fields": {
                "fragment": record.get("fragment"), "version": record.get("version"), "queued": len(self._pending)}})
            return
        blobs = dict(blobs or {})
        size = sum(len(b) for b in blobs.values())
        if blobs and self._pending_bytes + size > self._max_pending_bytes:
            # The record still names each contribution's hash; only the bytes for replay are lost.
            self.blobs_dropped += len(blobs)
            self.blob_bytes_dropped += size
            for c in record.get("contributors", ()):
                if "blob" in (c.get("fold") or {}):
                    c["fold"]["blob_dropped"] = c["fold"].pop("blob")
            record.pop("blobs", None)
            blobs, size = {}, 0
        self._pending.append(_Entry(record, blobs))
        self._pending_bytes += size
        self._idle.clear()
        self._wake.set()

    def _pop(self) -> None:
        entry = self._pending.popleft()
        self._pending_bytes -= sum(len(b) for b in entry.blobs.values())
        self._uploaded.difference_update(entry.blobs)
        self.acknowledged += 1

    async def _run(self) -> None:
        backoff_s = 0.5
        while True:
            if not self._pending:
                self._idle.set()
                await self._wake.wait()
                self._wake.clear()
                continue
            try:
                await self._ship_batch()
                backoff_s = 0.5
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the store is down or refused: the records stay queued, in order
                self.failures += 1
                if _refused_chain(exc):
                    self._head = None
                _LOG.warning("merge ledger append failed; retrying", extra={"fields": {
                    "queued": len(self._pending), "error": repr(exc)[:300], "retry_in_s": backoff_s}})
                await asyncio.sleep(backoff_s)
                backoff_s = min(_BACKOFF_MAX_S, backoff_s * 2)

    async def _retrying(self, what: str, fn, timeout_s: float):
        async for attempt in tenacity.AsyncRetrying(
                stop=tenacity.stop_after_attempt(self._attempts),
                wait=tenacity.wait_exponential_jitter(initial=0.2, max=5.0),
                retry=tenacity.retry_if_exception(_transient), reraise=True):
            with attempt:
                return await asyncio.wait_for(fn(), timeout_s)
        raise AssertionError(f"unreachable: {what}")

    async def _ship_batch(self) -> None:
        if self._head is None:
            await self.resume()
        batch = list(self._pending)[:BATCH_RECORDS]
        if not batch:  # the store already held them all (resume acknowledged them)
            return
        for entry in batch:  # blobs before the records that reference them (the store checks)
            for digest, data in entry.blobs.items():
                if digest not in self._uploaded:
                    await self._retrying("PutBlob", lambda d=data: self._client.put_blob(d), self._blob_timeout_s)
                    self._uploaded.add(digest)
        prev = self._head
        for entry in batch:
            if not entry.line or entry.prev != prev:
                entry.prev = prev
                entry.line = json.dumps({"format": FORMAT, **entry.record, "prev": prev}, sort_keys=True,
                                        separators=(",", ":"))
            prev = line_hash(entry.line)
        lines = [entry.line for entry in batch]
        length, head = await self._retrying(
            "AppendLedger", lambda: self._client.append_ledger(self.run_id, lines), self._call_timeout_s)
        for _ in batch:
            self._pop()
        self.record_bytes += sum(len(line) for line in lines)  # json.dumps escapes to ASCII: chars are bytes
        self._head, self.length = head, length

    async def drain(self, timeout_s: float) -> bool:
        """Waits (at most `timeout_s`) until every queued record is acknowledged; True if so."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            _LOG.warning("merge ledger: records still queued at shutdown", extra={"fields": {
                "queued": len(self._pending)}})
            return False
        return True

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
