"""Blob streams of the checkpoint store: `BlobWriter` (an upload into a temp file, verified, then
renamed into place) and `BlobReader` (a blob verified on open and again while streaming), plus the
small durable-filesystem helpers they share with `store.BlobStore`.

Split from store.py to keep each module to one concern; must not import grpc either.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import pathlib
import secrets
import threading
from collections.abc import Iterator
from typing import Protocol

from ddiloco.rpc import errors

DEFAULT_CHUNK_BYTES = 512 * 1024
_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class _Store(Protocol):
    """What a `BlobWriter` needs from its store (a `store.BlobStore`)."""

    def _failpoint(self, name: str) -> None: ...

    def _touch(self, path: pathlib.Path) -> bool: ...

    def _rename_into_place(self, tmp: pathlib.Path, target: pathlib.Path) -> None: ...


def tmp_path(target: pathlib.Path) -> pathlib.Path:
    return target.with_name(f"{target.name}.tmp-{secrets.token_hex(8)}")


def fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_dir(path: pathlib.Path) -> None:
    """Creates `path` (one level) durably: the new entry is fsynced into its parent."""
    if path.is_dir():
        return
    with contextlib.suppress(FileExistsError):  # a concurrent writer created it first
        path.mkdir()
        fsync_dir(path.parent)


def unlink_quietly(path: pathlib.Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


@contextlib.contextmanager
def disk_full_as_resource_exhausted(what: str) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        if exc.errno in _DISK_FULL_ERRNOS:
            raise errors.ResourceExhausted(f"{what}: no space left on the store's disk") from exc
        raise


# ---------------------------------------------------------------------------------------------
# Blob streams.


class BlobWriter(contextlib.AbstractContextManager["BlobWriter"]):  # __enter__ returns self
    """One blob being uploaded: stream `write()`s, then `commit()` or `abort()`.

    The bytes go to a temp file and become visible only in `commit()`, after their size and
    sha256 match the header. Any failure (or `abort()`, or leaving the `with` block without
    committing) removes the temp file. If the store already holds the digest at commit time,
    the verified temp copy is discarded and the stored blob is touched instead (a no-op for
    readers). Re-uploads still write a temp copy: rare (clients stat first), and it means a
    blob garbage-collected during the upload is simply stored again.

    NOTE: methods take a lock, so the servicer may call `abort()` from a cleanup path while a
    `write()` is still running in a worker thread.
    """

    def __init__(self, store: _Store, digest: str, size_bytes: int, target: pathlib.Path):
        self.digest = digest
        self.size_bytes = size_bytes
        self.written_bytes = 0
        self._store = store
        self._target = target
        self._tmp = tmp_path(target)
        self._hash = hashlib.sha256()
        self._lock = threading.Lock()
        self._done = False
        self._file = None
        with self._failing_aborts("creating a temp file"):
            ensure_dir(target.parent)
            self._file = open(self._tmp, "xb")

    def __exit__(self, *exc_info: object) -> None:
        self.abort()

    def write(self, data: bytes) -> None:
        """Appends `data`. Raises InvalidArgument past the declared size (and aborts)."""
        with self._lock:
            self._check_open()
            if self.written_bytes + len(data) > self.size_bytes:
                self._abort_locked()
                raise errors.InvalidArgument(
                    f"blob {self.digest}: more than the declared {self.size_bytes} bytes arrived"
                )
            self._hash.update(data)
            self.written_bytes += len(data)
            with self._failing_aborts("writing"):
                self._store._failpoint("store.write")
                self._file.write(data)

    def commit(self) -> bool:
        """Verifies size and sha256, then makes the blob visible atomically.

        Returns:
          True if the store already held the blob (the upload changed nothing).

        Raises:
          InvalidArgument: size or digest mismatch (the temp file is removed).
          ResourceExhausted: the disk filled up (the temp file is removed).
        """
        with self._lock:
            self._check_open()
            if self.written_bytes != self.size_bytes:
                self._abort_locked()
                raise errors.InvalidArgument(
                    f"blob {self.digest}: got {self.written_bytes} bytes, header declared "
                    f"{self.size_bytes}"
                )
            actual = self._hash.hexdigest()
            if actual != self.digest:
                self._abort_locked()
                raise errors.InvalidArgument(
                    f"blob {self.digest}: the data hashes to {actual}; nothing was stored"
                )
            if self._store._touch(self._target):
                self._abort_locked()
                return True
            with self._failing_aborts("committing"):
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
                self._store._rename_into_place(self._tmp, self._target)
            self._done = True
            return False

    def abort(self) -> None:
        """Discards the upload and its temp file; a no-op after commit or a previous abort."""
        with self._lock:
            self._abort_locked()

    def _check_open(self) -> None:
        if self._done:
            raise errors.FailedPrecondition(f"blob {self.digest}: upload already finished")

    def _abort_locked(self) -> None:
        if self._done:
            return
        self._done = True
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
        unlink_quietly(self._tmp)

    @contextlib.contextmanager
    def _failing_aborts(self, what: str) -> Iterator[None]:
        try:
            with disk_full_as_resource_exhausted(f"blob {self.digest}: {what}"):
                yield
        except BaseException:
            self._abort_locked()
            raise


class BlobReader(contextlib.AbstractContextManager["BlobReader"]):  # __enter__ returns self
    """An open blob whose full content was verified against its digest on open.

    `read()` streams the same open file again and re-hashes it; if the bytes changed after the
    first pass, the final `read()` raises DataLoss instead of signalling a clean end. So a
    caller never sees a complete blob that does not match its digest, while memory stays at one
    chunk (the cost is reading the blob twice; the second pass is usually page cache).

    NOTE: methods take a lock, so `close()` may run while a `read()` is in a worker thread.
    """

    def __init__(self, path: pathlib.Path, digest: str):
        self.digest = digest
        self._lock = threading.Lock()
        try:
            self._file = open(path, "rb")
        except FileNotFoundError:
            raise errors.NotFound(f"blob {digest} not found") from None
        try:
            first_pass = hashlib.sha256()
            while chunk := self._file.read(DEFAULT_CHUNK_BYTES):
                first_pass.update(chunk)
            if first_pass.hexdigest() != digest:
                raise errors.DataLoss(
                    f"blob {digest}: stored bytes hash to {first_pass.hexdigest()}"
                )
            self.size_bytes = self._file.tell()
            self._file.seek(0)
        except BaseException:
            self._file.close()
            raise
        self._hash = hashlib.sha256()
        self._read_bytes = 0

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def read(self, max_bytes: int) -> bytes:
        """The next chunk, or b"" at a verified end. Raises DataLoss if the bytes changed."""
        with self._lock:
            chunk = self._file.read(max_bytes)
            self._hash.update(chunk)
            self._read_bytes += len(chunk)
            if not chunk and (
                self._hash.hexdigest() != self.digest or self._read_bytes != self.size_bytes
            ):
                raise errors.DataLoss(f"blob {self.digest}: stored bytes changed while reading")
            return chunk

    def close(self) -> None:
        with self._lock:
            self._file.close()
