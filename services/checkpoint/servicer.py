"""gRPC face of the checkpoint store: decode requests, call `BlobStore`, encode responses.

Holds no state beyond the store. Blocking filesystem work runs in worker threads
(`asyncio.to_thread`) so one slow disk write never stalls the event loop. Domain errors from
the store become status codes through `ServiceError.code`; `_manifest_to_proto` and
`_manifest_from_proto` are the only conversions between wire and store manifests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, NoReturn, TypeVar

import grpc

from ddiloco.rpc import errors
from ddiloco.v1 import checkpoint_pb2, checkpoint_pb2_grpc
from . import ledger as ledger_lib
from . import store as store_lib

_LOG = logging.getLogger(__name__)
_P = "[CheckpointStore.{}]"
T = TypeVar("T")


def _manifest_from_proto(m: checkpoint_pb2.Manifest) -> dict[str, Any]:
    return {
        "run_id": m.run_id,
        "step": m.step,
        "created_unix_s": m.created_unix_s,
        "blobs": [
            {"name": b.name, "digest": b.digest, "size_bytes": b.size_bytes} for b in m.blobs
        ],
        "metadata": dict(m.metadata),
    }


def _manifest_to_proto(d: Mapping[str, Any]) -> checkpoint_pb2.Manifest:
    return checkpoint_pb2.Manifest(
        run_id=d["run_id"],
        step=d["step"],
        created_unix_s=d["created_unix_s"],
        blobs=[checkpoint_pb2.BlobRef(**b) for b in d["blobs"]],
        metadata=d["metadata"],
    )


async def _abort(
    context: grpc.aio.ServicerContext, rpc: str, exc: errors.ServiceError
) -> NoReturn:
    _LOG.warning("%s %s: %s", _P.format(rpc), exc.code.name, exc)
    await context.abort(exc.code, str(exc))
    raise AssertionError("unreachable: context.abort raises")


async def _in_thread(context: grpc.aio.ServicerContext, rpc: str, call: Callable[..., T], *args: Any) -> T:
    """`call(*args)` in a worker thread; a ServiceError it raises aborts `rpc` with its code."""
    try:
        return await asyncio.to_thread(call, *args)
    except errors.ServiceError as exc:
        await _abort(context, rpc, exc)


class CheckpointStoreServicer(checkpoint_pb2_grpc.CheckpointStoreServicer):
    """Serves one `BlobStore` and its merge ledgers (`ledger`: by default the ones under the
    store's root, keeping the blobs of the last `ledger_retain_merges` records per (run, fragment));
    `chunk_size_bytes` sizes the GetBlob data messages."""

    def __init__(self, store: store_lib.BlobStore, *, chunk_size_bytes: int,
                 ledger: ledger_lib.LedgerStore | None = None,
                 ledger_retain_merges: int = ledger_lib.DEFAULT_RETAIN_MERGES) -> None:
        self._store = store
        self._chunk_size_bytes = chunk_size_bytes
        self._ledger = ledger or ledger_lib.LedgerStore(store.root, store.stat, retain_merges=ledger_retain_merges)
        store.extra_references = self._ledger.referenced_blobs  # retained contributions outlive GC

    async def PutBlob(self, request_iterator, context):
        writer: store_lib.BlobWriter | None = None
        try:
            next_seq = 0
            async for request in request_iterator:
                kind = request.WhichOneof("kind")
                if writer is None:
                    if kind != "header":
                        raise errors.InvalidArgument("the first PutBlob message must be the header")
                    writer = await asyncio.to_thread(
                        self._store.begin_blob, request.header.digest, request.header.size_bytes
                    )
                elif kind != "chunk":
                    raise errors.InvalidArgument(f"expected a chunk, got {kind or 'nothing'}")
                elif request.chunk.seq != next_seq:
                    raise errors.InvalidArgument(
                        f"chunk seq {request.chunk.seq} arrived, expected {next_seq}"
                    )
                else:
                    next_seq += 1
                    # The writer refuses bytes past the declared size, so at most one chunk
                    # beyond it is ever held in memory.
                    await asyncio.to_thread(writer.write, request.chunk.data)
            if writer is None:
                raise errors.InvalidArgument("PutBlob stream ended before the header")
            existed = await asyncio.to_thread(writer.commit)
        except errors.ServiceError as exc:
            if writer is not None:  # before the status goes out: a failed put leaves nothing
                await asyncio.to_thread(writer.abort)
            await _abort(context, "PutBlob", exc)
        finally:
            # Client cancellation ends here too; a no-op after commit or abort.
            if writer is not None:
                await asyncio.to_thread(writer.abort)
        _LOG.info(
            "%s %s digest=%s size_bytes=%d",
            _P.format("PutBlob"), "exists" if existed else "stored", writer.digest,
            writer.size_bytes,
        )
        return checkpoint_pb2.PutBlobResponse(
            digest=writer.digest, size_bytes=writer.size_bytes, already_existed=existed
        )

    async def GetBlob(
        self, request, context
    ) -> AsyncIterator[checkpoint_pb2.GetBlobResponse]:
        reader = await _in_thread(context, "GetBlob", self._store.open_blob, request.digest)
        try:
            yield checkpoint_pb2.GetBlobResponse(
                header=checkpoint_pb2.BlobHeader(digest=reader.digest, size_bytes=reader.size_bytes)
            )
            seq = 0
            while data := await asyncio.to_thread(reader.read, self._chunk_size_bytes):
                yield checkpoint_pb2.GetBlobResponse(
                    chunk=checkpoint_pb2.BlobChunk(seq=seq, data=data)
                )
                seq += 1
        except errors.ServiceError as exc:
            await _abort(context, "GetBlob", exc)
        finally:
            await asyncio.to_thread(reader.close)

    async def StatBlobs(self, request, context):
        present = await _in_thread(context, "StatBlobs", self._store.stat, request.digests)
        return checkpoint_pb2.StatBlobsResponse(
            present=[d for d in request.digests if d in present]
        )

    async def CommitManifest(self, request, context):
        step, pruned = await _in_thread(
            context, "CommitManifest", self._store.commit_manifest, _manifest_from_proto(request.manifest)
        )
        _LOG.info(
            "%s run=%s step=%d blobs=%d pruned=%d",
            _P.format("CommitManifest"), request.manifest.run_id, step,
            len(request.manifest.blobs), pruned,
        )
        return checkpoint_pb2.CommitManifestResponse(step=step, pruned=pruned)

    async def GetLatestManifest(self, request, context):
        latest = await _in_thread(context, "GetLatestManifest", self._store.latest_manifest, request.run_id)
        if latest is None:
            return checkpoint_pb2.GetLatestManifestResponse(found=False)
        return checkpoint_pb2.GetLatestManifestResponse(
            found=True, manifest=_manifest_to_proto(latest)
        )

    async def ListManifests(self, request, context):
        manifests = await _in_thread(context, "ListManifests", self._store.list_manifests, request.run_id)
        return checkpoint_pb2.ListManifestsResponse(
            manifests=[_manifest_to_proto(m) for m in manifests]
        )

    async def RestoreManifest(self, request, context):
        restored, retained = await _in_thread(
            context, "RestoreManifest", self._store.restore_manifest, _manifest_from_proto(request.manifest)
        )
        _LOG.info(
            "%s run=%s step=%d restored=%s retained=%s",
            _P.format("RestoreManifest"), request.manifest.run_id, request.manifest.step,
            restored, retained,
        )
        return checkpoint_pb2.RestoreManifestResponse(restored=restored, retained=retained)

    async def AppendLedger(self, request, context):
        length, head, appended = await _in_thread(
            context, "AppendLedger", self._ledger.append, request.run_id, list(request.lines)
        )
        _LOG.debug("%s run=%s appended=%d length=%d", _P.format("AppendLedger"), request.run_id, appended, length)
        return checkpoint_pb2.AppendLedgerResponse(length=length, head=head, appended=appended)

    async def ReadLedger(self, request, context) -> AsyncIterator[checkpoint_pb2.ReadLedgerResponse]:
        index = request.from_index
        while True:
            page = await _in_thread(context, "ReadLedger", self._ledger.read, request.run_id, index)
            if not page:
                return
            yield checkpoint_pb2.ReadLedgerResponse(
                records=[checkpoint_pb2.LedgerRecord(index=i, line=line) for i, line in page]
            )
            index = page[-1][0] + 1

    async def GetLedgerHead(self, request, context):
        length, head = await _in_thread(context, "GetLedgerHead", self._ledger.head, request.run_id)
        return checkpoint_pb2.GetLedgerHeadResponse(length=length, head=head)
