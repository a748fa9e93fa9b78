"""The evaluator with a syncer split into fragment shards (issue 21): two fake shards on
127.0.0.1:0, each streaming only the fragments it owns, as a shard does. The evaluator follows the
shard map of the first one's training state, holds every fragment, and reports each evaluation
to both shards with the tokens merged over both; with one shard down the other still gets it.

Before, the evaluator watched only the syncer it was given: it never held fragments 1 and 3 and
waited for the whole model until its timeout.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np

from ddiloco.rpc import security as security_lib
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde
from services.learner import config as config_lib
from services.learner import evaluator as evaluator_lib
from services.learner import leader_link

_WAIT_S = 20.0


class _FakeShard(syncer_pb2_grpc.SyncerServicer):
    def __init__(self, index: int) -> None:
        self.index = index
        self.owned = [f for f in range(4) if f % 2 == index]
        self.shards: list[syncer_pb2.SyncerShard] = []
        self.address = ""
        self.reports: list[syncer_pb2.ReportEvalRequest] = []

    async def GetTrainingState(self, request, context):  # noqa: N802 (gRPC naming)
        return syncer_pb2.GetTrainingStateResponse(state=syncer_pb2.TrainingState(
            epoch=1, tokens_merged=100 * (self.index + 1), shards=self.shards, shard_index=self.index))

    async def ReportEval(self, request, context):  # noqa: N802
        self.reports.append(request)
        return syncer_pb2.ReportEvalResponse()

    async def WatchFragments(self, request, context):  # noqa: N802
        for fid in self.owned:
            encoded = codec_lib.encode(np.full(4, float(fid), np.float32), "fp32")
            yield syncer_pb2.WatchFragmentsResponse(header=syncer_pb2.GlobalFragmentHeader(
                fragment_id=fid, version=10 + fid, syncer_instance=self.address,
                payload=serde.payload_info_to_proto(encoded), epoch=1))
            for chunk in serde.payload_chunks(encoded.payload, 1 << 16):
                yield syncer_pb2.WatchFragmentsResponse(chunk=chunk)
        await asyncio.sleep(3600)


async def _serve(fake: _FakeShard) -> grpc.aio.Server:
    server = grpc.aio.server()
    syncer_pb2_grpc.add_SyncerServicer_to_server(fake, server)
    fake.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    return server


async def _shards() -> None:
    fakes = [_FakeShard(0), _FakeShard(1)]
    servers = [await _serve(f) for f in fakes]
    shard_map = [syncer_pb2.SyncerShard(index=f.index, addresses=[f.address], fragment_ids=f.owned) for f in fakes]
    for f in fakes:
        f.shards = shard_map
    cfg = config_lib.EvaluatorConfig(syncer=fakes[0].address, insecure=True, timeout_s=3.0, call_timeout_s=1.0)
    link = leader_link.LeaderLink(cfg.syncer, security_lib.ClientSecurity(insecure=True),
                                  call_timeout_s=cfg.call_timeout_s, retry_pause_s=0.05)
    stop = asyncio.Event()
    links: list[leader_link.LeaderLink] = [link]
    tasks = []
    try:
        state = await evaluator_lib.fetch_state(link, time.monotonic() + _WAIT_S)
        links, watchers = evaluator_lib.shard_watchers(cfg, link, state, num_fragments=4)
        assert len(links) == 2 and links[0] is link
        tasks = [asyncio.create_task(w.keep_watching(stop, pause_s=0.05)) for w in watchers]
        await asyncio.wait_for(asyncio.gather(*(w.complete.wait() for w in watchers)), _WAIT_S)
        versions = {f: v for w in watchers for f, v in w.versions.items()}
        assert versions == {0: 10, 1: 11, 2: 12, 3: 13}
        assert watchers[1].values[3].tolist() == [3.0] * 4  # fragment 3 came from shard 1

        result = await evaluator_lib.report_to_shards(links, cfg, versions, 2.5, heldout_tokens=64)
        assert result["tokens_merged"] == 300 and result["shards_reported"] == 2
        for f in fakes:
            (r,) = f.reports
            assert r.tokens_merged == 300 and serde.versions_from_proto(r.evaluated) == versions

        await servers[1].stop(None)  # shard 1 down: shard 0 still gets the evaluation
        result = await evaluator_lib.report_to_shards(links, cfg, versions, 2.25, heldout_tokens=64)
        assert result["shards_reported"] == 1 and result["tokens_merged"] == 100
        assert [r.heldout_loss for r in fakes[0].reports] == [2.5, 2.25] and len(fakes[1].reports) == 1
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        for own in links:
            await own.close()
        for server in servers:
            await server.stop(None)


def test_the_evaluator_watches_every_shard_and_reports_to_each():
    asyncio.run(asyncio.wait_for(_shards(), 90.0))


def test_an_unsharded_syncer_is_one_link_and_one_watcher():
    cfg = config_lib.EvaluatorConfig(syncer="127.0.0.1:1", insecure=True)
    link = leader_link.LeaderLink(cfg.syncer, security_lib.ClientSecurity(insecure=True), call_timeout_s=1.0)
    links, watchers = evaluator_lib.shard_watchers(cfg, link, syncer_pb2.TrainingState(), num_fragments=4)
    assert links == [link] and len(watchers) == 1
