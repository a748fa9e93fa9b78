"""`CheckpointClient`: the typed grpc.aio client of the checkpoint store (used by the syncer).

Every call has a deadline and is retried on transient failures under an overall time bound.
All ten RPCs are idempotent, so DEADLINE_EXCEEDED is retried as well as UNAVAILABLE:
  * reads (GetBlob, StatBlobs, GetLatestManifest, ListManifests) change nothing;
  * PutBlob is content-addressed: storing the same bytes again is a no-op;
  * CommitManifest: the store accepts a re-commit of the run's latest step with the same blobs
    and metadata as a no-op, so a retry after a lost response succeeds instead of failing the
    step check;
  * RestoreManifest (repair of a replica): storing a manifest already held is a no-op;
  * AppendLedger: a line the ledger already holds is a no-op (ReadLedger, GetLedgerHead read).
Blobs are verified again on the client after download.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TypeVar

import grpc

from ddiloco.rpc import retry as retry_lib
from ddiloco.v1 import checkpoint_pb2, checkpoint_pb2_grpc

_T = TypeVar("_T")


class BlobVerificationError(Exception):
    """A downloaded blob does not match its digest (or its stream was malformed)."""


@dataclasses.dataclass(frozen=True)
class BlobRef:
    name: str
    digest: str
    size_bytes: int


# A checkpoint's blobs as ``commit_manifest`` takes them: {name: (digest, size_bytes)} or BlobRefs.
Blobs = Mapping[str, tuple[str, int]] | Iterable[BlobRef]


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A committed checkpoint: named blobs plus string metadata."""

    run_id: str
    step: int
    created_unix_s: float
    blobs: tuple[BlobRef, ...]
    metadata: Mapping[str, str]

    def blob(self, name: str) -> BlobRef:
        """The blob called `name` (KeyError if the manifest has none)."""
        for ref in self.blobs:
            if ref.name == name:
                return ref
        raise KeyError(f"manifest {self.run_id}/{self.step} has no blob {name!r}")


def _manifest_to_proto(m: Manifest) -> checkpoint_pb2.Manifest:
    return checkpoint_pb2.Manifest(
        run_id=m.run_id,
        step=m.step,
        created_unix_s=m.created_unix_s,
        blobs=[checkpoint_pb2.BlobRef(**dataclasses.asdict(r)) for r in m.blobs],
        metadata=dict(m.metadata),
    )


def _manifest_from_proto(m: checkpoint_pb2.Manifest) -> Manifest:
    return Manifest(
        run_id=m.run_id,
        step=m.step,
        created_unix_s=m.created_unix_s,
        blobs=tuple(BlobRef(b.name, b.digest, b.size_bytes) for b in m.blobs),
        metadata=dict(m.metadata),
    )


class CheckpointClient:
    """Wraps a `CheckpointStoreStub` with deadlines, retries and client-side verification.

    Args:
      channel: from `ddiloco.rpc.channel.aio_channel(target, security)`; the caller owns and
        closes it. Under mutual TLS it must carry the `syncer` identity to write (a `reader`
        identity may only read); see ddiloco.rpc.security.
      timeout: deadline of each small call (stat, commit, manifests).
      blob_timeout: deadline of each PutBlob/GetBlob stream (blobs can be hundreds of MiB).
      retry_timeout: overall bound on retrying one operation after transient failures.
      chunk_size_bytes: data per PutBlob message (below the 8 MiB gRPC message limit).
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        *,
        timeout: datetime.timedelta = datetime.timedelta(seconds=30),
        blob_timeout: datetime.timedelta = datetime.timedelta(minutes=10),
        retry_timeout: datetime.timedelta = datetime.timedelta(minutes=2),
        chunk_size_bytes: int = 512 * 1024,
    ) -> None:
        self._stub = checkpoint_pb2_grpc.CheckpointStoreStub(channel)
        self._timeout = timeout
        self._blob_timeout = blob_timeout
        self._retry_timeout = retry_timeout
        self._chunk_size_bytes = chunk_size_bytes

    async def _call(self, what: str, attempt_fn: Callable[[], Awaitable[_T]]) -> _T:
        async for attempt in retry_lib.async_retrying(
            what=f"CheckpointStore.{what}", timeout=self._retry_timeout, idempotent=True
        ):
            with attempt:
                return await attempt_fn()
        raise AssertionError("unreachable: async_retrying returns or raises")

    async def stat_blobs(
        self, digests: Iterable[str], *, timeout: datetime.timedelta | None = None
    ) -> set[str]:
        """The subset of `digests` the store holds."""
        request = checkpoint_pb2.StatBlobsRequest(digests=list(digests))
        seconds = (timeout or self._timeout).total_seconds()
        response = await self._call(
            "StatBlobs", lambda: self._stub.StatBlobs(request, timeout=seconds)
        )
        return set(response.present)

    async def put_blob(self, data: bytes, *, timeout: datetime.timedelta | None = None) -> str:
        """Stores `data` unless the store already holds it; returns its sha256 hex digest."""
        digest = hashlib.sha256(data).hexdigest()
        if digest in await self.stat_blobs([digest]):
            return digest
        chunk = self._chunk_size_bytes
        view = memoryview(data)

        async def requests() -> AsyncIterator[checkpoint_pb2.PutBlobRequest]:
            yield checkpoint_pb2.PutBlobRequest(
                header=checkpoint_pb2.BlobHeader(digest=digest, size_bytes=len(data))
            )
            for seq, offset in enumerate(range(0, len(data), chunk)):
                piece = bytes(view[offset : offset + chunk])
                yield checkpoint_pb2.PutBlobRequest(
                    chunk=checkpoint_pb2.BlobChunk(seq=seq, data=piece)
                )

        seconds = (timeout or self._blob_timeout).total_seconds()
        # A fresh request stream per attempt: a stream cannot be replayed.
        await self._call("PutBlob", lambda: self._stub.PutBlob(requests(), timeout=seconds))
        return digest

    async def get_blob(self, digest: str, *, timeout: datetime.timedelta | None = None) -> bytes:
        """Downloads a blob and checks its sha256 (BlobVerificationError on mismatch)."""
        seconds = (timeout or self._blob_timeout).total_seconds()

        async def attempt() -> bytes:
            call = self._stub.GetBlob(checkpoint_pb2.GetBlobRequest(digest=digest), timeout=seconds)
            header, parts = None, []
            async for response in call:
                if response.WhichOneof("kind") == "header" and header is None:
                    header = response.header
                elif header is not None and response.chunk.seq == len(parts):
                    parts.append(response.chunk.data)
                else:
                    raise BlobVerificationError(f"blob {digest}: malformed GetBlob stream")
            return self._verified(digest, header, b"".join(parts))

        return await self._call("GetBlob", attempt)

    @staticmethod
    def _verified(digest: str, header: checkpoint_pb2.BlobHeader | None, data: bytes) -> bytes:
        if header is None or header.digest != digest or header.size_bytes != len(data):
            raise BlobVerificationError(f"blob {digest}: header missing or size mismatch")
        actual = hashlib.sha256(data).hexdigest()
        if actual != digest:
            raise BlobVerificationError(f"blob {digest}: downloaded bytes hash to {actual}")
        return data

    async def commit_manifest(self, run_id: str, step: int, blobs: Blobs, metadata: Mapping[str, str] | None = None,
                              *, timeout: datetime.timedelta | None = None) -> int:
        """Commits a checkpoint of `blobs` ({name: (digest, size_bytes)} or BlobRefs).

        Returns the committed step. Raises grpc.aio.AioRpcError with FAILED_PRECONDITION when
        a blob is missing or `step` is not after the run's latest step.
        """
        refs = (
            [BlobRef(name, d, size) for name, (d, size) in blobs.items()]
            if isinstance(blobs, Mapping)
            else list(blobs)
        )
        request = checkpoint_pb2.CommitManifestRequest(
            manifest=checkpoint_pb2.Manifest(
                run_id=run_id,
                step=step,
                # Fixed before the first attempt, so a retry sends the identical manifest.
                created_unix_s=time.time(),
                blobs=[checkpoint_pb2.BlobRef(**dataclasses.asdict(r)) for r in refs],
                metadata=dict(metadata or {}),
            )
        )
        seconds = (timeout or self._timeout).total_seconds()
        response = await self._call(
            "CommitManifest", lambda: self._stub.CommitManifest(request, timeout=seconds)
        )
        return response.step

    async def latest_manifest(
        self, run_id: str, *, timeout: datetime.timedelta | None = None
    ) -> Manifest | None:
        """The latest committed checkpoint of `run_id`, or None if it has none."""
        request = checkpoint_pb2.GetLatestManifestRequest(run_id=run_id)
        seconds = (timeout or self._timeout).total_seconds()
        response = await self._call(
            "GetLatestManifest", lambda: self._stub.GetLatestManifest(request, timeout=seconds)
        )
        return _manifest_from_proto(response.manifest) if response.found else None

    async def list_manifests(
        self, run_id: str, *, timeout: datetime.timedelta | None = None
    ) -> list[Manifest]:
        """The retained checkpoints of `run_id`, oldest first."""
        request = checkpoint_pb2.ListManifestsRequest(run_id=run_id)
        seconds = (timeout or self._timeout).total_seconds()
        response = await self._call(
            "ListManifests", lambda: self._stub.ListManifests(request, timeout=seconds)
        )
        return [_manifest_from_proto(m) for m in response.manifests]

    async def restore_manifest(
        self, manifest: Manifest, *, timeout: datetime.timedelta | None = None
    ) -> tuple[bool, bool]:
        """Stores `manifest` (read from a peer replica) verbatim, even below the run's latest step.

        Returns (restored, retained): restored is False when the store already held it, retained
        False when its retention policy dropped it at once. Raises grpc.aio.AioRpcError:
        FAILED_PRECONDITION (a blob is missing: copy blobs first), ALREADY_EXISTS (a different
        manifest is held at that step).
        """
        request = checkpoint_pb2.RestoreManifestRequest(manifest=_manifest_to_proto(manifest))
        seconds = (timeout or self._timeout).total_seconds()
        response = await self._call(
            "RestoreManifest", lambda: self._stub.RestoreManifest(request, timeout=seconds)
        )
        return response.restored, response.retained

    async def append_ledger(
        self, run_id: str, lines: Sequence[str], *, timeout: datetime.timedelta | None = None
    ) -> tuple[int, str]:
        """Appends hash-chained ledger lines (the store checks the chain); returns (length, head).
        Raises grpc.aio.AioRpcError with FAILED_PRECONDITION when the first new line does not chain
        to the store's head (or a referenced blob is missing)."""
        request = checkpoint_pb2.AppendLedgerRequest(run_id=run_id, lines=list(lines))
        seconds = (timeout or self._timeout).total_seconds()
        response = await self._call(
            "AppendLedger", lambda: self._stub.AppendLedger(request, timeout=seconds)
        )
        return response.length, response.head

    async def ledger_head(
        self, run_id: str, *, timeout: datetime.timedelta | None = None
    ) -> tuple[int, str]:
        """(length, head) of the run's ledger on this store."""
        request = checkpoint_pb2.GetLedgerHeadRequest(run_id=run_id)
        seconds = (timeout or self._timeout).total_seconds()
        response = await self._call(
            "GetLedgerHead", lambda: self._stub.GetLedgerHead(request, timeout=seconds)
        )
        return response.length, response.head

    async def read_ledger(
        self, run_id: str, from_index: int = 0, *, timeout: datetime.timedelta | None = None
    ) -> list[str]:
        """The run's ledger lines from `from_index` on, oldest first (the whole read under one
        deadline: `blob_timeout`, since a long ledger is many messages)."""
        seconds = (timeout or self._blob_timeout).total_seconds()

        async def attempt() -> list[str]:
            lines: list[str] = []
            call = self._stub.ReadLedger(
                checkpoint_pb2.ReadLedgerRequest(run_id=run_id, from_index=from_index), timeout=seconds
            )
            async for response in call:
                for record in response.records:
                    if record.index != from_index + len(lines):
                        raise BlobVerificationError(
                            f"ledger {run_id}: record {record.index} arrived, expected {from_index + len(lines)}"
                        )
                    lines.append(record.line)
            return lines

        return await self._call("ReadLedger", attempt)
