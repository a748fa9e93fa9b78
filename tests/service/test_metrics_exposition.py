"""The syncer's /metrics by the conventions, scraped over HTTP from a real in-process syncer.

A syncer servicer with the shared MetricsInterceptor serves on 127.0.0.1:0 and its registry on a
real /metrics endpoint (127.0.0.1:0). A learner joins, downloads a fragment, reports progress and
uploads in fp32 while the run's configured codecs are int4; a stale upload is refused. The
exposition must then pass `promtool check metrics` without a single lint message
(scripts/promtool_env.sh provides promtool; none fails the test), counts must be counters, every
quantity a metric of its own with its unit, learner quantities named as the learners name them,
the codec label the codec each transfer used, and the gRPC metrics under go-grpc-prometheus's
names. Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ddiloco import metrics as metrics_lib
from ddiloco.algo import fragments as fragments_lib
from ddiloco.rpc import interceptors as rpc_interceptors
from ddiloco.rpc import security
from ddiloco.v1 import syncer_pb2
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde
from ddiloco.learner import client as client_lib
from services.syncer import config as config_lib
from services.syncer import core as core_lib
from services.syncer import metrics as syncer_metrics
from services.syncer import wire_views
from tests import promtool
from tests.fakes import make_core
from tests.service.conftest import serve_syncer
from tests.waits import wait_until_async

pytestmark = pytest.mark.timeout(180)

NUMEL = 64 * 1024
CHUNK_BYTES = 64 * 1024
SYNCER = "ddiloco.v1.Syncer"


def _core() -> core_lib.SyncerCore:
    # The run's codecs are int4 both ways; the learner below uploads fp32 and the first download
    # is a whole version (fp32): the codec label must tell the codec used, not the configured one.
    cfg = config_lib.SyncerConfig(num_fragments=1, sync_period_steps=1, upload_codec="int4", download_codec="int4",
                                  chunk_size_bytes=CHUNK_BYTES)
    return make_core(config=cfg, specs=[fragments_lib.TensorSpec("w", (256, 256))], grace_gamma=0.0, max_grace_s=0.0)


def _upload(core, *, instance: str | None = None) -> list:
    values = np.random.default_rng(1).standard_normal(NUMEL).astype(np.float32) * np.float32(1e-3)
    enc = codec_lib.encode(values, "fp32")
    header = syncer_pb2.UploadHeader(
        protocol_version=serde.PROTOCOL_VERSION, learner_id="learner-0", incarnation=1, fragment_id=0,
        base_version=0, syncer_instance=core.instance if instance is None else instance,
        steps=2, tokens=200, payload=serde.payload_info_to_proto(enc))
    return [syncer_pb2.UploadFragmentRequest(header=header)] + [
        syncer_pb2.UploadFragmentRequest(chunk=c) for c in serde.payload_chunks(enc.payload, CHUNK_BYTES)]


async def _download_first_version(stub) -> int:
    """Reads fragment 0's first version from the watch stream; returns the messages received."""
    call = stub.WatchFragments(syncer_pb2.WatchFragmentsRequest(
        protocol_version=serde.PROTOCOL_VERSION, learner_id="learner-0", incarnation=1), timeout=20)
    assembler, received = None, 0
    try:
        async for msg in call:
            received += 1
            kind = msg.WhichOneof("kind")
            if kind == "header":
                assert msg.header.payload.codec == serde.codec_to_proto("fp32")  # a whole version
                assembler = serde.ChunkAssembler(msg.header.payload.payload_size_bytes)
            elif kind == "chunk":
                assembler.add(msg.chunk)
                if assembler.done:
                    return received
    finally:
        call.cancel()
    raise AssertionError("the stream ended before the fragment arrived")


def _scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        return response.read().decode()


async def _exercise_syncer() -> tuple[str, int, int]:
    """Runs the activity above; returns the exposition and the message counts the server saw."""
    core = _core()
    registry = metrics_lib.new_registry("syncer")
    syncer_metrics.SyncerMetrics(core, registry)
    endpoint = metrics_lib.serve("127.0.0.1:0", registry)
    try:
        async with serve_syncer(core, interceptors=[rpc_interceptors.MetricsInterceptor(registry)]) as served:
            await served.stub.Join(syncer_pb2.JoinRequest(protocol_version=serde.PROTOCOL_VERSION,
                                                          learner_id="learner-0", incarnation=1, region="eu"),
                                   timeout=10)
            watched = await asyncio.wait_for(_download_first_version(served.stub), 30)
            await served.stub.ReportProgress(syncer_pb2.ReportProgressRequest(
                protocol_version=serde.PROTOCOL_VERSION, learner_id="learner-0", incarnation=1, local_step=5,
                tokens_total=640, step_time_s=0.25, inner_loss=2.5), timeout=10)
            good = _upload(core)
            response = await asyncio.wait_for(client_lib.send_upload(served.stub, good, 10.0), 15)
            assert response.result == syncer_pb2.UploadFragmentResponse.RESULT_ACCEPTED
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await asyncio.wait_for(
                    client_lib.send_upload(served.stub, _upload(core, instance="another-life"), 10.0), 15)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            await wait_until_async(lambda: wire_views.training_state(core, 0).outer_steps >= 1, timeout_s=30,
                                   what="the accepted upload's merge", interval_s=0.05)
            # Scrapes run on the endpoint's thread and read the core on this loop: never block it.
            return await asyncio.to_thread(_scrape, endpoint.address), watched, len(good)
    finally:
        endpoint.stop()


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(family, name: str | None = None, **labels) -> float:
    matches = [s.value for s in family.samples
               if (name is None or s.name == name) and labels.items() <= s.labels.items()]
    assert matches, f"{family.name}{labels} has no sample"
    return sum(matches)


def test_syncer_exposition_follows_the_conventions_and_passes_promtool():
    text, watched, uploaded = asyncio.run(_exercise_syncer())
    promtool.check_metrics(text, "the syncer's /metrics")
    families = _families(text)

    def counter(name: str):
        family = families.get(name)
        assert family is not None, f"{name} not exported"
        assert family.type == "counter", (name, family.type)
        assert all(s.name in (f"{name}_total", f"{name}_created") for s in family.samples), family.samples
        return family

    def gauge(name: str):
        family = families.get(name)
        assert family is not None, f"{name} not exported"
        assert family.type == "gauge", (name, family.type)
        return family

    # Monotonic counts are counters: merges since the run began, and each learner's steps and tokens.
    assert _value(counter("ddiloco_syncer_outer_steps"), "ddiloco_syncer_outer_steps_total") >= 1
    learner = {"learner": "learner-0", "region": "eu"}
    assert _value(counter("ddiloco_learner_inner_steps"), **learner) == 5
    assert _value(counter("ddiloco_learner_tokens"), **learner) == 640
    # The learner's loss under the name the learner itself exports it by (services/learner/metrics.py).
    assert _value(gauge("ddiloco_learner_inner_loss"), **learner) == 2.5
    for gone in ("ddiloco_learner_steps", "ddiloco_learner_loss", "ddiloco_syncer_grace"):
        assert gone not in families, gone
    # The grace window and each of its inputs: a metric each, in seconds.
    assert _value(gauge("ddiloco_syncer_smoothed_step_time_seconds")) == 0.25
    for name in ("ddiloco_syncer_current_grace_window_seconds", "ddiloco_syncer_smoothed_quorum_time_seconds",
                 "ddiloco_syncer_smoothed_sync_time_seconds"):
        assert _value(gauge(name)) >= 0
    assert _value(gauge("ddiloco_syncer_min_quorum")) == 1
    # The codec each transfer used: fp32 both ways here, although the run's codecs are int4.
    fragment_bytes = counter("ddiloco_syncer_fragment_wire_bytes")
    # (zstd frames of fp32: well above the ~NUMEL / 2 bytes of int4)
    assert _value(fragment_bytes, direction="in", codec="fp32") > NUMEL * 2
    assert _value(fragment_bytes, direction="out", codec="fp32") > NUMEL * 2
    assert not [s for s in fragment_bytes.samples if s.labels.get("codec") == "int4"], fragment_bytes.samples
    assert all("codec" not in s.labels for s in counter("ddiloco_wire_bytes").samples)
    # The gRPC server metrics by go-grpc-prometheus's names, labels and code spelling.
    join = {"grpc_type": "unary", "grpc_service": SYNCER, "grpc_method": "Join"}
    upload = {"grpc_type": "client_stream", "grpc_service": SYNCER, "grpc_method": "UploadFragment"}
    watch = {"grpc_type": "server_stream", "grpc_service": SYNCER, "grpc_method": "WatchFragments"}
    assert _value(counter("grpc_server_started"), **join) == 1
    assert _value(counter("grpc_server_handled"), grpc_code="OK", **join) == 1
    assert _value(counter("grpc_server_msg_received"), **join) == 1
    assert _value(counter("grpc_server_msg_sent"), **join) == 1
    assert _value(counter("grpc_server_started"), **upload) == 2
    assert _value(counter("grpc_server_handled"), grpc_code="OK", **upload) == 1
    assert _value(counter("grpc_server_handled"), grpc_code="FailedPrecondition", **upload) == 1
    assert _value(counter("grpc_server_msg_received"), **upload) >= uploaded + 1  # + the refused header
    assert _value(counter("grpc_server_msg_sent"), **upload) == 1
    assert _value(counter("grpc_server_msg_received"), **watch) == 1
    assert _value(counter("grpc_server_msg_sent"), **watch) >= watched
    handling = families["grpc_server_handling_seconds"]
    assert handling.type == "histogram"
    assert _value(handling, "grpc_server_handling_seconds_count", **join) == 1
    assert not [name for name in families if name.startswith("ddiloco_grpc")]
    # Refusals the security panel and the alerts watch exist at 0 before the first (rate() needs a series).
    for reason in security.AUTH_FAILURE_REASONS:
        assert _value(counter("ddiloco_syncer_auth_failures"), reason=reason) == 0
    for result in ("rejected_norm_bound", "rejected_direction", "rejected_replay_mismatch", "rejected_quarantined"):
        assert _value(counter("ddiloco_syncer_uploads"), result=result) == 0
    # Restarts show as a new process start time (the alerting rules' DdilocoSyncerRestarted).
    assert _value(gauge("process_start_time_seconds")) > 0
