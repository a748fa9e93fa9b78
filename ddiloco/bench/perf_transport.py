"""The transport section of `ddiloco bench perf`: fragment uploads through a real syncer process
(``python -m services.syncer``: servicer, header checks, decode, norm bound, fold-in) against a bare
gRPC stream of bytes (`ddiloco.bench.perf_workers.bare`: no protobuf and no work), from the same
client process, with the same chunks and number of messages, one at a time and one per fragment in
flight; and the ceiling the syncer's own work per upload sets on any servicer. Before measuring,
each fragment gets the direction check's first contributions at once (they judge each other), as in
any run past its start: no measured upload waits for references.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib

import grpc
import numpy as np

from ddiloco.algo import fragments as fragments_lib
from ddiloco.bench import perf_common as common
from ddiloco.bench import perf_identity
from ddiloco.bench import perf_micro
from ddiloco.rpc import channel as channel_lib
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc

DEADLINE_S = 120.0


def start_bare(workdir: pathlib.Path, name: str):
    """The bare gRPC sink process (`ddiloco.bench.perf_workers.bare`), serving."""
    return common.start_server(workdir, name, "ddiloco.bench.perf_workers.bare", [common.ready_path(workdir, name)],
                               timeout_s=60)


async def _bare_uploads(address: str, payload_chunks: list[bytes], uploads: int, deadline_s: float,
                        in_flight: int = 1) -> tuple[float, int]:
    """Seconds and bytes for `uploads` streams of `payload_chunks` to the bare sink, at most
    `in_flight` at a time."""
    channel = channel_lib.aio_channel(address, None)
    try:
        call = channel.stream_unary("/bench.Bare/Upload", request_serializer=None, response_deserializer=None)
        await call(iter(payload_chunks[:1]), timeout=deadline_s)  # connect and warm up
        gate = asyncio.Semaphore(in_flight)

        async def one() -> None:
            async with gate:
                await call(iter(payload_chunks), timeout=deadline_s)

        started = common.now()
        await asyncio.gather(*(one() for _ in range(uploads)))
        return common.now() - started, uploads * sum(len(c) for c in payload_chunks)
    except grpc.RpcError as exc:
        raise RuntimeError(f"bare gRPC upload failed: {exc}") from None
    finally:
        await channel.close()


async def _servicer_uploads(address: str, payloads: dict[int, tuple], uploads: int, identities: int,
                            deadline_s: float, in_flight: int = 1) -> dict:
    """Uploads through the real syncer, at most `in_flight` at a time, cycling identities and
    fragments (upload n comes from identity n % identities, to fragment n % P, based on the
    version that identity last heard of). With `in_flight` up to P, uploads in flight are to
    different fragments, as one learner's are."""
    async with _joined(address, "transport", identities, deadline_s) as (stub, ids):
        fids = sorted(payloads)
        results = {"accepted": 0, "refused": 0, "codes": {}}
        latencies = []
        gate = asyncio.Semaphore(in_flight)

        async def one(n: int) -> int:
            """Upload n; returns its wire bytes (0 for the warm-up upload)."""
            ident = ids[n % len(ids)]
            fid = fids[n % len(fids)]
            info, chunks = payloads[fid]
            async with gate:
                msgs = ident.messages(fid, ident.versions.get(fid, 0), info, chunks, steps=8, tokens=8 * 2048)
                t0 = common.now()
                try:
                    resp = await stub.UploadFragment(iter(msgs), timeout=deadline_s)
                    ident.versions[fid] = max(ident.versions.get(fid, 0), resp.current_version)
                    results["accepted"] += n > 0
                except grpc.aio.AioRpcError as exc:
                    results["refused"] += n > 0
                    results["codes"][exc.code().name] = results["codes"].get(exc.code().name, 0) + 1
                    # Learn the current version for the next try.
                    await ident.join(deadline_s)
                if n > 0:
                    latencies.append(common.now() - t0)
            return sum(m.ByteSize() for m in msgs) if n > 0 else 0

        await one(0)  # warm-up upload (first-call costs), then the measured ones
        started = common.now()
        sent = sum(await asyncio.gather(*(one(n) for n in range(1, uploads + 1))))
        results["seconds"] = common.now() - started
        results["wire_bytes"] = sent
        results["latency_p50_s"] = common.percentile(latencies, 50)
        return results


async def _first_contributions(address: str, payloads: dict[int, tuple], identities: int, deadline_s: float) -> None:
    """The direction check's first contributions of each fragment, sent at once so that they judge
    each other (`ddiloco.algo.robust`), as in any run past its start. Sent one at a time, each of
    them waited the check's judge wait (8 s) for references, and the first measured run timed
    those waits (9 uploads: 64 s of the quick run's 70 s) instead of the servicer's work."""
    async with _joined(address, "transport-first", identities, deadline_s) as (stub, ids):
        await asyncio.gather(*(stub.UploadFragment(iter(ident.messages(fid, ident.versions.get(fid, 0), info, chunks,
                                                                       steps=8, tokens=8 * 2048)), timeout=deadline_s)
                               for ident in ids for fid, (info, chunks) in payloads.items()))


@contextlib.asynccontextmanager
async def _joined(address: str, prefix: str, identities: int, deadline_s: float):
    """A channel to the syncer at `address` and `identities` fresh learner identities joined
    through it (names `<prefix>-<random tag>-<i>`, new in every call); yields (stub, identities)
    and closes the channel."""
    channel = channel_lib.aio_channel(address, None)
    stub = syncer_pb2_grpc.SyncerStub(channel)
    try:
        tag = os.urandom(3).hex()
        ids = [perf_identity.Identity(stub, f"{prefix}-{tag}-{i}") for i in range(identities)]
        for ident in ids:
            await ident.join(deadline_s)
        yield stub, ids
    finally:
        await channel.close()


def _direction_judgments(address: str) -> dict[str, int]:
    """The syncer's count of contributions its direction check held ("waited") or let through
    without a comparison ("unjudged") so far."""
    channel = channel_lib.sync_channel(address)
    try:
        state = syncer_pb2_grpc.SyncerStub(channel).GetTrainingState(
            syncer_pb2.GetTrainingStateRequest(recent_merges=0), timeout=30).state
        return dict(state.direction_judgments)
    finally:
        channel.close()


def _rate(res: dict) -> float:
    return res["wire_bytes"] / res["seconds"] if res["seconds"] > 0 else 0.0


def _measure(syncer_address: str, bare_address: str, payloads: dict, payloads_fp32: dict, uploads: int,
             in_flight: int, repeats: int) -> dict:
    """Best rates of `repeats` rounds, each running every path once, interleaved (all see the same
    machine load): servicer int4 (one at a time, `in_flight` at a time), servicer fp32, bare."""
    best = {"real": 0.0, "bare": 0.0, "fp32": 0.0, "conc": 0.0, "bare_conc": 0.0, "real_run": {}, "conc_run": {}}
    # The bare stream carries the same chunks (largest fragment), as many messages.
    _info, chunks = payloads[max(payloads, key=lambda f: len(payloads[f][1]))]
    for _ in range(repeats):
        res = asyncio.run(_servicer_uploads(syncer_address, payloads, uploads, uploads + 1, DEADLINE_S))
        if _rate(res) > best["real"]:
            best["real"], best["real_run"] = _rate(res), res
        res = asyncio.run(_servicer_uploads(syncer_address, payloads, uploads, uploads + 1, DEADLINE_S,
                                            in_flight=in_flight))
        if _rate(res) > best["conc"]:
            best["conc"], best["conc_run"] = _rate(res), res
        # fp32 uploads: 7.5x the wire bytes for the same decode-and-fold work per value.
        res = asyncio.run(_servicer_uploads(syncer_address, payloads_fp32, max(2, uploads // 4), uploads + 1,
                                            DEADLINE_S))
        best["fp32"] = max(best["fp32"], _rate(res))
        seconds, sent = asyncio.run(_bare_uploads(bare_address, chunks, uploads, DEADLINE_S))
        best["bare"] = max(best["bare"], sent / seconds)
        seconds, sent = asyncio.run(_bare_uploads(bare_address, chunks, uploads, DEADLINE_S, in_flight))
        best["bare_conc"] = max(best["bare_conc"], sent / seconds)
    return best


def _ceiling(deltas: dict, payloads: dict, best: dict, repeats: int) -> dict:
    """The ceiling any servicer design has here: a bare stream that also does the syncer's own
    work on each upload (decode with norms and cosine, fold-in; measured now, in this process,
    on the largest fragment), serially or perfectly overlapped with the transfer."""
    largest = max(payloads, key=lambda f: deltas[f].size)
    upload_bytes = sum(len(c) for c in payloads[largest][1])
    bare_s = upload_bytes / best["bare"] if best["bare"] else 0.0
    work_s = perf_micro.upload_work_s(deltas[largest], repeats=3 if repeats == 1 else 7)
    return {"upload_bytes": upload_bytes, "bare_s_per_upload": bare_s, "work_s_per_upload": work_s,
            "servicer_s_per_upload": upload_bytes / best["real"] if best["real"] else 0.0,
            "ceiling_serial": bare_s / (bare_s + work_s) if bare_s + work_s > 0 else 0.0,
            "ceiling_overlapped": bare_s / max(bare_s, work_s) if max(bare_s, work_s) > 0 else 0.0}


def run_transport(workdir: pathlib.Path, model: dict, uploads: int, tag: str, repeats: int) -> dict:
    """Upload throughput through the real servicer vs a bare gRPC bytes stream."""
    from ddiloco import models  # JAX: after perf.run has set XLA_FLAGS

    specs = models.get_model("transformer", model).tensor_specs()
    plan = fragments_lib.plan_fragments(specs, 4, 8)
    rng = np.random.default_rng(0)
    deltas = {f.fragment_id: (rng.standard_normal(f.numel) * 1e-4).astype(np.float32) for f in plan.fragments}
    payloads = perf_identity.prepare_payloads(deltas, 512 * 1024)
    payloads_fp32 = perf_identity.prepare_payloads(deltas, 512 * 1024, "fp32")
    # As a syncer sees them: one learner has one upload per fragment in flight, and many learners
    # upload at once. The bare stream gets the same concurrency.
    in_flight = len(plan.fragments)
    # No merges while measuring: a quorum no round reaches (one contribution per identity and
    # fragment), so the figure is transport + checks + decode + norm bound + fold-in. The
    # merge itself is the merge section's figure (and the scale section runs it end to end).
    with common.running(start_bare(workdir, f"bare-{tag}")) as bare, \
            common.running_syncer(workdir, f"syncer-transport-{tag}", model,
                                  ["--min-quorum", "1000000", "--max-grace-s", "600",
                                   "--liveness-timeout-s", "600"]) as syncer:
        asyncio.run(_first_contributions(syncer.address, payloads, 3, DEADLINE_S))
        before = _direction_judgments(syncer.address)
        best = _measure(syncer.address, bare.address, payloads, payloads_fp32, uploads, in_flight, repeats)
        # Measured uploads the direction check held for references (waited) or let through
        # without a comparison (unjudged): none, once the first contributions judged each other.
        held = {k: v - before.get(k, 0) for k, v in _direction_judgments(syncer.address).items() if v > before.get(k, 0)}
        syncer_rss = common.vm_hwm_bytes(syncer.pid)
    ceiling = _ceiling(deltas, payloads, best, repeats)
    return {"model": model, "params": sum(f.numel for f in plan.fragments),
            "fragment_numels": [f.numel for f in plan.fragments],
            "uploads": uploads, "servicer_bytes_per_s": best["real"], "bare_bytes_per_s": best["bare"],
            "ratio": best["real"] / best["bare"] if best["bare"] else 0.0, "servicer_run": best["real_run"],
            "syncer_peak_rss_bytes": syncer_rss, "direction_holds_while_measuring": held,
            "servicer_fp32_bytes_per_s": best["fp32"], "ratio_fp32": best["fp32"] / best["bare"] if best["bare"] else 0.0,
            **ceiling,
            "in_flight": in_flight, "servicer_concurrent_bytes_per_s": best["conc"],
            "servicer_concurrent_run": best["conc_run"], "bare_concurrent_bytes_per_s": best["bare_conc"],
            "ratio_concurrent": best["conc"] / best["bare_conc"] if best["bare_conc"] else 0.0}
