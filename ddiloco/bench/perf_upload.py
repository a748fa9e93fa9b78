"""`ddiloco bench perf`'s upload section: the learner's real upload client through a real syncer
against a bare gRPC stream of the same bytes, with and without added round-trip time.

For each model size, one syncer process (``python -m services.syncer``, shipped defaults but a
quorum no round reaches, so no merge runs while uploads are measured) and one bare sink process
(a grpc.aio server that reads bytes and does nothing else). The client is this process:

* real: ``ddiloco.learner.client.send_upload``, the function the learner's SyncClient uploads
  with, on the messages it builds (``upload_messages``; payloads encoded by ``codec.encode`` with
  the run's codec, as the learner's default encoder does), with the pipeline window the syncer
  announced at Join (the header's acknowledgement overlaps the transfer);
* bare: the same messages, serialized, as a stream of bytes to the sink, on its own channel.

Uploads alternate real, bare, real, bare... (the same bytes each time, both seeing the same
machine load), one at a time; each side's figure is the median time per upload and the ratio is
bare / real. With RTT, both channels go through one ``ddiloco.chaos.proxy`` process adding half
the RTT per direction (a delay line: throughput is not limited by the delay). Before measuring,
each fragment gets the direction check's first contributions at once (they judge each other),
as in any run past its start.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import statistics
import time

import grpc
import numpy as np

from ddiloco.bench import perf_common as common
from ddiloco.bench import perf_transport
from ddiloco.bench import results as results_lib
from ddiloco.learner import client as client_lib
from ddiloco.rpc import channel as channel_lib
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde


class _Learner:
    """One learner identity of the measurement: joined over `channel`, uploading with the real client."""

    def __init__(self, stub, learner_id: str) -> None:
        self.stub = stub
        self.learner_id = learner_id
        self.incarnation = time.time_ns()
        self.join = None

    async def start(self, timeout_s: float) -> None:
        self.join = await self.stub.Join(syncer_pb2.JoinRequest(
            protocol_version=serde.PROTOCOL_VERSION, learner_id=self.learner_id, incarnation=self.incarnation,
            region="bench"), timeout=timeout_s)

    def messages(self, fid: int, encoded, chunk_size_bytes: int) -> list:
        versions = serde.versions_from_proto(self.join.fragment_versions)
        header = syncer_pb2.UploadHeader(
            protocol_version=serde.PROTOCOL_VERSION, learner_id=self.learner_id, incarnation=self.incarnation,
            fragment_id=fid, base_version=versions.get(fid, 0), syncer_instance=self.join.syncer_instance,
            steps=8, tokens=8 * 2048, payload=serde.payload_info_to_proto(encoded))
        return client_lib.upload_messages(header, encoded.payload, chunk_size_bytes)

    async def upload(self, messages: list, timeout_s: float):
        return await client_lib.send_upload(self.stub, messages, timeout_s,
                                            pipeline_bytes=self.join.upload_pipeline_bytes)


async def _measure(syncer_address: str, bare_address: str, encoded: dict, uploads: int, chunk_size_bytes: int,
                   timeout_s: float) -> dict:
    """`uploads` real uploads (cycling fragments, each from a fresh learner identity) alternating
    with bare streams of the same bytes; per-upload times of each."""
    syncer_channel = channel_lib.aio_channel(syncer_address, None)
    bare_channel = channel_lib.aio_channel(bare_address, None)
    stub = syncer_pb2_grpc.SyncerStub(syncer_channel)
    bare = bare_channel.stream_unary("/bench.Bare/Upload", request_serializer=None, response_deserializer=None)
    tag = os.urandom(3).hex()
    fids = sorted(encoded)
    out = {"real_s": [], "bare_s": [], "wire_bytes": [], "accepted": 0, "refused": {}, "slowed": 0}
    try:
        # The direction check's first contributions of each fragment judge each other: sent at once.
        firsts = [_Learner(stub, f"upload-{tag}-first-{i}") for i in range(3)]
        for learner in firsts:
            await learner.start(timeout_s)
        await asyncio.gather(*(learner.upload(learner.messages(fid, encoded[fid], chunk_size_bytes), timeout_s)
                               for learner in firsts for fid in fids))
        learners = [_Learner(stub, f"upload-{tag}-{n}") for n in range(-(-uploads // len(fids)))]
        for learner in learners:
            await learner.start(timeout_s)
        await bare(iter([b"warm-up"]), timeout=timeout_s)
        for n in range(uploads):
            fid = fids[n % len(fids)]
            messages = learners[n // len(fids)].messages(fid, encoded[fid], chunk_size_bytes)
            frames = [m.SerializeToString() for m in messages]
            t0 = common.now()
            try:
                response = await learners[n // len(fids)].upload(messages, timeout_s)
                out["accepted"] += 1
                out["slowed"] += response.next_upload_after_s > 0
            except grpc.aio.AioRpcError as exc:
                out["refused"][exc.code().name] = out["refused"].get(exc.code().name, 0) + 1
            t1 = common.now()
            await bare(iter(frames), timeout=timeout_s)
            out["real_s"].append(t1 - t0)
            out["bare_s"].append(common.now() - t1)
            out["wire_bytes"].append(sum(len(f) for f in frames))
    finally:
        await syncer_channel.close()
        await bare_channel.close()
    return out


def _cells(syncer, bare, workdir: pathlib.Path, label: str, rtts_s: list[float], uploads: int, run_config,
           encoded: dict) -> list[dict]:
    """One cell per RTT: the real client and the bare stream, through a proxy process when the RTT > 0."""
    cells = []
    for rtt_s in rtts_s:
        proxy = None
        syncer_address, bare_address = syncer.address, bare.address
        if rtt_s > 0:
            name = f"proxy-{label}-{rtt_s:g}"
            spec = {"upstreams": [syncer.address, bare.address], "latency_s": rtt_s / 2}
            proxy = common.start_server(workdir, name, "ddiloco.bench.perf_workers.proxies",
                                        [json.dumps(spec), common.ready_path(workdir, name)], timeout_s=60)
            syncer_address, bare_address = (f"127.0.0.1:{p}" for p in proxy.info["ports"])
        try:
            res = asyncio.run(_measure(syncer_address, bare_address, encoded, uploads,
                                       run_config.chunk_size_bytes, timeout_s=120.0))
        finally:
            if proxy is not None:
                proxy.stop()
        real, bare_s = statistics.median(res["real_s"]), statistics.median(res["bare_s"])
        wire = statistics.median(res["wire_bytes"])
        cells.append({"rtt_s": rtt_s, "uploads": uploads, "real_median_s": real, "bare_median_s": bare_s,
                      "real_bytes_per_s": wire / real, "bare_bytes_per_s": wire / bare_s,
                      "ratio": bare_s / real, "wire_bytes_median": wire, **res})
    return cells


def run_upload(workdir: pathlib.Path, model: dict, label: str, rtts_s: list[float], uploads: int) -> dict:
    """The upload section for one model: every RTT in `rtts_s`, one syncer and one sink for all."""
    with common.running(perf_transport.start_bare(workdir, f"bare-upload-{label}")) as bare, \
            common.running_syncer(workdir, f"syncer-upload-{label}", model,
                                  ["--min-quorum", "1000000", "--max-grace-s", "600",
                                   "--liveness-timeout-s", "600"]) as syncer:
        run_config, encoded = _payloads(syncer.address)
        cells = _cells(syncer, bare, workdir, label, rtts_s, uploads, run_config, encoded)
        rss = common.vm_hwm_bytes(syncer.pid)
    sample = encoded[max(encoded, key=lambda f: encoded[f].numel)]
    return {"label": label, "model": model, "params": sum(e.numel for e in encoded.values()),
            "fragment_numels": [encoded[f].numel for f in sorted(encoded)], "codec": sample.codec,
            "compression": sample.compression, "checksum_kind": sample.checksum_kind,
            "chunk_size_bytes": run_config.chunk_size_bytes, "cells": cells, "syncer_peak_rss_bytes": rss}


def _payloads(address: str) -> tuple:
    """The run's configuration (as a learner gets it at Join) and one encoded pseudo-gradient per
    fragment in its upload codec, block size and zstd level, as the learner's encoder makes them."""
    channel = channel_lib.sync_channel(address)
    try:
        join = syncer_pb2_grpc.SyncerStub(channel).Join(syncer_pb2.JoinRequest(
            protocol_version=serde.PROTOCOL_VERSION, learner_id=f"upload-probe-{os.urandom(3).hex()}",
            incarnation=time.time_ns(), region="bench"), timeout=30)
    finally:
        channel.close()
    cfg = join.config
    rng = np.random.default_rng(0)
    codec = serde.codec_from_proto(cfg.upload_codec)
    encoded = {info.fragment_id: codec_lib.encode((rng.standard_normal(info.numel) * 1e-4).astype(np.float32), codec,
                                                  block_size=cfg.upload_block_size, zstd_level=cfg.zstd_level)
               for info in cfg.fragments}
    return cfg, encoded


def markdown(sections: list[dict], target: float) -> list[str]:
    """The section's tables for perf.md."""
    md = ["", "## Upload: the learner's real client through the syncer vs a bare gRPC stream", "",
          "Median time per upload, one at a time, alternating with a bare stream of the same bytes between the "
          "same processes (ratio = bare / real: the real client's share of the bare stream's throughput); "
          "RTT added by a `ddiloco.chaos.proxy` process on both paths. See `ddiloco/bench/perf_upload.py`.", ""]
    rows = []
    for sec in sections:
        for c in sec["cells"]:
            rows.append([f"{sec['params']:,} ({sec['label']}; fragment {max(sec['fragment_numels']):,} values)",
                         f"{c['rtt_s'] * 1e3:.0f} ms", f"{c['wire_bytes_median'] / 1e6:.2f}",
                         f"{c['real_median_s'] * 1e3:.2f}", f"{c['bare_median_s'] * 1e3:.2f}",
                         f"{c['ratio']:.1%}", "yes" if c["ratio"] >= target else "NO",
                         f"{c['accepted']}/{c['uploads']}" + (f" {c['refused']}" if c["refused"] else "")])
    md.append(results_lib.markdown_table(
        ["params", "added RTT", "MB on the wire", "real ms", "bare ms", "ratio", f">= {target:.0%}", "accepted"], rows))
    for sec in sections:
        md.append(f"\n{sec['label']}: {sec['codec']} payloads sent with compression '{sec['compression']}' and a "
                  f"{sec['checksum_kind']} checksum, chunks of {sec['chunk_size_bytes'] // 1024} KiB; syncer peak RSS "
                  f"{sec['syncer_peak_rss_bytes'] / 2**20:.0f} MiB.")
    return md
