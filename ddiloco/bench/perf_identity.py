"""Lightweight learner identities for `ddiloco bench perf`: joined, watching versions, reporting
progress and uploading prepared payloads straight over the syncer's protocol (no training, no
SyncClient), so that one process can drive many. The transport section's uploads and the scale
section's replay workers (`ddiloco.bench.perf_workers.replay`) are made of these.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import numpy as np

from ddiloco.v1 import common_pb2, syncer_pb2
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde


class Identity:
    """One lightweight learner: joined, watching versions, uploading prepared payloads."""

    def __init__(self, stub, learner_id: str, instance: str = "") -> None:
        self.stub = stub
        self.learner_id = learner_id
        self.incarnation = time.time_ns()
        self.instance = instance
        self.versions: dict[int, int] = {}
        self.sent_base: dict[int, int] = {}
        self.pipeline_bytes = 0
        # Fragment shards: the shard map of the Join answer (JoinResponse.shards; empty: unsharded)
        # and the index of the shard this identity is joined to.
        self.shards: list = []
        self.shard_index = 0

    async def join(self, timeout_s: float) -> None:
        resp = await self.stub.Join(syncer_pb2.JoinRequest(
            protocol_version=serde.PROTOCOL_VERSION, learner_id=self.learner_id, incarnation=self.incarnation,
            region="bench"), timeout=timeout_s)
        self.instance = resp.syncer_instance
        self.versions = serde.versions_from_proto(resp.fragment_versions)
        self.pipeline_bytes = resp.upload_pipeline_bytes
        self.shards = list(resp.shards)
        self.shard_index = resp.shard_index

    async def watch(self, stop: asyncio.Event, stream_s: float) -> None:
        """Reads the fragment stream (payloads discarded): keeps `versions` current."""
        while not stop.is_set():
            call = self.stub.WatchFragments(syncer_pb2.WatchFragmentsRequest(
                protocol_version=serde.PROTOCOL_VERSION, learner_id=self.learner_id, incarnation=self.incarnation,
                syncer_instance=self.instance, held=serde.versions_to_proto(self.versions)), timeout=stream_s)
            try:
                async for msg in call:
                    if msg.WhichOneof("kind") == "header":
                        self.versions[msg.header.fragment_id] = msg.header.version
                    if stop.is_set():
                        call.cancel()
                        return
            except Exception:  # noqa: BLE001 - deadline or shutdown: re-open unless stopping
                if stop.is_set():
                    return
                await asyncio.sleep(0.1)

    async def report_progress(self, stop: asyncio.Event, interval_s: float, steps: Callable[[], int],
                              timeout_s: float, step_time_s: float | None = None,
                              finished: Callable[[], bool] | None = None) -> None:
        """Reports progress every `interval_s`, as a real learner's SyncClient does, with its step
        time (`step_time_s`, default `interval_s`: one report per step); the syncer's grace window
        is computed from it, and without it every upload is merged alone. `finished()` true: the
        learner has ended its steps (ReportProgressRequest.finished) and keeps reporting while it
        waits for its last work to merge, as a real learner's finish does."""
        while not stop.is_set():
            try:
                await self.stub.ReportProgress(syncer_pb2.ReportProgressRequest(
                    protocol_version=serde.PROTOCOL_VERSION, learner_id=self.learner_id, incarnation=self.incarnation,
                    local_step=steps(), step_time_s=interval_s if step_time_s is None else step_time_s,
                    held=serde.versions_to_proto(self.versions),
                    finished=finished is not None and finished()), timeout=timeout_s)
            except grpc.aio.AioRpcError:  # transient, like the learner's: the next tick sends again
                pass
            await asyncio.sleep(interval_s)

    def messages(self, fid: int, base: int, info, chunks: list[bytes], steps: int, tokens: int, final: bool = False):
        header = syncer_pb2.UploadHeader(
            protocol_version=serde.PROTOCOL_VERSION, learner_id=self.learner_id, incarnation=self.incarnation,
            fragment_id=fid, base_version=base, syncer_instance=self.instance, steps=steps, tokens=tokens,
            payload=info, final=final)
        msgs = [syncer_pb2.UploadFragmentRequest(header=header)]
        msgs += [syncer_pb2.UploadFragmentRequest(chunk=common_pb2.PayloadChunk(seq=i, data=c, last=i == len(chunks) - 1))
                 for i, c in enumerate(chunks)]
        return msgs


def prepare_payloads(deltas: dict[int, np.ndarray], chunk_size: int, codec: str = "int4") -> dict[int, tuple]:
    """Each fragment's delta encoded as a learner encodes it: (PayloadInfo, chunks) by fragment id."""
    out = {}
    for fid, delta in deltas.items():
        enc = codec_lib.encode(np.ascontiguousarray(delta, np.float32), codec)
        out[fid] = (serde.payload_info_to_proto(enc), codec_lib.chunk_payload(enc.payload, chunk_size))
    return out
