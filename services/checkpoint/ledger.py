"""The checkpoint store's merge ledgers: one durable, append-only, hash-chained JSONL file per run.

Owns the ledger layout, the chain checks on append and the blobs ledgers keep alive. The syncer
appends one record per merge (format `ddiloco.ledger/1`, services/syncer/influence.py); `ddiloco
audit --store` reads them back. Must not import grpc (domain errors, as store.py) and must not
interpret a record beyond the fields named here.

Layout under the store's root:

    ledger/<run_id>.jsonl     one JSON record per line, in append order

A record's chain hash is the sha256 of its line (without the newline). Fields the store reads:
  prev    the chain hash of the line before (64 zeros for the first): must be the head
  epoch   the writing syncer's leader epoch (absent: 0); never older than the head's, so a deposed
          leader cannot extend the chain after a newer one did
  blobs   content digests of blobs the record references (retained contributions): they must be
          held already; garbage collection keeps those of the last `retain_merges` records of each
          (run, fragment) (0: of every record), so older ones are collected unless a checkpoint
          manifest or a kept record names them too. The records themselves stay (they are small);
          `ddiloco audit replay` reports a merge whose blobs were collected as not retained
  fragment  which fragment the record merged (groups records for the retention above)
A line identical to one of the last `_RECENT` lines is a retry whose response was lost: a no-op.
Each append is one write(2) of whole lines, then fsync; a torn last line (a crash mid-write) is
cut off when the ledger is opened, so the file always holds whole records.
"""

from __future__ import annotations

import array
import collections
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import threading
from collections.abc import Callable, Iterable

from ddiloco.rpc import errors
from . import blob_io
from . import store as store_lib

_LOG = logging.getLogger(__name__)

GENESIS = "0" * 64
_RECENT = 4096  # chain hashes remembered per run for idempotent retries (older ones cannot recur)
READ_PAGE_RECORDS = 512  # records per ReadLedger message
# Merges per (run, fragment) whose retained blobs garbage collection keeps: one fragment of disk
# per contribution, so without a bound the store grows with every merge of the run.
DEFAULT_RETAIN_MERGES = 64


def line_hash(line: bytes) -> str:
    return hashlib.sha256(line).hexdigest()


@dataclasses.dataclass
class _Run:
    path: pathlib.Path
    offsets: array.array  # byte offset of every line ("Q")
    size_bytes: int
    head: str = GENESIS
    epoch: int = 0
    recent: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)  # hash -> index
    retain_merges: int = 0  # 0: the blobs of every record are kept
    blobs: dict = dataclasses.field(default_factory=dict)  # fragment -> deque of its last records' blob tuples

    @property
    def length(self) -> int:
        return len(self.offsets)

    def note(self, line: bytes, record: dict, offset: int) -> None:
        digest = line_hash(line)
        self.recent[digest] = len(self.offsets)
        while len(self.recent) > _RECENT:
            self.recent.popitem(last=False)
        self.offsets.append(offset)
        self.head = digest
        self.epoch = max(self.epoch, _epoch(record))
        kept = self.blobs.get(_fragment(record))
        if kept is None:
            kept = self.blobs[_fragment(record)] = collections.deque(maxlen=self.retain_merges or None)
        kept.append(tuple(_blobs(record)))


def _epoch(record: dict) -> int:
    value = record.get("epoch", 0)
    return value if isinstance(value, int) and value >= 0 else 0


def _fragment(record: dict) -> int | str | None:
    value = record.get("fragment")
    return value if isinstance(value, (int, str)) else None


def _blobs(record: dict) -> list[str]:
    value = record.get("blobs") or []
    return [d for d in value if isinstance(d, str)] if isinstance(value, list) else []


def _parse(run_id: str, line: str) -> tuple[bytes, dict]:
    if "\n" in line or "\r" in line:
        raise errors.InvalidArgument(f"ledger {run_id}: a record must be one line")
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise errors.InvalidArgument(f"ledger {run_id}: record is not JSON ({exc.msg})") from None
    if not isinstance(record, dict) or not isinstance(record.get("prev"), str):
        raise errors.InvalidArgument(f"ledger {run_id}: a record must be a JSON object with a string `prev`")
    return line.encode(), record


class LedgerStore:
    """Every run's ledger under `root/ledger`; thread-safe. `held(digests)` says which blobs the
    store holds (BlobStore.stat: it also marks them fresh, so GC cannot race the append);
    `retain_merges` bounds the records per (run, fragment) whose blobs GC keeps (0: all)."""

    def __init__(self, root: str | os.PathLike, held: Callable[[Iterable[str]], set[str]], *,
                 retain_merges: int = DEFAULT_RETAIN_MERGES) -> None:
        if retain_merges < 0:
            raise ValueError(f"retain_merges={retain_merges}: use 0 (keep all) or more")
        self._retain_merges = retain_merges
        self._dir = pathlib.Path(root) / "ledger"
        self._dir.parent.mkdir(parents=True, exist_ok=True)
        blob_io.ensure_dir(self._dir)
        self._held = held
        self._lock = threading.Lock()
        self._runs: dict[str, _Run] = {}
        for path in sorted(self._dir.glob("*.jsonl")):  # GC must know every ledger's blobs from the start
            self._runs[path.stem] = self._open(path)

    def _open(self, path: pathlib.Path) -> _Run:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            data = b""
        end = data.rfind(b"\n") + 1
        if end < len(data):  # a torn last line: the append that wrote it was never acknowledged
            _LOG.warning("ledger %s: cutting off a torn last line (%d bytes)", path.name, len(data) - end)
            with open(path, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
        run = _Run(path=path, offsets=array.array("Q"), size_bytes=end, retain_merges=self._retain_merges)
        offset = 0
        for line in data[:end].split(b"\n")[:-1]:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # changed on disk: the chain check of `ddiloco audit` reports it
                record = {}
            run.note(line, record if isinstance(record, dict) else {}, offset)
            offset += len(line) + 1
        return run

    def _run(self, run_id: str) -> _Run:
        """NOTE: call with the lock held."""
        run = self._runs.get(store_lib.validate_run_id(run_id))
        if run is None:
            run = self._runs[run_id] = _Run(path=self._dir / f"{run_id}.jsonl", offsets=array.array("Q"),
                                            size_bytes=0, retain_merges=self._retain_merges)
        return run

    def append(self, run_id: str, lines: list[str]) -> tuple[int, str, int]:
        """Appends `lines` (see the module docstring). Returns (length, head, lines written).

        Raises:
          InvalidArgument: a line that is not a one-line JSON object with `prev`, a bad run id.
          FailedPrecondition: a `prev` that is not the head, an older epoch, a blob not held.
          ResourceExhausted: the disk is full (nothing of the batch is kept).
        """
        parsed = [_parse(run_id, line) for line in lines]
        wanted = {d for _, record in parsed for d in _blobs(record)}
        missing = wanted - self._held(wanted) if wanted else set()
        if missing:
            raise errors.FailedPrecondition(
                f"ledger {run_id}: record references blobs the store does not hold: {sorted(missing)[:3]}; "
                "upload them first")
        with self._lock:
            run = self._run(run_id)
            head, epoch, new = run.head, run.epoch, []
            for number, (line, record) in enumerate(parsed):
                digest = line_hash(line)
                if digest in run.recent or any(digest == line_hash(n) for n, _ in new):
                    continue  # a retry of a record already held
                if record["prev"] != head:
                    raise errors.FailedPrecondition(
                        f"ledger {run_id}: record {number} of the batch chains to {record['prev'][:12]}..., "
                        f"not to the head {head[:12]}... (length {run.length + len(new)}): resume from the head")
                if _epoch(record) < epoch:
                    raise errors.FailedPrecondition(
                        f"ledger {run_id}: record of leader epoch {_epoch(record)} after epoch {epoch} "
                        "(a deposed leader)")
                new.append((line, record))
                head, epoch = digest, max(epoch, _epoch(record))
            if new:
                self._write(run, new)
            return run.length, run.head, len(new)

    def _write(self, run: _Run, new: list[tuple[bytes, dict]]) -> None:
        """Appends whole lines in one write, fsynced. NOTE: call with the lock held."""
        data = b"".join(line + b"\n" for line, _ in new)
        created = not run.path.exists()
        try:
            with blob_io.disk_full_as_resource_exhausted(f"appending to ledger {run.path.name}"):
                fd = os.open(run.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                try:
                    written = os.write(fd, data)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                if written != len(data):
                    raise OSError(f"short write to {run.path.name}")
        except BaseException:
            # A partial write would leave a torn line: cut the file back to what is acknowledged.
            with contextlib.suppress(FileNotFoundError), open(run.path, "r+b") as f:
                f.truncate(run.size_bytes)
                os.fsync(f.fileno())
            raise
        if created:
            blob_io.fsync_dir(self._dir)
        offset = run.size_bytes
        for line, record in new:
            run.note(line, record, offset)
            offset += len(line) + 1
        run.size_bytes = offset

    def head(self, run_id: str) -> tuple[int, str]:
        """(length, head) of a run's ledger ((0, 64 zeros) when it has none)."""
        with self._lock:
            run = self._run(run_id)
            return run.length, run.head

    def read(self, run_id: str, from_index: int, max_records: int = READ_PAGE_RECORDS) -> list[tuple[int, str]]:
        """Up to `max_records` (index, line) from `from_index` on, oldest first."""
        with self._lock:
            run = self._run(run_id)
            if from_index >= run.length:
                return []
            stop = min(run.length, from_index + max_records)
            start_byte = run.offsets[from_index]
            end_byte = run.offsets[stop] if stop < run.length else run.size_bytes
            path = run.path
        with open(path, "rb") as f:  # appended bytes are never rewritten: safe outside the lock
            f.seek(start_byte)
            data = f.read(end_byte - start_byte)
        lines = data.split(b"\n")[:-1]
        if len(lines) != stop - from_index:
            raise errors.DataLoss(f"ledger {run_id}: {len(lines)} lines where {stop - from_index} were expected")
        return [(from_index + i, line.decode()) for i, line in enumerate(lines)]

    def referenced_blobs(self) -> set[str]:
        """The blobs the last `retain_merges` records of each (run, fragment) reference (garbage
        collection keeps them; it keeps what checkpoint manifests reference anyway)."""
        with self._lock:
            return {digest for run in self._runs.values() for kept in run.blobs.values()
                    for blobs in kept for digest in blobs}
