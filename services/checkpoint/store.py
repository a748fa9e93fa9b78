"""The checkpoint store's core: content-addressed blobs and per-run manifests on a local disk.

Owns the on-disk layout, atomic writes, verification, retention and blob garbage collection.
Must not import grpc: it raises `ddiloco.rpc.errors` domain errors, which the servicer maps to
status codes.

Layout under `root`:

    blobs/<first 2 hex>/<sha256 hex>          immutable blob bytes
    manifests/<run_id>/<step:020d>.json       one committed checkpoint of a run
    quarantine/<sha256 hex>.<unix s>          a blob that failed verification, kept for forensics
    superseded/<run_id>/<step:020d>.e<epoch>.json  a deposed leader's manifest, set aside (below)
    ledger/<run_id>.jsonl                     a run's merge ledger (ledger.py)

Leader epochs (syncer failover, docs/failover.md): a manifest may carry the epoch of the leader
that wrote it, as metadata `leader_epoch` (a decimal integer; absent means 0, as every manifest
written without election). A run's retained manifests always form one lineage: epochs never
decrease as steps grow. A manifest from an older epoch than the run's newest is refused (a deposed
leader); one from a newer epoch is accepted even at a step not after the latest, and the older
epochs' manifests at or after its step (which a deposed leader wrote but could not commit) are
moved to `superseded/`, still readable there. Without epochs nothing changes.

Every file is written as `<name>.tmp-<random>` in its target's directory, then flushed,
fsynced, renamed over the target with `os.replace`, and the directory is fsynced (without
that last step a crash can lose the rename). A checkpoint exists once its manifest is renamed
into place: the manifest is written last and is the commit marker. Temp files left by a crash
are removed when the store opens.

Failpoints (fault tests only, `ddiloco.failpoints`) make the process die (`crash`: `os._exit(137)`,
like SIGKILL) or fail as if the disk were full (`enospc`) at a named point of every atomic write:

    store.write                         before each write of data to a temp file
    store.after_tmp_write               temp file complete and fsynced
    store.before_rename                 just before os.replace
    store.after_rename_before_dirsync   renamed, directory not yet fsynced
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from ddiloco import failpoints as failpoints_lib
from ddiloco.rpc import errors
from .blob_io import (  # noqa: F401 (BlobReader, BlobWriter: re-exported)
    DEFAULT_CHUNK_BYTES,
    BlobReader,
    BlobWriter,
)
from .blob_io import disk_full_as_resource_exhausted as _disk_full_as_resource_exhausted
from .blob_io import ensure_dir as _ensure_dir
from .blob_io import fsync_dir as _fsync_dir
from .blob_io import tmp_path as _tmp_path
from .blob_io import unlink_quietly as _unlink_quietly

_LOG = logging.getLogger(__name__)

_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
# A run id becomes a directory name: no separators, no leading dot, bounded length.
_RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_MANIFEST_RE = re.compile(r"(\d{20})\.json")
_TMP_RE = re.compile(r".+\.tmp-[0-9a-f]+")
# Written into every manifest so a future layout change can be recognized.
_MANIFEST_FORMAT_VERSION = 1
# The metadata key holding the writing leader's epoch (see the module docstring).
EPOCH_METADATA_KEY = "leader_epoch"


# ---------------------------------------------------------------------------------------------
# Retention policies (after orbax's PreservationPolicy): pure functions of the committed steps.


class RetentionPolicy(Protocol):
    """Decides which committed checkpoints of a run to keep."""

    def should_preserve(self, steps: Sequence[int]) -> Sequence[bool]:
        """For `steps` sorted ascending, returns one keep/drop decision per step."""
        ...


@dataclasses.dataclass(frozen=True)
class LatestN:
    """Keeps the `n` most recent checkpoints of a run."""

    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"LatestN.n={self.n} would delete every checkpoint; use n >= 1")

    def should_preserve(self, steps: Sequence[int]) -> Sequence[bool]:
        first_kept = max(0, len(steps) - self.n)
        return [i >= first_kept for i in range(len(steps))]


# ---------------------------------------------------------------------------------------------
# Validation and small filesystem helpers.


def validate_digest(digest: str) -> str:
    """Returns `digest` if it is 64 lowercase hex characters; raises InvalidArgument otherwise.

    Every path built from a digest goes through here first.
    """
    if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
        raise errors.InvalidArgument(f"digest {digest!r} is not a lowercase hex sha256 (64 chars)")
    return digest


def validate_run_id(run_id: str) -> str:
    """Returns `run_id` if it is a safe directory name; raises InvalidArgument otherwise."""
    if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id):
        raise errors.InvalidArgument(
            f"run_id {run_id!r} must be 1-128 characters of [A-Za-z0-9._-] starting with a "
            "letter or digit"
        )
    return run_id



def manifest_epoch(manifest: Mapping[str, Any]) -> int:
    """The leader epoch a manifest record carries (0 when it has none: written without election)."""
    return int((manifest.get("metadata") or {}).get(EPOCH_METADATA_KEY, "0"))

# ---------------------------------------------------------------------------------------------
# The store.


class BlobStore:
    """Content-addressed blobs plus manifests that commit a set of blobs as one checkpoint.

    Thread-safe: the servicer calls it from worker threads. Commits, retention, garbage
    collection and the GC-protecting touches of `stat`/re-uploads are serialized by one lock.

    Args:
      root: the directory holding `blobs/` and `manifests/` (created if missing).
      retention: which manifests of a run to keep after each commit.
      max_blob_bytes: larger uploads fail with ResourceExhausted.
      gc_grace_s: unreferenced blobs younger than this survive GC. Blobs of a checkpoint being
        uploaded are referenced by no manifest until it commits; the grace period protects them.
      failpoints: a `ddiloco.failpoints` spec of `store.*` points (see the module docstring);
        tests only. ValueError names a bad one.
      clock: returns the current unix time in seconds; injectable for tests.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        retention: RetentionPolicy = LatestN(5),
        max_blob_bytes: int = 2 * 1024**3,
        gc_grace_s: float = 3600.0,
        failpoints: str = "",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = pathlib.Path(root)
        self._blobs = self.root / "blobs"
        self._manifests = self.root / "manifests"
        self._retention = retention
        self._max_blob_bytes = max_blob_bytes
        self._gc_grace_s = gc_grace_s
        self._failpoints = failpoints_lib.Failpoints(failpoints, prefix="store.")
        self._clock = clock
        self._lock = threading.Lock()
        # More blobs garbage collection keeps (the merge ledgers' retained contributions, ledger.py).
        self.extra_references: Callable[[], set[str]] | None = None
        self.root.mkdir(parents=True, exist_ok=True)
        _ensure_dir(self._blobs)
        _ensure_dir(self._manifests)
        self.removed_tmp_files = self._remove_tmp_files()

    # -- blobs --------------------------------------------------------------------------------

    def begin_blob(self, digest: str, size_bytes: int) -> BlobWriter:
        """Starts an upload of `size_bytes` bytes that must hash to `digest`.

        Raises:
          InvalidArgument: malformed digest or negative size.
          ResourceExhausted: the blob is larger than `max_blob_bytes`, or the disk is full.
        """
        validate_digest(digest)
        if size_bytes < 0:
            raise errors.InvalidArgument(f"blob {digest}: negative size {size_bytes}")
        if size_bytes > self._max_blob_bytes:
            raise errors.ResourceExhausted(
                f"blob {digest}: {size_bytes} bytes exceeds the store's limit of "
                f"{self._max_blob_bytes} bytes"
            )
        return BlobWriter(self, digest, size_bytes, self._blob_path(digest))

    def put_blob(self, data: bytes) -> tuple[str, bool]:
        """Stores `data` in one go. Returns (digest, already_existed)."""
        digest = hashlib.sha256(data).hexdigest()
        with self.begin_blob(digest, len(data)) as writer:
            writer.write(data)
            return digest, writer.commit()

    def open_blob(self, digest: str) -> BlobReader:
        """Opens a blob after verifying all of its bytes (NotFound, DataLoss).

        A blob whose bytes no longer match its digest is moved to `quarantine/` before DataLoss
        is raised: the store then reports it absent (StatBlobs), so a replica's repair or the
        next upload stores the right bytes again instead of being told it already exists.
        """
        path = self._blob_path(validate_digest(digest))
        try:
            return BlobReader(path, digest)
        except errors.DataLoss:
            self._quarantine(path)
            raise

    def _quarantine(self, path: pathlib.Path) -> None:
        quarantine = self.root / "quarantine"
        with self._lock, contextlib.suppress(FileNotFoundError):
            _ensure_dir(quarantine)
            os.replace(path, quarantine / f"{path.name}.{int(self._clock())}")
            _fsync_dir(path.parent)
            _LOG.error("blob %s failed verification; moved to %s", path.name, quarantine)

    def read_blob(self, digest: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
        """Yields the blob in chunks; nothing is yielded unless the whole blob verified first.

        Raises (on the first `next()`): NotFound, DataLoss; DataLoss at the end if the bytes
        changed while being read.
        """
        with self.open_blob(digest) as reader:
            while chunk := reader.read(chunk_bytes):
                yield chunk

    def stat(self, digests: Iterable[str]) -> set[str]:
        """The subset of `digests` the store holds.

        Each present blob counts as fresh for the GC grace period, so a client that skips
        uploading it can still reference it in a manifest.
        """
        wanted = [validate_digest(d) for d in digests]
        with self._lock:
            return {d for d in wanted if self._touch_locked(self._blob_path(d))}

    # -- manifests ----------------------------------------------------------------------------

    def commit_manifest(self, manifest: Mapping[str, Any]) -> tuple[int, int]:
        """Commits one checkpoint: `{"run_id", "step", "blobs": [{"name", "digest",
        "size_bytes"}], "metadata": {str: str}, "created_unix_s" (optional)}`.

        Re-committing a run's latest step with the same blobs and metadata is a no-op success,
        so a client may retry a commit whose response it never received.

        Returns:
          (step, number of this run's manifests pruned by the retention policy).

        Raises:
          InvalidArgument: malformed run id, digest, duplicate blob name or wrong blob size.
          FailedPrecondition: a referenced blob is missing, the leader epoch is older than the
            run's newest, or (same epoch) step <= the latest step.
          ResourceExhausted: the disk is full (the previous checkpoints are untouched).
        """
        record = self._normalize_manifest(manifest)
        run_id, step = record["run_id"], record["step"]
        with self._lock:
            self._check_blobs_locked(record, "upload it before committing")
            steps = self._steps(run_id)
            newest_epoch = self._epoch_at_locked(run_id, steps[-1]) if steps else 0
            if manifest_epoch(record) < newest_epoch:
                raise errors.FailedPrecondition(
                    f"run {run_id}: step {step} comes from leader epoch {manifest_epoch(record)}, "
                    f"older than epoch {newest_epoch} of the run's latest manifests (a deposed leader)"
                )
            if manifest_epoch(record) > newest_epoch:  # a new leader's lineage wins
                steps = self._supersede_locked(run_id, steps, step)
            if steps and step <= steps[-1]:
                if step == steps[-1] and self._same_content(self._load(run_id, step), record):
                    return step, 0
                raise errors.FailedPrecondition(
                    f"run {run_id}: step {step} is not after the latest committed step "
                    f"{steps[-1]}"
                )
            run_dir = self._manifests / run_id
            _ensure_dir(run_dir)
            data = json.dumps({"format_version": _MANIFEST_FORMAT_VERSION, **record}, indent=1)
            self._write_atomic(self._manifest_path(run_id, step), data.encode())
            pruned = self._apply_retention(run_id, [*steps, step])
            self._collect_garbage()
        _LOG.info("committed run=%s step=%d pruned=%d", run_id, step, pruned)
        return step, pruned

    def restore_manifest(self, manifest: Mapping[str, Any]) -> tuple[bool, bool]:
        """Stores a manifest copied from a peer replica verbatim, at its own step (repair).

        Unlike `commit_manifest`, the step may be older than the run's latest: a replica that
        was down missed commits its peers hold, and later commits may already have reached it.
        Leader epochs keep one lineage: a manifest a newer epoch superseded is not restored
        (returns (False, False)); one from a newer epoch supersedes this store's older ones.

        Returns:
          (restored: False if this manifest was already held, retained: False if the retention
          policy dropped it at once because it is older than every retained step).

        Raises:
          InvalidArgument: malformed manifest (as `commit_manifest`).
          FailedPrecondition: a referenced blob is missing (copy the blobs first).
          AlreadyExists: a different manifest is held at that step.
          ResourceExhausted: the disk is full.
        """
        record = self._normalize_manifest(manifest)
        run_id, step, epoch = record["run_id"], record["step"], manifest_epoch(record)
        with self._lock:
            self._check_blobs_locked(record, "copy the blobs before the manifest")
            steps = self._steps(run_id)
            below = [s for s in steps if s <= step]
            above = [s for s in steps if s >= step]
            if below and self._epoch_at_locked(run_id, below[-1]) > epoch:
                # A newer leader's lineage forked at or before this step: a deposed leader's
                # manifest, which a peer still holds. Dropped, as retention would drop it.
                _LOG.warning("not restoring run=%s step=%d: epoch %d is superseded", run_id, step, epoch)
                return False, False
            if above and self._epoch_at_locked(run_id, above[0]) < epoch:
                steps = self._supersede_locked(run_id, steps, step)
            if step in steps:
                if self._same_content(self._load(run_id, step), record):
                    return False, True
                raise errors.AlreadyExists(
                    f"run {run_id}: a different manifest is already held at step {step}"
                )
            _ensure_dir(self._manifests / run_id)
            data = json.dumps({"format_version": _MANIFEST_FORMAT_VERSION, **record}, indent=1)
            self._write_atomic(self._manifest_path(run_id, step), data.encode())
            self._apply_retention(run_id, sorted([*steps, step]))
            retained = step in self._steps(run_id)
        _LOG.info("restored run=%s step=%d retained=%s", run_id, step, retained)
        return True, retained

    def latest_manifest(self, run_id: str) -> dict[str, Any] | None:
        """The latest committed manifest of `run_id`, or None."""
        steps = self._steps(validate_run_id(run_id))
        return self._load(run_id, steps[-1]) if steps else None

    def list_manifests(self, run_id: str) -> list[dict[str, Any]]:
        """The retained manifests of `run_id`, oldest first."""
        steps = self._steps(validate_run_id(run_id))
        return [self._load(run_id, step) for step in steps]

    # -- internals ----------------------------------------------------------------------------

    def _blob_path(self, digest: str) -> pathlib.Path:
        return self._blobs / digest[:2] / digest

    def _manifest_path(self, run_id: str, step: int) -> pathlib.Path:
        return self._manifests / run_id / f"{step:020d}.json"

    def _failpoint(self, name: str) -> None:
        self._failpoints.hit(name)

    def _rename_into_place(self, tmp: pathlib.Path, target: pathlib.Path) -> None:
        self._failpoint("store.after_tmp_write")
        self._failpoint("store.before_rename")
        os.replace(tmp, target)
        self._failpoint("store.after_rename_before_dirsync")
        _fsync_dir(target.parent)

    def _write_atomic(self, target: pathlib.Path, data: bytes) -> None:
        tmp = _tmp_path(target)
        try:
            with _disk_full_as_resource_exhausted(f"writing {target.name}"):
                with open(tmp, "xb") as f:
                    self._failpoint("store.write")
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                self._rename_into_place(tmp, target)
        except BaseException:
            _unlink_quietly(tmp)
            raise

    def _touch_locked(self, path: pathlib.Path) -> bool:
        try:
            os.utime(path)
            return True
        except FileNotFoundError:
            return False

    def _touch(self, path: pathlib.Path) -> bool:
        """Marks a blob fresh for GC; False if it does not exist."""
        with self._lock:
            return self._touch_locked(path)

    def _remove_tmp_files(self) -> int:
        removed = 0
        for dirpath, _, filenames in os.walk(self.root):
            for name in filenames:
                if _TMP_RE.fullmatch(name):
                    _unlink_quietly(pathlib.Path(dirpath, name))
                    removed += 1
        if removed:
            _LOG.warning("removed %d temp files left by an interrupted write", removed)
        return removed

    def _normalize_manifest(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        run_id = validate_run_id(manifest.get("run_id", ""))
        step = manifest.get("step")
        if not isinstance(step, int) or not 0 <= step < 10**20:
            raise errors.InvalidArgument(f"run {run_id}: step {step!r} is not an integer >= 0")
        blobs = []
        for ref in manifest.get("blobs", ()):
            size = ref.get("size_bytes")
            if not isinstance(size, int) or size < 0:
                raise errors.InvalidArgument(f"run {run_id}: blob size {size!r} is invalid")
            blobs.append(
                {"name": str(ref.get("name", "")), "digest": validate_digest(ref.get("digest")),
                 "size_bytes": size}
            )
        names = [b["name"] for b in blobs]
        if len(set(names)) != len(names):
            raise errors.InvalidArgument(f"run {run_id} step {step}: duplicate blob names")
        metadata = dict(manifest.get("metadata") or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise errors.InvalidArgument(f"run {run_id} step {step}: metadata must map str to str")
        if not re.fullmatch(r"\d{1,19}", metadata.get(EPOCH_METADATA_KEY, "0")):
            raise errors.InvalidArgument(
                f"run {run_id} step {step}: metadata {EPOCH_METADATA_KEY} "
                f"{metadata[EPOCH_METADATA_KEY]!r} is not a non-negative integer"
            )
        created = float(manifest.get("created_unix_s") or 0.0) or self._clock()
        return {"run_id": run_id, "step": step, "created_unix_s": created, "blobs": blobs,
                "metadata": metadata}

    def _check_blobs_locked(self, record: Mapping[str, Any], hint: str) -> None:
        """Every blob of `record` is held at its declared size. NOTE: call with the lock held."""
        run_id, step = record["run_id"], record["step"]
        for ref in record["blobs"]:
            try:
                stored_bytes = self._blob_path(ref["digest"]).stat().st_size
            except FileNotFoundError:
                raise errors.FailedPrecondition(
                    f"run {run_id} step {step}: blob {ref['name']!r} ({ref['digest']}) is "
                    f"not in the store; {hint}"
                ) from None
            if stored_bytes != ref["size_bytes"]:
                raise errors.InvalidArgument(
                    f"run {run_id} step {step}: blob {ref['name']!r} is {stored_bytes} bytes, "
                    f"the manifest says {ref['size_bytes']}"
                )

    @staticmethod
    def _same_content(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
        return a["blobs"] == b["blobs"] and a["metadata"] == b["metadata"]

    def _epoch_at_locked(self, run_id: str, step: int) -> int:
        """The leader epoch of the run's manifest at `step`. Since a run's retained manifests form
        one lineage (epochs never decrease as steps grow), the manifests next to a step say all
        about the epochs before and after it. NOTE: call with the lock held."""
        return manifest_epoch(self._load(run_id, step))

    def _supersede_locked(self, run_id: str, steps: list[int], from_step: int) -> list[int]:
        """Moves the run's manifests at steps >= `from_step` (older epochs: a deposed leader's)
        to `superseded/`; returns the steps left. NOTE: call with the lock held."""
        moved = [s for s in steps if s >= from_step]
        if not moved:
            return steps
        aside = self.root / "superseded" / run_id
        aside.mkdir(parents=True, exist_ok=True)
        for step in moved:
            epoch = manifest_epoch(self._load(run_id, step))
            os.replace(self._manifest_path(run_id, step), aside / f"{step:020d}.e{epoch}.json")
        _fsync_dir(aside)
        _fsync_dir(self._manifests / run_id)
        _LOG.warning("run=%s: manifests at steps %s of an older leader epoch superseded", run_id, moved)
        return [s for s in steps if s < from_step]

    def _steps(self, run_id: str) -> list[int]:
        try:
            names = os.listdir(self._manifests / run_id)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for m in map(_MANIFEST_RE.fullmatch, names) if m)

    def _load(self, run_id: str, step: int) -> dict[str, Any]:
        path = self._manifest_path(run_id, step)
        try:
            record = json.loads(path.read_bytes())
        except FileNotFoundError:
            # Pruned between listing and reading.
            raise errors.NotFound(f"run {run_id}: manifest for step {step} is gone") from None
        except ValueError as exc:
            raise errors.DataLoss(f"run {run_id}: manifest {path.name} is unreadable: {exc}") from None
        version = record.pop("format_version", None) if isinstance(record, dict) else None
        if version != _MANIFEST_FORMAT_VERSION:
            raise errors.DataLoss(f"run {run_id}: manifest {path.name} has an unknown format")
        return record

    def _apply_retention(self, run_id: str, steps: list[int]) -> int:
        """Removes the manifests the policy drops. NOTE: call with the lock held."""
        dropped = [s for s, keep in zip(steps, self._retention.should_preserve(steps)) if not keep]
        for step in dropped:
            _unlink_quietly(self._manifest_path(run_id, step))
        if dropped:
            _fsync_dir(self._manifests / run_id)
        return len(dropped)

    def _collect_garbage(self) -> int:
        """Deletes blobs no retained manifest of any run references, once past the grace period.

        NOTE: call with the lock held. If any manifest is unreadable, nothing is deleted: the
        store cannot tell what that manifest references.
        """
        referenced: set[str] = set()
        try:
            for run_dir in self._manifests.iterdir():
                if run_dir.is_dir() and _RUN_ID_RE.fullmatch(run_dir.name):
                    for step in self._steps(run_dir.name):
                        manifest = self._load(run_dir.name, step)
                        referenced.update(b["digest"] for b in manifest["blobs"])
        except errors.ServiceError as exc:
            _LOG.error("blob GC skipped: %s", exc)
            return 0
        if self.extra_references is not None:
            referenced |= self.extra_references()
        cutoff_s = self._clock() - self._gc_grace_s
        removed = 0
        for path in self._blobs.glob("??/*"):
            if not _DIGEST_RE.fullmatch(path.name) or path.name in referenced:
                continue  # temp files and referenced blobs
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_mtime < cutoff_s:
                    path.unlink()
                    removed += 1
        if removed:
            _LOG.info("blob GC removed %d unreferenced blobs", removed)
        return removed
