"""`ReplicatedCheckpointClient`: one checkpoint client over several store replicas, and their repair.

Owns the replication rules between checkpoint stores (each a `CheckpointClient`):
  * blobs and manifests go to every reachable store; a write succeeds once `write_quorum` stores
    acknowledged it (QuorumError below that, naming each store's failure);
  * reads try the stores in turn: a blob comes from the first store that has it and whose bytes
    match their digest (a corrupt or missing copy falls back to the next store);
  * the latest checkpoint is the commit pointer's step when one is given (a `CommitPointer`,
    e.g. etcd fenced by the leader's epoch), read from any store holding that manifest; without
    a pointer, the highest step held by a read quorum of `n - write_quorum + 1` stores (any commit
    acknowledged by `write_quorum` stores is on at least one of them);
  * merge ledgers (AppendLedger) go to every reachable store, under the write quorum too; a
    store whose chain is behind is given the records it missed, from a store that has them;
  * repair: a store that missed writes (down, partitioned, or its disk lost) gets every blob the
    retained manifests of its peers reference and then those manifests (`RestoreManifest`),
    in bounded passes, in the background (`start_repair`) or once (`repair`).

Every call is bounded by a deadline (`asyncio.wait_for`) on top of each client's own retries. A
store that fails a call is skipped for `down_backoff_s` so one dead replica does not slow every
write; repair passes probe it and bring it back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import grpc

from ddiloco.checkpoint_client import Blobs, Manifest
from ddiloco.checkpoint_commit import CommitPointer, CommitRecord
from ddiloco.rpc import retry as retry_lib

_LOG = logging.getLogger(__name__)
_T = TypeVar("_T")


class QuorumError(Exception):
    """Fewer stores than the quorum acknowledged (or answered); the message names every failure."""


class BlobUnavailable(Exception):
    """No store could serve a verified copy of a blob (`not_found`: every store answered NOT_FOUND)."""

    not_found = False


class StoreClient(Protocol):
    """What the replicated client needs of one store (ddiloco.checkpoint_client.CheckpointClient)."""

    async def put_blob(self, data: bytes) -> str: ...

    async def get_blob(self, digest: str) -> bytes: ...

    async def stat_blobs(self, digests: Iterable[str]) -> set[str]: ...

    async def commit_manifest(
        self, run_id: str, step: int, blobs: Blobs, metadata: Mapping[str, str] | None = None
    ) -> int: ...

    async def latest_manifest(self, run_id: str) -> Manifest | None: ...

    async def list_manifests(self, run_id: str) -> list[Manifest]: ...

    async def restore_manifest(self, manifest: Manifest) -> tuple[bool, bool]: ...

    async def append_ledger(self, run_id: str, lines: Sequence[str]) -> tuple[int, str]: ...

    async def ledger_head(self, run_id: str) -> tuple[int, str]: ...

    async def read_ledger(self, run_id: str, from_index: int = 0) -> list[str]: ...


@dataclasses.dataclass
class RepairReport:
    """What one repair pass did to one store."""

    store: str
    blobs_copied: int = 0
    bytes_copied: int = 0
    manifests_restored: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)
    complete: bool = True  # False: the pass stopped at its byte bound or on an error

    def summary(self) -> str:
        restored = ", ".join(f"{run}@{step}" for run, step in self.manifests_restored) or "none"
        state = "up to date" if self.complete and not self.errors else "INCOMPLETE"
        lines = [f"{self.store}: {self.blobs_copied} blobs ({self.bytes_copied} bytes) copied, "
                 f"manifests restored: {restored}; {state}"]
        lines += [f"  error: {e}" for e in self.errors]
        return "\n".join(lines)


@dataclasses.dataclass
class RepairTotals:
    """Every repair pass of one client, summed (the syncer exports these as metrics)."""

    passes: int = 0  # passes that reported (a store's errors included)
    passes_failed: int = 0  # background passes that raised before reporting
    last_pass_unix_s: float = 0.0  # when the last pass ended (0: none yet)
    last_pass_duration_s: float = 0.0
    blobs_copied: dict[str, int] = dataclasses.field(default_factory=dict)  # per store
    bytes_copied: dict[str, int] = dataclasses.field(default_factory=dict)
    manifests_restored: dict[str, int] = dataclasses.field(default_factory=dict)
    failures: dict[str, int] = dataclasses.field(default_factory=dict)  # passes that left a store with errors
    incomplete: dict[str, int] = dataclasses.field(default_factory=dict)  # passes that left a store behind

    def add(self, reports: Sequence[RepairReport], duration_s: float) -> None:
        self.passes += 1
        self.last_pass_unix_s = time.time()
        self.last_pass_duration_s = duration_s
        for r in reports:
            for counts, value in ((self.blobs_copied, r.blobs_copied), (self.bytes_copied, r.bytes_copied),
                                  (self.manifests_restored, len(r.manifests_restored)),
                                  (self.failures, int(bool(r.errors))), (self.incomplete, int(not r.complete))):
                counts[r.store] = counts.get(r.store, 0) + value


def default_write_quorum(num_stores: int) -> int:
    """2 when there are 2 or more stores (a checkpoint survives losing any one), else 1."""
    return 2 if num_stores >= 2 else 1


class ReplicatedCheckpointClient:
    """The `CheckpointClient` interface over `stores` ({name: client}, e.g. keyed by target).

    Args:
      write_quorum: stores that must acknowledge a blob or a manifest (default_write_quorum).
      call_timeout_s: bound of one small call on one store (stat, commit, manifests).
      blob_timeout_s: bound of one blob transfer on one store.
      down_backoff_s: a store that failed a call is skipped this long by writes and reads.
      quorum_wait_s: `latest_manifest`/`list_manifests` poll the stores this long for a read quorum.
      repair_max_bytes: bound of the blob bytes one background repair pass copies to one store.
      clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        stores: Mapping[str, StoreClient],
        *,
        write_quorum: int | None = None,
        call_timeout_s: float = 30.0,
        blob_timeout_s: float = 600.0,
        down_backoff_s: float = 5.0,
        quorum_wait_s: float = 30.0,
        repair_max_bytes: int = 1 << 30,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not stores:
            raise ValueError("ReplicatedCheckpointClient needs at least one store")
        self._stores = dict(stores)
        self.write_quorum = default_write_quorum(len(stores)) if write_quorum is None else write_quorum
        if not 1 <= self.write_quorum <= len(stores):
            raise ValueError(f"write_quorum={self.write_quorum} must be between 1 and the {len(stores)} stores")
        self.read_quorum = len(stores) - self.write_quorum + 1
        self._call_timeout_s = call_timeout_s
        self._blob_timeout_s = blob_timeout_s
        self._down_backoff_s = down_backoff_s
        self._quorum_wait_s = quorum_wait_s
        self._repair_max_bytes = repair_max_bytes
        self._clock = clock
        self._down_until: dict[str, float] = {}
        self._read_first = ""  # the store that served the committed manifest: reads try it first
        self._repair_task: asyncio.Task | None = None
        self._repair_now = asyncio.Event()
        self.last_repair: list[RepairReport] = []
        self.repair_totals = RepairTotals()

    @property
    def store_names(self) -> list[str]:
        return list(self._stores)

    # -- store health -------------------------------------------------------------------------

    def _is_down(self, name: str) -> bool:
        return self._down_until.get(name, 0.0) > self._clock()

    def _mark(self, name: str, ok: bool) -> None:
        if ok and name in self._down_until:
            # Back after an outage: it probably missed writes (or lost its disk); repair it soon.
            self._repair_now.set()
            self._down_until.pop(name)
        elif not ok:
            self._down_until[name] = self._clock() + self._down_backoff_s

    def _ordered(self) -> list[str]:
        """Stores believed up first, then the others (a read still tries every store); among those
        up, the one that served the committed manifest first."""
        return sorted(self._stores, key=lambda name: (self._is_down(name), name != self._read_first))

    async def _one(self, name: str, what: str, fn: Callable[[StoreClient], Awaitable[_T]],
                   timeout_s: float) -> _T:
        try:
            result = await asyncio.wait_for(fn(self._stores[name]), timeout_s)
        except Exception as exc:
            # Only an outage benches the store: a missing or corrupt blob is the repair's job.
            self._mark(name, not _is_outage(exc))
            _LOG.warning("checkpoint store %s: %s failed: %r", name, what, exc)
            raise
        self._mark(name, True)
        return result

    async def _fan_out(self, what: str, fn: Callable[[StoreClient], Awaitable[_T]], timeout_s: float,
                       *, skip_down: bool = True) -> tuple[dict[str, _T], dict[str, str]]:
        """Runs `fn` on every store (skipping those recently failed) at once: (results, errors)."""
        names = [n for n in self._stores if not (skip_down and self._is_down(n))]
        errors = {n: "skipped: failed a call within the last "
                  f"{self._down_backoff_s:.0f} s" for n in self._stores if n not in names}
        outcomes = await asyncio.gather(*(self._one(n, what, fn, timeout_s) for n in names),
                                        return_exceptions=True)
        results: dict[str, _T] = {}
        for name, outcome in zip(names, outcomes):
            if isinstance(outcome, BaseException):
                errors[name] = _describe(outcome)
            else:
                results[name] = outcome
        return results, errors

    def _require(self, what: str, acked: Mapping[str, Any], errors: Mapping[str, str], quorum: int) -> None:
        if len(acked) < quorum:
            detail = "; ".join(f"{n}: {e}" for n, e in errors.items())
            raise QuorumError(f"{what}: {len(acked)} of {len(self._stores)} checkpoint stores acknowledged, "
                              f"the quorum is {quorum} ({detail})")

    # -- the CheckpointClient interface ---------------------------------------------------------

    async def put_blob(self, data: bytes, *, timeout: datetime.timedelta | None = None) -> str:
        """Stores `data` on every reachable store; QuorumError if fewer than write_quorum took it."""
        timeout_s = timeout.total_seconds() if timeout else self._blob_timeout_s
        acked, errors = await self._fan_out("PutBlob", lambda c: c.put_blob(data), timeout_s)
        self._require("PutBlob", acked, errors, self.write_quorum)
        return next(iter(acked.values()))

    async def stat_blobs(self, digests: Iterable[str], *, timeout: datetime.timedelta | None = None) -> set[str]:
        """The digests held by at least write_quorum stores (those need no upload)."""
        wanted = list(digests)
        timeout_s = timeout.total_seconds() if timeout else self._call_timeout_s
        present, errors = await self._fan_out("StatBlobs", lambda c: c.stat_blobs(wanted), timeout_s)
        self._require("StatBlobs", present, errors, self.write_quorum)
        return {d for d in wanted if sum(d in held for held in present.values()) >= self.write_quorum}

    async def get_blob(self, digest: str, *, timeout: datetime.timedelta | None = None) -> bytes:
        """A verified copy from the first store that has one (missing or corrupt copies: the next)."""
        return await self._get_blob(digest, timeout.total_seconds() if timeout else self._blob_timeout_s)

    async def _get_blob(self, digest: str, timeout_s: float, *, exclude: str = "") -> bytes:
        failures = []
        for name in (n for n in self._ordered() if n != exclude):
            try:
                return await self._one(name, f"GetBlob {digest[:12]}", lambda c: c.get_blob(digest), timeout_s)
            except Exception as exc:
                failures.append(f"{name}: {_describe(exc)}")
        error = BlobUnavailable(f"blob {digest}: no store served a verified copy ({'; '.join(failures)})")
        error.not_found = bool(failures) and all(": NOT_FOUND: " in f for f in failures)  # every store lacks it
        raise error

    async def commit_manifest(self, run_id: str, step: int, blobs: Blobs, metadata: Mapping[str, str] | None = None,
                              *, timeout: datetime.timedelta | None = None, pointer: CommitPointer | None = None,
                              epoch: int = 0) -> int:
        """Commits the manifest on every reachable store (QuorumError below write_quorum), then,
        with a `pointer`, moves it to (run_id, step, epoch) (CommitFenced if a newer leader
        holds it). Stores that refused the commit are queued for repair."""
        refs = blobs if isinstance(blobs, Mapping) else list(blobs)
        timeout_s = timeout.total_seconds() if timeout else self._call_timeout_s
        acked, errors = await self._fan_out(
            "CommitManifest", lambda c: c.commit_manifest(run_id, step, refs, metadata), timeout_s)
        if any(not self._is_down(n) for n in errors):
            # A store answered but refused (e.g. a blob it missed): repair it now. A store that is
            # down is repaired once it answers again (see _mark).
            self._repair_now.set()
        self._require(f"CommitManifest {run_id}@{step}", acked, errors, self.write_quorum)
        if pointer is not None:
            await asyncio.wait_for(pointer.commit(CommitRecord(run_id=run_id, step=step, epoch=epoch)),
                                   self._call_timeout_s)
        return step

    async def _read_quorum(self, what: str, fn: Callable[[StoreClient], Awaitable[_T]]) -> dict[str, _T]:
        """Answers of at least read_quorum stores, polling the others for up to quorum_wait_s.

        Returns as soon as read_quorum stores have answered: a store whose host vanished with its
        region (no answer at all, not even a refusal) held a new leader's restore for a whole call
        timeout (10 s in the compose failover test) while a quorum had answered. The first store
        to answer is read first afterwards (its blobs)."""
        deadline = self._clock() + self._quorum_wait_s
        answers: dict[str, _T] = {}
        while True:
            missing = [n for n in self._stores if n not in answers]
            tasks = {asyncio.ensure_future(self._one(n, what, fn, self._call_timeout_s)): n for n in missing}
            pending, errors = set(tasks), {}
            try:
                while pending and len(answers) < self.read_quorum:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        if task.exception() is not None:
                            errors[tasks[task]] = _describe(task.exception())
                            continue
                        if not answers:
                            self._read_first = tasks[task]
                        answers[tasks[task]] = task.result()
            finally:
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
            if len(answers) >= self.read_quorum or self._clock() >= deadline:
                self._require(what, answers, errors, self.read_quorum)
                return answers
            await asyncio.sleep(min(1.0, max(0.0, deadline - self._clock())))

    async def latest_manifest(
        self, run_id: str, *, timeout: datetime.timedelta | None = None, pointer: CommitPointer | None = None
    ) -> Manifest | None:
        """The latest committed checkpoint of `run_id` (see the module docstring), or None.

        Raises QuorumError when too few stores answer, or (with a pointer) when no store holds
        the committed manifest.
        """
        if pointer is None:
            answers = await self._read_quorum(f"GetLatestManifest {run_id}", lambda c: c.latest_manifest(run_id))
            found = [m for m in answers.values() if m is not None]
            return max(found, key=lambda m: m.step) if found else None
        record = await asyncio.wait_for(pointer.latest(run_id), self._call_timeout_s)
        if record is None:
            return None
        timeout_s = timeout.total_seconds() if timeout else self._call_timeout_s
        # Every store at once; the first that holds the committed step wins, and later reads go to
        # it first. Asked one after the other, a store whose host vanished with its region (no
        # answer at all, not even a refusal) held a new leader's restore for a whole call timeout
        # (10 s in the compose failover test) while its peer had the manifest.
        tasks = {asyncio.ensure_future(self._one(name, f"ListManifests {run_id}",
                                                 lambda c: c.list_manifests(run_id), timeout_s)): name
                 for name in self._ordered()}
        pending, failures = set(tasks), []
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    name = tasks[task]
                    if task.exception() is not None:
                        failures.append(f"{name}: {_describe(task.exception())}")
                        continue
                    for manifest in task.result():
                        if manifest.step == record.step:
                            self._read_first = name
                            return manifest
                    failures.append(f"{name}: does not hold step {record.step}")
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        raise QuorumError(f"run {run_id}: the commit pointer names step {record.step} (epoch {record.epoch}) "
                          f"but no store holds its manifest ({'; '.join(failures)})")

    async def list_manifests(self, run_id: str, *, timeout: datetime.timedelta | None = None) -> list[Manifest]:
        """The retained checkpoints of `run_id` over a read quorum of stores, oldest first."""
        answers = await self._read_quorum(f"ListManifests {run_id}", lambda c: c.list_manifests(run_id))
        return _union(answers.values())

    # -- the merge ledger -----------------------------------------------------------------------

    async def append_ledger(self, run_id: str, lines: Sequence[str], *,
                            timeout: datetime.timedelta | None = None) -> tuple[int, str]:
        """Appends ledger lines on every reachable store (QuorumError below write_quorum). A store
        whose chain is behind (it missed appends while down) is first given the records it lacks,
        and the blobs they name, read from a store that took these lines. Returns (length, head)
        of an acknowledging store."""
        timeout_s = timeout.total_seconds() if timeout else self._call_timeout_s
        acked, errors = await self._fan_out("AppendLedger", lambda c: c.append_ledger(run_id, lines), timeout_s)
        behind = [n for n, e in errors.items() if e.startswith("FAILED_PRECONDITION")]
        if acked and behind:
            source = self._stores[next(iter(acked))]

            async def catch_up(store: StoreClient) -> tuple[int, str]:
                length, _ = await store.ledger_head(run_id)
                missed = await source.read_ledger(run_id, length)
                # The blobs those records name (retained contributions) first: the store checks them.
                digests = sorted({d for line in missed for d in json.loads(line).get("blobs") or ()})
                held = await store.stat_blobs(digests) if digests else set()
                for digest in (d for d in digests if d not in held):
                    await store.put_blob(await source.get_blob(digest))
                return await store.append_ledger(run_id, missed)

            for name in behind:
                try:
                    acked[name] = await self._one(name, "AppendLedger (catch-up)", catch_up, timeout_s)
                    errors.pop(name)
                except Exception as exc:
                    errors[name] = _describe(exc)
        self._require(f"AppendLedger {run_id}", acked, errors, self.write_quorum)
        return max(acked.values())

    async def ledger_head(self, run_id: str, *, timeout: datetime.timedelta | None = None) -> tuple[int, str]:
        """The longest (length, head) over a read quorum of stores (an acknowledged append is on one)."""
        answers = await self._read_quorum(f"GetLedgerHead {run_id}", lambda c: c.ledger_head(run_id))
        return max(answers.values())

    async def read_ledger(self, run_id: str, from_index: int = 0, *,
                          timeout: datetime.timedelta | None = None) -> list[str]:
        """The ledger from the store holding the longest one (over a read quorum)."""
        answers = await self._read_quorum(f"GetLedgerHead {run_id}", lambda c: c.ledger_head(run_id))
        longest = max(answers, key=lambda n: answers[n])
        timeout_s = timeout.total_seconds() if timeout else self._blob_timeout_s
        return await self._one(longest, f"ReadLedger {run_id}", lambda c: c.read_ledger(run_id, from_index),
                               timeout_s)

    # -- repair ---------------------------------------------------------------------------------

    async def repair(self, run_ids: Iterable[str], *, max_bytes: int | None = None) -> list[RepairReport]:
        """One pass: brings every store up to date with its peers' retained manifests of `run_ids`.

        Copies at most `max_bytes` of blobs per store (unbounded: None); a store that does not
        answer is reported, not fatal. Probes every store, so a store back up is used again.
        """
        runs = list(run_ids)
        started_s = self._clock()
        held: dict[str, dict[str, list[Manifest]]] = {run: {} for run in runs}
        unreachable: dict[str, str] = {}
        for run in runs:
            answers, errors = await self._fan_out(f"ListManifests {run}", lambda c, r=run: c.list_manifests(r),
                                                  self._call_timeout_s, skip_down=False)
            held[run] = answers
            unreachable.update(errors)
        reports = []
        for name in self._stores:
            report = RepairReport(store=name)
            if name in unreachable:
                report.errors.append(f"unreachable ({unreachable[name]})")
                report.complete = False
            else:
                await self._repair_store(name, runs, held, report, max_bytes)
            reports.append(report)
        self.last_repair = reports
        self.repair_totals.add(reports, self._clock() - started_s)
        return reports

    async def _repair_store(self, name: str, runs: Sequence[str], held: Mapping[str, Mapping[str, list[Manifest]]],
                            report: RepairReport, max_bytes: int | None) -> None:
        wanted: list[Manifest] = []  # newest first: the latest checkpoint matters most
        for run in runs:
            peers = [ms for peer, ms in held[run].items() if peer != name]
            keep = max((len(ms) for ms in held[run].values()), default=0)  # ~ the retention window
            wanted += sorted(_union(peers), key=lambda m: m.step, reverse=True)[:keep]
        if not wanted:
            return
        try:
            digests = {ref.digest: ref.size_bytes for m in wanted for ref in m.blobs}
            present = await self._one(name, "StatBlobs", lambda c: c.stat_blobs(list(digests)), self._call_timeout_s)
            for digest in [d for d in digests if d not in present]:
                if max_bytes is not None and report.bytes_copied + digests[digest] > max_bytes and report.blobs_copied:
                    report.complete = False
                    return
                data = await self._get_blob(digest, self._blob_timeout_s, exclude=name)
                await self._one(name, "PutBlob", lambda c, d=data: c.put_blob(d), self._blob_timeout_s)
                report.blobs_copied += 1
                report.bytes_copied += len(data)
            for manifest in wanted:
                if any(m.step == manifest.step for m in held[manifest.run_id].get(name, [])):
                    continue
                restored, _ = await self._one(name, "RestoreManifest", lambda c, m=manifest: c.restore_manifest(m),
                                              self._call_timeout_s)
                if restored:
                    report.manifests_restored.append((manifest.run_id, manifest.step))
        except Exception as exc:  # the next pass tries again
            report.errors.append(_describe(exc))
            report.complete = False

    def start_repair(self, run_ids: Iterable[str], *, interval_s: float = 30.0) -> None:
        """Repairs in the background: every `interval_s`, and soon after a commit some store missed.

        Each pass copies at most `repair_max_bytes` per store. Call `close()` to stop.
        """
        runs = list(run_ids)
        if len(self._stores) < 2 or self._repair_task is not None:
            return

        async def loop() -> None:
            while True:
                try:
                    await asyncio.wait_for(self._repair_now.wait(), interval_s)
                except asyncio.TimeoutError:
                    pass
                self._repair_now.clear()
                try:
                    for report in await self.repair(runs, max_bytes=self._repair_max_bytes):
                        if report.blobs_copied or report.manifests_restored or report.errors:
                            _LOG.info("checkpoint repair: %s", report.summary())
                except Exception as exc:  # never let one failed pass end the loop
                    self.repair_totals.passes_failed += 1
                    _LOG.warning("checkpoint repair pass failed: %r", exc)

        self._repair_task = asyncio.get_running_loop().create_task(loop(), name="checkpoint-repair")

    async def close(self) -> None:
        """Stops background repair (the stores' channels belong to the caller)."""
        if self._repair_task is not None:
            self._repair_task.cancel()
            await asyncio.gather(self._repair_task, return_exceptions=True)
            self._repair_task = None


def _union(lists: Iterable[Sequence[Manifest]]) -> list[Manifest]:
    """One manifest per (run, step) over several stores' lists (the first seen wins), oldest first."""
    by_step: dict[tuple[str, int], Manifest] = {}
    for manifests in lists:
        for m in manifests:
            by_step.setdefault((m.run_id, m.step), m)
    return [by_step[k] for k in sorted(by_step, key=lambda k: k[1])]


def _is_outage(exc: BaseException) -> bool:
    if isinstance(exc, (asyncio.TimeoutError, retry_lib.RetriesExhausted, ConnectionError)):
        return True
    return isinstance(exc, grpc.RpcError) and exc.code() in (
        grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    code = getattr(exc, "code", None)
    if callable(code):
        try:
            return f"{code().name}: {exc.details()}"  # grpc.aio.AioRpcError
        except Exception:
            pass
    return f"{type(exc).__name__}: {exc}"
